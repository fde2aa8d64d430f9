"""Per-position log-probabilities (and entropies) recovered from compact rows (the LM head in blocks)."""

from .blocked import SuppliedNormalizers, position_logprobs, position_logprobs_and_entropy, row_normalizers
from .naive import naive_position_entropy, naive_position_logprobs

__all__ = ["position_logprobs", "position_logprobs_and_entropy", "row_normalizers", "SuppliedNormalizers",
           "naive_position_logprobs", "naive_position_entropy"]
