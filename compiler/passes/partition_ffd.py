"""The OR-Tools+FFD comparison planner (`hartsc --planner ffd`, paper Section 5.3).

Reads: what L1 reads (`partition_microbatches`): `lengths` and `lcp` of the
step's trajectories in lexicographic order, the capacity T and the DP degree D.

Adds: an `L1Partition` built the baseline's way, in four steps:

(a) Shard: original-token first-fit decreasing. Shards by decreasing
    original tokens (ties: sorted position) go to the first replica whose
    original tokens stay within the balanced share ceil(S / D); one that
    fits nowhere goes to the least-loaded replica (ties: lowest index).
    Guarantee (Graham's list-scheduling bound, which a first-fit placement
    also keeps since it stays within the share):
    D * max replica load <= S + (D - 1) * largest shard.
    The shard unit (`shard=`) is the one reading the paper leaves open:
    "trajectory" (default): every trajectory is a shard, as an RL
        framework's sequence balancer does; prefixes are not looked at, so a
        rollout tree's steps scatter over replicas and most sharing is lost
        (on the paper-scale stepwise step: 2.1x compression, 62 vs 10
        microbatches per replica).
    "subtree": maximal trie subtrees of at most ceil(S / D) original tokens
        (trees are cut only where one would overflow a replica's share);
        keeps rollout trees whole, closer to the paper's reported near-parity
        with HARTS L1. Shards are still balanced by original tokens only.
(b) Pack each replica with CP-SAT (the model below): fewest microbatches
    with C(M) <= T first, then least total compact work.
(c) Align counts: K = the largest per-replica count. A replica with fewer
    trajectories than K first receives trajectories (each as its own
    microbatch) from replicas with trajectories to spare, cheapest departure
    first; only tiny or degenerate steps need this. Then every replica splits
    its heaviest splittable microbatch at the cut with the least work
    increase until it has K.
(d) Slots: each replica's microbatches by decreasing work (ties: lowest
    first member) take slots 0, 1, ...

Invariant afterwards: `verify_partition` holds (every trajectory in exactly
one non-empty microbatch, C(M) <= T under the exact cost, K a multiple of D,
the (replica, slot) grid complete); microbatch i sits at slot i // D and
replica i % D, as in `partition_microbatches`.

The CP-SAT model of one replica (n trajectories in sorted order, B bins):
* The replica's compressed prefix trie: one node per distinct branch point or
  trajectory end, weight w_v = depth(v) - depth(parent(v)), so that C(M) is
  the total weight of the nodes on the root paths of M's members (the trie
  of M is the union of those paths). Built from lengths and LCPs alone.
* Booleans x[i, b] (trajectory i in bin b), y[b] (bin b used), u[v, b]
  (node v is paid for in bin b). Constraints: exactly one b per i;
  x[i, b] -> u[end(i), b]; u[v, b] -> u[parent(v), b]; x[i, b] -> y[b];
  sum_v w_v u[v, b] <= T * y[b]; y[b] <= sum_i x[i, b].
* Soundness: the implications force u[v, b] = 1 on every node of every
  member's root path, so sum_v w_v u[v, b] >= C(M_b), and the capacity row
  bounds the true C(M_b) by T. Completeness: setting u to the OR of the
  members makes the row exactly C(M_b), so every partition whose exact
  costs fit (relabelled as below, into at most B bins) is admitted; nothing
  is approximated. Every answer is rechecked with the exact C(M) anyway, and
  the better of it and the hint (below) is kept.
* Objective: (W + 1) * sum_b y[b] + sum_b sum_v w_v u[v, b], W an upper
  bound on the total work (min(sum of lengths, B * T)), so fewer bins always
  wins and work breaks ties; at an optimum u is exactly the OR, so the
  second term is the true total compact work.
* Search aids that cut no optimal solution: B = the count of the replica's
  sorted-order next-fit packing (feasible, so an optimal count is <= B);
  sum y >= ceil(C(replica) / T); bins used in order (y[b] >= y[b+1]) and
  trajectory i only in bins 0..i (relabel bins by their first member). The
  next-fit packing is also given as a solution hint, as an OR-Tools user
  would warm-start the solver.
* Budget and determinism: one search worker with the given seed. The budget
  is CP-SAT's deterministic time (`max_deterministic_time`), so the same
  input, seed and budget give the same plan on any machine and under any
  load (a wall-clock limit would not). Wall time runs over it: 1.5-2.6x on
  the paper-scale step on a busy 2-core machine. The paper's budget is per
  rank; here the replicas are solved one after another, so planning time
  adds up over D. `first_feasible` stops each replica at CP-SAT's first
  solution (the paper's planning-time setting); with the hint that is
  usually the hint itself.

Legend for shape suffixes: N positions (whole step), V trie nodes, B bins.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from harts.compiler.ir.partition import L1Partition
from harts.compiler.partition.assignment import check_step_fits
from harts.compiler.partition.contiguous import natural_partition
from harts.compiler.prefix_cost import PrefixCostModel
from harts.schema.errors import PassFailedError

PASS_NAME = "partition_ffd"
SHARD_UNITS = ("trajectory", "subtree")  # what first-fit decreasing places on replicas (module doc, step a)


# --------------------------------------------------------------------------- (a) shard


def ffd_shard(lengths, dp: int) -> np.ndarray:
    """int32[N]: the replica of each position, by original-token first-fit decreasing (see module doc)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    share = -(-int(lengths.sum()) // dp)
    load = np.zeros(dp, dtype=np.int64)
    replica_of = np.empty(len(lengths), dtype=np.int32)
    for x in np.argsort(-lengths, kind="stable").tolist():
        fits = np.flatnonzero(load + lengths[x] <= share)
        r = int(fits[0]) if fits.size else int(np.argmin(load))
        replica_of[x] = r
        load[r] += lengths[x]
    return replica_of


def subtree_shards(model: PrefixCostModel, dp: int) -> np.ndarray:
    """int64[N]: shard id of each position; shards are maximal trie subtrees of <= ceil(S / D) original tokens.

    Start from the whole step; a run of sorted positions over the share is
    cut at every position where its least interior LCP occurs, i.e. into the
    subtrees below its top branch point. A single trajectory is always a
    shard. Shards are contiguous runs, numbered in sorted order.
    """
    n = model.num_trajectories
    share = -(-int(model.lengths.sum()) // dp)
    cumulative = np.append(0, np.cumsum(model.lengths))
    starts = []
    todo = [(0, n - 1)] if n else []
    while todo:
        start, end = todo.pop()
        if end == start or cumulative[end + 1] - cumulative[start] <= share:
            starts.append(start)
            continue
        inner = model.lcp[start + 1:end + 1]
        cuts = (start + 1 + np.flatnonzero(inner == inner.min())).tolist()
        bounds = [start, *cuts, end + 1]
        todo += [(a, b - 1) for a, b in zip(bounds, bounds[1:])]
    shard_of = np.zeros(n, dtype=np.int64)
    starts.sort()
    shard_of[starts[1:]] = 1
    return np.cumsum(shard_of)


def shard_replicas(model: PrefixCostModel, dp: int, unit: str) -> np.ndarray:
    """int32[N]: each position's replica: FFD by original tokens over trajectories or over subtree shards."""
    if unit == "trajectory":
        return ffd_shard(model.lengths, dp)
    shard_of = subtree_shards(model, dp)
    return ffd_shard(np.bincount(shard_of, weights=model.lengths).astype(np.int64), dp)[shard_of]


# --------------------------------------------------------------------------- (b) pack one replica


@dataclass(frozen=True, slots=True)
class PrefixTrie:
    """Compressed prefix trie of sorted trajectories; node 0 is the root (depth 0)."""

    parent: np.ndarray  # int64[V], -1 for the root
    weight: np.ndarray  # int64[V], tokens on the edge into the node (root: 0)
    end: np.ndarray     # int64[n], the node where each trajectory ends

    def cost(self, members) -> int:
        """C(M): total weight of the union of the members' root paths (plain loop, for checks)."""
        covered = set()
        for v in self.end[np.asarray(members, dtype=np.int64)].tolist():
            while v > 0 and v not in covered:
                covered.add(v)
                v = int(self.parent[v])
        return int(sum(int(self.weight[v]) for v in covered))


def build_prefix_trie(lengths, lcp) -> PrefixTrie:
    """The trie of sorted trajectories from their lengths and neighbour LCPs (one stack walk, O(n)).

    The stack holds the current rightmost root path. Trajectory i pops the
    nodes deeper than lcp[i]; if the path has no node at depth lcp[i], one is
    inserted above the last popped node (a branch point); then i's end node
    hangs below it, unless i ends there (a duplicate of its predecessor).
    """
    lengths = np.asarray(lengths, dtype=np.int64).tolist()
    lcp = np.asarray(lcp, dtype=np.int64).tolist()
    depth, parent = [0], [-1]
    end = []
    stack = [0]
    for length, shared in zip(lengths, lcp):
        popped = -1
        while depth[stack[-1]] > shared:
            popped = stack.pop()
        if depth[stack[-1]] < shared:
            branch = len(depth)
            depth.append(shared)
            parent.append(stack[-1])
            parent[popped] = branch
            stack.append(branch)
        if length > shared:
            depth.append(length)
            parent.append(stack[-1])
            stack.append(len(depth) - 1)
        end.append(stack[-1])
    depth_V = np.asarray(depth, dtype=np.int64)
    parent_V = np.asarray(parent, dtype=np.int64)
    weight_V = np.where(parent_V >= 0, depth_V - depth_V[np.maximum(parent_V, 0)], 0)
    return PrefixTrie(parent=parent_V, weight=weight_V, end=np.asarray(end, dtype=np.int64))


def _ids_from_starts(starts: np.ndarray, n: int) -> np.ndarray:
    ids = np.zeros(n, dtype=np.int64)
    ids[starts[1:]] = 1
    return np.cumsum(ids)


def _work_of(model: PrefixCostModel, bin_of: np.ndarray) -> np.ndarray:
    """int64[K]: exact C(M) of each bin (bins numbered 0..K-1, all non-empty)."""
    return np.array([model.cost(np.flatnonzero(bin_of == b)) for b in range(int(bin_of.max()) + 1)],
                    dtype=np.int64)


def _renumber(bin_of: np.ndarray) -> np.ndarray:
    """Bins renumbered 0..K-1 by first member, dropping empty ones."""
    _, first, inverse = np.unique(bin_of, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.reshape(-1)]


# Largest CP-SAT model one replica builds: assignment (trajectory x bin) and paid-node (trie node x bin)
# booleans. ~10,000 trajectories in ~40 bins is about 830,000 and takes ~1.7 GB and ~10 s to build.
FFD_MAX_VARIABLES = 1_000_000


def pack_replica(model: PrefixCostModel, capacity: int, *, time_budget_s: float, seed: int,
                 first_feasible: bool) -> tuple[np.ndarray, str]:
    """Pack one replica's sorted trajectories with CP-SAT; returns (bin of each local position, status).

    `model` prices the replica's own sorted subsequence. See the module
    docstring for the model and why it is exact.
    """
    from ortools.sat.python import cp_model  # import on use: `hartsc --planner harts` never needs it

    n = model.num_trajectories
    hint_of = _ids_from_starts(natural_partition(model, capacity), n)
    bins = int(hint_of[-1]) + 1
    lower = max(1, -(-model.total_unique_tokens // capacity))
    if bins == 1:
        return hint_of, "single microbatch"
    trie = build_prefix_trie(model.lengths, model.lcp)
    nodes = np.flatnonzero(trie.parent >= 0)  # every node but the root carries weight >= 1
    variables = bins + int(np.minimum(np.arange(1, n + 1), bins).sum()) + len(nodes) * bins
    if variables > FFD_MAX_VARIABLES:
        # Python builds the model one variable at a time (about 2 KB each, before any search), so a replica
        # with tens of thousands of trajectories would take minutes and gigabytes outside the time budget.
        return hint_of, (f"model too large ({variables:,} CP-SAT variables, more than {FFD_MAX_VARIABLES:,}), "
                         f"kept the next-fit packing ({bins} bins)")

    cp = cp_model.CpModel()
    used = [cp.NewBoolVar(f"y{b}") for b in range(bins)]
    x = [[cp.NewBoolVar(f"x{i},{b}") for b in range(min(i + 1, bins))] for i in range(n)]
    paid = {int(v): [cp.NewBoolVar(f"u{v},{b}") for b in range(bins)] for v in nodes}
    for i in range(n):
        cp.AddExactlyOne(x[i])
        end = paid[int(trie.end[i])]
        for b, xb in enumerate(x[i]):
            cp.AddImplication(xb, end[b])
            cp.AddImplication(xb, used[b])
    for v in nodes.tolist():
        p = int(trie.parent[v])
        if p > 0:
            for b in range(bins):
                cp.AddImplication(paid[v][b], paid[p][b])
    weights = [int(trie.weight[v]) for v in nodes]
    bin_work = []
    for b in range(bins):
        work = cp_model.LinearExpr.WeightedSum([paid[int(v)][b] for v in nodes], weights)
        cp.Add(work <= capacity * used[b])
        cp.Add(used[b] <= sum(x[i][b] for i in range(b, n)))
        bin_work.append(work)
        if b + 1 < bins:
            cp.AddImplication(used[b + 1], used[b])
    cp.Add(sum(used) >= lower)
    work_bound = min(int(model.lengths.sum()), bins * capacity)
    cp.Minimize((work_bound + 1) * sum(used) + sum(bin_work))

    # Hint: the next-fit packing, with each node paid in the bins whose members pass through it.
    covered = np.zeros((len(trie.parent), bins), dtype=bool)
    for i in range(n):
        v, b = int(trie.end[i]), int(hint_of[i])
        while v > 0 and not covered[v, b]:
            covered[v, b] = True
            v = int(trie.parent[v])
    # Hints as ints: a hint is a protobuf int field, and protobuf 7 refuses a bool there.
    for b in range(bins):
        cp.AddHint(used[b], 1)
    for i in range(n):
        for b, xb in enumerate(x[i]):
            cp.AddHint(xb, int(b == hint_of[i]))
    for v in nodes.tolist():
        for b in range(bins):
            cp.AddHint(paid[v][b], int(covered[v, b]))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = int(seed)
    solver.parameters.max_deterministic_time = float(time_budget_s)
    solver.parameters.stop_after_first_solution = bool(first_feasible)
    status = solver.Solve(cp)
    name = solver.StatusName(status).lower()

    hint_key = (bins, int(_work_of(model, hint_of).sum()))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint_of, f"cp-sat {name} in budget, kept the hint ({hint_key[0]} bins)"
    found = np.array([next(b for b, xb in enumerate(x[i]) if solver.BooleanValue(xb)) for i in range(n)],
                     dtype=np.int64)
    found = _renumber(found)
    work = _work_of(model, found)
    if work.max() > capacity:  # cannot happen if the model is sound; never let it through
        return hint_of, f"cp-sat answer rejected by the exact C(M) check, kept the hint ({bins} bins)"
    key = (len(work), int(work.sum()))
    if key > hint_key:
        return hint_of, f"cp-sat {name} {key[0]} bins work {key[1]} worse than the hint, kept the hint"
    return found, f"cp-sat {name}: {key[0]} bins (hint {bins}, bound {lower}), work {key[1]}"


# --------------------------------------------------------------------------- (c) align counts


def _best_cut(model: PrefixCostModel, members: np.ndarray) -> tuple[int, int]:
    """(increase, index) of the least-increase contiguous cut of sorted `members` (index: first of the right part).

    For any 2-split L, R of M some sorted neighbours land on different sides,
    and both sides then hold that pair's shared prefix, so C(L) + C(R) - C(M)
    >= the least neighbour LCP; cutting there achieves it. Ties: leftmost.
    """
    shared = model.lcp_between(members[:-1], members[1:])
    cut = int(np.argmin(shared))
    return int(shared[cut]), cut + 1


def _donate(model: PrefixCostModel, replica_of: np.ndarray, bin_of: np.ndarray, dp: int, target: int,
            decisions: list[str]) -> None:
    """Give every replica at least `target` trajectories, each arrival as its own new microbatch.

    A donor is a replica with more than `target` trajectories; among their
    trajectories the one whose departure adds least work moves (the prefix
    it shares with its nearest fellow member; ties: lower position).
    Mutates `replica_of` and `bin_of` (bins numbered per replica).
    """
    while True:
        count = np.bincount(replica_of, minlength=dp)
        short = np.flatnonzero(count < target)
        if not short.size:
            return
        receiver = int(short[0])
        best = None
        for r in np.flatnonzero(count > target).tolist():
            positions = np.flatnonzero(replica_of == r)
            for b in np.unique(bin_of[positions]).tolist():
                members = positions[bin_of[positions] == b]
                for k, x in enumerate(members.tolist()):
                    below = model.lcp_between(members[k - 1], x) if k > 0 else 0
                    above = model.lcp_between(x, members[k + 1]) if k + 1 < len(members) else 0
                    key = (int(max(below, above)), x)
                    if best is None or key < best[0]:
                        best = (key, r)
        (increase, x), donor = best
        bin_of[x] = int(bin_of[replica_of == receiver].max(initial=-1)) + 1
        replica_of[x] = receiver
        decisions.append(f"align: replica {receiver} has {count[receiver]} < {target} trajectories; "
                         f"moved position {x} from replica {donor} (+{increase} work)")
        # The donor may have emptied a microbatch: renumber its bins densely.
        donor_positions = np.flatnonzero(replica_of == donor)
        bin_of[donor_positions] = _renumber(bin_of[donor_positions])


def _split_to(model: PrefixCostModel, positions: np.ndarray, bin_of: np.ndarray, target: int) -> np.ndarray:
    """Split a replica's heaviest splittable microbatch at its least-increase cut until it has `target`.

    `positions` are the replica's sorted positions, `bin_of` their microbatch
    numbers; returns the new numbers. Ties: the lowest-numbered microbatch.
    """
    members = [positions[bin_of == b] for b in range(int(bin_of.max()) + 1)]
    work = [model.cost(m) for m in members]
    while len(members) < target:
        heaviest = max((b for b in range(len(members)) if len(members[b]) > 1), key=lambda b: (work[b], -b))
        _, cut = _best_cut(model, members[heaviest])
        left, right = members[heaviest][:cut], members[heaviest][cut:]
        members[heaviest], work[heaviest] = left, model.cost(left)
        members.append(right)
        work.append(model.cost(right))
    out = np.empty(len(positions), dtype=np.int64)
    for b, m in enumerate(members):
        out[np.searchsorted(positions, m)] = b
    return out


# --------------------------------------------------------------------------- the pass


def partition_ffd(lengths, lcp, *, capacity: int, dp: int, time_budget_s: float, seed: int,
                  first_feasible: bool, shard: str = "trajectory") -> L1Partition:
    """Run the OR-Tools+FFD planner; the result satisfies `verify_partition`.

    lengths: int[N] trajectory lengths in lexicographic order; lcp: int[N],
    lcp[0] = 0, lcp[i] = LCP(trajectory i-1, trajectory i). Deterministic for
    a given seed and budget (the budget is CP-SAT deterministic time).
    """
    model = PrefixCostModel.build(lengths, lcp)
    n = model.num_trajectories
    if capacity < 1 or dp < 1:
        raise ValueError(f"capacity and dp must be >= 1, got capacity={capacity}, dp={dp}")
    if not time_budget_s > 0 or not np.isfinite(time_budget_s):
        raise ValueError(f"time_budget_s must be a positive number of seconds, got {time_budget_s}")
    if shard not in SHARD_UNITS:
        raise ValueError(f"shard must be one of {SHARD_UNITS}, got {shard!r}")
    check_step_fits(model, capacity, dp, PASS_NAME)

    replica_of = shard_replicas(model, dp, shard)
    load = np.bincount(replica_of, weights=model.lengths, minlength=dp).astype(np.int64)
    decisions = [f"ffd shard by {shard}: original tokens per replica {load.tolist()} "
                 f"(share {-(-int(load.sum()) // dp)})"]

    bin_of = np.zeros(n, dtype=np.int64)  # microbatch number within its replica
    for r in range(dp):
        positions = np.flatnonzero(replica_of == r)
        if not positions.size:
            decisions.append(f"replica {r}: no trajectories")
            continue
        sub = PrefixCostModel.build(model.lengths[positions],
                                    np.append(0, model.lcp_between(positions[:-1], positions[1:])))
        started = time.perf_counter()
        local, status = pack_replica(sub, capacity, time_budget_s=time_budget_s, seed=seed,
                                     first_feasible=first_feasible)
        bin_of[positions] = local
        decisions.append(f"replica {r}: {len(positions)} trajectories, {status} "
                         f"({time.perf_counter() - started:.2f}s)")

    counts = [int(bin_of[replica_of == r].max()) + 1 if np.any(replica_of == r) else 0 for r in range(dp)]
    target = max(counts)
    if n < dp * target:
        raise PassFailedError(PASS_NAME, f"FFD sharding needs {target} microbatches on some replica, so {dp} replicas "
                                         f"need {dp * target} trajectories, but the step has {n}",
                              "use --planner harts (it packs across replicas), lower --dp or raise --capacity")
    _donate(model, replica_of, bin_of, dp, target, decisions)
    for r in range(dp):
        positions = np.flatnonzero(replica_of == r)
        before = int(bin_of[positions].max()) + 1
        if before < target:
            bin_of[positions] = _split_to(model, positions, bin_of[positions], target)
            decisions.append(f"align: replica {r} split {target - before} microbatches ({before} -> {target})")

    # (d) slots by decreasing work within each replica; then the grid numbering i = slot * D + replica.
    members, work, replica, slot = [], [], [], []
    for r in range(dp):
        positions = np.flatnonzero(replica_of == r)
        groups = [positions[bin_of[positions] == b] for b in range(target)]
        costs = [model.cost(g) for g in groups]
        for j, b in enumerate(sorted(range(target), key=lambda b: (-costs[b], int(groups[b][0])))):
            members.append(groups[b])
            work.append(costs[b])
            replica.append(r)
            slot.append(j)
    replica_K = np.asarray(replica, dtype=np.int32)
    slot_K = np.asarray(slot, dtype=np.int32)
    work_K = np.asarray(work, dtype=np.int64)
    grid_order = np.lexsort((replica_K, slot_K))
    work_K, replica_K, slot_K = work_K[grid_order], replica_K[grid_order], slot_K[grid_order]
    members = tuple(members[i] for i in grid_order.tolist())
    j_init = (int(work_K.sum()), int(work_K.reshape(target, dp).max(axis=1).sum()),
              int(np.bincount(replica_K, weights=work_K, minlength=dp).max()))
    name = f"ffd shard={shard} cp-sat " + ("first-feasible" if first_feasible else f"budget={time_budget_s:g}")
    decisions.append(f"selected {name}: K={len(members)} J_init={j_init}")
    return L1Partition(members=members, work=work_K, replica=replica_K, slot=slot_K, candidate=name,
                       j_init=j_init, decisions=tuple(decisions))
