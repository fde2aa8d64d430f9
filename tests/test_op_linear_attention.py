"""Tests of the packed chunkwise gated delta rule (executor/ops/linear_attention).

Run (CPU, a few seconds):

    python -m pytest tests/test_op_linear_attention.py -q

Why these tests: the executor runs each linear-attention layer of a rollout tree
as a few packed calls (rounds). Training on the compact tree is exact only if
one call computes the model's own function on every sequence (against the
token-by-token spec and transformers' fallbacks), keeps the sequences of a
round apart, and hands states from call to call differentiably; with replay on
an unchanged chunk grid the hand-off must even be bitwise, since that is what
replay is for (paper, Sections 2.2 and 3.3).
"""

from __future__ import annotations

import sys

import pytest
import torch

from harts.executor.ops.linear_attention import chunk_linear_attention, naive_linear_attention
from harts.executor.ops.linear_attention.chunk import subchunk_size

GATES = ["channel", "scalar"]
CHUNK_SIZES = [4, 8, 16]


def layout_lengths(name: str, chunk: int) -> list[int]:
    """Sequence lengths of a round, named by what they exercise."""
    return {
        "short": [1, chunk - 1, 2],  # every sequence shorter than one chunk
        "multiples": [chunk, 2 * chunk, 3 * chunk],  # exact multiples: no padding at all
        "mixed": [3, 2 * chunk + 1, 5 * chunk, 1, 4 * chunk - 1],  # short, partial, long
    }[name]


LAYOUTS = ["short", "multiples", "mixed"]


def make_round(lengths, gate, dtype=torch.float64, seed=0, heads=2, qk_heads=2, key_dim=6, value_dim=5):
    """Leaf tensors of one round; non-zero initial states; gates in the models' range (g <= 0, beta in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_seqs = sum(lengths), len(lengths)

    def leaf(*shape, fn=torch.randn):
        return fn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    g_shape = (num_tokens, heads, key_dim) if gate == "channel" else (num_tokens, heads)
    return dict(
        q=leaf(num_tokens, qk_heads, key_dim),
        k=leaf(num_tokens, qk_heads, key_dim),
        v=leaf(num_tokens, heads, value_dim),
        g=(-1.5 * torch.rand(*g_shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_(),
        beta=leaf(num_tokens, heads, fn=torch.rand),
        cu_seqlens=torch.tensor([0, *lengths]).cumsum(0),
        initial_state=(0.5 * torch.randn(num_seqs, heads, key_dim, value_dim, generator=gen, dtype=torch.float64))
        .to(dtype)
        .requires_grad_(),
    )


def some_exports(lengths, chunk, seed=0):
    """For every non-empty sequence: its first chunk, a middle one, its final state and one duplicate; shuffled."""
    pairs = []
    for s, n in enumerate(lengths):
        num_chunks = -(-n // chunk)
        if num_chunks:
            pairs += [(s, c) for c in sorted({1, (num_chunks + 1) // 2, num_chunks})]
    pairs.append(pairs[-1])
    perm = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    pairs = [pairs[i] for i in perm]
    return torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])


def run(fn, inputs, export_seq, export_chunk, chunk, **kw):
    return fn(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], inputs["cu_seqlens"],
        inputs["initial_state"], export_seq, export_chunk, chunk_size=chunk, use_qk_l2norm_in_kernel=True, **kw,
    )


LEAVES = ["q", "k", "v", "g", "beta", "initial_state"]


def grads_of(outputs, wrt, seed=1):
    """Gradients of a fixed random linear function of the outputs."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)).sum() for x in outputs)
    return torch.autograd.grad(loss, wrt)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) if b.numel() else 0.0


I = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731


