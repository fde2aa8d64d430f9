"""Which implementation runs a linear-attention round: our torch op, or fla's kernels on CUDA.

`HARTS_LINEAR_ATTENTION` = `auto` (default: fla when the tensors are on CUDA,
fla imports and the round uses fla's chunk size 64; the torch op otherwise),
`torch`, or `fla` (an error if it cannot run). Both give the same function
(`chunk.py`'s contract); the torch op is the complete CPU path and the one
every test runs.
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

from .chunk import chunk_linear_attention
from .fla_backend import FLA_CHUNK_SIZE, fla_linear_attention

BACKENDS = ("auto", "torch", "fla")


@functools.cache
def fla_importable() -> bool:
    try:
        for module in ("fla.ops.kda", "fla.ops.gated_delta_rule"):
            importlib.import_module(module)
    except Exception:   # not installed, or its Triton kernels cannot load without CUDA
        return False
    return True


def select_backend(device: torch.device, chunk_size: int, requested: str | None = None) -> str:
    requested = requested or os.environ.get("HARTS_LINEAR_ATTENTION", "auto")
    if requested not in BACKENDS:
        raise ValueError(f"HARTS_LINEAR_ATTENTION must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested == "torch":
        return "torch"
    fits = device.type == "cuda" and chunk_size == FLA_CHUNK_SIZE and fla_importable()
    if requested == "fla" and not fits:
        raise ValueError(f"the fla backend needs CUDA tensors, chunk size {FLA_CHUNK_SIZE} and an importable "
                         f"flash-linear-attention (got device {device}, chunk size {chunk_size}); fix: install the "
                         "'cuda' extra on a GPU machine, or set HARTS_LINEAR_ATTENTION=torch")
    return "fla" if fits else "torch"


def linear_attention_round(q, k, v, g, beta, cu_seqlens, initial_state, export_seq, export_chunk, *,
                           chunk_size: int, use_qk_l2norm_in_kernel: bool, backend: str | None = None):
    """One packed round (see `chunk_linear_attention`) on the selected backend."""
    run = fla_linear_attention if select_backend(q.device, chunk_size, backend) == "fla" else chunk_linear_attention
    return run(q, k, v, g, beta, cu_seqlens, initial_state, export_seq, export_chunk, chunk_size=chunk_size,
               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
