"""Repacking a cell's trajectories into its consumers from intact subtrees (Appendix A.2).

Units are the cell's subtrees, cut at their shallowest fork only while their
complete layout exceeds a bound; they go, largest own rows first, to the
least-loaded consumer whose complete layout still fits them, with exact LCP
costs. Invariant of every packing returned: each consumer is non-empty and
its complete layout fits the capacity.
"""
from __future__ import annotations

import bisect

import numpy as np

from harts.compiler.placement.scoring import Layout
from harts.compiler.prefix_cost import PrefixCostModel, RangeMin


class Cell:
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
        self.owner = np.full(model.num_trajectories, -1, dtype=np.int64)   # consumer of each position
        # Each consumer's first and last member (N and -1 while empty): whether it has a member outside a tree.
        self.lowest = np.full(count, model.num_trajectories, dtype=np.int64)
        self.highest = np.full(count, -1, dtype=np.int64)

    def growth(self, positions: np.ndarray, run_cost: int, which=None) -> np.ndarray:
        """Exact C increase of adding a run (consecutive in its cell, so no member lies inside it)
        to each consumer, or to the consumers listed in `which`.

        C grows by the run's cost less the rows it shares with the consumer's nearest members below and
        above it. Outside the run's tree (`PrefixCostModel.tree_start`/`tree_stop`) a member shares
        exactly the step-wide prompt with it, so the nearest members are looked up in the tree's slice of
        `owner` alone, and only the LCPs of members found there are read: a unit costs a pass over its
        tree, not over the cell's members (10,000 independent trajectories at capacity 1,000: 2,500
        consumers, where L2 took 181 s; 40,000 trajectories under one 500-token prompt: packing took
        10.0 s while a prompt made the whole step one tree and every member was looked up)."""
        if which is not None:
            listed = np.asarray(which, dtype=np.int64)
            distinct, back = np.unique(listed, return_inverse=True)
            if len(distinct) < len(listed):   # each consumer looked up once below
                return self.growth(positions, run_cost, distinct)[back]
        model = self.model
        n, depth = model.num_trajectories, model.shared_depth
        first, last = int(positions[0]), int(positions[-1])
        start, stop = int(model.tree_start[first]), int(model.tree_stop[last])
        chosen = np.arange(len(self.members)) if which is None else np.asarray(which, dtype=np.int64)
        # Every consumer with no member in the tree shares the prompt with the run, or nothing if empty.
        out = np.where(self.highest[chosen] >= 0, run_cost - depth, run_cost)
        left, right = self.owner[start:first], self.owner[last + 1:stop]
        if left.max(initial=-1) < 0 and right.max(initial=-1) < 0:
            return out
        # Consumers with a member in the tree: their nearest members below and above the run there
        # (-1 / n: none in the tree).
        slot = np.full(len(self.members), -1, dtype=np.int64)
        slot[chosen] = np.arange(len(chosen))
        below, above = np.full(len(chosen), -1, dtype=np.int64), np.full(len(chosen), n, dtype=np.int64)
        held = np.flatnonzero(left >= 0)
        held = held[slot[left[held]] >= 0]
        np.maximum.at(below, slot[left[held]], start + held)
        held = np.flatnonzero(right >= 0)
        held = held[slot[right[held]] >= 0]
        np.minimum.at(above, slot[right[held]], last + 1 + held)
        inside = np.flatnonzero((below >= 0) | (above < n))
        below, above, chosen = below[inside], above[inside], chosen[inside]
        count = len(inside)
        # A member outside the tree shares `depth` rows with the run, and with anything on its other side.
        outside_below = (below < 0) & (self.lowest[chosen] < start)
        outside_above = (above >= n) & (self.highest[chosen] >= stop)
        lcp = model.neighbour_lcp(np.concatenate([below, np.full(count, last), below]),
                                  np.concatenate([np.full(count, first), above, above]))
        lcp_below = np.where(outside_below, depth, lcp[:count])
        lcp_above = np.where(outside_above, depth, lcp[count:2 * count])
        joined = np.where(outside_below & (above < n) | outside_above & (below >= 0), depth, lcp[2 * count:])
        out[inside] = run_cost - lcp_below - lcp_above + joined
        return out

    def add(self, k: int, positions: np.ndarray, growth: int, own: int) -> None:
        members = self.members[k]
        at = bisect.bisect_left(members, int(positions[0]))
        members[at:at] = positions.tolist()
        self.full[k] += growth
        self.load[k] += own
        self.owner[positions] = k
        self._bounds(k)

    def _bounds(self, k: int) -> None:
        members = self.members[k]
        self.lowest[k] = members[0] if members else self.model.num_trajectories
        self.highest[k] = members[-1] if members else -1

    def fill_empty(self) -> bool:
        """Give each empty consumer the first position of the consumer with the most members; False when
        that consumer has fewer than two. Both complete layouts are recounted: the donor's can only shrink
        and a lone trajectory fits T, so capacities still hold. `load` keeps the packing's own-row
        estimates (a single moved position has no unit to take its own rows from)."""
        for k in range(len(self.members)):
            if self.members[k]:
                continue
            donor = int(np.argmax([len(m) for m in self.members]))
            if len(self.members[donor]) < 2:
                return False
            position = self.members[donor].pop(0)
            self.members[k] = [position]
            self.owner[position] = k
            for c in (donor, k):
                self.full[c] = self.model.cost(np.asarray(self.members[c], dtype=np.int64))
                self._bounds(c)
        return True

    def remove(self, k: int, positions: np.ndarray, own: int) -> None:
        """Take a unit's positions out of consumer k (its complete layout is recounted)."""
        remaining = sorted(set(self.members[k]) - set(positions.tolist()))
        self.members[k] = remaining
        self.full[k] = self.model.cost(np.asarray(remaining, dtype=np.int64))
        self.load[k] -= own
        self.owner[positions] = -1
        self._bounds(k)


