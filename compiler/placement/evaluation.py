"""Exact rows and costs of one L2 assignment (consumers to cells), in numpy.

Invariant relied on by the search: every per-position quantity depends only
on the members of the position's own consumer and cell, and every consumer's
or producer's cost only on its own positions. So a move or swap confined to a
few cells is re-evaluated exactly from those cells alone (`reevaluate`), and
a move between two consumers of one cell from those two consumers' positions
alone (`reevaluate_within_cell`: the cell's other positions see the same
members outside their own consumer).

Legend: N sorted positions, K consumers, G cells (window x replica column).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.compiler.placement.options import L2Options
from harts.compiler.prefix_cost import PrefixCostModel

NO_CAP = np.int64(1) << 40   # a depth cap no trajectory reaches


@dataclass(slots=True)
class Evaluation:
    """Exact rows and costs of one assignment (see `evaluate`)."""

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


def evaluate(model: PrefixCostModel, options: L2Options, consumer_of: np.ndarray, cell_of_consumer: np.ndarray,
             cap_of_cell: np.ndarray, K: int, G: int) -> Evaluation:
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
    return evaluate_positions(model, options, positions, consumer_of, cell_of_consumer, cap_of_cell, K, G)


def reevaluate(model: PrefixCostModel, options: L2Options, base: Evaluation, consumer_of: np.ndarray,
               cell_of_consumer: np.ndarray, cap_of_cell: np.ndarray, cells,
               members_changed: bool = True) -> Evaluation:
    """`evaluate` of an assignment that differs from `base`'s only inside `cells`, in time of those cells.

    Every quantity of a position depends only on the members of its own
    consumer and cell, and a consumer's or producer's costs only on its
    positions; so a move or swap confined to `cells` (which must hold every
    consumer it touches, before and after) changes nothing elsewhere, and
    re-evaluating those cells' positions gives exactly `evaluate`'s result.
    When no consumer's members changed (a swap of cells), each position's LCP
    within its consumer is `base`'s.
    """
    K, G = len(cell_of_consumer), len(cap_of_cell)
    cells = np.asarray(cells, dtype=np.int64)
    touched = np.zeros(G, dtype=bool)
    touched[cells] = True
    consumers = np.flatnonzero(touched[cell_of_consumer])
    positions = np.flatnonzero(touched[cell_of_consumer[consumer_of]])
    part = evaluate_positions(model, options, positions, consumer_of, cell_of_consumer, cap_of_cell, K, G,
                              None if members_changed else base.lcp_consumer[positions])

    def spliced(old: np.ndarray, new: np.ndarray, index: np.ndarray, take: np.ndarray) -> np.ndarray:
        out = old.copy()
        out[index] = new[take]
        return out

    local = np.arange(len(positions))
    return Evaluation(*(spliced(getattr(base, name), getattr(part, name), positions, local)
                   for name in ("cached", "lcp_consumer", "lcp_cell")),
                 *(spliced(getattr(base, name), getattr(part, name), consumers, consumers)
                   for name in ("full", "res_n", "res_f", "res_b")),
                 *(spliced(getattr(base, name), getattr(part, name), cells, cells)
                   for name in ("pro_n", "pro_f", "pro_b")))


def reevaluate_within_cell(model: PrefixCostModel, options: L2Options, base: Evaluation, consumer_of: np.ndarray,
                           cell_of_consumer: np.ndarray, cap_of_cell: np.ndarray, cell: int,
                           consumers) -> Evaluation:
    """`evaluate` of an assignment that differs from `base`'s only in which of `consumers` (all in `cell`,
    before and after) holds which positions, under `base`'s caps; in time of those consumers' positions.

    The cell keeps its positions, so every position's LCP with the previous position of its cell is
    `base`'s; a position of any other consumer C of the cell sees the same members outside C, so its cached
    depth is `base`'s too. Only the moved consumers' positions are re-evaluated, and the cell's producer
    sums change by their contributions alone (exact integers, as `evaluate_positions`' are).
    """
    n = model.num_trajectories
    K = len(cell_of_consumer)
    touched = np.zeros(K, dtype=bool)
    touched[np.asarray(consumers, dtype=np.int64)] = True
    in_cell = np.flatnonzero(cell_of_consumer[consumer_of] == cell)   # the cell's positions, sorted
    labels = consumer_of[in_cell]
    local = np.flatnonzero(touched[labels])
    positions, consumer = in_cell[local], labels[local]
    m, size = len(positions), len(in_cell)

    by_consumer = np.argsort(consumer, kind="stable")
    same = consumer[by_consumer[1:]] == consumer[by_consumer[:-1]]
    lcp_consumer = np.zeros(m, dtype=np.int64)
    lcp_consumer[by_consumer[1:]] = np.where(
        same, model.neighbour_lcp(np.where(same, positions[by_consumer[:-1]], -1), positions[by_consumer[1:]]), 0)
    # Runs of one consumer in the cell's sorted positions; the nearest member of another consumer is just
    # outside the run (as in `evaluate_positions`, for one cell).
    new_run = np.ones(size, dtype=bool)
    new_run[1:] = labels[1:] != labels[:-1]
    run_start, run_end = (bound[local] for bound in _run_bounds(new_run))
    below = np.where(run_start > 0, in_cell[np.maximum(run_start - 1, 0)], -1)
    above = np.where(run_end < size - 1, in_cell[np.minimum(run_end + 1, size - 1)], n)
    below_above = model.neighbour_lcp(np.concatenate([below, positions]), np.concatenate([positions, above]))
    lengths = model.lengths[positions]
    cached = np.minimum(np.minimum(np.maximum(below_above[:m], below_above[m:]), lengths), cap_of_cell[cell])

    moved = np.flatnonzero(touched)
    res_n, res_f, res_b, full = (base.res_n.copy(), base.res_f.copy(), base.res_b.copy(), base.full.copy())
    for total, part in zip((res_n, res_f, res_b),
                           _run_costs(options, consumer, np.maximum(lcp_consumer, cached), lengths, K)):
        total[moved] = part[moved]
    full[moved] = np.bincount(consumer, weights=lengths - lcp_consumer, minlength=K).astype(np.int64)[moved]

    # The cell's producer changes by these positions' contributions alone.
    lcp_cell, one_group = base.lcp_cell[positions], np.zeros(m, dtype=np.int64)
    new = _run_costs(options, one_group, lcp_cell, np.maximum(cached, lcp_cell), 1)
    old = _run_costs(options, one_group, lcp_cell, np.maximum(base.cached[positions], lcp_cell), 1)
    pro_n, pro_f, pro_b = base.pro_n.copy(), base.pro_f.copy(), base.pro_b.copy()
    for total, after, before in zip((pro_n, pro_f, pro_b), new, old):
        total[cell] += int(after[0] - before[0])
    out_cached, out_lcp_consumer = base.cached.copy(), base.lcp_consumer.copy()
    out_cached[positions] = cached
    out_lcp_consumer[positions] = lcp_consumer
    return Evaluation(out_cached, out_lcp_consumer, base.lcp_cell, full, res_n, res_f, res_b, pro_n, pro_f, pro_b)


def evaluate_positions(model: PrefixCostModel, options: L2Options, positions: np.ndarray, consumer_of: np.ndarray,
                       cell_of_consumer: np.ndarray, cap_of_cell: np.ndarray, K: int, G: int,
                        lcp_consumer: np.ndarray | None = None) -> Evaluation:
    """`evaluate` restricted to sorted `positions`, a union of whole cells.

    Per-position fields are aligned with `positions`; consumer and producer
    fields are full-length, exact for the consumers and cells inside and 0
    elsewhere. `lcp_consumer`, when given, is each position's LCP with the
    previous member of its consumer, known already.
    """
    n = model.num_trajectories
    m = len(positions)
    lengths = model.lengths[positions]
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
    run_start, run_end = _run_bounds(new_run)
    before = run_start - 1
    before_ok = (before >= 0) & (cell_sorted[np.maximum(before, 0)] == cell_sorted)
    after = run_end + 1
    after_ok = (after < m) & (cell_sorted[np.minimum(after, m - 1)] == cell_sorted)
    # LCP with the nearest other-consumer member below and above, in one range-minimum query.
    below_above = model.neighbour_lcp(
        np.concatenate([np.where(before_ok, global_sorted[np.maximum(before, 0)], -1), global_sorted]),
        np.concatenate([global_sorted, np.where(after_ok, global_sorted[np.minimum(after, m - 1)], n)]))
    other = np.zeros(m, dtype=np.int64)
    other[by_cell] = np.maximum(below_above[:m], below_above[m:])
    cached = np.minimum(np.minimum(other, lengths), cap_of_cell[cell])

    # Consumer residual run of each position: [start, lengths).
    res_n, res_f, res_b = _run_costs(options, consumer, np.maximum(lcp_consumer, cached), lengths, K)
    full = np.bincount(consumer, weights=lengths - lcp_consumer, minlength=K).astype(np.int64)
    pro_n, pro_f, pro_b = _run_costs(options, cell, lcp_cell, np.maximum(cached, lcp_cell), G)
    return Evaluation(cached, lcp_consumer, lcp_cell, full, res_n, res_f, res_b, pro_n, pro_f, pro_b)


def _run_costs(options: L2Options, group: np.ndarray, low: np.ndarray, high: np.ndarray,
               size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group, the rows n, forward cost and backward cost of each position computing its depths
    [low, high): q = high - low rows, A = q low + q (q + 1) / 2 causal pairs, R = q high (`place_windows`'
    cost model). A consumer's residual run is [max(lcp_consumer, cached), length); a producer's
    [lcp_cell, max(cached, lcp_cell))."""
    q = high - low
    n = np.bincount(group, weights=q, minlength=size).astype(np.int64)
    forward = options.token_cost_forward * n + options.pair_cost_forward * np.bincount(
        group, weights=q * low + q * (q + 1) // 2, minlength=size).astype(np.int64)
    backward = options.token_cost_backward * n + options.pair_cost_backward * np.bincount(
        group, weights=q * high, minlength=size).astype(np.int64)
    return n, forward, backward


def _run_bounds(new_run: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First and last index of the run holding each element, runs starting where `new_run` is True
    (`new_run[0]` must be)."""
    index = np.arange(len(new_run), dtype=np.int64)
    run_start = np.maximum.accumulate(np.where(new_run, index, 0))
    run_last = np.ones(len(new_run), dtype=bool)
    run_last[:-1] = new_run[1:]
    run_end = np.minimum.accumulate(np.where(run_last, index, len(new_run))[::-1])[::-1]
    return run_start, run_end
