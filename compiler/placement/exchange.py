"""L2's placement exchanges: whole consumers of one window trade cells (replicas).

Complete layouts do not change, so only producers can break capacity; every
accepted swap lowers (Phi, sum of squared costs) with tokens within L1's.
"""
from __future__ import annotations

import itertools

import numpy as np

from harts.compiler.placement.evaluation import Evaluation
from harts.compiler.placement.options import L2Options
from harts.compiler.placement.scoring import Layout, format_key, trial_score, work_potential
from harts.compiler.prefix_cost import PrefixCostModel


def _cost_in_cells(model: PrefixCostModel, layout: Layout, ev: Evaluation, cost: np.ndarray, dp: int) -> np.ndarray:
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


def _exchange_candidates(layout: Layout, cost: np.ndarray, dp: int,
                         cost_in_cell: np.ndarray | None = None) -> list[tuple[int, int, int]]:
    """Swaps (change, x, y) of consumers x, y in different cells of one window that lower its Phi.

    With costs held fixed, a window's Phi is the sum over slot ranks of the
    largest rank-th cost over its cells (each cell's slots are its costs in
    descending order, as `score_layout` orders them). A moved consumer costs
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


def exchange_consumers(model: PrefixCostModel, options: L2Options, layout: Layout, dp: int, capacity: int,
                       token_limit: int, decisions: list[str]) -> Layout:
    """Placement exchanges: whole consumers of one window trade replicas; see `place_windows`' docstring.

    Each round ranks the swaps twice, with costs held fixed and with the moved
    consumers re-estimated in their new cells (`_cost_in_cells`), interleaves
    the two rankings and keeps the first swap whose exact evaluation lowers
    (Phi, sum of squared costs). Neither surrogate ranks well alone on every
    workload: fixed costs ignore the caching a move loses, the estimate
    ignores what the old cell mates lose.
    """
    potential = work_potential(layout)
    accepted = evaluations = scanned = 0
    # Two rankings per round, each scoring |A| x |B| swaps of S slots for every pair of cells of a window.
    sizes = np.bincount(layout.cell_of_consumer, minlength=len(layout.cap_of_cell)).reshape(-1, dp)
    round_scan = 2 * int(sum((row.sum() ** 2 - (row ** 2).sum()) // 2 * (row.max(initial=0)) for row in sizes))
    stopped = ""
    for _ in range(options.exchange_rounds):
        if scanned + round_scan > options.exchange_scan_budget:
            stopped = f" (scan budget: {round_scan:,} numbers a round)"
            break
        scanned += round_scan
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
            trial = Layout(layout.name, layout.consumer_of, cells, layout.window_start, layout.cap_of_cell)
            evaluations += 1
            score = trial_score(model, options, trial, dp, capacity, token_limit, layout, [x, y])
            if score is not None and score < (layout.key[0], potential):
                kept = trial, score[1]
                break
        if kept is None:
            break
        layout, potential = kept
        accepted += 1
    decisions.append(f"exchanges: {accepted} consumer swaps accepted, {evaluations} evaluated{stopped}, "
                     f"{format_key(layout.key)}")
    return layout
