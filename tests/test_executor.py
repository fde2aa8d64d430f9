"""The executor against references nobody here wrote.

Run: `python -m pytest tests/test_executor.py -q` (about a minute on 2 cores).

* Compact log-probabilities and `nll` gradients against the Hugging Face
  model's own forward/backward run on one trajectory at a time (unmodified
  transformers code, its torch fallbacks included), on a tree with forks on,
  just before and just after chunk boundaries, a duplicate, strict prefixes,
  short segments and an unrelated trajectory.
* Compact, node-wise and expanded execution of the same plan against each
  other: log-probabilities, gradients of every objective, MoE statistics.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts.executor.losses import LossConfig
from harts.executor.models.init_model import kimi_linear_config
from harts.executor.runtime import run_step

from fidelity import (VOCAB, boundary_tree, compile_lists, gradient_floor, hf_reference, relative_error,
                      small_forests)


@pytest.fixture(scope="module")
def model():
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(0)
    model = KimiLinearForCausalLM(kimi_linear_config("tiny", VOCAB)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return model


def test_compact_matches_the_hugging_face_model_run_per_trajectory(model):
    lists = boundary_tree(np.random.default_rng(0))
    plan = compile_lists(lists)
    mb = plan.microbatches[0]
    assert len(mb["replay_rows"]) > 0 and len(mb["export_row"]) > 0 and mb["num_rounds"] >= 2
    result = run_step(plan, model, mode="compact")
    want_logprobs, want_grads = hf_reference(model, lists)
    for i, want in enumerate(want_logprobs):
        got = result.logprobs[str(i)]
        assert np.isnan(got[0])
        assert np.max(np.abs(got[1:] - want)) <= 1e-5, f"trajectory {i}"
    assert set(result.grads) == set(want_grads) == {n for n, _ in model.named_parameters()} - {
        n for n, p in model.named_parameters() if p.grad is None and n not in want_grads}
    floor = gradient_floor(want_grads)
    worst = max((relative_error(result.grads[n], g, floor), n) for n, g in want_grads.items())
    assert worst[0] <= 1e-4, worst


@pytest.mark.parametrize("mode", ["expanded", "nodewise"])
def test_other_modes_agree_with_compact_on_every_objective(model, mode):
    rng = np.random.default_rng(1)
    lists = boundary_tree(rng)
    old = rng.normal(-3.0, 0.5, sum(len(t) for t in lists))
    plan = compile_lists(lists, advantages=rng.normal(size=len(lists)), old=old)
    for loss in (LossConfig("nll", moe_aux_coef=0.01, moe_z_coef=0.001), LossConfig("ppo", kl_coef=0.0),
                 LossConfig("grpo")):
        compact = run_step(plan, model, mode="compact", loss=loss)
        other = run_step(plan, model, mode=mode, loss=loss, pack_expanded=False)
        assert abs(compact.loss - other.loss) <= 1e-5 * max(1.0, abs(compact.loss))
        assert abs(compact.moe_aux_loss - other.moe_aux_loss) <= 1e-6
        assert abs(compact.moe_z_loss - other.moe_z_loss) <= 1e-5
        for layer, load in compact.moe_load.items():
            np.testing.assert_allclose(load, other.moe_load[layer], rtol=0, atol=0)
        floor = gradient_floor(compact.grads)
        for name, grad in compact.grads.items():
            assert relative_error(other.grads[name], grad, floor) <= 1e-4, (loss.kind, name)
        for key, lp in compact.logprobs.items():
            assert np.nanmax(np.abs(lp - other.logprobs[key])) <= 1e-5


def test_expert_loads_count_every_occurrence(model):
    lists = boundary_tree(np.random.default_rng(2))
    plan = compile_lists(lists)
    result = run_step(plan, model, mode="compact", backward=False)
    top_k = model.config.num_experts_per_tok
    for load in result.moe_load.values():
        assert load.sum() == top_k * sum(len(t) for t in lists)


def test_ppo_without_old_logprobs_is_a_clear_error(model):
    plan = compile_lists([[5, 6, 7], [5, 6, 8]])
    with pytest.raises(ValueError, match="needs old_logprobs"):
        run_step(plan, model, loss=LossConfig("ppo"))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(small_forests(), st.sampled_from([2, 4, 8]), st.integers(1, 2))
def test_random_trees_compact_equals_expanded(model, lists, chunk_size, dp):
    dp = min(dp, len(lists))
    plan = compile_lists(lists, chunk_size=chunk_size, dp=dp, capacity=max(len(t) for t in lists) + 30)
    compact = run_step(plan, model, mode="compact")
    expanded = run_step(plan, model, mode="expanded")   # packed under the plan's capacity
    for key, lp in compact.logprobs.items():
        assert np.nanmax(np.abs(lp - expanded.logprobs[key])) <= 1e-5
    floor = gradient_floor(compact.grads)
    for name, grad in compact.grads.items():
        assert relative_error(expanded.grads[name], grad, floor) <= 1e-4, name


def test_recomputation_gives_the_same_gradients_and_statistics(model):
    lists = boundary_tree(np.random.default_rng(3))
    plan = compile_lists(lists)
    loss = LossConfig("nll", moe_aux_coef=0.01, moe_z_coef=0.001)
    plain = run_step(plan, model, loss=loss)
    recomputed = run_step(plan, model, loss=loss, recompute=True)
    assert recomputed.loss == plain.loss and recomputed.moe_aux_loss == plain.moe_aux_loss
    for layer, load in plain.moe_load.items():
        np.testing.assert_array_equal(recomputed.moe_load[layer], load)
    for name, grad in plain.grads.items():
        torch.testing.assert_close(recomputed.grads[name], grad, rtol=1e-6, atol=1e-9)
