"""Fixtures shared by test modules (pytest finds this file by name)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead, and on a busy shared CPU they spin (10x slower).
    Op test modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
