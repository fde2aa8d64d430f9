"""The precision every op computes in, whatever its inputs' dtype.

Reduced-precision inputs (bfloat16, float16) are upcast to float32 inside the
ops and only the outputs are rounded back, so a compact run and a per-trajectory
run round at the same places; float64 stays float64 for the reference checks.
"""
from __future__ import annotations

import torch


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, bfloat16 and float16 compute in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