# 1. chunk == naive (float64): outputs, exported states, gradients of every input.


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk", CHUNK_SIZES, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("gate", GATES)
def test_chunk_matches_naive(gate, chunk, layout):
    lengths = layout_lengths(layout, chunk)
    inputs = make_round(lengths, gate)
    export_seq, export_chunk = some_exports(lengths, chunk)
    wrt = [inputs[n] for n in LEAVES]
    o, ex = run(chunk_linear_attention, inputs, export_seq, export_chunk, chunk)
    o_ref, ex_ref = run(naive_linear_attention, inputs, export_seq, export_chunk, chunk)
    assert o.dtype == ex.dtype == torch.float64
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(ex, ex_ref) < 1e-10
    for name, got, want in zip(LEAVES, grads_of([o, ex], wrt), grads_of([o_ref, ex_ref], wrt)):
        assert rel_err(got, want) < 1e-10, name


@pytest.mark.parametrize("gate", GATES)
def test_grouped_heads_custom_scale_no_l2norm(gate):
    """HK < H (Qwen3-Next's grouped value heads), an explicit scale, raw q/k of small norm."""
    lengths, chunk = [5, 17, 8], 8
    inputs = make_round(lengths, gate, heads=4, qk_heads=2)
    with torch.no_grad():
        inputs["k"].mul_(0.3)  # keeps beta * |k|^2 < 2, where the raw delta rule is stable
    export_seq, export_chunk = some_exports(lengths, chunk)
    kw = dict(chunk_size=chunk, scale=0.7, use_qk_l2norm_in_kernel=False)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")]
    o, ex = chunk_linear_attention(*args, export_seq, export_chunk, **kw)
    o_ref, ex_ref = naive_linear_attention(*args, export_seq, export_chunk, **kw)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(ex, ex_ref) < 1e-10
    wrt = [inputs[n] for n in LEAVES]
    for name, got, want in zip(LEAVES, grads_of([o, ex], wrt), grads_of([o_ref, ex_ref], wrt)):
        assert rel_err(got, want) < 1e-10, name


@pytest.mark.parametrize("chunk", [1, 2, 3, 6, 12, 64])
def test_odd_chunk_sizes_per_channel(chunk):
    """Sub-chunking of the per-channel gate for chunk sizes that are not 4, 8, 16."""
    assert chunk % subchunk_size(chunk) == 0
    lengths = [1, 2 * chunk + 1, 70]
    inputs = make_round(lengths, "channel")
    export_seq, export_chunk = some_exports(lengths, chunk)
    o, ex = run(chunk_linear_attention, inputs, export_seq, export_chunk, chunk)
    o_ref, ex_ref = run(naive_linear_attention, inputs, export_seq, export_chunk, chunk)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(ex, ex_ref) < 1e-10


@pytest.mark.parametrize("gate", GATES)
def test_strong_decay_does_not_overflow(gate):
    """Gates as large as Kimi's can be (-exp(A_log) * softplus: tens per token): no inf, no NaN."""
    lengths, chunk = [40, 9], 16
    inputs = make_round(lengths, gate, dtype=torch.float32)
    with torch.no_grad():
        inputs["g"].mul_(60.0)
    export_seq, export_chunk = some_exports(lengths, chunk)
    o, ex = run(chunk_linear_attention, inputs, export_seq, export_chunk, chunk)
    o_ref, ex_ref = run(naive_linear_attention, inputs, export_seq, export_chunk, chunk)
    wrt = [inputs[n] for n in LEAVES]
    assert all(torch.isfinite(x).all() for x in (o, ex, *grads_of([o, ex], wrt)))
    assert rel_err(o, o_ref) < 1e-5 and rel_err(ex, ex_ref) < 1e-5


