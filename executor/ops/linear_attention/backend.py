"""Which implementation runs a linear-attention round: our torch op, or fla's kernels on CUDA.

`HARTS_LINEAR_ATTENTION` = `auto` (the default, also when empty: fla when the tensors are on CUDA,
fla imports, the round uses fla's chunk size 64 and fla has no known defect for
the round's gate on this GPU; the torch op otherwise),
`torch`, or `fla` (an error if it cannot run). Both give the same function
(`chunk.py`'s contract); the torch op is the complete CPU path and the one
every test runs.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from harts.schema.errors import UsageError

from .chunk import chunk_linear_attention
from .fla_backend import FLA_CHUNK_SIZE, fla_linear_attention

BACKENDS = ("auto", "torch", "fla")


@functools.cache
def fla_import_error() -> str | None:
    """Why fla's kernels cannot be imported here (None: they can)."""
    try:
        for module in ("fla.ops.kda", "fla.ops.gated_delta_rule"):
            importlib.import_module(module)
    except Exception as err:   # noqa: BLE001 - not installed (ImportError), or installed but broken
        # (Triton or CUDA failing at import): either way the reason is kept and reported, not swallowed.
        return f"{type(err).__name__}: {err}"
    return None


@functools.cache
def fla_scalar_gate_defect() -> str | None:
    """Why fla's scalar-gate (Gated DeltaNet) kernels must not run here (None: nothing known).

    fla 0.6.0 raises in the backward of its gated chunk_bwd_dqkwg on Hopper GPUs with
    3.4.0 <= Triton < 3.7.1, which compute it wrongly there (fla issue #640); its per-channel
    (KDA) path does not call that kernel. Seen on the lent H200 (Triton 3.6). fla's own flags
    decide, so a fla that fixes it or drops the guard is trusted.
    """
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:   # a fla without these flags has no such guard either
        return None
    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:
        return "fla refuses scalar-gate (Gated DeltaNet) backward on Hopper GPUs with Triton 3.4.0-3.7.0 (fla #640)"
    return None


@functools.cache
def _warn_once(message: str) -> None:
    """Warn once per process (select_backend runs for every round), at select_backend's caller."""
    warnings.warn(message, stacklevel=3)


def select_backend(device: torch.device, chunk_size: int, requested: str | None = None,
                   scalar_gate: bool = False) -> str:
    """"fla" or "torch" for rounds on `device` planned with `chunk_size` (with a scalar gate per head
    when `scalar_gate`); a UsageError (one line with its fix) when HARTS_LINEAR_ATTENTION (or
    `requested`) asks for what cannot run here."""
    # Empty counts as unset (`HARTS_LINEAR_ATTENTION= harts run ...`, or a launcher passing "$UNSET").
    requested = requested or os.environ.get("HARTS_LINEAR_ATTENTION") or "auto"
    if requested not in BACKENDS:
        raise UsageError(f"HARTS_LINEAR_ATTENTION must be one of {', '.join(BACKENDS)}, got {requested!r}; "
                         "fix: unset it (auto) or set one of those")
    if requested == "torch":
        return "torch"
    reason = fla_import_error() if device.type == "cuda" else None
    fits = device.type == "cuda" and chunk_size == FLA_CHUNK_SIZE and reason is None
    if requested == "fla" and not fits:
        raise UsageError(f"the fla backend needs CUDA tensors, chunk size {FLA_CHUNK_SIZE} and an importable "
                         f"flash-linear-attention (got device {device}, chunk size {chunk_size}"
                         + (f", import failed: {reason}" if reason else "") + "); fix: install the "
                         "'cuda' extra on a GPU machine, or set HARTS_LINEAR_ATTENTION=torch")
    if reason is not None and not reason.startswith("ModuleNotFoundError"):
        # A broken install must not pass silently for the torch op.
        _warn_once(f"flash-linear-attention is installed but cannot be imported ({reason}); linear attention "
                   "runs on the slower torch op. Set HARTS_LINEAR_ATTENTION=torch to silence this.")
    defect = fla_scalar_gate_defect() if fits and scalar_gate else None
    if defect is not None:
        if requested == "fla":
            raise UsageError(f"{defect}; fix: upgrade Triton to >= 3.7.1, or set HARTS_LINEAR_ATTENTION=auto "
                             "(scalar-gate layers then run the torch op) or torch")
        _warn_once(f"{defect}; scalar-gate layers run on the torch op (upgrade Triton to >= 3.7.1 for fla). "
                   "Set HARTS_LINEAR_ATTENTION=torch to silence this.")
        return "torch"
    return "fla" if fits else "torch"


def linear_attention_round(q, k, v, g, beta, cu_seqlens, initial_state, export_seq, export_chunk, *,
                           chunk_size: int, use_qk_l2norm_in_kernel: bool, backend: str | None = None):
    """One packed round (see `chunk_linear_attention`) on the selected backend."""
    scalar_gate = g.dim() == 2   # [N, H]: one decay per head (Gated DeltaNet); [N, H, K]: per channel (KDA)
    run = fla_linear_attention if select_backend(q.device, chunk_size, backend, scalar_gate) == "fla" \
        else chunk_linear_attention
    return run(q, k, v, g, beta, cu_seqlens, initial_state, export_seq, export_chunk, chunk_size=chunk_size,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
