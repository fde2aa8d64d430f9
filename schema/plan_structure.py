"""The structure of a decoded plan: keys, types, lengths and index bounds (`validate_plan`).

A plan that passes its checksum can still be damaged (written by another
tool, edited, or produced by a compiler bug). `validate_plan` checks what
every reader indexes with: keys, types, lengths and index bounds, as
`harts.schema.plan`'s docstring lists them. It does not check the plan's
meaning (sharing, rounds, replay, windows): that is `harts check`, which
relies on these guarantees to report instead of crash. `read_plan` runs it
after decoding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from harts.schema.errors import PlanFormatError

if TYPE_CHECKING:
    from harts.schema.plan import Plan

_FIX = "recompile the plan with hartsc"
_INTEGER = "iu"
# Limits of the compile flags, shared with the compiler's option checks so a
# plan it writes always reads back. Sizes are int32 (row indices, tokens).
MAX_CAPACITY = 2**31 - 1
# plan-replay keeps a (sequences x chunk) table per microbatch and kernels use
# chunks of 16-256 rows: a longer chunk is a typo, and that table gigabytes.
MAX_CHUNK_SIZE = 4096
# L2's cost weights multiply rows by 3 x pairs_per_token in int64 (the paper's
# models are near 2**16), which leaves room for any realistic step.
MAX_PAIRS_PER_TOKEN = 2**32
# Default upper bound of every plan integer that is not an index: values
# (tokens, positions, counts) are int32, so readers' int64 arithmetic on
# them cannot overflow.
_INT32_END = 2**31
# Tables of a microbatch or producer, by the length they share.
_SEQUENCE_KEYS = ("sequence_round", "sequence_row_start", "sequence_num_rows", "sequence_start_position",
                  "sequence_start_state")
_EXPORT_KEYS = ("export_row", "export_sequence", "export_chunk")
_RUN_KEYS = ("run_row_start", "run_length")
_SEGMENT_KEYS = ("segment_parent", "segment_level")
_RESIDUAL_SEQUENCE_KEYS = ("residual_sequence_round", "residual_sequence_replay",
                           "residual_sequence_start_position", "residual_sequence_start_state",
                           "residual_sequence_producer_state")
_RESIDUAL_EXPORT_KEYS = ("residual_export_sequence", "residual_export_chunk")
_RESIDUAL_KEYS = ("residual_num_rounds", "residual_sequence_token_offsets", "residual_token_rows",
                  *_RESIDUAL_SEQUENCE_KEYS, *_RESIDUAL_EXPORT_KEYS)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True, slots=True)
class _Record:
    """One dict of a plan under validation (flags, step, a microbatch, a producer); names it in errors."""

    source: str
    label: str
    fields: dict

    def fail(self, key: str, problem: str):
        raise PlanFormatError(f"{self.source}: {self.label}: field '{key}': {problem}; fix: {_FIX}")

    def get(self, key: str):
        if key not in self.fields:
            self.fail(key, "missing")
        return self.fields[key]

    def integer(self, key: str, lowest: int, end: int = _INT32_END) -> int:
        """An int in [lowest, end)."""
        value = self.get(key)
        if not _is_int(value):
            self.fail(key, f"expected an int, found {type(value).__name__}")
        if value < lowest or value >= end:
            self.fail(key, f"{value} is outside [{lowest}, {end})")
        return int(value)

    def array(self, key: str, kinds: str = _INTEGER, length: int | None = None) -> np.ndarray:
        """A 1-D array whose dtype kind is one of `kinds`, of `length` entries when given."""
        value = self.get(key)
        if not isinstance(value, np.ndarray):
            self.fail(key, f"expected an array, found {type(value).__name__}")
        if value.ndim != 1 or value.dtype.kind not in kinds:
            self.fail(key, f"expected a 1-D array of kind '{kinds}', found {value.dtype} with shape {value.shape}")
        if length is not None and len(value) != length:
            self.fail(key, f"has {len(value)} entries, expected {length}")
        return value

    def bounded(self, key: str, lowest: int, end: int = _INT32_END, length: int | None = None) -> np.ndarray:
        """An integer array of `length` whose every value lies in [lowest, end): one min and one max."""
        value = self.array(key, _INTEGER, length)
        if len(value) and (value.min() < lowest or value.max() >= end):
            self.fail(key, f"values {value.min()}..{value.max()} are outside [{lowest}, {end})")
        return value

    def offsets(self, key: str, count: int, total: int) -> np.ndarray:
        """CSR offsets: count + 1 non-decreasing values from 0 to total."""
        value = self.array(key, _INTEGER, count + 1)
        if value[0] != 0 or value[-1] != total or np.any(value[1:] < value[:-1]):
            self.fail(key, f"is not a table of offsets from 0 to {total} (found {value[0]}..{value[-1]}, "
                           "or a decrease)")
        return value

    def reads_earlier_rounds(self, state_key: str, export_sequence_key: str, round_key: str) -> None:
        """Every start state (index >= 0 into the exports) is exported by a sequence of an earlier round."""
        states = self.get(state_key)
        reads = states >= 0
        if reads.any():
            rounds = self.get(round_key)
            exporter_round = rounds[self.get(export_sequence_key)[states[reads]]]
            if np.any(exporter_round >= rounds[reads]):
                self.fail(state_key, "a sequence starts from a state exported in its own or a later round")

    def same_length(self, keys: tuple) -> int:
        """The shared length of `keys`' 1-D integer arrays (the first one's)."""
        length = len(self.array(keys[0]))
        for key in keys[1:]:
            self.array(key, _INTEGER, length)
        return length


def validate_plan(plan: Plan, source: str = "<plan>") -> None:
    """Raise `PlanFormatError` (one line naming the record and field) unless the plan is well-formed.

    Guarantees afterwards, for every reader: `flags` holds ints dp in
    [1, max(K, 1)] (K microbatches), capacity and chunk_size >= 1 and, if
    present, pairs_per_token >= 0; the step's arrays have the lengths of its
    N trajectories and S tokens (`token_offsets` runs from 0 to S); every
    microbatch and producer has each key of the module docstring with an
    integer 1-D array of consistent length, `replica` in [0, dp), `slot` and
    `window` in [0, K), and every index within what it indexes: rows, parents
    (-1 or a row), sequences, exports, runs (start + length within the rows),
    segments, trajectories, and offset tables from 0 to their table's size.
    A sequence's start state is exported in an earlier round, a segment's
    parent precedes it, at most one producer serves a (replica, window), and a
    consumer's cached rows and producer start states index that producer.

    Cost: a few vectorised passes (min, max, one comparison) per array and a
    Python loop over trajectory ids only, no per-row Python: small next to
    decompressing the plan.
    """
    flags = plan.header.get("flags")
    if not isinstance(flags, dict):
        raise PlanFormatError(f"{source}: header: 'flags' is {type(flags).__name__}, not a map; fix: {_FIX}")
    microbatches = plan.microbatches
    if not isinstance(microbatches, list):
        raise PlanFormatError(f"{source}: 'microbatches' is {type(microbatches).__name__}, not a list; fix: {_FIX}")
    count = len(microbatches)
    header = _Record(source, "flags", flags)
    # A replica without microbatches cannot exist, and readers size grids by dp.
    dp = header.integer("dp", 1, max(count, 1) + 1)
    header.integer("capacity", 1, MAX_CAPACITY + 1)
    header.integer("chunk_size", 1, MAX_CHUNK_SIZE + 1)
    if "pairs_per_token" in flags:
        header.integer("pairs_per_token", 0, MAX_PAIRS_PER_TOKEN + 1)
    if not isinstance(plan.step, dict):
        raise PlanFormatError(f"{source}: 'step' is {type(plan.step).__name__}, not a map; fix: {_FIX}")
    trajectories = _validate_step(_Record(source, "step", plan.step))
    # (replica, window) -> (rows, exports) of its producer: what a consumer's cached rows index.
    served: dict[tuple[int, int], tuple[int, int]] = {}
    if plan.producers is not None:
        if not isinstance(plan.producers, list):
            raise PlanFormatError(f"{source}: 'producers' is {type(plan.producers).__name__}, not a list; fix: {_FIX}")
        for p, producer in enumerate(plan.producers):
            record = _as_record(source, f"producer {p}", producer)
            key = (record.integer("replica", 0, dp), record.integer("window", 0, max(count, 1)))
            _validate_computation(record, trajectories, consumer=False)
            if key in served:
                record.fail("window", f"a second producer for window {key[1]} on replica {key[0]}")
            served[key] = (len(producer["row_token"]), len(producer["export_row"]))
    for i, mb in enumerate(microbatches):
        record = _as_record(source, f"microbatch {i}", mb)
        replica = record.integer("replica", 0, dp)
        record.integer("slot", 0, count)
        if "window" in mb:
            record.integer("window", 0, count)
        _validate_computation(record, trajectories, consumer=True)
        _validate_cached_reads(record, served.get((replica, mb.get("window", -1)), (0, 0)))


def _as_record(source: str, label: str, value) -> _Record:
    if not isinstance(value, dict):
        raise PlanFormatError(f"{source}: {label} is {type(value).__name__}, not a map; fix: {_FIX}")
    return _Record(source, label, value)


def _validate_step(step: _Record) -> int:
    """The step's trajectory tables; returns N, the number of trajectories."""
    n = step.integer("num_trajectories", 0)
    for key, allowed in (("ids", (str, int)), ("trees", (str, int, type(None)))):
        values = step.get(key)
        if not isinstance(values, list) or len(values) != n:
            step.fail(key, f"expected a list of {n} entries, found "
                           f"{len(values) if isinstance(values, list) else type(values).__name__}")
        # One pass over trajectories (not tokens): ids key dicts in the tools.
        if not all(type(v) in allowed for v in values):
            step.fail(key, f"holds a value that is not one of {', '.join(t.__name__ for t in allowed)}")
    _validate_unique_ids(step, step.get("ids"))
    tokens = int(step.array("token_offsets", _INTEGER, n + 1)[-1])
    offsets = step.offsets("token_offsets", n, tokens)
    loss_mask = step.array("loss_mask", "iub", tokens)
    if loss_mask.size and (loss_mask.min() < 0 or loss_mask.max() > 1):
        bad = int(np.flatnonzero((loss_mask < 0) | (loss_mask > 1))[0])
        step.fail("loss_mask", f"holds {loss_mask[bad]} at position {bad}, not 0 or 1")
    advantages = step.array("advantages", "f", tokens)
    if not np.isfinite(advantages).all():
        step.fail("advantages", f"holds {advantages[~np.isfinite(advantages)][0]} at position "
                                f"{int(np.flatnonzero(~np.isfinite(advantages))[0])}; every advantage is finite")
    for key in ("old_logprobs", "ref_logprobs"):
        has = step.array(f"has_{key}", "b", n)
        if step.get(key) is not None:
            values = step.array(key, "f", tokens)
            # The reader's invariant: a trajectory that gave them has finite values (0.0 where no loss reads
            # one), one that did not has NaN, so a loss can never read a NaN it was not told about.
            given = np.repeat(has.astype(bool), np.diff(offsets))
            bad = np.flatnonzero(given != np.isfinite(values))
            if bad.size:
                step.fail(key, f"position {int(bad[0])} holds {values[bad[0]]} for a trajectory that "
                               f"{'gave' if given[bad[0]] else 'did not give'} them")
        elif has.any():
            step.fail(f"has_{key}", f"says a trajectory gave {key}, but the step holds none")
    step.integer("original_tokens", tokens, tokens + 1)
    # Step totals may pass 2**31 (token_offsets is int64).
    step.integer("trie_unique_tokens", 0, 2**63)
    if "l1_compact_tokens" in step.fields:
        step.integer("l1_compact_tokens", 0, 2**63)
    return n


