"""Compact log-probability recovery: the LM head on compact rows, in blocks.

Legend: C compact rows, D hidden size, V vocabulary, P semantic positions,
A rows some position reads, R rows of one block, G positions whose row's
normalizer is supplied by the caller.

Each semantic position p (a trajectory position i >= 1; or only those the
loss reads, see `harts run --logprobs loss`) reads the logits of the row of
its previous position, `position_row[p]`, at its own label, `position_label[p]`:

    lambda_p = z[row_p, label_p] - logsumexp(z[row_p, :]),   z = hidden @ weight.T

The log-sum-exp (the row's *normalizer*) is the [R, V] work; the label logit
is one dot product. Several positions may share a row with different labels
(branches that diverge right after it); each keeps its own log-probability
and its own gradient, and the row's normalizer is computed once. Forward
computes logits only for the A rows some position reads. Backward recomputes
each block's logits from the saved hidden rows and log-sum-exps,

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

`SuppliedNormalizers` lets a caller that already owns some rows' normalizers
(a window consumer: its producer computes each cached row's once for all the
window's consumers, `row_normalizers`) skip their [R, V] work here: those
positions get only their label logit from this op, minus the supplied
normalizer (and the supplied entropy), differentiably.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# Positions per block of label-logit dot products: bounds the two [block, D] gathers.
LABEL_BLOCK_POSITIONS = 8192


class SuppliedNormalizers(NamedTuple):
    """Normalizers the caller computed elsewhere, for some positions: `lse[j]` (and `entropy[j]`,
    when entropies are asked for) belong to position `positions[j]`. Differentiable tensors."""
    positions: torch.Tensor        # [G] int64, distinct
    lse: torch.Tensor              # [G]
    entropy: torch.Tensor | None   # [G], or None when no entropy is asked for


def _block_starts(num_rows: int, block_rows: int) -> range:
    return range(0, num_rows, block_rows)


class _BlockBuffers:
    """[R, V] buffers that every block of one call reuses (a view of their first rows for the last block).

    A block of logits is the op's largest tensor (1024 x 150k floats is 600 MB), and allocating one per
    block costs more than computing it where the allocator hands large blocks back to the system: on CPU
    (glibc) each fresh block is page-faulted in again. Measured on 2 CPU cores, [1024, 32000] logits from
    64-wide rows: 82 ms for a fresh product against 32 ms into a reused buffer, and 150 against 58 ms for
    a block's log-sum-exp. Every op that writes one overwrites it whole, so stale values never leak.
    """

    def __init__(self, rows: int, like: torch.Tensor, count: int):
        self._buffers = [like.new_empty(rows, like.shape[0]) for _ in range(count)]

    def logits(self, hidden_RD: torch.Tensor, weight_c: torch.Tensor) -> torch.Tensor:
        """hidden_RD @ weight_c.T into the first buffer."""
        return torch.matmul(hidden_RD, weight_c.T, out=self._buffers[0][:hidden_RD.shape[0]])

    def scratch(self, rows: int) -> torch.Tensor:
        return self._buffers[1][:rows]


def _log_sum_exp_(logits_RV: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp over the last dim, the same operations in the same order (max shifted, an infinite
    max taken as 0), but consuming `logits_RV` in place instead of allocating its shifted copy."""
    peak_R1 = logits_RV.amax(dim=-1, keepdim=True)
    peak_R1.masked_fill_(peak_R1.abs() == float("inf"), 0)
    return logits_RV.sub_(peak_R1).exp_().sum(dim=-1).log_().add_(peak_R1.squeeze(1))


