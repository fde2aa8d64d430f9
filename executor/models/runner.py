"""The driver every model runner shares: rows through the decoder, layer by layer.

A runner wraps a loaded Hugging Face `*ForCausalLM`, reuses its modules on
[R, D] row tensors and replaces only what is not row-local (short conv over
ancestor windows, the linear-attention rounds, ancestor attention). This base
holds what does not depend on the family: the layer loop with optional
full-layer recomputation, the statistics bookkeeping, and the driver of the
plan's linear-attention rounds. A family subclass provides `layer` (one
decoder layer on rows) and, if its layers need per-microbatch inputs such as
rotary tables, `layer_inputs`.

Legend: R rows, D hidden size, H heads, K/V head dims.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from harts.executor.layout import ExecLayout
from harts.executor.models.moe import MoEStatistics
from harts.executor.ops.linear_attention import chunk_linear_attention
from harts.executor.ops.short_conv import conv_context


class RowRunner:
    def __init__(self, model, chunk_size: int = 64, attention_block_tokens: int = 1024, recompute: bool = False):
        self.model = model
        self.config = model.config
        self.chunk_size = chunk_size
        self.attention_block_tokens = attention_block_tokens
        # Full-layer activation recomputation: each decoder layer keeps only its
        # input for backward and re-runs the same rows, rounds, replay and
        # handoffs from the fixed layout when its gradient is needed.
        self.recompute = recompute
        self._recording = True

    @property
    def top_k(self) -> int:
        return int(self.config.num_experts_per_tok)

    def layer_inputs(self, layout: ExecLayout, h_RD: torch.Tensor):
        """Per-microbatch inputs every layer reads besides the rows (default: none)."""
        return None

    def layer(self, index: int, layer, h_RD, layout: ExecLayout, context, inputs, stats):
        raise NotImplementedError

    def hidden_states(self, layout: ExecLayout, stats: MoEStatistics | None = None) -> torch.Tensor:
        """Final hidden states [R, D] (after the last norm), one per row."""
        base = self.model.model
        context = (conv_context(layout.row_parent, self.config.linear_conv_kernel_dim)
                   if "linear_attention" in self.config.layer_types else None)
        h_RD = base.embed_tokens(layout.row_token)
        inputs = self.layer_inputs(layout, h_RD)
        if stats is not None:
            stats.tokens = stats.tokens + layout.row_weight.sum()
        self._recording = True
        for index, layer in enumerate(base.layers[: self.config.num_hidden_layers]):
            args = (index, layer, h_RD, layout, context, inputs, stats)
            if self.recompute and torch.is_grad_enabled():
                h_RD = checkpoint(self.layer, *args, use_reentrant=False)
            else:
                h_RD = self.layer(*args)
        # Statistics are recorded by the forward pass only, never by a recomputation in backward.
        self._recording = False
        return base.norm(h_RD)

    def statistics_record(self, stats: MoEStatistics | None) -> MoEStatistics | None:
        """Where a layer records router statistics: a recomputation must save exactly what the
        forward saved, so it computes the statistics too, into a throwaway record."""
        return stats if self._recording or stats is None else MoEStatistics()

    def linear_rounds(self, q, k, v, g, beta, layout: ExecLayout) -> torch.Tensor:
        """Run the layout's rounds; exported states feed later rounds with gradients attached."""
        calls = layout.calls
        states: list = [None] * calls.num_exports
        pieces = []
        for call in calls.rounds:
            rows = call.token_rows
            if call.start_state.numel() and bool((call.start_state >= 0).any()):
                zero = None
                initial = []
                for source in call.start_state.tolist():
                    if source >= 0:
                        initial.append(states[source])
                    else:
                        if zero is None:
                            zero = q.new_zeros(v.shape[1], q.shape[2], v.shape[2], dtype=torch.float32
                                               if q.dtype != torch.float64 else torch.float64)
                        initial.append(zero)
                initial_state = torch.stack(initial)
            else:
                initial_state = None
            o, exported = chunk_linear_attention(
                q[rows], k[rows], v[rows], g[rows], beta[rows], call.cu_seqlens, initial_state,
                call.export_sequence, call.export_chunk, chunk_size=self.chunk_size,
                use_qk_l2norm_in_kernel=True)
            for j, export_id in enumerate(call.export_ids.tolist()):
                states[export_id] = exported[j]
            pieces.append(o[call.output_tokens])
        o_RHV = torch.cat(pieces)
        if calls.output_order is not None:
            o_RHV = o_RHV[calls.output_order]
        return o_RHV
