"""RL objectives on recovered per-position log-probabilities.

Legend: P labelled semantic positions of one microbatch. Each objective only
sees lambda (the current log-probabilities) and the original per-position
metadata, and reduces with the *step's* denominator, so summing microbatch
losses gives the step loss and sharing rows changes nothing.

* `nll`: -sum(mask * lambda) / count.
* `grpo`: the clipped surrogate -min(r A, clip(r, 1-eps_low, 1+eps_high) A)
  with r = exp(lambda - old), old = the input's `old_logprobs` when given,
  else lambda itself detached (on-policy: r = 1, the gradient is A grad lambda);
  plus `kl_coef` times the k3 estimator of KL(pi || ref),
  exp(ref - lambda) - (ref - lambda) - 1, where `ref_logprobs` are given.
* `ppo`: the same surrogate; `old_logprobs` are required.
* `custom`: `LossConfig.objective(logprobs, inputs)`, a function of the
  caller's (`Objective`): any objective that is a sum over trajectories of a
  term reading only that trajectory's positions and step-level constants
  (a sequence-level ratio as in GSPO, a length penalty, a different clip).
  Every trajectory lies whole in one microbatch, so summing the microbatch
  shares gives the step objective and its gradient exactly.
* `value` (a critic; `harts.api.run(..., returns=...)`): the objective reads
  the values v a value head gives each position, not log-probabilities:
  0.5 (v - R)^2 with R the caller's returns, or with `value_clip` c PPO's
  clipped form 0.5 max((v - R)^2, (clip(v, old - c, old + c) - R)^2) around
  the caller's old values. Value v_i, like logprobs[i], is read from the
  hidden state of position i - 1 (the context before token i).

Every kind may add an entropy bonus, -entropy_coef x (the reduction of the
per-position entropies of the predictive distribution, with the same weights).

Reductions (`reduction`, the same for every objective; weights are computed over
the whole step, so they never depend on how trajectories fall into microbatches):

* `token-mean` (default, contract section 3): divide by the number of
  positions i >= 1 with loss_mask 1 over the whole step;
* `seq-mean-token-mean`: each trajectory's masked token mean, averaged over
  the trajectories that have a trained position (the original GRPO reduction);
* `seq-mean-token-sum`: each trajectory's masked token sum, averaged over those
  trajectories.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from harts.schema.errors import UsageError

LOSSES = ("nll", "grpo", "ppo", "custom")   # the policy objectives (harts run --loss)
VALUE = "value"                               # the critic's objective (harts run --loss value, harts.api.run)
REDUCTIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
_DEFAULT_CLIP = 0.2   # both clip bounds; nll and custom objectives leave them at this


@dataclass(frozen=True, slots=True)
class LossConfig:
    """The objective of a step; every instance holds legal values (checked on construction).

    Invariants: `kind` in LOSSES or VALUE, `reduction` in REDUCTIONS, 0 <= clip_low < 1
    (the lower clip bound 1 - clip_low stays positive, as a ratio is),
    clip_high >= 0, the four coefficients finite and >= 0; for nll, custom
    and value (which have no ratio to clip and no KL term) the clip fields at
    their defaults and kl_coef 0; `objective` a callable exactly when kind
    is custom; `value_clip` None or finite and >= 0, and given only with kind
    value, which also has no entropy bonus (a value head has no predictive
    distribution). A NaN or an
    infinity here would silently turn the loss and every gradient into NaN,
    so it is refused with a ValueError that names the field, its `harts run`
    flag and the fix.
    """

    kind: str = "nll"          # nll | grpo | ppo | custom | value
    clip_low: float = _DEFAULT_CLIP    # eps_low: ratio clipped below at 1 - clip_low
    clip_high: float = _DEFAULT_CLIP   # eps_high: ratio clipped above at 1 + clip_high
    kl_coef: float = 0.0       # weight of the k3 KL estimate against ref_logprobs (0: off)
    moe_aux_coef: float = 0.0  # weight of the MoE load-balancing loss (0: reported only)
    moe_z_coef: float = 0.0    # weight of the router z-loss (0: reported only)
    entropy_coef: float = 0.0  # weight of the entropy bonus: the objective subtracts entropy_coef x entropy
    reduction: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    objective: "Objective | None" = None   # kind custom: the caller's objective (`Objective`)
    value_clip: float | None = None   # kind value: clip the new values within old_values +- value_clip (None: off)

    def __post_init__(self) -> None:
        _check_choice("kind", "--loss", self.kind, LOSSES + (VALUE,))
        _check_choice("reduction", "--reduction", self.reduction, REDUCTIONS)
        _check_number("clip_low", self.clip_low, upper=1.0,
                      fix="pass --clip-low in [0, 1), e.g. 0.2 (the ratio is clipped below at 1 - clip_low)")
        _check_number("clip_high", self.clip_high, fix="pass --clip-high >= 0, e.g. 0.2 or 0.28")
        for name in ("kl_coef", "moe_aux_coef", "moe_z_coef", "entropy_coef"):
            _check_number(name, getattr(self, name), fix=f"pass {_flag(name)} >= 0 (0 turns the term off)")
        for name in ("clip_low", "clip_high"):
            if self.kind in ("nll", "custom", VALUE) and getattr(self, name) != _DEFAULT_CLIP:
                raise UsageError(f"LossConfig.{name} ({_flag(name)}) = {getattr(self, name)!r} has no effect with "
                                 f"kind '{self.kind}' (it clips the grpo/ppo ratio); fix: leave it at "
                                 f"{_DEFAULT_CLIP}" + {"nll": ", or pick kind 'grpo' or 'ppo'",
                                                       VALUE: " (a critic clips its values with value_clip)"}.get(
                                     self.kind, " and clip inside your objective"))
        if self.kind in ("nll", "custom", VALUE) and self.kl_coef:
            raise UsageError(f"LossConfig.kl_coef (--kl-coef) = {self.kl_coef!r} has no effect with kind "
                             f"'{self.kind}' (the KL term belongs to the grpo/ppo policy loss); fix: set kl_coef "
                             "to 0" + {"nll": ", or pick kind 'grpo' or 'ppo'", VALUE: ""}.get(
                                 self.kind, " and add the KL term inside your objective"))
        if self.kind == "custom" and not callable(self.objective):
            raise UsageError(f"LossConfig(kind='custom') needs objective, a callable (logprobs, inputs) -> scalar "
                             f"tensor, got {self.objective!r}; fix: pass objective=your_function "
                             "(harts run --objective MODULE:FUNCTION)")
        if self.kind != "custom" and self.objective is not None:
            raise UsageError(f"LossConfig.objective is given with kind '{self.kind}', which would ignore it; "
                             "fix: pass kind='custom' to use your objective, or drop objective")
        if self.value_clip is not None:
            _check_number("value_clip", self.value_clip, fix="pass value_clip >= 0, e.g. 0.2, or None (no clip)")
            if self.kind != VALUE:
                raise UsageError(f"LossConfig.value_clip = {self.value_clip!r} has no effect with kind "
                                 f"'{self.kind}' (it clips a critic's values); fix: drop it, or pick kind 'value'")
        if self.kind == VALUE and self.entropy_coef:
            raise UsageError(f"LossConfig.entropy_coef = {self.entropy_coef!r} has no meaning with kind 'value' "
                             "(a value head has no predictive distribution); fix: set entropy_coef to 0")


def _flag(name: str) -> str:
    """The `harts run` flag of a LossConfig field."""
    return "--" + name.replace("_", "-")


def _check_choice(name: str, flag: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise UsageError(f"LossConfig.{name} ({flag}) must be one of {', '.join(allowed)}, got {value!r}; "
                         f"fix: pick one of {', '.join(allowed)}")


def _check_number(name: str, value, *, fix: str, upper: float | None = None) -> None:
    """A finite real number >= 0 (and < `upper` when given); bools are not numbers here."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if ok and upper is not None:
        ok = value < upper
    if not ok:
        interval = f"in [0, {upper:g})" if upper is not None else "finite and >= 0"
        raise UsageError(f"LossConfig.{name} ({_flag(name)}) must be {interval}, got {value!r}; fix: {fix}")


