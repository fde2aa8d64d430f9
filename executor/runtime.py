"""Run a plan's step on a loaded model: per-position log-probabilities, the loss, gradients.

The runtime reads the plan's arrays, builds each microbatch's `ExecLayout`,
runs the model runner over it, recovers every semantic position's
log-probability and accumulates gradients microbatch by microbatch. Loss
reductions use step-level denominators taken from the plan, so the result
equals one backward over the whole step. It contains no tree logic.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from harts.executor.critic import flat_targets, head_values, value_head_of
from harts.executor.layout import MODES, build_layout, expanded_groups
from harts.executor.losses import (LOGPROB_POSITIONS, VALUE, LossConfig, PositionMeta, check_objective_inputs,
                                    check_value_inputs, policy_loss, position_weights, trained_counts, value_loss)
from harts.executor.models.moe import MoEStatistics
from harts.executor.models.registry import runner_for
from harts.executor.ops.linear_attention.chunk import clear_round_layouts
from harts.executor.ops.logprobs import position_logprobs, position_logprobs_and_entropy
from harts.executor.ops.transfer import to_device
from harts.executor.windows import WindowSchedule
from harts.schema.errors import UsageError
from harts.schema.plan import Plan
from harts.schema.runs import expand_runs


@dataclass
class StepResult:
    logprobs: dict                     # str(id) -> float32[n], NaN at index 0
    loss: float                        # the step's loss (policy, or a critic's value loss; NaN for a critic's
                                       # forward pass without returns), reduced as LossConfig.reduction says
    objective: float                   # what was differentiated: loss + MoE terms - entropy_coef x entropy
    grads: dict                        # parameter name -> its .grad, trainable ones (empty without backward)
    moe_load: dict                     # layer -> float64[E] occurrence-weighted expert loads
    moe_aux_loss: float                # summed over MoE layers, divided by the step's microbatch count
                                       # (`moe_units`): the step's mean, or with `microbatches=` their share
    moe_z_loss: float                  # likewise
    seconds: float
    rows: int                          # decoder rows run (over all microbatches and window producers)
    # Per unit in run order: its forward + backward, not counting producer work it set off (`producer_seconds`);
    # host time (on a GPU, until its kernels are queued) unless run_step's `device_timing`.
    microbatch_seconds: list = field(default_factory=list)
    unit_microbatches: list = field(default_factory=list)    # the plan microbatch index of each of those units
    producer_seconds: dict = field(default_factory=dict)     # (window, replica) -> its producer's forward + backward
    producers_run: int = 0             # window producers executed (L1+L2 plans with windows on)
    producer_backward_passes: int = 0  # autograd traversals of producer graphs (one per producer)
    most_live_producers: int = 0       # producer graphs held at once (memory)
    # The reduction of the per-position entropies (the loss's weights: with token-mean, the mean entropy of the
    # trained positions); None unless asked for (`entropy=True`) or weighed (`LossConfig.entropy_coef`), and
    # None on a step with no trained position.
    entropy: float | None = None
    # Loss 'value' (a critic): str(id) -> float32[n], the value head's output for each position (v_i read
    # where logprobs[i] would be, NaN at index 0); `logprobs` is then empty and `loss` the value loss.
    values: dict = field(default_factory=dict)


def _meta(step_inputs: "_StepInputs", flat: np.ndarray) -> PositionMeta:
    """The objective's per-position inputs of one microbatch (positions `flat`), moved in one copy."""
    step, offsets = step_inputs.plan.step, step_inputs.offsets
    trajectory = np.searchsorted(offsets, flat, side="right") - 1
    arrays = {"weight": step_inputs.weights[flat], "trajectory": trajectory, "position": flat - offsets[trajectory],
              "loss_mask": np.asarray(step["loss_mask"])[flat].astype(np.float64)}
    for key in ("advantages", "old_logprobs", "ref_logprobs"):   # selected first: converting is per position
        if step.get(key) is not None:
            arrays[key] = np.asarray(step[key])[flat].astype(np.float64)
    for key in ("returns", "old_values"):
        if getattr(step_inputs, key) is not None:
            arrays[key] = getattr(step_inputs, key)[flat]
    moved = dict(zip(arrays, to_device(list(arrays.values()), step_inputs.device)))
    counts = step_inputs.counts
    return PositionMeta(weight=moved["weight"], advantages=moved.get("advantages"),
                        old_logprobs=moved.get("old_logprobs"), ref_logprobs=moved.get("ref_logprobs"),
                        trajectory=moved["trajectory"], position=moved["position"], loss_mask=moved["loss_mask"],
                        trained_positions=counts[0], trained_trajectories=counts[1],
                        returns=moved.get("returns"), old_values=moved.get("old_values"))