# 2. A packed round computes each sequence as if it ran alone.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("chunk", [4, 16], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("gate", GATES)
def test_packed_round_equals_sequences_alone(gate, chunk, dtype):
    """Bitwise on CPU: nothing of one sequence reaches another, padding included."""
    lengths = [3, 2 * chunk + 1, 0, 5 * chunk, 1, 4 * chunk - 1, chunk]  # an empty sequence, too
    inputs = make_round(lengths, gate, dtype=dtype)
    num_chunks = [-(-n // chunk) for n in lengths]
    has_state = [s for s, n in enumerate(num_chunks) if n]
    o, final = run(chunk_linear_attention, inputs, I(*has_state), I(*[num_chunks[s] for s in has_state]), chunk)
    bounds = inputs["cu_seqlens"].tolist()
    for i, s in enumerate(has_state):
        a, b = bounds[s], bounds[s + 1]
        alone = {n: inputs[n][a:b] for n in ("q", "k", "v", "g", "beta")}
        alone.update(cu_seqlens=I(0, b - a), initial_state=inputs["initial_state"][s : s + 1])
        o_alone, final_alone = run(chunk_linear_attention, alone, I(0), I(num_chunks[s]), chunk)
        assert torch.equal(o[a:b], o_alone), s
        assert torch.equal(final[i], final_alone[0]), s


@pytest.mark.parametrize("fn", [chunk_linear_attention, naive_linear_attention], ids=["chunk", "naive"])
def test_empty_round_and_no_exports(fn):
    """Rounds the planner can emit at the edges: only empty sequences; no state requested."""
    empty = make_round([0, 0], "scalar")
    o, ex = run(fn, empty, I(), I(), 4)
    assert o.shape == (0, 2, 5) and ex.shape == (0, 2, 6, 5)
    inputs = make_round([3, 9], "channel")
    o, ex = run(fn, inputs, I(), I(), 4)
    assert o.shape == (12, 2, 5) and ex.shape == (0, 2, 6, 5)
    # Without exports the outputs are those of the same round with every final state exported.
    o_exported, _ = run(naive_linear_attention, inputs, I(0, 1), I(1, 3), 4)
    assert rel_err(o, o_exported) < 1e-10


def test_initial_state_none_is_zeros():
    inputs = make_round([5, 12], "channel")
    o, ex = run(chunk_linear_attention, {**inputs, "initial_state": None}, I(0, 1), I(2, 3), 4)
    o0, ex0 = run(chunk_linear_attention, {**inputs, "initial_state": torch.zeros_like(inputs["initial_state"])},
                  I(0, 1), I(2, 3), 4)
    assert torch.equal(o, o0) and torch.equal(ex, ex0)


# 3. Hand-off between calls.


def _slice(inputs, a, b, initial_state):
    part = {n: inputs[n][a:b] for n in ("q", "k", "v", "g", "beta")}
    part.update(cu_seqlens=I(0, b - a), initial_state=initial_state)
    return part


def _pack(*parts):
    """One round of several single-sequence parts."""
    packed = {n: torch.cat([p[n] for p in parts]) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    packed["cu_seqlens"] = torch.tensor([0] + [len(p["q"]) for p in parts]).cumsum(0)
    return packed


@pytest.mark.parametrize("split_chunks", [1, 3])
@pytest.mark.parametrize("gate", GATES)
def test_handoff_at_chunk_boundary(gate, split_chunks):
    """One call == two calls split at a chunk boundary, the second starting from the first's export (float64)."""
    chunk = 8
    length = 5 * chunk + 3
    inputs = make_round([length], gate)
    wrt = [inputs[n] for n in LEAVES]
    o_one, final_one = run(chunk_linear_attention, inputs, I(0), I(6), chunk)

    cut = split_chunks * chunk
    o_a, state_cut = run(chunk_linear_attention, _slice(inputs, 0, cut, inputs["initial_state"]),
                         I(0), I(split_chunks), chunk)
    # The continuation shares its round with an unrelated sequence.
    other = make_round([11], gate, seed=7)
    continuation = _pack(_slice(inputs, cut, length, state_cut), other)
    o_b, final_two = run(chunk_linear_attention, continuation, I(0), I(6 - split_chunks), chunk)
    o_two = torch.cat([o_a, o_b[: length - cut]])

    assert rel_err(o_two, o_one) < 1e-12
    assert rel_err(final_two, final_one) < 1e-12
    for name, got, want in zip(LEAVES, grads_of([o_two, final_two], wrt), grads_of([o_one, final_one], wrt)):
        assert rel_err(got, want) < 1e-12, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("fork", [0, 1, 4, 7], ids=lambda r: f"replay{r}")
@pytest.mark.parametrize("gate", GATES)
def test_replay_is_bitwise(gate, fork, dtype):
    """A branch forking at p = cB + r starts from the anchor S_cB and replays r tokens.

    Outputs after p are bitwise those of the one-call run (same chunk grid), the
    first call's outputs before p too; gradients agree to rounding.
    """
    chunk = 8
    length = 6 * chunk + 5
    p = 2 * chunk + fork
    anchor = (p // chunk) * chunk
    inputs = make_round([length], gate, dtype=dtype)
    o_one, final_one = run(chunk_linear_attention, inputs, I(0), I(7), chunk)

    # Call 1 produces [0, p) and exports the anchor state S_cB.
    o_a, anchor_state = run(chunk_linear_attention, _slice(inputs, 0, p, inputs["initial_state"]),
                            I(0), I(anchor // chunk), chunk)
    # Call 2 replays [cB, p) and continues; the replayed outputs are discarded.
    other = make_round([13], gate, dtype=dtype, seed=5)
    o_b, final_two = run(chunk_linear_attention, _pack(other, _slice(inputs, anchor, length, anchor_state)),
                         I(1), I(-(-(length - anchor) // chunk)), chunk)
    o_b = o_b[13:]
    assert torch.equal(o_a, o_one[:p])
    assert torch.equal(o_b[p - anchor :], o_one[p:])
    assert torch.equal(final_two[0], final_one[0])

    if dtype == torch.float64:
        wrt = [inputs[n] for n in LEAVES]
        o_two = torch.cat([o_a, o_b[p - anchor :]])
        for name, got, want in zip(LEAVES, grads_of([o_two, final_two], wrt), grads_of([o_one, final_one], wrt)):
            assert rel_err(got, want) < 1e-12, name


# 4. The same function as transformers' torch fallbacks.


def _transformers_fallbacks():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    unwrap = lambda f: getattr(f, "__wrapped__", f)  # noqa: E731  (skips the hub-kernel wrapper)
    return {
        "channel": (unwrap(kimi.chunk_kimi_delta_attention), unwrap(kimi.recurrent_kimi_delta_attention)),
        "scalar": (unwrap(qwen.torch_chunk_gated_delta_rule), unwrap(qwen.torch_recurrent_gated_delta_rule)),
    }


@pytest.mark.parametrize("chunk", [16, 64], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("gate", GATES)
def test_matches_transformers_chunk_fallback(gate, chunk):
    """Single sequence of 150 tokens (the fallbacks pad it to a multiple of their chunk), float32."""
    heads, qk_heads = (2, 2) if gate == "channel" else (4, 2)  # Qwen3-Next: grouped value heads
    inputs = make_round([150], gate, dtype=torch.float32, heads=heads, qk_heads=qk_heads, key_dim=16, value_dim=8)
    chunk_fn, _ = _transformers_fallbacks()[gate]
    o, final = run(chunk_linear_attention, inputs, I(0), I(-(-150 // chunk)), chunk)
    o_hf, final_hf = chunk_fn(
        inputs["q"][None], inputs["k"][None], inputs["v"][None], g=inputs["g"][None], beta=inputs["beta"][None],
        chunk_size=chunk, initial_state=inputs["initial_state"], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o, o_hf[0]) < 1e-5
    assert rel_err(final, final_hf) < 1e-5


@pytest.mark.parametrize("gate", GATES)
def test_naive_matches_transformers_recurrent_fallback(gate):
    """The spec is the models' own token-by-token recurrence."""
    inputs = make_round([37], gate, dtype=torch.float32, key_dim=16, value_dim=8)
    _, recurrent_fn = _transformers_fallbacks()[gate]
    o, final = run(naive_linear_attention, inputs, I(0), I(3), 16)
    o_hf, final_hf = recurrent_fn(
        inputs["q"][None], inputs["k"][None], inputs["v"][None], g=inputs["g"][None], beta=inputs["beta"][None],
        initial_state=inputs["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o, o_hf[0]) < 1e-6
    assert rel_err(final, final_hf) < 1e-6


@pytest.mark.parametrize("gate", GATES)
def test_float32_stays_close_to_float64_over_many_chunks(gate):
    """The chunk recurrence in float32 (the models' compute dtype) against the same op in float64
    (which is the naive recurrence to 1e-10, above): slow decays carry the state through up to 11
    chunk steps, so rounding that built up along the chain would show in every output and gradient."""
    lengths, chunk = [700, 300, 129, 64], 64
    inputs64 = make_round(lengths, gate, key_dim=32, value_dim=32)
    with torch.no_grad():
        inputs64["g"].mul_(0.03)   # per-token decays of 0.955 and slower: state crosses chunks
    inputs32 = {n: (x.detach().float().requires_grad_() if x.is_floating_point() else x) for n, x in inputs64.items()}
    export_seq, export_chunk = some_exports(lengths, chunk)
    results = {}
    for name, inputs in (("f32", inputs32), ("f64", inputs64)):
        o, ex = run(chunk_linear_attention, inputs, export_seq, export_chunk, chunk)
        results[name] = [o, ex, *grads_of([o, ex], [inputs[n] for n in LEAVES])]
    for name, got, want in zip(["o", "exports", *LEAVES], results["f32"], results["f64"]):
        assert rel_err(got, want) < 5e-6, name   # measured 2e-7 to 5e-7


# Dtypes and input validation.


@pytest.mark.parametrize("gate", GATES)
def test_bfloat16_computes_in_float32(gate):
    """bf16 in: computed in float32, o returned in bf16, states in float32."""
    lengths, chunk = [9, 20], 8
    inputs = make_round(lengths, gate, dtype=torch.bfloat16)
    export_seq, export_chunk = some_exports(lengths, chunk)
    o, ex = run(chunk_linear_attention, inputs, export_seq, export_chunk, chunk)
    assert o.dtype == torch.bfloat16 and ex.dtype == torch.float32
    upcast = {n: (x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in inputs.items()}
    o32, ex32 = run(chunk_linear_attention, upcast, export_seq, export_chunk, chunk)
    assert torch.equal(o, o32.to(torch.bfloat16)) and torch.equal(ex, ex32)
    wrt = [inputs[n] for n in LEAVES]
    grads = grads_of([o, ex], wrt)
    assert all(gr.dtype == torch.bfloat16 for gr in grads)
    # The same gradients as the float32 computation, up to bfloat16 rounding of the upstream weights and result.
    grads32 = grads_of([o32, ex32], [upcast[n] for n in LEAVES])
    assert all(rel_err(gr, gr32) < 2e-2 for gr, gr32 in zip(grads, grads32))


def _valid_args():
    inputs = make_round([5, 9], "channel", dtype=torch.float32)
    args = {n: inputs[n].detach() for n in ("q", "k", "v", "g", "beta", "initial_state")}
    args.update(cu_seqlens=inputs["cu_seqlens"], export_seq=I(1), export_chunk=I(3), chunk_size=4)
    return args


BAD_INPUTS = {
    "q-2d": (lambda a: a.update(q=a["q"][:, 0]), r"q must be \[N, HK, K\], got shape \(14, 6\)"),
    "k-shape": (lambda a: a.update(k=a["k"][:-1]), r"k must have q's shape"),
    "g-shape": (lambda a: a.update(g=a["g"][..., :3]), r"g must be \[N, H, K\].*got \(14, 2, 3\)"),
    "beta-shape": (lambda a: a.update(beta=a["beta"][:, :1]), r"beta must be \[N, H\]"),
    "heads-not-multiple": (lambda a: a.update(v=torch.zeros(14, 3, 5)), r"multiple of the query/key heads"),
    "mixed-dtypes": (lambda a: a.update(v=a["v"].double()), r"q, k, v must share a dtype"),
    "cu-end": (lambda a: a.update(cu_seqlens=I(0, 5, 13)), r"cu_seqlens must run from 0 to N=14"),
    "cu-decreasing": (lambda a: a.update(cu_seqlens=I(0, 9, 5, 14)), r"non-decreasing"),
    "cu-float": (lambda a: a.update(cu_seqlens=torch.tensor([0.0, 14.0])), r"cu_seqlens must be a 1-D integer"),
    "state-shape": (lambda a: a.update(initial_state=a["initial_state"][:1]), r"initial_state must be \[S, H, K, V\]"),
    "export-past-end": (
        lambda a: a.update(export_chunk=I(4)),
        r"export_chunk must be in \[1, ceil\(len / chunk_size\)=3\]",
    ),
    "export-zero": (lambda a: a.update(export_chunk=I(0)), r"got 0"),
    "export-seq": (lambda a: a.update(export_seq=I(2)), r"export_seq must be in \[0, S=2\), got 2"),
    "export-lengths": (lambda a: a.update(export_seq=I(0, 1)), r"one length"),
    "chunk-size": (lambda a: a.update(chunk_size=0), r"chunk_size must be a positive int, got 0"),
}


@pytest.mark.parametrize("fn", [chunk_linear_attention, naive_linear_attention], ids=["chunk", "naive"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_value_error(case, fn):
    args = _valid_args()
    fn(**args)  # the unmodified arguments are valid
    mutate, message = BAD_INPUTS[case]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        fn(**args)


# 6. The fla adapter: fla's kernels need CUDA, so a stand-in with fla's documented signature
#    (batch 1 + cu_seqlens, float32 initial states, final states only, one head count for q/k/v)
#    checks everything the adapter adds: extra prefix sequences for mid-sequence exports,
#    grouped heads, layouts, export order, gradients through exports and initial states.


def _fla_stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    assert q.shape[0] == 1 and cu_seqlens is not None and output_final_state
    assert initial_state.dtype == torch.float32 and initial_state.shape[0] == len(cu_seqlens) - 1
    assert q.shape == k.shape and q.shape[2] == v.shape[2] == beta.shape[2], "fla wants one head count"
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    o, final = naive_linear_attention(q[0], k[0], v[0], g[0], beta[0], cu_seqlens, initial_state,
                                      torch.arange(len(lengths)), (lengths + 63) // 64, chunk_size=64, scale=scale,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o[None], final


@pytest.fixture
def fla_stand_in(monkeypatch):
    import sys
    import types

    calls = []

    def record(*args, **kwargs):
        calls.append(kwargs["cu_seqlens"].clone())
        return _fla_stand_in(*args, **kwargs)

    modules = {name: types.ModuleType(name) for name in ("fla", "fla.ops", "fla.ops.kda", "fla.ops.gated_delta_rule")}
    modules["fla.ops.kda"].chunk_kda = record
    modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = record
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


@pytest.mark.parametrize("qk_heads", [2, 1], ids=["mha", "grouped"])
@pytest.mark.parametrize("gate", GATES)
def test_fla_adapter_keeps_the_round_contract(fla_stand_in, gate, qk_heads):
    from harts.executor.ops.linear_attention import fla_linear_attention

    lengths = [3, 130, 64, 200, 65]
    inputs = make_round(lengths, gate, dtype=torch.float32, qk_heads=qk_heads)
    export_seq, export_chunk = some_exports(lengths, 64)
    wrt = [inputs[n] for n in LEAVES]
    o, ex = run(fla_linear_attention, inputs, export_seq, export_chunk, 64)
    o_ref, ex_ref = run(chunk_linear_attention, inputs, export_seq, export_chunk, 64)
    assert o.dtype == torch.float32 and ex.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-5 and rel_err(ex, ex_ref) < 1e-5
    for name, got, want in zip(LEAVES, grads_of([o, ex], wrt), grads_of([o_ref, ex_ref], wrt)):
        assert rel_err(got, want) < 1e-4, name
    # One call; each mid-sequence export (not its sequence's final state) adds one prefix of whole chunks.
    final = [-(-n // 64) for n in lengths]
    middle = [int(c) * 64 for s, c in zip(export_seq.tolist(), export_chunk.tolist()) if c < final[s]]
    assert len(fla_stand_in) == 1
    assert (fla_stand_in[0][1:] - fla_stand_in[0][:-1]).tolist() == lengths + middle


def test_backend_selection_falls_back_to_torch_and_refuses_fla_without_cuda(monkeypatch):
    from harts.executor.ops.linear_attention import select_backend

    cpu = torch.device("cpu")
    assert select_backend(cpu, 64) == "torch"
    monkeypatch.setenv("HARTS_LINEAR_ATTENTION", "torch")
    assert select_backend(cpu, 64) == "torch"
    monkeypatch.setenv("HARTS_LINEAR_ATTENTION", "")   # empty is unset: auto
    assert select_backend(cpu, 64) == "torch"
    with pytest.raises(ValueError, match="needs CUDA tensors, chunk size 64"):
        select_backend(cpu, 64, "fla")
    with pytest.raises(ValueError, match="must be one of auto, torch, fla"):
        select_backend(cpu, 64, "triton")


@pytest.mark.parametrize("hopper, triton_3_4, triton_3_7_1, refused", [
    (True, True, False, True),      # the lent H200 with Triton 3.6: fla raises in the backward
    (True, True, True, False),      # Triton >= 3.7.1 fixes it
    (False, True, False, False),    # not Hopper
    (True, False, False, False),    # Triton < 3.4 predates the defect
])
def test_fla_scalar_gate_defect_follows_flas_own_flags(monkeypatch, hopper, triton_3_4, triton_3_7_1, refused):
    import types

    from harts.executor.ops.linear_attention import backend

    flags = types.ModuleType("fla.utils")
    flags.IS_NVIDIA_HOPPER, flags.TRITON_ABOVE_3_4_0, flags.TRITON_ABOVE_3_7_1 = hopper, triton_3_4, triton_3_7_1
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.utils", flags)
    backend.fla_scalar_gate_defect.cache_clear()
    try:
        reason = backend.fla_scalar_gate_defect()
    finally:
        backend.fla_scalar_gate_defect.cache_clear()
    assert (reason is not None) == refused
    if refused:
        assert "#640" in reason and "Gated DeltaNet" in reason


def test_backend_selection_keeps_scalar_gates_off_a_defective_fla(monkeypatch):
    from harts.executor.ops.linear_attention import backend

    cuda = torch.device("cuda")   # a device object only: select_backend reads its type
    monkeypatch.setattr(backend, "fla_import_error", lambda: None)
    monkeypatch.setattr(backend, "fla_scalar_gate_defect", lambda: "fla refuses scalar-gate backward here (fla #640)")
    backend._warn_once.cache_clear()
    assert backend.select_backend(cuda, 64, scalar_gate=False) == "fla"     # KDA's per-channel path is unaffected
    with pytest.warns(UserWarning, match="scalar-gate layers run on the torch op"):
        assert backend.select_backend(cuda, 64, scalar_gate=True) == "torch"
    with pytest.raises(ValueError, match=r"fla #640\); fix: upgrade Triton to >= 3.7.1"):
        backend.select_backend(cuda, 64, "fla", scalar_gate=True)
    monkeypatch.setattr(backend, "fla_scalar_gate_defect", lambda: None)
    assert backend.select_backend(cuda, 64, scalar_gate=True) == "fla"
    backend._warn_once.cache_clear()


def test_harts_run_picks_the_backend_from_the_model_familys_gate(monkeypatch):
    """`harts run` asks for a backend knowing the family: Qwen3-Next (scalar gates) stays off a
    defective fla, Kimi Linear (per-channel) keeps it; asking for fla there fails before the step."""
    from fidelity import tiny_kimi_linear, tiny_qwen3_next

    from harts.executor.cli import model_backend
    from harts.executor.ops.linear_attention import backend

    class Plan:
        flags = {"chunk_size": 64}

    cuda = torch.device("cuda")   # a device object only
    monkeypatch.setattr(backend, "fla_import_error", lambda: None)
    monkeypatch.setattr(backend, "fla_scalar_gate_defect", lambda: "fla refuses scalar-gate backward here (fla #640)")
    backend._warn_once.cache_clear()
    assert model_backend(cuda, Plan, tiny_kimi_linear()) == "fla"
    qwen = tiny_qwen3_next()
    with pytest.warns(UserWarning, match="scalar-gate layers run on the torch op"):
        assert model_backend(cuda, Plan, qwen) == "torch"
    monkeypatch.setenv("HARTS_LINEAR_ATTENTION", "fla")
    with pytest.raises(ValueError, match="upgrade Triton to >= 3.7.1"):
        model_backend(cuda, Plan, qwen)
    backend._warn_once.cache_clear()
