"""A capacity-feasible L1 membership before grid placement, and the work C(M) of each microbatch.

Contiguous and greedy candidates both end here; `partition_microbatches`
places each on the grid and keeps the one with the least J_init.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.compiler.prefix_cost import PrefixCostModel


@dataclass(frozen=True, slots=True)
class Candidate:
    """A capacity-feasible membership before assignment: microbatch id per position."""

    name: str
    microbatch_of: np.ndarray  # int64[N], ids 0..K-1
    work: np.ndarray           # int64[K]


def starts_to_candidate(model: PrefixCostModel, name: str, starts: np.ndarray) -> Candidate:
    n = model.num_trajectories
    microbatch_of = np.zeros(n, dtype=np.int64)
    microbatch_of[starts[1:]] = 1
    np.cumsum(microbatch_of, out=microbatch_of)
    ends = np.append(starts[1:] - 1, n - 1)
    return Candidate(name, microbatch_of, model.contiguous_cost(starts, ends))


def work_of(model: PrefixCostModel, microbatch_of: np.ndarray, count: int) -> np.ndarray:
    """int64[count]: C(M) of every microbatch, from consecutive members in sorted order."""
    by_microbatch = np.argsort(microbatch_of, kind="stable")
    owner = microbatch_of[by_microbatch]
    same = owner[1:] == owner[:-1]
    shared = np.where(same, model.neighbour_lcp(np.where(same, by_microbatch[:-1], -1), by_microbatch[1:]), 0)
    work = np.bincount(microbatch_of, weights=model.lengths, minlength=count).astype(np.int64)
    work -= np.bincount(owner[1:], weights=shared, minlength=count).astype(np.int64)
    return work
