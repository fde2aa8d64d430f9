"""The plan's run encoding: a list of positions stored as runs of consecutive integers.

A member's position -> row map, replay intervals and sequence outputs are
runs `[start, start + length)`; `expand_runs` decodes them. It lives here
because both the compiler (which writes runs) and the executor (which reads
them) need it, and `schema/` is the only thing they share.
"""
from __future__ import annotations

import numpy as np


def expand_runs(starts, lengths) -> np.ndarray:
    """Concatenate `arange(s, s + n)` over the runs, without a per-run Python loop (int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    keep = lengths > 0
    starts, lengths = np.asarray(starts, dtype=np.int64)[keep], lengths[keep]
    # Each element is its run's start plus its offset inside the run: a cumsum of
    # ones with a jump at every run's first element.
    step = np.ones(total, dtype=np.int64)
    first = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=first[1:])
    step[first] = starts - np.concatenate(([0], starts[:-1] + lengths[:-1] - 1))
    return np.cumsum(step)
