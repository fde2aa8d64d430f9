"""Compact log-probability recovery: the LM head on compact rows, in blocks.

Legend: C compact rows, D hidden size, V vocabulary, P semantic positions,
A rows some position reads, R rows of one block.

Each semantic position p (a trajectory position i >= 1; or only those the
loss reads, see `harts run --logprobs loss`) reads the logits of the row of
its previous position, `position_row[p]`, at its own label, `position_label[p]`:

    lambda_p = z[row_p, label_p] - logsumexp(z[row_p, :]),   z = hidden @ weight.T

Several positions may share a row with different labels (branches that
diverge right after it); each keeps its own log-probability and its own
gradient. Forward computes logits only for the A rows some position reads.
Backward recomputes each block's logits from the saved hidden rows and
log-sum-exps,

    dL/dz[r] = sum_{p: row_p = r} g_p * (onehot(label_p) - softmax(z[r])),

so no [C, V] or [P, V] tensor is ever saved, and only for rows with a
position that carries a gradient: every other row has dL/dz[r] = 0 exactly
(in RL, positions with loss_mask 0, e.g. prompts and tool outputs), so the
backward's cost follows the loss-weighted positions, not C.

On request the same pass also gives each position the entropy of the
distribution it is drawn from, H_p = logsumexp(z[row_p]) - sum_v pi_v z[row_p, v]
with pi = softmax(z[row_p]) (positions sharing a row share it), whose
gradient adds, per row, -sum_{p: row_p = r} h_p * pi * (z[r] - sum_v pi_v z[r, v])
for incoming entropy gradients h_p.
"""
from __future__ import annotations

import torch


def _block_starts(num_rows: int, block_rows: int) -> range:
    return range(0, num_rows, block_rows)


class _CompactLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_CD, weight_VD, position_row_P, position_label_P, block_rows: int, with_entropy: bool):
        compute = torch.promote_types(hidden_CD.dtype, torch.float32)
        device = hidden_CD.device
        weight_c = weight_VD.to(compute)
        # Only rows some position reads need logits (a leaf's last row predicts nothing; with
        # positions limited to the loss, most rows of a prompt or tool output are not read).
        read_A, slot_P = torch.unique(position_row_P, return_inverse=True)
        A = read_A.shape[0]
        lse_A = torch.empty(A, dtype=compute, device=device)
        entropy_A = torch.empty(A if with_entropy else 0, dtype=compute, device=device)
        # Sort positions by slot once so each block reads a contiguous slice.
        order_P = torch.argsort(slot_P, stable=True)
        # Block boundaries read once (one wait for the device per call, not one per block).
        bounds = torch.searchsorted(slot_P[order_P],
                                    torch.arange(0, A + block_rows, block_rows, device=device)).tolist()
        target_P = torch.empty(position_row_P.shape[0], dtype=compute, device=device)
        for b, start in enumerate(_block_starts(A, block_rows)):
            logits_RV = hidden_CD[read_A[start:start + block_rows]].to(compute) @ weight_c.T
            if with_entropy:
                # One exponential pass serves both: lse = m + log sum e, E_pi[z] = sum e z / sum e.
                # In place where possible: a block of logits is the op's largest buffer (R x V).
                peak_R = logits_RV.amax(dim=-1, keepdim=True)
                scaled_RV = logits_RV.sub(peak_R).exp_()
                total_R = scaled_RV.sum(dim=-1)
                lse_R = peak_R.squeeze(1) + torch.log(total_R)
                entropy_A[start:start + block_rows] = lse_R - scaled_RV.mul_(logits_RV).sum(dim=-1) / total_R
            else:
                lse_R = torch.logsumexp(logits_RV, dim=-1)
            lse_A[start:start + block_rows] = lse_R
            picked = order_P[bounds[b]:bounds[b + 1]]
            target_P[picked] = logits_RV[slot_P[picked] - start, position_label_P[picked]]
        ctx.save_for_backward(hidden_CD, weight_VD, position_label_P, read_A, slot_P, lse_A, entropy_A)
        ctx.block_rows = block_rows
        entropy_P = entropy_A[slot_P] if with_entropy else entropy_A
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy_P,)))
        # An output the loss never used arrives as None, not zeros: entropies that are only reported cost the
        # backward no pass over them (and on a GPU, no nonzero() wait).
        ctx.set_materialize_grads(False)
        return target_P - lse_A[slot_P], entropy_P

    @staticmethod
    def backward(ctx, grad_P, grad_entropy_P):
        hidden_CD, weight_VD, position_label_P, read_A, slot_P, lse_A, entropy_A = ctx.saved_tensors
        block_rows = ctx.block_rows
        compute = lse_A.dtype
        device = hidden_CD.device
        weight_c = weight_VD.to(compute)
        grad_P = torch.zeros_like(lse_A[slot_P]) if grad_P is None else grad_P.to(compute)
        A = read_A.shape[0]
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden_CD, dtype=compute) if need_hidden else None
        grad_weight = torch.zeros_like(weight_c) if need_weight else None
        # Sum of incoming gradients per read row: the weight of that row's softmax term.
        row_grad_A = torch.zeros(A, dtype=compute, device=device).index_add_(0, slot_P, grad_P)
        # Only positions with a gradient contribute; only their rows need logits again.
        live_L = torch.nonzero(grad_P).squeeze(1)
        live_rows = slot_P[live_L]
        row_entropy_grad_A = None
        live_H = torch.nonzero(grad_entropy_P).squeeze(1) if grad_entropy_P is not None else slot_P[:0]
        if live_H.numel():   # entropies asked for but never used in the loss cost no backward work
            grad_entropy_P = grad_entropy_P.to(compute)
            row_entropy_grad_A = torch.zeros(A, dtype=compute, device=device).index_add_(0, slot_P, grad_entropy_P)
            live_rows = torch.cat([live_rows, slot_P[live_H]])
        active_S = torch.unique(live_rows)                               # read-row slots, sorted
        S = active_S.shape[0]
        rank_of_slot_A = torch.full((A,), -1, dtype=torch.long, device=device)
        rank_of_slot_A[active_S] = torch.arange(S, device=device)
        rank_L = rank_of_slot_A[slot_P[live_L]]
        order_L = torch.argsort(rank_L, stable=True)
        live_L, rank_L = live_L[order_L], rank_L[order_L]
        bounds = torch.searchsorted(rank_L, torch.arange(0, S + block_rows, block_rows, device=device)).tolist()
        for b, start in enumerate(_block_starts(S, block_rows)):
            slots_R = active_S[start:start + block_rows]
            rows_R = read_A[slots_R]
            hidden_RD = hidden_CD[rows_R].to(compute)
            logits_RV = hidden_RD @ weight_c.T
            # In place: two R x V buffers (the logits, then the softmax turned into the gradient).
            grad_logits_RV = logits_RV.sub(lse_A[slots_R, None]).exp_()
            if row_entropy_grad_A is not None:
                # dH/dz = -pi * (z - E_pi[z]), with E_pi[z] = lse - H; the logits become the per-entry weight.
                expected_R = lse_A[slots_R] - entropy_A[slots_R]
                weight_RV = logits_RV.sub_(expected_R[:, None]).mul_(row_entropy_grad_A[slots_R, None])
                grad_logits_RV.mul_(weight_RV.add_(row_grad_A[slots_R, None])).neg_()
            else:
                grad_logits_RV.mul_(row_grad_A[slots_R, None]).neg_()
            lo, hi = bounds[b], bounds[b + 1]
            picked = live_L[lo:hi]
            grad_logits_RV.index_put_((rank_L[lo:hi] - start, position_label_P[picked]), grad_P[picked],
                                      accumulate=True)
            if need_hidden:
                grad_hidden[rows_R] = grad_logits_RV @ weight_c
            if need_weight:
                grad_weight += grad_logits_RV.T @ hidden_RD
        return (grad_hidden.to(hidden_CD.dtype) if need_hidden else None,
                grad_weight.to(weight_VD.dtype) if need_weight else None, None, None, None, None)


