"""L1's trie-aware greedy candidates: four insertion orders times two placement rules.

Each plan inserts trajectories one by one where they add the least work
(best-fit) or share the most (max-shared), then dissolves small groups and
aligns the count to a multiple of D; `partition_microbatches`' module
docstring gives the choices.
"""
from __future__ import annotations

import numpy as np

from harts.compiler.partition.candidate import Candidate, work_of
from harts.compiler.prefix_cost import PrefixCostModel, RangeMin


# The four greedy insertion orders (Appendix A.1 names four but not which):
#   sorted             trie DFS order: prefix families arrive together and fill one microbatch;
#   reverse-sorted     extensions before their prefixes: a prefix then lands beside its extension for free;
#   length-desc        first-fit-decreasing on raw length: big items first, fewest bins;
#   unique-suffix-desc decreasing tokens shared with neither sorted neighbour: FFD on marginal cost.
GREEDY_ORDERS = ("sorted", "reverse-sorted", "length-desc", "unique-suffix-desc")


GREEDY_RULES = ("best-fit", "max-shared")


def greedy_orders(model: PrefixCostModel) -> dict[str, np.ndarray]:
    """The four insertion orders, each a permutation of positions (stable on ties)."""
    n = model.num_trajectories
    lcp_next = np.append(model.lcp[1:], 0)
    unique_suffix = model.lengths - np.maximum(model.lcp, lcp_next)
    sorted_order = np.arange(n, dtype=np.int64)
    return {
        "sorted": sorted_order,
        "reverse-sorted": sorted_order[::-1].copy(),
        "length-desc": np.argsort(-model.lengths, kind="stable").astype(np.int64),
        "unique-suffix-desc": np.argsort(-unique_suffix, kind="stable").astype(np.int64),
    }


# Up to this many trajectories, the greedy fill reads neighbour LCPs from a
# dense N x (N + 2) int32 table (64 MiB at the limit), ~1.6x faster than range
# minima at paper scale; above it, from a sparse table (O(N log N) memory).
DENSE_LCP_LIMIT = 4096


def dense_lcp_table(model: PrefixCostModel) -> np.ndarray:
    """int32[N, N + 2]: entry [x, i + 1] = LCP(x, i); columns 0 and N + 1 (missing neighbours) are 0.

    Built row by row from LCP(i, j) = min(LCP(i, j - 1), lcp[j]) (one numpy op
    per row), then mirrored.
    """
    n = model.num_trajectories
    table = np.zeros((n, n + 2), dtype=np.int32)
    lcp_NN = table[:, 1:n + 1]
    for j in range(n):
        if j:
            np.minimum(lcp_NN[j - 1, :j], model.lcp[j], out=lcp_NN[j, :j])
        lcp_NN[j, j] = model.lengths[j]
    # Off the diagonal exactly one of [i, j], [j, i] is filled so far (the other is 0).
    np.maximum(lcp_NN, lcp_NN.T.copy(), out=lcp_NN)
    return table


def _neighbour_lcp_reader(model: PrefixCostModel, dense: bool):
    """Return shared(x, neighbours) -> max(LCP(p, x), LCP(x, q)), 0 for a missing side.

    `x` is int[P], `neighbours` int[P, 2, K] holding each microbatch's
    predecessor p (-1 if none) and successor q (N if none) of x. This is
    |x| - ΔC of `PrefixCostModel.insertion_delta`, specialised for the greedy
    fill's inner loop, which dominates L1's run time.
    """
    n = model.num_trajectories
    if dense:
        flat = dense_lcp_table(model).reshape(-1)

        def shared(x, neighbours):
            base = (x * (n + 2) + 1)[:, None, None]
            return flat[base + neighbours].max(axis=1)
        return shared

    # With lcp[0] = 0 and a sentinel lcp[N] = 0 the minima over [p + 1, x] and
    # [x + 1, q] are already 0 for p = -1 or q = N, so nothing needs masking.
    lcp_min = RangeMin.build(np.append(model.lcp, 0))
    width = lcp_min.min_LN.shape[1]
    table_flat = lcp_min.min_LN.reshape(-1)
    level_of = lcp_min.floor_log2
    window_of_level = np.int64(1) << np.arange(lcp_min.min_LN.shape[0], dtype=np.int64)

    def range_min(lo, span):
        level = level_of[span]
        left = level * width + lo
        return np.minimum(table_flat[left], table_flat[left + span - window_of_level[level]])

    def shared(x, neighbours):
        # LCP(p, x) = min(lcp[p + 1 .. x]) and LCP(x, q) = min(lcp[x + 1 .. q]); plain broadcasting of x
        # against the [P, K] neighbours (this runs once per insertion: numpy's per-call cost dominates).
        x_col = x[:, None].astype(np.int64)
        below, above = neighbours[:, 0].astype(np.int64), neighbours[:, 1].astype(np.int64)
        return np.maximum(range_min(below + 1, x_col - below), range_min(x_col + 1, above - x_col))
    return shared


