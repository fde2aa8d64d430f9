"""`harts viz PLAN -o report.html`: one self-contained page of plots of a plan.

The page is plain HTML with inline CSS and inline SVG: no JavaScript, no
fonts or styles fetched at view time, so it opens from a CI artifact or a mail
attachment. Hovering a bar shows its numbers (SVG `<title>`). Everything is
derived from the plan's arrays (`harts.schema.plan` documents every key):

* `work`: rows per replica and slot, producer part (L2) stacked under the
  consumer's decoder part;
* `balance`: mean / max of that work across replicas, per slot;
* `compression`: original tokens of a microbatch's members / its compact rows;
* `rounds`: sequential linear-attention calls per microbatch;
* `windows`: the sharing windows on a slot timeline (L2 plans only);
* `tree`: one rollout tree's segments by position, chunk grid, replay, rounds.

Sharing windows come from L2 (`hartsc --levels l1+l2`). This module reads them
as: a microbatch's ``window`` (int, -1 or absent: none), its ``row_cached_by``
(int[C], >= 0 where the row comes from the window's producer), and a list
``producers`` of dicts with ``replica``, ``window`` and ``row_token`` (or
``num_rows``), held by the plan (`plan.producers`) or its step record. A plan
without them is drawn as an L1 plan. A producer's rows are charged to the first
slot of its window, where its forward runs (paper Section 3.4).
"""
from __future__ import annotations

import argparse
import html
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harts.schema.errors import HartsError
from harts.schema.atomic import atomic_write_bytes, check_output_path
from harts.schema.plan import Plan, read_plan
from harts.schema.summary import plan_statistics
from harts.tools.stats import read_planning_seconds

PLOT_IDS = ("work", "balance", "compression", "rounds", "windows", "tree")

# Tableau 10: distinguishable, and safe for the common colour-vision deficiencies.
CONSUMER, CACHED, PRODUCER, REPLAY = "#4e79a7", "#a0cbe8", "#f28e2b", "#e15759"
ROUND_COLORS = ("#4e79a7", "#59a14f", "#b07aa1", "#9c755f", "#76b7b2", "#edc948", "#ff9da7")
WINDOW_COLORS = ("#ffbe7d", "#8cd17d", "#b6992d", "#86bcb6", "#d4a6c8", "#f1ce63", "#fabfd2")
INK, MUTED, GRID = "#222", "#666", "#e4e4e4"
WIDTH = 960                   # every plot's width in px (the page is 1000 px wide)
MAX_TREE_SEGMENTS = 160       # lanes drawn in the tree plot; larger trees are cut, and say so
CHAR_PX = 6.1                 # approximate width of one 11 px sans-serif character


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


# ----------------------------------------------------------------------------- SVG helpers

def esc(value) -> str:
    return html.escape(str(value), quote=True)


def fmt(value: float) -> str:
    if isinstance(value, (int, np.integer)) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}" if abs(value) >= 10 else f"{value:.3g}"


def nice_ticks(top: float, count: int = 5, integer: bool = False) -> list[float]:
    """0 .. >= top in 1-2-5 steps."""
    if top <= 0:
        return [0, 1]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(1, math.ceil(step))
    n = math.ceil(top / step - 1e-9)
    return [round(k * step, 10) for k in range(n + 1)]


def text(x, y, content, *, size=11, anchor="start", color=INK, weight="normal", rotate=None) -> str:
    transform = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate is not None else ""
    bold = ' font-weight="bold"' if weight != "normal" else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{color}"'
            f'{bold}{transform}>{esc(content)}</text>')


def rect(x, y, w, h, fill, *, stroke=None, extra="", tip=None) -> str:
    outline = f' stroke="{stroke}"' if stroke else ""
    body = f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{max(h, 0):.1f}" fill="{fill}"{outline}{extra}'
    return body + (f"><title>{esc(tip)}</title></rect>" if tip else "/>")


def line(x1, y1, x2, y2, color, *, width=1.0, dash=None) -> str:
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}" '
            f'stroke-width="{width}"{dashed}/>')


def legend(items: list[tuple[str, str]], x_right: float, y: float) -> str:
    """Swatches right-aligned at the top of a plot."""
    parts, x = [], x_right
    for label, color in reversed(items):
        x -= len(label) * CHAR_PX + 8
        parts.append(text(x, y + 9, label, size=11))
        x -= 16
        parts.append(rect(x, y, 12, 12, color, extra=' class="swatch"'))
        x -= 14
    return "".join(parts)


