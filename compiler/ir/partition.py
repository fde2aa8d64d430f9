"""L1's result: the step's trajectories partitioned into consumer microbatches on the (replica, slot) grid.

Produced by `partition_microbatches` (or the comparison planner
`partition_ffd`); read by `place_windows` and the pipeline. Invariants are
those `verify_partition` checks (`harts.compiler.passes.partition_microbatches`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class L1Partition:
    """L1's result: K microbatches on a D x K/D (replica, slot) grid."""

    members: tuple[np.ndarray, ...]  # per microbatch, sorted positions (int64, ascending)
    work: np.ndarray                 # int64[K], C(M) of each microbatch
    replica: np.ndarray              # int32[K], in [0, dp)
    slot: np.ndarray                 # int32[K], in [0, K/dp); (replica, slot) pairs are unique
    candidate: str                   # which candidate won, e.g. "contiguous-exact k=16"
    j_init: tuple[int, int, int]     # (total work, sum over slots of max work, max replica total)
    decisions: tuple[str, ...] = field(default=())  # one line per decision, for `-v` logs

    @property
    def num_microbatches(self) -> int:
        return len(self.members)
