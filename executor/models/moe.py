"""Occurrence-weighted MoE router statistics, shared by every model runner.

Legend: R rows, E experts, k top-k.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MoEStatistics:
    """Occurrence-weighted router statistics, summed over rows (and microbatches).

    With weight q_r = how many semantic positions share row r, each sum equals
    the sum over trajectory-expanded positions:
    `tokens` = sum q_r; `load[l, e]` = sum q_r [e in topk(r)];
    `prob_mass[l, e]` = sum q_r p_r[e] with p_r the router's normalised scores;
    `z_sum[l]` = sum q_r logsumexp(router_logits_r)^2.
    `prob_mass` and `z_sum` carry gradients.
    """

    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    load: dict = field(default_factory=dict)
    prob_mass: dict = field(default_factory=dict)
    z_sum: dict = field(default_factory=dict)

    def add(self, layer: int, weight_R, router_logits_RE, topk_index_Rk, probs_RE=None) -> None:
        """Record one layer's routing of R rows. `probs_RE` are the router's routing
        probabilities for the load-balancing term; default: normalised sigmoid
        scores (Kimi Linear's router). A softmax router passes its softmax."""
        weight = weight_R.to(router_logits_RE.dtype)
        if probs_RE is None:
            scores = router_logits_RE.sigmoid()
            probs_RE = scores / scores.sum(dim=-1, keepdim=True)
        hits = torch.zeros_like(router_logits_RE, dtype=torch.float64).scatter_(1, topk_index_Rk, 1.0)
        load = (hits * weight_R[:, None].to(torch.float64)).sum(0).detach()
        mass = (probs_RE.to(weight.dtype) * weight[:, None]).sum(0)
        z = (weight * torch.logsumexp(router_logits_RE, dim=-1).square()).sum()
        self.load[layer] = self.load.get(layer, 0) + load
        self.prob_mass[layer] = self.prob_mass.get(layer, 0) + mass
        self.z_sum[layer] = self.z_sum.get(layer, 0) + z

    def aux_loss(self, top_k: int) -> torch.Tensor:
        """Switch-style load-balancing loss summed over layers: E * sum_e f_e P_e."""
        total = torch.zeros(())
        for layer, load in self.load.items():
            num_experts = load.shape[0]
            f = load / (top_k * self.tokens)
            p = self.prob_mass[layer] / self.tokens.to(self.prob_mass[layer].dtype)
            total = total + num_experts * (f.to(p.dtype) * p).sum()
        return total

    def z_loss(self) -> torch.Tensor:
        return sum((z / self.tokens.to(z.dtype) for z in self.z_sum.values()), torch.zeros(()))