def _normalizer_blocks(hidden_CD, weight_c, read_A, block_rows: int, with_entropy: bool, on_block=None):
    """(lse_A, entropy_A) of the rows' logits, one block of rows at a time; `on_block(b, start, logits_RV)`
    sees each block's logits before they are overwritten (entropy_A is empty without `with_entropy`)."""
    compute = weight_c.dtype
    A = read_A.shape[0]
    lse_A = torch.empty(A, dtype=compute, device=hidden_CD.device)
    entropy_A = torch.empty(A if with_entropy else 0, dtype=compute, device=hidden_CD.device)
    buffers = _BlockBuffers(min(block_rows, A), weight_c, 2 if with_entropy else 1)
    for b, start in enumerate(_block_starts(A, block_rows)):
        logits_RV = buffers.logits(hidden_CD[read_A[start:start + block_rows]].to(compute), weight_c)
        if on_block is not None:
            on_block(b, start, logits_RV)
        if with_entropy:
            # One exponential pass serves both: lse = m + log sum e, E_pi[z] = sum e z / sum e.
            peak_R = logits_RV.amax(dim=-1, keepdim=True)
            scaled_RV = torch.sub(logits_RV, peak_R, out=buffers.scratch(logits_RV.shape[0])).exp_()
            total_R = scaled_RV.sum(dim=-1)
            lse_R = peak_R.squeeze(1) + torch.log(total_R)
            entropy_A[start:start + block_rows] = lse_R - scaled_RV.mul_(logits_RV).sum(dim=-1) / total_R
        else:
            lse_R = _log_sum_exp_(logits_RV)
        lse_A[start:start + block_rows] = lse_R
    return lse_A, entropy_A


def _normalizer_gradient_blocks(hidden_CD, weight_c, read_A, active_S, lse_A, entropy_A, row_grad_A,
                                row_entropy_grad_A, block_rows: int, grad_hidden, grad_weight, on_block=None) -> None:
    """Accumulate into grad_hidden / grad_weight the normalizers' (and entropies') gradient for the
    read-row slots `active_S`: dL/dz[r] = -softmax(z[r]) * (row_grad[r] + entropy_grad[r] * (z[r] - E_pi[z[r]])),
    where row_grad[r] is the gradient arriving at -lse[r] (the sum of its log-probabilities' gradients).
    `on_block(b, start, grad_logits_RV)` may add the label terms of the block's positions first."""
    with_entropy = row_entropy_grad_A is not None
    buffers = _BlockBuffers(min(block_rows, active_S.shape[0]), weight_c, 2 if with_entropy else 1)
    for b, start in enumerate(_block_starts(active_S.shape[0], block_rows)):
        slots_R = active_S[start:start + block_rows]
        rows_R = read_A[slots_R]
        hidden_RD = hidden_CD[rows_R].to(weight_c.dtype)
        logits_RV = buffers.logits(hidden_RD, weight_c)
        if with_entropy:
            # The softmax goes to the scratch buffer: the logits become the per-entry weight,
            # dH/dz = -pi * (z - E_pi[z]), with E_pi[z] = lse - H.
            grad_logits_RV = torch.sub(logits_RV, lse_A[slots_R, None], out=buffers.scratch(len(slots_R))).exp_()
            expected_R = lse_A[slots_R] - entropy_A[slots_R]
            weight_RV = logits_RV.sub_(expected_R[:, None]).mul_(row_entropy_grad_A[slots_R, None])
            grad_logits_RV.mul_(weight_RV.add_(row_grad_A[slots_R, None])).neg_()
        else:
            grad_logits_RV = logits_RV.sub_(lse_A[slots_R, None]).exp_().mul_(row_grad_A[slots_R, None]).neg_()
        if on_block is not None:
            on_block(b, start, grad_logits_RV)
        if grad_hidden is not None:
            grad_hidden.index_add_(0, rows_R, grad_logits_RV @ weight_c)
        if grad_weight is not None:
            # Accumulated in place: `+= A @ B` would first build a [V, D] product, a second LM-head-weight-
            # sized buffer per block (1.2-1.5 GB in float32 for the 150k-160k vocabularies of Qwen3-Next
            # and Kimi Linear at their hidden sizes).
            grad_weight.addmm_(grad_logits_RV.T, hidden_RD)


def _label_logits(hidden_CD, weight_c, rows_G, labels_G) -> torch.Tensor:
    """z[row_g, label_g] = hidden[row_g] . weight[label_g], in blocks of positions."""
    out = torch.empty(rows_G.shape[0], dtype=weight_c.dtype, device=hidden_CD.device)
    for start in range(0, rows_G.shape[0], LABEL_BLOCK_POSITIONS):
        end = start + LABEL_BLOCK_POSITIONS
        out[start:end] = (hidden_CD[rows_G[start:end]].to(weight_c.dtype) * weight_c[labels_G[start:end]]).sum(-1)
    return out


