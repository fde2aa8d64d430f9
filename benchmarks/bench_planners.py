"""Compare the planners on paper-scale steps: the shape of the paper's Tables 4 and 5.

Usage:
    python benchmarks/bench_planners.py [--kinds stepwise,treestep] [--dp 2,4,8] [--capacity 65536]
                                        [--preset paper|small] [--ffd-budget SECONDS] [--no-ffd]
                                        [--pairs-per-token R] [--system-prompt-tokens N] [--steps N]
                                        [--l1-objective step-time|compression]

For each generated workload (`harts.tools.gen.preset(preset, kind)`, built in
memory) and each DP degree D, compiles the step with L1 alone, with L1+L2
(`--levels l1+l2`), and with the OR-Tools+FFD comparison planner when this
HARTS has it (`--planner ffd`, stopped at its first feasible solution as in
the paper's planning-time runs unless `--ffd-budget` is given), and prints one
row per planner:

* compression: original tokens / decoder tokens (Table 4's compression; for
  L1 and FFD the decoder runs every compact row);
* decoder: decoder tokens (producer rows + consumer rows no producer
  computes), and its reduction relative to L1;
* balance: eta_sched with producers (Section 5.3), in tokens, and in L2's
  cost model ("cost bal": forward + backward work with the attention-pair
  terms, what L2 balances; `harts stats`' `cost_balance`, for every planner);
* P5: 5th percentile of per-slot and per-window-producer mean/max balance,
  in tokens and in L2's cost model ("cost P5", `cost_balance_p5`);
* step-total: mean/max of the replicas' total non-replay work (the least
  over steps, Table 5's "step-total minimum");
* slots, windows, planning seconds per step (L1/FFD partition, L2 placement,
  layouts, rounds, replay and lowering; not reading, not the trie).

`--steps N` generates N steps of each workload (generator seeds 0..N-1) and
pools them as the paper pools its ten replayed steps: token and slot sums,
balance and P5 over all steps' slots and producers together, the least
step-total balance, planning seconds as the mean per step (the target is
checked on the slowest step).

`--system-prompt-tokens N` regenerates the preset with an N-token scaffold
prompt (the paper preset's is 6,000), scaled back to ~1,600 trajectories:
the prefix every rollout shares, and so what L2 can still share across
microbatches, grows with it.

`--pairs-per-token` is hartsc's: L2's cost model (default the paper's
models; 0 makes L2 balance tokens, the unit of the balance columns, and then
"cost bal" equals "balance").

`--l1-objective` is hartsc's: how L1 (and so L2, which starts from it) ranks
its partitions; `compression` is the paper's Equation 1 (paper-scale steps
are above the size where `step-time` also tries L2 from that partition).

Then, for D = 8, whether the issue's targets hold: L1+L2 decoder work at
least 25% below L1, balance >= 97%, P5 >= 90%, L1+L2 planning under 1.5 s.
The decoder target is also compared with what any plan could reach: every
unique trie row runs at least once, and the prefix every trajectory shares
(the scaffold prompt) at least once on each of the D replicas, since each
runs some trajectory and replicas share no rows; so the reduction can never
exceed 1 - (unique trie tokens + (D - 1) x shared prefix) / (L1 compact tokens).
The cost balance is compared with the most that re-placing the plan's own
consumers could give if each kept its cost: each window's consumers sorted
by cost and dealt D to a slot (`regrouped`). When that is close to the
plan's balance, what limits it is the spread of the consumers' costs, not
where they were placed. The points the cost balance loses are split into
each step's first slot, middle slots, last slot and producers
(`balance_loss`): the first slot holds the step's heaviest consumers, the
last one what is left over.
"""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.schema.cost_model import DEFAULT_PAIRS_PER_TOKEN
from harts.compiler.partition.options import L1_OBJECTIVES
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.schema.errors import HartsError
from harts.schema.summary import balance, balance_percentile, plan_statistics, slot_grid, work_grids
from harts.tools import gen

TARGET_REDUCTION, TARGET_BALANCE, TARGET_P5, TARGET_SECONDS = 0.25, 0.97, 0.90, 1.5


