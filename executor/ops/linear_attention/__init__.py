"""Gated delta rule (KDA per-channel gate, Gated DeltaNet scalar gate) over one packed round.

`chunk_linear_attention` is the fast path the executor calls once per round;
`naive_linear_attention` is its token-by-token specification.
"""

from .chunk import chunk_linear_attention
from .naive import naive_linear_attention

__all__ = ["chunk_linear_attention", "naive_linear_attention"]
