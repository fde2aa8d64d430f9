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

Sharing windows come from L2 (`hartsc --levels l1+l2`); a plan without them is
drawn as an L1 plan (`harts.tools.viz_data` says how they are read).

This module is the report only: the plots, the page around them and the CLI.
What each plot shows is computed by `harts.tools.viz_data` (plan queries) and
drawn with `harts.tools.svg` (the SVG toolkit). The page is a pure function of
the plan, the tree choice and the planning time: the same inputs give the same
bytes, so two pages can be compared with `cmp`.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from harts.schema.errors import HartsError
from harts.schema.atomic import atomic_write_bytes, check_output_path
from harts.schema.plan import Plan, read_plan_and_bytes
from harts.schema.plan_invariants import require_valid_plan
from harts.schema.summary import plan_statistics
from harts.tools.stats import read_planning_seconds
from harts.tools.svg import (CHAR_PX, GRID, INK, MUTED, WIDTH, bar_chart, esc, fmt, legend, line,
                             message_svg, nice_ticks, rect, svg, text)
# harts.tools.diff and the tests import plan queries from here, as they did before
# the split: keep these names importable from harts.tools.viz.
from harts.tools.viz_data import (TreeView, cached_rows, grid_shape, microbatch_original_tokens,
                                  microbatch_window, plan_producers, producer_rows, slot_parts,
                                  tree_view, window_spans)

PLOT_IDS = ("work", "balance", "compression", "rounds", "windows", "tree")

# Tableau 10: distinguishable, and safe for the common colour-vision deficiencies.
CONSUMER, CACHED, PRODUCER, REPLAY = "#4e79a7", "#a0cbe8", "#f28e2b", "#e15759"
ROUND_COLORS = ("#4e79a7", "#59a14f", "#b07aa1", "#9c755f", "#76b7b2", "#edc948", "#ff9da7")
WINDOW_COLORS = ("#ffbe7d", "#8cd17d", "#b6992d", "#86bcb6", "#d4a6c8", "#f1ce63", "#fabfd2")


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
        plan, plan_bytes = read_plan_and_bytes(args.plan)
        require_valid_plan(args.plan, plan)   # the plots index the plan's tables
        page = render_report(plan, Path(args.plan).name, args.tree, read_planning_seconds(args.plan, plan_bytes)[0])
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
