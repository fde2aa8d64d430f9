"""Pass `plan-residual`: a window consumer's linear-attention calls over its uncached rows only.

Reads: a consumer's `CompactLayout` and `ReplayPlan`, which of its rows its
window's producer caches (`row_cached_by`, memory order, -1 = computed here),
and the chunk size B. Adds: a `ResidualPlan`.

With sharing windows a consumer runs the decoder only on its uncached rows U.
Cached rows are prefix-closed, so U hangs below cached rows as a forest whose
roots start anywhere on a trajectory. Every chunk a consumer computes must
still lie on its trajectory's own chunk grid, so each root at depth s is
extended upwards by *ghost* rows: the cached path rows at depths [a(s), s),
a(s) = B * floor(s / B). Ghost rows are never computed here; their
linear-attention inputs are the producer's (replay inputs), and they only
ever appear as replay. The ghost + uncached forest G u U is scheduled by the
same passes as a microbatch (`assign_rounds`, `plan_replay` with external
roots), so it gets the minimum number of rounds under the same call model.

A sequence whose anchor a > 0 lies at or above its root starts from an
*external* state: the producer's boundary state after the path row at depth
a - 1, which is a cached row (the producer exports it; see `with_exports`).

Invariants afterwards (checked by `verify_residual`):
* every uncached row is the output of exactly one sequence, no ghost or cached
  row is an output, and each sequence lists its replay rows first;
* each sequence's token rows follow its path at consecutive depths starting
  at its anchor a (a multiple of B);
* a sequence's start state is zero (a == 0), an export of an earlier round of
  this consumer, or exactly one producer export (external);
* exports sit on whole chunks of their sequence.

Legend: C consumer rows, U uncached rows, G ghost rows, Q residual sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.compiler.ir.layout import CompactLayout, segments_of
from harts.compiler.passes.assign_rounds import assign_rounds
from harts.compiler.passes.plan_replay import ReplayPlan, plan_replay
from harts.schema.errors import VerificationError
from harts.schema.runs import expand_runs


@dataclass(frozen=True, slots=True)
class ResidualPlan:
    """Linear-attention calls of one consumer's decoder rows; all rows are consumer memory rows."""

    num_rounds: int
    sequence_round: np.ndarray          # int32[Q]
    sequence_token_offsets: np.ndarray  # int64[Q + 1] into token_rows
    token_rows: np.ndarray              # int64[N]: per sequence its replay rows, then its output rows
    sequence_replay: np.ndarray         # int64[Q]: leading replay rows of each sequence
    sequence_start_depth: np.ndarray    # int64[Q]: the anchor a
    sequence_start_state: np.ndarray    # int64[Q]: export of this plan, or -1
    sequence_external_row: np.ndarray   # int64[Q]: consumer (cached) row whose state the producer hands over, or -1
    export_sequence: np.ndarray         # int64[E]
    export_chunk: np.ndarray            # int64[E]: whole chunks of that sequence (replay included) before it

    @property
    def replay_tokens(self) -> int:
        return int(self.sequence_replay.sum())


def ghost_rows(layout: CompactLayout, cached: np.ndarray, chunk_size: int) -> np.ndarray:
    """bool[C] (creation order): cached rows at depths [a(s), s) above each uncached root at depth s."""
    parent = layout.row_parent.astype(np.int64)
    has_parent = parent >= 0
    root = ~cached & has_parent
    root[has_parent] &= cached[parent[has_parent]]
    roots = np.flatnonzero(root)
    depth = layout.row_depth[roots].astype(np.int64)
    missing = depth % chunk_size                # rows between the anchor and the root
    ghost = np.zeros(layout.num_rows, dtype=bool)
    current = roots
    for step in range(chunk_size - 1):          # at most B - 1 steps, all roots at once
        walking = missing > step
        if not walking.any():
            break
        current = np.where(walking, parent[current], current)
        ghost[current[walking]] = True
    return ghost