def pack_units(model: PrefixCostModel, units: list, count: int, capacity: int) -> list[list[int]] | None:
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
    for unit in units:
        own, positions, cost = unit
        growth = consumers.growth(positions, cost)
        fits = consumers.full + growth <= capacity
        if not fits.any():
            return None
        if own == 0 or rule == "shared":
            # A unit no residual row comes with (a duplicate or prefix of another unit's
            # trajectory) costs only capacity: put it where it grows the layout least.
            k = _least_fitting(fits, growth, consumers.load)
        elif rule == "balance":
            k = _least_fitting(fits, consumers.load, growth)
        else:
            k = _least_fitting(fits, consumers.load + growth - own, growth)
        consumers.add(k, positions, int(growth[k]), own)
        placed[k].append(unit)
    _level(consumers, placed, capacity)
    return consumers.members if consumers.fill_empty() else None


def _least_fitting(fits: np.ndarray, primary: np.ndarray, secondary: np.ndarray) -> int:
    """The fitting consumer least in (primary, secondary, index): two masked minima, not a sort per unit
    (a cell of 10,000 consumers sorted for each of 20,000 units took most of L2's 32 s)."""
    chosen = np.flatnonzero(fits)
    first = primary[chosen]
    chosen = chosen[first == first.min()]
    if len(chosen) > 1:
        second = secondary[chosen]
        chosen = chosen[second == second.min()]
    return int(chosen[0])


def _level(consumers: _Consumers, placed: list[list[tuple]], capacity: int) -> None:
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
                if len(consumers.members[heavy]) <= len(positions):   # it would leave heavy empty
                    continue
                consumers.remove(heavy, positions, own)
                consumers.add(light, positions, growth, own)
                placed[light].append(placed[heavy].pop(i))
                moved = True
                break
            if moved:
                break
        if not moved:
            return


def repack_cells(model: PrefixCostModel, layout: Layout, capacity: int, unit_cost: int, name: str,
                 keep_failed: bool) -> Layout | None:
    """Repack every cell of `layout` from intact subtrees into its consumer count.

    A cell that cannot be repacked keeps its consumers when `keep_failed`
    (they fit already); otherwise the whole candidate is dropped.
    """
    consumer_of = layout.consumer_of.copy()
    cell_of_position = layout.cell_of_consumer[layout.consumer_of]
    by_cell = np.argsort(cell_of_position, kind="stable")
    bounds = np.searchsorted(cell_of_position[by_cell], np.arange(len(layout.cap_of_cell) + 1))
    for g in range(len(layout.cap_of_cell)):
        positions = by_cell[bounds[g]:bounds[g + 1]]
        consumers = np.flatnonzero(layout.cell_of_consumer == g)
        if not len(consumers):
            continue
        packed = pack_units(model, Cell(model, positions).units(unit_cost), len(consumers), capacity)
        if packed is None:
            if keep_failed:
                continue
            return None
        for k, members in zip(consumers.tolist(), packed):
            consumer_of[members] = k
    return Layout(name, consumer_of, layout.cell_of_consumer, layout.window_start, layout.cap_of_cell)
