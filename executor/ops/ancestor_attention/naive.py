"""The specification: expand each view's trajectory, plain causal attention in float64.

For every member that created rows, gather its whole path [n, H, D], run
softmax(q k^T * scale + causal mask) v on it as if it were alone, and keep the
outputs at its own positions. It materialises [H, n, n] per member and the
trajectory-expanded inputs: slow and memory-hungry on purpose, it is what
`blocked.py` is tested against.

Legend: R compact rows, n path length, H query heads, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import torch

from .blocked import check_inputs
from .views import AttentionViews


def naive_ancestor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    views: AttentionViews,
    scale: float | None = None,
) -> torch.Tensor:
    """Same arguments (no block budget) and result as `ancestor_attention`; see there."""
    check_inputs(q, k, v, views, scale, 1)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.to(torch.float64) for x in (q, k, v))
    if views.query_slot is not None:   # queries only on some rows: place them on a full row tensor
        full = q64.new_zeros(views.num_rows, *q64.shape[1:])
        queried = torch.from_numpy(views.query_slot >= 0)
        full[queried] = q64[torch.from_numpy(views.query_slot[views.query_slot >= 0])]
        q64 = full
    outputs, rows = [], []
    for view in range(views.num_views):
        path = torch.from_numpy(views.key_rows(view, view + 1)).to(q.device)
        n, own_start = path.numel(), int(views.view_query_start[view])
        q_nHD = q64.index_select(0, path)
        # Query head h reads kv head h // group, as transformers' repeat_kv does.
        k_nHD = k64.index_select(0, path).repeat_interleave(group, dim=1)
        v_nHD = v64.index_select(0, path).repeat_interleave(group, dim=1)
        scores_Hnn = torch.einsum("qhd,khd->hqk", q_nHD, k_nHD) * scale
        causal_nn = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        probs_Hnn = scores_Hnn.masked_fill(~causal_nn, float("-inf")).softmax(dim=-1)
        o_nHD = torch.einsum("hqk,khd->qhd", probs_Hnn, v_nHD)
        outputs.append(o_nHD[own_start:])
        rows.append(path[own_start:])
    if not outputs:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    # Every row is some view's own row exactly once: undo the concatenation order.
    slots = torch.cat(rows)
    if views.query_slot is not None:
        slots = torch.from_numpy(views.query_slot)[slots]
    order = torch.argsort(slots)
    return torch.cat(outputs)[order].to(q.dtype)
