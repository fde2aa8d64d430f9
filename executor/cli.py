"""`harts run PLAN --model DIR`: run a compiled step on a Hugging Face model directory."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import math
import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

from harts.executor.layout import MODES
from harts.executor.losses import (LOGPROB_POSITIONS, LOSSES, REDUCTIONS, VALUE, LossConfig, check_value_inputs,
                                    position_weights)
from harts.executor.models.registry import runner_class
from harts.executor.ops.linear_attention.backend import select_backend
from harts.progress import quiet_library_progress, terminal_progress
from harts.schema.atomic import atomic_write_files, check_output_path, refuse_one_file
from harts.schema.errors import HartsError, UsageError
from harts.schema.plan import read_plan
from harts.schema.plan_invariants import require_valid_plan


def load_errors() -> tuple[type[BaseException], ...]:
    """What loading a damaged or foreign model directory raises, as opposed to a bug of ours.

    A bad config.json gives OSError/ValueError/KeyError/TypeError; a truncated
    or corrupted weights file gives safetensors' SafetensorError (which is no
    OSError) or a torch RuntimeError (shape mismatch, short storage).
    """
    from safetensors import SafetensorError

    return (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError)


def check_model_type(model_dir: str) -> None:
    """Refuse, before any weights load, a config.json naming a family HARTS has no runner for."""
    from harts.executor.models.registry import RUNNERS
    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return   # missing or unreadable: the load below says so
    if isinstance(model_type, str) and model_type not in RUNNERS:
        raise HartsError(f"{model_dir}: model type {model_type!r} is not supported; fix: use one of "
                         f"{', '.join(sorted(RUNNERS))} (harts init-model writes one)")


def load_model(model_dir: str, dtype: str = "float32", critic: bool = False):
    """Load from local disk only; one clear line when the directory is not a complete model. `critic` loads
    it as a token-classification model with one label (`--loss value`), a causal LM otherwise."""
    path = Path(model_dir)
    if not path.is_dir():
        what = "not a folder" if path.exists() else "no such folder"
        raise HartsError(f"{model_dir}: {what}; fix: pass a Hugging Face model directory "
                         "(harts init-model writes one)")
    check_model_type(model_dir)
    if not (path / "config.json").is_file():
        raise HartsError(f"{model_dir}: no config.json; fix: pass a Hugging Face model directory "
                         "(harts init-model writes one)")
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from transformers.utils import logging as hf_logging

    if critic:
        from harts.executor.models.critics import register_critics

        check_critic_config(model_dir)
        register_critics()
    auto = AutoModelForTokenClassification if critic else AutoModelForCausalLM

    quiet_library_progress()
    verbosity = hf_logging.get_verbosity()
    # transformers reports missing or misshapen weights as a many-line table (and then, for shapes, an error
    # pointing at that table); HARTS says it in one line from the loading info instead.
    hf_logging.set_verbosity_error()
    try:
        model, info = auto.from_pretrained(path, local_files_only=True, dtype=getattr(torch, dtype),
                                           ignore_mismatched_sizes=True, output_loading_info=True)
    except load_errors() as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise HartsError(f"{model_dir}: cannot load the model ({type(err).__name__}: {first}); "
                         "fix: pass a complete Hugging Face model directory (copy again or re-create a "
                         "truncated or damaged config or weights file)") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    check_loaded_weights(model_dir, info)
    return model.train(False)


def check_critic_config(model_dir: str) -> None:
    """Refuse, before any weights load, a `--loss value` model that is not a critic with one value per position
    (a causal LM's folder, or num_labels other than 1). Every family HARTS runs has a critic class
    (`harts.executor.models.critics`); a family it does not run is refused by `check_model_type`."""
    from harts.executor.models.registry import config_architectures

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return   # the load says so
    if not isinstance(config, dict):
        return
    causal = [name for name in config_architectures(config) if name.endswith("ForCausalLM")]
    if causal:
        raise HartsError(f"{model_dir}: holds a causal LM ({causal[0]}), not a critic with a value head; fix: pass "
                         f"the critic's folder (harts init-model --critic --from {model_dir} -o CRITIC starts one "
                         "from this policy; harts init-model --critic writes a random one)")
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if labels != 1:
        raise HartsError(f"{model_dir}: --loss value reads one value per position, but the config has {labels} "
                         "labels; fix: save the critic with num_labels=1 (a value head of one output)")


def check_loaded_weights(model_dir: str, info: dict) -> None:
    """Refuse a model whose weights files lack tensors its config needs, or hold them in other shapes.

    transformers fills such parameters with fresh random values and carries on, so a run would train a
    model that was never on disk, with a different result each time. Tensors the model does not use are
    ignored, as transformers ignores them.
    """
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise HartsError(f"{model_dir}: the weights lack {len(missing)} tensor(s) the config needs "
                         f"(first: {missing[0]}); fix: copy the complete weights files again, or pass the "
                         "directory the model was saved to")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        name, *shapes = mismatched[0]
        shown = " vs ".join(str(tuple(shape)) for shape in shapes)
        raise HartsError(f"{model_dir}: {len(mismatched)} tensor(s) in the weights have other shapes than the "
                         f"config says (first: {name}, {shown}); fix: pass the config.json these weights were "
                         "saved with")


def model_device(choice: str) -> torch.device:
    """`--device`: cuda (this rank's GPU under torchrun) or cpu; auto picks cuda when there is one."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise HartsError("--device cuda: no CUDA device is visible; fix: run on a GPU machine or pass --device cpu")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def check_outputs(plan: str, model_dir: str, outputs: list[str], inputs: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, output paths that cannot become files (raises OutputError).

    Besides `check_output_path`'s refusals: two outputs at one path (the second
    would replace the first), and an output that is the plan or one of the
    model directory's files (it would destroy an input).
    """
    try:
        model_files = [f for f in Path(model_dir).iterdir() if f.is_file()]
    except OSError:     # no such folder, or unreadable: load_model reports it in its own words
        model_files = []
    # A symlink is written through, so a link and its target are one file.
    targets = [(path, check_output_path(path, inputs=(plan, *model_files, *inputs))) for path in outputs]
    refuse_one_file(targets, "two of --logprobs-out, --values-out and --grads-out name the same file",
                    "give each output its own file name")


def logprobs_bytes(logprobs: dict) -> bytes:
    """An .npz of one float32 array per trajectory, keyed by str(id), as `np.savez` writes it.

    Written entry by entry rather than through `np.savez(buffer, **logprobs)`:
    ids are user strings, and keyword arguments would turn an id "file" into a
    crash and swallow an id "allow_pickle" as an option.
    """
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key, values in logprobs.items():
            with archive.open(f"{key}.npy", "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.asanyarray(values), allow_pickle=False)
    return buffer.getvalue()


def check_npz_ids(ids, flag: str = "--logprobs-out") -> None:
    """Refuse, before the run, ids `np.load` could not give back from the .npz `logprobs_bytes` writes.

    An entry is named `{id}.npy`; np.load finds key k as the entry k first, then k.npy, so ids "a" and
    "a.npy" both answer to lp["a.npy"]. A zip entry name also ends at a NUL character.
    """
    keys = {str(i) for i in ids}
    for key in sorted(keys):
        if "\x00" in key:
            raise HartsError(f"{flag}: trajectory id {key!r} holds a NUL character, which an .npz entry "
                             "name cannot; fix: rename it in trees.jsonl and recompile, or take the results "
                             "from harts.api.run")
        if key.endswith(".npy") and key[:-4] in keys:
            raise HartsError(f"{flag}: trajectory ids {key[:-4]!r} and {key!r} cannot be told apart in "
                             f"an .npz (np.load reads {key!r} as the entry of {key[:-4]!r}); fix: rename one in "
                             "trees.jsonl and recompile, or take the results from harts.api.run")


def read_npz(path: str, flag: str) -> dict:
    """An .npz of per-trajectory float arrays (as --logprobs-out writes) as a dict; one line when it is not."""
    fix = "fix: write it with numpy.savez, one float array per trajectory keyed by str(id)"
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(f"{flag} {path}: cannot read it as an .npz ({type(err).__name__}: {first}); {fix}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):   # a .npy: one array, not one per trajectory
        raise UsageError(f"{flag} {path}: holds one array (.npy), not one per trajectory; {fix}")
    with loaded:
        return {key: loaded[key] for key in loaded.files}


def grads_bytes(grads: dict) -> bytes:
    """A .safetensors of every parameter's gradient, keyed by parameter name."""
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in grads.items()})


