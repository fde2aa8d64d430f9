"""Per-position log-probabilities (and entropies) recovered from compact rows (the LM head in blocks)."""

from .blocked import position_logprobs, position_logprobs_and_entropy
from .naive import naive_position_entropy, naive_position_logprobs

__all__ = ["position_logprobs", "position_logprobs_and_entropy", "naive_position_logprobs", "naive_position_entropy"]
