"""Sharing windows at run time: one producer forward, consumers on uncached rows, one producer backward.

A window's producer (one per window and replica) runs the decoder once over
the prefixes its consumers share. Everything a consumer's decoder reads from
those rows is a per-layer *interface* the producer records as it goes: the
short-convolution input (local context) and output (replay inputs), the
linear-attention gates, the boundary states it exports, full-attention keys
and values, router logits and choices, and the final hidden states for the
LM head. The LM head's normalizer of a cached row (its log-sum-exp, and
entropy when asked for: the [rows, vocabulary] work) is the producer's too,
computed the first time a consumer reads the row and shared by the window's
later consumers; a consumer adds only each position's label logit.

Consumers see each interface through one leaf tensor per window
(`detach().requires_grad_()`), so every consumer backward only accumulates
into the leaves' `.grad`; after the window's last consumer, `backward` sends
all accumulated interface gradients through the producer graph in a single
autograd call and the window's caches are released.

The runner asks its `RowSource` for every per-row tensor a non-row-local op
reads (`complete`) and for the states a round starts from (`start_states`),
and the step asks it for the normalizers it supplies to the LM head
(`supplied_normalizers`); `PASSTHROUGH` (no windows) returns what it is
given and supplies none.

`WindowSchedule` drives this in run order: a window's producer runs just
before its first consumer that reads it, and its backward just after its
last one, so at most the producers of the windows in flight hold memory.

Legend: P producer rows, C consumer rows, U consumer decoder rows, Cc cached rows.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from harts.executor.layout import CachedRows, ExecLayout, has_cached_rows, producer_layout
from harts.executor.ops.logprobs import SuppliedNormalizers, row_normalizers
from harts.executor.ops.transfer import to_device


class RowSource:
    """No windows: the decoder computes every row itself."""

    def complete(self, key: str, layer: int, computed: torch.Tensor) -> torch.Tensor:
        """The per-row tensor over every row of the layout, given the decoder rows' values."""
        return computed

    def record_states(self, layer: int, states: list) -> None:
        """The boundary states one layer's rounds exported (a producer keeps them)."""

    def start_states(self, layer: int) -> list:
        """States a window's producer exported in `layer`, by export index."""
        raise RuntimeError("a sequence asks for a producer state, but no window is active")

    def started(self, embedded: torch.Tensor) -> None:
        """Called with the decoder's first tensor (a producer counts its backward passes there)."""

    def supplied_normalizers(self, positions: np.ndarray | None, weight: torch.Tensor,
                             with_entropy: bool) -> SuppliedNormalizers | None:
        """LM-head normalizers of the positions (host indices into the layout's labelled positions; None:
        all of them) whose rows another computation owns; None: the LM head computes every one."""
        return None


PASSTHROUGH = RowSource()


class CellTimer:
    """Adds the seconds since `started` to one (window, replica) cell's entry of a totals dict. It holds no
    reference to the schedule, so a record that keeps one makes no reference cycle through it."""

    def __init__(self, clock, totals: dict, cell: tuple[int, int]) -> None:
        self.clock, self.totals, self.cell = clock, totals, cell

    def __call__(self, started: float) -> None:
        self.totals[self.cell] = self.totals.get(self.cell, 0.0) + self.clock() - started


