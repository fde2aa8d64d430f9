"""Kimi Linear over compact rows: the Hugging Face model's own modules, our layout.

Legend: R rows, D hidden size, H heads, K/V head dims, E experts, k top-k.

The runner owns no weights: it calls the loaded `KimiLinearForCausalLM`'s
modules (projections, norms, gates, experts, router) on [R, D] row tensors and
replaces only the three operations whose input is not row-local:

* KDA's short convolution reads the true ancestor window of each row;
* KDA's chunkwise core runs the plan's rounds (packed sequences, replay,
  differentiable boundary-state handoff);
* MLA reads exactly each row's ancestors' keys and values.

Everything else (embedding, RMSNorms, q/k/v/gate projections, forget gate,
gated output norm, dense MLP, router, experts, shared experts, final norm) is
row-local, so running it once per compact row is exactly what each trajectory
would compute for that position.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from harts.executor.layout import ExecLayout
from harts.executor.models.moe import MoEStatistics
from harts.executor.ops.ancestor_attention import ancestor_attention
from harts.executor.ops.linear_attention import chunk_linear_attention
from harts.executor.ops.short_conv import conv_context, short_conv


class KimiLinearRunner:
    """Forward of a `KimiLinearForCausalLM` over an `ExecLayout`'s rows."""

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

    def hidden_states(self, layout: ExecLayout, stats: MoEStatistics | None = None) -> torch.Tensor:
        """Final hidden states [R, D] (after the last norm), one per row."""
        base = self.model.model
        context = (conv_context(layout.row_parent, self.config.linear_conv_kernel_dim)
                   if "linear_attention" in self.config.layer_types else None)
        h_RD = base.embed_tokens(layout.row_token)
        if stats is not None:
            stats.tokens = stats.tokens + layout.row_weight.sum()
        self._recording = True
        for index, layer in enumerate(base.layers):
            if self.recompute and torch.is_grad_enabled():
                h_RD = checkpoint(self.layer, index, layer, h_RD, layout, context, stats, use_reentrant=False)
            else:
                h_RD = self.layer(index, layer, h_RD, layout, context, stats)
        # Statistics are recorded by the forward pass only, never by a recomputation in backward.
        self._recording = False
        return base.norm(h_RD)

    def layer(self, index: int, layer, h_RD, layout: ExecLayout, context, stats: MoEStatistics | None):
        x_RD = layer.input_layernorm(h_RD)
        if self.config.layer_types[index] == "linear_attention":
            a_RD = self.kda(layer.self_attn, x_RD, layout, context)
        else:
            a_RD = self.mla(layer.self_attn, x_RD, layout)
        h_RD = h_RD + a_RD
        x_RD = layer.post_attention_layernorm(h_RD)
        if self.config.mlp_layer_types[index] == "sparse":
            # A recomputation must save exactly what the forward saved, so it computes the
            # statistics too, into a throwaway record.
            record = stats if self._recording or stats is None else MoEStatistics()
            m_RD = self.moe(layer.mlp, x_RD, layout, index, record)
        else:
            m_RD = layer.mlp(x_RD)
        return h_RD + m_RD

    def kda(self, attn, x_RD, layout: ExecLayout, context) -> torch.Tensor:
        R = x_RD.shape[0]
        heads, head_dim = attn.num_heads, attn.head_dim
        mixed_RC = torch.cat([attn.q_proj(x_RD), attn.k_proj(x_RD), attn.v_proj(x_RD)], dim=-1)
        mixed_RC = short_conv(mixed_RC, attn.conv1d.weight, attn.conv1d.bias, context, activation=attn.activation)
        q_RHK, k_RHK, v_RHV = (t.reshape(R, heads, head_dim) for t in mixed_RC.split(attn.qkv_dim, dim=-1))
        g_RHK = attn.forget_gate(x_RD[None])[0]
        beta_RH = torch.sigmoid(attn.b_proj(x_RD))
        o_RHV = self.linear_rounds(q_RHK, k_RHK, v_RHV, g_RHK, beta_RH, layout)
        gate_RHV = attn.g_b_proj(attn.g_a_proj(x_RD)).view(R, heads, head_dim)
        out_RD = attn.o_norm(o_RHV, gate_RHV).reshape(R, -1)
        return attn.o_proj(out_RD)

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

    def mla(self, attn, x_RD, layout: ExecLayout) -> torch.Tensor:
        R = x_RD.shape[0]
        if attn.q_lora_rank is None:
            q = attn.q_proj(x_RD)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x_RD)))
        q_RHK = q.view(R, attn.num_heads, attn.qk_head_dim)
        kv_nope, k_rot = attn.kv_a_proj_with_mqa(x_RD).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        kv = attn.kv_b_proj(attn.kv_a_layernorm(kv_nope)).view(R, attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim)
        k_nope, v_RHV = kv.split([attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
        # NoPE: the "rope" part of the key is shared by all heads and carries no rotation.
        k_RHK = torch.cat([k_nope, k_rot[:, None, :].expand(R, attn.num_heads, attn.qk_rope_head_dim)], dim=-1)
        o_RHV = ancestor_attention(q_RHK, k_RHK, v_RHV, layout.views, scale=attn.scaling,
                                   block_tokens=self.attention_block_tokens)
        return attn.o_proj(o_RHV.reshape(R, -1))

    def moe(self, mlp, x_RD, layout: ExecLayout, index: int, stats: MoEStatistics | None) -> torch.Tensor:
        """Each row routed and computed once; occurrence counts weight the statistics only."""
        router_logits_RE, topk_weights_Rk, topk_index_Rk = mlp.gate(x_RD)
        routed_RD = mlp.experts(x_RD, topk_index_Rk, topk_weights_Rk)
        if stats is not None:
            stats.add(index, layout.row_weight, router_logits_RE, topk_index_Rk)
        return routed_RD + mlp.shared_experts(x_RD)
