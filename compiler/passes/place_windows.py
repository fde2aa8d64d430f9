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

This module runs the search and freezes its result; the pieces live in
`harts.compiler.placement`: `options` (L2Options), `evaluation` (exact rows
and costs), `scoring` (a candidate's slot and replica order and its key),
`packing`, `candidates`, `refine` (depth adjustments, local moves),
`exchange` and `verify` (verify_placement, independent of the search).

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
  saves. The cap is lowered only when the producer would exceed T (a search
  between the deepest cached depth and that depth less the overflow). Rows used by one consumer stay in that consumer.
* Search. For each window count W in `window_counts` (windows of near-equal
  length, longer first; a count whose windows would hold fewer than
  `min_window_slots` slots is skipped unless it is the smallest), the
  candidates are:
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
* Local refinement (at most `refine_steps` rounds, every
  `refine_pull_every`-th a pull round): push rounds take a slot's maximum,
  the one leading its slot by most first (Phi is a sum of slot maxima, so
  the lead of a light slot's maximum is worth as much as a heavy one's),
  then the heaviest consumer, and try exports, moving one of its nested
  chains to the lightest consumers of its own cell (whole-trajectory
  repacking within the window) or of other cells of its window (an exchange
  between heavy and light replicas, allowed only if tokens do not grow), and
  swapping a chain for a smaller one there; pull rounds take the consumer furthest below its
  slot's maximum and try moving in the tail of a nested chain (its longest
  members) whose history it can hold. Each move is evaluated exactly
  (capacities of complete layouts and producers included) and kept when
  (Phi, sum of squared costs) decreases; the squared costs level work where
  Phi alone is flat. Refinement runs again after the exchanges below, then
  letting a move that would overfill its producer lower that producer's
  sharing depth (a full re-evaluation) instead of refusing it.
* Placement exchanges (at most `exchange_rounds` accepted, and only the
  rounds `exchange_scan_budget` pays for: scoring a round's swaps grows as
  D^2 S^3 for windows of S slots): two consumers of
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

import numpy as np

from harts.compiler.ir.partition import L1Partition
from harts.compiler.ir.placement import L2Placement
from harts.compiler.placement.candidates import l1_layouts, l1_repacked_layouts, repack_layouts
from harts.compiler.placement.evaluation import NO_CAP
from harts.compiler.placement.exchange import exchange_consumers
from harts.compiler.placement.options import L2Options
from harts.compiler.placement.refine import adjust_depths, refine
from harts.compiler.placement.scoring import Layout, format_key, score_layout, window_sizes
from harts.compiler.placement.verify import verify_placement
from harts.compiler.prefix_cost import PrefixCostModel
from harts.schema.errors import PassFailedError

__all__ = ["PASS_NAME", "NO_CAP", "L2Options", "L2Placement", "place_windows", "verify_placement"]

PASS_NAME = "place_windows"


def _window_counts(J: int, options: L2Options) -> list[int]:
    smallest = 1 if options.max_window_slots <= 0 else -(-J // options.max_window_slots)
    counts = sorted({min(J, max(smallest, int(w))) for w in options.window_counts} | {smallest})
    return [w for w in counts if 1 <= w <= J and (w == smallest or J // w >= options.min_window_slots)]


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
    candidates: list[Layout] = []
    for W in _window_counts(J, options):
        window_start = np.concatenate([[0], np.cumsum(window_sizes(J, W))]).astype(np.int64)
        l1 = l1_layouts(model, options, partition, dp, window_start)
        candidates += l1 + l1_repacked_layouts(model, l1, capacity) + repack_layouts(
            model, dp, window_start, capacity, options)
    # L2 never runs more decoder rows than L1's consumers would without windows.
    token_limit = int(partition.work.sum())
    best = None
    for layout in candidates:
        if not score_layout(model, options, layout, dp, capacity):
            decisions.append(f"candidate {layout.name}: infeasible")
            continue
        decisions.append(f"candidate {layout.name}: {format_key(layout.key)}")
        if layout.key[1] > token_limit:
            decisions.append(f"candidate {layout.name}: dropped, {layout.key[1]} tokens > L1's {token_limit}")
            continue
        if best is None or layout.key < best.key:
            best = layout
    if best is None:   # the L1 grid always fits; reaching this is a bug
        raise PassFailedError(PASS_NAME, "no candidate placement fits the capacity",
                              "report this plan's input: L1's own grid should always fit")
    decisions.append(f"selected {best.name}: {format_key(best.key)}")
    best = adjust_depths(model, options, best, dp, capacity, token_limit, decisions)
    best = refine(model, options, best, dp, capacity, token_limit, decisions)
    best = exchange_consumers(model, options, best, dp, capacity, token_limit, decisions)
    # Exchanges re-sort the slots; refining again pulls work into the consumers now below their slot's maximum.
    # Producers are full by now (tree-step at D = 8: 62-65k rows of 65,536), so a move that adds sharing may
    # lower its producer's depth cap rather than be refused (paper-scale tree-step seed 0: Phi -0.7%).
    best = refine(model, options, best, dp, capacity, token_limit, decisions, recap=True)
    return _placement(model, best, dp, decisions)


def _placement(model: PrefixCostModel, layout: Layout, dp: int, decisions: list[str]) -> L2Placement:
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
    return L2Placement(
        members=members, cached_prefix=cached,
        replica=replica[grid_order].astype(np.int32), slot=layout.slot[grid_order].astype(np.int32),
        window_start=layout.window_start.astype(np.int64),
        producer_positions=tuple(positions_of), producer_lengths=tuple(lengths_of), depth_cap=caps,
        work=ev.full[grid_order].astype(np.int64), residual_tokens=ev.res_n[grid_order].astype(np.int64),
        producer_tokens=producer_tokens, residual_cost=(ev.res_f + ev.res_b)[grid_order].astype(np.int64),
        producer_cost=producer_cost, key=layout.key, candidate=layout.name, decisions=tuple(decisions))
