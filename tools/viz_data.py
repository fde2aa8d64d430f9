"""What the `harts viz` plots show, computed from a plan: no drawing here.

Each function reads a `Plan` (`harts.schema.plan` documents every key) and
returns plain numbers, numpy arrays or small frozen dataclasses; the report
(`harts.tools.viz`) turns them into SVG and `harts diff` compares them between
two plans. Nothing here emits markup or knows a pixel.

Sharing windows come from L2 (`hartsc --levels l1+l2`). This module reads them
as: a microbatch's ``window`` (int, -1 or absent: none), its ``row_cached_by``
(int[C], >= 0 where the row comes from the window's producer), and a list
``producers`` of dicts with ``replica``, ``window`` and ``row_token`` (or
``num_rows``), held by the plan (`plan.producers`) or its step record. A plan
without them reads as an L1 plan. A producer's rows are charged to the first
slot of its window, where its forward runs (paper Section 3.4).

Invariants: the work arrays are indexed [replica, slot] with shape
`grid_shape(plan)`; a `TreeView` lists at most `MAX_TREE_SEGMENTS` segments in
DFS preorder, parents before children, and `total_segments` says how many the
tree has, so a cut tree is reported, never silently shortened.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.schema.errors import HartsError
from harts.schema.plan import Plan

MAX_TREE_SEGMENTS = 160       # lanes drawn in the tree plot; larger trees are cut, and say so


# ----------------------------------------------------------------------------- plan reading

def plan_producers(plan: Plan) -> list[dict]:
    """L2 producers, wherever the plan keeps them; [] for an L1 plan."""
    producers = getattr(plan, "producers", None)
    if producers is None:
        producers = plan.step.get("producers")
    return list(producers or [])


def microbatch_window(mb: dict) -> int:
    window = mb.get("window")
    return -1 if window is None else int(window)


def cached_rows(mb: dict) -> int:
    """Rows of this consumer whose decoder states come from its window's producer."""
    cached_by = mb.get("row_cached_by")
    return 0 if cached_by is None else int(np.count_nonzero(np.asarray(cached_by) >= 0))


def producer_rows(producer: dict) -> int:
    if "row_token" in producer:
        return len(producer["row_token"])
    return int(producer.get("num_rows", 0))


def grid_shape(plan: Plan) -> tuple[int, int]:
    dp = int(plan.flags["dp"])
    slots = 1 + max((int(mb["slot"]) for mb in plan.microbatches), default=-1)
    return dp, slots


def window_spans(plan: Plan) -> dict[int, tuple[int, int]]:
    """window id -> (first slot, last slot); replicas share window boundaries."""
    spans: dict[int, tuple[int, int]] = {}
    for mb in plan.microbatches:
        w, j = microbatch_window(mb), int(mb["slot"])
        if w >= 0:
            lo, hi = spans.get(w, (j, j))
            spans[w] = (min(lo, j), max(hi, j))
    for p in plan_producers(plan):
        spans.setdefault(int(p["window"]), (0, 0))
    return dict(sorted(spans.items()))


def slot_parts(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """producer[d, j], consumer decoder[d, j], consumer cached[d, j] rows."""
    dp, slots = grid_shape(plan)
    producer = np.zeros((dp, slots), dtype=np.int64)
    decoder = np.zeros((dp, slots), dtype=np.int64)
    cached = np.zeros((dp, slots), dtype=np.int64)
    for mb in plan.microbatches:
        d, j = int(mb["replica"]), int(mb["slot"])
        c = cached_rows(mb)
        cached[d, j] += c
        decoder[d, j] += len(mb["row_token"]) - c
    spans = window_spans(plan)
    for p in plan_producers(plan):
        first_slot = spans[int(p["window"])][0]
        if slots:
            producer[int(p["replica"]), first_slot] += producer_rows(p)
    return producer, decoder, cached


def microbatch_original_tokens(plan: Plan, mb: dict) -> int:
    offsets = np.asarray(plan.step["token_offsets"], dtype=np.int64)
    members = np.asarray(mb["member_trajectory"], dtype=np.int64)
    return int((offsets[members + 1] - offsets[members]).sum())


def member_rows(mb: dict, member_index: int) -> np.ndarray:
    runs = mb["member_run_offsets"]
    lo, hi = int(runs[member_index]), int(runs[member_index + 1])
    starts, lengths = mb["run_row_start"][lo:hi], mb["run_length"][lo:hi]
    if hi == lo:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist())])


# ----------------------------------------------------------------------------- the tree

@dataclass(frozen=True, slots=True)
class SegmentBar:
    """One segment of the drawn tree: positions [start, end), its rounds, replay and exports."""

    index: int
    parent: int
    level: int
    start: int
    end: int
    rounds: tuple[int, ...]
    multiplicity: int
    replays: tuple[tuple[int, int], ...]   # (anchor, first position) of each sequence starting here
    exports: tuple[int, ...]               # positions after which a boundary state is exported


@dataclass(frozen=True, slots=True)
class TreeView:
    label: str
    microbatch: int
    trajectories: int
    segments: tuple[SegmentBar, ...]      # DFS preorder, parents first
    total_segments: int
    chunk_size: int
    note: str


