"""One round through flash-linear-attention's Triton kernels (CUDA only), with our round contract.

fla's `chunk_kda` (per-channel gate, KDA) and `chunk_gated_delta_rule` (scalar
gate, Gated DeltaNet) run packed variable-length sequences (batch 1,
`cu_seqlens`) from per-sequence float32 initial states and return each
sequence's final state, with gradients for inputs, initial states and final
states. Their chunk length is fixed at 64, so only rounds planned with B = 64
come here (`backend.select_backend`).

A round may also ask for the state after c whole chunks in the middle of a
sequence (the anchor a side branch starts from). fla returns final states
only, so each such export becomes one more sequence of the same call: the
first c chunks of that sequence again, from the same start state, whose final
state is the export. The state after chunk c depends only on chunks <= c, on
the same grid, so it is the state the full sequence passes through; the price
is recomputing at most that prefix once per mid-sequence export, inside the
same call.

Grouped heads (HK < H) repeat q and k per group, as the torch path does; fla
gets [1, N, H, *] tensors. Everything else (l2 norm in the kernel, default
scale K ** -0.5, log-space gates) is the same contract as
`chunk_linear_attention`; `tests/test_op_linear_attention.py` checks this
adapter against it with a stand-in that follows fla's documented signature,
and the device check (`benchmarks/device_check.py`) against fla itself: on an
H200 (fla 0.6.0) chunk_kda through this adapter matched the torch op, exports
and every gradient included, to TF32 and bfloat16 precision (docs/gpu-runs.md).

Legend: N packed tokens, S sequences, X extra prefix sequences, E exports,
H value heads, HK query/key heads, K key dim, V value dim.
"""
from __future__ import annotations

import functools
import inspect

import numpy as np
import torch

from harts.executor.ops.transfer import to_device

FLA_CHUNK_SIZE = 64


def _fla_kernels():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    return chunk_kda, chunk_gated_delta_rule


def _host_ints(x) -> np.ndarray:
    return np.asarray(x.tolist() if isinstance(x, torch.Tensor) else x, dtype=np.int64)


def fla_linear_attention(q, k, v, g, beta, cu_seqlens, initial_state, export_seq, export_chunk,
                         chunk_size: int = FLA_CHUNK_SIZE, scale: float | None = None,
                         use_qk_l2norm_in_kernel: bool = False):
    """Same arguments and results as `chunk_linear_attention` (o in q's dtype, exports in float32)."""
    if chunk_size != FLA_CHUNK_SIZE:
        raise ValueError(f"fla's kernels use chunk size {FLA_CHUNK_SIZE}, the round was planned with {chunk_size}")
    chunk_kda, chunk_gated_delta_rule = _fla_kernels()
    num_tokens, num_heads = v.shape[0], v.shape[1]
    # The geometry is index arithmetic on the host (cu_seqlens and exports are host tensors in the
    # executor); what the kernels read goes over in one copy that does not wait for the device.
    cu, ex_seq, ex_chunk = (_host_ints(x) for x in (cu_seqlens, export_seq, export_chunk))
    starts, lengths = cu[:-1], np.diff(cu)
    num_seqs = len(lengths)
    middle = ex_chunk < -(-lengths[ex_seq] // chunk_size)

    # Extra sequences: the first c chunks of each sequence with a mid-sequence export.
    prefix_seq, prefix_len = ex_seq[middle], ex_chunk[middle] * chunk_size
    prefix_rows = np.repeat(starts[prefix_seq], prefix_len) + (
        np.arange(int(prefix_len.sum())) - np.repeat(np.cumsum(prefix_len) - prefix_len, prefix_len))
    rows = np.concatenate([np.arange(num_tokens), prefix_rows])
    cu_all = np.concatenate([cu, cu[-1] + np.cumsum(prefix_len)])
    # Export e: its sequence's final state, or the final state of its extra prefix sequence.
    source = ex_seq.copy()
    source[middle] = num_seqs + np.arange(int(middle.sum()))
    rows_d, cu_d, prefix_seq_d, source_d = to_device([rows, cu_all, prefix_seq, source], q.device)

    if initial_state is None:
        initial_state = q.new_zeros(num_seqs, num_heads, q.shape[2], v.shape[2], dtype=torch.float32)
    state0 = torch.cat([initial_state, initial_state[prefix_seq_d]]).float()
    group = num_heads // q.shape[1]
    q_all, k_all = (x[rows_d].repeat_interleave(group, dim=1) if group > 1 else x[rows_d] for x in (q, k))
    v_all, g_all, beta_all = v[rows_d], g[rows_d], beta[rows_d]
    kernel = chunk_kda if g.dim() == 3 else chunk_gated_delta_rule
    # fla >= 0.6 takes the boundaries on the host too, sparing its own read-back of cu_seqlens.
    extra = {"cu_seqlens_cpu": torch.from_numpy(cu_all)} if _takes_host_boundaries(kernel) else {}
    o, final = kernel(q_all[None], k_all[None], v_all[None], g_all[None], beta_all[None], scale=scale,
                      initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      cu_seqlens=cu_d, **extra)
    return o[0, :num_tokens].to(q.dtype), final[source_d].float()


@functools.cache
def _takes_host_boundaries(kernel) -> bool:
    return "cu_seqlens_cpu" in inspect.signature(kernel).parameters
