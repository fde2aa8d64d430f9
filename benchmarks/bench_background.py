"""How long compiling blocks a training loop: in process, and with `harts.api.BackgroundCompiler`.

Usage:
    python benchmarks/bench_background.py [--preset grpo|paper|small] [--dp 8] [--update-seconds 20]

Generates one step of `harts gen`'s preset in memory (default: single-turn
GRPO, 16,384 trajectories), hands its token arrays and advantages to
`compile_trajectories` in this process, then to a warm `BackgroundCompiler`
(its process has already compiled a tiny batch, as in a loop past its first
step) and sleeps `--update-seconds` in place of a training update before
asking for the plan. Prints one table: the seconds the caller is blocked in
each case (in process: the whole compile; background: sending the batch, then
waiting after the update), and whether the two plans are the same.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import harts.api as harts
from harts.schema.plan import encode_plan
from harts.tools import gen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=gen.PRESETS, default="grpo", help="harts gen preset (default grpo)")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel degree (default 8)")
    parser.add_argument("--update-seconds", type=float, default=20.0,
                        help="the training update the background compile overlaps (default 20)")
    args = parser.parse_args()
    records = list(gen.generate(gen.preset(args.preset)))
    tokens = [np.asarray(r["tokens"], dtype=np.int64) for r in records]
    advantages = np.array([r["advantages"] for r in records], dtype=np.float32)
    print(f"{args.preset}: {len(tokens):,} trajectories, {sum(map(len, tokens)):,} tokens, dp={args.dp}")

    start = time.perf_counter()
    here = harts.compile_trajectories(tokens, advantages=advantages, dp=args.dp)
    in_process = time.perf_counter() - start

    with harts.BackgroundCompiler() as compiler:
        compiler.submit([[1, 2, 3], [1, 2, 4]]).result()   # warm: the compiler process has imported HARTS
        start = time.perf_counter()
        pending = compiler.submit(tokens, advantages=advantages, dp=args.dp)
        submit = time.perf_counter() - start
        time.sleep(args.update_seconds)
        start = time.perf_counter()
        there = pending.result()
        wait = time.perf_counter() - start
    for plan in (here, there):
        plan.flags.pop("planning_seconds", None)
    rows = [("in process: compile_trajectories", f"{in_process:.2f} s"),
            ("background: submit", f"{submit:.2f} s"),
            (f"background: result() after a {args.update_seconds:g} s update", f"{wait:.2f} s"),
            ("same plan", str(encode_plan(here) == encode_plan(there)))]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