def build_batch(preset: str, kind: str, system_prompt_tokens: int | None = None, seed: int = 0) -> TrajectoryBatch:
    config = dataclasses.replace(gen.preset(preset, kind), seed=seed)
    if system_prompt_tokens is not None:
        target = gen.summarize(config).trajectories
        config = gen.scale_to(dataclasses.replace(config, system_prompt_tokens=system_prompt_tokens),
                              trajectories=target)
    records = list(gen.generate(config))
    return TrajectoryBatch.from_token_lists([r["tokens"] for r in records], ids=[r["id"] for r in records])


def common_prefix_tokens(batch: TrajectoryBatch) -> int:
    """Length of the prefix every trajectory of the step shares."""
    offsets, tokens = batch.token_offsets, batch.tokens
    first = tokens[offsets[0]:offsets[1]]
    common = len(first)
    for start, end in zip(offsets[1:-1].tolist(), offsets[2:].tolist()):
        n = min(common, end - start)
        differ = np.flatnonzero(tokens[start:start + n] != first[:n])
        common = int(differ[0]) if len(differ) else n
    return common


def slot_windows(plan) -> np.ndarray:
    """The window of each slot (all 0 for a plan without windows, whose consumers any slot may take)."""
    window = np.zeros(slot_grid(plan)[1], dtype=np.int64)
    for mb in plan.microbatches:
        window[int(mb["slot"])] = int(mb.get("window", 0))
    return window


def regrouped(work: np.ndarray, window: np.ndarray) -> np.ndarray:
    """The same consumer work regrouped by size: in each window the D largest share its first slot, the next
    D the next slot, and so on. Of all ways to deal these values into the window's slots this one has the
    least sum of slot maxima, so its balance is the most any re-placement of these consumers can reach while
    each keeps its cost (moving one to another replica changes what its producer caches; that is ignored)."""
    out = np.empty_like(work)
    for w in np.unique(window):
        columns = np.flatnonzero(window == w)
        values = np.sort(work[:, columns], axis=None)[::-1]
        out[:, columns] = values.reshape(len(columns), work.shape[0]).T
    return out


def planning_seconds(result) -> float:
    return sum(seconds for name, seconds in result.pass_seconds.items() if name != "build-trie")


def ffd_options(base: CompileOptions, budget: float | None) -> CompileOptions | None:
    """CompileOptions for --planner ffd, or None when this HARTS has no FFD planner."""
    fields = {f.name for f in dataclasses.fields(CompileOptions)}
    extra = {}
    if budget is None and "ffd_first_feasible" in fields:
        extra["ffd_first_feasible"] = True
    elif budget is not None and "ffd_time_budget" in fields:
        extra["ffd_time_budget"] = budget
    return dataclasses.replace(base, planner="ffd", **extra)


def run(batch: TrajectoryBatch, options: CompileOptions) -> dict | None:
    """One planner on one step: its `harts stats` plus the per-slot work arrays that `combine` pools."""
    try:
        result = compile_batch(batch, options)
    except HartsError as err:
        if "not implemented" in str(err) or "unknown planner" in str(err):
            return None
        raise
    grids = work_grids(result.plan)
    stats = plan_statistics(result.plan, planning_seconds(result), grids)
    stats["arrays"] = grids
    stats["regrouped_cost"] = regrouped(grids[2], slot_windows(result.plan))
    stats["least_decoder"] = (stats["trie_unique_tokens"]
                              + (min(options.dp, batch.num_trajectories) - 1) * common_prefix_tokens(batch))
    return stats


def balance_loss(steps: list[dict]) -> dict[str, float]:
    """Where the pooled cost balance falls short of 1, in its points: 1 - balance is the sum over slots and
    producers of (max - mean) over replicas, divided by the sum of their maxima. Split into each step's first
    slot (its heaviest consumers), last slot (what is left over), the slots between, and the producers."""
    parts = dict.fromkeys(("first slot", "middle slots", "last slot", "producers"), 0.0)
    maxima = 0.0
    for step in steps:
        _, _, cost, producers = step["arrays"]
        lead = cost.max(axis=0) - cost.mean(axis=0)
        parts["first slot"] += lead[0]
        parts["last slot"] += lead[-1] if len(lead) > 1 else 0.0
        parts["middle slots"] += lead[1:-1].sum()
        parts["producers"] += (producers.max(axis=0) - producers.mean(axis=0)).sum()
        maxima += cost.max(axis=0).sum() + producers.max(axis=0).sum()
    return {name: value / maxima for name, value in parts.items()}