def windows_runnable(plan: Plan) -> bool:
    """Every consumer that reads a producer carries the calls of the rows it computes itself."""
    return all("residual_token_rows" in mb for mb in plan.microbatches
               if np.any(np.asarray(mb.get("row_cached_by", ())) >= 0))


def check_model_fits(plan: Plan, model) -> None:
    """Every token of the plan is in the model's vocabulary; else one line naming a trajectory using the
    largest such token, and the position."""
    vocab = int(model.config.vocab_size)
    largest = max((int(np.max(mb["row_token"])) for mb in plan.microbatches if len(mb["row_token"])), default=-1)
    if largest < vocab:
        return
    mb = next(mb for mb in plan.microbatches if len(mb["row_token"]) and int(np.max(mb["row_token"])) == largest)
    row = int(np.flatnonzero(mb["row_token"] == largest)[0])
    runs = mb["member_run_offsets"]
    # Error path only: find a member whose path holds that row (the plan's own run tables).
    member = next((j for j in range(len(mb["member_trajectory"]))
                   if row in expand_runs(mb["run_row_start"][runs[j]:runs[j + 1]], mb["run_length"][runs[j]:runs[j + 1]])),
                  None)   # None only in a plan that breaks its invariants (harts run --no-check)
    where = "" if member is None else f"trajectory {plan.step['ids'][int(mb['member_trajectory'][member])]!r}: "
    compiled_for = plan.flags.get("vocab_size")
    if compiled_for is not None:   # the plan says which vocabulary it was checked against: not this model's
        fix = (f"the plan was compiled for a vocabulary of {int(compiled_for)} (--vocab-size); fix: run it with "
               "the model its tokens come from")
    else:
        fix = ("fix: use the model the tokens come from (compile with --vocab-size to catch this when compiling)")
    raise UsageError(f"{where}token {largest} at position {int(mb['row_position'][row])} is "
                     f"outside the model's vocabulary of {vocab} entries; {fix}")


def trainable_gradients(model) -> dict:
    """Parameter name -> its `.grad` itself (no copy: a model-sized buffer per step otherwise), for every
    parameter that requires a gradient; one no row reached (an expert nobody was routed to) gets zeros.
    Frozen parameters (LoRA bases, a frozen embedding) are left out rather than given zero tensors."""
    return {name: p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            for name, p in model.named_parameters() if p.requires_grad}


# float64 fails inside the ops (float32 and bfloat16 are what is tested; float16 runs as before, untested).
REFUSED_DTYPES = (torch.float64,)


