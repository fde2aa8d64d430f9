"""The RL objective and the MoE terms against formulas written here, on the HF model run per trajectory.

Run: `python -m pytest tests/test_objective_reference.py -q` (about 20 s on 2 cores).

tests/fidelity.py checks log-probabilities and NLL gradients against Hugging
Face; this file checks what HARTS builds on top of them. The reference runs
the unmodified HF model on one trajectory at a time, evaluates the objective
from its definition (docs/input-contract.md: the clipped surrogate, the k3 KL
estimate, the three reductions; the Switch load-balancing loss over Kimi's
normalised sigmoid scores and the router z-loss), position by position in
plain Python, and differentiates it with autograd. HARTS must report the same
loss and MoE terms and leave the same gradients.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harts.api import compile_trajectories
from harts.executor.losses import LossConfig
from harts.executor.models.hf_reference import trajectory_logprobs
from harts.executor.runtime import run_step

from fidelity import boundary_tree, gradient_floor, relative_error, tiny_kimi_linear

CLIP_LOW, CLIP_HIGH, KL_COEF = 0.2, 0.28, 0.05


@pytest.fixture(scope="module")
def model():
    return tiny_kimi_linear()


@pytest.fixture(scope="module")
def step(model):
    """Trajectories with masks, per-token advantages of both signs, and old/ref log-probabilities
    perturbed from the current ones so that ratios fall inside and outside the clip range."""
    rng = np.random.default_rng(7)
    lists = boundary_tree(rng)
    with torch.no_grad():
        current = [trajectory_logprobs(model, t).numpy().astype(np.float64) for t in lists]
    masks, advantages, old, ref = [], [], [], []
    for tokens, lp in zip(lists, current):
        n = len(tokens)
        mask = (rng.random(n) < 0.7).astype(int)
        mask[-1] = 1
        masks.append(mask.tolist())
        advantages.append(rng.normal(0.0, 1.0, n).tolist())
        old.append([0.0] + (lp + rng.normal(0.0, 0.35, n - 1)).tolist())
        ref.append([0.0] + (lp + rng.normal(0.0, 0.5, n - 1)).tolist())
    return dict(lists=lists, masks=masks, advantages=advantages, old=old, ref=ref)


def reference_objective(lp_of, data, reduction: str, kind: str) -> torch.Tensor:
    """The step objective from its definition, one trained position at a time."""
    per_trajectory = []     # (sum of terms, trained count) per trajectory
    for i, tokens in enumerate(data["lists"]):
        lp = lp_of[i]
        terms, count = [], 0
        for t in range(1, len(tokens)):
            if not data["masks"][i][t]:
                continue
            count += 1
            current = lp[t - 1]
            if kind == "nll":
                terms.append(-current)
                continue
            ratio = torch.exp(current - data["old"][i][t])
            advantage = data["advantages"][i][t]
            clipped = torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
            surrogate = torch.minimum(ratio * advantage, clipped * advantage)
            if kind == "grpo-no-kl":
                terms.append(-surrogate)
                continue
            log_ratio_ref = data["ref"][i][t] - current
            kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1
            terms.append(-surrogate + KL_COEF * kl)
        per_trajectory.append((sum(terms, torch.zeros((), dtype=torch.float64)), count))
    return reduce_trajectories(per_trajectory, reduction)


def reduce_trajectories(per_trajectory, reduction: str) -> torch.Tensor:
    """The step value from each trajectory's (sum over trained positions, trained count), by the reduction."""
    if reduction == "token-mean":
        return sum(s for s, _ in per_trajectory) / sum(c for _, c in per_trajectory)
    active = [(s, c) for s, c in per_trajectory if c > 0]
    if reduction == "seq-mean-token-sum":
        return sum(s for s, _ in active) / len(active)
    return sum(s / c for s, c in active) / len(active)


