"""Tests of the short causal depthwise convolution over compact rows (executor/ops/short_conv).

Run (CPU, a few seconds):

    python -m pytest tests/test_op_short_conv.py -q

Why these tests: KDA and Gated DeltaNet convolve q, k, v over the last W
positions before the recurrence. Over compact rows that window must be the
row's ancestors, not the rows stored before it, or a fork's first tokens would
read another branch (paper, Section 3.4: "bounded local operators use true
ancestor context"). So the gather path is checked against F.conv1d run on each
expanded trajectory (outputs and gradients, float64) in two row orders, one of
which interleaves branches, and against transformers' own KDA / Gated DeltaNet
conv on one trajectory (float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.passes.build_trie import build_trie, global_layout
from harts.executor.ops.short_conv import conv_context, naive_short_conv, short_conv

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


MEMBER_KEYS = ("member_own_start", "member_run_offsets", "run_row_start", "run_length")


def tree_arrays(token_lists, row_order: str = "creation", seed: int = 0) -> dict:
    """row_parent and member runs of one tree; "depth_major" sorts rows by (depth, random) so siblings interleave."""
    batch = TrajectoryBatch.from_token_lists(token_lists)
    layout = global_layout(build_trie(batch), batch)
    parent = layout.row_parent.astype(np.int64)
    paths = [layout.member_rows(i) for i in range(len(layout.trajectories))]
    if row_order == "depth_major":
        order = np.lexsort((np.random.default_rng(seed).random(len(parent)), layout.row_depth))
        new_of_old = np.empty_like(order)
        new_of_old[order] = np.arange(len(order))
        parent = np.where(parent[order] >= 0, new_of_old[np.maximum(parent[order], 0)], -1)
        paths = [new_of_old[p] for p in paths]
    # One run per position is a valid (if wasteful) run encoding: fine for tests.
    return {
        "row_parent": parent,
        "member_own_start": layout.member_lcp,
        "member_run_offsets": np.concatenate(([0], np.cumsum([len(p) for p in paths]))),
        "run_row_start": np.concatenate(paths),
        "run_length": np.ones(sum(len(p) for p in paths), dtype=np.int64),
        "paths": paths,
    }


def random_tree(seed: int) -> list[list[int]]:
    """Forks at random points, duplicates and a strict prefix; tokens from a tiny vocab."""
    rng = np.random.default_rng(seed)
    lists = [rng.integers(0, 3, 12).tolist()]
    for _ in range(6):
        parent = lists[int(rng.integers(len(lists)))]
        cut = int(rng.integers(0, len(parent) + 1))
        lists.append(parent[:cut] + rng.integers(0, 3, int(rng.integers(1, 9))).tolist())
    lists += [list(lists[0]), lists[0][:5]]
    return [t if len(t) >= 2 else t + [1, 2] for t in lists]


def test_conv_context_walks_ancestors_not_memory_neighbours():
    #      0 -> 1 -> 2 -> 3          rows 4, 5 fork below row 1; row 6 is a second root
    #           1 -> 4 -> 5
    row_parent = np.array([-1, 0, 1, 2, 1, 4, -1])
    expected = torch.tensor([
        [-1, -1, -1, 0], [-1, -1, 0, 1], [-1, 0, 1, 2], [0, 1, 2, 3], [-1, 0, 1, 4], [0, 1, 4, 5], [-1, -1, -1, 6],
    ])
    assert torch.equal(conv_context(row_parent, 4), expected)
    assert torch.equal(conv_context(torch.from_numpy(row_parent), 2), expected[:, 2:])
    assert torch.equal(conv_context(row_parent, 1), torch.arange(7)[:, None])


@pytest.mark.parametrize("layout", ["nn_conv1d", "kernel"], ids=str)
@pytest.mark.parametrize("activation", ["silu", None], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("taps", [1, 2, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("order", ["creation", "depth_major"], ids=str)
def test_gather_matches_naive_in_float64(order, taps, bias, activation, layout):
    arrays = tree_arrays(random_tree(seed=taps), order, seed=taps)
    num_rows, channels = len(arrays["row_parent"]), 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_rows, channels, generator=gen, dtype=torch.float64, requires_grad=True)
    shape = (channels, 1, taps) if layout == "nn_conv1d" else (channels, taps)
    weight = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(channels, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    leaves = (x, weight) + ((b,) if bias else ())
    dy = torch.randn(num_rows, channels, generator=gen, dtype=torch.float64)

    fast = short_conv(x, weight, b, conv_context(arrays["row_parent"], taps), activation)
    spec = naive_short_conv(x, weight, b, *(arrays[key] for key in MEMBER_KEYS), activation=activation)
    torch.testing.assert_close(fast, spec, rtol=0, atol=1e-12)
    for g_fast, g_spec in zip(torch.autograd.grad(fast, leaves, dy), torch.autograd.grad(spec, leaves, dy)):
        torch.testing.assert_close(g_fast, g_spec, rtol=0, atol=1e-12)


@pytest.mark.parametrize("order", ["creation", "depth_major"], ids=str)
def test_windows_of_some_rows_read_every_row(order):
    """A window consumer convolves only its uncached rows, whose windows reach into cached rows:
    outputs and gradients equal the full op's on those rows (the spec is checked above)."""
    arrays = tree_arrays(random_tree(seed=4), order, seed=4)
    num_rows = len(arrays["row_parent"])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_rows, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    context = conv_context(arrays["row_parent"], 4)
    rows = torch.from_numpy(np.flatnonzero(np.random.default_rng(0).random(num_rows) < 0.5))
    dy = torch.randn(len(rows), 5, generator=gen, dtype=torch.float64)
    some = short_conv(x, w, None, context[rows])
    every = short_conv(x, w, None, context)
    torch.testing.assert_close(some, every.detach()[rows], rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(some, (x, w), dy), torch.autograd.grad(every[rows], (x, w), dy)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_gradcheck():
    arrays = tree_arrays(random_tree(seed=7), "depth_major")
    gen = torch.Generator().manual_seed(1)
    num_rows = len(arrays["row_parent"])
    x = torch.randn(num_rows, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    context = conv_context(arrays["row_parent"], 4)
    assert torch.autograd.gradcheck(lambda x, w, b: short_conv(x, w, b, context), (x, w, b))


def test_bfloat16_computes_in_float32():
    arrays = tree_arrays(random_tree(seed=3))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(len(arrays["row_parent"]), 6, generator=gen)
    w = torch.randn(6, 4, generator=gen)
    context = conv_context(arrays["row_parent"], 4)
    y = short_conv(x.bfloat16(), w.bfloat16(), None, context)
    reference = short_conv(x.bfloat16().float(), w.bfloat16().float(), None, context)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference.bfloat16(), rtol=0, atol=0)


# ---------------------------------------------------------------- transformers' modules


def _capture_conv(module_namespace, monkeypatch):
    """Wrap the module's `causal_conv1d_fn` (the torch fallback on CPU) to record its input and output."""
    calls = []
    original = module_namespace.causal_conv1d_fn

    def recording(hidden_states, *args, **kwargs):
        out = original(hidden_states, *args, **kwargs)
        calls.append((hidden_states.detach().clone(), out.detach().clone()))
        return out

    monkeypatch.setattr(module_namespace, "causal_conv1d_fn", recording)
    return calls


def _kimi_linear_layer():
    from transformers.models.kimi_linear import modeling_kimi_linear as ns
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    config = KimiLinearConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, linear_num_heads=2,
                              linear_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention"])
    layer = ns.KimiLinearDeltaAttention(config, layer_idx=0)
    torch.nn.init.normal_(layer.forget_gate.dt_bias)
    torch.nn.init.normal_(layer.forget_gate.A_log)
    return ns, layer


def _qwen3_next_layer():
    from transformers.models.qwen3_next import modeling_qwen3_next as ns
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    config = Qwen3NextConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention"])
    return ns, ns.Qwen3NextGatedDeltaNet(config, layer_idx=0)


@pytest.mark.parametrize("model", ["kimi_linear", "qwen3_next"], ids=str)
def test_matches_the_transformers_layer_on_one_trajectory(model, monkeypatch):
    """Run the real layer's forward on a trajectory and compare its conv output with ours on that path."""
    torch.manual_seed(0)
    ns, layer = {"kimi_linear": _kimi_linear_layer, "qwen3_next": _qwen3_next_layer}[model]()
    calls = _capture_conv(ns, monkeypatch)
    with torch.no_grad():
        layer(torch.randn(1, 23, 32))
    assert len(calls) == 1
    x_1CT, y_1CT = calls[0]
    # A single trajectory in compact rows: row r's parent is r - 1.
    context = conv_context(np.arange(-1, x_1CT.shape[-1] - 1), layer.conv1d.weight.shape[-1])
    with torch.no_grad():
        y_TC = short_conv(x_1CT[0].T, layer.conv1d.weight, layer.conv1d.bias, context, layer.activation)
    torch.testing.assert_close(y_TC, y_1CT[0].T, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("case", ["x_1d", "weight_channels", "weight_3d_bad", "bias_shape", "context_shape",
                                  "context_float", "context_range", "activation", "int_x"])
def test_inputs_are_validated(case):
    x, w, b = torch.randn(5, 3), torch.randn(3, 4), torch.randn(3)
    context = conv_context(np.array([-1, 0, 1, 2, 1]), 4)
    args = dict(x=x, weight=w, bias=b, context=context, activation="silu")
    args.update({
        "x_1d": dict(x=x[:, 0]),
        "weight_channels": dict(weight=torch.randn(2, 4)),
        "weight_3d_bad": dict(weight=torch.randn(3, 2, 4)),
        "bias_shape": dict(bias=torch.randn(4)),
        "context_shape": dict(context=context[:, 1:]),
        "context_float": dict(context=context.double()),
        "context_range": dict(context=context + 5),
        "activation": dict(activation="gelu"),
        "int_x": dict(x=x.long()),
    }[case])
    with pytest.raises(ValueError):
        short_conv(**args)


@pytest.mark.parametrize("row_parent", [np.array([-1, 1]), np.array([-1, -2]), np.array([[0]]), np.array([0.5])],
                         ids=["self_parent", "below_minus_one", "two_dim", "float"])
def test_conv_context_rejects_bad_parents(row_parent):
    with pytest.raises(ValueError):
        conv_context(row_parent, 4)