def check_call(plan, model, backward: bool, loss=LossConfig(), value_head=None) -> None:
    """One UsageError with a fix for arguments `run_step` cannot run, before any work, rather than a torch
    error from deep inside the step (microbatch indices: `microbatch_indices`)."""
    if not isinstance(loss, LossConfig):
        raise UsageError(f"loss must be a LossConfig here, got {type(loss).__name__}; fix: "
                         "LossConfig(kind='grpo'), or harts.api.run, which also takes a name or a function")
    if not isinstance(plan, Plan):
        raise UsageError(f"plan must be a harts Plan, got {type(plan).__name__}; "
                         "fix: plan = harts.api.read_plan(path) (or compile_trajectories(...))")
    parameters = list(model.parameters()) if hasattr(model, "parameters") else []
    if not parameters:
        raise UsageError(f"model must be a Hugging Face model with parameters, got {type(model).__name__}; "
                         "fix: pass e.g. AutoModelForCausalLM.from_pretrained(dir)")
    dtypes = sorted({str(p.dtype) for p in parameters if p.dtype in REFUSED_DTYPES})
    if dtypes:
        raise UsageError(f"the model holds {', '.join(dtypes)} parameters; HARTS runs float32 or bfloat16 models; "
                         "fix: model.float() (or .to(torch.bfloat16))")
    device_type = parameters[0].device.type
    if torch.is_autocast_enabled(device_type):
        # Our operators mix the model's own modules with tensors they build in the model's dtype; under
        # autocast the two disagree (a torch dtype error deep inside a layer).
        raise UsageError(f"called inside torch.autocast({device_type!r}), which HARTS does not support; fix: call "
                         "outside it, with the model itself in the dtype to train in (model.to(torch.bfloat16)): "
                         "HARTS's own operators then compute in float32 where it matters (docs/numerics.md)")
    if backward and torch.is_inference_mode_enabled():
        raise UsageError("called inside torch.inference_mode(), which records nothing to differentiate; "
                         "fix: call outside it, or pass backward=False")
    trainable = parameters + (list(value_head.parameters()) if isinstance(value_head, torch.nn.Module) else [])
    if backward and not any(p.requires_grad for p in trainable):   # a critic may train its head alone
        raise UsageError("no model parameter requires a gradient; fix: unfreeze what should train, or pass "
                         "backward=False")


def microbatch_indices(plan: Plan, microbatches) -> list[int] | None:
    """`run_step`'s `microbatches` as a list of ints: any iterable of integers (Python, numpy, torch scalars), each
    a distinct index of the plan's microbatches; one UsageError otherwise."""
    if microbatches is None:
        return None
    count = len(plan.microbatches)
    given = list(microbatches)
    try:
        indices = [operator.index(i) for i in given if not isinstance(i, bool)]
    except TypeError:
        indices = []
    if len(indices) != len(given) or any(not 0 <= i < count for i in indices) or len(set(indices)) != len(indices):
        raise UsageError(f"microbatches must be distinct indices in [0, {count}), got {given!r}; "
                         "fix: pass each microbatch once (a repeated one would count its loss twice)")
    return indices


@contextlib.contextmanager
def _step_scoped_round_layouts():
    try:
        yield
    finally:
        clear_round_layouts()


@contextlib.contextmanager
def _failed_backward_released(device: torch.device):
    """After a step that raised, run one trivial backward on `device`.

    After a backward that raised part-way, torch's autograd keeps what it had left to do (pending
    gradients and the graph they lead to: a microbatch's activations) until the next backward in the
    process, held from C++ where nothing in Python refers to it (measured by an audit: 390 tensors,
    10.7 MB on the tiny test model, freed by any later backward). A caller that catches an out-of-memory
    error and retries would start its retry with that graph still allocated; the trivial backward lets it
    go at once (test_windows.py's failing-backward test).
    """
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):   # a device that cannot even do this keeps the caller's error
            probe = torch.zeros((), device=device, requires_grad=True)
            torch.autograd.backward(probe * 1.0)
        raise


def moe_units(plan: Plan, offsets: np.ndarray, mode: str, pack_expanded: bool) -> int:
    """The step's forward units (plan microbatches; expanded and packed: their groups), all replicas'.

    Each unit's MoE auxiliary and z losses enter the step divided by this, so the step's terms are
    their mean over its units, as Megatron scales each microbatch's by 1 / num_microbatches and data
    parallelism averages: their weight does not grow with the number of microbatches a plan has, and
    ranks that each run their replica's units add up to the whole step's mean.
    """
    if mode == "expanded" and pack_expanded:
        capacity = int(plan.flags["capacity"])
        return max(1, sum(len(expanded_groups(mb, offsets, capacity)) for mb in plan.microbatches))
    return max(1, len(plan.microbatches))


