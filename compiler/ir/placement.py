"""L2's result: consumers on the (replica, slot) grid, sharing windows, and one producer per (window, replica).

Produced by `place_windows`; read by the pipeline, which lowers it into the
plan. Invariants are those `verify_placement` checks
(`harts.compiler.placement.verify`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class L2Placement:
    """L2's result: K consumers on the D x J grid, W windows, one producer per (window, replica).

    Producers are indexed `w * D + d`. A producer computes the union of the
    prefixes `producer_lengths[p][i]` of the trajectories at sorted positions
    `producer_positions[p][i]`; the entries are in sorted order and none is a
    prefix of a later one, so they form a valid `build_layout` input once
    truncated.
    """

    members: tuple[np.ndarray, ...]        # per consumer: sorted positions (int64, ascending)
    cached_prefix: tuple[np.ndarray, ...]  # per consumer, aligned with members: positions served by the producer
    replica: np.ndarray                    # int32[K] in [0, D)
    slot: np.ndarray                       # int32[K] in [0, J); (replica, slot) pairs are unique
    window_start: np.ndarray               # int64[W + 1]: window w covers slots [window_start[w], window_start[w+1])
    producer_positions: tuple[np.ndarray, ...]  # per producer w * D + d: sorted positions (int64)
    producer_lengths: tuple[np.ndarray, ...]    # per producer: computed prefix length of each position
    depth_cap: np.ndarray                  # int64[W * D]: sharing depth limit of each producer, -1 if none
    work: np.ndarray                       # int64[K]: complete compact layout C(M) of each consumer
    residual_tokens: np.ndarray            # int64[K]: rows the consumer runs through the decoder
    producer_tokens: np.ndarray            # int64[W * D]: rows each producer computes
    residual_cost: np.ndarray              # int64[K]: forward + backward cost of each consumer's rows (L2's units)
    producer_cost: np.ndarray              # int64[W * D]: forward + backward cost of each producer
    key: tuple                             # (Phi, tokens, imbalance, max replica total) of the final plan
    candidate: str                         # which candidate won, e.g. "ranked W=1 units<=1.0T"
    decisions: tuple[str, ...] = field(default=())

    @property
    def num_windows(self) -> int:
        return len(self.window_start) - 1

    @property
    def window(self) -> np.ndarray:
        """int32[K]: the window of each consumer."""
        return (np.searchsorted(self.window_start, self.slot, side="right") - 1).astype(np.int32)

    @property
    def decoder_tokens(self) -> int:
        return int(self.residual_tokens.sum() + self.producer_tokens.sum())
