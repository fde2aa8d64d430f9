"""`harts demo`: the README's main command, end to end on a built-in default.

Generates a small SWE-shaped step-wise workload, compiles it, verifies the
plan against the input, and prints the plan's statistics. Everything is
written under `--out` (default: a fresh temporary folder).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from harts.compiler import cli as hartsc
from harts.schema.errors import HartsError
from harts.tools import check, gen, stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harts demo", description="Generate, compile, check and summarise a small step.")
    parser.add_argument("--out", help="folder for trees.jsonl and step.plan (default: a new temporary folder)")
    parser.add_argument("--kind", choices=gen.KINDS, default="stepwise", help="sampling scheme (default stepwise)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel degree (default 2)")
    parser.add_argument("--capacity", type=int, default=65536, help="microbatch capacity T (default 65536)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="harts-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    trees, plan = out / "trees.jsonl", out / "step.plan"
    started = time.perf_counter()
    steps = [
        ("generate", gen.main, ["--kind", args.kind, "--seed", str(args.seed), "-o", str(trees)]),
        ("compile", hartsc.main, [str(trees), "-o", str(plan), "--dp", str(args.dp), "--capacity", str(args.capacity)]),
        ("check", check.main, [str(plan), "--trees", str(trees)]),
        ("stats", stats.main, [str(plan)]),
    ]
    for name, run, step_argv in steps:
        print(f"harts demo: {name}", file=sys.stderr)
        try:
            code = run(step_argv)
        except HartsError as err:
            print(f"harts demo: {err}", file=sys.stderr)
            return err.exit_code
        if code != 0:
            print(f"harts demo: step '{name}' failed (exit {code})", file=sys.stderr)
            return code
    print(f"harts demo: done in {time.perf_counter() - started:.1f}s; files in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