def run_step(plan: Plan, model, *, mode: str = "compact", loss: LossConfig = LossConfig(),
             backward: bool = True, microbatches: list[int] | None = None,
             pack_expanded: bool = True, recompute: bool = False, progress=None,
             windows: bool = True, logprobs: str = "all", accumulate: bool = False,
             entropy: bool = False, device_timing: bool = False, value_head=None,
             returns: np.ndarray | None = None, old_values: np.ndarray | None = None) -> StepResult:
    """Forward (and backward) of the step's microbatches, in plan order (slot, replica; with
    windows, window by window and replica by replica).

    `windows` (compact mode, plans compiled with `--levels l1+l2`): each
    window's producer runs once before its first consumer that reads it,
    consumers run the decoder on their uncached rows only, and after the
    window's last such consumer one producer backward runs and the window is
    released. False runs every consumer on its complete layout (no reuse).

    In expanded mode, `pack_expanded` packs each microbatch's trajectories into
    groups of at most the plan's capacity in original tokens (the realistic
    baseline); False runs each plan microbatch's trajectories as one group, so
    per-microbatch statistics (MoE auxiliary and z losses) are comparable with
    compact execution of the same microbatch. `recompute` turns on full-layer
    activation recomputation (same gradients, lower peak memory). `progress`,
    if given, wraps the microbatch loop (e.g. a tqdm bar).

    `accumulate` adds the step's gradients to what `.grad` holds instead of zeroing it first.

    `entropy` also reports `StepResult.entropy`, the entropies of the trained positions' predictive
    distributions reduced with the loss's weights; `loss.entropy_coef` > 0 turns it on and adds
    -entropy_coef x entropy to what is differentiated. It costs one more elementwise pass over each block
    of logits (0-20% of the LM head's forward + backward on CPU: benchmarks/bench_logprobs.py --entropy).

    `logprobs` "all" recovers every position's log-probability; "loss" only
    those the objective weighs (loss_mask 1, position >= 1; the rest stay NaN
    in `StepResult.logprobs`), so the LM head skips the rows of prompts and
    tool outputs. Loss, gradients and MoE statistics are the same either way.

    `device_timing` waits for the device at every clock read, so `microbatch_seconds` and `producer_seconds`
    are the device's time per unit and per producer (`harts calibrate --plan`); it costs the overlap of host
    and device, so leave it off in training.

    Loss 'value' trains a critic: `value_head` (default: the model's own `score`, with its `dropout`, as a
    `*ForTokenClassification` with one label has; else a torch.nn.Module in the model's dtype and on its
    device) maps final hidden states [R, D] to values [R, 1] or [R], once per compact row,
    `returns` and `old_values` (with `loss.value_clip`) are float64 arrays over the step's flat positions,
    and `StepResult.values` replaces `logprobs`. A head that is not part of the model has its `.grad`
    zeroed (unless `accumulate`) and filled as the model's are, but is not in `StepResult.grads`.
    """
    check_call(plan, model, backward, loss, value_head)
    microbatches = microbatch_indices(plan, microbatches)
    if not hasattr(model, "config") and hasattr(model, "module"):
        raise UsageError(f"the model is wrapped ({type(model).__name__}); fix: pass the Hugging Face model itself "
                         "(model.module): HARTS splits data parallelism by the plan's replicas (torchrun ... harts "
                         "run, or harts.executor.distributed; see docs/integration.md), not through a wrapper")
    critic = value_head_of(model, loss, value_head)
    head = getattr(model, "lm_head", None)
    if critic is None and head is None:   # a critic's step never reads the LM head
        raise UsageError(f"the model has no LM head ({type(model).__name__}: no lm_head layer), and HARTS recovers "
                         "log-probabilities through it; fix: pass the causal-LM model "
                         "(AutoModelForCausalLM.from_pretrained), not its base model")
    if critic is None and not isinstance(head, torch.nn.Linear):
        raise UsageError(f"the model's lm_head is a {type(head).__name__}, not a torch.nn.Linear: HARTS reads its "
                         "weight to recover log-probabilities blockwise; fix: merge any adapter into the head "
                         "(e.g. PEFT's merge_and_unload) or leave the head out of it")
    if mode not in MODES:
        raise UsageError(f"mode must be one of {MODES}, got {mode!r}; fix: pass one of them ('compact' unless "
                         "you are comparing against a baseline)")
    if logprobs not in LOGPROB_POSITIONS:
        raise UsageError(f"logprobs must be one of {LOGPROB_POSITIONS}, got {logprobs!r}; fix: pass 'all' (every "
                         "position) or 'loss' (only those the objective weighs)")
    check_model_fits(plan, model)
    started = time.perf_counter()
    chunk_size = int(plan.flags["chunk_size"])
    runner = runner_for(model, chunk_size=chunk_size, recompute=recompute)
    step = _step_inputs(plan, model, runner, mode, loss, pack_expanded, logprobs, entropy, backward, critic,
                        returns, old_values)
    if backward and not accumulate:
        model.zero_grad(set_to_none=True)
        if isinstance(critic, torch.nn.Module):
            critic.zero_grad(set_to_none=True)
    work = _work_units(plan, step.offsets, mode, pack_expanded, microbatches)
    use_windows = windows and mode == "compact" and bool(plan.producers)
    if use_windows and not windows_runnable(plan):
        # A plan from a hartsc that wrote producers but no decoder-row calls: exact without reuse.
        warnings.warn("this plan's consumers have no residual_* calls (compiled by an older hartsc): running "
                      "every consumer on its complete layout, without its window producer's reuse; recompile "
                      "the plan with this hartsc to reuse shared prefixes across microbatches", stacklevel=2)
        use_windows = False
    if use_windows:
        # One process running several replicas: finish a (window, replica) before the next, so only
        # one producer graph is alive at a time (slot order within a replica is kept; a rank of a
        # data-parallel run holds one replica anyway). Gradients are sums: the order does not matter.
        work.sort(key=lambda item: (int(item[1]["window"]), int(item[1]["replica"])))
    clock = device_clock(step.device) if device_timing else time.perf_counter
    schedule = WindowSchedule(plan.producers if use_windows else None, [mb for _, mb, _ in work], backward, clock)
    finished: list[_MicrobatchResult] = []
    times = []
    # `closing`: a step that stops early (an exception, an interrupt) releases its live producers, and
    # autograd lets go of a failed backward's graph; the round layouts cached for this step's
    # linear-attention calls go when it ends, whichever way.
    with contextlib.closing(schedule), _step_scoped_round_layouts(), _failed_backward_released(step.device):
        for i, (_, mb, group) in enumerate(progress(work, f"{mode} microbatches") if progress else work):
            t0, producers_before = clock(), schedule.seconds
            layout = build_layout(mb, step.offsets, chunk_size, mode, members=group, windows=use_windows)
            layout = layout.to(step.device)
            finished.append(_run_microbatch(step, runner, layout, schedule.source(i, runner, layout), backward))
            schedule.finished(i)
            times.append(clock() - t0 - (schedule.seconds - producers_before))
    return _step_result(plan, model, step, finished, backward, started=started, microbatch_seconds=times,
                        unit_microbatches=[index for index, _, _ in work], schedule=schedule)


