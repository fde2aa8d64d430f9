"""L2's depth adjustments and local refinement: moving trajectories between consumers of a window.

Every accepted move keeps every capacity, never raises Phi and never runs
more decoder tokens than L1's consumers would; a move across replicas also
never adds tokens (Appendix A.2's exchange rule).
"""
from __future__ import annotations

import numpy as np

from harts.compiler.placement.evaluation import Evaluation
from harts.compiler.placement.options import L2Options
from harts.compiler.placement.scoring import Layout, format_key, grid_costs, trial_score, work_potential
from harts.compiler.prefix_cost import PrefixCostModel


def _exportable(members: np.ndarray, lengths: np.ndarray, ev: Evaluation) -> np.ndarray:
    """Members whose rows all stay in the consumer when they leave: a prefix of the next member, or a duplicate."""
    if len(members) < 2:
        return members[:0]
    prefix_of_next = np.append(ev.lcp_consumer[members[1:]] >= lengths[members[:-1]], False)
    equal_previous = ev.lcp_consumer[members] >= lengths[members]
    return members[prefix_of_next | equal_previous]


def adjust_depths(model: PrefixCostModel, options: L2Options, layout: Layout, dp: int, capacity: int, token_limit: int,
                  decisions: list[str]) -> Layout:
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
    members_index = _Members(model, layout.consumer_of)
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
                receiver = _best_receiver(members_index, ev, x, pool, capacity)
                if receiver < 0:
                    continue
                trial = _apply_move(model, layout, np.array([x]), a, receiver, capacity)
                if trial is None:
                    continue
                score = trial_score(model, options, trial, dp, capacity, token_limit, layout, [a, receiver])
                if score is not None and score[0] <= layout.key[0]:
                    layout = trial
                    members_index = _Members(model, layout.consumer_of)
                    exported += 1
                    break
    decisions.append(f"depth adjustments: {exported} nested prefixes exported, {format_key(layout.key)}")
    return layout


def _member_runs(members: np.ndarray, lengths: np.ndarray, lcp_consumer: np.ndarray) -> list[np.ndarray]:
    """A consumer's members split into nested chains: each member a prefix of the next (or equal)."""
    if len(members) == 0:
        return []
    nested = lcp_consumer[members[1:]] >= lengths[members[:-1]]
    return np.split(members, np.flatnonzero(~nested) + 1)