def svg(svg_id: str, height: float, body: list[str], title: str) -> str:
    return (f'<svg id="{svg_id}" width="{WIDTH}" height="{height:.0f}" '
            f'viewBox="0 0 {WIDTH} {height:.0f}" role="img" aria-label="{esc(title)}" '
            f'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">{"".join(body)}</svg>')


def message_svg(svg_id: str, message: str) -> str:
    body = [rect(0.5, 0.5, WIDTH - 1, 59, "#fafafa", stroke=GRID), text(WIDTH / 2, 35, message, size=13,
                                                                     anchor="middle", color=MUTED)]
    return svg(svg_id, 60, body, message)


def bar_chart(svg_id: str, *, title: str, labels: list[str], series: list[tuple[str, str, np.ndarray]],
              y_label: str, x_label: str, groups: list[tuple[str, int, int]] | None = None,
              refs: tuple[tuple[float, str, str], ...] = (), y_top: float | None = None,
              integer_y: bool = False, tips: list[str] | None = None, height: int = 250) -> str:
    """Stacked bars, optionally in groups (a gap between groups, group labels under the axis)."""
    n = len(labels)
    ml, mr, mt, mb_ = 70, 20, 30, 58 if groups else 46
    pw, ph = WIDTH - ml - mr, height - mt - mb_
    totals = sum((np.asarray(v, dtype=float) for _, _, v in series), np.zeros(n))
    top = y_top if y_top is not None else max([float(totals.max()) if n else 0.0] + [r[0] for r in refs]) * 1.08
    ticks = nice_ticks(top, integer=integer_y)
    top = ticks[-1]
    group_of = np.zeros(n, dtype=np.int64)
    if groups:
        for g, (_, first, count) in enumerate(groups):
            group_of[first:first + count] = g
    gap = 0.8 if groups and len(groups) > 1 else 0.0
    unit = pw / max(n + gap * (group_of[-1] if n else 0), 1)
    bar_w = min(max(unit * 0.8, 1.0), 56.0)

    def x_of(k: int) -> float:
        return ml + (k + gap * group_of[k]) * unit + (unit - bar_w) / 2

    def y_of(v: float) -> float:
        return mt + ph - ph * (v / top if top else 0)

    body = [text(ml, 16, title, size=12, weight="bold")]
    for t in ticks:
        body.append(line(ml, y_of(t), ml + pw, y_of(t), GRID))
        body.append(text(ml - 6, y_of(t) + 4, fmt(t), size=10, anchor="end", color=MUTED))
    for k in range(n):
        base, parts = 0.0, []
        for name, color, values in series:
            v = float(values[k])
            if v > 0:
                parts.append(rect(x_of(k), y_of(base + v), bar_w, y_of(base) - y_of(base + v), color))
            base += v
        tip = tips[k] if tips else f"{labels[k]}: {fmt(base)}"
        body.append(f"<g><title>{esc(tip)}</title>{''.join(parts)}</g>")
    for value, label, color in refs:
        body.append(line(ml, y_of(value), ml + pw, y_of(value), color, width=1.5, dash="6 4"))
        body.append(text(ml + pw - 4, y_of(value) - 5, label, size=10, anchor="end", color=color))
    body.append(line(ml, mt + ph, ml + pw, mt + ph, INK))
    body.append(line(ml, mt, ml, mt + ph, INK))
    every = max(1, math.ceil(max((len(s) for s in labels), default=1) * 6.5 / unit)) if n else 1
    for k in range(0, n, every):
        body.append(text(x_of(k) + bar_w / 2, mt + ph + 14, labels[k], size=10, anchor="middle", color=MUTED))
    if groups:
        g_every = max(1, math.ceil(max(len(g[0]) for g in groups) * 6.5 / max(unit * groups[0][2], 1)))
        for g, (label, first, count) in enumerate(groups):
            if g % g_every:
                continue
            centre = (x_of(first) + x_of(first + count - 1) + bar_w) / 2
            body.append(text(centre, mt + ph + 30, label, size=11, anchor="middle"))
    body.append(text(ml + pw / 2, height - 6, x_label, size=11, anchor="middle"))
    body.append(text(16, mt + ph / 2, y_label, size=11, anchor="middle", rotate=-90))
    if len(series) > 1:
        body.append(legend([(name, color) for name, color, _ in series], ml + pw, 4))
    return svg(svg_id, height, body, title)


