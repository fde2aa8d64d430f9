"""L1's contiguous candidates: the sorted order cut into k consecutive microbatches.

The exact search (Equation A.3 as we read it: a DP over cut points, one
sliding-window minimum per row), the scalable search that splits or merges
from the natural partition P_0, and the min-max partitions the step-time
objective adds; `partition_microbatches`' module docstring gives the choices.
"""
from __future__ import annotations

import numpy as np

from harts.compiler.prefix_cost import INFEASIBLE, PrefixCostModel, floor_log2_table


def natural_partition(model: PrefixCostModel, capacity: int) -> np.ndarray:
    """P_0: greedy maximal filling in sorted order; returns the group starts (int64[K]).

    It has the fewest groups of any contiguous partition (each group reaches as
    far right as capacity allows). Loops over groups, not over positions.
    """
    n = model.num_trajectories
    prefix = model.unique_prefix_sum
    starts = []
    start = 0
    while start < n:
        starts.append(start)
        # C([s..e]) = U[e+1] - (U[s] - lcp[s]) <= T: the last e with U[e+1] within reach.
        reach = prefix[start] - model.lcp[start] + capacity
        start = int(np.searchsorted(prefix, reach, side="right")) - 1
    return np.asarray(starts, dtype=np.int64)


def exact_search_fits_int64(num_trajectories: int, capacity: int) -> bool:
    """Whether `contiguous_exact`'s packed (cut sum, start) keys fit below INFEASIBLE.

    A cut sum is at most N * T (at most N cuts of at most T shared tokens).
    """
    return (num_trajectories * capacity + capacity) * (num_trajectories + 1) < INFEASIBLE


def contiguous_exact(model: PrefixCostModel, capacity: int, counts) -> dict[int, np.ndarray]:
    """Least-work contiguous partition with exactly k groups, for each k in `counts`.

    Returns {k: group starts} for the feasible k only. Cost: one sliding-window
    minimum per row k = 1..max(counts), each O(N log N) numpy work, then O(k)
    scalar steps to recover each requested partition.

    Each table entry packs (least cut sum, start of the last group) into one
    int64 as `cut_sum * (N + 1) + start`, so the window minimum yields the
    argmin too: ties in cut sum go to the leftmost start, deterministically.
    """
    counts = sorted({int(k) for k in counts if 1 <= k <= model.num_trajectories})
    if not counts:
        return {}
    n = model.num_trajectories
    if not exact_search_fits_int64(n, capacity):
        raise ValueError(f"exact search keys overflow int64 for N={n}, T={capacity}; use the scalable search")
    lcp = model.lcp
    window_lo = model.earliest_feasible_start(capacity)
    window_hi = np.arange(n, dtype=np.int64)
    span = window_hi - window_lo + 1
    levels = int(floor_log2_table(int(span.max()))[-1]) + 1
    level_of = floor_log2_table(n)[span]
    # Flat indices into the per-row sparse table: the two overlapping
    # power-of-two windows that cover [lo(e), e] are the same for every row.
    left_flat = level_of * n + window_lo
    right_flat = level_of * n + window_hi - (np.int64(1) << level_of) + 1
    packing = np.int64(n + 1)
    start_of = np.arange(n, dtype=np.int64)

    k_hi = counts[-1]
    # best[k, e + 1]: packed (least sum of cut lcps splitting positions 0..e into
    # k groups, start of the last group); INFEASIBLE where no split fits.
    best = np.full((k_hi + 1, n + 1), INFEASIBLE, dtype=np.int64)
    best[0, 0] = 0
    cut_sum = np.empty(n, dtype=np.int64)
    table = np.full((levels, n), INFEASIBLE, dtype=np.int64)
    flat = table.reshape(-1)
    for k in range(1, k_hi + 1):
        # Last group starting at s: best (k-1)-split of 0..s-1 plus the cut at s.
        np.floor_divide(best[k - 1, :n], packing, out=cut_sum)
        np.add(cut_sum, lcp, out=cut_sum)
        np.multiply(cut_sum, packing, out=table[0])
        np.add(table[0], start_of, out=table[0])
        np.putmask(table[0], best[k - 1, :n] >= INFEASIBLE, INFEASIBLE)
        for level in range(1, levels):
            half = 1 << (level - 1)
            width = n - (1 << level) + 1
            np.minimum(table[level - 1, :width], table[level - 1, half:half + width], out=table[level, :width])
        np.minimum(flat.take(left_flat), flat.take(right_flat), out=best[k, 1:])

    result = {}
    for k in counts:
        if best[k, n] >= INFEASIBLE:
            continue
        starts = np.empty(k, dtype=np.int64)
        end = n - 1
        for group in range(k, 0, -1):
            start = int(best[group, end + 1] % packing)
            starts[group - 1] = start
            end = start - 1
        result[k] = starts
    return result


def _best_cuts(model: PrefixCostModel, starts: np.ndarray, ends: np.ndarray):
    """Per group: the interior cut with least lcp (the split increase) and its position."""
    splittable = ends > starts
    lo = np.where(splittable, starts + 1, 0)
    hi = np.where(splittable, ends, 0)
    position = model.lcp_min.argmin(lo, hi)
    increase = np.where(splittable, model.lcp[position], INFEASIBLE)
    return increase, position