def _label_logit_gradients(hidden_CD, weight_c, rows_G, labels_G, grad_G, grad_hidden, grad_weight) -> None:
    """d z[row, label] = onehot terms of positions whose normalizer is not this op's (zero gradients skipped)."""
    live = torch.nonzero(grad_G).squeeze(1)
    rows_G, labels_G, grad_G = rows_G[live], labels_G[live], grad_G[live]
    for start in range(0, rows_G.shape[0], LABEL_BLOCK_POSITIONS):
        end = start + LABEL_BLOCK_POSITIONS
        g = grad_G[start:end, None]
        if grad_hidden is not None:
            grad_hidden.index_add_(0, rows_G[start:end], g * weight_c[labels_G[start:end]])
        if grad_weight is not None:
            grad_weight.index_add_(0, labels_G[start:end], g * hidden_CD[rows_G[start:end]].to(weight_c.dtype))


def _gradient_buffers(ctx, hidden_CD, weight_c):
    grad_hidden = torch.zeros_like(hidden_CD, dtype=weight_c.dtype) if ctx.needs_input_grad[0] else None
    grad_weight = torch.zeros_like(weight_c) if ctx.needs_input_grad[1] else None
    return grad_hidden, grad_weight


def _returned(grad, like):
    return None if grad is None else grad.to(like.dtype)


class _CompactLogprobs(torch.autograd.Function):
    """Label logit minus own normalizer for the positions in `own_O`; the label logit alone for `given_G`.
    Both None (the usual case): every position is the op's own, and nothing is gathered by them."""

    @staticmethod
    def forward(ctx, hidden_CD, weight_VD, position_row_P, position_label_P, own_O, given_G, block_rows: int,
                with_entropy: bool):
        compute = torch.promote_types(hidden_CD.dtype, torch.float32)
        device = hidden_CD.device
        weight_c = weight_VD.to(compute)
        P = position_row_P.shape[0]
        every_position = given_G is None
        own_rows, own_labels = ((position_row_P, position_label_P) if every_position
                                else (position_row_P[own_O], position_label_P[own_O]))
        # Only rows some position reads need logits (a leaf's last row predicts nothing; with
        # positions limited to the loss, most rows of a prompt or tool output are not read).
        read_A, slot_O = torch.unique(own_rows, return_inverse=True)
        A = read_A.shape[0]
        # Sort positions by slot once so each block reads a contiguous slice.
        order_O = torch.argsort(slot_O, stable=True)
        # Block boundaries read once (one wait for the device per call, not one per block).
        bounds = torch.searchsorted(slot_O[order_O],
                                    torch.arange(0, A + block_rows, block_rows, device=device)).tolist()
        target_O = torch.empty(own_rows.shape[0], dtype=compute, device=device)

        def pick_targets(b, start, logits_RV):
            picked = order_O[bounds[b]:bounds[b + 1]]
            target_O[picked] = logits_RV[slot_O[picked] - start, own_labels[picked]]

        lse_A, entropy_A = _normalizer_blocks(hidden_CD, weight_c, read_A, block_rows, with_entropy, pick_targets)
        if every_position:
            out_P = target_O - lse_A[slot_O]
            entropy_P = entropy_A[slot_O] if with_entropy else entropy_A
        else:
            out_P = torch.empty(P, dtype=compute, device=device)
            out_P[own_O] = target_O - lse_A[slot_O]
            out_P[given_G] = _label_logits(hidden_CD, weight_c, position_row_P[given_G], position_label_P[given_G])
            entropy_P = hidden_CD.new_zeros(P if with_entropy else 0, dtype=compute)
            if with_entropy:
                entropy_P[own_O] = entropy_A[slot_O]
        ctx.save_for_backward(hidden_CD, weight_VD, position_row_P, position_label_P, own_O, given_G, read_A, slot_O,
                              lse_A, entropy_A)
        ctx.block_rows = block_rows
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy_P,)))
        # An output the loss never used arrives as None, not zeros: entropies that are only reported cost the
        # backward no pass over them (and on a GPU, no nonzero() wait).
        ctx.set_materialize_grads(False)
        return out_P, entropy_P

    @staticmethod
    def backward(ctx, grad_P, grad_entropy_P):
        (hidden_CD, weight_VD, position_row_P, position_label_P, own_O, given_G, read_A, slot_O, lse_A,
         entropy_A) = ctx.saved_tensors
        block_rows = ctx.block_rows
        compute = lse_A.dtype
        device = hidden_CD.device
        weight_c = weight_VD.to(compute)
        grad_P = lse_A.new_zeros(position_row_P.shape[0]) if grad_P is None else grad_P.to(compute)
        grad_hidden, grad_weight = _gradient_buffers(ctx, hidden_CD, weight_c)
        every_position = given_G is None
        grad_O, own_labels = (grad_P, position_label_P) if every_position else (grad_P[own_O], position_label_P[own_O])
        A = read_A.shape[0]
        # Sum of incoming gradients per read row: the weight of that row's softmax term.
        row_grad_A = torch.zeros(A, dtype=compute, device=device).index_add_(0, slot_O, grad_O)
        # Only positions with a gradient contribute; only their rows need logits again.
        live_L = torch.nonzero(grad_O).squeeze(1)
        live_rows = slot_O[live_L]
        row_entropy_grad_A = None
        grad_entropy_O = grad_entropy_P if grad_entropy_P is None or every_position else grad_entropy_P[own_O]
        live_H = torch.nonzero(grad_entropy_O).squeeze(1) if grad_entropy_O is not None else slot_O[:0]
        if live_H.numel():   # entropies asked for but never used in the loss cost no backward work
            row_entropy_grad_A = torch.zeros(A, dtype=compute, device=device).index_add_(
                0, slot_O, grad_entropy_O.to(compute))
            live_rows = torch.cat([live_rows, slot_O[live_H]])
        active_S = torch.unique(live_rows)                               # read-row slots, sorted
        S = active_S.shape[0]
        rank_of_slot_A = torch.full((A,), -1, dtype=torch.long, device=device)
        rank_of_slot_A[active_S] = torch.arange(S, device=device)
        rank_L = rank_of_slot_A[slot_O[live_L]]
        order_L = torch.argsort(rank_L, stable=True)
        live_L, rank_L = live_L[order_L], rank_L[order_L]
        bounds = torch.searchsorted(rank_L, torch.arange(0, S + block_rows, block_rows, device=device)).tolist()

        def add_label_terms(b, start, grad_logits_RV):
            lo, hi = bounds[b], bounds[b + 1]
            picked = live_L[lo:hi]
            grad_logits_RV.index_put_((rank_L[lo:hi] - start, own_labels[picked]), grad_O[picked], accumulate=True)

        _normalizer_gradient_blocks(hidden_CD, weight_c, read_A, active_S, lse_A, entropy_A, row_grad_A,
                                    row_entropy_grad_A, block_rows, grad_hidden, grad_weight, add_label_terms)
        if not every_position:
            _label_logit_gradients(hidden_CD, weight_c, position_row_P[given_G], position_label_P[given_G],
                                   grad_P[given_G], grad_hidden, grad_weight)
        return (_returned(grad_hidden, hidden_CD), _returned(grad_weight, weight_VD),
                None, None, None, None, None, None)