# ----------------------------------------------------------------------------- the plots

def work_plot(plan: Plan) -> str:
    producer, decoder, cached = slot_parts(plan)
    dp, slots = producer.shape
    labels, tips, groups = [], [], []
    for j in range(slots):
        groups.append((f"slot {j}", j * dp, dp))
        for d in range(dp):
            labels.append(f"r{d}")
            tips.append(f"replica {d}, slot {j}: producer {producer[d, j]:,} + consumer decoder "
                        f"{decoder[d, j]:,} rows ({cached[d, j]:,} more cached)")
    series = [("consumer rows (decoder)", CONSUMER, decoder.T.reshape(-1))]
    if producer.any():
        series.insert(0, ("producer rows", PRODUCER, producer.T.reshape(-1)))
    return bar_chart("work", title="Work per replica and slot (compact rows through the decoder)",
                     labels=labels if dp > 1 else [""] * len(labels), series=series, groups=groups,
                     y_label="rows", tips=tips,
                     x_label="replica (r) within each microbatch slot" if dp > 1 else "microbatch slot (one replica)",
                     refs=((float(plan.flags["capacity"]), f"capacity {int(plan.flags['capacity']):,}", MUTED),)
                     if (producer + decoder).max(initial=0) > 0.5 * int(plan.flags["capacity"]) else ())


def balance_plot(plan: Plan, overall: float) -> str:
    producer, decoder, _ = slot_parts(plan)
    work = producer + decoder
    peak = work.max(axis=0) if work.size else np.zeros(0)
    ratio = np.where(peak > 0, work.mean(axis=0) / np.maximum(peak, 1), 1.0)
    tips = [f"slot {j}: mean {work[:, j].mean():,.0f} / max {peak[j]:,} rows = {ratio[j]:.3f}"
            for j in range(work.shape[1])]
    return bar_chart("balance", title="Balance per slot (mean / max work across replicas; 1 = perfect)",
                     labels=[str(j) for j in range(work.shape[1])], series=[("mean / max", "#59a14f", ratio)],
                     y_label="mean / max", x_label="microbatch slot", y_top=1.0, tips=tips, height=220,
                     refs=((overall, f"step balance {overall:.3f}", INK),))


def microbatch_labels(plan: Plan) -> list[str]:
    return [str(i) for i in range(len(plan.microbatches))]


def compression_plot(plan: Plan, stats: dict) -> str:
    original = np.array([microbatch_original_tokens(plan, mb) for mb in plan.microbatches], dtype=float)
    rows = np.array([len(mb["row_token"]) for mb in plan.microbatches], dtype=float)
    ratio = np.where(rows > 0, original / np.maximum(rows, 1), 0.0)
    tips = [f"microbatch {i} (replica {mb['replica']}, slot {mb['slot']}): {int(original[i]):,} tokens of "
            f"{len(mb['member_trajectory'])} trajectories / {int(rows[i]):,} rows = {ratio[i]:.2f}x"
            for i, mb in enumerate(plan.microbatches)]
    refs = [(stats["compression"], f"step {stats['compression']:.2f}x", INK)]
    bound = stats.get("compression_bound")
    if bound and bound > stats["compression"] * 1.01:
        refs.append((bound, f"trie bound {bound:.2f}x", MUTED))
    return bar_chart("compression", title="Compression per microbatch (original tokens / compact rows)",
                     labels=microbatch_labels(plan), series=[("compression", CONSUMER, ratio)],
                     y_label="original / compact", x_label="microbatch (plan order)", tips=tips,
                     refs=tuple(refs), height=230)


def rounds_plot(plan: Plan) -> str:
    rounds = np.array([int(mb["num_rounds"]) for mb in plan.microbatches], dtype=float)
    tips = [f"microbatch {i}: {int(rounds[i])} rounds, {len(mb['sequence_round'])} sequences, "
            f"{len(mb['replay_rows'])} replay rows" for i, mb in enumerate(plan.microbatches)]
    return bar_chart("rounds", title="Linear-attention rounds per microbatch (sequential packed calls)",
                     labels=microbatch_labels(plan), series=[("rounds", "#76b7b2", rounds)],
                     y_label="rounds", x_label="microbatch (plan order)", integer_y=True, tips=tips,
                     height=200, y_top=max(float(rounds.max(initial=0)), 1.0))


