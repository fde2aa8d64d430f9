"""A candidate placement (`Layout`) and its key: (Phi, decoder tokens, imbalance, largest replica).

`score_layout` evaluates a layout exactly, caps producers that would exceed
the capacity, orders each cell's consumers into slots (descending residual
cost) and cells onto replicas (heaviest first onto the lightest), and
computes the key candidates are compared by, lexicographically (Appendix A.2).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from harts.compiler.placement.evaluation import Evaluation, evaluate, reevaluate, reevaluate_within_cell
from harts.compiler.placement.options import L2Options
from harts.compiler.prefix_cost import PrefixCostModel


@dataclass(slots=True)
class Layout:
    """A complete candidate: membership, cells, and the derived grid and key."""

    name: str
    consumer_of: np.ndarray        # int64[N]
    cell_of_consumer: np.ndarray   # int64[K]: cell = window * D + column (column: not yet a replica)
    window_start: np.ndarray       # int64[W + 1]
    cap_of_cell: np.ndarray        # int64[G]
    ev: Evaluation | None = None
    slot: np.ndarray | None = None        # int64[K]
    replica_of_cell: np.ndarray | None = None  # int64[G]
    key: tuple | None = None


def window_sizes(slots: int, windows: int) -> list[int]:
    base, extra = divmod(slots, windows)
    return [base + (1 if w < extra else 0) for w in range(windows)]


def score_layout(model: PrefixCostModel, options: L2Options, layout: Layout, dp: int, capacity: int,
                 allow_caps: bool = True, ev: Evaluation | None = None) -> bool:
    """Evaluate (unless `ev` is the layout's evaluation already), cap oversized producers, order slots
    and replicas, and compute the key.

    Returns False when a consumer's complete layout exceeds the capacity, or
    a producer does and `allow_caps` is off (local moves keep the caps).
    """
    K = len(layout.cell_of_consumer)
    W = len(layout.window_start) - 1
    G = W * dp
    if ev is None:
        ev = evaluate(model, options, layout.consumer_of, layout.cell_of_consumer, layout.cap_of_cell, K, G)
    if ev.full.max(initial=0) > capacity:
        return False
    oversized = np.flatnonzero(ev.pro_n > capacity)
    if oversized.size and not allow_caps:
        return False
    if oversized.size:
        layout.cap_of_cell = layout.cap_of_cell.copy()
        for g in oversized.tolist():
            layout.cap_of_cell[g] = _largest_cap(model, layout, g, capacity, ev)
        ev = evaluate(model, options, layout.consumer_of, layout.cell_of_consumer, layout.cap_of_cell, K, G)
    _order_and_key(layout, ev, dp)
    return True


def _order_and_key(layout: Layout, ev: Evaluation, dp: int) -> None:
    """Adopt `ev`, order each cell's consumers into slots and the cells onto replicas, and compute the key."""
    K = len(layout.cell_of_consumer)
    W = len(layout.window_start) - 1
    G = W * dp
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


def _largest_cap(model, layout: Layout, cell: int, capacity: int, ev: Evaluation, memo: dict | None = None) -> int:
    """The deepest sharing cap that keeps one producer within capacity; `ev` evaluates the layout at its
    current caps (a producer that fits there keeps its cap).

    A producer is the trie of its cached prefixes. At the depth `deepest` of
    its deepest cached row, lowering the cap by d drops at least the d rows
    of that path, so `deepest - overflow` always fits: the search runs on
    [deepest - overflow, deepest] (a few evaluations of one cell), not over
    every depth. `memo`, when given, remembers answers by the
    cell's membership and cap (local search meets the same producer again).
    """
    # A producer's rows depend on its own cell's positions only.
    positions = np.flatnonzero(layout.cell_of_consumer[layout.consumer_of] == cell)
    if memo is not None:
        key = (int(layout.cap_of_cell[cell]), positions.tobytes(), layout.consumer_of[positions].tobytes())
        if key not in memo:
            memo[key] = _largest_cap(model, layout, cell, capacity, ev)
        return memo[key]
    if ev.pro_n[cell] <= capacity:   # fits already: its cap stays
        return int(min(model.lengths.max(), layout.cap_of_cell[cell]))
    cached, lcp_cell = ev.cached[positions], ev.lcp_cell[positions]
    deepest = int(cached.max(initial=0))

    def rows(cap: int) -> int:
        # The producer's rows at a lower cap, without re-evaluating the cell: a position's cached depth is
        # min(LCP with another consumer's member, its length, cap), and every cap searched is at most the
        # current one, so it is min(cached, cap); the producer holds what lies above its lcp_cell
        # (`evaluate_positions`' pro_n).
        return int(np.maximum(np.minimum(cached, cap) - lcp_cell, 0).sum())

    # Bracket: lo fits, hi does not (at the deepest cached depth the producer is what `ev` says).
    hi, hi_rows = deepest, int(ev.pro_n[cell])
    lo = max(0, deepest - (hi_rows - capacity))
    lo_rows = rows(lo)
    if lo_rows > capacity:   # cannot happen by the argument above; kept exact rather than trusted
        lo, lo_rows = 0, rows(0)
    # Rows grow piecewise linearly with the cap: interpolate (false position), bisecting every other
    # step so that a bent stretch cannot slow the search below bisection's pace by more than half.
    for step in itertools.count():
        if hi - lo <= 1:
            return lo
        if step % 2 == 0 and hi_rows > lo_rows:
            guess = lo + (capacity - lo_rows) * (hi - lo) // (hi_rows - lo_rows)
        else:
            guess = (lo + hi) // 2
        guess = min(max(guess, lo + 1), hi - 1)
        guess_rows = rows(guess)
        if guess_rows <= capacity:
            lo, lo_rows = guess, guess_rows
        else:
            hi, hi_rows = guess, guess_rows


def grid_costs(layout: Layout, dp: int):
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


def format_key(key: tuple) -> str:
    """A placement key for people: (Phi, decoder tokens, imbalance, largest replica total)."""
    phi, tokens, imbalance, replica_total = key
    return f"Phi {phi:.4e}, {tokens:,} decoder tokens, imbalance {imbalance:.2%}, largest replica {replica_total:.4e}"


def _key(layout: Layout, dp: int) -> tuple:
    fwd, bwd, pf, pb = grid_costs(layout, dp)
    phi = int(fwd.max(axis=0).sum() + bwd.max(axis=0).sum() + pf.max(axis=0).sum() + pb.max(axis=0).sum())
    total = int(fwd.sum() + bwd.sum() + pf.sum() + pb.sum())
    tokens = int(layout.ev.res_n.sum() + layout.ev.pro_n.sum())
    imbalance = 1.0 - total / (dp * phi) if phi else 0.0
    replica_total = int((fwd.sum(axis=1) + bwd.sum(axis=1) + pf.sum(axis=1) + pb.sum(axis=1)).max())
    return (phi, tokens, imbalance, replica_total)


def work_potential(layout: Layout) -> float:
    """Sum of squared costs of every consumer and producer: lower when work is level."""
    ev = layout.ev
    consumer = (ev.res_f + ev.res_b).astype(np.float64)
    producer = (ev.pro_f + ev.pro_b).astype(np.float64)
    return float(np.dot(consumer, consumer) + np.dot(producer, producer))


def trial_score(model: PrefixCostModel, options: L2Options, trial: Layout, dp: int, capacity: int,
                token_limit: int, parent: Layout, consumers, recap: dict | None = None) -> tuple[int, float] | None:
    """(Phi, sum of squared costs) of a local-search trial; None when it breaks a capacity or runs more
    decoder tokens than L1's consumers would.

    `trial` differs from the scored `parent` only in the members or cells of
    `consumers`, so only the cells those occupy, before and after, are
    re-evaluated. A producer the trial pushes past the capacity refuses it,
    unless `recap` (a dict, `_largest_cap`'s memo) is given: then that
    producer's sharing depth is lowered until it fits, and the trial is
    scored with the caching it keeps.
    """
    consumers = np.asarray(consumers, dtype=np.int64)
    cells = np.union1d(parent.cell_of_consumer[consumers], trial.cell_of_consumer[consumers])
    members_changed = trial.consumer_of is not parent.consumer_of
    if len(cells) == 1 and members_changed and trial.cap_of_cell[cells[0]] == parent.cap_of_cell[cells[0]]:
        # A move inside one cell (most of refinement's trials): only the two consumers' positions change.
        ev = reevaluate_within_cell(model, options, parent.ev, trial.consumer_of, trial.cell_of_consumer,
                                    trial.cap_of_cell, int(cells[0]), consumers)
    else:
        ev = reevaluate(model, options, parent.ev, trial.consumer_of, trial.cell_of_consumer, trial.cap_of_cell,
                        cells, members_changed=members_changed)
    oversized = np.flatnonzero(ev.pro_n > capacity)
    if recap is not None and oversized.size and ev.full.max(initial=0) <= capacity:
        # Only the trial's cells changed, so only their producers can overflow; each gets its largest cap.
        trial.cap_of_cell = trial.cap_of_cell.copy()
        for g in oversized.tolist():
            trial.cap_of_cell[g] = _largest_cap(model, trial, g, capacity, ev, recap)
        ev = reevaluate(model, options, parent.ev, trial.consumer_of, trial.cell_of_consumer, trial.cap_of_cell,
                        cells, members_changed=trial.consumer_of is not parent.consumer_of)
    fits = score_layout(model, options, trial, dp, capacity, allow_caps=False, ev=ev)
    if not fits or trial.key[1] > token_limit:
        return None
    return trial.key[0], work_potential(trial)
