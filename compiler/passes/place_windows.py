"""L2 of the global planner: reuse-aware placement of consumers into sharing windows.

Reads: the step's sorted trajectories (`TrieIR.lengths`, `TrieIR.lcp`), L1's
`L1Partition` (its consumer count K = D x J is kept), the capacity T and the
data-parallel degree D.

Adds: an `L2Placement`: the final members of every consumer, its (replica,
slot), windows as ranges of consecutive slots shared by all replicas, and per
(window, replica) a producer: the set of trajectory prefixes it computes once
for the window's consumers on that replica. Each consumer member records how
many of its leading positions the producer serves (`cached_prefix`).

Invariant afterwards (checked by `verify_placement`): every trajectory lies
in exactly one consumer; every consumer's complete layout and every producer
fits the capacity T; consumers fill the D x J grid; windows tile the slots;
a member's cached prefix is computed by its own window's producer on its own
replica and is shared with a member of another consumer there (a prefix only
one consumer uses is never cached); members of one consumer that share a row
agree on whether it is cached.

Paper: Section 3.2 ("L2: Reuse-aware placement"), Section 3.4 ("Window-scoped
reuse") and Appendix A.2. Our copy lost the definitions around Equation A.2;
the choices filling the gaps are:

* Costs. For one entity e (a consumer's residual rows, or a producer) on
  replica d, `i` ranges over the runs of rows e computes: every trajectory
  contributes one run, its new rows at depths [a_i, k_i), so q_i = k_i - a_i
  rows are computed and k_i is the depth of the run's last key. Then
  A = sum q_i (k_i - q_i) + q_i (q_i + 1) / 2 is exactly the number of causal
  query-key pairs (sum over computed rows of depth + 1) and R = sum q_i k_i
  the rectangle a blockwise attention backward touches. n is the number of
  computed rows. c_F = alpha_F n + beta_F A and c_B = alpha_B n + beta_B R, in
  integer units of one attention pair: alpha_F = 65,536 (a token's linear
  work is 40k-65k pairs' for the paper's models: 2 x active parameters over
  ~4 x head width x heads x full-attention layers), beta_F = 1, and backward
  twice forward (alpha_B = 131,072, beta_B = 2). `L2Options` holds the four
  weights; `hartsc --pairs-per-token R` sets alpha_F = R for another model
  (0: rows only). `harts stats` reports balance in tokens (Section 5.3), so a plan
  balanced in this cost model can show a slightly lower token balance.
* Phi is Equation 2 with these costs; candidates compare lexicographically by
  (Phi, producer + residual tokens, normalised imbalance 1 - sum of all costs
  / (D Phi), largest replica total cost). Replay rows ("alignment padding")
  are decided after placement by `plan_replay` and are not in the count; they
  are below one chunk per sequence. No candidate may run more decoder tokens
  than L1's consumers would without windows.
* Producers (Equation A.3, g_{d,w}): a producer computes exactly the rows
  that >= 2 consumers of its (window, replica) use, below an optional depth
  cap h_{d,w}; g_{d,w} = sum_j h_{d,j} - p_{d,w} > 0 is then the tokens it
  saves. The cap is lowered (binary search) only when the producer would
  exceed T. Rows used by one consumer stay in that consumer.
* Search. For each window count W in `window_counts` (windows of near-equal
  length, longer first), the candidates are:
  - "l1-grid": L1's consumers at L1's (replica, slot);
  - "l1-trie-rank": L1's consumers, each slot's consumers given to replicas in
    trie order of their first member (prefix-affine consumers share a replica);
  - "l1-affine": L1's consumers, each window's re-dealt to cells by load
    rank with affinity (as "ranked-affine" below, without repacking);
  - both again with every (window, replica) repacked ("... repacked");
  - "repack": a contiguous split of the sorted order into D x W cells whose
    largest is as small as possible (binary search on a per-slot bound, then
    a DP for the least LCP duplicated at the cuts), each cell repacked;
  - "dealt": contiguous windows whose intact subtrees are dealt, heaviest
    first, to the lightest cell, each cell repacked;
  - "ranked": each window packed at once into its D x S consumers, which are
    then grouped by descending cost, D per slot, the heavier consumer of a
    group to the cell with the lighter total so far (L1's initial
    assignment): balance first, prefix affinity second;
  - "ranked-affine": the same groups, each after the first matched to the
    cells by the rows its consumers would find cached there. Which cell of
    a slot gets which of its D consumers does not change the slot's maximum
    before caching, so affinity is free there; on tree-step workloads it
    keeps a task's branches on one replica (paper-scale D = 8: Phi -4.3%,
    decoder rows -5.9% against "ranked").
  Repacking is the paper's: intact subtrees (cut at their shallowest fork or
  prefix only while their complete layout exceeds T) go in descending own
  rows, the estimated residual cost, to the least-loaded consumer whose
  complete layout still fits them (exact LCP costs). If that fails, two
  fallbacks charge the duplicated prefix rows (load + growth - own), then
  prefer the consumer sharing most (least growth).
  Each candidate orders the consumers of every (window, replica) by
  descending forward + backward residual cost (slot order) and gives each
  window's cells to replicas heaviest first onto the lightest replica.
* Depth adjustments, on the best candidate: consumers above their window's
  mean cost export a nested prefix (a member that is a prefix of another
  member, or a duplicate) to a consumer of the same (window, replica) with
  room; its rows then become shared, so the producer computes them and the
  heavy consumer's residual shrinks. Kept when Phi does not grow.
* Local refinement (at most `refine_steps` rounds): push rounds take the
  heaviest consumer and try exports, moving one of its nested chains to the
  lightest consumers of its own cell (whole-trajectory repacking within the
  window) or of other cells of its window (an exchange between heavy and
  light replicas, allowed only if tokens do not grow), and swapping a chain
  for a smaller one there; pull rounds take the consumer furthest below its
  slot's maximum and try moving in the tail of a nested chain (its longest
  members) whose history it can hold. Each move is evaluated exactly
  (capacities of complete layouts and producers included) and kept when
  (Phi, sum of squared costs) decreases; the squared costs level work where
  Phi alone is flat. Refinement runs again after the exchanges below.
* Placement exchanges (at most `exchange_rounds` accepted): two consumers of
  one window on different replicas trade places. Complete layouts do not
  change, so only producers can break capacity; the cost is that a consumer
  leaves the producer that cached its shared rows. Moving trajectories rarely
  levels slots on long-context workloads (a chain's history rarely fits in
  another consumer), while trading whole consumers matches the replicas'
  slot profiles. Every swap is first scored by a surrogate (slots of a cell
  re-sorted, the window's sum of slot maxima; costs held fixed, and again
  with the moved consumers' caching re-estimated), the two rankings are
  interleaved and evaluated exactly in order, and the first swap that
  lowers (Phi, sum of squared costs) with tokens within L1's is kept.

Everything is deterministic; no randomness is used (`seed` is recorded only).
Legend: N sorted positions, K consumers, D replicas, J slots, W windows,
G = W x D cells (one per window and replica).
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import numpy as np

from harts.compiler.passes.partition_microbatches import L1Partition
from harts.compiler.prefix_cost import INFEASIBLE, PrefixCostModel, RangeMin
from harts.schema.cost_model import row_cost_weights
from harts.schema.errors import PassFailedError, VerificationError

PASS_NAME = "place_windows"
NO_CAP = np.int64(1) << 40   # a depth cap no trajectory reaches


@dataclass(frozen=True, slots=True)
class L2Options:
    """Cost weights and search bounds of L2 (see the module docstring for the cost model)."""

    # Weights of Equation A.2 in units of one causal attention pair.
    token_cost_forward: int = 65536     # alpha_F: linear-layer work of one computed row
    pair_cost_forward: int = 1          # beta_F: one query-key pair forward
    token_cost_backward: int = 131072   # alpha_B: backward is about twice forward
    pair_cost_backward: int = 2         # beta_B
    # Window counts tried (each capped at J); windows have near-equal lengths.
    window_counts: tuple[int, ...] = (1, 2, 4)
    # Longest window in slots (0: no limit); raises the smallest window count tried.
    max_window_slots: int = 0
    # Repack candidates cut subtrees whose complete layout exceeds this fraction
    # of T (one candidate per value): smaller units pack more evenly but share
    # more prefix rows between consumers.
    repack_shares: tuple[float, ...] = (1.0,)
    # Local refinement: at most this many accepted or rejected move rounds.
    refine_steps: int = 32
    # Placement exchanges: at most this many accepted whole-consumer swaps; each
    # round scans at most `exchange_candidates` surrogate-ranked swaps, and all
    # rounds together evaluate at most `exchange_evaluations` exactly. A trial
    # re-evaluates only its two cells (~0.25 ms at paper scale), so the budget
    # keeps a paper-scale tree-step step at D = 8 under 1.5 s of planning
    # (benchmarks/bench_planners.py); step-wise stops on its own after ~160.
    exchange_rounds: int = 150
    exchange_candidates: int = 128
    exchange_evaluations: int = 1200
    seed: int = 0                       # recorded only: the pass is deterministic

    @classmethod
    def for_pairs_per_token(cls, pairs_per_token: int, **fields) -> "L2Options":
        """Weights for a model whose row costs `pairs_per_token` attention pairs (`hartsc --pairs-per-token`;
        `harts.schema.cost_model.row_cost_weights`, which `harts stats` uses too)."""
        weights = row_cost_weights(pairs_per_token)
        return cls(token_cost_forward=weights.token_forward, pair_cost_forward=weights.pair_forward,
                   token_cost_backward=weights.token_backward, pair_cost_backward=weights.pair_backward, **fields)


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


# --------------------------------------------------------------------------- exact evaluation


@dataclass(slots=True)
class _Eval:
    """Exact rows and costs of one assignment (see `_evaluate`)."""

    cached: np.ndarray     # int64[N]: cached prefix of each position
    lcp_consumer: np.ndarray  # int64[N]: LCP with the previous member of the same consumer (0 for the first)
    lcp_cell: np.ndarray   # int64[N]: LCP with the previous position of the same cell (0 for the first)
    full: np.ndarray       # int64[K]: complete layout size of each consumer
    res_n: np.ndarray      # int64[K]
    res_f: np.ndarray      # int64[K]: residual forward cost
    res_b: np.ndarray      # int64[K]
    pro_n: np.ndarray      # int64[G]
    pro_f: np.ndarray      # int64[G]
    pro_b: np.ndarray      # int64[G]


def _evaluate(model: PrefixCostModel, options: L2Options, consumer_of: np.ndarray, cell_of_consumer: np.ndarray,
              cap_of_cell: np.ndarray, K: int, G: int) -> _Eval:
    """Rows and costs of every consumer and producer, exactly, in O(N log N) numpy.

    A row of x at depth i is cached when another consumer of x's cell shares it
    (LCP(x, y) > i for some y there) and i < the cell's cap. The largest LCP of
    x with another consumer's member is reached at the nearest such member
    below or above x in sorted order, which the run structure of the cell-
    sorted sequence gives directly. Consumer residual rows of x: depths
    [max(lcp in consumer, cached), len); producer rows first created by x:
    depths [lcp in cell, max(lcp in cell, cached)).
    """
    positions = np.arange(model.num_trajectories, dtype=np.int64)
    return _evaluate_positions(model, options, positions, consumer_of, cell_of_consumer, cap_of_cell, K, G)


def _reevaluate(model: PrefixCostModel, options: L2Options, base: _Eval, consumer_of: np.ndarray,
                cell_of_consumer: np.ndarray, cap_of_cell: np.ndarray, cells, members_changed: bool = True) -> _Eval:
    """`_evaluate` of an assignment that differs from `base`'s only inside `cells`, in time of those cells.

    Every quantity of a position depends only on the members of its own
    consumer and cell, and a consumer's or producer's costs only on its
    positions; so a move or swap confined to `cells` (which must hold every
    consumer it touches, before and after) changes nothing elsewhere, and
    re-evaluating those cells' positions gives exactly `_evaluate`'s result.
    When no consumer's members changed (a swap of cells), each position's LCP
    within its consumer is `base`'s.
    """
    K, G = len(cell_of_consumer), len(cap_of_cell)
    cells = np.asarray(cells, dtype=np.int64)
    touched = np.zeros(G, dtype=bool)
    touched[cells] = True
    consumers = np.flatnonzero(touched[cell_of_consumer])
    positions = np.flatnonzero(touched[cell_of_consumer[consumer_of]])
    part = _evaluate_positions(model, options, positions, consumer_of, cell_of_consumer, cap_of_cell, K, G,
                               None if members_changed else base.lcp_consumer[positions])

    def spliced(old: np.ndarray, new: np.ndarray, index: np.ndarray, take: np.ndarray) -> np.ndarray:
        out = old.copy()
        out[index] = new[take]
        return out

    local = np.arange(len(positions))
    return _Eval(*(spliced(getattr(base, name), getattr(part, name), positions, local)
                   for name in ("cached", "lcp_consumer", "lcp_cell")),
                 *(spliced(getattr(base, name), getattr(part, name), consumers, consumers)
                   for name in ("full", "res_n", "res_f", "res_b")),
                 *(spliced(getattr(base, name), getattr(part, name), cells, cells)
                   for name in ("pro_n", "pro_f", "pro_b")))


def _evaluate_positions(model: PrefixCostModel, options: L2Options, positions: np.ndarray, consumer_of: np.ndarray,
                        cell_of_consumer: np.ndarray, cap_of_cell: np.ndarray, K: int, G: int,
                        lcp_consumer: np.ndarray | None = None) -> _Eval:
    """`_evaluate` restricted to sorted `positions`, a union of whole cells.

    Per-position fields are aligned with `positions`; consumer and producer
    fields are full-length, exact for the consumers and cells inside and 0
    elsewhere. `lcp_consumer`, when given, is each position's LCP with the
    previous member of its consumer, known already.
    """
    n = model.num_trajectories
    m = len(positions)
    lengths = model.lengths[positions]
    local = np.arange(m, dtype=np.int64)
    consumer = consumer_of[positions]
    cell = cell_of_consumer[consumer]

    if lcp_consumer is None:
        by_consumer = np.argsort(consumer, kind="stable")   # positions are sorted: ties stay in order
        same = consumer[by_consumer[1:]] == consumer[by_consumer[:-1]]
        lcp_consumer = np.zeros(m, dtype=np.int64)
        lcp_consumer[by_consumer[1:]] = np.where(
            same, model.neighbour_lcp(np.where(same, positions[by_consumer[:-1]], -1), positions[by_consumer[1:]]), 0)

    by_cell = np.argsort(cell, kind="stable")
    cell_sorted = cell[by_cell]
    consumer_sorted = consumer[by_cell]
    global_sorted = positions[by_cell]
    same_cell = cell_sorted[1:] == cell_sorted[:-1]
    lcp_cell = np.zeros(m, dtype=np.int64)
    lcp_cell[by_cell[1:]] = np.where(
        same_cell, model.neighbour_lcp(np.where(same_cell, global_sorted[:-1], -1), global_sorted[1:]), 0)
    # Runs of one consumer inside the cell-sorted sequence; the nearest member
    # of another consumer is just outside the run.
    new_run = np.ones(m, dtype=bool)
    new_run[1:] = ~same_cell | (consumer_sorted[1:] != consumer_sorted[:-1])
    run_start = np.maximum.accumulate(np.where(new_run, local, 0))
    run_last = np.ones(m, dtype=bool)
    run_last[:-1] = new_run[1:]
    run_end = np.minimum.accumulate(np.where(run_last, local, m)[::-1])[::-1]
    before = run_start - 1
    before_ok = (before >= 0) & (cell_sorted[np.maximum(before, 0)] == cell_sorted)
    after = run_end + 1
    after_ok = (after < m) & (cell_sorted[np.minimum(after, m - 1)] == cell_sorted)
    below = model.neighbour_lcp(np.where(before_ok, global_sorted[np.maximum(before, 0)], -1), global_sorted)
    above = model.neighbour_lcp(global_sorted, np.where(after_ok, global_sorted[np.minimum(after, m - 1)], n))
    other = np.zeros(m, dtype=np.int64)
    other[by_cell] = np.maximum(below, above)
    cached = np.minimum(np.minimum(other, lengths), cap_of_cell[cell])

    # Consumer residual run of each position: [start, lengths).
    start = np.maximum(lcp_consumer, cached)
    q = lengths - start
    tf, pf, tb, pb = (options.token_cost_forward, options.pair_cost_forward,
                      options.token_cost_backward, options.pair_cost_backward)
    pairs = q * start + q * (q + 1) // 2
    rect = q * lengths
    res_n = np.bincount(consumer, weights=q, minlength=K).astype(np.int64)
    res_f = tf * res_n + pf * np.bincount(consumer, weights=pairs, minlength=K).astype(np.int64)
    res_b = tb * res_n + pb * np.bincount(consumer, weights=rect, minlength=K).astype(np.int64)
    full = np.bincount(consumer, weights=lengths - lcp_consumer, minlength=K).astype(np.int64)

    top = np.maximum(cached, lcp_cell)
    pq = top - lcp_cell
    pro_n = np.bincount(cell, weights=pq, minlength=G).astype(np.int64)
    pro_f = tf * pro_n + pf * np.bincount(cell, weights=pq * lcp_cell + pq * (pq + 1) // 2, minlength=G).astype(np.int64)
    pro_b = tb * pro_n + pb * np.bincount(cell, weights=pq * top, minlength=G).astype(np.int64)
    return _Eval(cached, lcp_consumer, lcp_cell, full, res_n, res_f, res_b, pro_n, pro_f, pro_b)


# --------------------------------------------------------------------------- scoring a layout


@dataclass(slots=True)
class _Layout:
    """A complete candidate: membership, cells, and the derived grid and key."""

    name: str
    consumer_of: np.ndarray        # int64[N]
    cell_of_consumer: np.ndarray   # int64[K]: cell = window * D + column (column: not yet a replica)
    window_start: np.ndarray       # int64[W + 1]
    cap_of_cell: np.ndarray        # int64[G]
    ev: _Eval | None = None
    slot: np.ndarray | None = None        # int64[K]
    replica_of_cell: np.ndarray | None = None  # int64[G]
    key: tuple | None = None


def _window_sizes(slots: int, windows: int) -> list[int]:
    base, extra = divmod(slots, windows)
    return [base + (1 if w < extra else 0) for w in range(windows)]


def _score(model: PrefixCostModel, options: L2Options, layout: _Layout, dp: int, capacity: int,
           allow_caps: bool = True, ev: _Eval | None = None) -> bool:
    """Evaluate (unless `ev` is the layout's evaluation already), cap oversized producers, order slots
    and replicas, and compute the key.

    Returns False when a consumer's complete layout exceeds the capacity, or
    a producer does and `allow_caps` is off (local moves keep the caps).
    """
    K = len(layout.cell_of_consumer)
    W = len(layout.window_start) - 1
    G = W * dp
    if ev is None:
        ev = _evaluate(model, options, layout.consumer_of, layout.cell_of_consumer, layout.cap_of_cell, K, G)
    if ev.full.max(initial=0) > capacity:
        return False
    oversized = np.flatnonzero(ev.pro_n > capacity)
    if oversized.size and not allow_caps:
        return False
    if oversized.size:
        layout.cap_of_cell = layout.cap_of_cell.copy()
        for g in oversized.tolist():
            layout.cap_of_cell[g] = _largest_cap(model, options, layout, g, capacity, K, G)
        ev = _evaluate(model, options, layout.consumer_of, layout.cell_of_consumer, layout.cap_of_cell, K, G)
    layout.ev = ev

    consumer_cost = ev.res_f + ev.res_b
    # Slot order within each cell: descending residual cost (ties: consumer id).
    order = np.lexsort((np.arange(K), -consumer_cost, layout.cell_of_consumer))
    cells_sorted = layout.cell_of_consumer[order]
    first_of_cell = np.searchsorted(cells_sorted, np.arange(G))
    rank = np.arange(K) - first_of_cell[cells_sorted]
    window_of_cell = np.arange(G) // dp
    slot = np.empty(K, dtype=np.int64)
    slot[order] = layout.window_start[window_of_cell[cells_sorted]] + rank
    layout.slot = slot

    # Replicas: per window, heaviest cell first onto the lightest replica so far.
    cell_cost = np.bincount(layout.cell_of_consumer, weights=consumer_cost, minlength=G).astype(np.int64)
    cell_cost += ev.pro_f + ev.pro_b
    replica_of_cell = np.empty(G, dtype=np.int64)
    totals = np.zeros(dp, dtype=np.int64)
    for w in range(W):
        cells = np.arange(w * dp, (w + 1) * dp)
        heavy_first = cells[np.argsort(-cell_cost[cells], kind="stable")]
        light_first = np.argsort(totals, kind="stable")
        replica_of_cell[heavy_first] = light_first
        totals[light_first] += cell_cost[heavy_first]
    layout.replica_of_cell = replica_of_cell
    layout.key = _key(layout, dp)
    return True


def _largest_cap(model, options, layout: _Layout, cell: int, capacity: int, K: int, G: int) -> int:
    """The deepest sharing cap that keeps one producer within capacity (binary search on depth)."""
    lo, hi = 0, int(model.lengths.max())
    caps = layout.cap_of_cell.copy()
    # A producer's rows depend on its own cell's positions only.
    positions = np.flatnonzero(layout.cell_of_consumer[layout.consumer_of] == cell)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        caps[cell] = mid
        ev = _evaluate_positions(model, options, positions, layout.consumer_of, layout.cell_of_consumer, caps, K, G)
        if ev.pro_n[cell] <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _grid_costs(layout: _Layout, dp: int):
    """Per (replica, slot) consumer forward/backward costs and per (replica, window) producer costs."""
    ev = layout.ev
    K = len(layout.cell_of_consumer)
    J = K // dp
    W = len(layout.window_start) - 1
    replica = layout.replica_of_cell[layout.cell_of_consumer]
    fwd = np.zeros((dp, J), dtype=np.int64)
    bwd = np.zeros((dp, J), dtype=np.int64)
    fwd[replica, layout.slot] = ev.res_f
    bwd[replica, layout.slot] = ev.res_b
    pf = np.zeros((dp, W), dtype=np.int64)
    pb = np.zeros((dp, W), dtype=np.int64)
    cells = np.arange(W * dp)
    pf[layout.replica_of_cell, cells // dp] = ev.pro_f
    pb[layout.replica_of_cell, cells // dp] = ev.pro_b
    return fwd, bwd, pf, pb


def _format_key(key: tuple) -> str:
    """A placement key for people: (Phi, decoder tokens, imbalance, largest replica total)."""
    phi, tokens, imbalance, replica_total = key
    return f"Phi {phi:.4e}, {tokens:,} decoder tokens, imbalance {imbalance:.2%}, largest replica {replica_total:.4e}"


def _key(layout: _Layout, dp: int) -> tuple:
    fwd, bwd, pf, pb = _grid_costs(layout, dp)
    phi = int(fwd.max(axis=0).sum() + bwd.max(axis=0).sum() + pf.max(axis=0).sum() + pb.max(axis=0).sum())
    total = int(fwd.sum() + bwd.sum() + pf.sum() + pb.sum())
    tokens = int(layout.ev.res_n.sum() + layout.ev.pro_n.sum())
    imbalance = 1.0 - total / (dp * phi) if phi else 0.0
    replica_total = int((fwd.sum(axis=1) + bwd.sum(axis=1) + pf.sum(axis=1) + pb.sum(axis=1)).max())
    return (phi, tokens, imbalance, replica_total)


# --------------------------------------------------------------------------- candidates from L1


def _l1_layouts(model, options: L2Options, partition: L1Partition, dp: int,
                window_start: np.ndarray) -> list[_Layout]:
    """L1's consumers kept intact: at L1's replicas, ranked by trie order within each slot, and (within
    L1's windows) re-dealt by load rank with affinity (`_rank_columns`)."""
    K = partition.num_microbatches
    consumer_of = np.empty(model.num_trajectories, dtype=np.int64)
    for k, members in enumerate(partition.members):
        consumer_of[members] = k
    slot = partition.slot.astype(np.int64)
    window = np.searchsorted(window_start, slot, side="right") - 1
    W = len(window_start) - 1
    caps = np.full(W * dp, NO_CAP, dtype=np.int64)
    grid = _Layout(f"l1-grid W={W}", consumer_of, window * dp + partition.replica.astype(np.int64), window_start, caps)
    first = np.array([int(m[0]) for m in partition.members], dtype=np.int64)
    column = np.empty(K, dtype=np.int64)
    for j in range(K // dp):
        in_slot = np.flatnonzero(slot == j)
        column[in_slot[np.argsort(first[in_slot], kind="stable")]] = np.arange(dp)
    ranked = _Layout(f"l1-trie-rank W={W}", consumer_of, window * dp + column, window_start, caps)
    members = [np.asarray(m, dtype=np.int64) for m in partition.members]
    loads = np.array([_layout_cost(model, options, m) for m in members], dtype=np.int64)
    affine = np.empty(K, dtype=np.int64)
    for w in range(W):
        ks = np.flatnonzero(window == w)
        affine[ks] = w * dp + _rank_columns(model, [members[k] for k in ks.tolist()], loads[ks], dp, affine=True)
    return [grid, ranked, _Layout(f"l1-affine W={W}", consumer_of, affine, window_start, caps)]


def _l1_repacked_layouts(model, layouts: list[_Layout], capacity: int) -> list[_Layout]:
    """L1's cells with each cell's trajectories repacked (a cell that cannot be keeps L1's consumers)."""
    out = []
    for layout in layouts:
        repacked = _repacked(model, layout, capacity, capacity, f"{layout.name} repacked", keep_failed=True)
        if repacked is not None:
            out.append(repacked)
    return out


# --------------------------------------------------------------------------- repack candidates


def _cell_bounds_feasible(model: PrefixCostModel, bound: int, sizes: list[int]) -> bool:
    """Greedy furthest reach: can cells (in order) of C <= bound * S_g, each with >= S_g positions, cover all?"""
    n = model.num_trajectories
    prefix = model.unique_prefix_sum
    remaining = sum(sizes)
    start = 0
    for size in sizes:
        remaining -= size
        if start >= n:
            return False
        reach = prefix[start] - model.lcp[start] + bound * size
        end = min(int(np.searchsorted(prefix, reach, side="right")) - 2, n - 1 - remaining)
        if end < start + size - 1:
            return False
        start = end + 1
    return start >= n


def _contiguous_cells(model: PrefixCostModel, sizes: list[int], capacity: int) -> np.ndarray | None:
    """Cell starts (int64[G]) of a contiguous split with the smallest per-slot bound, then least cut LCPs.

    Cell g holds >= sizes[g] positions and C(cell) <= B * sizes[g] for the
    least B a greedy furthest-reach split achieves (binary search). Among the
    splits within that bound a DP picks the least sum of LCPs at the cuts
    (each cut duplicates that many prefix tokens in the later cell).
    """
    n = model.num_trajectories
    if sum(sizes) > n:
        return None
    lo = max(1, -(-model.total_unique_tokens // sum(sizes)))
    hi = max(lo, int(capacity))
    if not _cell_bounds_feasible(model, hi, sizes):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _cell_bounds_feasible(model, mid, sizes):
            hi = mid
        else:
            lo = mid + 1
    for slack in (1.0, 1.01, 1.03):
        starts = _least_cut_cells(model, [int(lo * slack) * s for s in sizes], sizes)
        if starts is not None:
            return starts
    return None


def _least_cut_cells(model: PrefixCostModel, bounds: list[int], sizes: list[int]) -> np.ndarray | None:
    """DP over cells: F_g[e] = min over feasible starts s of F_{g-1}[s-1] + lcp[s]; None if infeasible."""
    n = model.num_trajectories
    prefix = model.unique_prefix_sum
    reach_base = prefix[:-1] - model.lcp   # C(s..e) = prefix[e + 1] - reach_base[s]
    ends = np.arange(n, dtype=np.int64)   # also the candidate starts s, indexed the same way
    packing = np.int64(n + 1)
    best = np.full(n + 1, INFEASIBLE, dtype=np.int64)   # best[s]: least cut sum covering [0, s)
    best[0] = 0
    choice = np.zeros((len(sizes), n), dtype=np.int64)
    for g, (bound, size) in enumerate(zip(bounds, sizes)):
        first = np.searchsorted(reach_base, prefix[1:] - bound, side="left").astype(np.int64)
        last = ends - size + 1
        cost = best[:n] + np.where(ends > 0, model.lcp, 0)   # cost[s]: cells before s, plus the cut at s
        packed = np.where(cost >= INFEASIBLE, INFEASIBLE, cost * packing + ends)   # (cost, s): argmin rides along
        valid = first <= last
        table = RangeMin.build(packed)
        window_min = np.full(n, INFEASIBLE, dtype=np.int64)
        if valid.any():
            window_min[valid] = table.min(first[valid], np.maximum(last[valid], first[valid]))
        fresh = np.full(n + 1, INFEASIBLE, dtype=np.int64)
        ok = window_min < INFEASIBLE
        fresh[1:][ok] = window_min[ok] // packing
        choice[g, ok] = window_min[ok] % packing
        best = fresh
    if best[n] >= INFEASIBLE:
        return None
    starts = np.empty(len(sizes), dtype=np.int64)
    end = n - 1
    for g in range(len(sizes) - 1, -1, -1):
        starts[g] = choice[g, end]
        end = starts[g] - 1
    return starts


class _Cell:
    """Sorted positions of one cell (any subset of the step, ascending) and its subtree runs.

    Runs are local index ranges [i, j] of `positions`. A run's own rows are
    the rows of its trie that no position of the cell outside it shares:
    C(run) - |path(i)[:lcp_i] u path(j)[:lcp_{j+1}]| with the LCPs to its
    neighbours in the cell (0 at the cell's edges).
    """

    def __init__(self, model: PrefixCostModel, positions: np.ndarray):
        self.positions = np.asarray(positions, dtype=np.int64)
        m = len(self.positions)
        self.lengths = model.lengths[self.positions]
        self.lcp = np.zeros(m + 1, dtype=np.int64)   # lcp[i]: with the previous position; lcp[m] = 0
        if m > 1:
            self.lcp[1:m] = model.neighbour_lcp(self.positions[:-1], self.positions[1:])
        self.prefix = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(self.lengths - self.lcp[:m], out=self.prefix[1:])
        self.lcp_min = RangeMin.build(self.lcp[:m]) if m else None

    def _interior(self, i: int, j: int) -> int:
        return int(self.lcp_min.min(i + 1, j)) if j > i else int(self.lengths[i])

    def cost(self, i: int, j: int) -> int:
        """C of the run alone: the size of its own trie."""
        return int(self.lengths[i] + self.prefix[j + 1] - self.prefix[i + 1])

    def own(self, i: int, j: int) -> int:
        left, right = int(self.lcp[i]), int(self.lcp[j + 1])
        return self.cost(i, j) - (left + right - min(left, right, self._interior(i, j)))

    def children(self, i: int, j: int) -> list[tuple[int, int]]:
        """Cut a run at its shallowest divergence: sibling subtrees part, a prefix parts from its extensions."""
        interior = self._interior(i, j)
        cuts = (i + 1 + np.flatnonzero(self.lcp[i + 1:j + 1] == interior)).tolist()
        bounds = [i] + cuts + [j + 1]
        return [(a, b - 1) for a, b in zip(bounds[:-1], bounds[1:])]

    def units(self, unit_cost: int) -> list[tuple[int, np.ndarray, int]]:
        """Intact subtrees (own rows, positions, C), cut while C > unit_cost; descending own, ties by position."""
        out = []
        stack = [(0, len(self.positions) - 1)] if len(self.positions) else []
        while stack:
            i, j = stack.pop()
            cost = self.cost(i, j)
            if i == j or cost <= unit_cost:
                out.append((self.own(i, j), self.positions[i:j + 1], cost))
            else:
                stack.extend(reversed(self.children(i, j)))
        out.sort(key=lambda u: (-u[0], int(u[1][0])))
        return out


class _Consumers:
    """Members of a cell's consumers during packing, with exact complete-layout sizes."""

    def __init__(self, model: PrefixCostModel, count: int):
        self.model = model
        self.members: list[list[int]] = [[] for _ in range(count)]
        self.full = np.zeros(count, dtype=np.int64)
        self.load = np.zeros(count, dtype=np.int64)

    def growth(self, positions: np.ndarray, run_cost: int, which=None) -> np.ndarray:
        """Exact C increase of adding a run (consecutive in its cell, so no member lies inside it)
        to each consumer, or to the consumers listed in `which`."""
        model = self.model
        n = model.num_trajectories
        first, last = int(positions[0]), int(positions[-1])
        chosen = range(len(self.members)) if which is None else which
        below = np.empty(len(chosen), dtype=np.int64)
        above = np.empty(len(chosen), dtype=np.int64)
        for k, members in enumerate(self.members[c] for c in chosen):
            at = bisect.bisect_left(members, first)
            below[k] = members[at - 1] if at > 0 else -1
            above[k] = members[at] if at < len(members) else n
        left = model.neighbour_lcp(below, np.full_like(below, first))
        right = model.neighbour_lcp(np.full_like(above, last), above)
        joined = model.neighbour_lcp(below, above)
        return run_cost - left - right + joined

    def add(self, k: int, positions: np.ndarray, growth: int, own: int) -> None:
        members = self.members[k]
        at = bisect.bisect_left(members, int(positions[0]))
        members[at:at] = positions.tolist()
        self.full[k] += growth
        self.load[k] += own


def _pack_units(model: PrefixCostModel, units: list, count: int, capacity: int) -> list[list[int]] | None:
    """Longest processing time first: each unit to the least-loaded consumer whose complete layout fits it.

    Capacity uses exact LCP costs against the consumer's current members.
    When that fails (subtrees of one large tree each carry its trunk), the
    cell is packed again charging each consumer its load plus the prefix rows
    the unit would duplicate there, and failing that, to the fitting consumer
    it shares most with (least growth), then least load. None when nothing
    fits or a consumer would stay empty.
    """
    for rule in ("balance", "blend", "shared"):
        members = _pack_units_once(model, units, count, capacity, rule)
        if members is not None:
            return members
    return None


def _pack_units_once(model, units, count: int, capacity: int, rule: str) -> list[list[int]] | None:
    """One LPT pass, then a leveling repair; `rule` orders the fitting consumers: least load
    ("balance"), least load plus duplicated prefix rows ("blend"), or least growth then load ("shared")."""
    consumers = _Consumers(model, count)
    placed: list[list[tuple]] = [[] for _ in range(count)]
    index = np.arange(count)
    for unit in units:
        own, positions, cost = unit
        growth = consumers.growth(positions, cost)
        fits = consumers.full + growth <= capacity
        if not fits.any():
            return None
        if own == 0 or rule == "shared":
            # A unit no residual row comes with (a duplicate or prefix of another unit's
            # trajectory) costs only capacity: put it where it grows the layout least.
            order = np.lexsort((index, consumers.load, growth))
        elif rule == "balance":
            order = np.lexsort((index, growth, consumers.load))
        else:
            order = np.lexsort((index, growth, consumers.load + growth - own))
        k = int(order[np.argmax(fits[order])])
        consumers.add(k, positions, int(growth[k]), own)
        placed[k].append(unit)
    _level(model, consumers, placed, capacity)
    for k in range(count):
        while not consumers.members[k]:
            donor = int(np.argmax([len(m) for m in consumers.members]))
            if len(consumers.members[donor]) < 2:
                return None
            consumers.members[k].append(consumers.members[donor].pop(0))
    return consumers.members


def _level(model, consumers: _Consumers, placed: list[list[tuple]], capacity: int) -> None:
    """Repair an LPT result: move whole units from the heaviest consumers to the lightest while that
    lowers the larger of the two loads and both complete layouts fit (at most 2 x count moves)."""
    count = len(placed)
    for _ in range(2 * count):
        light = int(np.argmin(consumers.load))
        moved = False
        for heavy in np.argsort(-consumers.load, kind="stable")[:10].tolist():
            gap = int(consumers.load[heavy] - consumers.load[light])
            options = sorted((max(int(consumers.load[heavy]) - u[0], int(consumers.load[light]) + u[0]), i)
                             for i, u in enumerate(placed[heavy]) if 0 < u[0] < gap)
            for _, i in options[:3]:
                own, positions, cost = placed[heavy][i]
                growth = int(consumers.growth(positions, cost, [light])[0])
                if consumers.full[light] + growth > capacity:
                    continue
                remaining = sorted(set(consumers.members[heavy]) - set(positions.tolist()))
                if not remaining:
                    continue
                consumers.members[heavy] = remaining
                consumers.full[heavy] = model.cost(np.asarray(remaining, dtype=np.int64))
                consumers.load[heavy] -= own
                consumers.add(light, positions, growth, own)
                placed[light].append(placed[heavy].pop(i))
                moved = True
                break
            if moved:
                break
        if not moved:
            return


def _repacked(model: PrefixCostModel, layout: _Layout, capacity: int, unit_cost: int, name: str,
              keep_failed: bool) -> _Layout | None:
    """Repack every cell of `layout` from intact subtrees into its consumer count.

    A cell that cannot be repacked keeps its consumers when `keep_failed`
    (they fit already); otherwise the whole candidate is dropped.
    """
    consumer_of = layout.consumer_of.copy()
    K = len(layout.cell_of_consumer)
    cell_of_position = layout.cell_of_consumer[layout.consumer_of]
    by_cell = np.argsort(cell_of_position, kind="stable")
    bounds = np.searchsorted(cell_of_position[by_cell], np.arange(len(layout.cap_of_cell) + 1))
    for g in range(len(layout.cap_of_cell)):
        positions = by_cell[bounds[g]:bounds[g + 1]]
        consumers = np.flatnonzero(layout.cell_of_consumer == g)
        if not len(consumers):
            continue
        packed = _pack_units(model, _Cell(model, positions).units(unit_cost), len(consumers), capacity)
        if packed is None:
            if keep_failed:
                continue
            return None
        for k, members in zip(consumers.tolist(), packed):
            consumer_of[members] = k
    del K
    return _Layout(name, consumer_of, layout.cell_of_consumer, layout.window_start, layout.cap_of_cell)


def _cells_layout(model, cells: list[np.ndarray], sizes: list[int], dp: int, window_start: np.ndarray,
                  name: str) -> _Layout:
    """A placeholder layout whose cell g holds `cells[g]` spread over sizes[g] consumers (to be repacked)."""
    consumer_of = np.empty(model.num_trajectories, dtype=np.int64)
    cell_of_consumer = np.repeat(np.arange(len(sizes)), sizes).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for g, positions in enumerate(cells):
        consumer_of[positions] = first[g] + np.arange(len(positions)) % sizes[g]
    W = len(window_start) - 1
    return _Layout(name, consumer_of, cell_of_consumer, window_start, np.full(W * dp, NO_CAP, dtype=np.int64))


def _repack_layouts(model: PrefixCostModel, dp: int, window_start: np.ndarray, capacity: int,
                    options: L2Options) -> list[_Layout]:
    """Candidates with new cells: contiguous cells ("repack"), or contiguous windows dealt to cells ("dealt")."""
    W = len(window_start) - 1
    n = model.num_trajectories
    window_slots = [int(window_start[w + 1] - window_start[w]) for w in range(W)]
    sizes = [size for size in window_slots for _ in range(dp)]
    layouts = []
    for factor in options.repack_shares:
        unit_cost = max(1, int(factor * capacity))
        # Contiguous cells: prefix-affine, least duplicated prefixes at the cuts.
        starts = _contiguous_cells(model, sizes, capacity)
        if starts is not None:
            cells = [np.arange(lo, hi) for lo, hi in zip(starts.tolist(), np.append(starts[1:], n).tolist())]
            base = _cells_layout(model, cells, sizes, dp, window_start, f"repack W={W} units<={factor}T")
            layout = _repacked(model, base, capacity, unit_cost, base.name, keep_failed=False)
            if layout is not None:
                layouts.append(layout)
        # Dealt cells: each window's subtrees dealt heaviest first to the lightest cell (balance first).
        starts = _contiguous_cells(model, [size * dp for size in window_slots], capacity * dp)
        if starts is not None:
            cells = []
            for lo, hi in zip(starts.tolist(), np.append(starts[1:], n).tolist()):
                dealt: list[list[np.ndarray]] = [[] for _ in range(dp)]
                totals = np.zeros(dp, dtype=np.int64)
                for own, positions, _ in _Cell(model, np.arange(lo, hi)).units(unit_cost):
                    c = int(np.argmin(totals))
                    dealt[c].append(positions)
                    totals[c] += own
                cells += [np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64) for parts in dealt]
            if all(len(c) >= size for c, size in zip(cells, sizes)):
                base = _cells_layout(model, cells, sizes, dp, window_start, f"dealt W={W} units<={factor}T")
                layout = _repacked(model, base, capacity, unit_cost, base.name, keep_failed=False)
                if layout is not None:
                    layouts.append(layout)
            # Ranked: the whole window packed at once, consumers then dealt by load rank.
            for affine in (False, True):
                layout = _ranked_layout(model, options, starts, window_slots, dp, window_start, capacity, unit_cost,
                                        f"ranked{'-affine' if affine else ''} W={W} units<={factor}T", affine)
                if layout is not None:
                    layouts.append(layout)
    return layouts


def _layout_cost(model: PrefixCostModel, options: L2Options, members: np.ndarray) -> int:
    """Forward + backward cost of a consumer's complete layout, before any caching (members sorted)."""
    lengths = model.lengths[members]
    shared = np.zeros(len(members), dtype=np.int64)
    if len(members) > 1:
        shared[1:] = model.neighbour_lcp(members[:-1], members[1:])
    q = lengths - shared
    rows = int(q.sum())
    pairs = int((q * shared + q * (q + 1) // 2).sum())
    rect = int((q * lengths).sum())
    return ((options.token_cost_forward + options.token_cost_backward) * rows
            + options.pair_cost_forward * pairs + options.pair_cost_backward * rect)


def _ranked_layout(model, options: L2Options, starts: np.ndarray, window_slots: list[int], dp: int,
                   window_start: np.ndarray, capacity: int, unit_cost: int, name: str,
                   affine: bool = False) -> _Layout | None:
    """Each window's subtrees packed LPT into its D x S consumers, then consumers grouped by load rank.

    Consecutive consumers in descending load form a slot group; within a
    group the heavier consumer goes to the cell with the lower total so far
    (L1's initial assignment), so every slot holds D consumers of nearly
    equal load and cells stay balanced, at the price of prefix affinity.
    `affine` instead matches each group after the first to the cells
    greedily by the rows its consumers would find cached there
    (`_shared_rows`), ties to the lighter cell: the group's slot maximum is
    the same whichever cell gets which consumer, so affinity costs Phi
    nothing before caching, and what caching changes is scored exactly.
    """
    n = model.num_trajectories
    consumer_of = np.empty(n, dtype=np.int64)
    cell_of_consumer = []
    for w, (lo, hi) in enumerate(zip(starts.tolist(), np.append(starts[1:], n).tolist())):
        count = window_slots[w] * dp
        cell = _Cell(model, np.arange(lo, hi))
        units = cell.units(unit_cost)
        packed = _pack_units(model, units, count, capacity)
        if packed is None:
            return None
        members = [np.asarray(m, dtype=np.int64) for m in packed]
        loads = np.array([_layout_cost(model, options, m) for m in members], dtype=np.int64)
        columns = _rank_columns(model, members, loads, dp, affine)
        for k in np.argsort(-loads, kind="stable").tolist():   # consumers numbered by rank
            consumer_of[members[k]] = len(cell_of_consumer)
            cell_of_consumer.append(w * dp + int(columns[k]))
    W = len(window_start) - 1
    return _Layout(name, consumer_of, np.asarray(cell_of_consumer, dtype=np.int64), window_start,
                   np.full(W * dp, NO_CAP, dtype=np.int64))


def _rank_columns(model: PrefixCostModel, members: list[np.ndarray], loads: np.ndarray, dp: int,
                  affine: bool) -> np.ndarray:
    """The cell column (0..D-1) of each of a window's D x S consumers: groups of D by descending load.

    Each group gets one consumer per column; see `_ranked_layout` for how.
    """
    if len(members) % dp:
        raise ValueError(f"a window holds D x S consumers, got {len(members)} for D = {dp}")
    order = np.argsort(-loads, kind="stable")
    totals = np.zeros(dp, dtype=np.int64)
    column = np.empty(len(members), dtype=np.int64)
    in_column: list[list[np.ndarray]] = [[] for _ in range(dp)]
    for j in range(len(members) // dp):
        group = order[j * dp:(j + 1) * dp].tolist()
        if affine and j > 0:
            column_positions = [np.sort(np.concatenate(parts)) for parts in in_column]
            pairs = _greedy_matching(_shared_rows(model, [members[k] for k in group], column_positions), totals)
        else:
            pairs = zip(range(len(group)), np.argsort(totals, kind="stable").tolist())
        for i, c in pairs:
            k = group[i]
            column[k] = c
            totals[c] += loads[k]
            in_column[c].append(members[k])
    return column


def _shared_rows(model: PrefixCostModel, consumers: list[np.ndarray], cells: list[np.ndarray]) -> np.ndarray:
    """[consumer, cell]: rows of each consumer (sorted members) that some trajectory of each cell (sorted
    positions) also has.

    A member's rows below its LCP with the nearest position of the cell, less
    those the consumer already shares with its previous member, would be
    cached if the two sat in one cell (the estimate `_cost_in_cells` makes,
    without caps).
    """
    n = model.num_trajectories
    members = np.concatenate(consumers)
    owner = np.repeat(np.arange(len(consumers)), [len(m) for m in consumers])
    own = np.zeros(len(members), dtype=np.int64)
    same = owner[1:] == owner[:-1]
    own[1:] = np.where(same, model.neighbour_lcp(np.where(same, members[:-1], -1), members[1:]), 0)
    shared = np.zeros((len(consumers), len(cells)), dtype=np.int64)
    for c, positions in enumerate(cells):
        if not len(positions):
            continue
        at = np.searchsorted(positions, members)
        below = np.where(at > 0, positions[np.maximum(at - 1, 0)], -1)
        above = np.where(at < len(positions), positions[np.minimum(at, len(positions) - 1)], n)
        lcp = np.minimum(np.maximum(model.neighbour_lcp(below, members), model.neighbour_lcp(members, above)),
                         model.lengths[members])
        shared[:, c] = np.bincount(owner, weights=np.maximum(lcp - own, 0), minlength=len(consumers))
    return shared


def _greedy_matching(shared: np.ndarray, totals: np.ndarray) -> list[tuple[int, int]]:
    """Pairs (row, cell) of a square gain matrix, largest gain first (ties: lighter cell, then lower index)."""
    rows, cells = shared.shape
    order = np.lexsort((np.tile(np.arange(cells), rows), np.tile(totals, rows), -shared.ravel()))
    used_row, used_cell, pairs = set(), set(), []
    for flat in order.tolist():
        i, c = divmod(flat, cells)
        if i in used_row or c in used_cell:
            continue
        pairs.append((i, c))
        used_row.add(i)
        used_cell.add(c)
    return pairs


# --------------------------------------------------------------------------- depth adjustments


def _exportable(members: np.ndarray, lengths: np.ndarray, ev: _Eval) -> np.ndarray:
    """Members whose rows all stay in the consumer when they leave: a prefix of the next member, or a duplicate."""
    if len(members) < 2:
        return members[:0]
    prefix_of_next = np.append(ev.lcp_consumer[members[1:]] >= lengths[members[:-1]], False)
    equal_previous = ev.lcp_consumer[members] >= lengths[members]
    return members[prefix_of_next | equal_previous]


def _trim(model: PrefixCostModel, options: L2Options, layout: _Layout, dp: int, capacity: int, token_limit: int,
          decisions: list[str]) -> _Layout:
    """Depth adjustments: consumers above their window's mean cost export a nested prefix to a cell neighbour.

    The exported member's rows beyond its cached prefix become shared, so the
    producer computes them and the heavy consumer's residual shrinks by
    len - cached. Each export is chosen to land the consumer closest to the
    mean, re-evaluated exactly, and kept only when capacities and the
    producer limit hold and Phi does not grow.
    """
    lengths = model.lengths
    K = len(layout.cell_of_consumer)
    W = len(layout.window_start) - 1
    exported = 0
    for w in range(W):
        ev = layout.ev
        cost = ev.res_f + ev.res_b
        in_window = np.flatnonzero(layout.cell_of_consumer // dp == w)
        mean = float(cost[in_window].mean())
        for a in in_window[np.argsort(-cost[in_window], kind="stable")].tolist():
            ev = layout.ev
            cost = ev.res_f + ev.res_b
            if cost[a] <= mean:
                break
            per_row = max(1.0, cost[a] / max(1, ev.res_n[a]))
            wanted = (cost[a] - mean) / per_row
            members = np.flatnonzero(layout.consumer_of == a)
            candidates = _exportable(members, lengths, ev)
            gain = lengths[candidates] - ev.cached[candidates]
            keep = gain > 0
            candidates, gain = candidates[keep], gain[keep]
            if not len(candidates):
                continue
            cell = layout.cell_of_consumer[a]
            pool = np.flatnonzero((layout.cell_of_consumer == cell) & (np.arange(K) != a))
            for x in candidates[np.argsort(np.abs(gain - wanted), kind="stable")][:2].tolist():
                receiver = _best_receiver(model, layout, ev, x, pool, capacity)
                if receiver < 0:
                    continue
                trial = _apply_move(layout, np.array([x]), a, receiver)
                if trial is None:
                    continue
                score = _trial_score(model, options, trial, dp, capacity, token_limit, layout, [a, receiver])
                if score is not None and score[0] <= layout.key[0]:
                    layout = trial
                    exported += 1
                    break
    decisions.append(f"depth adjustments: {exported} nested prefixes exported, {_format_key(layout.key)}")
    return layout


# --------------------------------------------------------------------------- local refinement


def _member_runs(members: np.ndarray, lengths: np.ndarray, lcp_consumer: np.ndarray) -> list[np.ndarray]:
    """A consumer's members split into nested chains: each member a prefix of the next (or equal)."""
    if len(members) == 0:
        return []
    nested = lcp_consumer[members[1:]] >= lengths[members[:-1]]
    return np.split(members, np.flatnonzero(~nested) + 1)


def _potential(layout: _Layout) -> float:
    """Sum of squared costs of every consumer and producer: lower when work is level."""
    ev = layout.ev
    consumer = (ev.res_f + ev.res_b).astype(np.float64)
    producer = (ev.pro_f + ev.pro_b).astype(np.float64)
    return float(np.dot(consumer, consumer) + np.dot(producer, producer))


def _trial_score(model: PrefixCostModel, options: L2Options, trial: _Layout, dp: int, capacity: int,
                 token_limit: int, parent: _Layout, consumers) -> tuple[int, float] | None:
    """(Phi, sum of squared costs) of a local-search trial; None when it breaks a capacity (caps are
    kept: no producer may need a new one) or runs more decoder tokens than L1's consumers would.

    `trial` differs from the scored `parent` only in the members or cells of
    `consumers`, so only the cells those occupy, before and after, are re-evaluated.
    """
    consumers = np.asarray(consumers, dtype=np.int64)
    cells = np.union1d(parent.cell_of_consumer[consumers], trial.cell_of_consumer[consumers])
    ev = _reevaluate(model, options, parent.ev, trial.consumer_of, trial.cell_of_consumer, trial.cap_of_cell, cells,
                     members_changed=trial.consumer_of is not parent.consumer_of)
    if not _score(model, options, trial, dp, capacity, allow_caps=False, ev=ev) or trial.key[1] > token_limit:
        return None
    return trial.key[0], _potential(trial)


def _run_rows(runs: list[np.ndarray], lengths: np.ndarray, ev: _Eval) -> np.ndarray:
    """Residual rows each nested chain contributes to its consumer."""
    return np.array([int((lengths[r] - np.maximum(ev.lcp_consumer[r], ev.cached[r])).sum()) for r in runs],
                    dtype=np.int64)


def _refine(model: PrefixCostModel, options: L2Options, layout: _Layout, dp: int, capacity: int, token_limit: int,
            decisions: list[str]) -> _Layout:
    """Bounded local search that levels work without ever raising Phi; see the module docstring.

    Rounds alternate. A push round takes the heaviest consumer not yet found
    stuck and tries: exports of a nested prefix to a consumer of its cell;
    moving one of its nested chains to the lightest consumers of its cell
    (repacking within the window) or of other cells of its window (an
    exchange between replicas); swapping a chain with a smaller chain of
    those consumers. A pull round takes the consumer furthest below its
    slot's maximum and tries moving in the tail of a nested chain
    (`_pull_moves`). A move is
    kept when (Phi, sum of squared costs) decreases lexicographically, the
    capacities hold, and, when it crosses replicas, tokens do not grow.
    """
    stuck: set[tuple[int, bool]] = set()
    accepted = evaluations = 0
    potential = _potential(layout)
    for step in range(options.refine_steps):
        ev = layout.ev
        cost = ev.res_f + ev.res_b
        pull = step % 2 == 1
        if pull:
            fwd, bwd, _, _ = _grid_costs(layout, dp)
            slot_max = (fwd + bwd).max(axis=0)
            ranked = np.argsort(-(slot_max[layout.slot] - cost), kind="stable").tolist()
        else:
            ranked = np.argsort(-cost, kind="stable").tolist()
        order = [k for k in ranked if (k, pull) not in stuck]
        if not order:
            break
        focus = order[0]
        moves = _pull_moves(model, layout, ev, focus, dp, capacity, slot_max) if pull else \
            _push_moves(model, layout, ev, focus, dp, capacity)
        best = best_score = None
        for positions, a, b in moves:
            trial = _apply_move(layout, positions, a, b)
            if trial is None:
                continue
            evaluations += 1
            score = _trial_score(model, options, trial, dp, capacity, token_limit, layout, [a, b])
            if score is None:
                continue
            if layout.cell_of_consumer[b] != layout.cell_of_consumer[a] and trial.key[1] > layout.key[1]:
                continue   # exchanges between replicas never add tokens
            if score < (layout.key[0], potential) and (best is None or score < best_score):
                best, best_score = trial, score
        if best is None:
            stuck.add((focus, pull))
            continue
        layout, potential = best, best_score[1]
        accepted += 1
        stuck.clear()
    decisions.append(f"refine: {accepted} moves accepted, {evaluations} candidates evaluated, {_format_key(layout.key)}")
    return layout


def _cost_in_cells(model: PrefixCostModel, layout: _Layout, ev: _Eval, cost: np.ndarray, dp: int) -> np.ndarray:
    """[K, G]: each consumer's estimated cost if it alone moved to each cell (its own cell: its cost).

    A member's rows stay cached when some consumer of the new cell shares
    them: its LCP with the nearest position of that cell, below or above,
    capped by the cell's depth cap. The estimate keeps the consumer's cost per
    computed row, and ignores that its old cell mates lose what they shared
    with it; exact evaluation settles both.
    """
    lengths = model.lengths
    n, K = model.num_trajectories, len(layout.cell_of_consumer)
    G = len(layout.cap_of_cell)
    cell_of_position = layout.cell_of_consumer[layout.consumer_of]
    per_row = cost / np.maximum(ev.res_n, 1)
    estimate = np.repeat(cost[:, None].astype(np.float64), G, axis=1)
    for g in range(G):
        inside = np.flatnonzero(cell_of_position == g)
        outside = np.flatnonzero((cell_of_position != g) & (cell_of_position // dp == g // dp))
        if not len(inside) or not len(outside):
            continue
        at = np.searchsorted(inside, outside)
        below = np.where(at > 0, inside[np.maximum(at - 1, 0)], -1)
        above = np.where(at < len(inside), inside[np.minimum(at, len(inside) - 1)], n)
        shared = np.maximum(model.neighbour_lcp(below, outside), model.neighbour_lcp(outside, above))
        cached = np.minimum(np.minimum(shared, lengths[outside]), layout.cap_of_cell[g])
        rows = lengths[outside] - np.maximum(ev.lcp_consumer[outside], cached)
        consumer = layout.consumer_of[outside]
        estimate[:, g] = np.where(np.isin(np.arange(K), consumer), 0.0, estimate[:, g])
        np.add.at(estimate[:, g], consumer, rows * per_row[consumer])
    return estimate


def _exchange_candidates(layout: _Layout, cost: np.ndarray, dp: int,
                         cost_in_cell: np.ndarray | None = None) -> list[tuple[int, int, int]]:
    """Swaps (change, x, y) of consumers x, y in different cells of one window that lower its Phi.

    With costs held fixed, a window's Phi is the sum over slot ranks of the
    largest rank-th cost over its cells (each cell's slots are its costs in
    descending order, as `_score` orders them). A moved consumer costs
    `cost_in_cell[k, new cell]` when given (`_cost_in_cells`), else its
    current cost. For a pair of cells all |A| x |B| swaps are scored at once;
    best (most negative change) first.
    """
    found = []
    W = len(layout.window_start) - 1
    for w in range(W):
        members = [np.flatnonzero(layout.cell_of_consumer == g) for g in range(w * dp, (w + 1) * dp)]
        profile = np.stack([np.sort(cost[m]) for m in members])   # ascending: rank-aligned across cells
        base = int(profile.max(axis=0).sum())
        for a in range(dp):
            for b in range(a + 1, dp):
                rest = np.delete(profile, [a, b], axis=0).max(axis=0, initial=0)
                xs, ys = members[a], members[b]
                nx, ny, slots = len(xs), len(ys), profile.shape[1]
                y_in_a = cost[ys] if cost_in_cell is None else cost_in_cell[ys, w * dp + a]
                x_in_b = cost[xs] if cost_in_cell is None else cost_in_cell[xs, w * dp + b]
                # cell a with x replaced by y, and cell b with y replaced by x: [x, y, slot]
                new_a = np.broadcast_to(cost[xs], (nx, ny, slots)).copy()
                new_a[np.arange(nx), :, np.arange(nx)] = np.broadcast_to(y_in_a, (nx, ny))
                new_b = np.broadcast_to(cost[ys], (nx, ny, slots)).copy()
                new_b[:, np.arange(ny), np.arange(ny)] = np.broadcast_to(x_in_b[:, None], (nx, ny))
                new_a.sort(axis=2)
                new_b.sort(axis=2)
                change = np.maximum(np.maximum(new_a, new_b), rest).sum(axis=2) - base
                i, j = np.nonzero(change < 0)
                found += zip(change[i, j].tolist(), xs[i].tolist(), ys[j].tolist())
    found.sort()
    return found


def _exchange(model: PrefixCostModel, options: L2Options, layout: _Layout, dp: int, capacity: int,
              token_limit: int, decisions: list[str]) -> _Layout:
    """Placement exchanges: whole consumers of one window trade replicas; see the module docstring.

    Each round ranks the swaps twice, with costs held fixed and with the moved
    consumers re-estimated in their new cells (`_cost_in_cells`), interleaves
    the two rankings and keeps the first swap whose exact evaluation lowers
    (Phi, sum of squared costs). Neither surrogate ranks well alone on every
    workload: fixed costs ignore the caching a move loses, the estimate
    ignores what the old cell mates lose.
    """
    potential = _potential(layout)
    accepted = evaluations = 0
    for _ in range(options.exchange_rounds):
        cost = layout.ev.res_f + layout.ev.res_b
        fixed = _exchange_candidates(layout, cost, dp)
        moved = _exchange_candidates(layout, cost, dp, _cost_in_cells(model, layout, layout.ev, cost, dp))
        interleaved = (pair for both in itertools.zip_longest(fixed, moved) for pair in both if pair is not None)
        ranked = list(dict.fromkeys(pair[1:] for pair in interleaved))
        kept = None
        for x, y in ranked[:options.exchange_candidates]:
            if evaluations >= options.exchange_evaluations:
                break
            cells = layout.cell_of_consumer.copy()
            cells[[x, y]] = cells[[y, x]]
            trial = _Layout(layout.name, layout.consumer_of, cells, layout.window_start, layout.cap_of_cell)
            evaluations += 1
            score = _trial_score(model, options, trial, dp, capacity, token_limit, layout, [x, y])
            if score is not None and score < (layout.key[0], potential):
                kept = trial, score[1]
                break
        if kept is None:
            break
        layout, potential = kept
        accepted += 1
    decisions.append(f"exchanges: {accepted} consumer swaps accepted, {evaluations} evaluated, {_format_key(layout.key)}")
    return layout


def _push_moves(model, layout: _Layout, ev: _Eval, a: int, dp: int, capacity: int) -> list:
    """Candidate moves out of the heavy consumer a: (positions, from, to); -1 - p moves p from `to` to `from`."""
    lengths = model.lengths
    K = len(layout.cell_of_consumer)
    cost = ev.res_f + ev.res_b
    cell = int(layout.cell_of_consumer[a])
    in_window = np.flatnonzero(layout.cell_of_consumer // dp == cell // dp)
    per_row = max(1.0, cost[a] / max(1, ev.res_n[a]))
    wanted = max(1.0, (cost[a] - cost[in_window].mean()) / per_row)
    members = np.flatnonzero(layout.consumer_of == a)
    same_cell = np.flatnonzero((layout.cell_of_consumer == cell) & (np.arange(K) != a))
    other_cells = in_window[layout.cell_of_consumer[in_window] != cell]
    light = (same_cell[np.argsort(cost[same_cell], kind="stable")][:2].tolist()
             + other_cells[np.argsort(cost[other_cells], kind="stable")][:2].tolist())
    moves = []
    exportable = _exportable(members, lengths, ev)
    gain = lengths[exportable] - ev.cached[exportable]
    exportable, gain = exportable[gain > 0], gain[gain > 0]
    for x in exportable[np.argsort(np.abs(gain - wanted), kind="stable")][:3].tolist():
        receiver = _best_receiver(model, layout, ev, x, same_cell, capacity)
        if receiver >= 0:
            moves.append((np.array([x]), a, receiver))
    runs = _member_runs(members, lengths, ev.lcp_consumer)
    sizes = _run_rows(runs, lengths, ev)
    if len(runs) > 1:
        for r in np.argsort(np.abs(sizes - wanted), kind="stable")[:2].tolist():
            moves += [(runs[r], a, b) for b in light]
    swaps = []
    for b in light:
        light_runs = _member_runs(np.flatnonzero(layout.consumer_of == b), lengths, ev.lcp_consumer)
        light_sizes = _run_rows(light_runs, lengths, ev)
        for ra in range(len(runs)):
            for rb in range(len(light_runs)):
                if sizes[ra] > light_sizes[rb]:
                    swaps.append((abs(sizes[ra] - light_sizes[rb] - wanted), ra, b, rb, light_runs))
    for _, ra, b, rb, light_runs in sorted(swaps, key=lambda t: t[:4])[:4]:
        moves.append((np.concatenate([runs[ra], -1 - light_runs[rb]]), a, b))
    return moves


def _pull_moves(model, layout: _Layout, ev: _Eval, b: int, dp: int, capacity: int, slot_max: np.ndarray) -> list:
    """Candidate moves into consumer b, which runs below its slot's maximum `slot_max[slot]`: tails of nested chains.

    A tail is a chain's members from some member up; it leaves its consumer a
    with the rows above the member below it, and b must then hold the tail's
    longest member. Donors are b's cell mates and the two heaviest consumers
    of other cells of its window. Only tails whose growth of b's complete
    layout fits the capacity are proposed, two per chain, those moving about
    half of b's deficit first (the donor's slot often has a deficit too).
    """
    lengths = model.lengths
    cost = ev.res_f + ev.res_b
    cell = int(layout.cell_of_consumer[b])
    in_window = np.flatnonzero(layout.cell_of_consumer // dp == cell // dp)
    same_cell = in_window[(layout.cell_of_consumer[in_window] == cell) & (in_window != b)]
    other_cells = in_window[layout.cell_of_consumer[in_window] != cell]
    donors = same_cell.tolist() + other_cells[np.argsort(-cost[other_cells], kind="stable")][:2].tolist()
    per_row = max(1.0, cost[b] / max(1, ev.res_n[b]))
    wanted = max(1.0, (slot_max[layout.slot[b]] - cost[b]) / per_row / 2)
    ranked = []
    for a in donors:
        for run in _member_runs(np.flatnonzero(layout.consumer_of == a), lengths, ev.lcp_consumer):
            if ev.full[b] + _growth(model, layout.consumer_of, int(run[-1]), np.array([b]))[0] > capacity:
                continue
            below = np.concatenate([[ev.lcp_consumer[run[0]]], lengths[run[:-1]]])
            moved = lengths[run[-1]] - below          # rows a no longer holds once run[i:] leaves
            for i in np.argsort(np.abs(moved - wanted), kind="stable")[:2].tolist():
                ranked.append((abs(float(moved[i]) - wanted), a, i, run))
    ranked.sort(key=lambda t: t[:3])
    return [(run[i:], a, b) for _, a, i, run in ranked[:12]]


def _growth(model: PrefixCostModel, consumer_of: np.ndarray, x: int, pool: np.ndarray) -> np.ndarray:
    """Rows each consumer of `pool` would add to its complete layout to hold trajectory x.

    x shares with a consumer exactly its longest common prefix with any member.
    """
    shared = np.zeros(int(consumer_of.max()) + 1, dtype=np.int64)
    np.maximum.at(shared, consumer_of, model.lcp_to_all(x))
    return model.lengths[x] - shared[pool]


def _best_receiver(model: PrefixCostModel, layout: _Layout, ev: _Eval, x: int, pool: np.ndarray, capacity: int) -> int:
    """The consumer of `pool` that takes trajectory x with the least growth of its complete layout (-1: none fits)."""
    if not len(pool):
        return -1
    growth = _growth(model, layout.consumer_of, x, pool)
    fits = ev.full[pool] + growth <= capacity
    if not fits.any():
        return -1
    return int(pool[fits][np.argmin(growth[fits])])


def _apply_move(layout: _Layout, positions: np.ndarray, a: int, b: int) -> _Layout | None:
    """Move positions >= 0 from a to b, and positions encoded as -1 - p from b to a; None if a consumer empties."""
    consumer_of = layout.consumer_of.copy()
    forward = positions[positions >= 0]
    backward = -1 - positions[positions < 0]
    consumer_of[forward] = b
    consumer_of[backward] = a
    if not np.any(consumer_of == a) or not np.any(consumer_of == b):
        return None
    return _Layout(layout.name, consumer_of, layout.cell_of_consumer, layout.window_start, layout.cap_of_cell)


# --------------------------------------------------------------------------- the pass


def _window_counts(J: int, options: L2Options) -> list[int]:
    smallest = 1 if options.max_window_slots <= 0 else -(-J // options.max_window_slots)
    counts = sorted({min(J, max(smallest, int(w))) for w in options.window_counts} | {smallest})
    return [w for w in counts if 1 <= w <= J]


def place_windows(trie, partition: L1Partition, *, capacity: int, dp: int,
                  options: L2Options = L2Options()) -> L2Placement:
    """Run L2: choose the best candidate by (Phi, tokens, imbalance, max replica total), then refine it.

    `trie` needs `lengths` and `lcp` of the sorted trajectories (a `TrieIR`).
    Deterministic: the same inputs give the same placement.
    """
    model = PrefixCostModel.build(trie.lengths, trie.lcp)
    K = partition.num_microbatches
    if capacity < 1 or dp < 1:
        raise ValueError(f"capacity and dp must be >= 1, got capacity={capacity}, dp={dp}")
    if K == 0 or K % dp:
        raise PassFailedError(PASS_NAME, f"L1 produced {K} consumers, not a positive multiple of dp={dp}",
                              "run partition_microbatches with the same dp first")
    J = K // dp
    decisions = [f"K={K} consumers on {dp} replicas x {J} slots, T={capacity}"]
    candidates: list[_Layout] = []
    for W in _window_counts(J, options):
        window_start = np.concatenate([[0], np.cumsum(_window_sizes(J, W))]).astype(np.int64)
        l1 = _l1_layouts(model, options, partition, dp, window_start)
        candidates += l1 + _l1_repacked_layouts(model, l1, capacity) + _repack_layouts(
            model, dp, window_start, capacity, options)
    # L2 never runs more decoder rows than L1's consumers would without windows.
    token_limit = int(partition.work.sum())
    best = None
    for layout in candidates:
        if not _score(model, options, layout, dp, capacity):
            decisions.append(f"candidate {layout.name}: infeasible")
            continue
        decisions.append(f"candidate {layout.name}: {_format_key(layout.key)}")
        if layout.key[1] > token_limit:
            decisions.append(f"candidate {layout.name}: dropped, {layout.key[1]} tokens > L1's {token_limit}")
            continue
        if best is None or layout.key < best.key:
            best = layout
    if best is None:   # the L1 grid always fits; reaching this is a bug
        raise PassFailedError(PASS_NAME, "no candidate placement fits the capacity",
                              "report this plan's input: L1's own grid should always fit")
    decisions.append(f"selected {best.name}: {_format_key(best.key)}")
    best = _trim(model, options, best, dp, capacity, token_limit, decisions)
    best = _refine(model, options, best, dp, capacity, token_limit, decisions)
    best = _exchange(model, options, best, dp, capacity, token_limit, decisions)
    # Exchanges re-sort the slots; refining again pulls work into the consumers now below their slot's maximum.
    best = _refine(model, options, best, dp, capacity, token_limit, decisions)
    return _placement(model, best, dp, decisions)


def _placement(model: PrefixCostModel, layout: _Layout, dp: int, decisions: list[str]) -> L2Placement:
    """Freeze a scored layout: consumers renumbered to grid order (slot-major, then replica)."""
    ev = layout.ev
    K = len(layout.cell_of_consumer)
    W = len(layout.window_start) - 1
    replica = layout.replica_of_cell[layout.cell_of_consumer]
    grid_order = np.lexsort((replica, layout.slot))
    new_id = np.empty(K, dtype=np.int64)
    new_id[grid_order] = np.arange(K)
    consumer_of = new_id[layout.consumer_of]
    by_consumer = np.argsort(consumer_of, kind="stable").astype(np.int64)
    bounds = np.cumsum(np.bincount(consumer_of, minlength=K))[:-1]
    members = tuple(np.split(by_consumer, bounds))
    cached = tuple(ev.cached[m].astype(np.int64) for m in members)

    # Producer of cell g is (window g // D, replica replica_of_cell[g]); index w * D + d.
    lengths = model.lengths
    cell = layout.cell_of_consumer[layout.consumer_of]
    creates = ev.cached > ev.lcp_cell
    positions_of = [np.zeros(0, dtype=np.int64)] * (W * dp)
    lengths_of = [np.zeros(0, dtype=np.int64)] * (W * dp)
    caps = np.full(W * dp, -1, dtype=np.int64)
    producer_tokens = np.zeros(W * dp, dtype=np.int64)
    producer_cost = np.zeros(W * dp, dtype=np.int64)
    for g in range(W * dp):
        index = (g // dp) * dp + int(layout.replica_of_cell[g])
        entries = np.flatnonzero((cell == g) & creates)
        positions_of[index] = entries.astype(np.int64)
        lengths_of[index] = ev.cached[entries].astype(np.int64)
        producer_tokens[index] = ev.pro_n[g]
        producer_cost[index] = ev.pro_f[g] + ev.pro_b[g]
        if layout.cap_of_cell[g] < NO_CAP:
            caps[index] = layout.cap_of_cell[g]
    del lengths
    return L2Placement(
        members=members, cached_prefix=cached,
        replica=replica[grid_order].astype(np.int32), slot=layout.slot[grid_order].astype(np.int32),
        window_start=layout.window_start.astype(np.int64),
        producer_positions=tuple(positions_of), producer_lengths=tuple(lengths_of), depth_cap=caps,
        work=ev.full[grid_order].astype(np.int64), residual_tokens=ev.res_n[grid_order].astype(np.int64),
        producer_tokens=producer_tokens, residual_cost=(ev.res_f + ev.res_b)[grid_order].astype(np.int64),
        producer_cost=producer_cost, key=layout.key, candidate=layout.name, decisions=tuple(decisions))


# --------------------------------------------------------------------------- verification


def verify_placement(lengths, lcp, placement: L2Placement, capacity: int, dp: int) -> None:
    """Raise VerificationError naming the first L2 invariant that does not hold.

    Recomputes everything from the LCP array, independently of how the pass
    built the placement.
    """
    model = PrefixCostModel.build(lengths, lcp)
    n = model.num_trajectories
    K = len(placement.members)
    replica = np.asarray(placement.replica, dtype=np.int64)
    slot = np.asarray(placement.slot, dtype=np.int64)
    if len(placement.cached_prefix) != K or replica.shape != (K,) or slot.shape != (K,):
        raise VerificationError("one replica, slot and cached-prefix list per consumer",
                                f"{K} consumers, {replica.shape} replicas, {slot.shape} slots, "
                                f"{len(placement.cached_prefix)} cached-prefix lists")
    if K == 0 or K % dp:
        raise VerificationError("every replica has the same number of slots", f"K={K}, dp={dp}")
    J = K // dp
    if replica.min() < 0 or replica.max() >= dp or slot.min() < 0 or slot.max() >= J or \
            len(np.unique(replica * J + slot)) != K:
        raise VerificationError("consumers fill the replica x slot grid", "a (replica, slot) pair is missing or repeated")
    start = np.asarray(placement.window_start, dtype=np.int64)
    if len(start) < 2 or start[0] != 0 or start[-1] != J or np.any(np.diff(start) <= 0):
        raise VerificationError("windows tile the slots", f"window_start={start.tolist()} for {J} slots")
    W = len(start) - 1
    window = np.searchsorted(start, slot, side="right") - 1
    if len(placement.producer_positions) != W * dp or len(placement.producer_lengths) != W * dp:
        raise VerificationError("one producer per (window, replica)",
                                f"{len(placement.producer_positions)} producers for {W} windows x {dp} replicas")

    consumer_of = np.full(n, -1, dtype=np.int64)
    cached_of = np.zeros(n, dtype=np.int64)
    seen = np.zeros(n, dtype=np.int64)
    for k, members in enumerate(placement.members):
        members = np.asarray(members, dtype=np.int64)
        if members.size == 0:
            raise VerificationError("every consumer is non-empty", f"consumer {k} has no trajectory")
        if members.min() < 0 or members.max() >= n or np.any(np.diff(members) <= 0):
            raise VerificationError("members are sorted positions in [0, N)", f"consumer {k}")
        np.add.at(seen, members, 1)
        consumer_of[members] = k
        cost = model.cost(members)
        if cost > capacity:
            raise VerificationError("complete consumer layouts fit the capacity",
                                    f"consumer {k} has C(M)={cost} > {capacity}")
        cached = np.asarray(placement.cached_prefix[k], dtype=np.int64)
        if cached.shape != members.shape or cached.min() < 0 or np.any(cached > model.lengths[members]):
            raise VerificationError("a cached prefix is a prefix of its trajectory", f"consumer {k}")
        cached_of[members] = cached
        if len(members) > 1:
            shared = model.neighbour_lcp(members[:-1], members[1:])
            if np.any(np.minimum(cached[:-1], shared) != np.minimum(cached[1:], shared)):
                raise VerificationError("a row shared inside a consumer has one cached status",
                                        f"consumer {k}: neighbouring members disagree on a shared row")
    if np.any(seen != 1):
        bad = int(np.flatnonzero(seen != 1)[0])
        raise VerificationError("every trajectory is in exactly one consumer",
                                f"sorted position {bad} appears {int(seen[bad])} times")

    cell_of_consumer = window * dp + replica
    for g in range(W * dp):
        entries = np.asarray(placement.producer_positions[g], dtype=np.int64)
        depth = np.asarray(placement.producer_lengths[g], dtype=np.int64)
        if entries.shape != depth.shape or (entries.size and (np.any(np.diff(entries) <= 0) or depth.min() < 1
                                                              or np.any(depth > model.lengths[entries]))):
            raise VerificationError("producer prefixes are sorted trajectory prefixes", f"producer {g}")
        rows = 0
        if entries.size:
            between = model.neighbour_lcp(entries[:-1], entries[1:]) if entries.size > 1 else np.zeros(0, np.int64)
            truncated = np.minimum(between, np.minimum(depth[:-1], depth[1:]))
            if np.any(truncated >= depth[1:]):
                raise VerificationError("producer prefixes are sorted trajectory prefixes",
                                        f"producer {g}: a prefix repeats or sorts after its extension")
            rows = int(depth.sum() - truncated.sum())
        if rows > capacity:
            raise VerificationError("producers fit the capacity", f"producer {g} computes {rows} rows > {capacity}")
        mine = np.flatnonzero(cell_of_consumer[consumer_of] == g)
        if not mine.size:
            if entries.size:
                raise VerificationError("a producer serves its window's consumers", f"producer {g} has no consumer")
            continue
        cached = cached_of[mine]
        needed = cached > 0
        if np.any(needed) and not entries.size:
            raise VerificationError("every cached prefix is produced in its window on its replica",
                                    f"producer {g} computes nothing but its consumers cache rows")
        if np.any(needed):
            x = mine[needed]
            want = cached[needed]
            lcp_xe = _lcp_matrix(model, x, entries)
            served = np.minimum(lcp_xe, depth[None, :]).max(axis=1)
            if np.any(served < want):
                bad = int(x[np.argmax(served < want)])
                raise VerificationError("every cached prefix is produced in its window on its replica",
                                        f"sorted position {bad}: its producer computes fewer leading positions")
            lcp_xy = _lcp_matrix(model, x, mine)
            other = consumer_of[mine][None, :] != consumer_of[x][:, None]
            shared = np.where(other, lcp_xy, 0).max(axis=1)
            if np.any(shared < want):
                bad = int(x[np.argmax(shared < want)])
                raise VerificationError("a cached prefix is shared with another consumer of its window",
                                        f"sorted position {bad} caches a prefix no other consumer there uses")
        if entries.size:
            # Nothing computed for nobody: each prefix's deepest row is cached by >= 2 consumers.
            use = np.minimum(_lcp_matrix(model, entries, mine), cached[None, :]) >= depth[:, None]
            users = np.array([len(np.unique(consumer_of[mine][row])) for row in use])
            if np.any(users < 2):
                raise VerificationError("a producer computes only rows two consumers use",
                                        f"producer {g}: prefix of sorted position {int(entries[np.argmax(users < 2)])}")


def _lcp_matrix(model: PrefixCostModel, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int64[len(a), len(b)]: LCP of every pair (the length itself where a position meets itself)."""
    lo = np.minimum(a[:, None], b[None, :])
    hi = np.maximum(a[:, None], b[None, :])
    same = lo == hi
    out = model.lcp_min.min(np.where(same, 0, lo + 1), np.where(same, 0, hi))
    return np.where(same, model.lengths[lo], out)
