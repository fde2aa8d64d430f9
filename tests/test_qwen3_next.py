"""The Qwen3-Next runner against references nobody here wrote.

Run: `python -m pytest tests/test_qwen3_next.py -q` (about a minute on 2 cores).

* Compact log-probabilities and `nll` gradients against the Hugging Face
  `Qwen3NextForCausalLM`'s own forward/backward run on one trajectory at a
  time (unmodified transformers code, its torch fallbacks included: Gated
  DeltaNet chunk core, causal conv, sdpa attention, grouped_mm experts), on a
  tree with forks on, just before and just after chunk boundaries, a
  duplicate, strict prefixes, short segments and an unrelated trajectory.
* Compact, node-wise and expanded execution of the same plan against each
  other: log-probabilities, gradients of every objective, MoE statistics.
* `harts init-model --arch qwen3_next` writes a directory `harts run` loads.

The tiny model has grouped heads everywhere (Gated DeltaNet: 2 key heads,
4 value heads; attention: 4 query heads, 2 kv heads), partial RoPE (4 of 16
channels), a dense first layer and MoE with a shared expert after it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from harts.executor.losses import LossConfig
from harts.executor.models.hf_reference import trajectory_logprobs
from harts.executor.models.registry import runner_for
from harts.executor.runtime import run_step

from fidelity import (VOCAB, check_expert_loads_count_every_occurrence, check_float32_gradients_as_accurate_as_transformers,
                      check_matches_hugging_face, check_modes_agree,
                      check_random_forest_compact_equals_expanded, check_recomputation_keeps_gradients_and_statistics,
                      compile_lists, gradient_floor, hf_reference, relative_error, small_forests, tiny_qwen3_next)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_next()


def test_tiny_preset_has_the_structure_the_tests_rely_on(model):
    config = model.config
    assert config.model_type == "qwen3_next"
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    assert config.linear_num_key_heads < config.linear_num_value_heads
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.rope_parameters["partial_rotary_factor"] < 1
    assert not hasattr(model.model.layers[0].mlp, "experts")
    assert all(hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "shared_expert")
               for layer in model.model.layers[1:])
    assert type(runner_for(model)).__name__ == "Qwen3NextRunner"


def test_compact_matches_the_hugging_face_model_run_per_trajectory(model):
    check_matches_hugging_face(model)


def test_float32_gradients_are_as_accurate_as_the_hugging_face_models_own(model):
    check_float32_gradients_as_accurate_as_transformers(model)


@pytest.mark.parametrize("mode", ["expanded", "nodewise"])
def test_other_modes_agree_with_compact_on_every_objective(model, mode):
    check_modes_agree(model, mode)


def test_expert_loads_count_every_occurrence(model):
    check_expert_loads_count_every_occurrence(model)


def test_router_statistics_use_the_softmax_router(model):
    """Expanded, one trajectory: the occurrence-weighted sums are the plain per-token sums
    of the HF router's own outputs (softmax probabilities, top-k hits, logsumexp^2)."""
    tokens = list(np.random.default_rng(4).integers(3, VOCAB, 40))
    plan = compile_lists([tokens])
    logits = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o, index=index: logits.__setitem__(index, o))
             for index, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    loss = LossConfig("nll", moe_aux_coef=1.0, moe_z_coef=0.0)
    result = run_step(plan, model, loss=loss, backward=False)
    num_experts, top_k, n = model.config.num_experts, model.config.num_experts_per_tok, len(tokens)
    want_aux = 0.0
    for index, (router_logits, _, topk_index) in logits.items():
        hits = torch.zeros(n, num_experts, dtype=torch.float64).scatter_(1, topk_index, 1.0)
        np.testing.assert_array_equal(result.moe_load[index], hits.sum(0).numpy())
        f = hits.sum(0) / (top_k * n)
        p = torch.softmax(router_logits.double(), dim=-1).mean(0)
        want_aux += float(num_experts * (f * p).sum())
    assert abs(result.moe_aux_loss - want_aux) <= 1e-5


def test_recomputation_gives_the_same_gradients_and_statistics(model):
    check_recomputation_keeps_gradients_and_statistics(model)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(small_forests(), st.sampled_from([2, 4, 8]), st.integers(1, 2))
def test_random_trees_compact_equals_expanded(model, lists, chunk_size, dp):
    # A forest of two-token trajectories only is the degenerate case of the next test: the
    # last layer's k_proj gradient is zero in exact arithmetic and float noise that exceeds
    # the floor; it is measured there against the reference's exact zero.
    assume(max(len(t) for t in lists) >= 3)
    check_random_forest_compact_equals_expanded(model, lists, chunk_size, dp)


def test_a_gradient_that_is_zero_in_exact_arithmetic_is_float_noise(model):
    """Two-token trajectories: only row 0's last-layer output is read (it predicts token 1),
    and row 0 attends to itself alone, so the last full-attention layer's key projection
    gets no gradient in exact arithmetic; HF's sdpa backward returns exactly 0. Our
    flash-style backward computes dS = P (dP - rowsum(dO O)) with P = 1, a cancellation of
    O(|dO| |v|) terms, and k_norm's 1 / rms(k) scales the leftover up, so the result is
    float noise of a few 1e-8 of the largest gradient: above the 1e-8 that
    `gradient_floor` allows for such parameters, far below any signal."""
    lists = [[3, 3], [3, 3]]
    result = run_step(compile_lists(lists, chunk_size=2, capacity=32), model)
    _, want_grads = hf_reference(model, lists)
    largest = max(float(g.norm()) for g in want_grads.values())
    floor = gradient_floor(want_grads)
    for name, want in want_grads.items():
        if float(want.norm()) == 0.0:
            assert float(result.grads[name].norm()) <= 1e-6 * largest, name
        else:
            assert relative_error(result.grads[name], want, floor) <= 1e-4, name


def test_init_model_cli_writes_a_model_harts_run_loads(tmp_path):
    from harts.cli import main as harts
    from harts.executor.cli import load_model

    assert harts(["init-model", "--arch", "qwen3_next", "--preset", "tiny", "--vocab-size", "64",
                  "-o", str(tmp_path / "model")]) == 0
    loaded = load_model(str(tmp_path / "model"))
    assert loaded.config.model_type == "qwen3_next"
    lists = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12]]
    result = run_step(compile_lists(lists, chunk_size=4), loaded, backward=False)
    with torch.no_grad():
        for i, tokens in enumerate(lists):
            want = trajectory_logprobs(loaded, tokens).numpy()
            assert np.max(np.abs(result.logprobs[str(i)][1:] - want)) <= 1e-5
