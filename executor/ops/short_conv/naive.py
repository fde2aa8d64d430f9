"""The specification: expand each trajectory, run F.conv1d on it alone, keep its own rows.

For every member that created rows, gather its whole path [n, C], apply the
models' causal depthwise conv (`F.conv1d`, left padding W - 1, groups=C) and
the activation, and write the outputs at its own positions back to their
rows. Loops over members on purpose: it is what `gather.py` is tested against.

Legend: R compact rows, C channels, W taps, n path length.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from harts.executor.ops.dtypes import compute_dtype_for

from .gather import weight_CW


def member_paths(member_own_start, member_run_offsets, run_row_start, run_length):
    """(rows of positions 0..n-1, own_start) for every member of a microbatch, from the plan arrays."""
    offsets = np.asarray(member_run_offsets)
    paths = []
    for i, own_start in enumerate(np.asarray(member_own_start).tolist()):
        runs = range(int(offsets[i]), int(offsets[i + 1]))
        rows = np.concatenate([np.arange(run_row_start[j], run_row_start[j] + run_length[j]) for j in runs] or [[]])
        paths.append((rows.astype(np.int64), int(own_start)))
    return paths


def naive_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    member_own_start,
    member_run_offsets,
    run_row_start,
    run_length,
    activation: str | None = "silu",
) -> torch.Tensor:
    """`short_conv`'s function, computed per trajectory from the plan's member arrays; returns [R, C]."""
    dtype = compute_dtype_for(x.dtype)
    w_C1W = weight_CW(weight).to(dtype)[:, None, :]
    taps = w_C1W.shape[-1]
    b_C = bias.to(dtype) if bias is not None else None
    outputs, rows = [], []
    for path, own_start in member_paths(member_own_start, member_run_offsets, run_row_start, run_length):
        if own_start >= len(path):
            continue  # created no row: a duplicate or strict prefix
        path_n = torch.from_numpy(path).to(x.device)
        x_1Cn = x.to(dtype).index_select(0, path_n).T[None]
        y_Cn = F.conv1d(x_1Cn, w_C1W, b_C, padding=taps - 1, groups=x.shape[1])[0, :, : len(path)]
        if activation is not None:
            y_Cn = F.silu(y_Cn)
        outputs.append(y_Cn.T[own_start:])
        rows.append(path_n[own_start:])
    order = torch.argsort(torch.cat(rows))
    return torch.cat(outputs)[order].to(x.dtype)
