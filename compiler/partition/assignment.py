"""Placing an L1 candidate on the (replica, slot) grid (J_init), the candidate counts of
Equation A.4, and the step-level feasibility check that the FFD planner shares."""
from __future__ import annotations

import numpy as np

from harts.compiler.partition.options import L1Options
from harts.compiler.prefix_cost import PrefixCostModel
from harts.schema.errors import PassFailedError
from harts.text import plural


def initial_assignment(work: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
    """Place microbatches on the (replica, slot) grid; returns (replica, slot, J_init).

    Microbatches sorted by decreasing work (stable), each consecutive dp form a
    slot; within a slot the heavier microbatch goes to the replica with the
    lower cumulative work so far (ties: lower replica index).
    J_init = (sum w, sum over slots of max w, max over replicas of total w).
    """
    count = len(work)
    order = np.argsort(-work, kind="stable")
    replica = np.empty(count, dtype=np.int32)
    slot = np.empty(count, dtype=np.int32)
    cumulative = np.zeros(dp, dtype=np.int64)
    slot_max_sum = 0
    for j in range(count // dp):
        members = order[j * dp:(j + 1) * dp]  # heaviest first
        lightest_first = np.argsort(cumulative, kind="stable")
        replica[members] = lightest_first
        slot[members] = j
        cumulative[lightest_first] += work[members]
        slot_max_sum += int(work[members[0]])
    return replica, slot, (int(work.sum()), slot_max_sum, int(cumulative.max()))


def candidate_counts(model: PrefixCostModel, capacity: int, dp: int, options: L1Options,
                     natural_count: int) -> list[int]:
    """Eq. A.4 as we read it: aligned counts from K_lo through K_lo + count_span * dp, at most D*floor(N/D)."""
    k_min = dp * max(1, -(-model.total_unique_tokens // (capacity * dp)))
    k_lo = max(k_min, dp * -(-natural_count // dp))
    k_cap = dp * (model.num_trajectories // dp)
    return list(range(k_lo, min(k_lo + options.count_span * dp, k_cap) + 1, dp))


def check_step_fits(model: PrefixCostModel, capacity: int, dp: int, pass_name: str) -> None:
    """Refuse, with a fix, a step no partitioner can place: a trajectory longer than the
    capacity, or fewer trajectories than DP replicas (each needs a non-empty microbatch)."""
    n = model.num_trajectories
    if n and model.lengths.max() > capacity:
        worst = int(np.argmax(model.lengths))
        raise PassFailedError(pass_name, f"trajectory at sorted position {worst} has {model.lengths[worst]} tokens, "
                                         f"more than the microbatch capacity {capacity}",
                              f"raise the capacity to at least {model.lengths[worst]} or drop/truncate that trajectory")
    if n < dp:
        raise PassFailedError(pass_name,
                              f"{plural(n, 'trajectory')} cannot give each of {dp} DP replicas a non-empty microbatch",
                              f"lower dp to at most {n} or add trajectories to the step")
