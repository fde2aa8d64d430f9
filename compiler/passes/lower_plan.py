"""Pass `lower`: executor-ready index arrays, so the executor needs no tree logic.

Reads: a microbatch's `CompactLayout`, `RoundSchedule` and `ReplayPlan`.
Adds: the microbatch's plan record (see `harts.schema.plan` for every key).
Afterwards every index refers to memory order: row r of the lowered arrays is
memory position r; parents, replay rows, export rows and member runs all use
memory positions, and each member's runs expand to the row of every one of its
positions 0..n-1 in order.

With L2 windows (`--levels l1+l2`) it also lowers each producer (its rows,
rounds, replay and exports, no members) and, per consumer, `row_cached_by`:
for every compact row the producer row that computes it, or -1. A cached
row's producer row holds the same token at the same position, and its parent
is the producer row of the consumer row's parent, so consumers can read
cached rows (and their ancestors) straight out of the producer.
"""
from __future__ import annotations

import numpy as np

from harts.compiler.ir.layout import CompactLayout
from harts.schema.runs import expand_runs
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.ir.trie import TrieIR
from harts.compiler.passes.assign_rounds import RoundSchedule
from harts.compiler.passes.plan_replay import ReplayPlan
from harts.compiler.passes.plan_residual import ResidualPlan
from harts.schema.errors import VerificationError


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


# Keys of a microbatch record that a producer shares (no slot, multiplicities or trajectories: its
# members are the prefixes it computes, whose path runs give its attention views).
PRODUCER_KEYS = ("num_rounds", "row_token", "row_position", "row_parent", "sequence_round", "sequence_row_start",
                 "sequence_num_rows", "sequence_start_position", "sequence_replay_offsets", "replay_rows",
                 "sequence_start_state", "round_offsets", "export_row", "export_sequence", "export_chunk",
                 "member_own_start", "member_run_offsets", "run_row_start", "run_length",
                 "segment_row_start", "segment_parent", "segment_level")


def lower_producer(layout: CompactLayout, schedule: RoundSchedule, replay: ReplayPlan, *, replica: int, window: int,
                   prefix_trajectory: np.ndarray, prefix_length: np.ndarray) -> dict:
    """A producer's plan record: its rows in memory order, its rounds/replay/export and segment tables.

    `prefix_trajectory` (file indices) and `prefix_length` name the prefixes it
    computes, in the sorted order its layout was built from.
    """
    record = lower_microbatch(layout, schedule, replay, replica=replica, slot=-1)
    lowered = {"replica": int(replica), "window": int(window)}
    lowered.update({key: record[key] for key in PRODUCER_KEYS})
    lowered["prefix_trajectory"] = np.asarray(prefix_trajectory, dtype=np.int64)
    lowered["prefix_length"] = np.asarray(prefix_length, dtype=np.int64)
    return lowered


def path_rows(layout: CompactLayout, member: int, lo: int, hi: int) -> np.ndarray:
    """Creation-order rows of one member's positions lo..hi-1 (its path runs cover depths 0.. in order)."""
    first, last = layout.run_offsets[member], layout.run_offsets[member + 1]
    starts = layout.run_row_start[first:last]
    lengths = layout.run_length[first:last]
    depth = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    begin = np.maximum(depth, lo)
    end = np.minimum(depth + lengths, hi)
    keep = end > begin
    return expand_runs(starts[keep] + begin[keep] - depth[keep], end[keep] - begin[keep])


def lower_cached_rows(layout: CompactLayout, replay: ReplayPlan, cached_prefix: np.ndarray,
                      producer: CompactLayout | None, producer_replay: ReplayPlan | None,
                      producer_member: np.ndarray) -> np.ndarray:
    """int32[C]: for each consumer row (memory order), the producer row (memory order) computing it, else -1.

    Member i's own rows (created at depths [member_lcp[i], len)) are cached at
    depths below `cached_prefix[i]`; `producer_member[i]` is the producer
    prefix whose path holds those positions. Rows shared with an earlier
    member were mapped through that member (members agree on shared rows).
    """
    out = np.full(layout.num_rows, -1, dtype=np.int32)
    if producer is None:
        return out
    own_start = np.concatenate([[0], np.cumsum(layout.lengths - layout.member_lcp)[:-1]])
    consumer_rows, producer_rows = [], []
    for i in np.flatnonzero(cached_prefix > layout.member_lcp).tolist():
        lo, hi = int(layout.member_lcp[i]), int(cached_prefix[i])
        consumer_rows.append(np.arange(own_start[i], own_start[i] + hi - lo))
        producer_rows.append(path_rows(producer, int(producer_member[i]), lo, hi))
    if consumer_rows:
        rows = np.concatenate(consumer_rows)
        out[replay.exec_of_row[rows]] = producer_replay.exec_of_row[np.concatenate(producer_rows)]
    return out


def lower_residual(residual: ResidualPlan, row_cached_by: np.ndarray, producer_export_row: np.ndarray) -> dict:
    """A consumer's `residual_*` keys: its decoder-row linear-attention calls; an external start
    state becomes the index of the producer export taken after that cached row."""
    external = residual.sequence_external_row >= 0
    producer_state = np.full(len(external), -1, dtype=np.int64)
    rows = np.asarray(row_cached_by, dtype=np.int64)[residual.sequence_external_row[external]]
    producer_state[external] = np.searchsorted(producer_export_row, rows)
    if len(rows) and np.any(producer_export_row[np.minimum(producer_state[external], len(producer_export_row) - 1)]
                            != rows):
        raise VerificationError("a consumer's anchor state is exported by its producer",
                                "the producer does not export a requested anchor state")
    return {
        "residual_num_rounds": int(residual.num_rounds),
        "residual_sequence_round": residual.sequence_round,
        "residual_sequence_token_offsets": residual.sequence_token_offsets,
        "residual_token_rows": residual.token_rows,
        "residual_sequence_replay": residual.sequence_replay,
        "residual_sequence_start_position": residual.sequence_start_depth,
        "residual_sequence_start_state": residual.sequence_start_state,
        "residual_sequence_producer_state": producer_state,
        "residual_export_sequence": residual.export_sequence,
        "residual_export_chunk": residual.export_chunk,
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