def contiguous_evolve(model: PrefixCostModel, capacity: int, starts: np.ndarray, targets) -> dict[int, np.ndarray]:
    """Scalable search: walk from a contiguous partition to each target count.

    Smaller targets: repeatedly merge the adjacent feasible pair with maximum
    saving C(A) + C(B) - C(A u B) (= lcp at their cut). Larger targets:
    repeatedly split the group whose least-lcp interior cut adds the least
    (= that lcp; both halves are cheaper than the whole, so always feasible).
    Each walk is greedy and sequential, so every target reached on the way is
    recorded. Returns {target: starts} for the targets reached; a target is
    missing when no legal operation remained. Ties: leftmost pair / group.
    """
    n = model.num_trajectories
    targets = sorted({int(t) for t in targets})
    found: dict[int, np.ndarray] = {}
    starts = np.asarray(starts, dtype=np.int64)

    current = starts.copy()
    for target in sorted((t for t in targets if t < len(starts)), reverse=True):
        while len(current) > target:
            ends = np.append(current[1:] - 1, n - 1)
            merged_cost = model.contiguous_cost(current[:-1], ends[1:])
            saving = np.where(merged_cost <= capacity, model.lcp[current[1:]], -1)
            pair = int(np.argmax(saving))
            if saving[pair] < 0:
                break
            current = np.delete(current, pair + 1)
        if len(current) != target:
            break  # every smaller target is unreachable too
        found[target] = current.copy()

    current = starts.copy()
    ends = np.append(current[1:] - 1, n - 1)
    increase, cut = _best_cuts(model, current, ends)
    for target in (t for t in targets if t >= len(starts)):
        while len(current) < target:
            group = int(np.argmin(increase))
            if increase[group] >= INFEASIBLE:
                break  # all singletons
            split_at = int(cut[group])
            new_starts = np.array([current[group], split_at], dtype=np.int64)
            new_ends = np.array([split_at - 1, ends[group]], dtype=np.int64)
            new_increase, new_cut = _best_cuts(model, new_starts, new_ends)
            current = np.insert(current, group + 1, split_at)
            ends = np.concatenate([ends[:group], new_ends, ends[group + 1:]])
            increase = np.concatenate([increase[:group], new_increase, increase[group + 1:]])
            cut = np.concatenate([cut[:group], new_cut, cut[group + 1:]])
        if len(current) != target:
            break
        found[target] = current.copy()
    return found


def sample_counts(counts: list[int], budget: int) -> list[int]:
    """At most `budget` counts: both endpoints, the lowest half densely, the rest evenly spread."""
    if len(counts) <= budget:
        return list(counts)
    if budget <= 2:
        return sorted({counts[0], counts[-1]})[:max(budget, 1)]
    dense = budget // 2
    chosen = set(counts[:dense]) | {counts[-1]}
    rest = counts[dense:-1]
    sparse = budget - len(chosen)
    if sparse > 0 and rest:
        picks = np.unique(np.linspace(0, len(rest) - 1, num=sparse).round().astype(np.int64))
        chosen |= {rest[i] for i in picks}
    return sorted(chosen)


def contiguous_min_max(model: PrefixCostModel, capacity: int, counts) -> dict[int, np.ndarray]:
    """For each k in `counts`: a contiguous k-partition whose heaviest group is as light as possible.

    The fewest groups P_0 reaches under a bound B never grows as B grows, so the
    least bound B*(k) with |P_0(B)| <= k is found by bisection over
    [longest trajectory, capacity]; P_0(B*) is then split (least-lcp cuts, so
    no group grows) up to exactly k. No contiguous k-partition has a lighter
    heaviest group than B*(k): P_0(B) would otherwise reach k groups below it.
    Returns {k: group starts} for the feasible k only.
    """
    n = model.num_trajectories
    counts = sorted({int(k) for k in counts if 1 <= k <= n})
    if not counts or not n:
        return {}
    longest = int(model.lengths.max())
    if longest > capacity:
        return {}
    group_count: dict[int, int] = {}

    def groups_under(bound: int) -> int:
        if bound not in group_count:
            group_count[bound] = len(natural_partition(model, bound))
        return group_count[bound]

    counts_under: dict[int, list[int]] = {}   # B*(k) -> the counts k it is least for
    upper = capacity   # B*(k) never grows with k: each count's bound caps the next one's search
    for k in counts:
        if groups_under(upper) > k:
            continue
        lo, hi = longest, upper   # invariant: groups_under(hi) <= k
        while lo < hi:
            middle = (lo + hi) // 2
            if groups_under(middle) <= k:
                hi = middle
            else:
                lo = middle + 1
        upper = hi
        counts_under.setdefault(hi, []).append(k)
    result: dict[int, np.ndarray] = {}
    for bound, ks in counts_under.items():   # counts sharing a bound share one split walk
        result.update(contiguous_evolve(model, bound, natural_partition(model, bound), ks))
    return result
