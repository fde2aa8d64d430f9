"""The driver every model runner shares: rows through the decoder, layer by layer.

A runner wraps a loaded Hugging Face `*ForCausalLM`, reuses its modules on
[R, D] row tensors and replaces only what is not row-local (short conv over
ancestor windows, the linear-attention rounds, ancestor attention). This base
holds what does not depend on the family: the layer loop with optional
full-layer recomputation, the statistics bookkeeping, and the driver of the
plan's linear-attention rounds. A family subclass provides `layer` (one
decoder layer on rows) and, if its layers need per-microbatch inputs such as
rotary tables, `layer_inputs`.

The decoder runs `layout.decoder_rows` (every row, except in a window
consumer). Every per-row tensor a non-row-local op reads, and the final
hidden states, pass through `window.complete(key, layer, values)`, which
returns them over every row of the layout (`harts.executor.windows`).

Legend: R rows, D hidden size, H heads, K/V head dims.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from harts.executor.layout import ExecLayout
from harts.executor.models.moe import MoEStatistics
from harts.executor.ops.linear_attention import linear_attention_round
from harts.executor.ops.short_conv import conv_context
from harts.executor.ops.short_conv.gather import ACTIVATIONS
from harts.schema.errors import HartsError
from harts.executor.windows import PASSTHROUGH, RowSource


def check_short_conv_activation(model) -> None:
    """Refuse, before any work, a linear-attention short convolution whose activation our op does not have.

    The families' configs set it through `hidden_act` (SiLU by default); transformers' own modules take any
    activation, so such a model loads and runs there, and would otherwise fail deep inside the first step.
    """
    for name, module in model.named_modules():
        activation = getattr(module, "activation", None)
        if hasattr(module, "conv1d") and activation not in ACTIVATIONS:
            raise HartsError(f"{model.config.model_type}: {name}'s short convolution uses activation {activation!r} "
                             f"(config hidden_act), which HARTS runs only as {', '.join(map(repr, ACTIVATIONS))}; "
                             "fix: save the model with hidden_act 'silu', the family's default")


class RowRunner:
    # A family whose linear attention decays by one scalar per head (Gated DeltaNet) sets this:
    # some fla versions refuse that case on some GPUs (backend.fla_scalar_gate_defect).
    SCALAR_GATE = False

    def __init__(self, model, chunk_size: int = 64, attention_block_tokens: int | None = None,
                 recompute: bool = False):
        check_short_conv_activation(model)
        self.model = model
        self.config = model.config
        self.chunk_size = chunk_size
        self.attention_block_tokens = attention_block_tokens   # None: the device's (default_block_tokens)
        # Full-layer activation recomputation: each decoder layer keeps only its
        # input for backward and re-runs the same rows, rounds, replay and
        # handoffs from the fixed layout when its gradient is needed.
        self.recompute = recompute
        self._recording = True

    @property
    def top_k(self) -> int:
        return int(self.config.num_experts_per_tok)

    def layer_inputs(self, layout: ExecLayout, h_RD: torch.Tensor):
        """Per-microbatch inputs every layer reads besides the decoder rows (default: none)."""
        return None

    def layer(self, index: int, layer, h_RD, layout: ExecLayout, context, inputs, stats, window: RowSource):
        raise NotImplementedError

    def hidden_states(self, layout: ExecLayout, stats: MoEStatistics | None = None,
                      window: RowSource = PASSTHROUGH) -> torch.Tensor:
        """Final hidden states [R, D] (after the last norm), one per row of the layout."""
        base = self.model.model
        if stats is not None:
            stats.tokens = stats.tokens + layout.row_weight.sum()
        if layout.num_decoder_rows == 0:
            return self.all_cached(layout, stats, window)
        context = None
        if "linear_attention" in self.config.layer_types:
            # Windows of the decoder rows, reading any row of the layout.
            context = layout.decoder_view(conv_context(layout.row_parent, self.config.linear_conv_kernel_dim,
                                                       device=layout.row_token.device))
        h_RD = base.embed_tokens(layout.decoder_view(layout.row_token))
        window.started(h_RD)
        inputs = self.layer_inputs(layout, h_RD)
        self._recording = True
        for index, layer in enumerate(base.layers[: self.config.num_hidden_layers]):
            if self.recompute and torch.is_grad_enabled():
                call = _RecomputableLayer(self.layer, index, layer, layout, context, inputs, stats, window)
                h_RD = checkpoint(call, h_RD, use_reentrant=False)
            else:
                h_RD = self.layer(index, layer, h_RD, layout, context, inputs, stats, window)
        # Statistics are recorded by the forward pass only, never by a recomputation in backward.
        self._recording = False
        return window.complete("final", -1, base.norm(h_RD))

    def all_cached(self, layout: ExecLayout, stats: MoEStatistics | None, window) -> torch.Tensor:
        """A window consumer whose every row its producer computed: it reads only the router
        outputs (for its own occurrence-weighted statistics) and the final hidden states."""
        if stats is not None:
            for index in window.layers_with("router_logits"):
                self.record_router(stats, index, layout.row_weight, window.complete("router_logits", index, None),
                                   window.complete("router_topk", index, None))
        return window.complete("final", -1, None)

    def record_router(self, stats: MoEStatistics, index: int, weight_R, router_logits_RE, topk_index_Rk) -> None:
        """Record one MoE layer's routing (default: a sigmoid router's normalised scores)."""
        stats.add(index, weight_R, router_logits_RE, topk_index_Rk)

    def statistics_record(self, stats: MoEStatistics | None) -> MoEStatistics | None:
        """Where a layer records router statistics: a recomputation must save exactly what the
        forward saved, so it computes the statistics too, into a throwaway record."""
        return stats if self._recording or stats is None else MoEStatistics()

    def linear_rounds(self, q, k, v, g, beta, layout: ExecLayout, index: int, window: RowSource) -> torch.Tensor:
        """Run the layout's rounds over per-row inputs; returns one output per decoder row.

        Exported states feed later rounds with gradients attached; a window
        consumer's sequence may start from a state its producer exported.
        """
        calls = layout.calls
        states: list = [None] * calls.num_exports
        state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        pieces = []
        for call in calls.rounds:
            internal = call.start_state.tolist()
            external = call.start_external.tolist() if call.start_external is not None else [-1] * len(internal)
            initial_state = None
            if any(i >= 0 for i in internal) or any(e >= 0 for e in external):
                producer_states = window.start_states(index) if any(e >= 0 for e in external) else None
                zero = q.new_zeros(v.shape[1], q.shape[2], v.shape[2], dtype=state_dtype)
                initial_state = torch.stack([states[i] if i >= 0 else producer_states[e] if e >= 0 else zero
                                             for i, e in zip(internal, external)])
            if call.token_range is not None:   # a view: no gather forward, no scatter backward
                first, end = call.token_range
                inputs = [x[first:end] for x in (q, k, v, g, beta)]
            else:
                inputs = [x.index_select(0, call.token_rows) for x in (q, k, v, g, beta)]
            o, exported = linear_attention_round(
                *inputs, call.cu_seqlens, initial_state, call.export_sequence, call.export_chunk,
                chunk_size=self.chunk_size, use_qk_l2norm_in_kernel=True)
            for j, export_id in enumerate(call.export_ids.tolist()):
                states[export_id] = exported[j]
            pieces.append(o if call.outputs_are_all_tokens else o.index_select(0, call.output_tokens))
        window.record_states(index, states)
        if not pieces:
            return v.new_zeros(0, *v.shape[1:])
        o_RHV = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if calls.output_order is not None:
            o_RHV = o_RHV.index_select(0, calls.output_order)
        return o_RHV


class _RecomputableLayer:
    """One checkpointed decoder layer, `layer(index, module, h_RD, ...)`: what `checkpoint` keeps to
    recompute it, with the window and the statistics record held by weak reference.

    torch keeps a recomputation's function and arguments in a frame that the layer's saved activations
    point to from inside the autograd graph. The window and the statistics record hold graph tensors of
    their own, so holding them strongly closes a reference cycle through C++, which Python's collector
    cannot see: harmless when the backward completes (it frees the saved activations and with them the
    cycle), but a backward that fails part-way (an out-of-memory error in a consumer, an interrupt) would
    keep the microbatch's whole graph alive, once per failure. Their owners keep both alive for as long as
    HARTS runs the backward that recomputes (the microbatch for its own, the schedule for a producer's);
    the rest (layout, conv context, rotary tables) holds no graph and is kept as torch would.
    """

    __slots__ = ("layer", "index", "module", "layout", "context", "inputs", "stats", "window")

    def __init__(self, layer, index: int, module, layout: ExecLayout, context, inputs, stats, window):
        self.layer, self.index, self.module = layer, index, module
        self.layout, self.context, self.inputs = layout, context, inputs
        self.stats = None if stats is None else weakref.ref(stats)
        self.window = weakref.ref(window)

    def __call__(self, h_RD: torch.Tensor) -> torch.Tensor:
        stats = None if self.stats is None else self.stats()
        window = self.window()
        if window is None or (self.stats is not None and stats is None):
            raise HartsError(f"decoder layer {self.index} was recomputed after its microbatch's window or "
                             "statistics were released: recomputation runs only inside the step's own backward")
        return self.layer(self.index, self.module, h_RD, self.layout, self.context, self.inputs, stats, window)
