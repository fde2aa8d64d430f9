"""Kimi Linear over compact rows: the Hugging Face model's own modules, our layout.

Legend: R decoder rows, N all rows of the layout (R except in a window consumer), D hidden size, H heads, K/V head dims, E experts, k top-k.

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

from harts.executor.layout import ExecLayout
from harts.executor.models.moe import MoEStatistics
from harts.executor.models.runner import RowRunner
from harts.executor.ops.ancestor_attention import ancestor_attention
from harts.executor.ops.short_conv import short_conv
from harts.executor.windows import RowSource


class KimiLinearRunner(RowRunner):
    """Forward of a `KimiLinearForCausalLM` over an `ExecLayout`'s rows."""

    def layer(self, index: int, layer, h_RD, layout: ExecLayout, context, inputs, stats: MoEStatistics | None,
              window: RowSource):
        x_RD = layer.input_layernorm(h_RD)
        if self.config.layer_types[index] == "linear_attention":
            a_RD = self.kda(layer.self_attn, x_RD, layout, context, index, window)
        else:
            a_RD = self.mla(layer.self_attn, x_RD, layout, index, window)
        h_RD = h_RD + a_RD
        x_RD = layer.post_attention_layernorm(h_RD)
        if self.config.mlp_layer_types[index] == "sparse":
            m_RD = self.moe(layer.mlp, x_RD, layout, index, self.statistics_record(stats), window)
        else:
            m_RD = layer.mlp(x_RD)
        return h_RD + m_RD

    def kda(self, attn, x_RD, layout: ExecLayout, context, index: int, window: RowSource) -> torch.Tensor:
        """Rows R are the decoder rows; the conv and the rounds read all N rows of the layout."""
        R = x_RD.shape[0]
        heads, head_dim = attn.num_heads, attn.head_dim
        mixed_RC = torch.cat([attn.q_proj(x_RD), attn.k_proj(x_RD), attn.v_proj(x_RD)], dim=-1)
        mixed_NC = window.complete("conv_in", index, mixed_RC)
        mixed_RC = short_conv(mixed_NC, attn.conv1d.weight, attn.conv1d.bias, context, activation=attn.activation)
        mixed_NC = window.complete("conv_out", index, mixed_RC)
        N = mixed_NC.shape[0]
        q_NHK, k_NHK, v_NHV = (t.reshape(N, heads, head_dim) for t in mixed_NC.split(attn.qkv_dim, dim=-1))
        g_NHK = window.complete("gate", index, attn.forget_gate(x_RD[None])[0])
        beta_NH = window.complete("beta", index, torch.sigmoid(attn.b_proj(x_RD)))
        o_RHV = self.linear_rounds(q_NHK, k_NHK, v_NHV, g_NHK, beta_NH, layout, index, window)
        gate_RHV = attn.g_b_proj(attn.g_a_proj(x_RD)).view(R, heads, head_dim)
        out_RD = attn.o_norm(o_RHV, gate_RHV).reshape(R, -1)
        return attn.o_proj(out_RD)

    def mla(self, attn, x_RD, layout: ExecLayout, index: int, window: RowSource) -> torch.Tensor:
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
        k_NHK = window.complete("key", index, k_RHK)
        v_NHV = window.complete("value", index, v_RHV)
        o_RHV = ancestor_attention(q_RHK, k_NHK, v_NHV, layout.views, scale=attn.scaling,
                                   block_tokens=self.attention_block_tokens)
        return attn.o_proj(o_RHV.reshape(R, -1))

    def moe(self, mlp, x_RD, layout: ExecLayout, index: int, stats: MoEStatistics | None,
            window: RowSource) -> torch.Tensor:
        """Each row routed and computed once; occurrence counts weight the statistics only."""
        router_logits_RE, topk_weights_Rk, topk_index_Rk = mlp.gate(x_RD)
        routed_RD = mlp.experts(x_RD, topk_index_Rk, topk_weights_Rk)
        # Statistics cover every row of the layout (a consumer's cached rows via its producer).
        logits_NE = window.complete("router_logits", index, router_logits_RE)
        topk_Nk = window.complete("router_topk", index, topk_index_Rk)
        if stats is not None:
            self.record_router(stats, index, layout.row_weight, logits_NE, topk_Nk)
        return routed_RD + mlp.shared_experts(x_RD)