def plan_residual(layout: CompactLayout, replay: ReplayPlan, row_cached_by: np.ndarray,
                  chunk_size: int) -> ResidualPlan:
    B = chunk_size
    cached = np.asarray(row_cached_by)[replay.exec_of_row] >= 0      # creation order
    ghost = ghost_rows(layout, cached, B)
    selected = np.flatnonzero(~cached | ghost)                         # creation order, parents first
    # One more entry than rows, left at -1, so that a root's parent (-1) maps to -1 without a where().
    index_of = np.full(layout.num_rows + 1, -1, dtype=np.int64)
    index_of[selected] = np.arange(len(selected))
    parent = index_of[layout.row_parent[selected]]
    segment_row_start, segment_parent = segments_of(parent)
    empty = np.zeros(0, dtype=np.int64)
    # The residual forest has no members: rounds and replay read only rows and segments.
    forest = CompactLayout(
        trajectories=empty, lengths=empty, member_lcp=empty,
        row_token=layout.row_token[selected], row_depth=layout.row_depth[selected],
        row_parent=parent.astype(np.int32), row_multiplicity=np.ones(len(selected), dtype=np.int32),
        segment_row_start=segment_row_start, segment_parent=segment_parent.astype(np.int32),
        run_offsets=np.zeros(1, dtype=np.int64), run_row_start=empty, run_length=empty)
    schedule = assign_rounds(forest, B)
    plan = plan_replay(forest, schedule, external_roots=True)

    memory_of_forest_row = replay.exec_of_row[selected]                # forest creation -> consumer memory
    # Outputs tile the forest's memory rows in sequence order (ReplayPlan), so memory row i is output i.
    own_ghost = ghost[selected][plan.row_of_exec]
    Q = len(plan.sequence_round)
    # Ghost rows of a sequence come first (a ghost's ancestors are ghosts or outside the forest). A ghost's
    # sequence is the last one whose outputs start at or before it.
    ghost_sequence = np.searchsorted(plan.sequence_row_start, np.flatnonzero(own_ghost), side="right") - 1
    ghosts_per_sequence = np.bincount(ghost_sequence, minlength=Q)
    lead = np.zeros(len(own_ghost), dtype=bool)
    lead_positions = expand_runs(plan.sequence_row_start, ghosts_per_sequence)
    lead[lead_positions] = True
    if np.any(lead != own_ghost):
        raise VerificationError("ghost rows lead their sequence", "a ghost row follows an uncached row")
    replay_len = np.diff(plan.sequence_replay_offsets)
    token_count = replay_len + plan.sequence_num_rows
    offsets = np.zeros(Q + 1, dtype=np.int64)
    np.cumsum(token_count, out=offsets[1:])
    # Each sequence's replay rows, then its outputs: output memory row i sits after the replay rows of its own
    # sequence and of every sequence before it.
    tokens = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(np.cumsum(replay_len), token_count)
    tokens[expand_runs(offsets[:-1], replay_len)] = plan.replay_rows
    token_rows = memory_of_forest_row[plan.row_of_exec[tokens]]

    # External start: the consumer row at depth a - 1 above the sequence's anchor row.
    external = plan.sequence_external_start
    anchor_row = plan.row_of_exec[tokens[offsets[:-1][external]]]     # forest row at depth a
    outer = layout.row_parent[selected[anchor_row]].astype(np.int64)
    external_row = np.full(Q, -1, dtype=np.int64)
    external_row[external] = replay.exec_of_row[outer]
    return ResidualPlan(
        num_rounds=int(schedule.num_rounds),
        sequence_round=plan.sequence_round,
        sequence_token_offsets=offsets,
        token_rows=token_rows,
        sequence_replay=(replay_len + ghosts_per_sequence).astype(np.int64),
        sequence_start_depth=plan.sequence_start_depth,
        sequence_start_state=plan.sequence_start_state,
        sequence_external_row=external_row,
        export_sequence=plan.export_sequence,
        export_chunk=plan.export_chunk,
    )


def verify_residual(residual: ResidualPlan, row_cached_by: np.ndarray, row_parent: np.ndarray,
                    row_position: np.ndarray, chunk_size: int) -> None:
    """Check the module docstring's invariants against the consumer's lowered rows."""
    cached_by = np.asarray(row_cached_by, dtype=np.int64)
    parent = np.asarray(row_parent, dtype=np.int64)
    position = np.asarray(row_position, dtype=np.int64)
    offsets, tokens = residual.sequence_token_offsets, residual.token_rows
    count = np.diff(offsets)
    outputs = expand_runs(offsets[:-1] + residual.sequence_replay, count - residual.sequence_replay)
    produced = np.bincount(tokens[outputs], minlength=len(cached_by))
    if np.any(produced != (cached_by < 0)):
        raise VerificationError("every uncached row is the output of exactly one sequence",
                                "an uncached row is produced 0 or 2+ times, or a cached row is an output")
    starts = offsets[:-1]
    within = np.ones(len(tokens), dtype=bool)
    within[starts[count > 0]] = False
    if np.any(parent[tokens[within]] != tokens[np.flatnonzero(within) - 1]):
        raise VerificationError("a sequence follows its path", "a token row's parent is not the row before it")
    first = tokens[starts[count > 0]]
    if np.any(position[first] != residual.sequence_start_depth[count > 0]) or np.any(
            residual.sequence_start_depth % chunk_size != 0):
        raise VerificationError("a sequence starts at its chunk-aligned anchor", "first token row is off the anchor")
    external = residual.sequence_external_row >= 0
    if np.any(external & (residual.sequence_start_state >= 0)):
        raise VerificationError("one start state per sequence", "a sequence has an internal and an external state")
    zero = ~external & (residual.sequence_start_state < 0)
    if np.any(residual.sequence_start_depth[zero] != 0):
        raise VerificationError("only a sequence at depth 0 starts from zero", "a sequence above 0 has no state")
    ext = residual.sequence_external_row[external]
    if np.any(cached_by[ext] < 0) or np.any(position[ext] + 1 != residual.sequence_start_depth[external]):
        raise VerificationError("an external state is a cached row's at the anchor",
                                "the handed-over row is uncached or not at depth a - 1")
    state_round = residual.sequence_round[residual.export_sequence]
    internal = residual.sequence_start_state >= 0
    if np.any(state_round[residual.sequence_start_state[internal]] >= residual.sequence_round[internal]):
        raise VerificationError("a state is exported in an earlier round", "a sequence reads a state of its own round")