def hf_objective_and_grads(model, data, reduction, kind):
    model.zero_grad(set_to_none=True)
    lp_of = [trajectory_logprobs(model, t).to(torch.float64) for t in data["lists"]]
    objective = reference_objective(lp_of, data, reduction, kind)
    objective.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(objective.detach()), grads


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_policy_objective_matches_the_definition_on_hugging_face(model, step, kind, reduction):
    plan = compile_trajectories(step["lists"], loss_masks=step["masks"], advantages=step["advantages"],
                                old_logprobs=step["old"], ref_logprobs=step["ref"], capacity=4096)
    config = LossConfig(kind=kind, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=KL_COEF, reduction=reduction)
    result = run_step(plan, model, loss=config)
    want, want_grads = hf_objective_and_grads(model, step, reduction, kind)
    # The perturbation must put ratios on both sides of the clip range, or clipping goes untested.
    ratios = np.exp(np.concatenate([np.asarray(result.logprobs[str(i)][1:], np.float64) - np.asarray(o[1:])
                                    for i, o in enumerate(step["old"])]))
    assert (ratios < 1 - CLIP_LOW).any() and (ratios > 1 + CLIP_HIGH).any()
    assert result.loss == pytest.approx(want, rel=1e-5, abs=1e-7)
    floor = gradient_floor(want_grads)
    worst = max((relative_error(result.grads[n], g, floor), n) for n, g in want_grads.items())
    assert worst[0] <= 1e-4, worst


def reduce_like_the_loss(per_position_of, data, reduction: str) -> torch.Tensor:
    """A per-position quantity (index t >= 1 of trajectory i) reduced over the trained positions as the loss is."""
    sums = []
    for i, tokens in enumerate(data["lists"]):
        trained = [t for t in range(1, len(tokens)) if data["masks"][i][t]]
        sums.append((sum((per_position_of[i][t - 1] for t in trained), torch.zeros((), dtype=torch.float64)),
                     len(trained)))
    return reduce_trajectories(sums, reduction)


@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("shape", [dict(capacity=4096), dict(capacity=170, dp=2)], ids=["one-microbatch", "dp2-windows"])
def test_entropy_bonus_matches_the_definition_on_hugging_face(model, step, reduction, shape):
    # H = -sum_v p log p of each trained position's predictive distribution, from the HF model's full logits.
    coef = 0.05
    plan = compile_trajectories(step["lists"], loss_masks=step["masks"], advantages=step["advantages"],
                                old_logprobs=step["old"], **shape)
    assert len(plan.microbatches) >= shape.get("dp", 1) and (shape.get("dp") is None or plan.producers)
    config = LossConfig(kind="grpo", clip_low=CLIP_LOW, clip_high=CLIP_HIGH, entropy_coef=coef, reduction=reduction)
    result = run_step(plan, model, loss=config)
    model.zero_grad(set_to_none=True)
    lp_of, entropy_of = [], []
    for tokens in step["lists"]:
        logits = model(input_ids=torch.as_tensor(tokens)[None]).logits[0, :-1].to(torch.float64)
        logp = torch.log_softmax(logits, dim=-1)
        lp_of.append(logp.gather(1, torch.as_tensor(tokens[1:])[:, None])[:, 0])
        entropy_of.append(-(logp.exp() * logp).sum(dim=-1))
    policy = reference_objective(lp_of, dict(step, ref=step["old"]), reduction, "grpo-no-kl")
    entropy = reduce_like_the_loss(entropy_of, step, reduction)
    (policy - coef * entropy).backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert result.entropy == pytest.approx(float(entropy.detach()), rel=1e-5)
    policy, entropy = float(policy.detach()), float(entropy.detach())
    assert result.loss == pytest.approx(policy, rel=1e-5, abs=1e-7)
    assert result.objective == pytest.approx(policy - coef * entropy, rel=1e-5, abs=1e-7)
    floor = gradient_floor(want_grads)
    worst = max((relative_error(result.grads[n], g, floor), n) for n, g in want_grads.items())
    assert worst[0] <= 1e-4, worst
    # Without the bonus the entropy term's share of the gradient is real: the gradients differ.
    plain = run_step(plan, model, loss=LossConfig(kind="grpo", clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                                                  reduction=reduction), entropy=True)
    assert plain.entropy == pytest.approx(result.entropy, rel=1e-9)
    assert max(relative_error(plain.grads[n], g, floor) for n, g in want_grads.items()) > 1e-3


