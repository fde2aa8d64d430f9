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
        # Every (consumer, member) as consumer * (N + 1) + position, sorted: one searchsorted finds each
        # consumer's members either side of a position (per-consumer bisects cost ~1 us each, and a
        # unit of a step-wide prompt asks every consumer of the cell).
        self.keys = np.empty(0, dtype=np.int64)

    def growth(self, positions: np.ndarray, run_cost: int, which=None) -> np.ndarray:
        """Exact C increase of adding a run (consecutive in its cell, so no member lies inside it)
        to each consumer, or to the consumers listed in `which`.

        Only a consumer with a member in the run's tree (`PrefixCostModel.tree_start`/`tree_stop`) can
        share a row with it: every other one grows by the run's whole cost. So the exact LCPs are read
        for those consumers alone, and a cell of thousands of consumers and small trees costs each unit
        a slice of `owner`, not a pass over every consumer's members (10,000 independent trajectories
        at capacity 1,000: 2,500 consumers, where L2 took 181 s)."""
        count = len(self.members)
        if which is None:
            start, stop = self.model.tree_start[int(positions[0])], self.model.tree_stop[int(positions[-1])]
            if stop - start >= count:   # a tree as large as the cell (one prompt): read every consumer
                return self._exact_growth(positions, run_cost, range(count))
            tree = self.owner[start:stop]
            sharing = np.zeros(count, dtype=bool)
            sharing[tree[tree >= 0]] = True
            out = np.full(count, run_cost, dtype=np.int64)
            if sharing.any():
                chosen = np.flatnonzero(sharing)
                out[chosen] = self._exact_growth(positions, run_cost, chosen.tolist())
            return out
        return self._exact_growth(positions, run_cost, which)

    def _exact_growth(self, positions: np.ndarray, run_cost: int, chosen) -> np.ndarray:
        model = self.model
        n = model.num_trajectories
        first, last = int(positions[0]), int(positions[-1])
        base = np.asarray(chosen, dtype=np.int64) * (n + 1)
        keys = self.keys
        at = np.searchsorted(keys, base + first)
        previous = keys[np.maximum(at - 1, 0)] if len(keys) else base
        following = keys[np.minimum(at, len(keys) - 1)] if len(keys) else base
        below = np.where((at > 0) & (previous >= base), previous - base, -1)
        above = np.where((at < len(keys)) & (following < base + n + 1), following - base, n)
        # One range-minimum query for the three LCPs of every consumer (left, right, joined):
        # this runs once per unit and consumer, and numpy's per-call cost dominates small arrays.
        count = len(below)
        lcp = model.neighbour_lcp(np.concatenate([below, np.full(count, last), below]),
                                  np.concatenate([np.full(count, first), above, above]))
        return run_cost - lcp[:count] - lcp[count:2 * count] + lcp[2 * count:]

    def add(self, k: int, positions: np.ndarray, growth: int, own: int) -> None:
        members = self.members[k]
        at = bisect.bisect_left(members, int(positions[0]))
        members[at:at] = positions.tolist()
        self._insert_keys(k, positions)
        self.full[k] += growth
        self.load[k] += own
        self.owner[positions] = k

    def _insert_keys(self, k: int, positions) -> None:
        new = k * (self.model.num_trajectories + 1) + np.asarray(positions, dtype=np.int64)
        self.keys = np.insert(self.keys, np.searchsorted(self.keys, new), new)

    def _remove_keys(self, k: int, positions) -> None:
        gone = k * (self.model.num_trajectories + 1) + np.asarray(positions, dtype=np.int64)
        self.keys = self.keys[~np.isin(self.keys, gone)]

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
            self._remove_keys(donor, [position])
            self._insert_keys(k, [position])
            for c in (donor, k):
                self.full[c] = self.model.cost(np.asarray(self.members[c], dtype=np.int64))
        return True

    def remove(self, k: int, positions: np.ndarray, own: int) -> None:
        """Take a unit's positions out of consumer k (its complete layout is recounted)."""
        remaining = sorted(set(self.members[k]) - set(positions.tolist()))
        self.members[k] = remaining
        self._remove_keys(k, positions)
        self.full[k] = self.model.cost(np.asarray(remaining, dtype=np.int64))
        self.load[k] -= own
        self.owner[positions] = -1


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