# Which positions' log-probabilities a step recovers: every one, or only those the objective weighs.
LOGPROB_POSITIONS = ("all", "loss")


def trained_counts(weights: np.ndarray, token_offsets: np.ndarray) -> tuple[int, int]:
    """(positions, trajectories) of the step that are trained: weight > 0, and holding such a position."""
    trained = weights > 0
    starts = np.asarray(token_offsets[:-1], dtype=np.int64)
    per_trajectory = np.add.reduceat(trained, starts) if len(starts) else np.zeros(0, dtype=np.int64)
    return int(trained.sum()), int((per_trajectory > 0).sum())


def position_weights(loss_mask: np.ndarray, token_offsets: np.ndarray, reduction: str) -> np.ndarray:
    """Weight of every flat position of the step in the reduced loss (0 where not trained).

    Position 0 of each trajectory is never a target. The weights sum to 1 for
    the two mean-of-means reductions and for token-mean.
    """
    if reduction not in REDUCTIONS:
        raise UsageError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    trained = np.asarray(loss_mask, dtype=np.float64).copy()
    starts = np.asarray(token_offsets[:-1], dtype=np.int64)
    trained[starts] = 0.0
    if reduction == "token-mean":
        return trained / max(trained.sum(), 1.0)
    lengths = np.diff(token_offsets)
    per_trajectory = np.add.reduceat(trained, starts) if len(starts) else np.zeros(0)
    active = max(int((per_trajectory > 0).sum()), 1)
    if reduction == "seq-mean-token-sum":
        return trained / active
    scale = np.divide(1.0, per_trajectory * active, out=np.zeros_like(per_trajectory), where=per_trajectory > 0)
    return trained * np.repeat(scale, lengths)


