"""Qwen3-Next over compact rows: the Hugging Face model's own modules, our layout.

Legend: R decoder rows, N all rows of the layout (R except in a window consumer), D hidden size, H value heads (linear) or query heads (full),
HK key heads, Hkv key/value heads, K/V head dims, E experts, k top-k.

The runner owns no weights: it calls the loaded `Qwen3NextForCausalLM`'s
modules (projections, norms, gates, rotary embedding, router, experts, shared
expert) on [R, D] row tensors and replaces only the three operations whose
input is not row-local:

* Gated DeltaNet's short convolution reads the true ancestor window of each
  row (`conv_context` / `short_conv`);
* Gated DeltaNet's chunkwise core (scalar gate, grouped q/k heads) runs the
  plan's rounds (packed sequences, replay, differentiable boundary-state
  handoff), exactly as the Kimi runner's `linear_rounds`;
* gated full attention reads exactly each row's ancestors' keys and values
  (`ancestor_attention`, grouped kv heads), after partial RoPE at each row's
  original position `layout.row_position`.

Everything else (embedding, RMSNorms, in_proj_qkvz / in_proj_ba and their
head split, g and beta, gated RMSNorm, out_proj, q/k norms, output gate, dense
MLP, router, experts, shared expert and its sigmoid gate, final norm) is
row-local, so running it once per compact row is exactly what each trajectory
would compute for that position.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harts.executor.layout import ExecLayout
from harts.executor.models.moe import MoEStatistics
from harts.executor.models.runner import RowRunner
from harts.executor.ops.ancestor_attention import ancestor_attention
from harts.executor.ops.short_conv import short_conv
from harts.executor.windows import RowSource


class Qwen3NextRunner(RowRunner):
    """Forward of a `Qwen3NextForCausalLM` over an `ExecLayout`'s rows."""

    SCALAR_GATE = True   # Gated DeltaNet: one decay per value head

    def layer_inputs(self, layout: ExecLayout, h_RD: torch.Tensor):
        """The model's own rotary module at each row's original position: ([R, rotary_dim], [R, rotary_dim])."""
        if "full_attention" not in self.config.layer_types:
            return None
        positions = layout.decoder_view(layout.row_position)
        cos, sin = self.model.model.rotary_emb(h_RD, positions[None].to(h_RD.device))
        return cos[0], sin[0]

    def layer(self, index: int, layer, h_RD, layout: ExecLayout, context, rotary, stats: MoEStatistics | None,
              window: RowSource):
        """One decoder layer on the decoder rows; `rotary` is `layer_inputs`' (cos, sin)."""
        x_RD = layer.input_layernorm(h_RD)
        if self.config.layer_types[index] == "linear_attention":
            a_RD = self.gated_deltanet(layer.linear_attn, x_RD, layout, context, index, window)
        else:
            a_RD = self.gated_attention(layer.self_attn, x_RD, layout, rotary, index, window)
        h_RD = h_RD + a_RD
        x_RD = layer.post_attention_layernorm(h_RD)
        if hasattr(layer.mlp, "experts"):
            m_RD = self.moe(layer.mlp, x_RD, layout, index, self.statistics_record(stats), window)
        else:
            m_RD = layer.mlp(x_RD)
        return h_RD + m_RD

    def record_router(self, stats, index, weight_R, router_logits_RE, topk_index_Rk) -> None:
        record_softmax_router(stats, index, weight_R, router_logits_RE, topk_index_Rk)

    def gated_deltanet(self, attn, x_RD, layout: ExecLayout, context, index: int, window: RowSource) -> torch.Tensor:
        """Rows R are the decoder rows; the conv and the rounds read all N rows of the layout."""
        R = x_RD.shape[0]
        # The module's own head-interleaved split; it wants [batch, seq, C], so the rows are one batch.
        q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x_RD)[None], attn.in_proj_ba(x_RD)[None])
        mixed_RC = torch.cat([t[0].reshape(R, -1) for t in (q, k, v)], dim=-1)
        mixed_NC = window.complete("conv_in", index, mixed_RC)
        mixed_RC = short_conv(mixed_NC, attn.conv1d.weight, attn.conv1d.bias, context, activation=attn.activation)
        mixed_NC = window.complete("conv_out", index, mixed_RC)
        N = mixed_NC.shape[0]
        q_NHK, k_NHK, v_NHV = mixed_NC.split([attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
        q_NHK = q_NHK.reshape(N, -1, attn.head_k_dim)      # [N, HK, K]
        k_NHK = k_NHK.reshape(N, -1, attn.head_k_dim)      # [N, HK, K]
        v_NHV = v_NHV.reshape(N, -1, attn.head_v_dim)      # [N, H, V]
        beta_NH = window.complete("beta", index, b[0].sigmoid())
        g_NH = window.complete("gate", index, -attn.A_log.float().exp() * F.softplus(a[0].float() + attn.dt_bias))
        # Grouped heads: the op repeats q/k per group (value head h reads key head h // (H / HK)),
        # as the fallback's repeat_interleave does.
        o_RHV = self.linear_rounds(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, layout, index, window)
        z_RHV = z[0]
        out = attn.norm(o_RHV.reshape(-1, attn.head_v_dim), z_RHV.reshape(-1, attn.head_v_dim))
        return attn.out_proj(out.reshape(R, -1))

    def gated_attention(self, attn, x_RD, layout: ExecLayout, rotary, index: int, window: RowSource) -> torch.Tensor:
        from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

        R = x_RD.shape[0]
        head_dim = attn.head_dim
        q_RHD, gate_RHD = torch.chunk(attn.q_proj(x_RD).view(R, -1, head_dim * 2), 2, dim=-1)
        gate_RC = gate_RHD.reshape(R, -1)
        q_RHD = attn.q_norm(q_RHD.reshape(R, -1, head_dim))
        k_RHD = attn.k_norm(attn.k_proj(x_RD).view(R, -1, head_dim))
        v_RHD = attn.v_proj(x_RD).view(R, -1, head_dim)
        cos_R_, sin_R_ = rotary
        # Partial RoPE on the first rotary_dim channels; [R, 1, rotary_dim] broadcasts over heads.
        q_RHD, k_RHD = apply_rotary_pos_emb(q_RHD, k_RHD, cos_R_, sin_R_, unsqueeze_dim=1)
        # Keys and values after RoPE: a consumer reads its cached rows' straight from its producer.
        k_NHD = window.complete("key", index, k_RHD)
        v_NHD = window.complete("value", index, v_RHD)
        o_RHD = ancestor_attention(q_RHD, k_NHD, v_NHD, layout.views, scale=attn.scaling,
                                   block_tokens=self.attention_block_tokens)
        o_RC = o_RHD.reshape(R, -1) * torch.sigmoid(gate_RC)
        return attn.o_proj(o_RC)

    def moe(self, mlp, x_RD, layout: ExecLayout, index: int, stats: MoEStatistics | None,
            window: RowSource) -> torch.Tensor:
        """Each row routed and computed once; occurrence counts weight the statistics only."""
        shared_RD = mlp.shared_expert(x_RD)
        router_logits_RE, topk_weights_Rk, topk_index_Rk = mlp.gate(x_RD)   # softmax top-k (norm_topk_prob)
        routed_RD = mlp.experts(x_RD, topk_index_Rk, topk_weights_Rk)
        # Statistics cover every row of the layout (a consumer's cached rows via its producer).
        logits_NE = window.complete("router_logits", index, router_logits_RE)
        topk_Nk = window.complete("router_topk", index, topk_index_Rk)
        if stats is not None:
            self.record_router(stats, index, layout.row_weight, logits_NE, topk_Nk)
        return routed_RD + torch.sigmoid(mlp.shared_expert_gate(x_RD)) * shared_RD


def record_softmax_router(stats: MoEStatistics, layer: int, weight_R, router_logits_RE, topk_index_Rk) -> None:
    """Record Qwen3-Next's routing: its router ranks experts by softmax(logits)."""
    probs_RE = torch.softmax(router_logits_RE, dim=-1, dtype=torch.float).to(router_logits_RE.dtype)
    stats.add(layer, weight_R, router_logits_RE, topk_index_Rk, probs_RE=probs_RE)