class ProducerRecord(RowSource):
    """A producer's forward: keeps every interface; hands consumers leaves; runs one backward.

    `timer` (a `CellTimer`), when given, also counts the LM-head normalizers the record computes when a
    consumer first reads its rows: producer work, though it runs inside that consumer's turn."""

    def __init__(self, timer: CellTimer | None = None) -> None:
        self.timer = timer
        self.tensors: dict = {}     # (key, layer) -> producer tensor [P, ...] (in the producer graph)
        self.states: dict = {}      # layer -> exported states
        self.leaves: dict = {}      # (key, layer) -> leaf shared by the window's consumers
        self.state_leaves: dict = {}
        # LM-head normalizers of producer rows, computed in pieces as consumers first read the rows:
        # piece k is tensors[("lse", k)] (and ("entropy", k)); normalizer_slot[row] indexes their
        # concatenation, -1 for a row no consumer has read yet.
        self.normalizer_slot: np.ndarray | None = None
        self.normalizer_pieces = self.normalizer_rows = 0
        # Autograd traversals of the producer graph (its embedding output), counted in a list the hook
        # holds: a hook bound to the record would keep it, and through it the whole graph, alive in a
        # cycle through torch's autograd graph that Python's collector cannot see.
        self._passes = [0]

    def complete(self, key, layer, computed):
        # A recomputation in backward (activation checkpointing) must not replace the forward's tensors.
        self.tensors.setdefault((key, layer), computed)
        return computed

    def record_states(self, layer, states):
        self.states.setdefault(layer, states)

    def started(self, embedded):
        if embedded.requires_grad:
            embedded.register_hook(lambda grad, passes=self._passes: passes.__setitem__(0, passes[0] + 1))

    @property
    def backward_passes(self) -> int:
        return self._passes[0]

    def leaf(self, key: str, layer: int) -> torch.Tensor:
        found = self.leaves.get((key, layer))
        if found is None:
            tensor = self.tensors[(key, layer)]
            found = self.leaves[(key, layer)] = tensor.detach().requires_grad_(tensor.requires_grad)
        return found

    def state_leaves_of(self, layer: int) -> list:
        found = self.state_leaves.get(layer)
        if found is None:
            found = self.state_leaves[layer] = [s.detach().requires_grad_(s.requires_grad) for s in self.states[layer]]
        return found

    def normalizers(self, rows: np.ndarray, weight: torch.Tensor, with_entropy: bool):
        """(lse, entropy or None) of the LM head's logits at the listed producer rows (host, distinct), as
        leaves the consumers share: each row's are computed once per window, from the producer's final
        hidden states, so their gradient joins the producer backward."""
        final = self.tensors[("final", -1)]
        if self.normalizer_slot is None:
            self.normalizer_slot = np.full(final.shape[0], -1, dtype=np.int64)
        missing = rows[self.normalizer_slot[rows] < 0]
        if missing.size:
            started = self.timer.clock() if self.timer else 0.0
            piece = self.normalizer_pieces
            (missing_rows,) = to_device([missing], final.device)
            lse, entropy = row_normalizers(final, weight, missing_rows, with_entropy=with_entropy)
            self.tensors[("lse", piece)] = lse
            if with_entropy:
                self.tensors[("entropy", piece)] = entropy
            self.normalizer_slot[missing] = self.normalizer_rows + np.arange(missing.size)
            self.normalizer_pieces += 1
            self.normalizer_rows += missing.size
            if self.timer:
                self.timer(started)
        (slots,) = to_device([self.normalizer_slot[rows]], final.device)
        pieces = range(self.normalizer_pieces)
        lse = torch.cat([self.leaf("lse", k) for k in pieces]).index_select(0, slots)
        entropy = torch.cat([self.leaf("entropy", k) for k in pieces]).index_select(0, slots) if with_entropy else None
        return lse, entropy

    def backward(self) -> None:
        """One backward through the producer graph with every interface gradient the consumers left."""
        outputs, grads = [], []
        pairs = [(self.tensors[key], leaf) for key, leaf in self.leaves.items()]
        for layer, leaves in self.state_leaves.items():
            pairs += list(zip(self.states[layer], leaves))
        for tensor, leaf in pairs:
            if leaf.grad is not None and tensor.requires_grad:
                outputs.append(tensor)
                grads.append(leaf.grad)
        if outputs:
            torch.autograd.backward(outputs, grads)

    def release(self) -> None:
        """Drop the window's graph, caches and gradient buffers."""
        self.tensors.clear()
        self.states.clear()
        self.leaves.clear()
        self.state_leaves.clear()
        self.normalizer_slot = None
        self.normalizer_pieces = self.normalizer_rows = 0


