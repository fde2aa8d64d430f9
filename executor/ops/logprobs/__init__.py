"""Per-position log-probabilities recovered from compact rows (the LM head in blocks)."""

from .blocked import position_logprobs
from .naive import naive_position_logprobs

__all__ = ["position_logprobs", "naive_position_logprobs"]
