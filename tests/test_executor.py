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
from harts.executor.runtime import run_step

from fidelity import (boundary_tree, check_expert_loads_count_every_occurrence, check_matches_hugging_face,
                      check_modes_agree, compile_lists, gradient_floor, relative_error, small_forests, tiny_kimi_linear)


@pytest.fixture(scope="module")
def model():
    return tiny_kimi_linear()


def test_compact_matches_the_hugging_face_model_run_per_trajectory(model):
    check_matches_hugging_face(model)


@pytest.mark.parametrize("mode", ["expanded", "nodewise"])
def test_other_modes_agree_with_compact_on_every_objective(model, mode):
    check_modes_agree(model, mode)


def test_expert_loads_count_every_occurrence(model):
    check_expert_loads_count_every_occurrence(model)


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
