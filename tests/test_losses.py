"""Loss reductions: weights over the whole step, checked by hand and across execution modes.

Run: `python -m pytest tests/test_losses.py -q`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.executor.losses import REDUCTIONS, LossConfig, position_weights
from harts.executor.models.init_model import kimi_linear_config
from harts.executor.runtime import run_step

from fidelity import compile_lists

# Two trajectories: lengths 4 and 3; masks [1,1,1,0] and [1,1,1] (index 0 is never a target).
MASK = np.array([1, 1, 1, 0, 1, 1, 1], dtype=np.uint8)
OFFSETS = np.array([0, 4, 7])


@pytest.mark.parametrize("reduction, expected", [
    ("token-mean", [0, 1 / 4, 1 / 4, 0, 0, 1 / 4, 1 / 4]),
    ("seq-mean-token-mean", [0, 1 / 4, 1 / 4, 0, 0, 1 / 4, 1 / 4]),
    ("seq-mean-token-sum", [0, 1 / 2, 1 / 2, 0, 0, 1 / 2, 1 / 2]),
])
def test_weights_by_hand(reduction, expected):
    np.testing.assert_allclose(position_weights(MASK, OFFSETS, reduction), expected)


def test_sequence_mean_weighs_trajectories_equally():
    mask = np.array([1, 1, 1, 1, 1, 1, 1], dtype=np.uint8)   # 3 trained positions, then 2
    weights = position_weights(mask, OFFSETS, "seq-mean-token-mean")
    np.testing.assert_allclose(weights, [0, 1 / 6, 1 / 6, 1 / 6, 0, 1 / 4, 1 / 4])
    np.testing.assert_allclose(position_weights(mask, OFFSETS, "token-mean"), [0, .2, .2, .2, 0, .2, .2])


def test_unknown_reduction_is_a_value_error():
    with pytest.raises(ValueError, match="reduction must be one of"):
        position_weights(MASK, OFFSETS, "mean")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_reduction_is_the_same_compact_expanded_and_split_over_microbatches(reduction):
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(0)
    model = KimiLinearForCausalLM(kimi_linear_config("tiny", 64)).float().eval()
    rng = np.random.default_rng(0)
    base = list(rng.integers(3, 64, 30))
    lists = [base[:n] + list(rng.integers(3, 64, 4)) for n in (5, 12, 12, 20, 26)]
    advantages = rng.normal(size=len(lists))
    loss = LossConfig("grpo", reduction=reduction)
    whole = run_step(compile_lists(lists, chunk_size=4, capacity=200, advantages=advantages), model, loss=loss)
    split_plan = compile_lists(lists, chunk_size=4, capacity=40, advantages=advantages)
    assert len(split_plan.microbatches) > 1
    for plan, mode in ((split_plan, "compact"), (split_plan, "expanded")):
        other = run_step(plan, model, loss=loss, mode=mode)
        assert abs(other.loss - whole.loss) <= 1e-9 * max(1.0, abs(whole.loss))
        for name, grad in whole.grads.items():
            torch.testing.assert_close(other.grads[name], grad, rtol=1e-4, atol=1e-7)
