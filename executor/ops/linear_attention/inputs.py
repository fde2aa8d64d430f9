"""Validation and preprocessing shared by the naive and the chunkwise round.

Both paths must reject the same inputs with the same messages and must see
the same preprocessed q and k (l2 norm, scale, grouped heads), otherwise a
test comparing them would compare two different functions.

Legend: N packed tokens, S sequences, H value heads (heads of v, g, beta),
HK query/key heads, K key dim, V value dim, E exported states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harts.executor.ops.dtypes import compute_dtype_for

# Inside the square root, as fla's l2norm and both transformers fallbacks do
# (F.normalize would clamp the norm instead: a different function near zero).
L2NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class RoundHost:
    """Host-side copies of the index arrays of one round (one device sync)."""

    seq_starts: list[int]  # cu_seqlens as Python ints, S + 1 entries
    num_chunks: list[int]  # ceil(len / chunk_size) per sequence
    export_seq: list[int]  # per export: which sequence
    export_chunk: list[int]  # per export: after how many chunks of it
    gate_per_channel: bool  # g is [N, H, K] (KDA) rather than [N, H] (Gated DeltaNet)


def _shape(x: torch.Tensor) -> str:
    return str(tuple(x.shape))


def check_round(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    export_seq: torch.Tensor,
    export_chunk: torch.Tensor,
    chunk_size: int,
    scale: float | None = None,
) -> RoundHost:
    """Validate one round's inputs; raise ValueError saying what was got."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be None (K ** -0.5) or a number, got {scale!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if q.dim() != 3:
        raise ValueError(f"q must be [N, HK, K], got shape {_shape(q)}")
    num_tokens, num_qk_heads, key_dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {_shape(q)}, got {_shape(k)}")
    if v.dim() != 3 or v.shape[0] != num_tokens:
        raise ValueError(f"v must be [N={num_tokens}, H, V], got shape {_shape(v)}")
    num_heads = v.shape[1]
    if num_qk_heads == 0 or num_heads % num_qk_heads != 0:
        raise ValueError(
            f"the value heads H={num_heads} must be a multiple of the query/key heads HK={num_qk_heads}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if g.shape == (num_tokens, num_heads, key_dim):
        gate_per_channel = True
    elif g.shape == (num_tokens, num_heads):
        gate_per_channel = False
    else:
        raise ValueError(
            f"g must be [N, H, K]={num_tokens, num_heads, key_dim} (per-channel, KDA) or "
            f"[N, H]={num_tokens, num_heads} (scalar, Gated DeltaNet), got {_shape(g)}"
        )
    if beta.shape != (num_tokens, num_heads):
        raise ValueError(f"beta must be [N, H]={num_tokens, num_heads}, got {_shape(beta)}")
    devices = {x.device for x in (q, k, v, g, beta)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, g, beta must be on one device, got {sorted(map(str, devices))}")

    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens!r}")
    seq_starts = [int(x) for x in cu_seqlens.tolist()]
    if len(seq_starts) < 2 or seq_starts[0] != 0 or seq_starts[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to N={num_tokens} with S + 1 >= 2 entries, got {seq_starts}")
    if any(b < a for a, b in zip(seq_starts, seq_starts[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {seq_starts}")
    num_seqs = len(seq_starts) - 1
    num_chunks = [-(-(b - a) // chunk_size) for a, b in zip(seq_starts, seq_starts[1:])]

    if initial_state is not None:
        expected = (num_seqs, num_heads, key_dim, v.shape[2])
        if not isinstance(initial_state, torch.Tensor) or initial_state.shape != expected:
            got = _shape(initial_state) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            raise ValueError(f"initial_state must be [S, H, K, V]={expected}, got {got}")
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must be floating, got dtype {initial_state.dtype}")

    for name, x in (("export_seq", export_seq), ("export_chunk", export_chunk)):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer tensor, got {x!r}")
    if export_seq.shape != export_chunk.shape:
        raise ValueError(
            f"export_seq and export_chunk must have one length, got {_shape(export_seq)} and {_shape(export_chunk)}"
        )
    ex_seq = [int(x) for x in export_seq.tolist()]
    ex_chunk = [int(x) for x in export_chunk.tolist()]
    for i, (s, c) in enumerate(zip(ex_seq, ex_chunk)):
        if not 0 <= s < num_seqs:
            raise ValueError(f"export {i}: export_seq must be in [0, S={num_seqs}), got {s}")
        if not 1 <= c <= num_chunks[s]:
            raise ValueError(
                f"export {i}: export_chunk must be in [1, ceil(len / chunk_size)={num_chunks[s]}] for sequence {s} "
                f"of length {seq_starts[s + 1] - seq_starts[s]}, got {c}"
            )
    return RoundHost(seq_starts, num_chunks, ex_seq, ex_chunk, gate_per_channel)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, the fallbacks' and fla's definition."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def prepare_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    num_seqs: int,
    scale: float | None,
    use_qk_l2norm_in_kernel: bool,
):
    """Cast to the compute dtype, l2-normalise and scale q/k, expand grouped heads.

    Returns (q_NHK, k_NHK, v_NHV, g, beta_NH, state0_SHKV), all in the compute
    dtype, q already multiplied by `scale` (default K ** -0.5).
    """
    dtype = compute_dtype_for(q.dtype)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    key_dim = q.shape[-1]
    q = q * (key_dim**-0.5 if scale is None else scale)
    group = v.shape[1] // q.shape[1]
    if group > 1:
        # Value head h reads query/key head h // group, as in transformers' Qwen3-Next.
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    if initial_state is None:
        state0 = v.new_zeros(num_seqs, v.shape[1], key_dim, v.shape[2])
    else:
        state0 = initial_state.to(device=v.device, dtype=dtype)
    return q, k, v, g, beta, state0