def combine(steps: list[dict]) -> dict:
    """Pool one planner's steps as the paper's Tables 4 and 5 do over ten steps.

    Sums of tokens and slots; balance and P5 over the slots and producers of
    all steps together (their work arrays side by side); the least step-total
    balance over steps; planning seconds as the mean (s/step) and the most.
    """
    work, producers, cost, cost_producers = (np.concatenate(parts, axis=1)
                                             for parts in zip(*(s["arrays"] for s in steps)))
    return {
        "original_tokens": sum(s["original_tokens"] for s in steps),
        "decoder_tokens": sum(s["decoder_tokens"] for s in steps),
        "least_decoder": sum(s["least_decoder"] for s in steps),
        "balance": balance(work, producers),
        "cost_balance": balance(cost, cost_producers),
        "regrouped_cost_balance": balance(np.concatenate([s["regrouped_cost"] for s in steps], axis=1),
                                          cost_producers),
        "balance_p5": balance_percentile(work, producers),
        "cost_balance_p5": balance_percentile(cost, cost_producers),
        "cost_balance_loss": balance_loss(steps),
        "step_total_balance": min(s["step_total_balance"] for s in steps),
        "slots": sum(s["slots"] for s in steps),
        "windows": sum(s["windows"] for s in steps),
        "planning_seconds": float(np.mean([s["planning_seconds"] for s in steps])),
        "planning_seconds_max": max(s["planning_seconds"] for s in steps),
    }


