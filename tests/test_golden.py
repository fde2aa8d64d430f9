"""Golden tests: every pass's IR printed for tiny inputs, compared with tests/golden/*.txt.

Run: `python -m pytest tests/test_golden.py -q`. After an intended change,
refresh with `HARTS_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py`
and read the diff before committing: the files are the reviewed expectation.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from harts.compiler.ir.printer import format_compile_result
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.compiler.read_trees import read_trees

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    # name: (input, options)
    "forks-b4": ("forks.jsonl", CompileOptions(chunk_size=4, capacity=64, levels="l1", verify=True)),
    "forks-b2-dp2": ("forks.jsonl", CompileOptions(chunk_size=2, capacity=24, dp=2, levels="l1", verify=True)),
    "stepwise-b3": ("stepwise.jsonl", CompileOptions(chunk_size=3, capacity=32, levels="l1", verify=True)),
    # Windows: three consumers share the 10-token stem through one producer; residual calls
    # start from its exported anchors.
    "forks-b4-windows": ("forks.jsonl", CompileOptions(chunk_size=4, capacity=12, levels="l1+l2", verify=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pass_output_matches_golden(name):
    source, options = CASES[name]
    batch = read_trees(GOLDEN / source)
    text = format_compile_result(compile_batch(batch, options), batch)
    expected = GOLDEN / f"{name}.txt"
    if os.environ.get("HARTS_UPDATE_GOLDEN") == "1":
        expected.write_text(text)
    assert expected.exists(), f"no golden file {expected.name}; create it with HARTS_UPDATE_GOLDEN=1"
    assert text == expected.read_text()