def _validate_unique_ids(step: _Record, ids: list) -> None:
    """Ids are unique as strings: per-trajectory outputs are keyed by `str(id)` (contract section 3)."""
    seen: dict[str, int] = {}
    for k, value in enumerate(ids):
        earlier = seen.setdefault(str(value), k)
        if earlier != k:
            step.fail("ids", f"trajectories {earlier} and {k} share the id {str(value)!r} (as strings)")


def _validate_computation(record: _Record, trajectories: int, consumer: bool) -> None:
    """The row, sequence, export, member-run and segment tables of a microbatch (consumer) or producer."""
    rows = len(record.array("row_token"))
    record.bounded("row_token", 0, _INT32_END, rows)
    record.bounded("row_position", 0, _INT32_END, rows)
    record.bounded("row_parent", -1, rows, rows)
    if consumer:
        record.bounded("row_multiplicity", 0, _INT32_END, rows)

    rounds = record.integer("num_rounds", 0)
    sequences = record.same_length(_SEQUENCE_KEYS)
    start = record.bounded("sequence_row_start", 0, rows + 1)
    length = record.bounded("sequence_num_rows", 0, rows + 1)
    if sequences and (start.astype(np.int64) + length).max() > rows:   # both <= rows: no overflow in int64
        record.fail("sequence_num_rows", f"a sequence ends past the last row ({rows})")
    record.bounded("sequence_start_position", 0)
    record.bounded("sequence_round", 0)
    replay = record.bounded("replay_rows", 0, rows)
    record.offsets("sequence_replay_offsets", sequences, len(replay))
    record.offsets("round_offsets", rounds, sequences)
    exports = record.same_length(_EXPORT_KEYS)
    record.bounded("export_row", 0, rows)
    # chunk x B = replay (< B) + rows into the sequence + 1, so chunk < rows + 2.
    record.bounded("export_chunk", 0, rows + 2)
    record.bounded("export_sequence", 0, sequences)
    record.bounded("sequence_start_state", -1, exports)
    record.reads_earlier_rounds("sequence_start_state", "export_sequence", "sequence_round")

    members = len(record.array("member_own_start"))
    record.bounded("member_own_start", 0, _INT32_END, members)
    if consumer:
        record.bounded("member_trajectory", 0, trajectories, members)
    else:
        record.bounded("prefix_trajectory", 0, trajectories, members)
        record.bounded("prefix_length", 0, _INT32_END, members)
    runs = record.same_length(_RUN_KEYS)
    run_start = record.bounded("run_row_start", 0, rows + 1)
    run_length = record.bounded("run_length", 0, rows + 1)
    record.offsets("member_run_offsets", members, runs)
    # Both are <= rows, so in int64 the sum cannot overflow.
    if runs and (run_start.astype(np.int64) + run_length).max() > rows:
        record.fail("run_length", f"a run ends past the last row ({rows})")

    segments = record.same_length(_SEGMENT_KEYS)
    record.offsets("segment_row_start", segments, rows)
    parent = record.bounded("segment_parent", -1, segments)
    if np.any(parent >= np.arange(segments)):
        record.fail("segment_parent", "a segment's parent does not come before it in memory order")
    record.bounded("segment_level", 0)
    if consumer and any(key in record.fields for key in _RESIDUAL_KEYS):
        _validate_residual(record, rows)


