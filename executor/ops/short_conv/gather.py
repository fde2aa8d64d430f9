"""Short causal depthwise convolution over compact rows, with true ancestor context.

KDA (Kimi Linear) and Gated DeltaNet (Qwen3-Next) pass the concatenated q, k, v
projections through `nn.Conv1d(C, C, W, groups=C, padding=W - 1, bias=False)`,
keep the first T outputs (causal) and apply SiLU; W is
`linear_conv_kernel_dim` (4 in both configs). Over compact rows the window of
row r must be its path, [ancestor^{W-1}(r), ..., parent(r), r] with zeros
before position 0, never the rows that happen to sit before r in memory: a
fork's first own row reads the shared prefix it hangs below.

`conv_context` turns `row_parent` into the window rows once per microbatch:
W - 1 vectorised gathers of the plan's `row_parent` (the W - 1 nearest
ancestors of every row). This is the one place the executor follows parent
links, and deliberately: storing the [R, W - 1] window table in the plan
would add W - 1 = 3 int32 per row to the 4 the row tables hold, for
three gathers' work; what it computes (the conv window) is fixed by the
model, not a planning decision. `short_conv` gathers the windows and is its own autograd Function so
that backward saves only x and the pre-activation, and sums the gradient of
every window a row appears in (a fork's parent feeds each child's window).

Legend: R compact rows, C channels, W kernel size (taps).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from harts.executor.ops.dtypes import compute_dtype_for
from harts.executor.ops.transfer import to_device

ACTIVATIONS = (None, "silu", "swish")  # transformers' ACT2FN: "swish" is SiLU too


def conv_context(row_parent: np.ndarray | torch.Tensor, kernel_size: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Window rows [R, W]: column W - 1 is r, column W - 1 - j its j-th ancestor, -1 before position 0.

    Invariant relied on: `row_parent[r]` is -1 or < r (checked), so every walk ends.
    """
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
        raise ValueError(f"kernel_size must be a positive int, got {kernel_size!r}")
    parent_R = torch.as_tensor(np.asarray(row_parent) if not isinstance(row_parent, torch.Tensor) else row_parent)
    if parent_R.dim() != 1 or parent_R.is_floating_point() or parent_R.dtype == torch.bool:
        raise ValueError(f"row_parent must be a 1-D integer array, got dtype {parent_R.dtype} and shape "
                         f"{tuple(parent_R.shape)}")
    # Built on the host and moved once: the walk and its check would each wait for a device.
    target = torch.device(device) if device is not None else parent_R.device
    parent_R = parent_R.to(device="cpu", dtype=torch.long)
    rows_R = torch.arange(parent_R.numel())
    if bool(((parent_R >= rows_R) | (parent_R < -1)).any()):
        bad = int(torch.nonzero((parent_R >= rows_R) | (parent_R < -1))[0])
        raise ValueError(f"row_parent[r] must be -1 or < r, got row_parent[{bad}] = {int(parent_R[bad])}")
    columns = [rows_R]
    ancestor_R = rows_R
    for _ in range(kernel_size - 1):
        # -1 stays -1: before position 0 there is nothing (the conv's zero padding).
        ancestor_R = torch.where(ancestor_R >= 0, parent_R[ancestor_R.clamp(min=0)], ancestor_R)
        columns.append(ancestor_R)
    return to_device([torch.stack(columns[::-1], dim=1)], target)[0]


def weight_CW(weight: torch.Tensor) -> torch.Tensor:
    """Accept the kernels' [C, W] and nn.Conv1d's [C, 1, W] layouts."""
    return weight[:, 0, :] if weight.dim() == 3 else weight


