"""`harts stats PLAN [--json]`: the step's compression, balance, rounds and sizes."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harts.schema.errors import HartsError
from harts.schema.plan import read_plan_and_bytes
from harts.schema.summary import plan_statistics
from harts.schema.timing import plan_digest, timing_path


def read_planning_seconds(plan_path: str, plan_bytes: bytes) -> tuple[float | None, str]:
    """hartsc records timing beside the plan (`PLAN.timing.json`) to keep the plan deterministic.

    `plan_bytes` is the plan file's contents as read (`read_plan_and_bytes`).
    Returns (seconds, "") or (None, why there is no usable number: missing,
    unreadable, malformed, or recorded for other plan bytes: a record whose
    `plan_sha256` differs belongs to a plan since overwritten, e.g. by
    `harts.api.write_plan`, which writes no timing. Records without the
    digest, from earlier hartsc versions, are taken as they are.)
    """
    path = Path(plan_path)
    sidecar = timing_path(path)
    try:
        text = sidecar.read_text()
    except FileNotFoundError:
        return None, f"no {sidecar.name} beside the plan"
    except OSError as err:
        return None, f"cannot read {sidecar.name} ({err.strerror or err})"
    try:
        record = json.loads(text)
        seconds = record["planning_seconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        return None, f"{sidecar.name} holds no planning_seconds >= 0 (not hartsc's timing record)"
    digest = record.get("plan_sha256")
    if digest is not None and digest != plan_digest(plan_bytes):
        return None, f"{sidecar.name} was written for other plan bytes (the plan was replaced since)"
    return float(seconds), ""


def format_table(stats: dict) -> str:
    width = max(len(k) for k in stats)
    lines = []
    for key, value in stats.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<{width}}  {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harts stats", description="Summarise a HARTS plan.")
    parser.add_argument("plan", help="plan file written by hartsc")
    parser.add_argument("--json", action="store_true", help="print one JSON object (every key is a number)")
    args = parser.parse_args(argv)
    try:
        plan, plan_bytes = read_plan_and_bytes(args.plan)
    except HartsError as err:
        print(f"harts stats: {err}", file=sys.stderr)
        return err.exit_code
    seconds, why = read_planning_seconds(args.plan, plan_bytes)
    stats = plan_statistics(plan, seconds if seconds is not None else 0.0)
    if seconds is None:
        # The contract's keys are all numbers: 0 stands for "unknown", and this line says so.
        print(f"harts stats: {why}; planning_seconds shown as 0 (unknown)", file=sys.stderr)
    print(json.dumps(stats, sort_keys=True) if args.json else format_table(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