def write_outputs(result, logprobs_out: str | None, grads_out: str | None, values_out: str | None = None) -> None:
    """Write the requested outputs as one: all files appear, or none does."""
    files = {}
    if logprobs_out is not None:
        files[logprobs_out] = logprobs_bytes(result.logprobs)
    if values_out is not None:
        files[values_out] = logprobs_bytes(result.values)
    if grads_out is not None:
        files[grads_out] = grads_bytes(result.grads)
    if files:
        atomic_write_files(files)


def json_summary(summary: dict) -> tuple[str, list[str]]:
    """The --json line, and the keys whose values were not finite.

    JSON has no NaN or Infinity (strict parsers, e.g. Go's, Rust's serde_json
    or JavaScript's JSON.parse, reject Python's `NaN` token), so a non-finite
    number is written as null: the line always parses, and null tells the
    consumer exactly which value diverged.
    """
    bad = sorted(k for k, v in summary.items() if isinstance(v, float) and not math.isfinite(v))
    clean = {k: (None if k in bad else v) for k, v in summary.items()}
    return json.dumps(clean, sort_keys=True, allow_nan=False), bad


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
    p.add_argument("--loss", choices=LOSSES + (VALUE,),
                   help="objective (default nll: token-mean NLL; custom with --objective; value trains a critic "
                        "saved as a token-classification model with one label, on --returns)")
    p.add_argument("--objective", metavar="MODULE:FUNCTION",
                   help="your own objective, FUNCTION(logprobs, inputs) -> this microbatch's share as a scalar "
                        "tensor, from an importable module or a PATH.py (implies --loss custom; "
                        "docs/integration.md#custom-objectives)")
    p.add_argument("--reduction", choices=REDUCTIONS, default="token-mean",
                   help="how per-position terms reduce over the step (default token-mean: divide by the step's "
                        "trained positions; seq-mean-token-mean: mean over trajectories of their token means; "
                        "seq-mean-token-sum: mean over trajectories of their token sums)")
    # Defaults None so that a flag --loss nll would ignore can be told apart from one not given (LossConfig's
    # defaults apply when absent).
    p.add_argument("--clip-low", type=float, help="grpo/ppo: ratio clipped below at 1 - this (default 0.2)")
    p.add_argument("--clip-high", type=float, help="grpo/ppo: ratio clipped above at 1 + this (default 0.2)")
    p.add_argument("--kl-coef", type=float, help="grpo/ppo: weight of the k3 KL to ref_logprobs (default 0)")
    p.add_argument("--moe-aux-coef", type=float, default=0.0,
                   help="weight of the MoE load-balancing loss, averaged over the step's microbatches as Megatron "
                        "does (default 0: reported only)")
    p.add_argument("--moe-z-coef", type=float, default=0.0,
                   help="weight of the router z-loss, averaged likewise (default 0: reported only)")
    p.add_argument("--entropy-coef", type=float, default=0.0,
                   help="weight of the entropy bonus: subtract this x the trained positions' entropy, reduced as the "
                        "loss is (default 0: off); the entropy is then reported")
    p.add_argument("--entropy", action="store_true",
                   help="report the trained positions' entropy (\"entropy\" in --json) without training on it "
                        "(one more pass over the logits)")
    p.add_argument("--returns", metavar="NPZ",
                   help="--loss value: the targets, one float array per trajectory keyed by str(id) (as "
                        "--logprobs-out writes; NaN where loss_mask is 0)")
    p.add_argument("--old-values", metavar="NPZ",
                   help="--loss value with --value-clip: the values before the update, keyed likewise")
    p.add_argument("--value-clip", type=float,
                   help="--loss value: clip new values within old values +- this (PPO's clipped value loss; "
                        "default off)")
    p.add_argument("--values-out", help="--loss value: write per-trajectory values (.npz keyed by str(id), aligned "
                                        "as log-probabilities: value i is read before token i, NaN at 0)")
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
    p.add_argument("--no-check", action="store_true",
                   help="skip verifying the plan's invariants before running (`harts check`'s; 0.2 s for a "
                        "paper-scale step): a plan that breaks one would run to wrong results or fail midway")
    return p


