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
from dataclasses import dataclass

import numpy as np
import torch

from harts.schema.errors import UsageError

LOSSES = ("nll", "grpo", "ppo")
REDUCTIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True, slots=True)
class LossConfig:
    """The objective of a step; every instance holds legal values (checked on construction).

    Invariants: `kind` in LOSSES, `reduction` in REDUCTIONS, 0 <= clip_low < 1
    (the lower clip bound 1 - clip_low stays positive, as a ratio is),
    clip_high >= 0, the three coefficients finite and >= 0, and kl_coef 0
    for nll (which has no KL term). A NaN or an
    infinity here would silently turn the loss and every gradient into NaN,
    so it is refused with a ValueError that names the field, its `harts run`
    flag and the fix.
    """

    kind: str = "nll"          # nll | grpo | ppo
    clip_low: float = 0.2      # eps_low: ratio clipped below at 1 - clip_low
    clip_high: float = 0.2     # eps_high: ratio clipped above at 1 + clip_high
    kl_coef: float = 0.0       # weight of the k3 KL estimate against ref_logprobs (0: off)
    moe_aux_coef: float = 0.0  # weight of the MoE load-balancing loss (0: reported only)
    moe_z_coef: float = 0.0    # weight of the router z-loss (0: reported only)
    reduction: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum

    def __post_init__(self) -> None:
        _check_choice("kind", "--loss", self.kind, LOSSES)
        _check_choice("reduction", "--reduction", self.reduction, REDUCTIONS)
        _check_number("clip_low", self.clip_low, upper=1.0,
                      fix="pass --clip-low in [0, 1), e.g. 0.2 (the ratio is clipped below at 1 - clip_low)")
        _check_number("clip_high", self.clip_high, fix="pass --clip-high >= 0, e.g. 0.2 or 0.28")
        for name in ("kl_coef", "moe_aux_coef", "moe_z_coef"):
            _check_number(name, getattr(self, name), fix=f"pass {_flag(name)} >= 0 (0 turns the term off)")
        if self.kind == "nll" and self.kl_coef:
            raise UsageError(f"LossConfig.kl_coef (--kl-coef) = {self.kl_coef!r} has no effect with kind 'nll' "
                             "(the KL term belongs to the grpo/ppo policy loss); fix: set kl_coef to 0, or pick "
                             "kind 'grpo' or 'ppo'")


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
    """Per-position inputs of the objective (tensors of length P, float64 where real)."""

    weight: torch.Tensor                # reduction weight per position (0: not trained)
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None   # NaN where a trajectory gave none
    ref_logprobs: torch.Tensor | None


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


def policy_loss(logprobs_P: torch.Tensor, meta: PositionMeta, config: LossConfig) -> torch.Tensor:
    """This microbatch's share of the step loss: sum over its positions of weight x term
    (`config` is valid: LossConfig checks its fields on construction; the step passed
    `check_objective_inputs`)."""
    lam = logprobs_P.to(torch.float64)
    weight = meta.weight.to(torch.float64)
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


def _where_trained(given: torch.Tensor | None, weight: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """`given` (float64) at trained positions where it is a number, else `fallback`: a log-probability the loss
    may read, with no inf or NaN where it must not (0 x inf is NaN, and so would be the gradient)."""
    if given is None:
        return fallback
    given = given.to(torch.float64)
    return torch.where((weight > 0) & ~torch.isnan(given), given, fallback)
