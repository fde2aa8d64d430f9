"""One packed chunkwise gated-delta-rule call: one execution round.

Shapes (legend; tensor names carry these suffixes):
    N   packed tokens of the round            S   sequences, cu_seqlens has S + 1 entries
    H   value heads (heads of v, g, beta)     HK  query/key heads, H % HK == 0
    K   key dim                               V   value dim
    E   exported states                       B   chunk_size, tokens per chunk
    M   chunk slots of the round (sum over sequences of ceil(len / B))
    J   sub-chunks per chunk                  L   sub-chunk length, B == J * L

    q: [N, HK, K]    k: [N, HK, K]    v: [N, H, V]
    g: [N, H, K] (per-channel log-decay, KDA) or [N, H] (scalar, Gated DeltaNet)
    beta: [N, H]     cu_seqlens: int [S + 1]    initial_state: [S, H, K, V] or None
    export_seq, export_chunk: int [E]
    -> o: [N, H, V] (dtype of q),  exported_states: [E, H, K, V] (compute dtype)

The function (per value head; `naive.py` is the executable specification):

    q_t <- l2norm(q_t) * scale,  k_t <- l2norm(k_t)      (l2norm only if use_qk_l2norm_in_kernel)
    S'_t = diag(exp(g_t)) S_{t-1}                       (scalar gate: exp(g_t) S_{t-1})
    S_t  = S'_t + k_t (beta_t (v_t - S'_t^T k_t))^T
    o_t  = S_t^T q_t

This is the core of transformers' `chunk_kimi_delta_attention` (KDA,
models/kimi_linear) and `torch_chunk_gated_delta_rule` (Qwen3-Next), called
with the same tensors (tests/test_op_linear_attention.py checks both), and, by
our reading of its source, of fla's chunk_kda / chunk_gated_delta_rule (fla's
chunk_kda matched this op on an H200 to TF32 and bfloat16 precision,
docs/gpu-runs.md; fla needs CUDA, so no test runs it). Conventions:
* scale: None means K ** -0.5, the only value the fallbacks use; it multiplies
  q after the l2 norm.
* use_qk_l2norm_in_kernel: l2norm(x) = x / sqrt(sum(x^2) + 1e-6) over K, in the
  compute dtype, before the scale; both models call their core with True.
* g is the log-decay (<= 0; e.g. -exp(A_log) * softplus(...)), not the decay.
  Not checked (it would cost a device sync); a positive g may overflow exp.
* beta multiplies the prediction error (delta = beta (v - S'^T k)); it is
  applied as written, with no sigmoid.
* Grouped heads: HK < H repeats q and k per group (value head h reads
  query/key head h // (H // HK)), as Qwen3-Next's fallback does.
* Dtypes: q's dtype decides. float64 computes in float64; float32, bfloat16
  and float16 compute in float32 (as the fallbacks and fla do); every other
  input, initial_state included, is cast to the compute dtype. o is returned
  in q's dtype, the exported states in the compute dtype (float32 for bf16:
  states are where error accumulates).
* The fallbacks pad one sequence at its end to a multiple of their chunk_size
  (default 64); here every sequence is padded to whole chunks of its own grid.
  Zero padding (k = v = q = beta = g = 0) changes no real output or state.

Exports. export_chunk = c asks for the state after the first c chunks of
sequence export_seq, i.e. after min(c * B, len) of its tokens; c runs from 1 to
ceil(len / B), so the final state of a sequence whose last chunk is partial is
its last export. Exports are differentiable: an exported state fed to a later
call as initial_state carries gradients back into this call.

Algorithm (WY / UT form, as in fla and transformers' fallback). Every sequence
runs on its own chunk grid from its first token. Within a chunk with start
state S0 and cumulative log-decay G_t = g_1 + ... + g_t:

    A_kk[t, s] = beta_t sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])   (s < t)
    A_qk[t, s] =        sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])   (s <= t)
    (I + A_kk) [U | W] = [beta v | beta k exp(G)]                    (unit lower triangular solve)
    V_new = U - W S0
    O     = (q exp(G)) S0 + A_qk V_new
    S_B   = diag(exp(G_B)) S0 + (k exp(G_B - G))^T V_new

1. Chunk-local work (everything but S0) for all M chunks of the round at once.
   The per-channel pairwise decay exp(G_t - G_s) is never built as [B, B, K]:
   for s in an earlier sub-chunk than t it factors through the first token r
   of t's sub-chunk, exp(G_t - G_r) * exp(G_r - G_s), both factors <= 1 since
   G is non-increasing (no overflow, unlike exp(G_t) * exp(-G_s)); only the
   diagonal [L, L, K] sub-chunk blocks are built pairwise. Memory per chunk
   and head: (J + L) * B * K instead of B * B * K (B = 64: 16 * B * K, 4x less).
2. The chunk recurrence S0 -> S_B is a loop over chunk index c, batched over
   the sequences that still have a chunk c. Chunks are laid out step-major
   (all first chunks, then all second chunks, ...), sequences sorted by chunk
   count, so step c reads one contiguous slice and the active states are a
   prefix of the state batch. Its backward is the loop reversed, written out
   (`_ChunkRecurrence`): one kernel a step each way, the rest batched over
   all chunk slots.
3. O for all chunks at once from the chunk start states.

Every op in 1 and 3 acts on one chunk at a time, and the loop in 2 on one
sequence at a time, so a sequence's result does not depend on what else is in
the round, bitwise, wherever the kernels are batch-invariant: then a packed
round reproduces separate runs, and a replayed continuation on the same chunk
grid reproduces the one-call run, exactly. torch's CPU kernels are, given
contiguous chunk tensors (the tests check it); on GPU, cuBLAS may pick another
kernel for another batch size, so there it is to be measured, not assumed.

cu_seqlens and the export indices are read on the host: pass them as CPU
tensors (the executor does), or each call waits for the device to read them.
The round's index layout depends on nothing else, so it is built once per
distinct geometry and device and reused (`round_layout`): every layer of a
microbatch runs the same rounds.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from harts.executor.ops.transfer import to_device

from .inputs import RoundHost, check_round, prepare_inputs

# Layouts kept: a microbatch's rounds, walked once per layer, must all fit (a smaller cache
# would miss on every call once the rounds outnumber it), and each holds O(N) indices.
ROUND_LAYOUT_CACHE = 256


def chunk_linear_attention(
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
    """Run one round of packed sequences through the gated delta rule, chunkwise.

    Args:
        q, k: [N, HK, K] queries and keys of all sequences of the round, packed.
        v: [N, H, V] values.
        g: [N, H, K] per-channel (KDA) or [N, H] scalar (Gated DeltaNet) log-decay.
        beta: [N, H] delta-rule step size (already through its sigmoid).
        cu_seqlens: int [S + 1] sequence boundaries; each sequence starts at an
            anchor, i.e. its chunk grid is the grid of its trajectory.
        initial_state: [S, H, K, V] start state per sequence (zeros for sequences
            starting at position 0); None means all zeros.
        export_seq, export_chunk: int [E]; export e is the state of sequence
            export_seq[e] after export_chunk[e] chunks (1 <= export_chunk <=
            ceil(len / chunk_size); the last is the final state).
        chunk_size: tokens per chunk, B.
        scale: multiplies q; None means K ** -0.5.
        use_qk_l2norm_in_kernel: l2-normalise q and k first (both models do).

    Returns:
        o: [N, H, V] in q's dtype; exported_states: [E, H, K, V] in the compute
        dtype (float64 for float64 inputs, float32 otherwise).
    """
    host = check_round(q, k, v, g, beta, cu_seqlens, initial_state, export_seq, export_chunk, chunk_size, scale)
    num_seqs = len(host.seq_starts) - 1
    q_NHK, k_NHK, v_NHV, g, beta_NH, state0_SHKV = prepare_inputs(
        q, k, v, g, beta, initial_state, num_seqs, scale, use_qk_l2norm_in_kernel
    )
    num_heads, value_dim = v.shape[1], v.shape[2]
    layout = round_layout(host, chunk_size, q.device)
    if layout.num_slots == 0:  # every sequence is empty
        return v_NHV.new_zeros(0, num_heads, value_dim).to(q.dtype), state0_SHKV.new_zeros(0, *state0_SHKV.shape[1:])

    # 1. Chunk-local work for all chunks of the round.
    q_MHBK, k_MHBK, v_MHBV = (layout.to_chunks(x) for x in (q_NHK, k_NHK, v_NHV))
    beta_MHB = layout.to_chunks(beta_NH)
    gate_MHB_ = layout.to_chunks(g)  # [M, H, B, K] or [M, H, B]
    cum_MHB_ = gate_MHB_.cumsum(dim=2)
    if not host.gate_per_channel:
        cum_MHB_ = cum_MHB_[..., None]  # broadcast the scalar gate over K: [M, H, B, 1]
    kbeta_MHBK = k_MHBK * beta_MHB[..., None]
    vbeta_MHBV = v_MHBV * beta_MHB[..., None]
    if host.gate_per_channel:
        aqk_MHBB, akk_MHBB = _intra_chunk_per_channel(q_MHBK, k_MHBK, kbeta_MHBK, cum_MHB_, chunk_size)
    else:
        aqk_MHBB, akk_MHBB = _intra_chunk_scalar(q_MHBK, k_MHBK, kbeta_MHBK, cum_MHB_[..., 0], chunk_size)
    decay_from_start = cum_MHB_.exp()
    rhs = torch.cat([vbeta_MHBV, kbeta_MHBK * decay_from_start], dim=-1)
    solved = torch.linalg.solve_triangular(akk_MHBB, rhs, upper=False, unitriangular=True)
    u_MHBV, w_MHBK = solved[..., :value_dim].contiguous(), solved[..., value_dim:].contiguous()
    qdecay_MHBK = q_MHBK * decay_from_start
    cum_last_MH1_ = cum_MHB_[:, :, -1:]
    kdecay_MHBK = k_MHBK * (cum_last_MH1_ - cum_MHB_).exp()  # decay from token to chunk end
    chunk_decay_MHK1 = cum_last_MH1_.transpose(-1, -2).exp()  # [M, H, K, 1] or [M, H, 1, 1]

    # 2. The chunk recurrence, batched over the sequences that have chunk c.
    state_SHKV = state0_SHKV.index_select(0, layout.order)  # sorted by chunk count, longest first
    starts_MHKV, new_values_MHBV, export_pieces = _ChunkRecurrence.apply(
        state_SHKV, u_MHBV, w_MHBK, kdecay_MHBK, chunk_decay_MHK1, layout)

    # 3. Outputs of all chunks from their start states.
    o_MHBV = qdecay_MHBK @ starts_MHKV + aqk_MHBB @ new_values_MHBV
    o_NHV = layout.from_chunks(o_MHBV)
    exported_EHKV = export_pieces.index_select(0, layout.export_inverse)
    return o_NHV.to(q.dtype), exported_EHKV


class _ChunkRecurrence(torch.autograd.Function):
    """Step 2: the chunk recurrence, one chunk step at a time, batched over the sequences that have
    chunk c (a shrinking prefix of the state batch):

        V_new_c = u_c - w_c S_c
        S_{c+1} = decay_c * S_c + kdecay_c^T V_new_c  =  A_c S_c + kdecay_c^T u_c,
        A_c = diag(decay_c) - kdecay_c^T w_c                     ([K, K]; decay_c * I for a scalar gate)

    Everything but the chain S_c -> S_{c+1} is batched over all chunk slots outside the loop, so
    a step is one kernel forward and one backward: on an accelerator a small model's step is
    bound by kernel launches (left to autograd a step was some fifteen graph nodes). Every op
    still acts on one sequence at a time, so results, gradients included, do not depend on the
    rest of the round.

    Returns every step's start states [M, H, K, V] and new values [M, H, B, V] (step-major, as the
    chunk slots), and the exported states in piece order (step by step, `layout.export_ranks`).
    """

    @staticmethod
    def forward(ctx, state_SHKV, u_MHBV, w_MHBK, kdecay_MHBK, chunk_decay_MHK1, layout):
        # [M * H, ...] batches (`_batched`): bmm reads transposed operands in place, where a 4-D matmul copies.
        state_SHKV, u_MHBV, w_MHBK, kdecay_MHBK = (x.contiguous() for x in (state_SHKV, u_MHBV, w_MHBK, kdecay_MHBK))
        transition_MHKK = _transition(kdecay_MHBK, w_MHBK, chunk_decay_MHK1)
        inflow_MHKV = torch.bmm(_batched(kdecay_MHBK).transpose(1, 2), _batched(u_MHBV)).view(
            *transition_MHKK.shape[:-1], u_MHBV.shape[-1])
        num_states = state_SHKV.shape[0]
        start_states, export_pieces = [], []
        for c, (transition, inflow) in enumerate(zip(transition_MHKK.split(layout.step_count),
                                                     inflow_MHKV.split(layout.step_count))):
            state_SHKV = state_SHKV[: transition.shape[0]]  # sequences without a chunk c have finished
            start_states.append(state_SHKV)
            state_SHKV = torch.baddbmm(_batched(inflow), _batched(transition), _batched(state_SHKV)).view(inflow.shape)
            if c + 1 in layout.export_ranks:
                export_pieces.append(state_SHKV.index_select(0, layout.export_ranks[c + 1]))
        starts_MHKV = torch.cat(start_states)
        new_values_MHBV = torch.baddbmm(_batched(u_MHBV), _batched(w_MHBK), _batched(starts_MHKV),
                                        alpha=-1).view(u_MHBV.shape)
        exports = torch.cat(export_pieces) if export_pieces else state_SHKV.new_zeros(0, *state_SHKV.shape[1:])
        # The transitions are rebuilt in backward (one bmm): kept, they would add a state-sized tensor per slot.
        ctx.save_for_backward(starts_MHKV, u_MHBV, w_MHBK, kdecay_MHBK, chunk_decay_MHK1)
        ctx.layout, ctx.num_states = layout, num_states
        return starts_MHKV, new_values_MHBV, exports

    @staticmethod
    @once_differentiable
    def backward(ctx, d_starts_MHKV, d_new_values_MHBV, d_exports):
        starts_MHKV, u_MHBV, w_MHBK, kdecay_MHBK, chunk_decay_MHK1 = ctx.saved_tensors
        transition_MHKK = _transition(kdecay_MHBK, w_MHBK, chunk_decay_MHK1)
        layout, counts = ctx.layout, ctx.layout.step_count
        # Contiguous, as `_batched` views need (an incoming gradient may be any layout).
        d_starts_MHKV = torch.zeros_like(starts_MHKV) if d_starts_MHKV is None else d_starts_MHKV.contiguous()
        d_new_values_MHBV = (torch.zeros_like(u_MHBV) if d_new_values_MHBV is None
                             else d_new_values_MHBV.contiguous())
        d_pieces = {}
        if d_exports is not None and d_exports.shape[0]:
            steps = sorted(layout.export_ranks)
            d_pieces = dict(zip(steps, d_exports.split([layout.export_ranks[step].shape[0] for step in steps])))
        # What reaches S_c from step c's own outputs (its start state and V_new), all slots at once.
        d_direct_MHKV = torch.baddbmm(_batched(d_starts_MHKV), _batched(w_MHBK).transpose(1, 2),
                                      _batched(d_new_values_MHBV), alpha=-1).view(starts_MHKV.shape)
        # The chain, last step first; each step writes dL/dS_c where step c - 1 reads it (`out=`).
        d_end_MHKV = torch.empty_like(starts_MHKV)       # dL/dS_{c+1}, on step c's slots
        d_state_SHKV = starts_MHKV.new_zeros(ctx.num_states, *starts_MHKV.shape[1:])   # no-chunk rows stay 0
        d_end_steps = d_end_MHKV.split(counts)
        for c, (transition, d_direct) in reversed(list(enumerate(zip(transition_MHKK.split(counts),
                                                                     d_direct_MHKV.split(counts))))):
            d_end = d_end_steps[c]
            continuing = counts[c + 1] if c + 1 < len(counts) else 0   # rows step c + 1 wrote into d_end
            if continuing < counts[c]:   # sequences whose last chunk is c: nothing from later steps
                d_end[continuing:].zero_()
            if c + 1 in d_pieces:
                d_end.index_add_(0, layout.export_ranks[c + 1], d_pieces[c + 1])
            d_start = d_end_steps[c - 1][: counts[c]] if c > 0 else d_state_SHKV[: counts[0]]
            torch.baddbmm(_batched(d_direct), _batched(transition).transpose(1, 2), _batched(d_end),
                          out=_batched(d_start))                                         # dL/dS_c
        # The rest of every step's gradient, all slots at once.
        d_transition = torch.bmm(_batched(d_end_MHKV), _batched(starts_MHKV).transpose(1, 2))   # [M*H, K, K]
        kdecay, w, u, d_end = _batched(kdecay_MHBK), _batched(w_MHBK), _batched(u_MHBV), _batched(d_end_MHKV)
        d_u_MHBV = torch.baddbmm(_batched(d_new_values_MHBV), kdecay, d_end).view(u_MHBV.shape)
        d_w_MHBK = torch.baddbmm(torch.bmm(_batched(d_new_values_MHBV), _batched(starts_MHKV).transpose(1, 2)),
                                 kdecay, d_transition).neg_().view(w_MHBK.shape)
        d_kdecay_MHBK = torch.baddbmm(torch.bmm(u, d_end.transpose(1, 2)), w, d_transition.transpose(1, 2),
                                      alpha=-1).view(kdecay_MHBK.shape)
        # diag(dA), summed over K where one decay per head entered every diagonal entry (scalar gate).
        d_decay = d_transition.diagonal(dim1=-2, dim2=-1).view(*transition_MHKK.shape[:-1], 1)   # no copy
        return d_state_SHKV, d_u_MHBV, d_w_MHBK, d_kdecay_MHBK, d_decay.sum_to_size(chunk_decay_MHK1.shape), None


def _transition(kdecay_MHBK: torch.Tensor, w_MHBK: torch.Tensor, chunk_decay_MHK1: torch.Tensor) -> torch.Tensor:
    """A = diag(decay) - kdecay^T w of every chunk slot: [M, H, K, K]."""
    num_slots, num_heads, _, key_dim = w_MHBK.shape
    transition_MHKK = torch.bmm(_batched(kdecay_MHBK).transpose(1, 2), _batched(w_MHBK)).neg_().view(
        num_slots, num_heads, key_dim, key_dim)
    transition_MHKK.diagonal(dim1=-2, dim2=-1).add_(chunk_decay_MHK1[..., 0])   # a scalar gate broadcasts over K
    return transition_MHKK


def _batched(x_nH__: torch.Tensor) -> torch.Tensor:
    """[n, H, a, b] -> [n * H, a, b] (a view: the recurrence's tensors are contiguous)."""
    return x_nH__.view(-1, *x_nH__.shape[2:])


def round_layout(host: RoundHost, chunk_size: int, device: torch.device) -> "_RoundLayout":
    """The round's chunk layout, built once per (geometry, chunk size, device) and shared."""
    return _cached_layout(tuple(host.seq_starts), tuple(host.export_seq), tuple(host.export_chunk),
                          chunk_size, device)


def clear_round_layouts() -> None:
    """Drop every cached round layout. `run_step` calls it when a step ends: the cache serves one step's
    layers, backward and recomputation, while an RL loop's next step has a new plan whose geometries
    rarely repeat, so a process-wide cache would only hold index tensors on the model's device (about
    1 MiB per 65,536-token round, up to ROUND_LAYOUT_CACHE of them)."""
    _cached_layout.cache_clear()


@functools.lru_cache(maxsize=ROUND_LAYOUT_CACHE)
def _cached_layout(seq_starts: tuple, export_seq: tuple, export_chunk: tuple, chunk_size: int,
                   device: torch.device) -> "_RoundLayout":
    # Built as ordinary tensors even when the first call runs under torch.inference_mode(): cached
    # inference tensors would make every later training call with this geometry fail ("Inference
    # tensors cannot be saved for backward"). Ordinary tensors serve both modes.
    with torch.inference_mode(False):
        return _RoundLayout(np.asarray(seq_starts, dtype=np.int64), np.asarray(export_seq, dtype=np.int64),
                            np.asarray(export_chunk, dtype=np.int64), chunk_size, device)


class _RoundLayout:
    """Where each token sits in the padded, step-major chunk layout (built on the host, moved in
    one copy; read-only once built, since it is shared by every call with the same geometry).

    Slot m of the layout holds one chunk; slots of step c (the c-th chunk of
    every sequence that has one) are contiguous, sequences in `order`.
    """

    def __init__(self, seq_starts: np.ndarray, export_seq: np.ndarray, export_chunk: np.ndarray,
                 chunk_size: int, device: torch.device):
        lengths = np.diff(seq_starts)
        num_seqs, num_tokens = len(lengths), int(seq_starts[-1])
        num_chunks = -(-lengths // chunk_size)
        # Stable sort, longest first: the sequences active at step c are a prefix.
        order = np.argsort(-num_chunks, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(num_seqs)
        max_chunks = int(num_chunks.max()) if num_seqs else 0
        step_count = (num_chunks[None, :] > np.arange(max_chunks)[:, None]).sum(axis=1)
        step_start = np.cumsum(step_count) - step_count
        self.num_slots = int(step_count.sum())
        self.chunk_size = chunk_size
        self.step_count = step_count.tolist()

        seq_of_token = np.repeat(np.arange(num_seqs), lengths)
        local = np.arange(num_tokens) - seq_starts[seq_of_token]
        slot = step_start[local // chunk_size] + rank[seq_of_token]
        token_to_flat = slot * chunk_size + local % chunk_size
        flat_to_token = np.full(self.num_slots * chunk_size, num_tokens, dtype=np.int64)
        flat_to_token[token_to_flat] = np.arange(num_tokens)

        # Exports grouped by the step after which they are taken, in the order the pieces come out.
        by_step = np.argsort(export_chunk, kind="stable")
        steps, first = np.unique(export_chunk[by_step], return_index=True)
        inverse = np.empty(len(by_step), dtype=np.int64)
        inverse[by_step] = np.arange(len(by_step))
        groups = np.split(rank[export_seq[by_step]], first[1:])
        moved = to_device([order, token_to_flat, flat_to_token, inverse, *groups], device)
        self.order, self.token_to_flat, self.flat_to_token, self.export_inverse = moved[:4]
        self.export_ranks = dict(zip(steps.tolist(), moved[4:]))

    def to_chunks(self, x_N_: torch.Tensor) -> torch.Tensor:
        """[N, H, ...] -> [M, H, B, ...], padding rows zero."""
        padded = torch.cat([x_N_, x_N_.new_zeros(1, *x_N_.shape[1:])])
        x_MB_ = padded.index_select(0, self.flat_to_token)
        # Contiguous on purpose: torch's CPU matmul takes another BLAS path for a
        # strided batch of one than for several, which would break bitwise
        # independence of a chunk's result from the rest of the round.
        return x_MB_.view(self.num_slots, self.chunk_size, *x_N_.shape[1:]).transpose(1, 2).contiguous()

    def from_chunks(self, x_MHB_: torch.Tensor) -> torch.Tensor:
        """[M, H, B, ...] -> [N, H, ...], dropping padding rows."""
        x_MB_ = x_MHB_.transpose(1, 2).flatten(0, 1)
        return x_MB_.index_select(0, self.token_to_flat)


def subchunk_size(chunk_size: int) -> int:
    """Largest divisor L of B with L * L <= B: balances the J * B * K and L * B * K terms."""
    return max(d for d in range(1, math.isqrt(chunk_size) + 1) if chunk_size % d == 0)


def _intra_chunk_scalar(q_MHBK, k_MHBK, kbeta_MHBK, cum_MHB, chunk_size):
    """A_qk (s <= t) and A_kk (s < t) for a scalar gate: the [B, B] decay is cheap."""
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q_MHBK.device).triu(1)
    decay_MHBB = (cum_MHB[..., :, None] - cum_MHB[..., None, :]).masked_fill(later, float("-inf")).exp()
    aqk_MHBB = (q_MHBK @ k_MHBK.transpose(-1, -2)) * decay_MHBB
    akk_MHBB = ((kbeta_MHBK @ k_MHBK.transpose(-1, -2)) * decay_MHBB).tril(-1)
    return aqk_MHBB, akk_MHBB


def _intra_chunk_per_channel(q_MHBK, k_MHBK, kbeta_MHBK, cum_MHBK, chunk_size):
    """A_qk (s <= t) and A_kk (s < t) for a per-channel gate, without a [B, B, K] tensor."""
    num_slots, num_heads, _, key_dim = q_MHBK.shape
    sub = subchunk_size(chunk_size)
    num_sub = chunk_size // sub
    device = q_MHBK.device
    blocked = (num_slots, num_heads, num_sub, sub, key_dim)
    q_MHJLK, k_MHJLK, kbeta_MHJLK, cum_MHJLK = (x.reshape(blocked) for x in (q_MHBK, k_MHBK, kbeta_MHBK, cum_MHBK))

    # Earlier sub-chunks: factor exp(G_t - G_s) at r, the first token of t's sub-chunk.
    ref_MHJ1K = cum_MHJLK[:, :, :, :1]
    to_ref_MHJLK = (cum_MHJLK - ref_MHJ1K).exp()
    from_ref_MHJBK = ref_MHJ1K - cum_MHBK[:, :, None]  # G_r - G_s for every s of the chunk
    sub_start_J = torch.arange(num_sub, device=device) * sub
    earlier_JB = torch.arange(chunk_size, device=device)[None, :] < sub_start_J[:, None]
    # Masking before exp keeps G_r - G_s > 0 (s at or after r) from overflowing.
    from_ref_MHJBK = from_ref_MHJBK.masked_fill(~earlier_JB[..., None], float("-inf")).exp()
    kcol_MHJKB = (k_MHBK[:, :, None] * from_ref_MHJBK).transpose(-1, -2)
    aqk_MHJLB = (q_MHJLK * to_ref_MHJLK) @ kcol_MHJKB
    akk_MHJLB = (kbeta_MHJLK * to_ref_MHJLK) @ kcol_MHJKB

    # Same sub-chunk: pairwise, [L, L, K] per sub-chunk.
    later_LL = torch.ones(sub, sub, dtype=torch.bool, device=device).triu(1)
    pair_MHJLLK = cum_MHJLK[..., :, None, :] - cum_MHJLK[..., None, :, :]
    pair_MHJLLK = pair_MHJLLK.masked_fill(later_LL[..., None], float("-inf")).exp()
    kpair_MHJLLK = k_MHJLK[..., None, :, :] * pair_MHJLLK
    aqk_MHJLL = (q_MHJLK[..., :, None, :] * kpair_MHJLLK).sum(-1)
    akk_MHJLL = (kbeta_MHJLK[..., :, None, :] * kpair_MHJLLK).sum(-1)

    # Put the diagonal blocks in place (the factored part is exactly zero there).
    eye_J1J1 = torch.eye(num_sub, dtype=q_MHBK.dtype, device=device)[:, None, :, None]
    square = (num_slots, num_heads, chunk_size, chunk_size)
    aqk_MHBB = aqk_MHJLB.reshape(square) + (aqk_MHJLL[..., None, :] * eye_J1J1).reshape(square)
    akk_MHBB = (akk_MHJLB.reshape(square) + (akk_MHJLL[..., None, :] * eye_J1J1).reshape(square)).tril(-1)
    return aqk_MHBB, akk_MHBB