def flag_conflict(args) -> str | None:
    """The one-line complaint about flags that contradict each other, or None."""
    if args.no_replay and args.mode == "expanded":
        return "--no-replay has no meaning with --mode expanded (nothing is handed over); fix: drop one of them"
    if args.forward_only and args.grads_out is not None:
        return "--grads-out needs the backward pass; fix: drop --forward-only"
    critic_flags = [flag for flag, value in (("--returns", args.returns), ("--old-values", args.old_values),
                                             ("--value-clip", args.value_clip), ("--values-out", args.values_out))
                    if value is not None]
    if args.loss != VALUE and critic_flags:
        return f"{critic_flags[0]} is read by --loss value only; fix: pass --loss value to train a critic, or drop it"
    if args.loss == VALUE and args.entropy:
        return "--entropy reports the policy's entropy, but --loss value runs a value head; fix: drop --entropy"
    if args.loss == VALUE and args.logprobs_out is not None:
        return "--loss value runs a value head, not the LM head: there are no log-probabilities; fix: write " \
               "--values-out instead of --logprobs-out"
    return None


_POLICY_FLAGS = ("clip_low", "clip_high", "kl_coef")   # what grpo and ppo read and nll and custom do not


def loss_config(args) -> LossConfig:
    """The objective the flags ask for; UsageError (one line naming the flag) when a value is illegal or
    would be ignored (a clip or KL value other than the default with nll or a custom objective: LossConfig
    refuses it), or when `--objective` cannot be loaded or contradicts `--loss`."""
    if args.objective is not None and args.loss not in (None, "custom"):
        raise UsageError(f"--objective replaces the built-in loss, but --loss {args.loss} asks for one; "
                         "fix: drop --loss (or pass --loss custom)")
    kind = args.loss or ("custom" if args.objective is not None else "nll")
    # Absent flags take LossConfig's defaults; a launcher may pass every flag with its default whatever the loss.
    given = {name: getattr(args, name) for name in _POLICY_FLAGS if getattr(args, name) is not None}
    objective = load_objective(args.objective) if args.objective is not None else None
    return LossConfig(kind=kind, moe_aux_coef=args.moe_aux_coef, moe_z_coef=args.moe_z_coef,
                      entropy_coef=args.entropy_coef, reduction=args.reduction, objective=objective,
                      value_clip=args.value_clip, **given)


