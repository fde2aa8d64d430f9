"""Executor-side views of one plan microbatch: the rows to run and every index into them.

Legend: R rows run through the decoder, N packed tokens of one round, S
sequences of a round, E exported states, P semantic positions with a label
(trajectory positions i >= 1), k member trajectories.

Three modes read the same plan record; none walks a tree:

* `compact`: the plan's compact rows and its minimum-call rounds with replay;
* `nodewise`: the same rows, one linear-attention call per segment (the
  paper's Section 5.4 node-wise ablation, also `--no-replay`): each segment
  starts from its parent's exact final state at the fork, on a chunk grid
  that starts there (no replay);
* `expanded`: every trajectory gets its own rows (gathered from the compact
  rows by its path), one sequence each, nothing shared: the baseline.

A window consumer of an L1+L2 plan (compact mode with `windows=True`) keeps
its complete rows for the LM head, the loss and the MoE statistics, but its
decoder runs only the rows its producer does not cache (`decoder_rows`), with
the plan's residual linear-attention calls and views that query only those
rows; `cached` says where every other row's values come from.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from harts.executor.ops.ancestor_attention import AttentionViews
from harts.executor.ops.transfer import to_device
from harts.schema.runs import expand_runs

MODES = ("compact", "nodewise", "expanded")


def _array(x, dtype=np.int64) -> np.ndarray:
    return np.array(x, dtype=dtype, copy=True)   # plan arrays are read-only buffers


def _long(x) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))


@dataclass(frozen=True, eq=False)
class RoundCall:
    """One packed linear-attention call."""

    token_rows: torch.Tensor    # [N] rows gathered into the call: each sequence's replay rows, then its outputs
    cu_seqlens: torch.Tensor    # [S + 1]
    output_tokens: torch.Tensor  # packed indices of the output tokens, in the order their rows are listed
    start_state: torch.Tensor   # [S] global export index, -1 for the zero state
    export_sequence: torch.Tensor  # [E_r] sequence within this call
    export_chunk: torch.Tensor  # [E_r] whole chunks before the export
    export_ids: torch.Tensor    # [E_r] global export index of each
    start_external: torch.Tensor | None = None  # [S] producer export to start from, -1 for none (windows only)
    # Host facts that spare the runner a gather: (first, end) when token_rows is the range first..end-1
    # (a slice reads it, and its backward scatters nothing), else None; and whether every packed token
    # is an output (no replay), in which case output_tokens is 0..N-1.
    token_range: tuple[int, int] | None = None
    outputs_are_all_tokens: bool = False


@dataclass(frozen=True, eq=False)
class LinearCalls:
    """All rounds of one microbatch; concatenating their outputs and applying
    `output_order` (None: identity) yields one output per row in row order."""

    rounds: list
    num_exports: int
    output_order: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class CachedRows:
    """Where a window consumer's rows come from: row r of a complete per-row tensor is
    `cat([producer_values[cached_source], decoder_values])[complete_index[r]]`."""

    cached_source: torch.Tensor   # [Cc] producer row of each cached row (consumer rows ascending)
    complete_index: torch.Tensor  # [C]
    # Host: producer row of each labelled position's row, -1 where the consumer computes the row
    # (the producer owns the LM-head normalizer of every row it caches).
    position_source: np.ndarray   # [P]


@dataclass(frozen=True, eq=False)
class ExecLayout:
    mode: str
    row_token: torch.Tensor       # [R]
    row_position: torch.Tensor    # [R]
    row_parent: np.ndarray        # [R], -1 at position 0
    row_weight: torch.Tensor      # [R] occurrence count (multiplicity) of each row, float
    calls: LinearCalls
    views: AttentionViews
    position_row: torch.Tensor    # [P] row whose logits predict the position (its previous position's row)
    position_label: torch.Tensor  # [P] the position's token
    position_flat: np.ndarray     # [P] index into the step's flat per-token arrays
    member_trajectory: np.ndarray  # [k] trajectory (file index) of each member
    decoder_rows: torch.Tensor | None = None  # [U] rows the decoder computes; None: every row
    cached: CachedRows | None = None          # window consumers only

    @property
    def num_rows(self) -> int:
        return int(self.row_token.shape[0])

    @property
    def num_decoder_rows(self) -> int:
        return self.num_rows if self.decoder_rows is None else int(self.decoder_rows.shape[0])

    def decoder_view(self, per_row: torch.Tensor) -> torch.Tensor:
        """The decoder rows' entries of a per-row tensor."""
        return per_row if self.decoder_rows is None else per_row[self.decoder_rows]

    def to(self, device: torch.device | str) -> "ExecLayout":
        """Every index tensor the ops read on the device on `device` (the model's), in one copy per
        dtype (`ops.transfer`); what is only read on the host stays there (numpy arrays, the views,
        and each round's geometry and state bookkeeping: `HOST_FIELDS`), so reading it never waits
        for the device."""
        leaves: list[torch.Tensor] = []
        _collect_device_leaves(self, leaves)
        return _replace_device_leaves(self, iter(to_device(leaves, torch.device(device))))


