"""Compact log-probability recovery against the plain [C, V] computation.

Run: `python -m pytest tests/test_op_logprobs.py -q`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.executor.ops.logprobs import (SuppliedNormalizers, naive_position_entropy, naive_position_logprobs,
                                        position_logprobs, position_logprobs_and_entropy, row_normalizers)


def case(seed, C=13, D=6, V=29, P=40, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(C, D, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    rows = torch.randint(0, C, (P,), generator=g)
    rows[:3] = 2                                  # one row read by several positions...
    labels = torch.randint(0, V, (P,), generator=g)
    labels[:2] = 5                                # ...two of them with the same label
    return hidden, weight, rows, labels


@pytest.mark.parametrize("block_rows", [1, 4, 13, 100], ids=lambda b: f"block{b}")
def test_matches_naive_values_and_gradients_float64(block_rows):
    hidden, weight, rows, labels = case(0)
    upstream = torch.randn(len(rows), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = position_logprobs(hidden, weight, rows, labels, block_rows=block_rows)
    want = naive_position_logprobs(hidden, weight, rows, labels)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    g_want = torch.autograd.grad((want * upstream).sum(), (hidden, weight))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("block_rows", [1, 3, 100], ids=lambda b: f"block{b}")
def test_positions_without_gradient_are_skipped_exactly(block_rows):
    """Masked positions (zero upstream gradient, as loss_mask 0 gives) leave gradients equal to the naive ones."""
    hidden, weight, rows, labels = case(3, C=17, P=50)
    upstream = torch.randn(len(rows), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    upstream[torch.arange(len(rows)) % 3 != 0] = 0.0          # two thirds of the positions carry no loss
    upstream[rows == 2] = 0.0                                  # and every position of row 2
    got = position_logprobs(hidden, weight, rows, labels, block_rows=block_rows)
    want = naive_position_logprobs(hidden, weight, rows, labels)
    g_got = torch.autograd.grad((got * upstream).sum(), (hidden, weight), retain_graph=True)
    g_want = torch.autograd.grad((want * upstream).sum(), (hidden, weight))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.all(g_got[0][2] == 0), "a row read by no loss position gets an exact zero gradient"
    no_loss = torch.autograd.grad((got * torch.zeros_like(upstream)).sum(), (hidden, weight))
    assert all(torch.all(g == 0) for g in no_loss)


def test_gradcheck():
    hidden, weight, rows, labels = case(2, C=5, D=3, V=7, P=9)
    assert torch.autograd.gradcheck(lambda h, w: position_logprobs(h, w, rows, labels, block_rows=2), (hidden, weight))


def test_bfloat16_inputs_compute_in_float32():
    hidden, weight, rows, labels = case(3, dtype=torch.float32)
    got = position_logprobs(hidden.bfloat16(), weight.bfloat16(), rows, labels)
    assert got.dtype == torch.float32
    want = naive_position_logprobs(hidden.bfloat16().float(), weight.bfloat16().float(), rows, labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_value_errors():
    hidden, weight, rows, labels = case(4)
    with pytest.raises(ValueError, match="hidden must be"):
        position_logprobs(hidden, weight[:, :2], rows, labels)
    with pytest.raises(ValueError, match="equal-length"):
        position_logprobs(hidden, weight, rows, labels[:3])


@pytest.mark.parametrize("block_rows", [1, 4, 100], ids=lambda b: f"block{b}")
def test_entropy_matches_naive_values_and_gradients_float64(block_rows):
    hidden, weight, rows, labels = case(5)
    g = torch.Generator().manual_seed(6)
    upstream, upstream_entropy = torch.randn(len(rows), dtype=torch.float64, generator=g), \
        torch.randn(len(rows), dtype=torch.float64, generator=g)
    upstream_entropy[::4] = 0.0                   # some positions' entropies carry no gradient
    upstream[1::3] = 0.0                          # and some log-probabilities none (rows live for one term only)
    got, entropy = position_logprobs_and_entropy(hidden, weight, rows, labels, block_rows=block_rows)
    want, want_entropy = naive_position_logprobs(hidden, weight, rows, labels), naive_position_entropy(hidden, weight, rows)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-12, atol=1e-12)
    g_got = torch.autograd.grad((got * upstream + entropy * upstream_entropy).sum(), (hidden, weight))
    g_want = torch.autograd.grad((want * upstream + want_entropy * upstream_entropy).sum(), (hidden, weight))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_entropy_gradcheck_and_unused_entropy_changes_nothing():
    hidden, weight, rows, labels = case(7, C=5, D=3, V=7, P=9)
    assert torch.autograd.gradcheck(
        lambda h, w: position_logprobs_and_entropy(h, w, rows, labels, block_rows=2), (hidden, weight))
    # Entropies computed but left out of the loss: the gradient is position_logprobs' own.
    upstream = torch.randn(len(rows), dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    with_entropy, _ = position_logprobs_and_entropy(hidden, weight, rows, labels)
    alone = position_logprobs(hidden, weight, rows, labels)
    g_with = torch.autograd.grad((with_entropy * upstream).sum(), (hidden, weight))
    g_alone = torch.autograd.grad((alone * upstream).sum(), (hidden, weight))
    for a, b in zip(g_with, g_alone):
        assert torch.equal(a, b)


def test_entropy_of_a_uniform_head_is_log_vocabulary():
    hidden = torch.zeros(3, 4, dtype=torch.float64)
    weight = torch.randn(11, 4, dtype=torch.float64)
    _, entropy = position_logprobs_and_entropy(hidden, weight, torch.tensor([0, 2]), torch.tensor([1, 5]))
    torch.testing.assert_close(entropy, torch.full((2,), float(np.log(11.0)), dtype=torch.float64))


@pytest.mark.parametrize("block_rows", [1, 4, 100], ids=lambda b: f"block{b}")
def test_row_normalizers_match_naive_values_and_gradients_float64(block_rows):
    """lse and entropy per listed row (a row listed twice gets two entries), with their gradients;
    rows whose upstream gradients are both zero contribute exactly nothing."""
    hidden, weight, _, _ = case(9)
    rows = torch.tensor([4, 0, 7, 4, 12, 3])
    compute = hidden @ weight.T
    want_lse = torch.logsumexp(compute[rows], dim=-1)
    want_entropy = naive_position_entropy(hidden, weight, rows)
    lse, entropy = row_normalizers(hidden, weight, rows, with_entropy=True, block_rows=block_rows)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-12, atol=1e-12)
    g = torch.Generator().manual_seed(10)
    up, up_entropy = torch.randn(6, dtype=torch.float64, generator=g), torch.randn(6, dtype=torch.float64, generator=g)
    up[2] = up_entropy[2] = 0.0            # row 7: no gradient at all
    up_entropy[1] = 0.0                    # row 0: the normalizer's only
    g_got = torch.autograd.grad((lse * up + entropy * up_entropy).sum(), (hidden, weight))
    g_want = torch.autograd.grad((want_lse * up + want_entropy * up_entropy).sum(), (hidden, weight))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.all(g_got[0][7] == 0)
    lse_only, no_entropy = row_normalizers(hidden, weight, rows, block_rows=block_rows)
    assert no_entropy.numel() == 0 and torch.equal(lse_only, lse)
    assert torch.autograd.gradcheck(lambda h, w: row_normalizers(h, w, rows, with_entropy=True, block_rows=2),
                                    (hidden[:, :3].detach().clone().requires_grad_(), weight[:9, :3].detach().clone()
                                     .requires_grad_()))


@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprobs", "entropy"])
def test_supplied_normalizers_give_the_naive_values_and_gradients(with_entropy):
    """Positions whose row normalizers come from elsewhere (a window producer's, computed from a
    different tensor) get label logit minus the supplied normalizer; gradients reach both tensors."""
    hidden, weight, rows, labels = case(11)
    source = hidden.detach().clone().requires_grad_()       # stands in for the producer's hidden rows
    given = torch.tensor([0, 1, 5, 6, 17, 39])            # includes positions sharing row 2 (0, 1)
    lse, entropy = row_normalizers(source, weight, rows[given], with_entropy=with_entropy)
    supplied = SuppliedNormalizers(given, lse, entropy if with_entropy else None)
    g = torch.Generator().manual_seed(12)
    up, up_entropy = torch.randn(len(rows), dtype=torch.float64, generator=g), \
        torch.randn(len(rows), dtype=torch.float64, generator=g)
    up[5] = 0.0
    if with_entropy:
        got, got_entropy = position_logprobs_and_entropy(hidden, weight, rows, labels, block_rows=3, supplied=supplied)
        objective = (got * up + got_entropy * up_entropy).sum()
    else:
        got = position_logprobs(hidden, weight, rows, labels, block_rows=3, supplied=supplied)
        objective = (got * up).sum()
    want = naive_position_logprobs(hidden, weight, rows, labels)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    reference = hidden.detach().clone().requires_grad_()
    want_objective = (naive_position_logprobs(reference, weight, rows, labels) * up).sum()
    if with_entropy:
        want_entropy = naive_position_entropy(reference, weight, rows)
        torch.testing.assert_close(got_entropy, want_entropy.detach(), rtol=1e-12, atol=1e-12)
        want_objective = want_objective + (want_entropy * up_entropy).sum()
    g_hidden, g_source, g_weight = torch.autograd.grad(objective, (hidden, source, weight))
    g_ref, g_ref_weight = torch.autograd.grad(want_objective, (reference, weight))
    # Split between the two hidden tensors, the gradient sums to the reference's.
    torch.testing.assert_close(g_hidden + g_source, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_weight, g_ref_weight, rtol=1e-10, atol=1e-12)
    assert torch.count_nonzero(g_source[rows[given]].sum(-1)) > 0, "the supplied normalizers carry gradient"
    with pytest.raises(ValueError, match="carry none"):
        position_logprobs_and_entropy(hidden, weight, rows, labels, supplied=SuppliedNormalizers(given, lse, None))