def load_objective(spec: str):
    """`--objective MODULE:FUNCTION` or `PATH.py:FUNCTION` as a callable; UsageError (one line) otherwise.

    A dotted module is imported with the working directory on the path (as `python -m` would); a path is
    loaded as a file with its folder on the path (as `python PATH.py` would), so a script next to the plan
    works without packaging, importing its neighbours.
    """
    fix = "fix: pass --objective MODULE:FUNCTION (importable) or --objective PATH.py:FUNCTION"
    source, _, name = spec.rpartition(":")
    if not source or not name.isidentifier():
        raise UsageError(f"--objective {spec!r} is not MODULE:FUNCTION; {fix}")
    try:
        if source.endswith(".py") or os.sep in source:
            if not os.path.isfile(source):
                raise UsageError(f"--objective {spec!r}: no file {source}; {fix}")
            # As `python PATH.py` would: the file's folder on the path, so modules beside it import.
            folder = os.path.dirname(os.path.abspath(source))
            if folder not in sys.path:
                sys.path.insert(0, folder)
            module_spec = importlib.util.spec_from_file_location("harts_objective", source)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module   # dataclasses and pickling look their module up there
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(source)
    except UsageError:
        raise
    except Exception as err:   # the user's module failed to import: one line that names it, not a traceback
        raise UsageError(f"--objective {spec!r}: importing {source} failed: {type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}; fix: make {source} importable") from err
    function = getattr(module, name, None)
    if not callable(function):
        raise UsageError(f"--objective {spec!r}: {source} has no callable {name}; {fix}")
    return function


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from harts.executor.critic import critic_targets
    from harts.executor.runtime import run_step

    mode = "nodewise" if args.no_replay else args.mode
    conflict = flag_conflict(args)
    if conflict:
        print(f"harts run: {conflict}", file=sys.stderr)
        return 2
    from harts.executor import distributed

    primary = True
    try:
        loss = loss_config(args)
        # Every input check comes before the model loads and the step runs: a
        # bad output path must not cost a whole step, nor leave one file of two.
        # An empty path (`--logprobs-out "$UNSET"`) is refused there, not taken as "no output".
        check_outputs(args.plan, args.model,
                      [p for p in (args.logprobs_out, args.values_out, args.grads_out) if p is not None],
                      inputs=tuple(p for p in (args.returns, args.old_values) if p is not None))
        plan = read_plan(args.plan)
        if not args.no_check:
            # The executor trusts the plan's index tables: a broken invariant would run to wrong
            # log-probabilities or fail midway, so it is refused before any work.
            require_valid_plan(args.plan, plan)
        for flag, path in (("--logprobs-out", args.logprobs_out), ("--values-out", args.values_out)):
            if path is not None:
                check_npz_ids(plan.step["ids"], flag)
        returns, old_values = (critic_targets(plan, read_npz(path, flag), flag.removeprefix("--").replace("-", "_"))
                               if path is not None else None
                               for flag, path in (("--returns", args.returns), ("--old-values", args.old_values)))
        offsets = np.asarray(plan.step["token_offsets"], dtype=np.int64)
        check_value_inputs(returns, old_values, position_weights(plan.step["loss_mask"], offsets, loss.reduction),
                           loss, backward=not args.forward_only)
        if distributed.launched_by_torchrun():
            distributed.check_world_size(int(plan.flags["dp"]))
        device = model_device(args.device)
        # HARTS_LINEAR_ATTENTION checked before the model loads; the backend itself is known after.
        select_backend(device, int(plan.flags["chunk_size"]))
        model = load_model(args.model, args.dtype, critic=loss.kind == VALUE)
        selected = None
        if distributed.launched_by_torchrun():
            group = distributed.init_data_parallel(int(plan.flags["dp"]), device)
            selected, primary = distributed.microbatches_of_replica(plan, group.rank), group.is_primary
        model = model.to(device)
        backend = model_backend(device, plan, model)   # now knowing the family's gate (a defect may rule fla out)
        if primary and backend == "fla":
            print("harts run: linear attention runs fla's Triton kernels, which compile and autotune on first use "
                  "(about 4 minutes per dtype on a bare H200; Triton's disk cache serves later runs; "
                  "HARTS_LINEAR_ATTENTION=torch runs our torch op instead)", file=sys.stderr)
        with _together(selected is not None, device, "during the step"):
            result = run_step(plan, model, mode=mode, loss=loss, backward=not args.forward_only,
                              recompute=args.recompute, microbatches=selected, windows=not args.no_windows,
                              progress=terminal_progress if primary else None, logprobs=args.logprobs,
                              entropy=args.entropy, returns=returns, old_values=old_values)
        if selected is not None:
            distributed.all_reduce_result(result, model)
        with _together(selected is not None, device, "writing the outputs"):
            if primary:
                write_outputs(result, args.logprobs_out, args.grads_out, args.values_out)
        if selected is not None:
            distributed.finish_data_parallel()
    except HartsError as err:   # input, output and usage errors (UsageError: ppo without old_logprobs, a bad flag)
        rank = distributed.launch_rank() if distributed.launched_by_torchrun() else 0
        # Every rank says why it stopped (one may fail alone: its node lacks the model, its GPU is
        # busy); the other ranks' copies of a refusal they all meet carry their rank, so they read
        # as copies of rank 0's line.
        # One write per line: ranks share the terminal, and print's separate newline could split two lines.
        sys.stderr.write(f"harts run: {err}\n" if rank == 0 else f"harts run: rank {rank}: {err}\n")
        sys.stderr.flush()
        return err.exit_code
    if not primary:
        return 0
    report(args, mode, plan, result)
    return 0


