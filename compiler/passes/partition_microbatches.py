"""L1 of the global planner: partition a step's trajectories into consumer microbatches.

Reads: `lengths` and `lcp` of the step's trajectories in lexicographic token
order (produced by the trie pass), the compact-token capacity T of one
microbatch and the data-parallel degree D.

Adds: an `L1Partition`: the members of every microbatch, its work C(M) (the
size of its complete compact layout), an initial (replica, slot) grid, the
name of the winning candidate, its J_init and a one-line-per-decision log.

Invariant afterwards (checked by `verify_partition`): every trajectory lies in
exactly one non-empty microbatch; every microbatch's C(M) <= T; the number of
microbatches K is a multiple of D; the (replica, slot) pairs are exactly the
D x K/D grid; `work[i] == C(members[i])`. Microbatch i sits at slot i // D,
and slots are ordered by decreasing heaviest member (slot 0 is heaviest).

Paper: Section 3.2 and Appendix A.1 ("L1: Prefix compression"). Our copy lost
Equations A.3 and A.4; the choices filling the gaps are:

* A.3 (contiguous exact search): F[k, e] = min over feasible s <= e of
  F[k-1, s-1] + lcp[s], F[0, -1] = 0. For a contiguous partition,
  sum C(M) = G + sum of lcp at the cut points, so F[k, N-1] + G is the least
  total work over all contiguous k-partitions. Feasible starts for an end e
  form a window [lo(e), e] whose both ends only move right, so each row is a
  sliding-window minimum, computed with a per-row sparse table in numpy.
  Ties between equal-work partitions take the leftmost start of the last group.
* A.4 (candidate counts): K_lo = max(K_min, D * ceil(|P_0| / D)), the
  smallest aligned count a contiguous partition can reach (greedy maximal
  filling P_0 has the fewest contiguous groups, so smaller counts are provably
  infeasible), then K_lo, K_lo + D, ..., K_lo + count_span * D, capped at
  D * floor(N / D) (every microbatch must be non-empty).
* The exact search runs when its table, N x K_hi cells (row k is built from
  row k-1, so every count up to the largest candidate K_hi is evaluated), has
  at most `exact_max_cells` cells; otherwise the scalable search runs on at
  most Q_max sampled counts: both endpoints, the lowest Q_max // 2 counts
  densely, and the rest evenly spread over the remaining range.
  The scalable search walks from P_0: splits for larger counts, merges for
  smaller ones. P_0 being count-minimal, merges below |P_0| always fail for
  contiguous groups, so under our A.4 only splits run; `contiguous_evolve`
  still merges when started from a finer partition.
* Greedy: ΔC = |x| - LCP(p,x) - LCP(x,q) + LCP(p,q) equals |x| - max(LCP(p,x),
  LCP(x,q)) (LCP(p,q) is the smaller of the two), i.e. x's longest shared
  prefix with any member. "Eliminate small groups": dissolve the lightest
  microbatch while all its members fit elsewhere, stop at the first that does
  not. Alignment moves the trajectory whose departure costs the fewest shared
  tokens; a plan whose aligned count would exceed N is dropped. The greedy
  candidate joins even when its count is outside A.4 (as the paper says).
* Ties: placement picks the lowest microbatch index; candidates tying on
  J_init keep the earlier one (contiguous counts ascending, then greedy).

Legend for shape suffixes: P greedy plans, N positions, K microbatches, L sparse-table levels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.compiler.ir.partition import L1Partition
from harts.compiler.prefix_cost import INFEASIBLE, PrefixCostModel, RangeMin, floor_log2_table
from harts.schema.errors import PassFailedError, VerificationError

PASS_NAME = "partition_microbatches"

# The four greedy insertion orders (Appendix A.1 names four but not which):
#   sorted             trie DFS order: prefix families arrive together and fill one microbatch;
#   reverse-sorted     extensions before their prefixes: a prefix then lands beside its extension for free;
#   length-desc        first-fit-decreasing on raw length: big items first, fewest bins;
#   unique-suffix-desc decreasing tokens shared with neither sorted neighbour: FFD on marginal cost.
GREEDY_ORDERS = ("sorted", "reverse-sorted", "length-desc", "unique-suffix-desc")
GREEDY_RULES = ("best-fit", "max-shared")


@dataclass(frozen=True, slots=True)
class L1Options:
    """Search knobs of L1; defaults reproduce the paper where it gives numbers."""

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


@dataclass(frozen=True, slots=True)
class Candidate:
    """A capacity-feasible membership before assignment: microbatch id per position."""

    name: str
    microbatch_of: np.ndarray  # int64[N], ids 0..K-1
    work: np.ndarray           # int64[K]


# --------------------------------------------------------------------------- contiguous search


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


def _starts_to_candidate(model: PrefixCostModel, name: str, starts: np.ndarray) -> Candidate:
    n = model.num_trajectories
    microbatch_of = np.zeros(n, dtype=np.int64)
    microbatch_of[starts[1:]] = 1
    np.cumsum(microbatch_of, out=microbatch_of)
    ends = np.append(starts[1:] - 1, n - 1)
    return Candidate(name, microbatch_of, model.contiguous_cost(starts, ends))


# --------------------------------------------------------------------------- greedy candidates


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

    def shared(x, neighbours):
        x_col = x[:, None]
        lo = np.stack(np.broadcast_arrays(neighbours[:, 0] + 1, x_col + 1)).astype(np.int64)
        hi = np.stack(np.broadcast_arrays(x_col, neighbours[:, 1])).astype(np.int64)
        span = hi - lo + 1
        level = level_of[span]
        left = level * width + lo
        return np.minimum(table_flat[left], table_flat[left + span - window_of_level[level]]).max(axis=0)
    return shared


def greedy_fill(model: PrefixCostModel, capacity: int, orders: np.ndarray, max_shared: np.ndarray,
                initial_capacity: int = 16, dense_lcp: bool | None = None) -> np.ndarray:
    """Insert trajectories one at a time for P plans at once; returns microbatch ids int64[P, N].

    Plan p inserts `orders[p]` in turn; `max_shared[p]` picks its rule (else
    best-fit). State per plan, position i and microbatch m:
    `neighbours[p, 0, i, m]` is m's largest member < i (or -1) and
    `neighbours[p, 1, i, m]` its smallest member > i (or N). Reading column x
    gives every microbatch's neighbours of x at once, so each step is a
    handful of numpy ops over (P, K); an insertion rewrites, by two slice
    assignments, only the positions between x and its new neighbours.
    Memory: 2 x P x N x K int16 (int32 from N = 32,767 on), plus the dense
    LCP table (see DENSE_LCP_LIMIT).
    """
    plans, n = orders.shape
    lengths = model.lengths
    plan_index = np.arange(plans)
    shared_of = _neighbour_lcp_reader(model, n <= DENSE_LCP_LIMIT if dense_lcp is None else dense_lcp)

    index_type = np.int16 if n < np.iinfo(np.int16).max else np.int32  # must hold -1..N

    def empty_neighbours(slots):
        block = np.empty((plans, 2, n, slots), dtype=index_type)
        block[:, 0] = -1
        block[:, 1] = n
        return block

    slots = max(1, min(n, initial_capacity))
    neighbours = empty_neighbours(slots)
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
        near = neighbours[plan_index, :, x]  # [P, 2, K]
        shared = shared_of(x, near)
        after = work + (lengths[x][:, None] - shared)  # work + ΔC
        key = np.where(after <= capacity, shared * shared_weight + after, -1)
        choice = key.argmax(axis=1)
        fits = key.max(axis=1) >= 0
        choice = np.where(fits, choice, count)
        if choice.max() >= slots:  # grow the per-microbatch arrays by half, capped at N
            extra = min(n, slots + slots // 2 + 1) - slots
            neighbours = np.concatenate([neighbours, empty_neighbours(extra)], axis=3)
            near = np.concatenate([near, neighbours[plan_index, :, x, slots:]], axis=2)
            work = np.concatenate([work, np.full((plans, extra), closed, np.int64)], axis=1)
            after = np.concatenate([after, np.zeros((plans, extra), np.int64)], axis=1)
            slots += extra
        work[plan_index, choice] = np.where(fits, after[plan_index, choice], lengths[x])
        count += ~fits
        microbatch_of[plan_index, x] = choice
        # A new microbatch has no neighbours: its rows are still -1 / N.
        p_of, q_of = near[plan_index, :, choice].T.tolist()
        for plan, xp, m in zip(range(plans), x.tolist(), choice.tolist()):
            neighbours[plan, 0, xp + 1:q_of[plan] + 1, m] = xp
            neighbours[plan, 1, max(p_of[plan], 0):xp, m] = xp
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
        work = _work_of(model, microbatch_of, count)
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
        work = _work_of(model, microbatch_of, count)
        # lexsort: last key is primary -> (not movable, increase, -source work, position).
        pick = np.lexsort((by_microbatch, -work[owner], increase, ~movable))[0]
        microbatch_of[by_microbatch[pick]] = count
        count += 1
    return microbatch_of


def greedy_candidates(model: PrefixCostModel, capacity: int, dp: int) -> list[Candidate]:
    """All eight trie-aware greedy plans (4 orders x 2 rules), eliminated and aligned to dp."""
    orders = greedy_orders(model)
    names = [(order, rule) for order in GREEDY_ORDERS for rule in GREEDY_RULES]
    order_PN = np.stack([orders[order] for order, _ in names])
    max_shared = np.array([rule == "max-shared" for _, rule in names])
    n = model.num_trajectories
    # Greedy plans rarely need more than ~G/T microbatches plus alignment;
    # greedy_fill grows its arrays if one does.
    estimate = max(16, -(-5 * model.total_unique_tokens // (4 * capacity)) + dp)
    # Bound the per-microbatch lookup arrays (2 x 4 bytes x N x K per plan at worst) near 256 MB.
    per_plan = 8 * n * min(n, estimate)
    chunk = int(max(1, min(len(names), (256 << 20) // max(per_plan, 1))))
    filled = [greedy_fill(model, capacity, order_PN[i:i + chunk], max_shared[i:i + chunk], estimate)
              for i in range(0, len(names), chunk)]
    microbatch_PN = np.concatenate(filled, axis=0)

    result = []
    for (order, rule), microbatch_of, shared_rule in zip(names, microbatch_PN, max_shared):
        microbatch_of = eliminate_small_groups(model, capacity, microbatch_of, bool(shared_rule))
        microbatch_of = align_by_singleton_splits(model, microbatch_of, dp)
        if microbatch_of is None:
            continue
        count = int(microbatch_of.max()) + 1
        result.append(Candidate(f"greedy {rule} order={order}", microbatch_of,
                                _work_of(model, microbatch_of, count)))
    return result


def _work_of(model: PrefixCostModel, microbatch_of: np.ndarray, count: int) -> np.ndarray:
    """int64[count]: C(M) of every microbatch, from consecutive members in sorted order."""
    by_microbatch = np.argsort(microbatch_of, kind="stable")
    owner = microbatch_of[by_microbatch]
    same = owner[1:] == owner[:-1]
    shared = np.where(same, model.neighbour_lcp(np.where(same, by_microbatch[:-1], -1), by_microbatch[1:]), 0)
    work = np.bincount(microbatch_of, weights=model.lengths, minlength=count).astype(np.int64)
    work -= np.bincount(owner[1:], weights=shared, minlength=count).astype(np.int64)
    return work


# --------------------------------------------------------------------------- assignment and selection


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


def _check_arguments(model: PrefixCostModel, capacity: int, dp: int, options: L1Options) -> None:
    if capacity < 1 or dp < 1:
        raise ValueError(f"capacity and dp must be >= 1, got capacity={capacity}, dp={dp}")
    if options.exact_max_cells < 0 or options.max_sampled_counts < 1 or options.count_span < 0:
        raise ValueError(f"L1Options out of range, got {options}")
    check_step_fits(model, capacity, dp, PASS_NAME)


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
        raise PassFailedError(pass_name, f"{n} trajectories cannot give each of {dp} DP replicas a non-empty microbatch",
                              f"lower dp to at most {n} or add trajectories to the step")


def partition_microbatches(lengths, lcp, *, capacity: int, dp: int, options: L1Options = L1Options()) -> L1Partition:
    """Run L1: pick the candidate partition with the least J_init and place it on the grid.

    lengths: int[N] trajectory lengths in lexicographic order; lcp: int[N],
    lcp[0] = 0, lcp[i] = LCP(trajectory i-1, trajectory i). Deterministic.
    """
    model = PrefixCostModel.build(lengths, lcp)
    _check_arguments(model, capacity, dp, options)
    n = model.num_trajectories
    decisions = []
    total = model.total_unique_tokens
    k_min = dp * max(1, -(-total // (capacity * dp)))
    decisions.append(f"G={total} unique tokens, T={capacity}, D={dp}: K_min={k_min}")

    natural = natural_partition(model, capacity)
    counts = candidate_counts(model, capacity, dp, options, len(natural))
    if counts:
        decisions.append(f"natural partition P_0 has {len(natural)} groups; Eq. A.4 counts {counts[0]}..{counts[-1]} "
                         f"step {dp} ({len(counts)} counts)")
    else:
        decisions.append(f"natural partition P_0 has {len(natural)} groups: no multiple of {dp} between "
                         f"{len(natural)} and N={n}, no contiguous candidate")

    candidates: list[Candidate] = []
    if counts:
        if n * counts[-1] <= options.exact_max_cells and exact_search_fits_int64(n, capacity):
            found = contiguous_exact(model, capacity, counts)
            decisions.append(f"contiguous exact search over k<={counts[-1]} ({n * counts[-1]} cells): "
                             f"{len(found)} feasible counts")
            candidates += [_starts_to_candidate(model, f"contiguous-exact k={k}", found[k]) for k in sorted(found)]
        else:
            sampled = sample_counts(counts, options.max_sampled_counts)
            found = contiguous_evolve(model, capacity, natural, sampled)
            decisions.append(f"contiguous scalable search ({n * counts[-1]} cells > {options.exact_max_cells}): "
                             f"{len(found)} of {len(sampled)} sampled counts reached")
            candidates += [_starts_to_candidate(model, f"contiguous-scalable k={k}", found[k]) for k in sorted(found)]

    if options.greedy and n:
        plans = greedy_candidates(model, capacity, dp)
        if plans:
            best = min(range(len(plans)), key=lambda i: (len(plans[i].work), int(plans[i].work.sum()), i))
            decisions.append(f"greedy preselected '{plans[best].name}': K={len(plans[best].work)}, "
                             f"work={int(plans[best].work.sum())} (of {len(plans)} aligned plans)")
            candidates.append(plans[best])
        else:
            decisions.append("greedy: no plan could be aligned to a multiple of dp")

    if not candidates:
        raise PassFailedError(PASS_NAME, f"no partition of {n} trajectories into a multiple of {dp} non-empty "
                                         f"microbatches fits capacity {capacity} (at least {len(natural)} contiguous "
                                         f"groups are needed)",
                              f"raise the capacity, or choose a dp with a multiple between {len(natural)} and {n}")

    best = None
    for index, candidate in enumerate(candidates):
        replica, slot, j_init = initial_assignment(candidate.work, dp)
        decisions.append(f"candidate {candidate.name}: K={len(candidate.work)} J_init={j_init}")
        if best is None or j_init < best[0]:
            best = (j_init, index, replica, slot)
    j_init, index, replica, slot = best
    winner = candidates[index]
    decisions.append(f"selected {winner.name} with J_init={j_init}")

    # Renumber microbatches to grid order: microbatch i sits at slot i // D, replica i % D.
    grid_order = np.lexsort((replica, slot))
    new_id = np.empty_like(grid_order)
    new_id[grid_order] = np.arange(len(grid_order))
    microbatch_of = new_id[winner.microbatch_of]
    by_microbatch = np.argsort(microbatch_of, kind="stable").astype(np.int64)
    bounds = np.cumsum(np.bincount(microbatch_of, minlength=len(grid_order)))[:-1]
    members = tuple(np.split(by_microbatch, bounds))
    return L1Partition(members=members, work=winner.work[grid_order].astype(np.int64),
                       replica=replica[grid_order], slot=slot[grid_order], candidate=winner.name,
                       j_init=j_init, decisions=tuple(decisions))


# --------------------------------------------------------------------------- verification


def verify_partition(lengths, lcp, partition: L1Partition, capacity: int, dp: int) -> None:
    """Raise VerificationError naming the first L1 invariant that does not hold."""
    model = PrefixCostModel.build(lengths, lcp)
    n = model.num_trajectories
    count = len(partition.members)
    work = np.asarray(partition.work)
    replica = np.asarray(partition.replica)
    slot = np.asarray(partition.slot)
    if not (work.shape == replica.shape == slot.shape == (count,)):
        raise VerificationError("one work/replica/slot entry per microbatch",
                                f"{count} microbatches, work {work.shape}, replica {replica.shape}, slot {slot.shape}")
    seen = np.zeros(n, dtype=np.int64)
    for i, members in enumerate(partition.members):
        members = np.asarray(members)
        if members.size == 0:
            raise VerificationError("every microbatch is non-empty", f"microbatch {i} has no trajectory")
        if members.ndim != 1 or members.min() < 0 or members.max() >= n:
            raise VerificationError("members are sorted positions in [0, N)", f"microbatch {i} holds {members}")
        if members.size > 1 and np.any(np.diff(members) <= 0):
            raise VerificationError("members are sorted positions in [0, N)",
                                    f"microbatch {i} is not strictly ascending")
        np.add.at(seen, members, 1)
        cost = model.cost(members)
        if cost > capacity:
            raise VerificationError("C(M) <= capacity", f"microbatch {i} has C(M)={cost} > {capacity}")
        if int(work[i]) != cost:
            raise VerificationError("work equals C(M)", f"microbatch {i} records work {int(work[i])}, C(M)={cost}")
    if np.any(seen == 0):
        raise VerificationError("every trajectory is in exactly one microbatch",
                                f"trajectory {int(np.flatnonzero(seen == 0)[0])} is missing")
    if np.any(seen > 1):
        raise VerificationError("every trajectory is in exactly one microbatch",
                                f"trajectory {int(np.flatnonzero(seen > 1)[0])} appears {int(seen.max())} times")
    if count % dp:
        raise VerificationError("K is a multiple of dp", f"K={count}, dp={dp}")
    if count and (replica.min() < 0 or replica.max() >= dp or slot.min() < 0 or slot.max() >= count // dp):
        raise VerificationError("(replica, slot) pairs form the dp x K/dp grid",
                                f"replica in [{replica.min()}, {replica.max()}], slot in [{slot.min()}, {slot.max()}]")
    cells = np.unique(replica.astype(np.int64) * max(count // dp, 1) + slot)
    if cells.size != count:
        raise VerificationError("(replica, slot) pairs form the dp x K/dp grid",
                                f"{count - cells.size} (replica, slot) pairs are repeated")
