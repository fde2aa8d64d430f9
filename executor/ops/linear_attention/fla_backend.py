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
and the device check (`benchmarks/device_check.py`) against fla itself.

Legend: N packed tokens, S sequences, X extra prefix sequences, E exports,
H value heads, HK query/key heads, K key dim, V value dim.
"""
from __future__ import annotations

import torch

FLA_CHUNK_SIZE = 64


def _fla_kernels():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    return chunk_kda, chunk_gated_delta_rule


def fla_linear_attention(q, k, v, g, beta, cu_seqlens, initial_state, export_seq, export_chunk,
                         chunk_size: int = FLA_CHUNK_SIZE, scale: float | None = None,
                         use_qk_l2norm_in_kernel: bool = False):
    """Same arguments and results as `chunk_linear_attention` (o in q's dtype, exports in float32)."""
    if chunk_size != FLA_CHUNK_SIZE:
        raise ValueError(f"fla's kernels use chunk size {FLA_CHUNK_SIZE}, the round was planned with {chunk_size}")
    chunk_kda, chunk_gated_delta_rule = _fla_kernels()
    num_tokens, num_heads = v.shape[0], v.shape[1]
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    num_seqs = len(lengths)
    export_seq = export_seq.to(device=q.device, dtype=torch.long)
    export_chunk = export_chunk.to(device=q.device, dtype=torch.long)
    final_chunk = torch.div(lengths + chunk_size - 1, chunk_size, rounding_mode="floor")
    middle = export_chunk < final_chunk[export_seq]

    # Extra sequences: the first c chunks of each sequence with a mid-sequence export.
    prefix_seq, prefix_len = export_seq[middle], export_chunk[middle] * chunk_size
    prefix_rows = torch.repeat_interleave(starts[prefix_seq], prefix_len) + (
        torch.arange(int(prefix_len.sum()), device=q.device)
        - torch.repeat_interleave(torch.cumsum(prefix_len, 0) - prefix_len, prefix_len))
    rows = torch.cat([torch.arange(num_tokens, device=q.device), prefix_rows])
    cu_all = torch.cat([cu, cu[-1] + torch.cumsum(prefix_len, 0)])
    if initial_state is None:
        initial_state = q.new_zeros(num_seqs, num_heads, q.shape[2], v.shape[2], dtype=torch.float32)
    state0 = torch.cat([initial_state, initial_state[prefix_seq]]).float()

    group = num_heads // q.shape[1]
    q_all, k_all = (x[rows].repeat_interleave(group, dim=1) if group > 1 else x[rows] for x in (q, k))
    v_all, g_all, beta_all = v[rows], g[rows], beta[rows]
    kernel = chunk_kda if g.dim() == 3 else chunk_gated_delta_rule
    o, final = kernel(q_all[None], k_all[None], v_all[None], g_all[None], beta_all[None], scale=scale,
                      initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      cu_seqlens=cu_all)
    # Export e: its sequence's final state, or the final state of its extra prefix sequence.
    source = export_seq.clone()
    source[middle] = num_seqs + torch.arange(int(middle.sum()), device=q.device)
    return o[0, :num_tokens].to(q.dtype), final[source].float()