class _RowNormalizers(torch.autograd.Function):
    """Each listed row's log-sum-exp (and entropy): the [R, V] half of a log-probability, for a caller that
    shares it among positions it serves elsewhere (a window producer's cached rows)."""

    @staticmethod
    def forward(ctx, hidden_CD, weight_VD, rows_A, block_rows: int, with_entropy: bool):
        weight_c = weight_VD.to(torch.promote_types(hidden_CD.dtype, torch.float32))
        lse_A, entropy_A = _normalizer_blocks(hidden_CD, weight_c, rows_A, block_rows, with_entropy)
        ctx.save_for_backward(hidden_CD, weight_VD, rows_A, lse_A, entropy_A)
        ctx.block_rows = block_rows
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy_A,)))
        ctx.set_materialize_grads(False)
        return lse_A, entropy_A

    @staticmethod
    def backward(ctx, grad_lse_A, grad_entropy_A):
        hidden_CD, weight_VD, rows_A, lse_A, entropy_A = ctx.saved_tensors
        weight_c = weight_VD.to(lse_A.dtype)
        # The shared gradient helper takes the gradient at -lse (a log-probability's).
        row_grad_A = lse_A.new_zeros(lse_A.shape) if grad_lse_A is None else -grad_lse_A.to(lse_A.dtype)
        live = row_grad_A != 0
        row_entropy_grad_A = None
        if grad_entropy_A is not None and grad_entropy_A.numel():
            row_entropy_grad_A = grad_entropy_A.to(lse_A.dtype)
            live |= row_entropy_grad_A != 0
        grad_hidden, grad_weight = _gradient_buffers(ctx, hidden_CD, weight_c)
        _normalizer_gradient_blocks(hidden_CD, weight_c, rows_A, torch.nonzero(live).squeeze(1), lse_A, entropy_A,
                                    row_grad_A, row_entropy_grad_A, ctx.block_rows, grad_hidden, grad_weight)
        return _returned(grad_hidden, hidden_CD), _returned(grad_weight, weight_VD), None, None, None


