"""Loss reductions: weights over the whole step, checked by hand and across execution modes.

Run: `python -m pytest tests/test_losses.py -q`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.executor.losses import REDUCTIONS, LossConfig, PositionMeta, policy_loss, position_weights
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


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
@pytest.mark.parametrize("junk", [np.nan, -1e30, 1e30], ids=["nan", "minus-1e30", "plus-1e30"])
def test_untrained_positions_cannot_poison_the_loss_or_its_gradient(kind, junk):
    # What an untrained position holds is never read: a trajectory without old_logprobs whose loss_mask is all
    # zeros (NaN there), or a placeholder far from any log-probability. Weight 0 does not cancel inf or NaN,
    # so the loss must equal the loss over the trained positions alone, with a finite gradient.
    weights = position_weights(MASK, OFFSETS, "token-mean")
    trained = weights > 0
    old = np.where(trained, -1.25, junk)
    ref = np.where(trained, -1.5, junk)
    logprobs = torch.linspace(-2.0, -0.5, len(MASK), dtype=torch.float64, requires_grad=True)

    def loss_of(keep):
        trajectory = np.searchsorted(OFFSETS, np.arange(len(MASK)), side="right") - 1
        meta = PositionMeta(weight=torch.tensor(weights[keep]), advantages=torch.linspace(-1, 1, len(MASK))[keep],
                            old_logprobs=torch.tensor(old[keep]), ref_logprobs=torch.tensor(ref[keep]),
                            trajectory=torch.tensor(trajectory[keep]),
                            position=torch.tensor((np.arange(len(MASK)) - np.asarray(OFFSETS)[trajectory])[keep]),
                            loss_mask=torch.tensor(np.asarray(MASK, dtype=np.float64)[keep]),
                            trained_positions=int(trained.sum()), trained_trajectories=2)
        return policy_loss(logprobs[keep], meta, LossConfig(kind=kind, kl_coef=0.1))

    loss = loss_of(np.ones(len(MASK), dtype=bool))
    (gradient,) = torch.autograd.grad(loss, logprobs)
    assert torch.isfinite(loss) and torch.isfinite(gradient).all()
    torch.testing.assert_close(loss, loss_of(trained))
    assert torch.all(gradient[~torch.from_numpy(trained)] == 0)