def parse_dps(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """--dp's comma-separated degrees, or the parser's one-line error."""
    try:
        dps = [int(d) for d in text.split(",")]
    except ValueError:
        dps = []
    if not dps or min(dps) < 1:
        parser.error(f"--dp: give comma-separated integers >= 1, e.g. 2,4,8, got {text!r}")
    return dps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="stepwise,treestep", help="comma-separated gen kinds (default both)")
    parser.add_argument("--dp", default="2,4,8", help="comma-separated DP degrees (default 2,4,8)")
    parser.add_argument("--capacity", type=int, default=65536, help="microbatch capacity T (default 65536)")
    parser.add_argument("--chunk-size", type=int, default=64, help="chunk size B (default 64)")
    parser.add_argument("--preset", choices=gen.PRESETS, default="paper", help="workload size (default paper)")
    parser.add_argument("--ffd-budget", type=float, default=None,
                        help="run FFD's CP-SAT search with this budget per replica instead of first-feasible")
    parser.add_argument("--no-ffd", action="store_true", help="skip the FFD comparison planner")
    parser.add_argument("--pairs-per-token", type=int, default=DEFAULT_PAIRS_PER_TOKEN,
                        help=f"L2's cost model, as hartsc's flag (default {DEFAULT_PAIRS_PER_TOKEN}; 0: tokens only)")
    parser.add_argument("--system-prompt-tokens", type=int, default=None,
                        help="regenerate the workload with this scaffold-prompt length (default: the preset's)")
    parser.add_argument("--l1-objective", choices=L1_OBJECTIVES, default="step-time",
                        help="hartsc's --l1-objective for L1 and L1+L2 (default step-time)")
    parser.add_argument("--steps", type=int, default=1,
                        help="steps per workload (generator seeds 0..N-1), pooled as the paper pools its ten "
                             "(default 1)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in gen.KINDS]
    if unknown:
        parser.error(f"--kinds: unknown kind {unknown[0]!r}; choose from {','.join(gen.KINDS)}")
    for kind in kinds:
        try:
            gen.preset(args.preset, kind)   # e.g. the grpo preset has no tree-step kind
        except HartsError as err:
            parser.error(f"--kinds {kind}: {err}")
    dps = parse_dps(parser, args.dp)

    header = (f"{'workload':<9} {'D':>2} {'planner':<7} {'compr':>7} {'decoder':>10} {'vs L1':>7} {'balance':>8} "
              f"{'cost bal':>8} {'P5':>7} {'cost P5':>7} {'step-tot':>8} {'slots':>5} {'win':>4} {'plan s':>7}")
    prompt = args.system_prompt_tokens if args.system_prompt_tokens is not None else "the preset's"
    print(f"L2 cost model: --pairs-per-token {args.pairs_per_token}; scaffold prompt: {prompt} tokens; "
          f"--l1-objective {args.l1_objective}")
    print(header)
    print("-" * len(header))
    verdicts = []
    for kind in kinds:
        per_step: dict[tuple[int, str], list[dict]] = {}
        for seed in range(args.steps):
            batch = build_batch(args.preset, kind, args.system_prompt_tokens, seed)
            for dp in dps:
                base = CompileOptions(dp=dp, capacity=args.capacity, chunk_size=args.chunk_size, levels="l1",
                                      pairs_per_token=args.pairs_per_token, l1_objective=args.l1_objective)
                planners = {"L1": base, "L1+L2": dataclasses.replace(base, levels="l1+l2")}
                if not args.no_ffd:
                    planners["FFD"] = ffd_options(base, args.ffd_budget)
                for name, options in planners.items():
                    per_step.setdefault((dp, name), []).append(run(batch, options))
        for dp in dps:
            rows = {name: None if None in steps else combine(steps)
                    for (d, name), steps in per_step.items() if d == dp}
            l1_decoder = rows["L1"]["decoder_tokens"]
            for name, s in rows.items():
                if s is None:
                    print(f"{kind:<9} {dp:>2} {name:<7} {'n/a':>7}")
                    continue
                reduction = 1 - s["decoder_tokens"] / l1_decoder
                print(f"{kind:<9} {dp:>2} {name:<7} {s['original_tokens'] / s['decoder_tokens']:>6.3f}x "
                      f"{s['decoder_tokens']:>10,} {reduction:>6.1%} {s['balance']:>8.2%} "
                      f"{s['cost_balance']:>8.2%} "
                      f"{s['balance_p5']:>7.2%} "
                      f"{s['cost_balance_p5']:>7.2%} "
                      f"{s['step_total_balance']:>8.2%} {s['slots']:>5} {s['windows']:>4} "
                      f"{s['planning_seconds']:>7.3f}")
            if dp == 8:
                l2 = rows["L1+L2"]
                bound = 1 - l2["least_decoder"] / l1_decoder
                reduction = 1 - l2["decoder_tokens"] / l1_decoder
                verdicts += [
                    (kind, f"L1+L2 decoder work >= {TARGET_REDUCTION:.0%} below L1",
                     reduction >= TARGET_REDUCTION,
                     f"{reduction:.1%} (no plan can exceed {bound:.1%}: unique trie rows once, "
                     f"the shared prefix once per replica)"),
                    (kind, f"balance >= {TARGET_BALANCE:.0%}", l2["balance"] >= TARGET_BALANCE,
                     f"{l2['balance']:.2%} in tokens ({l2['cost_balance']:.2%} in L2's cost model; "
                     f"{l2['regrouped_cost_balance']:.2%} at most, these consumers' costs regrouped by size; "
                     "cost points lost: " + ", ".join(f"{100 * v:.2f} {k}" for k, v in l2["cost_balance_loss"].items())
                     + ")"),
                    (kind, f"balance P5 >= {TARGET_P5:.0%}", l2["balance_p5"] >= TARGET_P5,
                     f"{l2['balance_p5']:.2%} in tokens ({l2['cost_balance_p5']:.2%} in L2's cost model)"),
                    (kind, f"L1+L2 planning < {TARGET_SECONDS} s per step",
                     l2["planning_seconds_max"] < TARGET_SECONDS,
                     f"{l2['planning_seconds_max']:.3f} s in the slowest step"),
                ]
    if verdicts:
        print()
        print("targets at D = 8:")
        for kind, target, met, value in verdicts:
            print(f"  {kind:<9} {target:<40} {'met' if met else 'MISSED':<7} {value}")


if __name__ == "__main__":
    main()