# Read as host lists by the runner and the linear-attention op (validation, round layout):
# on the host they cost no device synchronisation.
HOST_FIELDS = {RoundCall: ("cu_seqlens", "start_state", "export_sequence", "export_chunk", "export_ids",
                           "start_external")}
_CONTAINERS = (ExecLayout, LinearCalls, RoundCall, CachedRows)


def _device_fields(obj):
    host = HOST_FIELDS.get(type(obj), ())
    return [f.name for f in dataclasses.fields(obj) if f.name not in host]


def _collect_device_leaves(obj, leaves: list) -> None:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
    elif isinstance(obj, list):
        for x in obj:
            _collect_device_leaves(x, leaves)
    elif isinstance(obj, _CONTAINERS):
        for name in _device_fields(obj):
            _collect_device_leaves(getattr(obj, name), leaves)


def _replace_device_leaves(obj, moved):
    """`obj` with its device leaves taken from `moved`, in `_collect_device_leaves` order."""
    if isinstance(obj, torch.Tensor):
        return next(moved)
    if isinstance(obj, list):
        return [_replace_device_leaves(x, moved) for x in obj]
    if isinstance(obj, _CONTAINERS):
        return dataclasses.replace(obj, **{name: _replace_device_leaves(getattr(obj, name), moved)
                                           for name in _device_fields(obj)})
    return obj