def device_clock(device: torch.device):
    """time.perf_counter after the device has finished what was queued (only CUDA queues work)."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


@dataclass(frozen=True)
class _StepInputs:
    """What every microbatch of one step reads; fixed before the first one runs. `weights` and `counts` are
    the step's reduction weights and trained counts, identical whichever microbatch or rank a position runs on."""
    plan: Plan
    offsets: np.ndarray          # int64[T + 1] trajectory starts in the step's flat positions
    weights: np.ndarray          # float64 per flat position: its share of the loss
    counts: tuple[int, int]      # trained positions, trained trajectories (the step's)
    device: torch.device         # the model's: index tensors follow it (on CUDA, fla's kernels run)
    loss: LossConfig
    loss_positions_only: bool    # logprobs="loss": the LM head reads weighed positions only
    with_entropy: bool
    moe_scale: float             # 1 / moe_units: each unit's MoE terms enter as the step's mean
    top_k: int
    lm_head_weight: torch.Tensor | None   # None for a critic (loss 'value'): the LM head is not read
    value_head: torch.nn.Module | None = None   # loss 'value': final hidden states [R, D] -> values [R]
    returns: np.ndarray | None = None     # loss 'value': float64 per flat position
    old_values: np.ndarray | None = None


def _step_inputs(plan: Plan, model, runner, mode: str, loss: LossConfig, pack_expanded: bool, logprobs: str,
                 entropy: bool, backward: bool, value_head=None, returns=None, old_values=None) -> _StepInputs:
    offsets = np.asarray(plan.step["token_offsets"], dtype=np.int64)
    weights = position_weights(plan.step["loss_mask"], offsets, loss.reduction)
    check_objective_inputs(plan.step.get("old_logprobs"), plan.step.get("ref_logprobs"), weights, loss)
    if loss.kind == VALUE:   # another loss's targets stay as given: check_value_inputs refuses any
        returns, old_values = (flat_targets(name, given, len(weights))
                               for name, given in (("returns", returns), ("old_values", old_values)))
    check_value_inputs(returns, old_values, weights, loss, backward)
    if entropy and value_head is not None:
        raise UsageError("entropy=True asks for the policy's entropies, but loss 'value' runs a value head; fix: "
                         "drop entropy for the critic's step")
    return _StepInputs(plan=plan, offsets=offsets, weights=weights, counts=trained_counts(weights, offsets),
                       device=next(model.parameters()).device, loss=loss, loss_positions_only=logprobs == "loss",
                       with_entropy=entropy or loss.entropy_coef > 0,
                       moe_scale=1.0 / moe_units(plan, offsets, mode, pack_expanded), top_k=runner.top_k,
                       lm_head_weight=None if value_head is not None else model.lm_head.weight,
                       value_head=value_head, returns=returns, old_values=old_values)