def _check(hidden_CD, weight_VD, position_row_P, position_label_P, block_rows: int) -> None:
    if hidden_CD.dim() != 2 or weight_VD.dim() != 2 or hidden_CD.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"hidden must be [C, D] and weight [V, D], got {tuple(hidden_CD.shape)} and {tuple(weight_VD.shape)}")
    if position_row_P.shape != position_label_P.shape or position_row_P.dim() != 1:
        raise ValueError(f"position rows and labels must be equal-length vectors, got {tuple(position_row_P.shape)} "
                         f"and {tuple(position_label_P.shape)}")
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")


def position_logprobs(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, position_row_P: torch.Tensor,
                      position_label_P: torch.Tensor, *, block_rows: int = 1024) -> torch.Tensor:
    """Log-probability of every semantic position, [P], in the compute dtype (float32 for bf16).

    hidden_CD: final hidden states of the compact rows (after the last norm);
    weight_VD: the LM head's weight; position_row_P / position_label_P: int64.
    """
    _check(hidden_CD, weight_VD, position_row_P, position_label_P, block_rows)
    logprobs, _ = _CompactLogprobs.apply(hidden_CD, weight_VD, position_row_P.long(), position_label_P.long(),
                                         block_rows, False)
    return logprobs


def position_logprobs_and_entropy(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, position_row_P: torch.Tensor,
                                  position_label_P: torch.Tensor, *,
                                  block_rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(`position_logprobs`, the entropy of each position's predictive distribution), both [P] and
    differentiable, from one pass over the logits (one extra elementwise product per block)."""
    _check(hidden_CD, weight_VD, position_row_P, position_label_P, block_rows)
    return _CompactLogprobs.apply(hidden_CD, weight_VD, position_row_P.long(), position_label_P.long(),
                                  block_rows, True)