def _calls(sequences: list[tuple[np.ndarray, int]], sequence_round: np.ndarray, start_state: np.ndarray,
           export_sequence: np.ndarray, export_chunk: np.ndarray, output_rows_in_order: bool,
           output_rows: list[np.ndarray], start_external: np.ndarray | None = None) -> LinearCalls:
    """Group sequences (token rows, number of replay tokens) by round into packed calls."""
    if not sequences:   # a window consumer whose rows are all cached
        return LinearCalls(rounds=[], num_exports=0, output_order=None)
    rounds = []
    order = np.argsort(sequence_round, kind="stable")
    sequence_round = sequence_round[order]
    bounds = np.flatnonzero(np.diff(sequence_round)) + 1
    local_index = np.empty(len(order), dtype=np.int64)
    for group in np.split(order, bounds):
        local_index[group] = np.arange(len(group))
    listed_rows = []
    for group in np.split(order, bounds):
        tokens = [sequences[q][0] for q in group]
        lengths = np.array([len(t) for t in tokens], dtype=np.int64)
        cu = np.zeros(len(group) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        replay = np.array([sequences[q][1] for q in group], dtype=np.int64)
        outputs = expand_runs(cu[:-1] + replay, lengths - replay)
        exports = np.flatnonzero(np.isin(export_sequence, group))
        token_rows = np.concatenate(tokens)
        contiguous = len(token_rows) > 0 and bool(np.all(np.diff(token_rows) == 1))
        rounds.append(RoundCall(
            token_rows=_long(token_rows),
            cu_seqlens=_long(cu),
            output_tokens=_long(outputs),
            start_state=_long(start_state[group]),
            export_sequence=_long(local_index[export_sequence[exports]]),
            export_chunk=_long(export_chunk[exports]),
            export_ids=_long(exports),
            start_external=None if start_external is None else _long(start_external[group]),
            token_range=(int(token_rows[0]), int(token_rows[-1]) + 1) if contiguous else None,
            # Outputs are distinct packed indices, so as many as the tokens means all of them, in order.
            outputs_are_all_tokens=len(outputs) == len(token_rows),
        ))
        listed_rows += [output_rows[q] for q in group]
    output_order = None
    if not output_rows_in_order:
        listed = np.concatenate(listed_rows)
        output_order = _long(np.argsort(listed, kind="stable"))
    return LinearCalls(rounds=rounds, num_exports=len(export_sequence), output_order=output_order)


def _positions(path_rows: np.ndarray, lengths: np.ndarray, row_token: np.ndarray, trajectories: np.ndarray,
               token_offsets: np.ndarray):
    """Labelled positions of every member: previous position's row, own token, flat index."""
    starts = np.cumsum(lengths) - lengths
    keep_label = np.ones(len(path_rows), dtype=bool)
    keep_label[starts] = False                 # position 0 is never a target
    keep_row = np.ones(len(path_rows), dtype=bool)
    keep_row[starts + lengths - 1] = False     # the last position predicts nothing
    index_in_traj = np.arange(len(path_rows)) - np.repeat(starts, lengths)
    flat = np.repeat(token_offsets[trajectories], lengths) + index_in_traj
    return (_long(path_rows[keep_row]), _long(row_token[path_rows[keep_label]]), flat[keep_label])


def expanded_groups(mb: dict, token_offsets: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Members packed in order into groups of at most `capacity` original tokens (one member at least).

    The expanded baseline trains trajectories alone, so it packs them by their
    own lengths under the same capacity a compact microbatch has, as
    trajectory-expanded training would; one group per plan microbatch would
    hold up to compression x capacity tokens.
    """
    token_offsets = np.asarray(token_offsets, dtype=np.int64)
    trajectories = np.asarray(mb["member_trajectory"], dtype=np.int64)
    lengths = token_offsets[trajectories + 1] - token_offsets[trajectories]
    groups, start, used = [], 0, 0
    for j, n in enumerate(lengths.tolist()):
        if used + n > capacity and j > start:
            groups.append(np.arange(start, j))
            start, used = j, 0
        used += n
    groups.append(np.arange(start, len(lengths)))
    return groups


def build_layout(mb: dict, token_offsets: np.ndarray, chunk_size: int, mode: str = "compact",
                 members: np.ndarray | None = None, windows: bool = False) -> ExecLayout:
    """The rows one microbatch runs in `mode`; `members` (expanded mode only) selects a subset.

    `windows` (compact mode): a consumer with cached rows runs only its
    uncached rows through the decoder (see `_read_producer`).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if members is not None and mode != "expanded":
        raise ValueError("a member subset only makes sense in expanded mode (compact rows are shared)")
    token_offsets = np.asarray(token_offsets, dtype=np.int64)
    trajectories = _array(mb["member_trajectory"])
    run_offsets = _array(mb["member_run_offsets"])
    run_start, run_length = _array(mb["run_row_start"]), _array(mb["run_length"])
    if members is not None:
        members = np.asarray(members, dtype=np.int64)
        runs = expand_runs(run_offsets[members], run_offsets[members + 1] - run_offsets[members])
        trajectories, run_start, run_length = trajectories[members], run_start[runs], run_length[runs]
    lengths = token_offsets[trajectories + 1] - token_offsets[trajectories]
    compact_token = _array(mb["row_token"])
    path_rows = expand_runs(run_start, run_length)   # every member's rows, member after member

    if mode == "expanded":
        num_rows = int(lengths.sum())
        starts = np.cumsum(lengths) - lengths
        rows = np.arange(num_rows)
        row_token = compact_token[path_rows]
        row_position = rows - np.repeat(starts, lengths)
        row_parent = np.where(row_position == 0, -1, rows - 1)
        row_weight = np.ones(num_rows)
        sequences = [(np.arange(s, s + n), 0) for s, n in zip(starts.tolist(), lengths.tolist())]
        calls = _calls(sequences, np.ones(len(sequences), dtype=np.int64), np.full(len(sequences), -1),
                       np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), True,
                       [s for s, _ in sequences])
        views = AttentionViews.from_plan(row_parent=row_parent, row_position=row_position,
                                         member_own_start=np.zeros(len(lengths), dtype=np.int64),
                                         member_run_offsets=np.arange(len(lengths) + 1), run_row_start=starts,
                                         run_length=lengths)
        positions = _positions(rows, lengths, row_token, trajectories, token_offsets)
    else:
        row_token = compact_token
        row_position = _array(mb["row_position"])
        row_parent = _array(mb["row_parent"])
        row_weight = _array(mb["row_multiplicity"], np.float64)
        views = AttentionViews.from_plan(row_parent=row_parent, row_position=row_position,
                                         member_own_start=mb["member_own_start"], member_run_offsets=run_offsets,
                                         run_row_start=run_start, run_length=run_length)
        positions = _positions(path_rows, lengths, row_token, trajectories, token_offsets)
        if mode == "compact" and windows and has_cached_rows(mb):
            return _read_producer(mb, ExecLayout(
                mode=mode, row_token=_long(row_token), row_position=_long(row_position), row_parent=row_parent,
                row_weight=torch.from_numpy(row_weight), calls=None, views=views, position_row=positions[0],
                position_label=positions[1], position_flat=positions[2], member_trajectory=trajectories))
        calls = _compact_calls(mb) if mode == "compact" else _nodewise_calls(mb, chunk_size)
    return ExecLayout(mode=mode, row_token=_long(row_token), row_position=_long(row_position), row_parent=row_parent,
                      row_weight=torch.from_numpy(np.asarray(row_weight, dtype=np.float64)), calls=calls, views=views,
                      position_row=positions[0], position_label=positions[1], position_flat=positions[2],
                      member_trajectory=trajectories)


def _compact_calls(mb: dict) -> LinearCalls:
    start, count = _array(mb["sequence_row_start"]), _array(mb["sequence_num_rows"])
    replay_offsets, replay_rows = _array(mb["sequence_replay_offsets"]), _array(mb["replay_rows"])
    sequences = []
    outputs = []
    for q in range(len(start)):
        own = np.arange(start[q], start[q] + count[q])
        replay = replay_rows[replay_offsets[q]:replay_offsets[q + 1]]
        sequences.append((np.concatenate([replay, own]), len(replay)))
        outputs.append(own)
    # Memory order is round-major with each sequence contiguous, so the outputs
    # of the rounds, concatenated, are already in row order.
    return _calls(sequences, _array(mb["sequence_round"]), _array(mb["sequence_start_state"]),
                  _array(mb["export_sequence"]), _array(mb["export_chunk"]), True, outputs)


def _nodewise_calls(mb: dict, chunk_size: int) -> LinearCalls:
    """One call per segment, in memory order (parents first); a child starts from its
    parent segment's final state, handed over at the exact fork position."""
    seg_start = _array(mb["segment_row_start"])
    parent = _array(mb["segment_parent"])
    seg_len = np.diff(seg_start)
    has_children = np.zeros(len(parent), dtype=bool)
    has_children[parent[parent >= 0]] = True
    exporter = np.flatnonzero(has_children)            # export e is the final state of segment exporter[e]
    export_of_segment = np.full(len(parent), -1, dtype=np.int64)
    export_of_segment[exporter] = np.arange(len(exporter))
    start_state = np.where(parent >= 0, export_of_segment[np.maximum(parent, 0)], -1)
    sequences = [(np.arange(seg_start[v], seg_start[v + 1]), 0) for v in range(len(parent))]
    export_chunk = -(-seg_len[exporter] // chunk_size)   # ceil: the final (possibly partial) chunk
    return _calls(sequences, np.arange(1, len(parent) + 1), start_state, exporter, export_chunk, True,
                  [s for s, _ in sequences])


def has_cached_rows(mb: dict) -> bool:
    return "row_cached_by" in mb and bool(np.any(np.asarray(mb["row_cached_by"]) >= 0))


def _read_producer(mb: dict, complete: ExecLayout) -> ExecLayout:
    """A window consumer: `complete`'s rows, LM-head positions and statistics weights (its
    calls not yet set), with the decoder on the uncached rows only (the plan's `residual_*`
    calls, views querying only those rows) and `cached` naming each cached row's producer row."""
    cached_by = np.asarray(mb["row_cached_by"], dtype=np.int64)
    is_decoder = cached_by < 0
    decoder_rows = np.flatnonzero(is_decoder)
    cached_rows = np.flatnonzero(~is_decoder)
    complete_index = np.empty(len(cached_by), dtype=np.int64)
    complete_index[cached_rows] = np.arange(len(cached_rows))
    complete_index[decoder_rows] = len(cached_rows) + np.arange(len(decoder_rows))
    decoder_index = complete_index - len(cached_rows)   # valid on decoder rows

    offsets = _array(mb["residual_sequence_token_offsets"])
    tokens = _array(mb["residual_token_rows"])
    replay = _array(mb["residual_sequence_replay"])
    sequences, outputs = [], []
    for q in range(len(replay)):
        rows = tokens[offsets[q]:offsets[q + 1]]
        sequences.append((rows, int(replay[q])))
        outputs.append(decoder_index[rows[replay[q]:]])
    calls = _calls(sequences, _array(mb["residual_sequence_round"]), _array(mb["residual_sequence_start_state"]),
                   _array(mb["residual_export_sequence"]), _array(mb["residual_export_chunk"]), False, outputs,
                   start_external=_array(mb["residual_sequence_producer_state"]))
    return dataclasses.replace(
        complete, calls=calls, views=complete.views.with_queries(is_decoder), decoder_rows=_long(decoder_rows),
        cached=CachedRows(cached_source=_long(cached_by[cached_rows]), complete_index=_long(complete_index),
                          position_source=cached_by[complete.position_row.numpy()]))


def producer_layout(producer: dict) -> ExecLayout:
    """A window producer: its rows, rounds, replay and views; no labelled positions (no LM head)."""
    row_parent = _array(producer["row_parent"])
    row_position = _array(producer["row_position"])
    views = AttentionViews.from_plan(row_parent=row_parent, row_position=row_position,
                                     member_own_start=producer["member_own_start"],
                                     member_run_offsets=producer["member_run_offsets"],
                                     run_row_start=producer["run_row_start"], run_length=producer["run_length"])
    empty = np.zeros(0, dtype=np.int64)
    return ExecLayout(mode="compact", row_token=_long(producer["row_token"]), row_position=_long(row_position),
                      row_parent=row_parent, row_weight=torch.ones(len(row_parent), dtype=torch.float64),
                      calls=_compact_calls(producer), views=views, position_row=_long(empty),
                      position_label=_long(empty), position_flat=empty, member_trajectory=empty)