@dataclass(frozen=True, slots=True)
class PositionMeta:
    """The objective's per-position inputs for one microbatch: tensors of length P, on the model's device.

    P covers whole trajectories: every position the run recovers (`run_step`'s
    `logprobs`: all labelled ones, index >= 1, or only the trained ones) of
    every trajectory the microbatch holds; no trajectory is split between
    microbatches. Entries follow the order of the log-probabilities the
    objective is given, not the step's flat order.
    """

    weight: torch.Tensor                # float64: the reduction's step-level weight (0: not trained)
    advantages: torch.Tensor            # float64 (0 where the input gave none)
    # float64 as given, NaN where a trajectory gave none (None when none did); where no built-in loss reads
    # them (loss_mask 0) a null or non-finite input value is 0.0.
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    trajectory: torch.Tensor            # int64: the trajectory's index in the step (plan.step["ids"] order)
    position: torch.Tensor              # int64: the token's index within its trajectory (>= 1)
    loss_mask: torch.Tensor             # float64 0/1, as given
    # Step-level denominators (the whole step, every microbatch and rank alike): positions with weight > 0,
    # and trajectories with at least one.
    trained_positions: int
    trained_trajectories: int
    # With entropies on (`run_step(entropy=True)` or `entropy_coef` > 0): each position's predictive entropy,
    # float64 and differentiable (a custom objective may select tokens by it or weigh it); else None.
    entropy: torch.Tensor | None = None
    # Kind value only: the caller's returns and old values (float64, as given; None for old values without
    # value_clip). Untrained positions may hold anything (NaN included): the loss never reads them.
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None


# The caller's objective (`LossConfig(kind="custom", objective=...)`): this microbatch's share of the step
# objective, a scalar tensor computed with torch operations on `logprobs` (float64 [P], differentiable).
# NaN where `old_logprobs`/`ref_logprobs` were not given must be masked before use: weight 0 does not cancel
# a NaN, in the value or in its gradient.
Objective = Callable[[torch.Tensor, PositionMeta], torch.Tensor]


