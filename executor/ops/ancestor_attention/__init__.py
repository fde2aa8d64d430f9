"""Full causal attention over compact rows: each row reads exactly its ancestors.

`ancestor_attention` is the blockwise fast path the executor calls once per
full-attention layer; `naive_ancestor_attention` expands every trajectory and
is its specification. `AttentionViews` (built once per microbatch from the
plan arrays) says which rows each query reads.
"""

from .blocked import CPU_BLOCK_TOKENS, ancestor_attention, default_block_tokens
from .naive import naive_ancestor_attention
from .views import AttentionViews

__all__ = ["AttentionViews", "CPU_BLOCK_TOKENS", "ancestor_attention", "default_block_tokens",
           "naive_ancestor_attention"]
