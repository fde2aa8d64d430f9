"""`harts demo`: the README's main command, end to end on a built-in default.

1. generate a small SWE-shaped step-wise workload (`harts gen`),
2. compile it (`hartsc`) and verify the plan against the input (`harts check`),
3. write a tiny random Kimi Linear model (`harts init-model`),
4. run the step's forward and backward expanded (the baseline), compact on
   complete layouts, and compact with sharing windows (`harts run`),
5. print compression, speedup and the largest log-probability difference.

The capacity is small enough that the step needs several microbatches, so
L2's sharing windows have prefixes to compute once across them.

Everything is written under `--out` (default: a fresh temporary folder).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harts.compiler import cli as hartsc
from harts.schema.atomic import check_can_create_under
from harts.schema.errors import HartsError, OutputError
from harts.tools import check, gen

DEMO_VOCAB = 4096
DEMO_CAPACITY = 2048
# Small enough that the expanded baseline runs in seconds on two CPU cores,
# shaped like an agent rollout: a shared system prompt, a task, tool turns.
# Rollouts stop at the microbatch capacity, so every trajectory fits one microbatch whatever --seed draws
# (at 4,096 about half the seeds drew a longer one and the compile step failed).
DEMO_WORKLOAD = dict(tasks=1, group_size=4, system_prompt_tokens=512, task_tokens_min=96, task_tokens_max=192,
                     turns_min=4, turns_max=6, action_tokens_median=40.0, tool_tokens_median=120.0,
                     tool_tokens_max=512, context_limit=DEMO_CAPACITY)
# Written into --out before the demo writes its outputs there, listing them: only the outputs it lists are
# the demo's to replace; anything else under those names is someone's, and refused.
DEMO_MARK = ".harts-demo"
DEMO_OUTPUTS = ("trees.jsonl", "step.plan", "model")


def prepare_out(out: str | None) -> Path:
    """The output folder, created; OutputError (one line) when it cannot be a folder.

    Called only after every flag is checked, so a bad flag leaves no folder behind.
    """
    if not out:
        return Path(tempfile.mkdtemp(prefix="harts-demo-"))
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise OutputError(out, "it is a file, not a folder", "give a new or existing folder for --out")
    check_can_create_under(out, folder.parent)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(out, err.strerror or type(err).__name__,
                          "give --out a folder you can create and write to") from None
    return folder


def demo_owned(out: Path) -> set[str]:
    """The outputs in `out` that an earlier demo wrote, as its mark lists them (none without a mark)."""
    try:
        return set((out / DEMO_MARK).read_text().split("\n")[1:]) & set(DEMO_OUTPUTS)
    except OSError:
        return set()


def check_outputs(out: Path, with_model: bool) -> tuple[Path, Path, Path]:
    """The demo's three outputs, each checked before any work: trees.jsonl, step.plan, model/.

    An output an earlier demo wrote in the same folder (listed in the
    folder's `DEMO_MARK`) is replaced. Any other existing trees.jsonl or
    step.plan, or non-empty model/ (one `harts init-model` wrote, or a
    checkpoint saved with `save_pretrained`, even with only the files a demo
    writes), is refused; a demo folder of an earlier HARTS, which wrote no
    mark, is refused the same way.
    """
    from harts.executor.models.init_model import check_model_dir
    from harts.schema.atomic import check_output_path

    trees, plan_path, model_dir = out / "trees.jsonl", out / "step.plan", out / "model"
    check_output_path(trees)
    check_output_path(plan_path)
    owned = demo_owned(out)
    for path in (trees, plan_path):
        if path.exists() and path.name not in owned:
            raise OutputError(path, f"no {DEMO_MARK} beside it lists it as a demo output",
                              "give --out a new folder, or move it away")
    if with_model and model_dir.is_dir() and any(model_dir.iterdir()) and "model" not in owned:
        raise OutputError(model_dir, f"it holds a model no {DEMO_MARK} beside it lists as the demo's",
                          "give --out a new folder, or move that model away")
    if with_model:
        check_model_dir(model_dir, replace=True)
    return trees, plan_path, model_dir


def mark_outputs(out: Path, with_model: bool) -> None:
    """List, before writing them, the outputs this run owns: its own, and a model/ an earlier demo wrote."""
    owned = {"trees.jsonl", "step.plan"} | ({"model"} if with_model else demo_owned(out) & {"model"})
    (out / DEMO_MARK).write_text("harts demo wrote these here and replaces them when run again with this --out:\n"
                                 + "\n".join(name for name in DEMO_OUTPUTS if name in owned))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harts demo", description="Generate, compile, check and run a small step.")
    parser.add_argument("--out", help="folder for trees.jsonl, step.plan and model/ (default: a new temporary "
                                      "folder); what an earlier demo wrote there is replaced, anything else "
                                      "under those names is refused")
    parser.add_argument("--kind", choices=gen.KINDS, default="stepwise", help="sampling scheme (default stepwise)")
    parser.add_argument("--seed", type=int, default=0, help="workload and model seed, >= 0 (default 0)")
    parser.add_argument("--no-model", action="store_true", help="stop after compiling and checking (no torch work)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        # Every flag first: a bad one must leave no folder and no file behind.
        config = gen.GenConfig(kind=args.kind, vocab_size=DEMO_VOCAB, seed=args.seed, **DEMO_WORKLOAD)
        if not args.no_model:
            from harts.executor.models.init_model import check_arguments

            check_arguments("kimi_linear", "tiny", DEMO_VOCAB, args.seed)
        out = prepare_out(args.out)
        trees, plan_path, model_dir = check_outputs(out, not args.no_model)
        mark_outputs(out, not args.no_model)
        gen.write_jsonl(gen.generate(config), trees)
        for name, run, step_argv in (
            ("compile", hartsc.main, [str(trees), "-o", str(plan_path), "--vocab-size", str(DEMO_VOCAB),
                                      "--capacity", str(DEMO_CAPACITY)]),
            ("check", check.main, [str(plan_path), "--trees", str(trees)]),
        ):
            code = run(step_argv)
            if code != 0:
                print(f"harts demo: step '{name}' failed (exit {code})", file=sys.stderr)
                return code
        if args.no_model:
            return 0
        return run_model(out, plan_path, model_dir, args.seed, started)
    except HartsError as err:   # UsageError included: a flag out of range (GenConfig, init-model's checks)
        print(f"harts demo: {err}", file=sys.stderr)
        return err.exit_code


def run_model(out: Path, plan_path: Path, model_dir: Path, seed: int, started: float) -> int:
    from harts.executor.models.init_model import init_model
    from harts.executor.runtime import run_step
    from harts.schema.plan import read_plan
    from harts.schema.summary import plan_statistics

    model = init_model("kimi_linear", "tiny", model_dir, vocab_size=DEMO_VOCAB, seed=seed, replace=True)
    plan = read_plan(plan_path)
    stats = plan_statistics(plan)
    expanded = run_step(plan, model, mode="expanded")
    compact = run_step(plan, model, mode="compact", windows=False)
    windows = run_step(plan, model, mode="compact")
    max_diff = max(float(np.nanmax(np.abs(run.logprobs[k] - expanded.logprobs[k])))
                   for run in (compact, windows) for k in expanded.logprobs)
    tokens = stats["original_tokens"]

    def timing(run) -> str:
        return f"{run.seconds:.2f} s ({tokens / run.seconds:,.0f} tokens/s, {expanded.seconds / run.seconds:.2f}x)"

    rows = [
        ("trajectories", f"{stats['trajectories']}"),
        ("original tokens", f"{tokens:,}"),
        ("microbatches, sharing windows", f"{stats['microbatches']}, {stats['windows']}"),
        ("compact rows, compression (no windows)", f"{stats['compact_tokens']:,}, {stats['compression']:.2f}x"),
        ("decoder rows, compression (L2)", f"{stats['decoder_tokens']:,}, {stats['compression_l2']:.2f}x"),
        ("linear-attention rounds (max)", f"{stats['max_rounds']}"),
        ("expanded forward+backward", f"{expanded.seconds:.2f} s ({tokens / expanded.seconds:,.0f} tokens/s)"),
        ("compact, no windows", timing(compact)),
        ("compact with windows", timing(windows)),
        ("max |logprob - expanded|", f"{max_diff:.2e}"),
        ("loss (token-mean NLL)", f"{windows.loss:.6f} windows, {compact.loss:.6f} compact, "
                                  f"{expanded.loss:.6f} expanded"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"harts demo: done in {time.perf_counter() - started:.1f}s; files in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
