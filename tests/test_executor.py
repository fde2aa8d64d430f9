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

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts.api as api
from harts.executor.losses import LossConfig
from harts.executor.runtime import run_step

from fidelity import (check_expert_loads_count_every_occurrence, check_float32_gradients_as_accurate_as_transformers,
                      check_loss_positions_only_keep_the_step, check_matches_hugging_face, check_modes_agree,
                      check_random_forest_compact_equals_expanded, check_recomputation_keeps_gradients_and_statistics,
                      compile_lists, small_forests, tiny_kimi_linear)


@pytest.fixture(scope="module")
def model():
    return tiny_kimi_linear()


def test_compact_matches_the_hugging_face_model_run_per_trajectory(model):
    check_matches_hugging_face(model)


def test_float32_gradients_are_as_accurate_as_the_hugging_face_models_own(model):
    check_float32_gradients_as_accurate_as_transformers(model)


@pytest.mark.parametrize("mode", ["expanded", "nodewise"])
def test_other_modes_agree_with_compact_on_every_objective(model, mode):
    check_modes_agree(model, mode)


def test_expert_loads_count_every_occurrence(model):
    check_expert_loads_count_every_occurrence(model)


def test_recovering_only_loss_positions_keeps_the_step(model):
    check_loss_positions_only_keep_the_step(model)


def test_ppo_without_old_logprobs_is_a_clear_error(model):
    plan = compile_lists([[5, 6, 7], [5, 6, 8]])
    with pytest.raises(ValueError, match="needs old_logprobs"):
        run_step(plan, model, loss=LossConfig("ppo"))


def test_a_forward_under_inference_mode_does_not_break_later_training(model):
    # Frameworks compute behaviour log-probabilities under torch.inference_mode(); nothing it creates may be
    # cached and reused by a later training step of the same geometry (inference tensors cannot be saved
    # for backward).
    plan = api.compile_trajectories([list(range(3, 60)), list(range(3, 40))], advantages=[1.0, -1.0])
    with torch.inference_mode():
        behaviour = run_step(plan, model, backward=False)
    trained = run_step(plan, model, loss=LossConfig("grpo"))
    for key, values in behaviour.logprobs.items():
        torch.testing.assert_close(torch.from_numpy(trained.logprobs[key]), torch.from_numpy(values), equal_nan=True)
    assert all(torch.isfinite(g).all() for g in trained.grads.values())
    model.zero_grad(set_to_none=True)


def test_a_step_the_objective_cannot_use_is_refused_before_any_gradient(model):
    # The last of three microbatches lacks old log-probabilities: ppo must refuse the step before the
    # first backward, or the caller's .grad would hold part of a step it was told failed.
    plan = api.compile_trajectories([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], capacity=4,
                                    old_logprobs=[[0.0, -1.0, -1.0, -1.0]] * 2 + [None])
    assert len(plan.microbatches) == 3
    before = {name: torch.full_like(p, 7.0) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = before[name].clone()
    with pytest.raises(ValueError, match="needs old_logprobs"):
        run_step(plan, model, loss=LossConfig("ppo"))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        run_step(plan, model, loss=LossConfig("grpo", kl_coef=0.1))
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, before[name]), name
    model.zero_grad(set_to_none=True)


def test_ppo_on_a_step_with_nothing_trained_needs_no_old_logprobs(model):
    plan = api.compile_trajectories([[5, 6, 7], [5, 6, 8]], loss_masks=[[0, 0, 0], [0, 0, 0]])
    result = run_step(plan, model, loss=LossConfig("ppo"))
    assert result.loss == 0.0 and all(float(g.abs().max()) == 0.0 for g in result.grads.values())
    model.zero_grad(set_to_none=True)


def test_gradients_are_the_grad_tensors_of_trainable_parameters_only(model):
    plan = api.compile_trajectories([[5, 6, 7, 8], [5, 6, 9]])
    frozen = model.model.embed_tokens.weight
    frozen.requires_grad_(False)
    try:
        result = run_step(plan, model)
    finally:
        frozen.requires_grad_(True)
    named = dict(model.named_parameters())
    assert "model.embed_tokens.weight" not in result.grads
    assert set(result.grads) == {n for n, p in named.items() if p is not frozen}
    # No model-sized copy: each entry is the parameter's .grad (zeros only where no row reached it).
    assert all(g.data_ptr() == named[n].grad.data_ptr() for n, g in result.grads.items() if named[n].grad is not None)
    model.zero_grad(set_to_none=True)


def test_accumulate_adds_a_plans_gradient_to_what_grad_holds(model):
    first = api.compile_trajectories([[5, 6, 7, 8], [5, 6, 9]], advantages=[1.0, -0.5])
    second = api.compile_trajectories([[10, 11, 12], [10, 11, 13, 14]], advantages=[0.5, 2.0])
    alone = [{n: g.clone() for n, g in run_step(plan, model, loss=LossConfig("grpo")).grads.items()}
             for plan in (first, second)]
    run_step(first, model, loss=LossConfig("grpo"))
    summed = run_step(second, model, loss=LossConfig("grpo"), accumulate=True)
    for name, grad in summed.grads.items():
        torch.testing.assert_close(grad, alone[0][name] + alone[1][name], rtol=1e-6, atol=1e-9)
    model.zero_grad(set_to_none=True)


def test_a_wrapped_model_is_one_clear_error(model):
    wrapper = torch.nn.Module()
    wrapper.module = model   # what DistributedDataParallel and similar wrappers look like
    with pytest.raises(ValueError, match=r"wrapped \(Module\).*model\.module"):
        run_step(api.compile_trajectories([[5, 6, 7]]), wrapper)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(small_forests(), st.sampled_from([2, 4, 8]), st.integers(1, 2))
def test_random_trees_compact_equals_expanded(model, lists, chunk_size, dp):
    check_random_forest_compact_equals_expanded(model, lists, chunk_size, dp)


def test_recomputation_gives_the_same_gradients_and_statistics(model):
    check_recomputation_keeps_gradients_and_statistics(model)
