"""Specification: log-probabilities of semantic positions from compact rows, the plain way.

Legend: C compact rows, D hidden size, V vocabulary, P semantic positions.
Builds the whole [C, V] logit matrix (fine for tests, not for a real vocabulary).
"""
from __future__ import annotations

import torch


def naive_position_logprobs(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, position_row_P: torch.Tensor,
                            position_label_P: torch.Tensor) -> torch.Tensor:
    """lambda_p = log_softmax(hidden[row_p] @ weight.T)[label_p]; float32 or wider."""
    compute = torch.promote_types(hidden_CD.dtype, torch.float32)
    logits_CV = hidden_CD.to(compute) @ weight_VD.to(compute).T
    logprobs_CV = torch.log_softmax(logits_CV, dim=-1)
    return logprobs_CV[position_row_P, position_label_P]


def naive_position_entropy(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, position_row_P: torch.Tensor) -> torch.Tensor:
    """H_p = -sum_v softmax(z[row_p])_v log_softmax(z[row_p])_v; float32 or wider."""
    compute = torch.promote_types(hidden_CD.dtype, torch.float32)
    logprobs_CV = torch.log_softmax(hidden_CD.to(compute) @ weight_VD.to(compute).T, dim=-1)
    return -(logprobs_CV.exp() * logprobs_CV).sum(dim=-1)[position_row_P]