def windows_plot(plan: Plan) -> str:
    spans = window_spans(plan)
    if not spans:
        levels = plan.flags.get("levels", "l1")
        message = ("no sharing windows: L1 plan" if levels == "l1"
                   else f"no sharing windows in this plan (levels {levels})")
        return message_svg("windows", message)
    dp, slots = grid_shape(plan)
    producers = {(int(p["replica"]), int(p["window"])): producer_rows(p) for p in plan_producers(plan)}
    ml, mr, mt, lane = 80, 20, 34, 30
    height = mt + dp * lane + 40
    col = (WIDTH - ml - mr) / max(slots, 1)
    strip = min(col * 0.28, 40)     # the producer strip at the left of a window's first slot
    body = [text(ml, 16, "Sharing windows over slots (P: producer forward, bars: consumers)", size=12,
                 weight="bold"),
            legend([("producer", PRODUCER), ("consumer decoder rows", CONSUMER), ("cached rows", CACHED)],
                   WIDTH - mr, 4)]
    for w, (lo, hi) in spans.items():
        color = WINDOW_COLORS[w % len(WINDOW_COLORS)]
        body.append(rect(ml + lo * col + 1, mt - 4, (hi - lo + 1) * col - 2, dp * lane + 8, color,
                         extra=' fill-opacity="0.35" rx="4"', tip=f"window {w}: slots {lo}..{hi}"))
        body.append(text(ml + lo * col + 4, mt + dp * lane + 16, f"W{w} (slots {lo}-{hi})", size=10))
    for mb_index, mb in enumerate(plan.microbatches):
        d, j, w = int(mb["replica"]), int(mb["slot"]), microbatch_window(mb)
        rows = len(mb["row_token"])
        c = cached_rows(mb)
        left = ml + j * col + (strip if w >= 0 and spans[w][0] == j else 0) + 3
        width = ml + (j + 1) * col - 3 - left
        y = mt + d * lane + 4
        tip = f"microbatch {mb_index} (replica {d}, slot {j}, window {w if w >= 0 else 'none'}): {rows:,} rows, {c:,} cached"
        body.append(rect(left, y, width, lane - 8, CACHED, tip=tip))
        body.append(rect(left + width * (c / rows if rows else 0), y, width * (1 - c / rows if rows else 1),
                         lane - 8, CONSUMER, tip=tip))
        if width > 40:
            # A white halo keeps the label readable on both the dark and the light part of the bar.
            body.append(text(left + 4, y + 15, f"mb {mb_index}", size=10).replace(
                "<text ", '<text stroke="#fff" stroke-width="3" paint-order="stroke" ', 1))
    for (d, w), rows in producers.items():
        lo = spans[w][0]
        body.append(rect(ml + lo * col + 3, mt + d * lane + 4, strip - 4, lane - 8, PRODUCER,
                         tip=f"producer of window {w} on replica {d}: {rows:,} rows"))
        body.append(text(ml + lo * col + 3 + (strip - 4) / 2, mt + d * lane + 19, "P", size=10,
                         anchor="middle", color="#fff"))
    for d in range(dp):
        body.append(text(ml - 8, mt + d * lane + 19, f"replica {d}", size=11, anchor="end"))
    for j in range(slots):
        body.append(text(ml + (j + 0.5) * col, mt + dp * lane + 32, f"slot {j}", size=10, anchor="middle",
                         color=MUTED))
    return svg("windows", height, body, "sharing windows")