def _validate_cached_reads(record: _Record, producer: tuple[int, int]) -> None:
    """A consumer reads only its own (window, replica) producer: cached rows and start states within it."""
    producer_rows, producer_exports = producer
    if "row_cached_by" in record.fields:
        record.bounded("row_cached_by", -1, producer_rows, len(record.fields["row_token"]))
    if "residual_sequence_producer_state" in record.fields:
        record.bounded("residual_sequence_producer_state", -1, producer_exports)


def _validate_residual(record: _Record, rows: int) -> None:
    """A consumer's decoder-row calls (`residual_*`): all keys, consistent lengths, indices in range."""
    if "row_cached_by" not in record.fields:
        record.fail("row_cached_by", "missing, although the microbatch has residual_* calls")
    record.integer("residual_num_rounds", 0)
    sequences = record.same_length(_RESIDUAL_SEQUENCE_KEYS)
    record.bounded("residual_sequence_round", 0)
    token_rows = record.bounded("residual_token_rows", 0, rows)
    record.offsets("residual_sequence_token_offsets", sequences, len(token_rows))
    record.bounded("residual_sequence_replay", 0)
    record.bounded("residual_sequence_start_position", 0)
    exports = record.same_length(_RESIDUAL_EXPORT_KEYS)
    record.bounded("residual_export_sequence", 0, sequences)
    record.bounded("residual_export_chunk", 0, rows + 2)
    record.bounded("residual_sequence_start_state", -1, exports)
    record.reads_earlier_rounds("residual_sequence_start_state", "residual_export_sequence", "residual_sequence_round")
