"""Custom objectives for `harts run --objective examples/objectives.py:NAME` or `harts.api.run(loss=...)`.

Each function gets one microbatch's differentiable log-probabilities (float64
[P]) and their `harts.api.PositionMeta`, and returns that microbatch's share
of the step objective. Both are sums over trajectories, so the shares add up
to the step objective exactly (docs/input-contract.md#custom-objectives);
`tests/test_custom_objective.py` checks them against their definitions on the
Hugging Face model run one trajectory at a time.
"""
from __future__ import annotations

import torch


def gspo(logprobs: torch.Tensor, inputs, eps: float = 0.2) -> torch.Tensor:
    """GSPO: -1/G sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i) over the G trajectories of the step
    with a trained position, s_i = exp(mean of (logprob - old) over trajectory i's trained positions) and
    A_i the mean of its advantages there (one per trajectory in GRPO). A trajectory without old_logprobs is
    on-policy (s_i = 1)."""
    trained = inputs.weight > 0
    old = inputs.old_logprobs if inputs.old_logprobs is not None else torch.full_like(logprobs, float("nan"))
    old = torch.where(old.isnan(), logprobs.detach(), old)   # none given: on-policy, ratio 1
    log_ratio = torch.where(trained, logprobs - old, 0.0)
    ids, local = torch.unique(inputs.trajectory, return_inverse=True)
    zeros = torch.zeros(len(ids), dtype=torch.float64, device=logprobs.device)
    count = zeros.index_add(0, local, trained.to(torch.float64))
    ratio = torch.exp(zeros.index_add(0, local, log_ratio) / count.clamp(min=1))
    # A_i: the mean advantage over i's trained positions (GRPO gives one per trajectory; frameworks often store
    # it per token, 0 where masked, so untrained positions must not be read).
    advantage = zeros.index_add(0, local, torch.where(trained, inputs.advantages, 0.0)) / count.clamp(min=1)
    term = -torch.minimum(ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage)
    return torch.where(count > 0, term, 0.0).sum() / max(inputs.trained_trajectories, 1)


def reinforce_tis(logprobs: torch.Tensor, inputs, cap: float = 2.0) -> torch.Tensor:
    """REINFORCE with truncated importance weights: sum of -min(exp(logprob - old), cap) A logprob x weight,
    the importance weight held constant (detached); positions without an old log-probability weigh 1."""
    trained = inputs.weight > 0
    old = inputs.old_logprobs if inputs.old_logprobs is not None else torch.full_like(logprobs, float("nan"))
    old = torch.where(trained & ~old.isnan(), old, logprobs.detach())   # untrained or missing: weight 1
    importance = torch.exp(logprobs.detach() - old).clamp(max=cap)
    return -(importance * inputs.advantages * logprobs * inputs.weight).sum()

