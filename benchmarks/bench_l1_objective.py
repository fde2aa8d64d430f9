"""Compare L1's two objectives end to end: the step's critical path after L1+L2 under each.

Usage:
    python benchmarks/bench_l1_objective.py [--dp 2,4,8] [--paper-steps N] [--capacity 65536] [--sweep]

`hartsc --l1-objective compression` ranks L1's partitions as the paper's
Equation 1 does (least total compact work first); `step-time` (the default)
ranks the critical path first: the sum over slots of the heaviest
microbatch, since replicas run a slot together. For each workload and DP
degree D this compiles the step both ways with sharing windows (hartsc's
default levels) and prints, per objective, the plan's critical path in rows
and in L2's cost model (the paper's Phi: slot maxima plus window-producer
maxima), its cost balance (eta_sched) and its decoder rows, then the change
step-time makes. A lower bound on the critical path in rows is printed too:
the longest trajectory (it runs whole on one replica) and the step's unique
trie rows over D (each runs on some replica), whichever is larger.

Workloads (built in memory, deterministic):

* `comb`: one 8,000-token rollout with 1,999 branches of 1-30 tokens leaving
  it at random depths: one prefix spans the step, the case compression-first
  planning leaves D - 1 replicas nearly idle on;
* `stepwise-small`, `treestep-small`: `harts gen`'s default steps (57 and
  104 trajectories), a single slot at these D;
* `stepwise-paper-S`, `treestep-paper-S` for S < `--paper-steps`: the paper
  preset (~1,600 trajectories, ~44M tokens), seed S; many full slots.

`--sweep` adds one line over many small steps: `harts gen`'s small preset
with 2, 3, 4, 6 or 8 tasks, seeds 0-2, both kinds, at each D: how many
step-time plans have a critical path in L2's cost model more than 1% shorter
or longer than compression's, the geometric mean of the ratio, and the worst
cases. These steps have at most 8 consumers, so step-time's plans there are
the better of L2 from both objectives' L1 partitions (the pipeline's second
start) and can be no longer; before the second start, 3 of the 90 were, by
up to 6.8%.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools

import numpy as np

from bench_planners import build_batch, parse_dps
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.schema.summary import plan_statistics
from harts.tools import gen

OBJECTIVES = ("compression", "step-time")


def comb(branches: int = 1999, spine: int = 8000, seed: int = 0) -> TrajectoryBatch:
    rng = np.random.default_rng(seed)
    full = rng.integers(1, 50000, size=spine)
    lists = [full.tolist()]
    for _ in range(branches):
        depth = int(rng.integers(2, spine))
        lists.append(full[:depth].tolist() + rng.integers(50000, 60000, size=int(rng.integers(1, 31))).tolist())
    return TrajectoryBatch.from_token_lists(lists)


def measure(batch: TrajectoryBatch, dp: int, capacity: int, objective: str) -> dict:
    result = compile_batch(batch, CompileOptions(dp=dp, capacity=capacity, l1_objective=objective))
    stats = plan_statistics(result.plan)
    return {"rows": stats["critical_path_tokens"], "cost": stats["cost_critical_path"],
            "balance": stats["cost_balance"], "decoder": stats["decoder_tokens"],
            "unique": stats["trie_unique_tokens"], "longest": int(result.trie.lengths.max())}


def sweep(dps: list[int], capacity: int) -> str:
    ratios, worst = [], []
    for kind, tasks, seed in itertools.product(gen.KINDS, (2, 3, 4, 6, 8), (0, 1, 2)):
        config = dataclasses.replace(gen.preset("small", kind), tasks=tasks, seed=seed)
        batch = TrajectoryBatch.from_token_lists([r["tokens"] for r in gen.generate(config)])
        for dp in (d for d in dps if d <= batch.num_trajectories):
            runs = {objective: measure(batch, dp, capacity, objective) for objective in OBJECTIVES}
            ratios.append(runs["step-time"]["cost"] / runs["compression"]["cost"])
            worst.append((ratios[-1], f"{kind} tasks={tasks} seed={seed} D={dp}"))
    ratios = np.asarray(ratios)
    longest = ", ".join(f"{name} {ratio - 1:+.1%}" for ratio, name in sorted(worst, reverse=True)[:3])
    return (f"sweep: {len(ratios)} small steps; step-time's cost critical path >1% shorter in "
            f"{int((ratios < 0.99).sum())}, >1% longer in {int((ratios > 1.01).sum())}; geometric mean ratio "
            f"{np.exp(np.log(ratios).mean()):.3f}, best {ratios.min() - 1:+.1%}; longest: {longest}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", default="2,4,8", help="comma-separated DP degrees (default 2,4,8)")
    parser.add_argument("--paper-steps", type=int, default=1,
                        help="paper-preset steps of each kind (seeds 0..N-1; default 1, 0 for none)")
    parser.add_argument("--capacity", type=int, default=65536, help="microbatch capacity T (default 65536)")
    parser.add_argument("--sweep", action="store_true", help="add the summary over many small generated steps")
    args = parser.parse_args()
    dps = parse_dps(parser, args.dp)
    if args.paper_steps < 0:
        parser.error(f"--paper-steps must be >= 0, got {args.paper_steps}")

    workloads = {"comb": comb, "stepwise-small": lambda: build_batch("small", "stepwise"),
                 "treestep-small": lambda: build_batch("small", "treestep")}
    for seed in range(args.paper_steps):
        for kind in ("stepwise", "treestep"):
            workloads[f"{kind}-paper-{seed}"] = lambda kind=kind, seed=seed: build_batch("paper", kind, seed=seed)

    header = (f"{'workload':<18} {'D':>2} {'rows bound':>10} | {'compression: rows':>17} {'cost':>15} {'bal':>6} "
              f"{'decoder':>10} | {'step-time: rows':>15} {'cost':>15} {'bal':>6} {'decoder':>10} | "
              f"{'rows':>7} {'cost':>7}")
    print(header)
    print("-" * len(header))
    for name, build in workloads.items():
        batch = build()
        for dp in dps:
            runs = {objective: measure(batch, dp, args.capacity, objective) for objective in OBJECTIVES}
            paper, ours = runs["compression"], runs["step-time"]
            bound = max(ours["longest"], -(-ours["unique"] // dp))
            print(f"{name:<18} {dp:>2} {bound:>10,} | {paper['rows']:>17,} {paper['cost']:>15,} "
                  f"{paper['balance']:>6.1%} {paper['decoder']:>10,} | {ours['rows']:>15,} {ours['cost']:>15,} "
                  f"{ours['balance']:>6.1%} {ours['decoder']:>10,} | {ours['rows'] / paper['rows'] - 1:>+7.1%} "
                  f"{ours['cost'] / paper['cost'] - 1:>+7.1%}")
    if args.sweep:
        print(sweep(dps, args.capacity))


if __name__ == "__main__":
    main()