def test_nll_with_masks_matches_the_definition(model, step):
    plan = compile_trajectories(step["lists"], loss_masks=step["masks"], capacity=4096)
    result = run_step(plan, model, loss=LossConfig(kind="nll"))
    want, want_grads = hf_objective_and_grads(model, step, "token-mean", "nll")
    assert result.loss == pytest.approx(want, rel=1e-5)
    floor = gradient_floor(want_grads)
    assert max(relative_error(result.grads[n], g, floor) for n, g in want_grads.items()) <= 1e-4


def _hf_router_outputs(model, lists):
    """Per MoE layer, per trajectory: the HF router's logits (with grad) and its top-k experts."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    captured: dict[int, list] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        for module in layer.modules():
            if isinstance(module, KimiLinearTopkRouter):
                hooks.append(module.register_forward_hook(
                    lambda _m, _inputs, out, index=index: captured.setdefault(index, []).append((out[0], out[2]))))
    try:
        lp_of = [trajectory_logprobs(model, t).to(torch.float64) for t in lists]
    finally:
        for hook in hooks:
            hook.remove()
    return lp_of, captured


@pytest.mark.parametrize("capacity", [4096, 256])
def test_moe_terms_and_loads_match_the_definition_on_hugging_face(model, step, capacity):
    """moe_aux = sum over layers of E sum_e f_e P_e, moe_z = sum over layers of mean logsumexp^2,
    f_e = top-k hits / (k tokens), P_e = mean normalised sigmoid score, per microbatch (every token of
    its trajectories counts once), then averaged over the step's microbatches (capacity 256: several)."""
    lists = step["lists"]
    plan = compile_trajectories(lists, capacity=capacity)
    assert (len(plan.microbatches) == 1) == (capacity == 4096)
    # Which input trajectories (by position in `lists`) each microbatch holds.
    groups = [[int(plan.step["ids"][t]) for t in mb["member_trajectory"]] for mb in plan.microbatches]
    aux_coef, z_coef = 0.3, 0.02
    result = run_step(plan, model, loss=LossConfig(kind="nll", moe_aux_coef=aux_coef, moe_z_coef=z_coef))

    model.zero_grad(set_to_none=True)
    lp_of, routers = _hf_router_outputs(model, lists)
    assert routers, "the tiny model has MoE layers"
    top_k = model.config.num_experts_per_token
    aux = torch.zeros((), dtype=torch.float64)
    z = torch.zeros((), dtype=torch.float64)
    for index, outputs in routers.items():
        all_hits = 0
        for group in groups:
            logits = torch.cat([outputs[i][0] for i in group]).to(torch.float64)     # [tokens, E]
            chosen = torch.cat([outputs[i][1] for i in group])                         # [tokens, k]
            num_experts = logits.shape[1]
            hits = torch.zeros(num_experts, dtype=torch.float64)
            for row in chosen.tolist():
                for expert in row:
                    hits[expert] += 1
            all_hits = all_hits + hits
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=1, keepdim=True)
            f = hits / (top_k * logits.shape[0])
            aux = aux + num_experts * (f * probs.mean(dim=0)).sum() / len(groups)
            z = z + (torch.logsumexp(logits, dim=1) ** 2).mean() / len(groups)
        np.testing.assert_array_equal(result.moe_load[index], all_hits.numpy(), err_msg=f"layer {index} loads")
    nll = -sum(lp.sum() for lp in lp_of) / sum(len(t) - 1 for t in lists)
    (nll + aux_coef * aux + z_coef * z).backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    aux, z, nll = float(aux.detach()), float(z.detach()), float(nll.detach())
    assert result.moe_aux_loss == pytest.approx(aux, rel=1e-5)
    assert result.moe_z_loss == pytest.approx(z, rel=1e-5)
    assert result.objective == pytest.approx(nll + aux_coef * aux + z_coef * z, rel=1e-5)
    assert math.isclose(result.loss, nll, rel_tol=1e-5)
    floor = gradient_floor(want_grads)
    worst = max((relative_error(result.grads[n], g, floor), n) for n, g in want_grads.items())
    assert worst[0] <= 1e-4, worst