def _check(hidden_CD, weight_VD, position_row_P, position_label_P, block_rows: int) -> None:
    if hidden_CD.dim() != 2 or weight_VD.dim() != 2 or hidden_CD.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"hidden must be [C, D] and weight [V, D], got {tuple(hidden_CD.shape)} and {tuple(weight_VD.shape)}")
    if position_row_P.shape != position_label_P.shape or position_row_P.dim() != 1:
        raise ValueError(f"position rows and labels must be equal-length vectors, got {tuple(position_row_P.shape)} "
                         f"and {tuple(position_label_P.shape)}")
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")


def _own_and_given(num_positions: int, supplied: SuppliedNormalizers | None, device) -> tuple:
    """(own_O, given_G) for `_CompactLogprobs`; (None, None) when no position's normalizer is supplied."""
    if supplied is None or supplied.positions.numel() == 0:
        return None, None
    given_G = supplied.positions.long()
    own = torch.ones(num_positions, dtype=torch.bool, device=device)
    own[given_G] = False
    return torch.nonzero(own).squeeze(1), given_G


def _logprobs(hidden_CD, weight_VD, position_row_P, position_label_P, block_rows: int, with_entropy: bool,
              supplied: SuppliedNormalizers | None):
    _check(hidden_CD, weight_VD, position_row_P, position_label_P, block_rows)
    if supplied is not None and with_entropy and supplied.entropy is None:
        raise ValueError("entropies were asked for, but the supplied normalizers carry none")
    own_O, given_G = _own_and_given(position_row_P.shape[0], supplied, hidden_CD.device)
    logprobs, entropy = _CompactLogprobs.apply(hidden_CD, weight_VD, position_row_P.long(), position_label_P.long(),
                                               own_O, given_G, block_rows, with_entropy)
    if given_G is not None:
        logprobs = logprobs.index_add(0, given_G, supplied.lse.to(logprobs.dtype), alpha=-1)
        if with_entropy:
            entropy = entropy.index_add(0, given_G, supplied.entropy.to(entropy.dtype))
    return logprobs, entropy


def position_logprobs(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, position_row_P: torch.Tensor,
                      position_label_P: torch.Tensor, *, block_rows: int = 1024,
                      supplied: SuppliedNormalizers | None = None) -> torch.Tensor:
    """Log-probability of every semantic position, [P], in the compute dtype (float32 for bf16).

    hidden_CD: final hidden states of the compact rows (after the last norm);
    weight_VD: the LM head's weight; position_row_P / position_label_P: int64.
    `supplied`: positions whose row's normalizer the caller provides (their rows get no [R, V] work here).
    """
    return _logprobs(hidden_CD, weight_VD, position_row_P, position_label_P, block_rows, False, supplied)[0]


def position_logprobs_and_entropy(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, position_row_P: torch.Tensor,
                                  position_label_P: torch.Tensor, *, block_rows: int = 1024,
                                  supplied: SuppliedNormalizers | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(`position_logprobs`, the entropy of each position's predictive distribution), both [P] and
    differentiable, from one pass over the logits (one extra elementwise product per block)."""
    return _logprobs(hidden_CD, weight_VD, position_row_P, position_label_P, block_rows, True, supplied)


def row_normalizers(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, rows_A: torch.Tensor, *,
                    with_entropy: bool = False, block_rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp(z[row]), entropy of softmax(z[row])) for each listed row, [A] each, differentiable
    (the entropy is empty without `with_entropy`); backward recomputes logits only for rows whose
    normalizer or entropy carries a nonzero gradient. Rows may repeat (each gets its own entry)."""
    _check(hidden_CD, weight_VD, rows_A, rows_A, block_rows)
    return _RowNormalizers.apply(hidden_CD, weight_VD, rows_A.long(), block_rows, with_entropy)
