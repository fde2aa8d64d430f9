"""L1's options: the search knobs of `partition_microbatches` (its module docstring explains them)."""
from __future__ import annotations

from dataclasses import dataclass

# How L1 ranks its candidates (`L1Options.objective`); hartsc's --l1-objective.
L1_OBJECTIVES = ("step-time", "compression")


@dataclass(frozen=True, slots=True)
class L1Options:
    """Search knobs of L1; defaults reproduce the paper where it gives numbers. The default
    `objective` departs from the paper's Equation 1: `partition_microbatches` says why."""

    # Run the exact contiguous DP when N x K_hi <= this (K_hi: largest candidate
    # count; the DP fills every row up to it). 2M cells is ~60 ms and 16 MB of
    # table here; a paper-scale step (N = 1,600, K_hi ~ 190) needs ~0.3M.
    exact_max_cells: int = 2_000_000
    # Q_max: at most this many counts are tried by the scalable search.
    max_sampled_counts: int = 32
    # Eq. A.4 as we read it: try K_lo + i * D for i = 0..count_span. More counts
    # add cuts (more work) but can fix capacity fragmentation and balance.
    count_span: int = 16
    # Add the best of the eight trie-aware greedy plans as a candidate.
    greedy: bool = True
    # ... unless N x K_estimate exceeds this and a contiguous candidate exists: every insertion scans every
    # microbatch of eight plans (~0.5 us a cell here), so 2M cells is ~1 s. A paper-scale step needs ~0.15M
    # (greedy wins there by 1-3% fewer rows); a 16,384-trajectory GRPO step of 40M tokens needs 10.4M, 5 s of
    # greedy whose plan loses to the contiguous ones.
    greedy_max_cells: int = 2_000_000
    # "step-time": least sum over slots of the heaviest microbatch first (the step's critical path in compact
    # rows), then the paper's order; the least-heaviest-group contiguous partitions join the candidates.
    # "compression": the paper's Equation 1 (least total work first) over the paper's candidates only.
    objective: str = "step-time"