def tree_key(plan: Plan, trajectory: int):
    trees = plan.step.get("trees") or []
    key = trees[trajectory] if trajectory < len(trees) else None
    return None if key is None else str(key)


def choose_tree(plan: Plan, tree_id: str | None) -> tuple[int, list[int], str, str]:
    """(microbatch index, member indices inside it, label, note) of the tree to draw."""
    if not plan.microbatches:
        raise HartsError("plan has no microbatches; fix: compile a non-empty trees file")
    offsets = np.asarray(plan.step["token_offsets"], dtype=np.int64)
    if tree_id is not None:
        holders = []
        for i, mb in enumerate(plan.microbatches):
            members = [k for k, t in enumerate(mb["member_trajectory"].tolist()) if tree_key(plan, t) == tree_id]
            if members:
                tokens = sum(int(offsets[t + 1] - offsets[t]) for t in mb["member_trajectory"][members].tolist())
                holders.append((-tokens, i, members))
        if not holders:
            known = sorted({k for t in range(int(plan.step["num_trajectories"])) if (k := tree_key(plan, t))})
            shown = ", ".join(known[:5]) + (", ..." if len(known) > 5 else "")
            raise HartsError(f"tree '{tree_id}' is not in the plan; fix: pass one of its trees "
                             f"({shown or 'the plan records no tree ids: omit --tree'})")
        holders.sort()
        _, i, members = holders[0]
        note = ""
        if len(holders) > 1:
            others = ", ".join(str(h[1]) for h in holders[1:6]) + (", ..." if len(holders) > 6 else "")
            note = f"The planner split this tree; its other trajectories are in microbatch {others}."
        return i, members, f"tree {tree_id}", note
    mb = plan.microbatches[0]
    groups: dict[str, list[int]] = {}
    for k, t in enumerate(mb["member_trajectory"].tolist()):
        key = tree_key(plan, t)
        if key is None:  # no tree ids recorded: a tree is everything below one root row
            key = f"root row {int(mb['run_row_start'][mb['member_run_offsets'][k]])}"
        groups.setdefault(key, []).append(k)

    def size(item):
        return sum(int(offsets[t + 1] - offsets[t]) for t in mb["member_trajectory"][item[1]].tolist())

    key, members = max(groups.items(), key=size)
    label = key if key.startswith("root row") else f"tree {key}"
    return 0, members, label, "The largest tree (original tokens) of the first microbatch."


def tree_view(plan: Plan, tree_id: str | None) -> TreeView:
    i, members, label, note = choose_tree(plan, tree_id)
    mb = plan.microbatches[i]
    seg_start = np.asarray(mb["segment_row_start"], dtype=np.int64)
    seg_parent = np.asarray(mb["segment_parent"], dtype=np.int64)
    seg_level = np.asarray(mb["segment_level"], dtype=np.int64)
    position = np.asarray(mb["row_position"], dtype=np.int64)
    seq_start = np.asarray(mb["sequence_row_start"], dtype=np.int64)
    seq_round = np.asarray(mb["sequence_round"], dtype=np.int64)
    anchors = np.asarray(mb["sequence_start_position"], dtype=np.int64)
    replay_len = np.diff(np.asarray(mb["sequence_replay_offsets"], dtype=np.int64))
    export_row = np.asarray(mb["export_row"], dtype=np.int64)

    covered = np.zeros(len(mb["row_token"]), dtype=bool)
    for k in members:
        covered[member_rows(mb, k)] = True
    wanted = set(np.flatnonzero(covered[seg_start[:-1]]).tolist())
    children: dict[int, list[int]] = {}
    for v in sorted(wanted):
        children.setdefault(int(seg_parent[v]), []).append(v)
    order: list[int] = []
    stack = list(reversed(children.get(-1, [])))
    # A tree's segments are closed under parents; a parent outside `wanted` would
    # be a broken plan, and its orphans are drawn as roots rather than dropped.
    stack += [v for v in sorted(wanted) if seg_parent[v] >= 0 and int(seg_parent[v]) not in wanted]
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(reversed(children.get(v, [])))

    bars = []
    for v in order[:MAX_TREE_SEGMENTS]:
        lo, hi = int(seg_start[v]), int(seg_start[v + 1])
        q_lo = int(np.searchsorted(seq_start, lo, side="right") - 1)
        q_hi = int(np.searchsorted(seq_start, hi - 1, side="right") - 1)
        starting = [q for q in range(q_lo, q_hi + 1) if lo <= seq_start[q] < hi]
        replays = tuple((int(anchors[q]), int(position[seq_start[q]])) for q in starting if replay_len[q] > 0)
        in_segment = export_row[(export_row >= lo) & (export_row < hi)]
        bars.append(SegmentBar(
            index=v, parent=int(seg_parent[v]), level=int(seg_level[v]),
            start=int(position[lo]), end=int(position[hi - 1]) + 1,
            rounds=tuple(sorted(set(seq_round[q_lo:q_hi + 1].tolist()))),
            multiplicity=int(mb["row_multiplicity"][lo]), replays=replays,
            exports=tuple(sorted((position[in_segment] + 1).tolist()))))
    return TreeView(label=label, microbatch=i, trajectories=len(members), segments=tuple(bars),
                    total_segments=len(order), chunk_size=int(plan.flags["chunk_size"]), note=note)

