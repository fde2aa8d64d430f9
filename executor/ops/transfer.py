"""Host-built index arrays onto the compute device in one copy, without stalling it.

A plain `tensor.to("cuda")` of pageable host memory waits for the GPU to
finish all queued work before copying, so every small index tensor moved that
way drains the launch queue. On the first lent H200 one compact step of a tiny
model made 254 such synchronisations, most of them index copies like these
(`benchmarks/device_check.py --sections syncs`). `to_device` packs the arrays
of one dtype into one pinned buffer and copies it asynchronously: one copy per
dtype, no wait. The caching host allocator keeps a pinned buffer alive until
its copy has run, so the buffer may be dropped at once.

On the CPU it copies nothing: the results share memory with the inputs (numpy
arrays are wrapped as they are), so callers must not write to them.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(arrays: Sequence[np.ndarray | torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The arrays as tensors on `device`, same dtypes and shapes, in order."""
    tensors = [a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    if device.type == "cpu":
        return [t.cpu() for t in tensors]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device.type == "cpu":
            by_dtype.setdefault(t.dtype, []).append(i)
        else:
            out[i] = t.to(device)   # already on an accelerator: a device-to-device copy at most
    for dtype, members in by_dtype.items():
        sizes = [tensors[i].numel() for i in members]
        staged = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
        torch.cat([tensors[i].reshape(-1) for i in members], out=staged)
        moved = staged.to(device, non_blocking=True)
        for i, piece in zip(members, moved.split(sizes)):
            out[i] = piece.view(tensors[i].shape)
    return out
