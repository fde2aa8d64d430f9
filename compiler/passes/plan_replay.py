"""Pass `plan-replay`: memory order, replay rows, start states and exports.

Reads: a microbatch's `CompactLayout` and `RoundSchedule`. Adds: a
`ReplayPlan`. Afterwards:

* compact rows are laid out round-major, each sequence contiguous (its
  segments in continuation order, each segment in depth order);
* every sequence starts at the anchor a(s) of its head segment: from the zero
  state when a(s) == 0, else from the boundary state after the path row at
  depth a(s) - 1, which an earlier round exports;
* a sequence replays the path rows at depths [a(s), s) (fewer than B, their
  outputs discarded) before producing its own rows, so every chunk it
  computes lies on the trajectory's own chunk grid;
* each export is taken after a whole number of chunks of its producer
  sequence, in a round before any sequence that starts from it.

Legend: C rows, Q sequences, E exported states, P replay rows in total.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from harts.compiler.ir.layout import CompactLayout
from harts.schema.runs import expand_runs
from harts.compiler.passes.assign_rounds import RoundSchedule
from harts.schema.errors import VerificationError


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """Memory order and linear-attention call tables of one microbatch (rows in memory order).

    Memory order is the sequences' output rows one sequence after another: sequence q outputs memory rows
    [sequence_row_start[q], sequence_row_start[q] + sequence_num_rows[q]), and sequence_row_start is the
    running sum of sequence_num_rows from 0 (so the outputs tile the rows in sequence order).
    """

    segment_order: np.ndarray         # int64[V]: creation-order segments in memory order
    exec_of_row: np.ndarray           # int64[C]: memory position of each creation-order row
    row_of_exec: np.ndarray           # int64[C]: creation-order row at each memory position
    sequence_round: np.ndarray        # int32[Q]
    sequence_row_start: np.ndarray    # int64[Q]: first output row (memory order)
    sequence_num_rows: np.ndarray     # int64[Q]
    sequence_start_depth: np.ndarray  # int64[Q]: the anchor a(s) the sequence starts at
    sequence_replay_offsets: np.ndarray  # int64[Q + 1] into replay_rows
    replay_rows: np.ndarray           # int64[P]: memory rows replayed, depth order per sequence
    sequence_start_state: np.ndarray  # int64[Q]: export index, -1 for the zero state
    export_row: np.ndarray            # int64[E]: memory row after which the state is taken
    export_sequence: np.ndarray       # int64[E]: sequence producing it
    export_chunk: np.ndarray          # int64[E]: whole chunks of that sequence (replay included) before it
    round_offsets: np.ndarray         # int64[R + 1]: sequences of round r are [round_offsets[r-1], round_offsets[r])
    # bool[Q]: the start state comes from outside the layout (a root above depth 0 whose
    # anchor row lies in a window's producer); only with `external_roots`, else all False.
    sequence_external_start: np.ndarray | None = None

    @property
    def replay_tokens(self) -> int:
        return len(self.replay_rows)


def plan_replay(layout: CompactLayout, schedule: RoundSchedule, external_roots: bool = False) -> ReplayPlan:
    """`external_roots`: roots may start at chunk-aligned depths > 0 (a consumer's residual
    forest); a sequence whose anchor state lies above its root starts from an external state."""
    B = schedule.chunk_size
    seg_start = layout.segment_row_start
    seg_len = np.diff(seg_start)
    nxt = schedule.segment_next.tolist()

    # Segments in memory order: each sequence's continuation chain, sequences by round.
    segment_order: list[int] = []
    sequence_num_segments: list[int] = []
    for head in schedule.sequence_head.tolist():
        before = len(segment_order)
        v = head
        while v >= 0:
            segment_order.append(v)
            v = nxt[v]
        sequence_num_segments.append(len(segment_order) - before)
    order = np.asarray(segment_order, dtype=np.int64)
    row_of_exec = expand_runs(seg_start[:-1][order], seg_len[order])
    exec_of_row = np.empty_like(row_of_exec)
    exec_of_row[row_of_exec] = np.arange(len(row_of_exec))

    Q = len(schedule.sequence_head)
    segs_per_seq = np.asarray(sequence_num_segments, dtype=np.int64)
    first_seg_index = np.zeros(Q + 1, dtype=np.int64)
    np.cumsum(segs_per_seq, out=first_seg_index[1:])
    rows_per_segment_in_order = seg_len[order]
    row_cum = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(rows_per_segment_in_order, out=row_cum[1:])
    sequence_row_start = row_cum[first_seg_index[:-1]]
    sequence_num_rows = row_cum[first_seg_index[1:]] - sequence_row_start

    # Replay: walk up from each head's first row, all heads at once, < B steps.
    head_first_row = seg_start[schedule.sequence_head.astype(np.int64)]
    head_depth = layout.row_depth[head_first_row].astype(np.int64)
    anchor = head_depth // B * B
    replay_len = head_depth - anchor
    needs_state = anchor > 0
    ancestors = np.full((Q, B), -1, dtype=np.int64)   # ancestors[:, j]: path row at depth s - 1 - j
    # Read below: columns j < replay_len (the replay rows) and j == replay_len where a state is needed (the
    # row at depth a - 1), so the walk stops after the deepest column read rather than always taking B steps.
    walk = max(int(replay_len.max(initial=0)), int(replay_len[needs_state].max(initial=-1)) + 1)
    if walk:
        parent = np.append(layout.row_parent.astype(np.int64), -1)   # parent[-1] == -1: above a root stays -1
        cur = head_first_row.astype(np.int64)
        for j in range(walk):
            cur = parent[cur]
            ancestors[:, j] = cur
    cols = np.arange(B)
    # Replay rows in depth order: ancestors j = replay_len-1 ... 0.
    take = cols[None, :] < replay_len[:, None]
    replay_creation = ancestors[:, ::-1][take[:, ::-1]]
    replay_offsets = np.zeros(Q + 1, dtype=np.int64)
    np.cumsum(replay_len, out=replay_offsets[1:])
    replay_rows = exec_of_row[replay_creation] if len(replay_creation) else np.zeros(0, np.int64)

    # Start state: the boundary state after the path row at depth anchor - 1.
    key_creation = ancestors[np.flatnonzero(needs_state), replay_len[needs_state]]
    external = np.zeros(Q, dtype=bool)
    outside = key_creation < 0
    if np.any(outside):
        if not external_roots:
            raise VerificationError("a start state is exported inside the microbatch",
                                    "a sequence's anchor row lies above its root")
        external[np.flatnonzero(needs_state)[outside]] = True
        needs_state &= ~external
        key_creation = key_creation[~outside]
    key_exec = exec_of_row[key_creation]
    export_row, state_index = np.unique(key_exec, return_inverse=True)
    sequence_start_state = np.full(Q, -1, dtype=np.int64)
    sequence_start_state[needs_state] = state_index

    export_sequence, export_chunk = _locate_exports(export_row, sequence_row_start, replay_len, B,
                                                    "an anchor state falls inside a chunk of its producer")

    rounds = schedule.sequence_round.astype(np.int64)
    round_offsets = np.searchsorted(rounds, np.arange(1, schedule.num_rounds + 2), side="left").astype(np.int64)
    plan = ReplayPlan(
        segment_order=order,
        exec_of_row=exec_of_row,
        row_of_exec=row_of_exec,
        sequence_round=schedule.sequence_round.astype(np.int32),
        sequence_row_start=sequence_row_start,
        sequence_num_rows=sequence_num_rows,
        sequence_start_depth=anchor,
        sequence_replay_offsets=replay_offsets,
        replay_rows=replay_rows,
        sequence_start_state=sequence_start_state,
        export_row=export_row.astype(np.int64),
        export_sequence=export_sequence,
        export_chunk=export_chunk,
        round_offsets=round_offsets,
        sequence_external_start=external,
    )
    return plan


def _locate_exports(export_row, sequence_row_start, replay_len, chunk_size: int,
                    problem: str) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, whole chunks before) of the state after each memory row in `export_row`;
    every such state must end a whole chunk of its sequence (replay included)."""
    # The sequence whose outputs hold the row: the last one starting at or before it (outputs tile the rows).
    export_sequence = np.searchsorted(sequence_row_start, export_row, side="right") - 1
    local_end = replay_len[export_sequence] + (export_row - sequence_row_start[export_sequence]) + 1
    if np.any(local_end % chunk_size != 0):
        raise VerificationError("exports sit on chunk boundaries", problem)
    return export_sequence.astype(np.int64), (local_end // chunk_size).astype(np.int64)


def with_exports(replay: ReplayPlan, rows: np.ndarray, chunk_size: int) -> tuple[ReplayPlan, np.ndarray]:
    """The same plan also exporting the state after each memory row in `rows`; returns it and
    the export index of every requested row.

    A window's producer exports, besides its own handoffs, the anchor states its
    consumers start from. Each requested row must end a whole chunk of its
    sequence (its depth + 1 is a multiple of B), which holds for any row at
    depth a - 1 with a chunk-aligned, since every sequence runs on the
    trajectory's own chunk grid. Memory order and rounds are unchanged.
    """
    rows = np.asarray(rows, dtype=np.int64)
    export_row = np.union1d(replay.export_row, rows).astype(np.int64)
    export_sequence, export_chunk = _locate_exports(
        export_row, replay.sequence_row_start, np.diff(replay.sequence_replay_offsets),
        chunk_size, "a requested anchor state falls inside a chunk of its producer")
    start_state = replay.sequence_start_state.copy()
    has = start_state >= 0
    start_state[has] = np.searchsorted(export_row, replay.export_row[start_state[has]])
    extended = dataclasses.replace(replay, export_row=export_row, export_sequence=export_sequence,
                                   export_chunk=export_chunk, sequence_start_state=start_state)
    return extended, np.searchsorted(export_row, rows).astype(np.int64)
