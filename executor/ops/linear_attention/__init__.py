"""Gated delta rule (KDA per-channel gate, Gated DeltaNet scalar gate) over one packed round.

`chunk_linear_attention` is the torch fast path (the complete CPU path);
`naive_linear_attention` is its token-by-token specification;
`fla_linear_attention` runs the same contract on flash-linear-attention's
Triton kernels (CUDA); `linear_attention_round` picks one (`backend.py`).
"""

from .backend import linear_attention_round, select_backend
from .chunk import chunk_linear_attention
from .fla_backend import fla_linear_attention
from .naive import naive_linear_attention

__all__ = ["chunk_linear_attention", "fla_linear_attention", "linear_attention_round", "naive_linear_attention",
           "select_backend"]
