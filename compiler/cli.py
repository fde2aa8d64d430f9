"""`hartsc TREES -o PLAN`: compile a step's trajectories into an execution plan."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from harts.compiler.partition.options import L1_OBJECTIVES
from harts.compiler.passes.partition_ffd import SHARD_UNITS
from harts.compiler.ir.trajectories import positive_logprob_warnings
from harts.console import run_command
from harts.compiler.pipeline import LEVELS, PLANNERS, CompileOptions, check_options, compile_batch
from harts.compiler.read_workers import add_read_workers_argument, read_workers
from harts.progress import terminal_progress
from harts.text import plural
from harts.schema.cost_model import DEFAULT_PAIRS_PER_TOKEN
from harts.schema.errors import HartsError, OutputError
from harts.schema.atomic import atomic_write_files, check_output_path, refuse_one_file
from harts.schema.plan import encode_plan
from harts.schema.summary import plan_statistics
from harts.schema.timing import plan_digest, timing_path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hartsc", description="Compile rollout trajectories (trees.jsonl) into a HARTS plan.")
    p.add_argument("trees", help="input trajectories: trees.jsonl or trees.jsonl.zst (see docs/input-contract.md)")
    p.add_argument("-o", "--output", required=True, help="plan file to write (atomically)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree D (default 1)")
    p.add_argument("--capacity", type=int, default=65536, help="compact-token capacity T per microbatch (default 65536)")
    p.add_argument("--chunk-size", type=int, default=64, help="linear-attention chunk length B; must match the model backend (default 64)")
    p.add_argument("--planner", choices=PLANNERS, default="harts", help="harts: two-level planner (default); ffd: OR-Tools+FFD comparison")
    p.add_argument("--levels", choices=LEVELS, default=None,
                   help="l1+l2: L1 microbatches, then sharing windows whose producers compute prefixes shared "
                        "across microbatches once (default with --planner harts); l1: stop after L1 "
                        "(default with --planner ffd)")
    p.add_argument("--ffd-time-budget", type=float, default=10.0, metavar="SECONDS",
                   help="--planner ffd: CP-SAT search budget per DP replica, in CP-SAT deterministic seconds "
                        "(reproducible; wall time is about 1-3x that, plus building the model, which grows with "
                        "trajectories x microbatches per replica: ~10 s at 10,000; a replica whose model would "
                        "exceed 1,000,000 variables keeps its next-fit packing); the paper's quality runs use 300 "
                        "(default 10)")
    p.add_argument("--ffd-first-feasible", action="store_true",
                   help="--planner ffd: stop each replica's CP-SAT search at its first feasible solution "
                        "(the paper's planning-time setting)")
    p.add_argument("--ffd-shard", choices=SHARD_UNITS, default="subtree",
                   help="--planner ffd: what first-fit decreasing balances over DP replicas by original tokens: "
                        "whole trie subtrees of at most one replica's share (default; keeps a rollout's steps together) "
                        "or single trajectories")
    p.add_argument("--pairs-per-token", type=int, default=DEFAULT_PAIRS_PER_TOKEN, metavar="R",
                   help="L2 cost model: a computed token's linear-layer work in full-attention query-key pairs, "
                        "about 2 x active parameters / (4 x heads x head width x full-attention layers); "
                        f"0 balances tokens only (default {DEFAULT_PAIRS_PER_TOKEN}, the paper's models)")
    p.add_argument("--max-window-slots", type=int, default=0, metavar="N",
                   help="L2: no sharing window spans more than N slots, which bounds how long a producer's "
                        "activations stay in memory (default 0: no limit)")
    p.add_argument("--l1-objective", choices=L1_OBJECTIVES, default="step-time",
                   help="how L1 ranks its partitions: step-time (default) puts the critical path, the sum over "
                        "slots of the heaviest microbatch, first; compression is the paper's Equation 1, least "
                        "total work first, which can leave replicas idle when one prefix spans the step")
    p.add_argument("--seed", type=int, default=0, help="seed of the ffd planner's CP-SAT search; the harts planner is deterministic and "
                        "only records it (default 0)")
    p.add_argument("--vocab-size", type=int, default=None, help="reject token ids >= this (default: no check)")
    add_read_workers_argument(p, "hartsc", "the plan is the same")
    p.add_argument("--debug", action="store_true", help="verify the IR after every pass (slow at paper scale)")
    p.add_argument("--json", action="store_true", help="print the plan statistics as one JSON object on stdout")
    p.add_argument("-v", "--verbose", action="store_true", help="explain each pass's decisions on stderr (a line per pass; L2 adds one per search phase, --planner ffd one per replica)")
    return p


# Flags that only one planner or level reads: (flag, argparse dest, what it needs, whether the compile has it).
# (--pairs-per-token is not one: `harts stats` prices cost_balance with it at either level.)
_IDLE_FLAGS = (
    ("--ffd-time-budget", "ffd_time_budget", "--planner ffd", lambda o: o.planner == "ffd"),
    ("--ffd-first-feasible", "ffd_first_feasible", "--planner ffd", lambda o: o.planner == "ffd"),
    ("--ffd-shard", "ffd_shard", "--planner ffd", lambda o: o.planner == "ffd"),
    ("--max-window-slots", "max_window_slots", "--levels l1+l2", lambda o: o.effective_levels == "l1+l2"),
    ("--l1-objective", "l1_objective", "--planner harts", lambda o: o.planner == "harts"),
)


def idle_flag_warnings(args, parser, options: CompileOptions) -> list[str]:
    """A warning for each flag set away from its default that the chosen planner or level never reads.

    Not an error: the run is still what was asked for, and the value is recorded in the plan's flags
    (so `harts diff` shows it), but a user who set it most likely expected it to matter. Judged on the
    compile's effective options (`--levels` left out means l1+l2 for the harts planner).
    """
    return [f"{flag} has no effect without {needs} (recorded in the plan's flags all the same)"
            for flag, dest, needs, used in _IDLE_FLAGS
            if getattr(args, dest) != parser.get_default(dest) and not used(options)]


def main(argv: list[str] | None = None) -> int:
    return run_command("hartsc", _compile, argv)


def _compile(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = CompileOptions(dp=args.dp, capacity=args.capacity, chunk_size=args.chunk_size,
                                 planner=args.planner, levels=args.levels, seed=args.seed,
                                 vocab_size=args.vocab_size, verify=args.debug,
                                 ffd_time_budget=args.ffd_time_budget, ffd_first_feasible=args.ffd_first_feasible,
                                 ffd_shard=args.ffd_shard, pairs_per_token=args.pairs_per_token,
                                 max_window_slots=args.max_window_slots, l1_objective=args.l1_objective)
        # Flags and output paths are checked before the (possibly minutes-long) read and compile.
        check_options(options)
        workers = read_workers(args.read_workers, args.trees)
        for line in idle_flag_warnings(args, parser, options):
            print(f"hartsc: warning: {line}", file=sys.stderr)
        output = check_output_path(args.output, inputs=[args.trees])
        # Beside the name given: `harts stats` looks for it there even when the plan is a link. Its name
        # follows the plan's, so the fix for a bad one is to clear that path, not to rename it.
        sidecar_fix = f"move it away: hartsc writes the plan's timing record there, beside {args.output}"
        timing = timing_path(args.output)
        try:
            sidecar = check_output_path(timing, inputs=[args.trees])
        except OutputError as err:
            # Nothing there to move (a name too long once the suffix is added): the plan's name is the fix.
            longer = len(os.fsencode(timing.name)) - len(os.fsencode(Path(args.output).name))
            fix = sidecar_fix if os.path.lexists(timing) else (
                f"shorten the plan's file name: hartsc writes its timing record beside it under a name "
                f"{longer} bytes longer")
            raise OutputError(err.path, err.problem, fix) from None
        refuse_one_file([(args.output, output), (timing, sidecar)], "it leads to the plan file itself", sidecar_fix)
        from harts.compiler.read_trees import read_trees
        t0 = time.perf_counter()
        batch = read_trees(args.trees, vocab_size=args.vocab_size, capacity=args.capacity, workers=workers)
        read_seconds = time.perf_counter() - t0
        for line in positive_logprob_warnings(batch):
            print(f"hartsc: warning: {args.trees}: {line}", file=sys.stderr)
        result = compile_batch(batch, options, progress=terminal_progress)
        planning = result.planning_seconds
        encoded = encode_plan(result.plan)
        # The plan's digest lets `harts stats` tell this record from one left beside a plan written since.
        timing = {"read_seconds": read_seconds, "planning_seconds": planning, "pass_seconds": result.pass_seconds,
                  "plan_sha256": plan_digest(encoded)}
        # One output: a plan without its sidecar (or the reverse) is never left behind.
        atomic_write_files({output: encoded, sidecar: json.dumps(timing, indent=1, sort_keys=True).encode()})
    except HartsError as err:
        print(f"hartsc: {err}", file=sys.stderr)
        return err.exit_code
    stats = plan_statistics(result.plan, planning)
    if args.verbose:
        for line in result.decisions():
            print(f"hartsc: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps(stats, sort_keys=True))
    print(f"hartsc: wrote {args.output}: {plural(stats['trajectories'], 'trajectory')}, {stats['original_tokens']:,} "
          f"tokens -> {stats['compact_tokens']:,} compact ({stats['compression']:.2f}x), "
          f"{plural(stats['microbatches'], 'microbatch')}, "
          + (f"{stats['decoder_tokens']:,} decoder rows with {plural(stats['windows'], 'sharing window')} "
             f"({stats['compression_l2']:.2f}x), " if stats["decoder_tokens"] < stats["compact_tokens"] else "") +
          f"max {plural(stats['max_rounds'], 'round')}, read {read_seconds:.2f}s, planned {planning:.2f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