class _NeighbourTable:
    """Neighbours of every position in every microbatch, for insertion orders of any shape.

    `table[p, 0, m, i]` is microbatch m's largest member < i (or -1) and
    `table[p, 1, m, i]` its smallest member > i (or N). Reading column x gives
    every microbatch's neighbours of x at once; an insertion rewrites, by two
    contiguous slice assignments, only the positions between x and its new
    neighbours. Memory: 2 x P x K x N int16 (int32 from N = 32,767 on).
    """

    def __init__(self, plans: int, n: int, slots: int):
        self.n = n
        self.index_type = np.int16 if n < np.iinfo(np.int16).max else np.int32  # must hold -1..N
        self.plan_index = np.arange(plans)
        self.table = self._empty(plans, slots)

    def _empty(self, plans: int, slots: int) -> np.ndarray:
        block = np.empty((plans, 2, slots, self.n), dtype=self.index_type)
        block[:, 0] = -1
        block[:, 1] = self.n
        return block

    def near(self, x: np.ndarray) -> np.ndarray:
        return self.table[self.plan_index, :, :, x]   # [P, 2, K]

    def grow(self, extra: int) -> None:
        self.table = np.concatenate([self.table, self._empty(len(self.plan_index), extra)], axis=2)

    def insert(self, x: np.ndarray, choice: np.ndarray, near: np.ndarray) -> None:
        below, above = near[self.plan_index, :, choice].T.tolist()
        for plan, xp, m in zip(self.plan_index.tolist(), x.tolist(), choice.tolist()):
            self.table[plan, 0, m, xp + 1:above[plan] + 1] = xp
            self.table[plan, 1, m, max(below[plan], 0):xp] = xp


class _NeighbourEnds:
    """Neighbours for insertion orders that run through the sorted positions one way (`sorted`,
    `reverse-sorted`): every member lies on one side of x, so x's neighbour in a microbatch is its last
    insertion there, and the other side is empty. O(P x K) state, where the table's slice writes would
    cost O(N) per insertion and make the fill quadratic."""

    def __init__(self, orders: np.ndarray, slots: int):
        self.n = orders.shape[1]
        self.increasing = (orders[:, -1] >= orders[:, 0])[:, None] if self.n else np.ones((len(orders), 1), bool)
        self.plan_index = np.arange(len(orders))
        self.last = self._empty(slots)

    def _empty(self, slots: int) -> np.ndarray:
        return np.where(self.increasing, -1, self.n) * np.ones((1, slots), dtype=np.int64)

    def near(self, x: np.ndarray) -> np.ndarray:
        empty = np.where(self.increasing, self.n, -1) * np.ones_like(self.last)
        below = np.where(self.increasing, self.last, empty)
        above = np.where(self.increasing, empty, self.last)
        return np.stack([below, above], axis=1)   # [P, 2, K]

    def grow(self, extra: int) -> None:
        self.last = np.concatenate([self.last, self._empty(extra)], axis=1)

    def insert(self, x: np.ndarray, choice: np.ndarray, near: np.ndarray) -> None:
        self.last[self.plan_index, choice] = x


def is_monotone(orders: np.ndarray) -> bool:
    """Every plan's order runs through the positions strictly one way (what `_NeighbourEnds` needs)."""
    step = np.diff(orders, axis=1)
    return bool(np.all(np.all(step > 0, axis=1) | np.all(step < 0, axis=1)))


