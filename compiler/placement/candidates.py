"""L2's starting placements: L1's consumers kept, re-dealt or repacked, and fresh packings of windows.

Each function returns `Layout`s to be scored; `place_windows`' module
docstring names every candidate and why it is there. Every layout returned
fills the D x J grid: each cell of a window holds that window's slot count of
consumers.
"""
from __future__ import annotations

import numpy as np

from harts.compiler.ir.partition import L1Partition
from harts.compiler.placement.evaluation import NO_CAP
from harts.compiler.placement.options import L2Options
from harts.compiler.placement.packing import Cell, pack_units, repack_cells
from harts.compiler.placement.scoring import Layout
from harts.compiler.prefix_cost import INFEASIBLE, PrefixCostModel, RangeMin


def l1_layouts(model, options: L2Options, partition: L1Partition, dp: int,
               window_start: np.ndarray) -> list[Layout]:
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
    grid = Layout(f"l1-grid W={W}", consumer_of, window * dp + partition.replica.astype(np.int64), window_start, caps)
    first = np.array([int(m[0]) for m in partition.members], dtype=np.int64)
    column = np.empty(K, dtype=np.int64)
    for j in range(K // dp):
        in_slot = np.flatnonzero(slot == j)
        column[in_slot[np.argsort(first[in_slot], kind="stable")]] = np.arange(dp)
    ranked = Layout(f"l1-trie-rank W={W}", consumer_of, window * dp + column, window_start, caps)
    members = [np.asarray(m, dtype=np.int64) for m in partition.members]
    loads = np.array([_layout_cost(model, options, m) for m in members], dtype=np.int64)
    affine = np.empty(K, dtype=np.int64)
    for w in range(W):
        ks = np.flatnonzero(window == w)
        affine[ks] = w * dp + _rank_columns(model, [members[k] for k in ks.tolist()], loads[ks], dp, affine=True)
    return [grid, ranked, Layout(f"l1-affine W={W}", consumer_of, affine, window_start, caps)]


def l1_repacked_layouts(model, layouts: list[Layout], capacity: int) -> list[Layout]:
    """L1's cells with each cell's trajectories repacked (a cell that cannot be keeps L1's consumers)."""
    out = []
    for layout in layouts:
        repacked = repack_cells(model, layout, capacity, capacity, f"{layout.name} repacked", keep_failed=True)
        if repacked is not None:
            out.append(repacked)
    return out


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


def _cells_layout(model, cells: list[np.ndarray], sizes: list[int], dp: int, window_start: np.ndarray,
                  name: str) -> Layout:
    """A placeholder layout whose cell g holds `cells[g]` spread over sizes[g] consumers (to be repacked)."""
    consumer_of = np.empty(model.num_trajectories, dtype=np.int64)
    cell_of_consumer = np.repeat(np.arange(len(sizes)), sizes).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for g, positions in enumerate(cells):
        consumer_of[positions] = first[g] + np.arange(len(positions)) % sizes[g]
    W = len(window_start) - 1
    return Layout(name, consumer_of, cell_of_consumer, window_start, np.full(W * dp, NO_CAP, dtype=np.int64))


def repack_layouts(model: PrefixCostModel, dp: int, window_start: np.ndarray, capacity: int,
                   options: L2Options) -> list[Layout]:
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
            layout = repack_cells(model, base, capacity, unit_cost, base.name, keep_failed=False)
            if layout is not None:
                layouts.append(layout)
        # Dealt cells: each window's subtrees dealt heaviest first to the lightest cell (balance first).
        starts = _contiguous_cells(model, [size * dp for size in window_slots], capacity * dp)
        if starts is not None:
            cells = []
            for lo, hi in zip(starts.tolist(), np.append(starts[1:], n).tolist()):
                dealt: list[list[np.ndarray]] = [[] for _ in range(dp)]
                totals = np.zeros(dp, dtype=np.int64)
                for own, positions, _ in Cell(model, np.arange(lo, hi)).units(unit_cost):
                    c = int(np.argmin(totals))
                    dealt[c].append(positions)
                    totals[c] += own
                cells += [np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64) for parts in dealt]
            if all(len(c) >= size for c, size in zip(cells, sizes)):
                base = _cells_layout(model, cells, sizes, dp, window_start, f"dealt W={W} units<={factor}T")
                layout = repack_cells(model, base, capacity, unit_cost, base.name, keep_failed=False)
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
                   affine: bool = False) -> Layout | None:
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
        cell = Cell(model, np.arange(lo, hi))
        units = cell.units(unit_cost)
        packed = pack_units(model, units, count, capacity)
        if packed is None:
            return None
        members = [np.asarray(m, dtype=np.int64) for m in packed]
        loads = np.array([_layout_cost(model, options, m) for m in members], dtype=np.int64)
        columns = _rank_columns(model, members, loads, dp, affine)
        for k in np.argsort(-loads, kind="stable").tolist():   # consumers numbered by rank
            consumer_of[members[k]] = len(cell_of_consumer)
            cell_of_consumer.append(w * dp + int(columns[k]))
    W = len(window_start) - 1
    return Layout(name, consumer_of, np.asarray(cell_of_consumer, dtype=np.int64), window_start,
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
        if affine and j > 0 and dp > 1:   # one column: nothing to match, and the sorts below grow as S x N
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
    cached if the two sat in one cell (the estimate `exchange._cost_in_cells` makes,
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