def check_inputs(x, weight, bias, context, activation) -> None:
    """Validate the public arguments; raise ValueError saying what was got."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating torch.Tensor, got {got}")
    if x.dim() != 2:
        raise ValueError(f"x must be [R, C], got shape {tuple(x.shape)}")
    num_rows, channels = x.shape
    if not (weight.dim() == 2 or (weight.dim() == 3 and weight.shape[1] == 1)) or weight.shape[0] != channels:
        raise ValueError(f"weight must be [C={channels}, W] or [C={channels}, 1, W], got shape {tuple(weight.shape)}")
    taps = weight.shape[-1]
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (channels,)):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be None or [C={channels}], got {got}")
    if (not isinstance(context, torch.Tensor) or context.is_floating_point() or context.dim() != 2
            or context.shape[1] != taps):
        got = (context.dtype, tuple(context.shape)) if isinstance(context, torch.Tensor) else type(context).__name__
        raise ValueError(f"context must be an integer tensor [Q, W={taps}] from conv_context, got {got}")
    # On an accelerator the range is the caller's invariant (conv_context guarantees it): reading
    # it back would stall the device once per layer. On the host it is checked.
    if context.device.type == "cpu" and context.numel() and (int(context.min()) < -1
                                                             or int(context.max()) >= num_rows):
        raise ValueError(f"context entries must be -1 or rows in [0, {num_rows}), got range "
                         f"[{int(context.min())}, {int(context.max())}]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    devices = {t.device for t in (x, weight, context) + ((bias,) if bias is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"x, weight, bias, context must be on one device, got {sorted(map(str, devices))}")


class _ShortConv(torch.autograd.Function):
    """Saves x, the pre-activation z and the window index; no per-tap copies of x."""

    @staticmethod
    def forward(ctx, x_RC, w_CW, b_C, context_RW, silu):
        num_rows, channels = x_RC.shape
        num_out = context_RW.shape[0]
        # One zero row at index R stands for every position before 0.
        x_pad = torch.cat([x_RC, x_RC.new_zeros(1, channels)])
        index_RW = torch.where(context_RW >= 0, context_RW, num_rows)
        z_RC = b_C.expand(num_out, channels).clone() if b_C is not None else x_RC.new_zeros(num_out, channels)
        for tap in range(w_CW.shape[1]):
            z_RC.addcmul_(x_pad.index_select(0, index_RW[:, tap]), w_CW[:, tap])
        ctx.save_for_backward(x_RC, w_CW, index_RW, z_RC if silu else None)
        ctx.has_bias, ctx.silu = b_C is not None, silu
        return torch.nn.functional.silu(z_RC) if silu else z_RC

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_RC):
        x_RC, w_CW, index_RW, z_RC = ctx.saved_tensors
        num_rows, channels = x_RC.shape
        dz_RC = dy_RC.to(x_RC.dtype)
        if ctx.silu:
            sig_RC = torch.sigmoid(z_RC)
            dz_RC = dz_RC * sig_RC * (1 + z_RC * (1 - sig_RC))
        x_pad = torch.cat([x_RC, x_RC.new_zeros(1, channels)])
        dx_pad = x_RC.new_zeros(num_rows + 1, channels)
        dw_CW = torch.empty_like(w_CW)
        for tap in range(w_CW.shape[1]):
            # A row in many windows (a fork's parent, or a prefix under several taps) sums them all.
            dx_pad.index_add_(0, index_RW[:, tap], dz_RC * w_CW[:, tap])
            dw_CW[:, tap] = (dz_RC * x_pad.index_select(0, index_RW[:, tap])).sum(dim=0)
        db_C = dz_RC.sum(dim=0) if ctx.has_bias else None
        return dx_pad[:num_rows], dw_CW, db_C, None, None


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    context: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """y[r] = act(bias + sum_j weight[:, j] * x[context[r, j]]), zero where context is -1; returns [Q, C].

    `context` may hold the windows of only some rows (Q of them, e.g. a window
    consumer's uncached rows, `conv_context(...)[rows]`) while `x` holds every
    row a window reads.

    Args:
        x: [R, C] compact rows (C = the conv channels, e.g. q|k|v concatenated).
        weight: [C, W], or nn.Conv1d's [C, 1, W].
        bias: [C] or None (both models use none).
        context: [Q, W] rows of `conv_context(row_parent, W)` (all R of them normally).
        activation: "silu" (the models' `hidden_act`), "swish" (same) or None.

    Equals the models' causal conv on any trajectory containing the row.
    float64 computes in float64, other dtypes in float32 (as a fused conv
    kernel accumulates); the result has x's dtype.
    """
    check_inputs(x, weight, bias, context, activation)
    dtype = compute_dtype_for(x.dtype)
    w_CW = weight_CW(weight).to(dtype)
    b_C = bias.to(dtype) if bias is not None else None
    y_RC = _ShortConv.apply(x.to(dtype), w_CW, b_C, context.to(torch.long), activation is not None)
    return y_RC.to(x.dtype)