@contextlib.contextmanager
def _together(distributed_run: bool, device: torch.device, stage: str):
    """Under torchrun, a failure of one rank in the block stops every rank with one line each
    (`distributed.raise_if_a_rank_failed`); alone, errors pass through unchanged."""
    if not distributed_run:
        yield
        return
    from harts.executor import distributed
    flags = distributed.failure_flags(device)
    failure = None
    try:
        yield
    except Exception as err:   # any: a custom objective's own error, out of memory
        failure = err
    distributed.raise_if_a_rank_failed(failure, flags, stage)


def model_backend(device: torch.device, plan, model) -> str:
    """The linear-attention backend `model`'s rounds get on `device` (see `select_backend`)."""
    scalar_gate = runner_class(model).SCALAR_GATE
    return select_backend(device, int(plan.flags["chunk_size"]), scalar_gate=scalar_gate)


def report(args, mode: str, plan, result) -> None:
    """The summary line on stderr, and with --json the summary object on stdout."""
    original = int(plan.step["original_tokens"])
    summary = {"mode": mode, "loss": result.loss, "objective": result.objective,
               "moe_aux_loss": result.moe_aux_loss, "moe_z_loss": result.moe_z_loss,
               "original_tokens": original, "decoder_rows": result.rows, "window_producers": result.producers_run,
               "seconds": result.seconds,
               "tokens_per_second": original / result.seconds if result.seconds else 0.0}
    if args.entropy or args.entropy_coef:
        summary["entropy"] = result.entropy   # null on a step with no trained position
    if args.json:
        line, bad = json_summary(summary)
        print(line)
        if args.loss == VALUE and args.returns is None:   # the values alone: no targets, so no loss to report
            bad = [key for key in bad if key not in ("loss", "objective")]
        if bad:
            print(f"harts run: warning: {', '.join(bad)} not finite (NaN or infinity), written as null in --json",
                  file=sys.stderr)
    offsets = np.asarray(plan.step["token_offsets"], dtype=np.int64)
    if not args.forward_only and not position_weights(plan.step["loss_mask"], offsets, "token-mean").any():
        # Legal (a batch whose every sample was filtered out), but a silent zero gradient is worth a line.
        print("harts run: warning: no position of the step has loss_mask 1 (index 0 never counts): the loss is 0 "
              "and every gradient is zero", file=sys.stderr)
    windows = f" ({result.producers_run} window producers)" if result.producers_run else ""
    entropy = f", entropy {result.entropy:.6f}" if result.entropy is not None else ""
    loss = "values only (no --returns)" if args.loss == VALUE and args.returns is None else f"loss {result.loss:.6f}"
    print(f"harts run: {mode}: {loss}{entropy}, {original} tokens through {result.rows} decoder rows{windows} in "
          f"{result.seconds:.2f}s ({summary['tokens_per_second']:.0f} tokens/s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
