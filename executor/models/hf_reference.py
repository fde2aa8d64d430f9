"""The reference nobody here wrote: the Hugging Face model run on one trajectory at a time.

`trajectory_logprobs` runs the model's own forward on each trajectory alone
and gathers log p(tokens[i] | tokens[:i]); `trajectory_values` runs its
backbone under a critic's value head, v_i from the state before token i.
`our_kda_core()` is a context
manager that swaps transformers' slow torch fallback of the KDA chunk core for
our chunk op (same math, checked against the fallback in
tests/test_op_linear_attention.py); the benchmarks use it so that the
per-trajectory baseline is not made slow by someone else's fallback. Tests of
fidelity use the unmodified model.
"""
from __future__ import annotations

import contextlib

import torch

from harts.executor.ops.linear_attention import chunk_linear_attention


def trajectory_logprobs(model, tokens) -> torch.Tensor:
    """[n - 1] log-probabilities of tokens[1:], from the model's own forward on this trajectory alone."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=next(model.parameters()).device)[None]
    logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]


def trajectory_values(model, head, tokens) -> torch.Tensor:
    """[n - 1] values of positions 1..n-1 (v_i from the hidden state of position i - 1, as loss 'value' reads
    them), float64, from the backbone `model.model` run on this trajectory alone under `head`."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=next(model.parameters()).device)[None]
    return head(model.model(input_ids=ids).last_hidden_state[0, :-1])[:, 0].double()


def _kda_core(query, key, value, g, beta, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **_):
    """Drop-in for transformers' `chunk_kimi_delta_attention` on [B, T, H, D] inputs."""
    outputs, finals = [], []
    for b in range(query.shape[0]):
        T = query.shape[1]
        # The round's geometry stays on the host, where the op reads it (see chunk.py).
        cu = torch.tensor([0, T])
        init = None if initial_state is None else initial_state[b:b + 1]
        export = torch.tensor([0]), torch.tensor([-(-T // 64)])
        o, final = chunk_linear_attention(query[b], key[b], value[b], g[b], beta[b], cu, init, *export,
                                          chunk_size=64, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outputs.append(o)
        finals.append(final)
    return torch.stack(outputs), (torch.cat(finals) if output_final_state else None)


@contextlib.contextmanager
def our_kda_core():
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    original = kimi.chunk_kimi_delta_attention
    kimi.chunk_kimi_delta_attention = _kda_core
    try:
        yield
    finally:
        kimi.chunk_kimi_delta_attention = original
