"""The specification: the gated delta rule token by token, one sequence at a time.

Per value head, with state S in R^{K x V} and the preprocessed q (l2-normed if
asked, times scale) and k:

    S'_t = diag(exp(g_t)) S_{t-1}              (scalar gate: exp(g_t) * S_{t-1})
    S_t  = S'_t + k_t (beta_t (v_t - S'_t^T k_t))^T
    o_t  = S_t^T q_t

which is the loop of transformers' `recurrent_kimi_delta_attention` (KDA) and
`torch_recurrent_gated_delta_rule` (Qwen3-Next). Plain loops, no chunking; it
computes in float64 for float64 inputs and in float32 otherwise. Slow on
purpose: it is what `chunk.py` is tested against.

Legend: N packed tokens, S sequences, H value heads, K key dim, V value dim,
E exported states.
"""

from __future__ import annotations

import torch

from .inputs import check_round, prepare_inputs


def naive_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    export_seq: torch.Tensor,
    export_chunk: torch.Tensor,
    chunk_size: int = 64,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and results as `chunk_linear_attention`; see there."""
    host = check_round(q, k, v, g, beta, cu_seqlens, initial_state, export_seq, export_chunk, chunk_size, scale)
    num_seqs = len(host.seq_starts) - 1
    q_NHK, k_NHK, v_NHV, g, beta_NH, state0_SHKV = prepare_inputs(
        q, k, v, g, beta, initial_state, num_seqs, scale, use_qk_l2norm_in_kernel
    )

    outputs = []
    states_after_chunk: dict[tuple[int, int], torch.Tensor] = {}
    for seq in range(num_seqs):
        start, end = host.seq_starts[seq], host.seq_starts[seq + 1]
        state_HKV = state0_SHKV[seq]
        for t in range(start, end):
            decay = g[t].exp()
            decay = decay[:, :, None] if host.gate_per_channel else decay[:, None, None]
            state_HKV = state_HKV * decay
            predicted_HV = torch.einsum("hk,hkv->hv", k_NHK[t], state_HKV)
            delta_HV = (v_NHV[t] - predicted_HV) * beta_NH[t][:, None]
            state_HKV = state_HKV + k_NHK[t][:, :, None] * delta_HV[:, None, :]
            outputs.append(torch.einsum("hk,hkv->hv", q_NHK[t], state_HKV))
            position = t - start + 1
            if position % chunk_size == 0 or t == end - 1:
                # After a full chunk, or after the last (possibly partial) one.
                states_after_chunk[seq, -(-position // chunk_size)] = state_HKV

    num_heads, value_dim = v.shape[1], v.shape[2]
    if outputs:
        o_NHV = torch.stack(outputs)
    else:
        o_NHV = v_NHV.new_zeros(0, num_heads, value_dim)
    exported = [states_after_chunk[s, c] for s, c in zip(host.export_seq, host.export_chunk)]
    if exported:
        exported_EHKV = torch.stack(exported)
    else:
        exported_EHKV = state0_SHKV.new_zeros(0, *state0_SHKV.shape[1:])
    return o_NHV.to(q.dtype), exported_EHKV
