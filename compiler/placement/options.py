"""L2's options: the cost weights of Appendix A.2 and the search's bounds.

`hartsc --pairs-per-token` and `harts.api` build these through
`L2Options.for_pairs_per_token`; `harts.schema.cost_model` holds the same
weights for `harts stats`.
"""
from __future__ import annotations

from dataclasses import dataclass

from harts.schema.cost_model import row_cost_weights


@dataclass(frozen=True, slots=True)
class L2Options:
    """Cost weights and search bounds of L2 (the cost model: `place_windows`' module docstring)."""

    # Weights of Equation A.2 in units of one causal attention pair.
    token_cost_forward: int = 65536     # alpha_F: linear-layer work of one computed row
    pair_cost_forward: int = 1          # beta_F: one query-key pair forward
    token_cost_backward: int = 131072   # alpha_B: backward is about twice forward
    pair_cost_backward: int = 2         # beta_B
    # Window counts tried (each capped at J); windows have near-equal lengths.
    window_counts: tuple[int, ...] = (1, 2, 4)
    # Longest window in slots (0: no limit); raises the smallest window count tried.
    max_window_slots: int = 0
    # Window counts whose windows would hold fewer slots than this are not tried (the smallest count always
    # is): each window's producer recomputes what its consumers share, so short windows repeat the shared
    # prefix. Over paper-scale steps (stepwise and treestep, D = 2, 4, 8, generator seeds 0-4) no window
    # shorter than 22 slots was ever selected; skipping them saves ~0.1 s of planning at D = 8.
    min_window_slots: int = 8
    # Repack candidates cut subtrees whose complete layout exceeds this fraction
    # of T (one candidate per value): smaller units pack more evenly but share
    # more prefix rows between consumers.
    repack_shares: tuple[float, ...] = (1.0,)
    # Local refinement: at most this many accepted or rejected move rounds, of
    # which every `refine_pull_every`-th pulls work into a light consumer and the
    # others push it out of a slot maximum (pushes lower Phi more often; measured in
    # benchmarks/bench_planners.py, see place_windows' docstring).
    refine_steps: int = 64
    refine_pull_every: int = 4
    # Placement exchanges: at most this many accepted whole-consumer swaps; each
    # round scans at most `exchange_candidates` surrogate-ranked swaps, and all
    # rounds together evaluate at most `exchange_evaluations` exactly. A trial
    # re-evaluates only its two cells (~0.25 ms at paper scale), so the budget
    # keeps a paper-scale tree-step step at D = 8 under 1.5 s of planning
    # (benchmarks/bench_planners.py); step-wise stops on its own after ~160.
    exchange_rounds: int = 150
    exchange_candidates: int = 128
    exchange_evaluations: int = 1200
    # Scoring every swap of a round builds D^2/2 x S^3 numbers for a window of S slots (~9 ns each), so
    # windows of many slots (a small capacity: 576 consumers at D = 8 took 12 s, 1,168 took minutes) stop
    # after the rounds this many numbers pay for (~1 s). Paper-scale steps use at most 3.4M (both kinds,
    # D = 2, 4, 8, generator seeds 0-9), so the budget never stops them.
    exchange_scan_budget: int = 100_000_000
    seed: int = 0                       # recorded only: the pass is deterministic

    @classmethod
    def for_pairs_per_token(cls, pairs_per_token: int, **fields) -> "L2Options":
        """Weights for a model whose row costs `pairs_per_token` attention pairs (`hartsc --pairs-per-token`;
        `harts.schema.cost_model.row_cost_weights`, which `harts stats` uses too)."""
        weights = row_cost_weights(pairs_per_token)
        return cls(token_cost_forward=weights.token_forward, pair_cost_forward=weights.pair_forward,
                   token_cost_backward=weights.token_backward, pair_cost_backward=weights.pair_backward, **fields)
