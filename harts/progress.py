"""Progress bars for long compiles and runs: shown on a terminal, silent in pipes and CI."""
from __future__ import annotations

import os
import sys


def wants_progress() -> bool:
    return sys.stderr.isatty() and not os.environ.get("CI") and os.environ.get("HARTS_PROGRESS", "1") != "0"


def terminal_progress(items, description: str):
    """Wrap `items` in a tqdm bar on stderr when it is a terminal; otherwise return them unchanged."""
    if not wants_progress():
        return items
    try:
        from tqdm import tqdm
    except ImportError:   # tqdm comes with transformers; without it, no bar
        return items
    return tqdm(items, desc=description, unit="mb", leave=False, file=sys.stderr)


def quiet_library_progress() -> None:
    """Silence transformers' and huggingface_hub's own bars where ours are silent (pipes, CI)."""
    if wants_progress():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