def _run_rows(runs: list[np.ndarray], lengths: np.ndarray, ev: Evaluation) -> np.ndarray:
    """Residual rows each nested chain contributes to its consumer."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    members = np.concatenate(runs)
    rows = (lengths[members] - np.maximum(ev.lcp_consumer[members], ev.cached[members])).astype(np.int64)
    return np.add.reduceat(rows, np.cumsum([0] + [len(r) for r in runs[:-1]]))


def refine(model: PrefixCostModel, options: L2Options, layout: Layout, dp: int, capacity: int, token_limit: int,
           decisions: list[str], recap: bool = False) -> Layout:
    """Bounded local search that levels work without ever raising Phi; see `place_windows`' docstring.

    Every `refine_pull_every`-th round is a pull round, the others push. A
    push round takes the first consumer not yet found stuck in this order:
    slot maxima by their excess over their slot's second-highest cost (what
    Phi can lose by moving work out: the maximum of a light slot counts as
    much as that of a heavy one), then every consumer by descending cost. It
    tries exports of a nested prefix to a consumer of its cell; moving one of
    its nested chains to the lightest consumers of its cell (repacking within
    the window) or of other cells of its window (an exchange between
    replicas); swapping a chain with a smaller chain of those consumers. A
    pull round takes the consumer furthest below its slot's maximum and tries
    moving in the tail of a nested chain (`_pull_moves`). A move is kept when
    (Phi, sum of squared costs) decreases lexicographically, the capacities
    hold, and, when it crosses replicas, tokens do not grow. With `recap`, a
    move that would overfill its cell's producer lowers that producer's
    sharing depth instead of being refused (`trial_score`).
    """
    stuck: set[tuple[int, bool]] = set()
    accepted = evaluations = recapped = 0
    cap_memo = {} if recap else None
    potential = work_potential(layout)
    for step in range(options.refine_steps):
        ev = layout.ev
        cost = ev.res_f + ev.res_b
        pull = step % options.refine_pull_every == options.refine_pull_every - 1
        fwd, bwd, _, _ = grid_costs(layout, dp)
        slot_cost = fwd + bwd
        slot_max = slot_cost.max(axis=0)
        excess = _excess_over_slot(cost, slot_cost, layout.slot)
        if pull:
            ranked = np.argsort(-(slot_max[layout.slot] - cost), kind="stable").tolist()
        else:
            leaders = np.flatnonzero(excess > 0)
            ranked = leaders[np.argsort(-excess[leaders], kind="stable")].tolist()
            ranked += np.argsort(-cost, kind="stable").tolist()
        order = [k for k in ranked if (k, pull) not in stuck]
        if not order:
            break
        focus = order[0]
        moves = _pull_moves(model, layout, ev, focus, dp, capacity, slot_max) if pull else \
            _push_moves(model, layout, ev, focus, dp, capacity, excess)
        best = best_score = None
        for positions, a, b in moves:
            trial = _apply_move(model, layout, positions, a, b, capacity)
            if trial is None:
                continue
            evaluations += 1
            score = trial_score(model, options, trial, dp, capacity, token_limit, layout, [a, b], cap_memo)
            if score is None:
                continue
            if layout.cell_of_consumer[b] != layout.cell_of_consumer[a] and trial.key[1] > layout.key[1]:
                continue   # exchanges between replicas never add tokens
            if score < (layout.key[0], potential) and (best is None or score < best_score):
                best, best_score = trial, score
        if best is None:
            stuck.add((focus, pull))
            continue
        recapped += int(np.any(best.cap_of_cell != layout.cap_of_cell))
        layout, potential = best, best_score[1]
        accepted += 1
        stuck.clear()
    lowered = f" ({recapped} lowered a producer's cap)" if recap else ""
    decisions.append(f"refine: {accepted} moves accepted{lowered}, {evaluations} candidates evaluated, "
                     f"{format_key(layout.key)}")
    return layout


def _excess_over_slot(cost: np.ndarray, slot_cost: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """Per consumer: its lead over the second-highest cost of its slot if it is the slot's maximum, else 0.

    With one replica every consumer leads its slot and Phi is the total, so none is singled out.
    """
    if slot_cost.shape[0] < 2:
        return np.zeros_like(cost)
    second, first = np.sort(slot_cost, axis=0)[-2:]
    return np.where(cost >= first[slot], cost - second[slot], 0)


def _push_moves(model, layout: Layout, ev: Evaluation, a: int, dp: int, capacity: int, excess: np.ndarray) -> list:
    """Candidate moves out of consumer a: (positions, from, to); -1 - p moves p from `to` to `from`.

    Moves are sized to shed about `excess[a]` (a slot maximum's lead over its
    slot) or, for a consumer that leads no slot, its excess over its window's mean.
    """
    lengths = model.lengths
    K = len(layout.cell_of_consumer)
    cost = ev.res_f + ev.res_b
    cell = int(layout.cell_of_consumer[a])
    in_window = np.flatnonzero(layout.cell_of_consumer // dp == cell // dp)
    per_row = max(1.0, cost[a] / max(1, ev.res_n[a]))
    shed = excess[a] if excess[a] > 0 else cost[a] - cost[in_window].mean()
    wanted = max(1.0, shed / per_row)
    members = np.flatnonzero(layout.consumer_of == a)
    same_cell = np.flatnonzero((layout.cell_of_consumer == cell) & (np.arange(K) != a))
    other_cells = in_window[layout.cell_of_consumer[in_window] != cell]
    light = (same_cell[np.argsort(cost[same_cell], kind="stable")][:2].tolist()
             + other_cells[np.argsort(cost[other_cells], kind="stable")][:2].tolist())
    moves = []
    exportable = _exportable(members, lengths, ev)
    gain = lengths[exportable] - ev.cached[exportable]
    exportable, gain = exportable[gain > 0], gain[gain > 0]
    members_index = _Members(model, layout.consumer_of)
    for x in exportable[np.argsort(np.abs(gain - wanted), kind="stable")][:3].tolist():
        receiver = _best_receiver(members_index, ev, x, same_cell, capacity)
        if receiver >= 0:
            moves.append((np.array([x]), a, receiver))
    runs = _member_runs(members, lengths, ev.lcp_consumer)
    sizes = _run_rows(runs, lengths, ev)
    if len(runs) > 1:
        for r in np.argsort(np.abs(sizes - wanted), kind="stable")[:2].tolist():
            moves += [(runs[r], a, b) for b in light]
    light_runs = {b: _member_runs(np.flatnonzero(layout.consumer_of == b), lengths, ev.lcp_consumer) for b in light}
    light_sizes = [(b, _run_rows(light_runs[b], lengths, ev)) for b in light]
    for ra, b, rb in _closest_swaps(sizes, light_sizes, wanted, SWAPS_PER_PUSH):
        moves.append((np.concatenate([runs[ra], -1 - light_runs[b][rb]]), a, b))
    return moves


SWAPS_PER_PUSH = 4


def _closest_swaps(sizes: np.ndarray, light_sizes: list, wanted: float, limit: int) -> list[tuple[int, int, int]]:
    """The `limit` swaps (ra, b, rb), run ra of the focus consumer (`sizes[ra]` rows) for a smaller run rb
    of light consumer b (`light_sizes` lists (b, its runs' sizes)), whose size difference is closest to
    `wanted`, ordered by (|sizes[ra] - size of rb - wanted|, ra, b, rb).

    Equal to ranking every pair (a quadratic list on many short trajectories: GRPO-like groups with
    thousands of runs per consumer), from at most 2 x limit x limit candidates per run ra: the `limit`
    distinct sizes below sizes[ra] nearest to sizes[ra] - wanted on either side, and the first `limit` runs
    of each. A pair outside them has at least `limit` pairs of its own ra and b ranked before it.
    """
    keys, ras, bs, rbs = [], [], [], []
    for b, light in light_sizes:
        if not len(light) or not len(sizes):
            continue
        by_size = np.argsort(light, kind="stable")                  # by size, then run index
        values, first, counts = np.unique(light[by_size], return_index=True, return_counts=True)
        smaller = np.searchsorted(values, sizes, side="left")         # values[:smaller[ra]] < sizes[ra]
        ideal = np.minimum(np.searchsorted(values, sizes - wanted), smaller)
        near = ideal[:, None] + np.arange(-limit, limit)
        ra, column = np.nonzero((near >= 0) & (near < smaller[:, None]))
        value = near[ra, column]
        ra, value, k = np.repeat(ra, limit), np.repeat(value, limit), np.tile(np.arange(limit), len(value))
        kept = k < counts[value]
        ra, rb = ra[kept], by_size[first[value[kept]] + k[kept]]
        keys.append(np.abs(sizes[ra] - light[rb] - wanted))
        ras.append(ra)
        rbs.append(rb)
        bs.append(np.full(len(ra), b))
    if not keys:
        return []
    key, ra, b, rb = (np.concatenate(x) for x in (keys, ras, bs, rbs))
    best = np.lexsort((rb, b, ra, key))[:limit]
    return list(zip(ra[best].tolist(), b[best].tolist(), rb[best].tolist()))


def _pull_moves(model, layout: Layout, ev: Evaluation, b: int, dp: int, capacity: int, slot_max: np.ndarray) -> list:
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
    members_index = _Members(model, layout.consumer_of)
    # Every donor's members, donor by donor in sorted order, split into nested chains (as `_member_runs`).
    member_lists = [np.flatnonzero(layout.consumer_of == a) for a in donors]
    members = np.concatenate(member_lists) if member_lists else np.zeros(0, dtype=np.int64)
    if not len(members):
        return []
    donor = np.repeat(np.asarray(donors, dtype=np.int64), [len(m) for m in member_lists])
    first = np.ones(len(members), dtype=bool)
    first[1:] = (donor[1:] != donor[:-1]) | (ev.lcp_consumer[members[1:]] < lengths[members[:-1]])
    run_of = np.cumsum(first) - 1
    run_start = np.flatnonzero(first)
    run_last = np.append(run_start[1:], len(members)) - 1
    fits = ev.full[b] + members_index.growth(members[run_last], b) <= capacity
    # The tail from member i up leaves its donor the rows above the member below it.
    below = np.where(first, ev.lcp_consumer[members], lengths[members[np.maximum(np.arange(len(members)) - 1, 0)]])
    score = np.abs(lengths[members[run_last[run_of]]] - below - wanted)
    index = np.arange(len(members)) - run_start[run_of]
    # Two tails per fitting chain, closest to `wanted` first (ties: the longer tail), then the best twelve.
    order = np.lexsort((index, score, run_of))
    order = order[fits[run_of[order]]]
    group = np.flatnonzero(np.r_[True, run_of[order[1:]] != run_of[order[:-1]]])
    rank = np.arange(len(order)) - np.repeat(group, np.diff(np.append(group, len(order))))
    chosen = order[rank < 2]
    best = chosen[np.lexsort((run_of[chosen], index[chosen], donor[chosen], score[chosen]))][:12]
    return [(members[run_start[run_of[m]]:run_last[run_of[m]] + 1][index[m]:], int(donor[m]), b) for m in best]


class _Members:
    """A layout's members as sorted (consumer, position) keys: for any consumer, its nearest members around a
    position by binary search, so a growth query costs O(log N) instead of a scan of all N positions (which
    made refinement quadratic on steps of tens of thousands of trajectories)."""

    def __init__(self, model: PrefixCostModel, consumer_of: np.ndarray):
        self.model = model
        self.stride = np.int64(model.num_trajectories + 1)
        self.keys = np.sort(consumer_of.astype(np.int64) * self.stride + np.arange(model.num_trajectories))

    def growth(self, x, consumers) -> np.ndarray:
        """Rows each consumer would add to its complete layout to hold trajectory x (elementwise, broadcast):
        |x| minus x's longest common prefix with any member, reached at its nearest member below or above x."""
        model, keys, stride = self.model, self.keys, self.stride
        x, consumers = np.broadcast_arrays(np.asarray(x, dtype=np.int64), np.asarray(consumers, dtype=np.int64))
        at = np.searchsorted(keys, consumers * stride + x)       # the first member at or above x
        below = keys[np.maximum(at - 1, 0)]
        below = np.where((at > 0) & (below // stride == consumers), below % stride, -1)
        above = keys[np.minimum(at, len(keys) - 1)]
        above = np.where((at < len(keys)) & (above // stride == consumers), above % stride, model.num_trajectories)
        member = above == x                                    # x already in that consumer: nothing to add
        after = np.where(member, model.num_trajectories, above)
        shared = np.maximum(model.neighbour_lcp(below, x), model.neighbour_lcp(x, after))
        return np.where(member, 0, model.lengths[x] - shared)


def _best_receiver(members: _Members, ev: Evaluation, x: int, pool: np.ndarray, capacity: int) -> int:
    """The consumer of `pool` that takes trajectory x with the least growth of its complete layout (-1: none fits)."""
    if not len(pool):
        return -1
    growth = members.growth(x, pool)
    fits = ev.full[pool] + growth <= capacity
    if not fits.any():
        return -1
    return int(pool[fits][np.argmin(growth[fits])])


def _apply_move(model: PrefixCostModel, layout: Layout, positions: np.ndarray, a: int, b: int,
                capacity: int) -> Layout | None:
    """Move positions >= 0 from a to b, and positions encoded as -1 - p from b to a; None if a consumer empties
    or its complete layout would exceed `capacity`.

    The complete-layout check costs a few numpy calls on the two consumers' members, against a full
    re-evaluation of their cells; about half of refinement's proposals on tree-step steps fail it.
    """
    consumer_of = layout.consumer_of.copy()
    forward = positions[positions >= 0]
    backward = -1 - positions[positions < 0]
    consumer_of[forward] = b
    consumer_of[backward] = a
    for k in (a, b):
        members = np.flatnonzero(consumer_of == k)
        if not len(members) or model.cost(members) > capacity:
            return None
    return Layout(layout.name, consumer_of, layout.cell_of_consumer, layout.window_start, layout.cap_of_cell)