def check_objective_inputs(old_logprobs, ref_logprobs, weights: np.ndarray, config: LossConfig) -> None:
    """Refuse, before anything runs, a step the objective cannot be computed on (UsageError).

    `old_logprobs` / `ref_logprobs` are the step's flat arrays (None when no trajectory gave them, NaN
    where one did not) and `weights` its `position_weights`. ppo needs an old log-probability at every
    trained position (grpo treats a missing one as on-policy); a KL term needs reference
    log-probabilities somewhere. Checked on the whole step, not per microbatch: a refusal after some
    microbatches' backward would leave their gradients behind, and every data-parallel rank refuses alike.
    """
    trained = weights > 0
    if config.kind == "ppo" and trained.any() and (old_logprobs is None
                                                   or np.isnan(np.asarray(old_logprobs)[trained]).any()):
        raise UsageError("loss 'ppo' needs old_logprobs for every trained position; fix: give old_logprobs "
                         "(in trees.jsonl, or to compile_trajectories), or use loss grpo (on-policy)")
    if config.kind != "nll" and config.kl_coef and ref_logprobs is None:
        raise UsageError(f"--kl-coef {config.kl_coef} needs ref_logprobs, but the step has none; fix: give "
                         "ref_logprobs (in trees.jsonl, or to compile_trajectories), or set the KL weight to 0")


def check_value_inputs(returns, old_values, weights: np.ndarray, config: LossConfig, backward: bool = True) -> None:
    """Refuse, before anything runs, a critic step whose targets are missing where the loss reads them.

    `returns` / `old_values` are flat float64 arrays over the step's positions (or None); the value loss
    reads returns at every trained position, and old values there when `value_clip` is set. A forward
    pass without returns reads the values alone (the old values GAE needs), so old values given to it
    are refused as unread, as are targets given to a policy loss: either would be silently ignored.
    """
    if config.kind != VALUE:
        if returns is not None or old_values is not None:
            raise UsageError(f"returns and old_values are read by loss 'value' only, not '{config.kind}'; fix: pass "
                             "loss='value' to train a critic, or drop them")
        return
    if old_values is not None and config.value_clip is None:
        raise UsageError("old_values is given but value_clip is None, so nothing reads it; fix: set value_clip "
                         "(e.g. 0.2) to clip around them, or drop old_values")
    if returns is None and not backward:
        if old_values is not None:
            raise UsageError("old_values is given without returns, so nothing reads it (a forward pass without "
                             "returns gives the values alone); fix: give returns too, or drop old_values")
        return
    trained = weights > 0
    for name, given, needed in (("returns", returns, True), ("old_values", old_values, config.value_clip is not None)):
        if not needed:
            continue
        if given is None:
            why = "" if name == "returns" else f" (value_clip = {config.value_clip} clips around them)"
            raise UsageError(f"loss 'value' needs {name}{why}; fix: pass {name}=..., one float per token of "
                             "every trajectory" + (" (or backward=False for the values alone)" if name == "returns"
                                                   else ", or value_clip=None"))
        bad = np.flatnonzero(trained & ~np.isfinite(given))
        if len(bad):
            raise UsageError(f"{name} is {given[bad[0]]} at flat position {int(bad[0])}, which the value loss "
                             f"trains (loss_mask 1); fix: give a finite value at every trained position")


def value_loss(values_P: torch.Tensor, meta: PositionMeta, config: LossConfig) -> torch.Tensor:
    """This microbatch's share of the critic's loss: sum over its positions of weight x 0.5 (v - R)^2, or PPO's
    clipped 0.5 max((v - R)^2, (clip(v, old - c, old + c) - R)^2) with c = `value_clip`."""
    v = values_P.to(torch.float64)
    weight = meta.weight.to(torch.float64)
    trained = weight > 0
    # Untrained positions read v itself: weight 0 would not cancel a NaN target, in the loss or its gradient.
    target = torch.where(trained, meta.returns.to(torch.float64), v.detach())
    per_position = (v - target) ** 2
    if config.value_clip is not None:
        old = torch.where(trained, meta.old_values.to(torch.float64), v.detach())
        clipped = old + torch.clamp(v - old, -config.value_clip, config.value_clip)
        per_position = torch.maximum(per_position, (clipped - target) ** 2)
    return 0.5 * (per_position * weight).sum()


