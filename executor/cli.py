"""`harts run PLAN --model DIR`: run a compiled step on a Hugging Face model directory."""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from harts.executor.layout import MODES
from harts.executor.losses import LOGPROB_POSITIONS, LOSSES, REDUCTIONS, LossConfig
from harts.progress import quiet_library_progress, terminal_progress
from harts.schema.errors import HartsError
from harts.schema.atomic import atomic_write_bytes
from harts.schema.plan import read_plan


def load_model(model_dir: str, dtype: str = "float32"):
    """Load from local disk only; one clear line when the directory is not a model."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise HartsError(f"{model_dir}: no config.json; fix: pass a Hugging Face model directory "
                         "(harts init-model writes one)")
    from transformers import AutoModelForCausalLM

    quiet_library_progress()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=getattr(torch, dtype))
    except (OSError, ValueError, KeyError) as err:
        raise HartsError(f"{model_dir}: cannot load the model ({str(err).splitlines()[0]}); "
                         "fix: pass a complete Hugging Face model directory") from None
    return model.train(False)


def model_device(choice: str) -> torch.device:
    """`--device`: cuda (this rank's GPU under torchrun) or cpu; auto picks cuda when there is one."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise HartsError("--device cuda: no CUDA device is visible; fix: run on a GPU machine or pass --device cpu")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def write_logprobs(path: str, logprobs: dict) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **logprobs)
    atomic_write_bytes(Path(path), buffer.getvalue())


def write_grads(path: str, grads: dict) -> None:
    from safetensors.torch import save

    atomic_write_bytes(Path(path), save({k: v.detach().cpu().contiguous() for k, v in grads.items()}))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harts run", description="Run a HARTS plan (forward + backward) on a model.")
    p.add_argument("plan", help="plan file written by hartsc")
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors), local disk")
    p.add_argument("--mode", choices=MODES, default="compact",
                   help="compact (default): shared prefixes once; expanded: every trajectory alone (baseline); "
                        "nodewise: one linear-attention call per tree segment (ablation)")
    p.add_argument("--no-replay", action="store_true",
                   help="hand over the exact fork state instead of replaying from the chunk anchor (ablation; "
                        "runs the node-wise call tables)")
    p.add_argument("--no-windows", action="store_true",
                   help="run every consumer of an L1+L2 plan on its complete layout, without its window "
                        "producer's reuse (baseline; same results)")
    p.add_argument("--loss", choices=LOSSES, default="nll", help="objective (default nll: token-mean NLL)")
    p.add_argument("--reduction", choices=REDUCTIONS, default="token-mean",
                   help="how per-position terms reduce over the step (default token-mean: divide by the step's "
                        "trained positions; seq-mean-token-mean: mean over trajectories of their token means; "
                        "seq-mean-token-sum: mean over trajectories of their token sums)")
    p.add_argument("--clip-low", type=float, default=0.2, help="grpo/ppo: ratio clipped below at 1 - this (default 0.2)")
    p.add_argument("--clip-high", type=float, default=0.2, help="grpo/ppo: ratio clipped above at 1 + this (default 0.2)")
    p.add_argument("--kl-coef", type=float, default=0.0, help="grpo/ppo: weight of the k3 KL to ref_logprobs (default 0)")
    p.add_argument("--moe-aux-coef", type=float, default=0.0, help="weight of the MoE load-balancing loss (default 0: reported only)")
    p.add_argument("--moe-z-coef", type=float, default=0.0, help="weight of the router z-loss (default 0: reported only)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model dtype (default float32)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs (default auto: cuda when available, one GPU per torchrun rank; "
                        "linear attention then uses fla's kernels when the plan's chunk size is 64)")
    p.add_argument("--logprobs", choices=LOGPROB_POSITIONS, default="all",
                   help="which positions' log-probabilities to recover: all (default) or loss (only those the "
                        "objective weighs: the LM head skips prompt and tool-output rows; others are NaN)")
    p.add_argument("--logprobs-out", help="write per-trajectory log-probabilities (.npz keyed by str(id))")
    p.add_argument("--grads-out", help="write parameter gradients (.safetensors keyed by parameter name)")
    p.add_argument("--recompute", action="store_true",
                   help="full-layer activation recomputation: keep only layer inputs, re-run layers in backward")
    p.add_argument("--forward-only", action="store_true", help="skip the backward pass (no --grads-out)")
    p.add_argument("--json", action="store_true", help="print the run summary as one JSON object on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from harts.executor.runtime import run_step

    mode = "nodewise" if args.no_replay else args.mode
    if args.no_replay and args.mode == "expanded":
        print("harts run: --no-replay has no meaning with --mode expanded (nothing is handed over); "
              "fix: drop one of them", file=sys.stderr)
        return 2
    if args.forward_only and args.grads_out:
        print("harts run: --grads-out needs the backward pass; fix: drop --forward-only", file=sys.stderr)
        return 2
    loss = LossConfig(kind=args.loss, clip_low=args.clip_low, clip_high=args.clip_high, kl_coef=args.kl_coef,
                      moe_aux_coef=args.moe_aux_coef, moe_z_coef=args.moe_z_coef, reduction=args.reduction)
    from harts.executor import distributed

    primary = True
    try:
        plan = read_plan(args.plan)
        model = load_model(args.model, args.dtype)
        selected = None
        if distributed.launched_by_torchrun():
            group = distributed.init_data_parallel(int(plan.flags["dp"]))
            selected, primary = distributed.microbatches_of_replica(plan, group.rank), group.is_primary
        model = model.to(model_device(args.device))
        result = run_step(plan, model, mode=mode, loss=loss, backward=not args.forward_only,
                          recompute=args.recompute, microbatches=selected, windows=not args.no_windows,
                          progress=terminal_progress if primary else None, logprobs=args.logprobs)
        if selected is not None:
            distributed.all_reduce_result(result, model)
        if primary and args.logprobs_out:
            write_logprobs(args.logprobs_out, result.logprobs)
        if primary and args.grads_out:
            write_grads(args.grads_out, result.grads)
        if selected is not None:
            distributed.finish_data_parallel()
    except HartsError as err:
        print(f"harts run: {err}", file=sys.stderr)
        return err.exit_code
    except ValueError as err:   # objective misuse, e.g. ppo without old_logprobs
        print(f"harts run: {err}", file=sys.stderr)
        return 2
    if not primary:
        return 0
    original = int(plan.step["original_tokens"])
    summary = {"mode": mode, "loss": result.loss, "objective": result.objective,
               "moe_aux_loss": result.moe_aux_loss, "moe_z_loss": result.moe_z_loss,
               "original_tokens": original, "decoder_rows": result.rows, "window_producers": result.producers_run,
               "seconds": result.seconds,
               "tokens_per_second": original / result.seconds if result.seconds else 0.0}
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    windows = f" ({result.producers_run} window producers)" if result.producers_run else ""
    print(f"harts run: {mode}: loss {result.loss:.6f}, {original} tokens through {result.rows} decoder rows{windows} in "
          f"{result.seconds:.2f}s ({summary['tokens_per_second']:.0f} tokens/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