class ConsumerView(RowSource):
    """A consumer's decoder: cached rows read from its producer's leaves, the rest computed."""

    def __init__(self, producer: ProducerRecord, cached: CachedRows) -> None:
        self.producer = producer
        self.cached = cached

    def complete(self, key, layer, computed):
        """`computed` None: the consumer computes no row (all its rows are cached)."""
        source = self.producer.leaf(key, layer).index_select(0, self.cached.cached_source)
        if computed is not None:
            source = torch.cat([source, computed])
        return source.index_select(0, self.cached.complete_index)

    def layers_with(self, key: str) -> list[int]:
        """Layers whose producer recorded `key` (e.g. the MoE layers, for "router_logits")."""
        return sorted(layer for k, layer in self.producer.tensors if k == key)

    def start_states(self, layer):
        return self.producer.state_leaves_of(layer)

    def supplied_normalizers(self, positions, weight, with_entropy):
        """The producer's normalizers for every position whose row it caches."""
        source = self.cached.position_source
        if positions is not None:
            source = source[positions]
        given = np.flatnonzero(source >= 0)
        if not given.size:
            return None
        rows, row_of_given = np.unique(source[given], return_inverse=True)
        lse, entropy = self.producer.normalizers(rows, weight, with_entropy)
        given_positions, row_of_given = to_device([given, row_of_given], lse.device)
        return SuppliedNormalizers(given_positions, lse.index_select(0, row_of_given),
                                   entropy.index_select(0, row_of_given) if with_entropy else None)


class WindowSchedule:
    """The producers of one run of microbatches: each runs before its first reader, and its one
    backward (then its release) follows its last reader in this run's order.

    `clock` (seconds) times each producer's forward, backward and LM-head normalizers into
    `producer_seconds`, by (window, replica); the step passes a synchronising clock when asked for
    device times."""

    def __init__(self, producers: list | None, microbatches: list[dict], backward: bool,
                 clock=time.perf_counter) -> None:
        self.producer_of_cell = {(int(p["window"]), int(p["replica"])): p for p in producers or []}
        # Only consumers with cached rows read a producer; the rest run their complete layouts.
        self.cell_of = [(int(mb["window"]), int(mb["replica"])) if producers and has_cached_rows(mb) else None
                        for mb in microbatches]
        self.last_reader = {cell: i for i, cell in enumerate(self.cell_of) if cell is not None}
        self.backward = backward
        self.clock = clock
        self.producer_seconds: dict[tuple[int, int], float] = {}
        self.live: dict = {}
        self.rows = self.producers_run = self.backward_passes = self.most_live = 0

    def source(self, i: int, runner, layout: ExecLayout) -> RowSource:
        """Where microbatch i's decoder reads rows it does not compute (running its producer if needed)."""
        cell = self.cell_of[i]
        if cell is None:
            return PASSTHROUGH
        record = self.live.get(cell)
        if record is None:
            # Producer forward: the decoder over its rows, no LM head, no statistics.
            timer = CellTimer(self.clock, self.producer_seconds, cell)
            started = self.clock()
            record = self.live[cell] = ProducerRecord(timer)
            producer = producer_layout(self.producer_of_cell[cell]).to(layout.row_token.device)
            with torch.set_grad_enabled(self.backward):
                runner.hidden_states(producer, None, record)
            timer(started)
            self.rows += producer.num_rows
            self.producers_run += 1
            self.most_live = max(self.most_live, len(self.live))
        return ConsumerView(record, layout.cached)

    def finished(self, i: int) -> None:
        """Microbatch i's backward has run: after a window's last reader, its producer backward."""
        cell = self.cell_of[i]
        if cell is None or self.last_reader[cell] != i:
            return
        record = self.live.pop(cell)
        try:
            if self.backward:
                started = self.clock()
                record.backward()
                record.timer(started)
                self.backward_passes += record.backward_passes
        finally:   # a producer backward that fails (out of memory) must not keep the window's graph
            record.release()

    @property
    def seconds(self) -> float:
        """Producer time so far (forward and backward, every cell)."""
        return sum(self.producer_seconds.values())

    def close(self) -> None:
        """Release every producer still live: a run that stops early (an exception, an interrupt)
        must not keep their graphs and caches for the rest of the process."""
        for record in self.live.values():
            record.release()
        self.live.clear()
