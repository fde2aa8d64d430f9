"""Synthetic agentic RL workloads shaped like SWE-bench agent rollouts (`harts gen`).

Reads a `GenConfig`; writes `trees.jsonl` (contract section 1): one training
trajectory per line. Invariants of every output, relied on by the tests:

* every trajectory is at most `context_limit` tokens long and at least 2;
* `loss_mask` is 1 exactly on the policy's action tokens (never on index 0),
  and every trajectory ends with an action token;
* the step-wise samples of one branch are nested strict prefixes, one per turn;
* two branches share their history token for token up to their fork (or up
  to the end of the task prompt for the rollouts of one GRPO group) and differ
  at the first action token after it, so the prefix trie of a task is known
  from lengths alone (`summarize`).

Generation runs in two phases with independent random streams: `plan` draws
the token-free shape of each task (turn lengths, forks, rewards); `generate`
then fills in tokens. The shape of task t depends only on (seed, t), so lengths
and counts of a paper-scale step are available in milliseconds, and adding
tasks never changes the earlier ones.

Per-token fields of the records `generate` yields are 1-D numpy arrays (views
into one buffer per branch): `tokens` int32, `loss_mask` uint8,
`old_logprobs` float32. `write_jsonl` serialises them directly (orjson);
use `.tolist()` where plain lists are needed.

This module is the public face and the CLI: the API is re-exported here from
one module per job, so `from harts.tools.gen import ...` and `gen.X` keep
working. `harts.tools.gen_config` holds `GenConfig`, its validation and
`preset`; `harts.tools.gen_shape` draws the shapes (`plan`, `plan_task`,
`TaskPlan`); `harts.tools.gen_sizes` sizes a step from them (`summarize`,
`GenStats`, `scale_to`); `harts.tools.gen_tokens` fills in tokens
(`generate`); `harts.tools.gen_write` writes the file (`write_jsonl`).

Run `python -m harts.tools.gen --help` (or `harts gen --help`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from harts.schema.atomic import check_output_path
from harts.schema.errors import HartsError, UsageError
# The public API, importable from here as it was before the split (tests,
# benchmarks, tools/demo.py and docs/gen.md use `harts.tools.gen`).
from harts.tools.gen_config import KINDS, PRESETS, SHARED_STEPS, TREESTEP_ONLY, GenConfig, cli_flag, preset
from harts.tools.gen_shape import TaskPlan, plan, plan_task
from harts.tools.gen_sizes import GenStats, scale_to, step_stats, summarize
from harts.tools.gen_tokens import generate, generate_from
from harts.tools.gen_write import WriteResult, write_jsonl

__all__ = ["KINDS", "PRESETS", "SHARED_STEPS", "GenConfig", "GenStats", "TaskPlan", "WriteResult",
           "generate", "main", "plan", "plan_task", "preset", "scale_to", "summarize", "write_jsonl"]

# GenConfig field types are annotation strings (see harts.tools.gen_config).
_CLI_TYPES = {"int": int, "float": float, "str": str}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="harts gen",
        description="Write a synthetic agentic RL step (SWE-bench-shaped rollouts) as trees.jsonl. "
                    "Start from --preset, override any field with its flag. The defaults "
                    "named below are the small preset's.")
    ap.add_argument("-o", "--output", help="output file (.jsonl, or .jsonl.zst to compress); "
                                           "required unless --dry-run")
    ap.add_argument("--preset", choices=PRESETS, default="small",
                    help="starting config: 'small' (the defaults, ~0.4M tokens stepwise), "
                         "'paper' (one paper-scale step, ~1,600 trajectories, ~44M tokens "
                         "stepwise) or 'grpo' (single-turn GRPO, 1,024 prompts x 16 responses, "
                         "~51M tokens; stepwise only); default small")
    target = ap.add_mutually_exclusive_group()
    target.add_argument("--target-trajectories", type=int, metavar="N",
                        help="set --tasks so the step has about N trajectories (after overrides)")
    target.add_argument("--target-tokens", type=int, metavar="N",
                        help="set --tasks so the step has about N tokens (after overrides)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the step's sizes and trie bound from its shape; write nothing")
    for f in dataclasses.fields(GenConfig):
        flag = cli_flag(f.name)
        kwargs = {"dest": f.name, "default": None, "help": f.metadata["help"]}
        if f.type == "bool":
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            ap.add_argument(flag, type=_CLI_TYPES[f.type], choices=f.metadata.get("choices"),
                            **kwargs)
    return ap


# Suffixes that promise a compression `write_jsonl` does not do (it compresses `.zst` names only).
_OTHER_COMPRESSIONS = (".gz", ".bz2", ".xz", ".lz4", ".zip")


def main(argv: list[str] | None = None) -> int:
    """`harts gen`: 0 on success; 2 with one `harts gen: error: ...` line on stderr."""
    args = _parser().parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(GenConfig)
                 if getattr(args, f.name) is not None}
    try:
        config = dataclasses.replace(preset(args.preset, overrides.get("kind", "stepwise")),
                                     **overrides)
        if args.target_trajectories is not None:
            config = scale_to(config, trajectories=args.target_trajectories)
        elif args.target_tokens is not None:
            config = scale_to(config, tokens=args.target_tokens)
        if config.kind != "treestep":
            for name in sorted(set(overrides) & TREESTEP_ONLY):
                print(f"harts gen: warning: {cli_flag(name)} has no effect with --kind {config.kind} "
                      "(only tree-step rollouts fork)", file=sys.stderr)
        if args.output is None and not args.dry_run:
            raise UsageError("no output file; fix: give -o/--output FILE, or --dry-run")
        if not args.dry_run:
            # Before any work: a bad path must not cost a paper-scale generation.
            check_output_path(args.output)
            suffix = os.path.splitext(args.output)[1].lower()
            if suffix in _OTHER_COMPRESSIONS:   # found by a CLI audit: plain JSON lines went out under .gz
                raise UsageError(f"{args.output}: harts gen compresses with zstd only, not {suffix[1:]}; "
                                 "fix: name the output .jsonl.zst (compressed) or .jsonl")
        t0 = time.perf_counter()
        plans = plan(config)
        stats = step_stats(config, plans)
        sizes = (f"{stats.trajectories:,} trajectories, {stats.tokens:,} tokens "
                 f"(max {stats.max_tokens:,}), {config.tasks} tasks, "
                 f"trie bound {stats.trie_bound:.2f}x")
        if args.dry_run:
            print(f"harts gen: {config.kind}: {sizes} (dry run, nothing written)", file=sys.stderr)
            return 0
        result = write_jsonl(generate_from(config, plans), args.output)
    except (OSError, HartsError) as err:
        print(f"harts gen: error: {err}", file=sys.stderr)
        return 2
    print(f"harts gen: {config.kind}: {sizes} -> {result.path} ({result.bytes:,} bytes, "
          f"{time.perf_counter() - t0:.2f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
