"""Compile a paper-scale step and print where the time and memory go.

Usage:
    python benchmarks/bench_compile.py [--kind stepwise|treestep] [--dp 8] [--capacity 65536]
                                       [--preset paper|small|grpo] [--levels l1|l1+l2] [--keep DIR]
                                       [--trajectories N] [--context-limit L] [--system-prompt-tokens S]

Generates an SWE-shaped step with `harts gen`'s preset (paper: ~1,600
trajectories, ~43M tokens), writes it as trees.jsonl, then times reading,
every compiler pass and writing the plan (two levels, hartsc's default;
`--levels l1` for L1 alone). Prints one table. The targets: L1 planning (L1,
layouts, rounds, replay, lowering) under 1 s (issue #2), all of planning with
L2 (place-windows and plan-residual added) under 1.5 s (issue #4), peak memory
under 8 GiB; the table says whether they hold.

`--trajectories N` scales the preset to about N trajectories (more tasks of
the same shape); `--context-limit L` caps every trajectory at L tokens and
`--system-prompt-tokens S` sets the shared scaffold prompt, so a step of tens
of thousands of short trajectories fits in memory: how planning grows with
the step (the targets are for the paper preset only). For example
`--preset small --trajectories 40000 --context-limit 8192
--system-prompt-tokens 500` is 40,001 trajectories and 162M tokens (`harts gen
--preset small --target-trajectories 40000 --context-limit 8192 --system-prompt-tokens 500
--dry-run` prints the same sizes). `--preset grpo` is single-turn GRPO
(16,384 trajectories, 51M tokens; stepwise only), the shape of most RL
steps: ten times the paper step's trajectories, each sharing only its prompt.
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import tempfile
import time
from pathlib import Path

from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.compiler.read_trees import read_trees
from harts.schema.errors import HartsError
from harts.schema.plan import encode_plan, write_plan
from harts.schema.summary import plan_statistics
from harts.tools import gen

L1_PASSES = ("partition-microbatches", "build-layout", "assign-rounds", "plan-replay", "lower")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=gen.KINDS, default="stepwise", help="sampling scheme (default stepwise)")
    parser.add_argument("--preset", choices=gen.PRESETS, default="paper", help="workload size (default paper)")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel degree (default 8)")
    parser.add_argument("--capacity", type=int, default=65536, help="microbatch capacity T (default 65536)")
    parser.add_argument("--chunk-size", type=int, default=64, help="chunk size B (default 64)")
    parser.add_argument("--levels", choices=("l1", "l1+l2"), default="l1+l2", help="planner levels (default l1+l2)")
    parser.add_argument("--keep", help="write trees.jsonl and step.plan here instead of a temporary folder")
    parser.add_argument("--trajectories", type=int, help="scale the preset to about this many trajectories")
    parser.add_argument("--context-limit", type=int, help="cap every trajectory at this many tokens "
                                                           "(default: the preset's)")
    parser.add_argument("--system-prompt-tokens", type=int, help="the scaffold prompt every trajectory shares "
                                                                  "(default: the preset's)")
    args = parser.parse_args()
    try:
        config = gen.preset(args.preset, args.kind)
        for field in ("context_limit", "system_prompt_tokens"):
            if getattr(args, field) is not None:
                config = dataclasses.replace(config, **{field: getattr(args, field)})
        if args.trajectories is not None:
            config = gen.scale_to(config, trajectories=args.trajectories)
    except HartsError as err:
        parser.error(str(err))
    # The targets are stated for one paper-scale step.
    paper_scale = args.preset == "paper" and (args.trajectories, args.context_limit, args.system_prompt_tokens) == (
        None, None, None)

    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="harts-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    trees = folder / "trees.jsonl"
    t0 = time.perf_counter()
    written = gen.write_jsonl(gen.generate(config), trees)
    gen_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    batch = read_trees(trees, capacity=args.capacity)
    read_seconds = time.perf_counter() - t0
    rss_after_read = peak_rss_gib()

    options = CompileOptions(dp=args.dp, capacity=args.capacity, chunk_size=args.chunk_size, levels=args.levels)
    result = compile_batch(batch, options)
    t0 = time.perf_counter()
    data = encode_plan(result.plan)
    encode_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_plan(result.plan, folder / "step.plan")
    write_seconds = time.perf_counter() - t0
    stats = plan_statistics(result.plan, result.planning_seconds)

    planning = sum(result.pass_seconds.get(p, 0.0) for p in L1_PASSES)
    planning_all = sum(secs for name, secs in result.pass_seconds.items() if name != "build-trie")
    rows = [
        ("workload", f"{args.kind} ({args.preset}), D={args.dp}, T={args.capacity}, B={args.chunk_size}"),
        ("trajectories", f"{stats['trajectories']:,}"),
        ("original tokens", f"{stats['original_tokens']:,}"),
        ("trees.jsonl", f"{trees.stat().st_size / 2**20:,.0f} MiB (generated+written in {gen_seconds:.2f} s)"),
        ("read", f"{read_seconds:.2f} s ({stats['original_tokens'] / read_seconds / 1e6:.1f} M tokens/s)"),
    ]
    rows += [(f"  pass {name}", f"{secs * 1e3:.0f} ms") for name, secs in result.pass_seconds.items()]
    def verdict(target: str, met: bool) -> str:
        return f"  [target {target}: {'met' if met else 'MISSED'}]" if paper_scale else ""

    rows += [
        ("planning (L1+rounds+replay+lower)", f"{planning:.3f} s{verdict('< 1 s', planning < 1)}"),
        ("planning, every pass but the trie", f"{planning_all:.3f} s{verdict('< 1.5 s with L2', planning_all < 1.5)}"),
        ("encode plan (msgpack+zstd)", f"{encode_seconds:.2f} s, {len(data) / 2**20:.1f} MiB"),
        ("write plan (encode+fsync+rename)", f"{write_seconds:.2f} s"),
        ("peak RSS after read", f"{rss_after_read:.2f} GiB"),
        ("peak RSS overall", f"{peak_rss_gib():.2f} GiB{verdict('< 8 GiB', peak_rss_gib() < 8)}"),
        ("microbatches / slots", f"{stats['microbatches']} / {stats['slots']}  ({result.partition.candidate})"),
        ("compact tokens (complete layouts)", f"{stats['compact_tokens']:,}"),
        ("compression (complete layouts)", f"{stats['compression']:.2f}x"),
        ("decoder tokens, windows", f"{stats['decoder_tokens']:,} in {stats['windows']} windows "
                                    f"({stats['original_tokens'] / stats['decoder_tokens']:.2f}x)"),
        ("trie compression bound", f"{stats['compression_bound']:.2f}x  ({stats['trie_unique_tokens']:,} unique trie tokens)"),
        ("balance (eta_sched)", f"{stats['balance']:.4f}"),
        ("max rounds / replay tokens", f"{stats['max_rounds']} / {stats['replay_tokens']:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"{'metric':<{width}}  value")
    print(f"{'-' * width}  {'-' * 40}")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    del written


if __name__ == "__main__":
    main()