def policy_loss(logprobs_P: torch.Tensor, meta: PositionMeta, config: LossConfig) -> torch.Tensor:
    """This microbatch's share of the step loss: sum over its positions of weight x term, or the share the
    caller's objective returns (`config` is valid: LossConfig checks its fields on construction; the step
    passed `check_objective_inputs`)."""
    lam = logprobs_P.to(torch.float64)
    weight = meta.weight.to(torch.float64)
    if config.kind == "custom":
        return _custom_share(config.objective, lam, meta)
    if config.kind == "nll":
        per_position = -lam
    else:
        # grpo without an old log-probability is on-policy (ratio 1). Untrained positions get ratio 1 too,
        # whatever they hold: weight 0 would not cancel an inf or NaN ratio there, in the loss or its gradient.
        old = _where_trained(meta.old_logprobs, weight, lam.detach())
        ratio = torch.exp(lam - old)
        adv = meta.advantages.to(torch.float64)
        clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
        per_position = -torch.minimum(ratio * adv, clipped * adv)
        if config.kl_coef:   # check_objective_inputs made sure the step has ref_logprobs
            # Trajectories that gave no reference contribute no KL term (delta = 0), nor do untrained positions.
            delta = _where_trained(meta.ref_logprobs, weight, lam.detach()) - lam
            per_position = per_position + config.kl_coef * (torch.exp(delta) - delta - 1.0)
    return (per_position * weight).sum()


def _custom_share(objective: Objective, lam: torch.Tensor, meta: PositionMeta) -> torch.Tensor:
    """The caller's objective on one microbatch, as a float64 scalar; a UsageError (one line, the cause
    chained) when it raises, or returns what cannot be summed into the step objective or would silently
    train nothing. Where the microbatch has no trained position, any constant (0.0, a detached tensor) is
    a share that trains nothing."""
    try:
        value = objective(lam, meta)
    except UsageError:
        raise
    except Exception as err:   # the caller's code: name it and where it failed, in one line
        raise UsageError(f"the custom objective raised {_where(err)}{_entropy_hint(err, meta)}; fix: correct "
                         "the objective (the exception is chained to this error)") from err
    # Whether anything here is trained is read from the device only when the answer matters (a host sync).
    def trained() -> bool:
        return bool((meta.weight > 0).any())

    if not isinstance(value, bool) and isinstance(value, (int, float)) and not trained():
        value = torch.tensor(float(value), dtype=torch.float64, device=lam.device)
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else f"a {type(value).__name__}")
        raise UsageError(f"the custom objective returned {got}; fix: return this microbatch's share of the step "
                         "objective as one floating-point tensor element (e.g. (terms * inputs.weight).sum())")
    value = value.reshape(()).to(torch.float64)
    if lam.requires_grad and not value.requires_grad:
        if trained():
            raise UsageError("the custom objective returned a value with no gradient path to the log-probabilities "
                             "of a microbatch with trained positions (detached, or rebuilt from .item() or numpy); "
                             "fix: compute it with torch operations on the logprobs tensor it is given")
        value = value + lam.sum() * 0.0   # nothing trained here: a constant share that still runs the backward
    return value


def _where(err: Exception) -> str:
    """'Type: message (file:line)' of an exception, at the innermost frame that raised it."""
    frame = err.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    place = f" at {frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}" if frame is not None else ""
    message = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {message}{place}"


def _entropy_hint(err: Exception, meta: PositionMeta) -> str:
    if meta.entropy is None and isinstance(err, (TypeError, AttributeError)) and "NoneType" in str(err):
        return " (inputs.entropy, old_logprobs and ref_logprobs may be None: entropies need run(entropy=True), " \
               "harts run --entropy or an entropy_coef)"
    return ""


def _where_trained(given: torch.Tensor | None, weight: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """`given` (float64) at trained positions where it is a number, else `fallback`: a log-probability the loss
    may read, with no inf or NaN where it must not (0 x inf is NaN, and so would be the gradient)."""
    if given is None:
        return fallback
    given = given.to(torch.float64)
    return torch.where((weight > 0) & ~torch.isnan(given), given, fallback)
