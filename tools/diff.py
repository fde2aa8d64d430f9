"""`harts diff A B [--json]`: what changed between two plans.

Compared: the compile flags, the trajectories (by id), microbatch membership,
placement (replica, slot), sharing windows, rounds and the statistics of
`harts stats`. Microbatches have no identity across plans, so they are matched
by shared members (greedily, largest overlap first); a trajectory "moved" when
it sits in B's microbatch that matches a different microbatch of A than its own
(or none). The terminal output shows only what changed; `--json` prints one
object with every section; each moved trajectory also names the A
microbatch its B microbatch matches (`to_matches`, null for a new one). The
exit status is 0 whether or not the plans differ (with `--exit-code`, 1 when
their bytes differ), 2 when a plan cannot be read.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from harts.schema.errors import HartsError, PlanFormatError
from harts.schema.plan import Plan, plan_from_bytes, read_plan_and_bytes
from harts.schema.summary import plan_statistics
from harts.text import plural
from harts.tools.viz import microbatch_window, plan_producers, producer_rows, window_spans

# planning_seconds is a timing beside the plan, not part of it: it always differs.
COMPARED_STATS_EXCLUDE = ("planning_seconds",)


def microbatch_place(plan: Plan, i: int) -> dict:
    mb = plan.microbatches[i]
    return {"microbatch": i, "replica": int(mb["replica"]), "slot": int(mb["slot"])}


def locations(plan: Plan) -> dict:
    """trajectory id -> index of the microbatch holding it."""
    ids = plan.step["ids"]
    where = {}
    for i, mb in enumerate(plan.microbatches):
        for t in mb["member_trajectory"].tolist():
            where[ids[t]] = i
    return where


def match_microbatches(where_a: dict, where_b: dict) -> dict[int, int]:
    """B microbatch -> the A microbatch it shares the most members with (one-to-one, greedy)."""
    overlap = Counter((where_a[t], where_b[t]) for t in where_b if t in where_a)
    matched_a, match = set(), {}
    for (a, b), _ in sorted(overlap.items(), key=lambda item: (-item[1], item[0])):
        if a not in matched_a and b not in match:
            matched_a.add(a)
            match[b] = a
    return match


def compare_flags(a: Plan, b: Plan) -> dict:
    flags_a = {**a.flags, "compiler": a.header.get("compiler")}
    flags_b = {**b.flags, "compiler": b.header.get("compiler")}
    return {k: [flags_a.get(k), flags_b.get(k)] for k in {**flags_a, **flags_b}}


def compare_windows(plan: Plan) -> dict:
    spans = window_spans(plan)
    return {"count": len(spans), "spans": [[w, lo, hi] for w, (lo, hi) in spans.items()],
            "producer_rows": sum(producer_rows(p) for p in plan_producers(plan)),
            "windowed_microbatches": sum(microbatch_window(mb) >= 0 for mb in plan.microbatches)}


def rounds_histogram(plan: Plan) -> dict[str, int]:
    counts = Counter(int(mb["num_rounds"]) for mb in plan.microbatches)
    return {str(r): counts[r] for r in sorted(counts)}


def diff_plans(a: Plan, b: Plan, identical_bytes: bool = False) -> dict:
    """Every section, before and after; `changed` names the sections that differ."""
    flags = compare_flags(a, b)
    stats_a, stats_b = plan_statistics(a), plan_statistics(b)
    statistics = {k: {"a": stats_a[k], "b": stats_b.get(k), "delta": stats_b.get(k, 0) - stats_a[k]}
                  for k in stats_a if k not in COMPARED_STATS_EXCLUDE}
    where_a, where_b = locations(a), locations(b)
    match = match_microbatches(where_a, where_b)
    moved = []
    for t, j in where_b.items():
        if t in where_a and match.get(j) != where_a[t]:
            # `to_matches`: the A microbatch B's microbatch stands for (None: a new one), so a move into a B
            # microbatch that happens to share its number with the source reads as what it is.
            moved.append({"id": t, "from": microbatch_place(a, where_a[t]), "to": microbatch_place(b, j),
                          "to_matches": match.get(j)})
    moved.sort(key=lambda x: (x["from"]["microbatch"], x["to"]["microbatch"]))  # stable: plan order within
    placement = []
    for j, i in sorted(match.items(), key=lambda item: item[1]):
        before, after = microbatch_place(a, i), microbatch_place(b, j)
        if (before["replica"], before["slot"]) != (after["replica"], after["slot"]):
            placement.append({"from": before, "to": after})
    only_a = [t for t in where_a if t not in where_b]
    only_b = [t for t in where_b if t not in where_a]
    windows = {"a": compare_windows(a), "b": compare_windows(b)}
    rounds = {"a": rounds_histogram(a), "b": rounds_histogram(b)}
    result = {
        "identical": identical_bytes,
        "flags": flags,
        "trajectories": {"a": len(where_a), "b": len(where_b), "only_in_a": only_a, "only_in_b": only_b},
        "statistics": statistics,
        "membership": {"moved": moved, "unmatched_a": sorted(set(range(len(a.microbatches))) - set(match.values())),
                       "unmatched_b": sorted(set(range(len(b.microbatches))) - set(match))},
        "placement": placement,
        "windows": windows,
        "rounds": rounds,
    }
    changed = []
    if any(x != y for x, y in flags.values()):
        changed.append("flags")
    if only_a or only_b:
        changed.append("trajectories")
    if any(v["a"] != v["b"] for v in statistics.values()):
        changed.append("statistics")
    if moved or result["membership"]["unmatched_a"] or result["membership"]["unmatched_b"]:
        changed.append("membership")
    if placement:
        changed.append("placement")
    if windows["a"] != windows["b"]:
        changed.append("windows")
    if rounds["a"] != rounds["b"]:
        changed.append("rounds")
    result["changed"] = changed
    return result


# ----------------------------------------------------------------------------- terminal output

def shown(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def signed(delta) -> str:
    if isinstance(delta, float):
        return f"{delta:+.4f}"
    return f"{delta:+,}"


def table(rows: list[list[str]], header: list[str], align: str, indent: str = "  ") -> list[str]:
    """Columns padded to their widest cell; `align` has one 'l' or 'r' per column."""
    widths = [max(len(r[c]) for r in rows + [header]) for c in range(len(header))]

    def row(cells: list[str]) -> str:
        return indent + "  ".join(v.ljust(w) if a == "l" else v.rjust(w)
                                  for v, w, a in zip(cells, widths, align)).rstrip()

    return [row(header)] + [row(r) for r in rows]


def trajectory_label(x) -> str:
    """An id as the terminal shows it: as written, unless that could mislead (a control character, which could
    break or colour the line; a comma or outer whitespace, which would blur the list): then quoted as repr."""
    if not isinstance(x, str):
        return str(x)
    return x if x.isprintable() and "," not in x and x == x.strip() and x else repr(x)


def place(p: dict) -> str:
    return f"mb {p['microbatch']} (r{p['replica']} s{p['slot']})"


def format_diff(d: dict, name_a: str, name_b: str, limit: int) -> str:
    changed = d["changed"]
    if d["identical"]:
        return f"identical: {name_a} and {name_b} are byte-identical"
    if not changed:
        return (f"same plan content: {name_a} and {name_b} differ in bytes but not in flags, membership, placement, "
                "windows, rounds or statistics")
    lines = [f"differ: {', '.join(changed)} ({name_a} -> {name_b})"]

    def more(total: int) -> None:
        if total > limit:
            lines.append(f"  ... {total - limit} more rows (--json lists all, --limit shows more)")

    if "flags" in changed:
        rows = [[k, shown(x), shown(y)] for k, (x, y) in d["flags"].items() if x != y]
        lines += ["", "flags"] + table(rows, ["", "A", "B"], "lrr")
    if "trajectories" in changed:
        t = d["trajectories"]
        lines += ["", f"trajectories: {t['a']:,} -> {t['b']:,} ({len(t['only_in_a']):,} only in A, "
                      f"{len(t['only_in_b']):,} only in B)"]
        for label, ids in (("only in A", t["only_in_a"]), ("only in B", t["only_in_b"])):
            if ids:
                lines.append(f"  {label}: " + ", ".join(map(trajectory_label, ids[:limit]))
                             + (" ..." if len(ids) > limit else ""))
    if "statistics" in changed:
        # dp, capacity and chunk_size already show under flags.
        rows = [[k, shown(v["a"]), shown(v["b"]), signed(v["delta"])]
                for k, v in d["statistics"].items() if v["a"] != v["b"] and k not in d["flags"]]
        if rows:
            lines += ["", "statistics"] + table(rows, ["", "A", "B", "change"], "lrrr")
    if "membership" in changed:
        m = d["membership"]
        common = d["trajectories"]["a"] - len(d["trajectories"]["only_in_a"])
        lines += ["", f"membership: {len(m['moved']):,} of {common:,} trajectories moved between microbatches "
                      "(microbatches matched by shared members)"]
        flows: dict[tuple, list] = {}
        for x in m["moved"]:
            counterpart = "none (new)" if x["to_matches"] is None else f"mb {x['to_matches']}"
            flows.setdefault((place(x["from"]), place(x["to"]), counterpart), []).append(trajectory_label(x["id"]))
        rows = []
        for (before, after, counterpart), ids in list(flows.items())[:limit]:
            listed = ", ".join(ids[:3]) + (f", ... (+{len(ids) - 3})" if len(ids) > 3 else "")
            rows.append([before, after, counterpart, str(len(ids)), listed])
        if rows:
            lines += table(rows, ["from (A)", "to (B)", "B's match in A", "n", "trajectory ids"], "lllrl")
            more(len(flows))
        for side, other in (("a", "B"), ("b", "A")):
            unmatched = m[f"unmatched_{side}"]
            if unmatched:
                lines.append(f"  {plural(len(unmatched), 'microbatch')} of {side.upper()} with no counterpart in "
                             f"{other}: " + ", ".join(f"mb {i}" for i in unmatched))
    if "placement" in changed:
        lines += ["", f"placement: {plural(len(d['placement']), 'matched microbatch')} changed replica or slot"]
        lines += table([[place(p["from"]), place(p["to"])] for p in d["placement"][:limit]], ["A", "B"], "ll")
        more(len(d["placement"]))
    if "windows" in changed:
        rows = [[k, shown(d["windows"]["a"][k]), shown(d["windows"]["b"][k])]
                for k in ("count", "windowed_microbatches", "producer_rows")]
        rows.append(["spans (w, first, last slot)", " ".join(f"{w}:{lo}-{hi}" for w, lo, hi in d["windows"]["a"]["spans"]) or "-",
                     " ".join(f"{w}:{lo}-{hi}" for w, lo, hi in d["windows"]["b"]["spans"]) or "-"])
        lines += ["", "windows"] + table(rows, ["", "A", "B"], "lrr")
    if "rounds" in changed:
        keys = sorted({*d["rounds"]["a"], *d["rounds"]["b"]}, key=int)
        rows = [[plural(int(k), "round"), shown(d["rounds"]["a"].get(k, 0)), shown(d["rounds"]["b"].get(k, 0))]
                for k in keys]
        lines += ["", "microbatches by number of rounds"] + table(rows, ["", "A", "B"], "lrr")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harts diff", description="Show what changed between two HARTS plans.")
    parser.add_argument("plan_a", help="the first plan (A)")
    parser.add_argument("plan_b", help="the second plan (B)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every section, changed or not")
    parser.add_argument("--limit", type=int, default=20,
                        help="most moved trajectories or re-placed microbatches listed in the terminal (default 20)")
    parser.add_argument("--exit-code", action="store_true",
                        help="exit 1 when the plans' bytes differ and 0 when they are identical, as diff(1) does "
                             "(default: 0 whenever both plans were read)")
    args = parser.parse_args(argv)
    if args.limit < 0:
        parser.error(f"--limit must be >= 0, got {args.limit}")
    try:
        a, data_a = read_plan_and_bytes(args.plan_a)
        try:
            data_b = Path(args.plan_b).read_bytes()
        except OSError as err:
            raise PlanFormatError(f"{args.plan_b}: cannot read plan ({err.strerror}); fix: check the path") from None
        identical = data_a == data_b
        del data_a
        # Identical bytes decode to the same plan: decode it once (a 16,384-trajectory plan takes seconds and
        # gigabytes to decode and validate); B's bytes are decoded as read, never read again.
        b = a if identical else plan_from_bytes(data_b, args.plan_b)
        del data_b
    except HartsError as err:
        print(f"harts diff: {err}", file=sys.stderr)
        return err.exit_code
    result = diff_plans(a, b, identical_bytes=identical)
    if args.json:
        print(json.dumps({"a": args.plan_a, "b": args.plan_b, **result}, default=str))
    else:
        print(format_diff(result, args.plan_a, args.plan_b, args.limit))
    return 1 if args.exit_code and not result["identical"] else 0


if __name__ == "__main__":
    sys.exit(main())