def _work_units(plan: Plan, offsets: np.ndarray, mode: str, pack_expanded: bool,
                microbatches: list[int] | None) -> list[tuple[int, dict, object]]:
    """(plan microbatch index, the microbatch, member group or None) per forward unit, in plan order;
    expanded and packed: one unit per group of at most the capacity in original tokens."""
    selected = range(len(plan.microbatches)) if microbatches is None else microbatches
    capacity = int(plan.flags["capacity"])
    work = []
    for index in selected:
        mb = plan.microbatches[index]
        if mode == "expanded" and pack_expanded:
            work += [(index, mb, group) for group in expanded_groups(mb, offsets, capacity)]
        else:
            work.append((index, mb, None))
    return work


@dataclass
class _MicrobatchResult:
    """One unit's outputs, still on the device: read back after the last unit, so the host never waits for
    a unit's kernels before queueing the next one's (on an accelerator)."""
    flat: np.ndarray             # the flat positions whose log-probabilities it recovered
    logprobs: torch.Tensor       # float32, aligned with `flat` (a critic's values for loss 'value')
    sums: tuple                  # 0-d tensors: policy loss, MoE aux, MoE z, weighted entropy
    loads: dict                  # MoE layer -> expert loads
    rows: int                    # decoder rows it ran (its producer's are the schedule's)