def greedy_fill(model: PrefixCostModel, capacity: int, orders: np.ndarray, max_shared: np.ndarray,
                initial_capacity: int = 16, dense_lcp: bool | None = None) -> np.ndarray:
    """Insert trajectories one at a time for P plans at once; returns microbatch ids int64[P, N].

    Plan p inserts `orders[p]` in turn; `max_shared[p]` picks its rule (else
    best-fit). Each step reads every microbatch's neighbours of x at once
    (`_NeighbourEnds` when every order is monotone, else `_NeighbourTable`),
    so it is a handful of numpy ops over (P, K). Memory: the neighbour state,
    plus the dense LCP table (see DENSE_LCP_LIMIT).
    """
    plans, n = orders.shape
    lengths = model.lengths
    plan_index = np.arange(plans)
    shared_of = _neighbour_lcp_reader(model, n <= DENSE_LCP_LIMIT if dense_lcp is None else dense_lcp)

    slots = max(1, min(n, initial_capacity))
    neighbours = _NeighbourEnds(orders, slots) if is_monotone(orders) else _NeighbourTable(plans, n, slots)
    # Unopened microbatches carry a work no trajectory can fit beside, which
    # keeps them out of every choice without a separate mask.
    closed = np.int64(2 * capacity + 1)
    work = np.full((plans, slots), closed, dtype=np.int64)
    count = np.zeros(plans, dtype=np.int64)
    microbatch_of = np.zeros((plans, n), dtype=np.int64)
    # Max-shared ranks by shared tokens first, then by best-fit's key (work
    # after insertion); both are at most the capacity, so the sum fits int64.
    shared_weight = np.where(max_shared, np.int64(capacity) + 1, 0)[:, None]

    for step in range(n):
        x = orders[:, step]
        near = neighbours.near(x)  # [P, 2, K]
        shared = shared_of(x, near)
        after = work + (lengths[x][:, None] - shared)  # work + ΔC
        key = np.where(after <= capacity, shared * shared_weight + after, -1)
        choice = key.argmax(axis=1)
        fits = key.max(axis=1) >= 0
        choice = np.where(fits, choice, count)
        if choice.max() >= slots:  # grow the per-microbatch arrays by half, capped at N
            extra = min(n, slots + slots // 2 + 1) - slots
            neighbours.grow(extra)
            # A new microbatch has no members: its neighbours are -1 / N.
            empty = np.empty((plans, 2, extra), dtype=np.int64)
            empty[:, 0], empty[:, 1] = -1, n
            near = np.concatenate([near, empty], axis=2)
            work = np.concatenate([work, np.full((plans, extra), closed, np.int64)], axis=1)
            after = np.concatenate([after, np.zeros((plans, extra), np.int64)], axis=1)
            slots += extra
        work[plan_index, choice] = np.where(fits, after[plan_index, choice], lengths[x])
        count += ~fits
        microbatch_of[plan_index, x] = choice
        neighbours.insert(x, choice, near)
    return microbatch_of


def _shared_with_microbatches(model: PrefixCostModel, microbatch_of: np.ndarray, x: int, count: int) -> np.ndarray:
    """int64[count]: tokens x shares with each microbatch (max LCP with any member; x itself excluded)."""
    row = model.lcp_to_all(x)
    row[x] = -1
    shared = np.zeros(count, dtype=np.int64)
    np.maximum.at(shared, microbatch_of, row)
    return shared


def _pick(after: np.ndarray, shared: np.ndarray, allowed: np.ndarray, max_shared: bool, capacity: int) -> int:
    """Index of the target by the placement rule, or -1 when nothing is allowed."""
    key = after + (shared * (capacity + 1) if max_shared else 0)
    key = np.where(allowed, key, -1)
    best = int(np.argmax(key))
    return best if key[best] >= 0 else -1


def eliminate_small_groups(model: PrefixCostModel, capacity: int, microbatch_of: np.ndarray,
                           max_shared: bool) -> np.ndarray:
    """Repeatedly dissolve the lightest microbatch into the others while all its members fit.

    Members move in sorted order, each by the plan's placement rule, and see
    the members moved before them. Stops at the first microbatch that cannot
    be absorbed entirely (the next-lightest ones are rarely easier).
    """
    microbatch_of = microbatch_of.copy()
    lengths = model.lengths
    while True:
        count = int(microbatch_of.max()) + 1
        if count <= 1:
            return microbatch_of
        work = work_of(model, microbatch_of, count)
        # Lightest; on ties the newest (highest id), which the greedy opened last.
        victim = count - 1 - int(np.argmin(work[::-1]))
        trial = microbatch_of.copy()
        trial_work = work.copy()
        absorbed = True
        for x in np.flatnonzero(microbatch_of == victim):
            shared = _shared_with_microbatches(model, trial, int(x), count)
            after = trial_work + lengths[x] - shared
            allowed = after <= capacity
            allowed[victim] = False
            target = _pick(after, shared, allowed, max_shared, capacity)
            if target < 0:
                absorbed = False
                break
            trial[x] = target
            trial_work[target] = after[target]
        if not absorbed:
            return microbatch_of
        microbatch_of = trial - (trial > victim)


def align_by_singleton_splits(model: PrefixCostModel, microbatch_of: np.ndarray, dp: int) -> np.ndarray | None:
    """Raise K to a multiple of dp by moving single trajectories into new microbatches.

    Each move takes the trajectory whose removal adds the least work: the
    prefix tokens it shared with its nearest fellow member. Ties: from the
    heavier microbatch (it also relieves load), then the lower position.
    Returns None when the aligned count exceeds N (cannot keep every
    microbatch non-empty).
    """
    n = model.num_trajectories
    count = int(microbatch_of.max()) + 1
    target = dp * -(-count // dp)
    if target > n:
        return None
    microbatch_of = microbatch_of.copy()
    while count < target:
        by_microbatch = np.argsort(microbatch_of, kind="stable")  # (microbatch, position) order
        owner = microbatch_of[by_microbatch]
        same = owner[1:] == owner[:-1]
        pair = np.where(same, model.neighbour_lcp(np.where(same, by_microbatch[:-1], -1), by_microbatch[1:]), 0)
        increase = np.zeros(n, dtype=np.int64)
        increase[:-1] = pair
        increase[1:] = np.maximum(increase[1:], pair)
        movable = np.bincount(owner, minlength=count)[owner] >= 2
        work = work_of(model, microbatch_of, count)
        # lexsort: last key is primary -> (not movable, increase, -source work, position).
        pick = np.lexsort((by_microbatch, -work[owner], increase, ~movable))[0]
        microbatch_of[by_microbatch[pick]] = count
        count += 1
    return microbatch_of


def greedy_microbatch_estimate(model: PrefixCostModel, capacity: int, dp: int) -> int:
    """Microbatches `greedy_fill` starts with: greedy plans rarely need more than ~G/T plus alignment
    (it grows its arrays if one does); each insertion scans that many per plan."""
    return max(16, -(-5 * model.total_unique_tokens // (4 * capacity)) + dp)


def greedy_candidates(model: PrefixCostModel, capacity: int, dp: int) -> list[Candidate]:
    """All eight trie-aware greedy plans (4 orders x 2 rules), eliminated and aligned to dp."""
    orders = greedy_orders(model)
    names = [(order, rule) for order in GREEDY_ORDERS for rule in GREEDY_RULES]
    order_PN = np.stack([orders[order] for order, _ in names])
    max_shared = np.array([rule == "max-shared" for _, rule in names])
    n = model.num_trajectories
    estimate = greedy_microbatch_estimate(model, capacity, dp)
    # Monotone orders (sorted, reverse-sorted) need no neighbour table: they are filled together. The
    # others' tables (2 x 4 bytes x N x K per plan at worst) are bounded near 256 MB per fill.
    monotone = [i for i in range(len(names)) if is_monotone(order_PN[i:i + 1])]
    general = [i for i in range(len(names)) if i not in monotone]
    per_plan = 8 * n * min(n, estimate)
    chunk = int(max(1, min(len(names), (256 << 20) // max(per_plan, 1))))
    groups = ([monotone] if monotone else []) + [general[i:i + chunk] for i in range(0, len(general), chunk)]
    microbatch_PN = np.empty((len(names), n), dtype=np.int64)
    for group in groups:
        microbatch_PN[group] = greedy_fill(model, capacity, order_PN[group], max_shared[group], estimate)

    result = []
    for (order, rule), microbatch_of, shared_rule in zip(names, microbatch_PN, max_shared):
        microbatch_of = eliminate_small_groups(model, capacity, microbatch_of, bool(shared_rule))
        microbatch_of = align_by_singleton_splits(model, microbatch_of, dp)
        if microbatch_of is None:
            continue
        count = int(microbatch_of.max()) + 1
        result.append(Candidate(f"greedy {rule} order={order}", microbatch_of,
                                work_of(model, microbatch_of, count)))
    return result