def tree_plot(view: TreeView) -> str:
    bars = view.segments
    B = view.chunk_size
    ml, mr, mt, lane = 70, 20, 48, 24
    height = mt + len(bars) * lane + 44
    extent = max((b.end for b in bars), default=1)
    pw = WIDTH - ml - mr

    def x_of(p: float) -> float:
        return ml + pw * p / extent

    body = [text(ml, 16, f"Rollout {view.label} in microbatch {view.microbatch}: segments by position", size=12,
                 weight="bold")]
    rounds = sorted({r for b in bars for r in b.rounds})
    body.append(legend([(f"round {r}", ROUND_COLORS[(r - 1) % len(ROUND_COLORS)]) for r in rounds]
                       + ([("replay", REPLAY)] if any(b.replays for b in bars) else []), WIDTH - mr, 4))
    body.append(text(WIDTH - mr, 34, "\u25bc exported chunk-boundary state", size=10, anchor="end", color=MUTED))
    grid_every = B * max(1, math.ceil(4.0 / max(pw * B / extent, 1e-9)))  # keep grid lines >= 4 px apart
    plot_bottom = mt + len(bars) * lane
    for p in range(0, extent + 1, grid_every):
        body.append(line(x_of(p), mt - 4, x_of(p), plot_bottom, GRID, width=0.8))
    lane_of = {b.index: k for k, b in enumerate(bars)}
    for k, b in enumerate(bars):
        if b.parent in lane_of:  # connector from the parent's end down to this child's lane
            body.append(line(x_of(b.start), mt + lane_of[b.parent] * lane + lane / 2, x_of(b.start),
                             mt + k * lane + lane / 2, "#999", width=1))
    for k, b in enumerate(bars):
        y = mt + k * lane + 5
        h = lane - 10
        color = ROUND_COLORS[(b.rounds[0] - 1) % len(ROUND_COLORS)]
        rounds_label = "R" + "-".join(str(r) for r in b.rounds) if len(b.rounds) <= 2 else f"R{b.rounds[0]}..{b.rounds[-1]}"
        tip = (f"segment {b.index} (level {b.level}): positions {b.start}..{b.end - 1} ({b.end - b.start:,} rows), "
               f"round {', '.join(map(str, b.rounds))}, {b.multiplicity} trajectories"
               + "".join(f"; replays {a}..{s - 1} from S_{a}" for a, s in b.replays))
        body.append(rect(x_of(b.start), y, max(x_of(b.end) - x_of(b.start), 1.5), h, color, tip=tip))
        for anchor, first in b.replays:
            body.append(rect(x_of(anchor), y - 2, max(x_of(first) - x_of(anchor), 2.0), h + 4, REPLAY,
                             tip=f"replay positions {anchor}..{first - 1} ({first - anchor} rows) from the "
                                 f"state at {anchor}"))
        for p in b.exports:
            body.append(f'<path d="M{x_of(p) - 4:.1f},{y - 5:.1f} h8 l-4,6 z" fill="{INK}"/>')
        label = f"{rounds_label} \u00b7 {b.end - b.start:,} tok \u00b7 \u00d7{b.multiplicity}"
        inside = x_of(b.end) - x_of(b.start) > len(label) * CHAR_PX + 8
        if inside:
            body.append(text(x_of(b.start) + 4, y + h - 3, label, size=10, color="#fff"))
        else:
            lx = x_of(b.end) + 4
            anchor = "start" if lx + len(label) * CHAR_PX < WIDTH else "end"
            body.append(text(lx if anchor == "start" else x_of(b.start) - 4, y + h - 3, label, size=10,
                             anchor=anchor))
        body.append(text(ml - 6, y + h - 3, f"v{b.index} L{b.level}", size=10, anchor="end", color=MUTED))
    axis_y = plot_bottom + 4
    body.append(line(ml, axis_y, ml + pw, axis_y, INK))
    for t in nice_ticks(extent, count=8, integer=True):
        if t <= extent:
            body.append(line(x_of(t), axis_y, x_of(t), axis_y + 4, INK))
            body.append(text(x_of(t), axis_y + 16, fmt(t), size=10, anchor="middle", color=MUTED))
    body.append(text(ml + pw / 2, height - 6, f"position in trajectory (grid: every {grid_every} positions"
                     + (f" = {grid_every // B} chunks" if grid_every != B else ", one chunk B") + ")",
                     size=11, anchor="middle"))
    return svg("tree", height, body, f"rollout {view.label}")


# ----------------------------------------------------------------------------- the page

CSS = """
body { font: 14px/1.45 "DejaVu Sans", Helvetica, Arial, sans-serif; color: #222; margin: 24px auto;
       max-width: 1000px; padding: 0 16px; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 28px 0 4px; border-bottom: 1px solid #ddd; padding-bottom: 3px; }
p.sub, p.caption { color: #555; margin: 2px 0 8px; font-size: 13px; }
table#stats { border-collapse: collapse; margin: 12px 0; font-size: 13px; }
table#stats td { padding: 3px 10px; border-bottom: 1px solid #eee; }
table#stats td.k { color: #555; }
table#stats td.v { text-align: right; font-variant-numeric: tabular-nums; font-weight: 600; padding-right: 26px; }
svg { display: block; max-width: 100%; height: auto; }
code { background: #f4f4f4; padding: 0 3px; border-radius: 3px; }
"""


def stat_value(key: str, value) -> str:
    if key in ("compression", "compression_bound"):
        return f"{value:.2f}\u00d7"
    if key == "balance":
        return f"{value:.4f}"
    if key == "planning_seconds":
        return f"{value:.3f} s"
    return fmt(value) if isinstance(value, (int, float)) else str(value)


