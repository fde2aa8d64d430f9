"""Pass `lower`: executor-ready index arrays, so the executor needs no tree logic.

Reads: a microbatch's `CompactLayout`, `RoundSchedule` and `ReplayPlan`.
Adds: the microbatch's plan record (see `harts.schema.plan` for every key).
Afterwards every index refers to memory order: row r of the lowered arrays is
memory position r; parents, replay rows, export rows and member runs all use
memory positions, and each member's runs expand to the row of every one of its
positions 0..n-1 in order.
"""
from __future__ import annotations

import numpy as np

from harts.compiler.ir.layout import CompactLayout
from harts.schema.runs import expand_runs
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.ir.trie import TrieIR
from harts.compiler.passes.assign_rounds import RoundSchedule
from harts.compiler.passes.plan_replay import ReplayPlan


def lower_member_runs(layout: CompactLayout, replay: ReplayPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split each creation-order path run at segment boundaries and move it to memory order.

    Segments are contiguous in memory, so a run piece inside one segment stays
    one run; a creation-order run spanning k segments becomes k pieces.
    """
    seg_start = layout.segment_row_start
    segment_of_row = np.repeat(np.arange(layout.num_segments), np.diff(seg_start))
    run_start = layout.run_row_start
    run_end = run_start + layout.run_length
    nonempty = layout.run_length > 0
    first_seg = np.zeros(len(run_start), dtype=np.int64)
    last_seg = np.full(len(run_start), -1, dtype=np.int64)
    first_seg[nonempty] = segment_of_row[run_start[nonempty]]
    last_seg[nonempty] = segment_of_row[run_end[nonempty] - 1]
    pieces = last_seg - first_seg + 1
    piece_segment = expand_runs(first_seg, pieces)
    piece_run = np.repeat(np.arange(len(run_start)), pieces)
    piece_lo = np.maximum(run_start[piece_run], seg_start[piece_segment])
    piece_hi = np.minimum(run_end[piece_run], seg_start[piece_segment + 1])
    piece_exec_start = replay.exec_of_row[piece_lo]
    # Every member has at least one run (length >= 2), so no reduceat range is empty.
    pieces_per_member = np.add.reduceat(pieces, layout.run_offsets[:-1])
    member_offsets = np.zeros(len(layout.trajectories) + 1, dtype=np.int64)
    np.cumsum(pieces_per_member, out=member_offsets[1:])
    return member_offsets, piece_exec_start.astype(np.int64), (piece_hi - piece_lo).astype(np.int64)


def lower_segments(layout: CompactLayout, replay: ReplayPlan) -> dict:
    """Segments in memory order, for node-wise execution (one linear-attention call per segment).

    Each segment is a contiguous memory range; its parent segment comes earlier
    in memory; its level is its depth in the segment tree (roots 0), so the
    segments of one level can run side by side once the previous level ran.
    """
    order = replay.segment_order
    memory_index = np.empty_like(order)
    memory_index[order] = np.arange(len(order))
    seg_len = np.diff(layout.segment_row_start)[order]
    row_start = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(seg_len, out=row_start[1:])
    parent_creation = layout.segment_parent.astype(np.int64)
    level = np.zeros(layout.num_segments, dtype=np.int64)
    for v in range(layout.num_segments):   # creation order: parents before children
        if parent_creation[v] >= 0:
            level[v] = level[parent_creation[v]] + 1
    parent = parent_creation[order]
    return {
        "segment_row_start": row_start,
        "segment_parent": np.where(parent >= 0, memory_index[np.maximum(parent, 0)], -1),
        "segment_level": level[order],
    }


def lower_microbatch(layout: CompactLayout, schedule: RoundSchedule, replay: ReplayPlan,
                     *, replica: int, slot: int) -> dict:
    perm = replay.row_of_exec
    parent_creation = layout.row_parent[perm].astype(np.int64)
    row_parent = np.where(parent_creation >= 0, replay.exec_of_row[np.maximum(parent_creation, 0)], -1)
    member_run_offsets, run_row_start, run_length = lower_member_runs(layout, replay)
    return {
        "replica": int(replica),
        "slot": int(slot),
        "num_rounds": int(schedule.num_rounds),
        "row_token": layout.row_token[perm],
        "row_position": layout.row_depth[perm],
        "row_parent": row_parent.astype(np.int32),
        "row_multiplicity": layout.row_multiplicity[perm],
        "sequence_round": replay.sequence_round,
        "sequence_row_start": replay.sequence_row_start,
        "sequence_num_rows": replay.sequence_num_rows,
        "sequence_start_position": replay.sequence_start_depth,
        "sequence_replay_offsets": replay.sequence_replay_offsets,
        "replay_rows": replay.replay_rows,
        "sequence_start_state": replay.sequence_start_state,
        "round_offsets": replay.round_offsets,
        "export_row": replay.export_row,
        "export_sequence": replay.export_sequence,
        "export_chunk": replay.export_chunk,
        "member_trajectory": layout.trajectories,
        "member_own_start": layout.member_lcp,
        "member_run_offsets": member_run_offsets,
        "run_row_start": run_row_start,
        "run_length": run_length,
        **lower_segments(layout, replay),
    }


def lower_step(batch: TrajectoryBatch, trie: TrieIR) -> dict:
    """Step-level records: ids and RL metadata in file order, shared by all microbatches."""
    return {
        "num_trajectories": batch.num_trajectories,
        "ids": list(batch.ids),
        "trees": list(batch.trees),
        "token_offsets": batch.token_offsets,
        "loss_mask": batch.loss_mask,
        "advantages": batch.advantages,
        "old_logprobs": batch.old_logprobs,
        "ref_logprobs": batch.ref_logprobs,
        "has_old_logprobs": batch.has_old_logprobs,
        "has_ref_logprobs": batch.has_ref_logprobs,
        "original_tokens": batch.num_tokens,
        "trie_unique_tokens": trie.unique_tokens,
    }
