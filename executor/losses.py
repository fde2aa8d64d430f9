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

All use the token-mean reduction: divide by the number of positions i >= 1 with
loss_mask 1 over the whole step (contract section 3).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOSSES = ("nll", "grpo", "ppo")


@dataclass(frozen=True, slots=True)
class LossConfig:
    kind: str = "nll"          # nll | grpo | ppo
    clip_low: float = 0.2      # eps_low: ratio clipped below at 1 - clip_low
    clip_high: float = 0.2     # eps_high: ratio clipped above at 1 + clip_high
    kl_coef: float = 0.0       # weight of the k3 KL estimate against ref_logprobs (0: off)
    moe_aux_coef: float = 0.0  # weight of the MoE load-balancing loss (0: reported only)
    moe_z_coef: float = 0.0    # weight of the router z-loss (0: reported only)


@dataclass(frozen=True, slots=True)
class PositionMeta:
    """Per-position inputs of the objective (tensors of length P, float64 where real)."""

    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None   # NaN where a trajectory gave none
    ref_logprobs: torch.Tensor | None


def policy_loss(logprobs_P: torch.Tensor, meta: PositionMeta, config: LossConfig, denominator: float) -> torch.Tensor:
    if config.kind not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {config.kind!r}")
    lam = logprobs_P.to(torch.float64)
    mask = meta.mask.to(torch.float64)
    if config.kind == "nll":
        per_position = -lam
    else:
        old = meta.old_logprobs
        if old is None or bool(torch.isnan(old[mask > 0]).any()):
            if config.kind == "ppo":
                raise ValueError("loss 'ppo' needs old_logprobs for every trained position; "
                                 "fix: give old_logprobs in trees.jsonl, or use --loss grpo (on-policy)")
            old = lam.detach() if old is None else torch.where(torch.isnan(old), lam.detach(), old)
        ratio = torch.exp(lam - old.to(torch.float64))
        adv = meta.advantages.to(torch.float64)
        clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
        per_position = -torch.minimum(ratio * adv, clipped * adv)
        if config.kl_coef:
            if meta.ref_logprobs is None:
                raise ValueError(f"--kl-coef {config.kl_coef} needs ref_logprobs, but the step has none; "
                                 "fix: give ref_logprobs in trees.jsonl, or drop --kl-coef")
            ref = meta.ref_logprobs.to(torch.float64)
            # Trajectories that gave no reference contribute no KL term (delta = 0).
            delta = torch.where(torch.isnan(ref), lam.detach(), ref) - lam
            per_position = per_position + config.kl_coef * (torch.exp(delta) - delta - 1.0)
    return (per_position * mask).sum() / denominator