def stats_table(stats: dict, columns: int = 3) -> str:
    items = list(stats.items())
    rows = []
    per_column = math.ceil(len(items) / columns)
    for r in range(per_column):
        cells = []
        for c in range(columns):
            k = c * per_column + r
            if k < len(items):
                key, value = items[k]
                cells.append(f'<td class="k">{esc(key)}</td><td class="v">{esc(stat_value(key, value))}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return '<table id="stats">' + "".join(rows) + "</table>"


def render_report(plan: Plan, plan_name: str, tree_id: str | None = None, planning_seconds: float | None = None) -> str:
    stats = plan_statistics(plan, planning_seconds or 0.0)
    view = tree_view(plan, tree_id)
    flags = ", ".join(f"{k}={v}" for k, v in plan.flags.items())
    windows = window_spans(plan)
    cut = (f" Only the first {len(view.segments)} of its {view.total_segments} segments are drawn."
           if view.total_segments > len(view.segments) else "")
    sections = [
        ("Work per replica and slot", work_plot(plan),
         "Compact rows each replica runs through the decoder at each slot. "
         + ("Orange: a window's producer, charged to the window's first slot; blue: each consumer's residual rows."
            if windows else "L1 plan: every consumer runs its whole compact layout (no producers).")),
        ("Balance", balance_plot(plan, stats["balance"]),
         "Mean over replicas / maximum, per slot, of the work above (the paper's eta_sched per slot); "
         "the dashed line is the step's balance from <code>harts stats</code>."),
        ("Compression", compression_plot(plan, stats),
         "Original tokens of a microbatch's member trajectories / its compact rows; dashed: the step's value "
         "and the bound if every shared prefix of the step were one row."),
        ("Linear-attention rounds", rounds_plot(plan),
         "Sequential packed linear-attention calls of each microbatch (paper Section 3.3)."),
        ("Sharing windows", windows_plot(plan),
         f"{len(windows)} windows; producers compute shared prefixes once per replica and window."
         if windows else "Sharing windows are placed by L2 (<code>hartsc --levels l1+l2</code>)."),
        ("Rollout tree", tree_plot(view),
         f"{esc(view.label)}: {view.trajectories} trajectories in microbatch {view.microbatch}. Each bar is a "
         f"fork-free segment (v: index, L: level), from its first to its last position, coloured and labelled "
         f"by its round, with its length and the trajectories through it (\u00d7). Red: positions replayed "
         f"from the preceding chunk boundary; grey lines: the chunk grid (B = {view.chunk_size}). "
         f"{esc(view.note)}{cut}"),
    ]
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>HARTS plan: {esc(plan_name)}</title>", f"<style>{CSS}</style></head><body>",
        f"<h1>HARTS plan: {esc(plan_name)}</h1>",
        f'<p class="sub">{esc(plan.header.get("compiler", "hartsc"))} \u00b7 schema v{esc(plan.header.get("schema_version"))}'
        f" \u00b7 {esc(flags)}</p>",
        stats_table(stats),
    ]
    for heading, figure, caption in sections:
        parts.append(f"<section><h2>{esc(heading)}</h2><p class=\"caption\">{caption}</p>{figure}</section>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harts viz", description="Write a self-contained HTML page of plots of a plan.")
    parser.add_argument("plan", help="plan file written by hartsc")
    parser.add_argument("-o", "--output", required=True, help="HTML file to write (atomically)")
    parser.add_argument("--tree", help="tree id (the input's `tree` field) to draw; default: the largest tree "
                                       "of the first microbatch")
    args = parser.parse_args(argv)
    try:
        # Before the plan is read: a bad -o (a folder, the plan itself) costs nothing.
        output = check_output_path(args.output, inputs=[args.plan])
        plan = read_plan(args.plan)
        page = render_report(plan, Path(args.plan).name, args.tree, read_planning_seconds(args.plan))
        atomic_write_bytes(output, page.encode("utf-8"))
    except HartsError as err:
        print(f"harts viz: {err}", file=sys.stderr)
        return err.exit_code
    except OSError as err:
        print(f"harts viz: cannot write {args.output} ({err.strerror}); fix: check the folder and its permissions",
              file=sys.stderr)
        return 2
    print(f"harts viz: wrote {args.output} ({len(page) / 1024:.0f} KiB, {len(PLOT_IDS)} plots)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