def _run_microbatch(step: _StepInputs, runner, layout, window, backward: bool) -> _MicrobatchResult:
    """Forward one unit, recover its positions' log-probabilities (a critic: values), and (with `backward`)
    backpropagate its share of the step's objective."""
    stats = MoEStatistics()
    with torch.set_grad_enabled(backward):
        hidden = runner.hidden_states(layout, stats, window)
        flat = layout.position_flat
        reads, labels = layout.position_row, layout.position_label
        kept = None
        if step.loss_positions_only:
            kept = np.flatnonzero(step.weights[flat] > 0)
            flat, (kept_index,) = flat[kept], to_device([kept], step.device)
            reads, labels = reads.index_select(0, kept_index), labels.index_select(0, kept_index)
        meta = _meta(step, flat)
        mb_entropy = torch.zeros((), dtype=torch.float64, device=step.device)
        loss = step.loss
        if step.value_head is not None:
            # A critic: the value of position i is read at the row whose logits would score token i. The head
            # runs once per row, not per position: positions sharing a row share its value (and a [P, D] gather
            # of hidden states would cost the compression factor in memory).
            lam = head_values(step.value_head, hidden).index_select(0, reads)
            # A forward pass for the values alone (no returns yet: GAE needs these first) has no loss.
            mb_loss = value_loss(lam, meta, loss) if meta.returns is not None else \
                torch.full((), math.nan, dtype=torch.float64, device=step.device)
        else:
            # A window consumer's producer owns the normalizers of the rows it caches (computed once per window).
            supplied = window.supplied_normalizers(kept, step.lm_head_weight, step.with_entropy)
            if step.with_entropy:
                lam, entropy_P = position_logprobs_and_entropy(hidden, step.lm_head_weight, reads, labels,
                                                               supplied=supplied)
                meta = dataclasses.replace(meta, entropy=entropy_P.to(torch.float64))
                mb_entropy = (meta.entropy * meta.weight).sum()
            else:
                lam = position_logprobs(hidden, step.lm_head_weight, reads, labels, supplied=supplied)
            mb_loss = policy_loss(lam, meta, loss)
        aux, z = stats.aux_loss(step.top_k) * step.moe_scale, stats.z_loss() * step.moe_scale
        objective = mb_loss + loss.moe_aux_coef * aux + loss.moe_z_coef * z
        if loss.entropy_coef:
            objective = objective - loss.entropy_coef * mb_entropy
    if backward:
        objective.backward()
    return _MicrobatchResult(flat=flat, logprobs=lam.detach().float(),
                             sums=(mb_loss.detach(), aux.detach(), z.detach(), mb_entropy.detach()),
                             loads=dict(stats.load), rows=layout.num_decoder_rows)


def _step_result(plan: Plan, model, step: _StepInputs, finished: list[_MicrobatchResult], backward: bool, *,
                 started: float, microbatch_seconds: list, unit_microbatches: list,
                 schedule: WindowSchedule) -> StepResult:
    """Read every unit's outputs back (the device is idle by now: no stall) and sum them in unit order, as a
    sequential loop would. `seconds` runs from `started` to the end of this read-back."""
    offsets = step.offsets
    flat_logprobs = np.full(int(offsets[-1]), np.nan, dtype=np.float32)
    total_loss, aux_total, z_total, entropy_total = 0.0, 0.0, 0.0, 0.0
    loads: dict = {}
    for unit in finished:
        flat_logprobs[unit.flat] = unit.logprobs.cpu().numpy()
        mb_loss, aux, z, mb_entropy = (float(x) for x in unit.sums)
        total_loss, aux_total, z_total = total_loss + mb_loss, aux_total + aux, z_total + z
        entropy_total += mb_entropy
        for layer, load in unit.loads.items():
            loads[layer] = loads.get(layer, 0) + load.cpu().numpy()
    ids = plan.step["ids"]
    per_trajectory = {str(ids[t]): flat_logprobs[offsets[t]:offsets[t + 1]].copy() for t in range(len(ids))}
    logprobs, values = ({}, per_trajectory) if step.value_head is not None else (per_trajectory, {})
    grads = trainable_gradients(model) if backward else {}
    loss = step.loss
    objective_total = (total_loss + loss.moe_aux_coef * aux_total + loss.moe_z_coef * z_total
                       - loss.entropy_coef * entropy_total)
    return StepResult(logprobs=logprobs, loss=total_loss, objective=objective_total,
                      grads=grads, moe_load=loads, moe_aux_loss=aux_total,
                      moe_z_loss=z_total, seconds=time.perf_counter() - started, rows=sum(unit.rows for unit in finished) + schedule.rows,
                      microbatch_seconds=microbatch_seconds, unit_microbatches=unit_microbatches,
                      producer_seconds=dict(schedule.producer_seconds), producers_run=schedule.producers_run,
                      producer_backward_passes=schedule.backward_passes, most_live_producers=schedule.most_live,
                      # No trained position: no entropy to report (0.0 would read as a collapsed policy).
                      entropy=entropy_total if step.with_entropy and step.counts[0] else None, values=values)
