"""The plan file, schema v1: the only thing the compiler and the executor share.

File layout::

    b"HARTSPLN"                         8 bytes, magic
    uint32 little-endian                length of the header
    msgpack header                      {"format", "schema_version", "flags", "compiler"}
    zstd frame (with checksum)          msgpack body {"step", "microbatches", ["producers",] "summary"}

The header sits outside the compressed body so that a reader can reject a
wrong format or version before decompressing anything. numpy arrays are stored
as `{"__ndarray__": [dtype, shape, raw bytes]}` (little-endian, C order), so a
plan loads without pickle and without per-element decoding. Writing is
deterministic (dict insertion order, single-threaded zstd at a fixed level) and
atomic (temporary file in the same folder, fsync, rename).

Body keys (all arrays in the microbatch's memory order of compact rows):

step
    ``num_trajectories``, ``ids`` (list of str|int), ``trees`` (list),
    ``token_offsets`` int64[N+1], ``loss_mask`` uint8[S], ``advantages``
    float32[S], ``old_logprobs`` / ``ref_logprobs`` float32[S] or None,
    ``has_old_logprobs`` / ``has_ref_logprobs`` bool[N],
    ``original_tokens``, ``trie_unique_tokens``; with ``--levels l1+l2`` also
    ``l1_compact_tokens`` (L1's complete-layout total, the decoder work
    without windows).
microbatches[i]
    ``replica``, ``slot``, ``num_rounds``;
    ``row_token`` int32[C], ``row_position`` int32[C], ``row_parent`` int32[C]
    (-1 at position 0), ``row_multiplicity`` int32[C];
    ``sequence_round`` int32[Q], ``sequence_row_start`` int64[Q],
    ``sequence_num_rows`` int64[Q], ``sequence_start_position`` int64[Q] (the
    anchor), ``sequence_replay_offsets`` int64[Q+1], ``replay_rows`` int64[P],
    ``sequence_start_state`` int64[Q] (export index or -1 for zero),
    ``round_offsets`` int64[R+1];
    ``export_row`` int64[E], ``export_sequence`` int64[E], ``export_chunk`` int64[E];
    ``member_trajectory`` int64[k] (file index), ``member_own_start`` int64[k]
    (first position whose row this member created), ``member_run_offsets``
    int64[k+1], ``run_row_start`` int64[R'], ``run_length`` int64[R'] (each
    member's positions 0..n-1 map to the concatenated runs);
    ``segment_row_start`` int64[V+1], ``segment_parent`` int64[V] (-1 for a
    root), ``segment_level`` int64[V]: the fork-free segments in memory order,
    for node-wise execution.
    Only with ``--levels l1+l2`` (the microbatches are then the consumers):
    ``window`` (int, the sharing window of the microbatch's slot; windows are
    ranges of consecutive slots, the same on every replica) and
    ``row_cached_by`` int32[C]: for each compact row, the row (memory order)
    of the producer of (this window, this replica) that computes it, or -1 if
    the consumer computes it. A cached row's producer row has the same token
    and position, its parent is the producer row of the consumer row's
    parent, and a cached row's parent is cached (cached rows are
    prefix-closed). Consumers keep their complete layouts for the LM head and
    the loss; only rows with -1 run through the decoder, with these
    linear-attention calls (only in consumers with cached rows; all rows are
    the consumer's, memory order):
    ``residual_num_rounds``, ``residual_sequence_round`` int32[Q'],
    ``residual_sequence_token_offsets`` int64[Q'+1] into
    ``residual_token_rows`` int64[N'] (per sequence its replay rows, then its
    output rows; every uncached row is an output exactly once, cached rows
    appear only as replay), ``residual_sequence_replay`` int64[Q'],
    ``residual_sequence_start_position`` int64[Q'] (the chunk-aligned anchor),
    ``residual_sequence_start_state`` int64[Q'] (export of these calls, or -1),
    ``residual_sequence_producer_state`` int64[Q'] (index into the producer's
    exports, or -1), ``residual_export_sequence``, ``residual_export_chunk``
    int64[E'].
producers[p] (only with ``--levels l1+l2``; absent otherwise)
    one per (window, replica) whose producer computes anything, ordered by
    window then replica: ``replica``, ``window``, ``num_rounds``,
    ``row_token``, ``row_position``, ``row_parent``, the same
    sequence/replay/round/export tables and segment tables as a microbatch,
    for the producer's own rows (its exports include every anchor state a
    consumer starts from), the member path runs of its prefixes
    (``member_own_start``, ``member_run_offsets``, ``run_row_start``,
    ``run_length``, for its attention views), and ``prefix_trajectory`` int64[m] (file
    index), ``prefix_length`` int64[m]: the trajectory prefixes it computes,
    deduplicated into its rows. A producer runs the decoder only (no LM head,
    no loss); every row it computes is used by at least two consumers.
summary
    the deterministic statistics of `harts stats` (timings excluded).

Reading: `decode_plan` checks the file format (magic, version, checksum,
msgpack); `read_plan` adds `validate_plan`, which checks the structure above
(keys, dtypes, lengths, index bounds) so that a damaged plan whose checksum
still holds is one `PlanFormatError` line, not a crash in a reader.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import zstandard

from harts.schema.atomic import atomic_write_bytes
from harts.schema.errors import PlanFormatError

FORMAT = "harts-plan"
SCHEMA_VERSION = 1
MAGIC = b"HARTSPLN"
ZSTD_LEVEL = 3


@dataclass(frozen=True, slots=True)
class Plan:
    """A loaded plan. `header["flags"]` holds the compile flags."""

    header: dict
    step: dict
    microbatches: list
    summary: dict = field(default_factory=dict)
    producers: list | None = None   # window producers (`--levels l1+l2` only)

    @property
    def flags(self) -> dict:
        return self.header["flags"]


def _encode(obj):
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        return {"__ndarray__": [dtype.str, list(array.shape), array.astype(dtype, copy=False).tobytes()]}
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in a plan")


def _decode(obj):
    if len(obj) == 1 and "__ndarray__" in obj:
        dtype, shape, raw = obj["__ndarray__"]
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
    return obj


def encode_plan(plan: Plan) -> bytes:
    header = msgpack.packb(plan.header, default=_encode, use_bin_type=True)
    body = {"step": plan.step, "microbatches": plan.microbatches}
    if plan.producers is not None:   # absent for L1-only plans, whose bytes stay as before
        body["producers"] = plan.producers
    body["summary"] = plan.summary
    body = msgpack.packb(body, default=_encode, use_bin_type=True)
    compressed = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True,
                                          write_content_size=True).compress(body)
    return MAGIC + struct.pack("<I", len(header)) + header + compressed


def write_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write atomically: the file appears only when complete."""
    atomic_write_bytes(Path(path), encode_plan(plan))


def read_header(data: bytes, source: str) -> tuple[dict, int]:
    if len(data) < len(MAGIC) + 4 or data[:len(MAGIC)] != MAGIC:
        raise PlanFormatError(f"{source}: not a HARTS plan (bad magic); fix: pass a file written by hartsc")
    (length,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if start + length > len(data):
        raise PlanFormatError(f"{source}: plan header is truncated; fix: recompile the plan with hartsc")
    try:
        header = msgpack.unpackb(data[start:start + length], raw=False)
    except Exception as err:  # msgpack raises several unrelated types
        raise PlanFormatError(f"{source}: plan header is corrupted ({err}); fix: recompile the plan with hartsc") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise PlanFormatError(f"{source}: format is {header.get('format') if isinstance(header, dict) else header!r}, "
                              f"expected '{FORMAT}'; fix: pass a file written by hartsc")
    version = header.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanFormatError(f"{source}: plan schema version {version} is not supported by this HARTS "
                              f"(reads version {SCHEMA_VERSION}); fix: recompile the plan with this hartsc")
    return header, start + length


def decode_plan(data: bytes, source: str = "<plan>") -> Plan:
    """The plan held in `data` (a plan file's bytes), with the file-format checks only.

    Rejects, as one `PlanFormatError` line naming `source`: a wrong magic,
    format or version, a truncated or corrupted header or body (zstd checksum,
    msgpack), a body without `step` and `microbatches`. Arrays come back
    exactly as written, whatever their shape; `read_plan` adds the structural
    checks (`validate_plan`) that readers rely on.
    """
    header, body_start = read_header(data, source)
    try:
        raw = zstandard.ZstdDecompressor().decompress(data[body_start:])
    except zstandard.ZstdError as err:
        raise PlanFormatError(f"{source}: plan body is truncated or corrupted ({err}); "
                              "fix: recompile the plan with hartsc") from None
    try:
        body = msgpack.unpackb(raw, raw=False, object_hook=_decode, strict_map_key=False)
    except Exception as err:
        raise PlanFormatError(f"{source}: plan body is corrupted ({err}); fix: recompile the plan with hartsc") from None
    if not isinstance(body, dict) or not {"step", "microbatches"} <= body.keys():
        raise PlanFormatError(f"{source}: plan body lacks 'step' or 'microbatches'; fix: recompile the plan with hartsc")
    return Plan(header=header, step=body["step"], microbatches=body["microbatches"], summary=body.get("summary", {}),
                producers=body.get("producers"))


def read_plan(path: str | os.PathLike) -> Plan:
    """Load a plan file: `decode_plan`, then `validate_plan`; any problem is one `PlanFormatError` line."""
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise PlanFormatError(f"{source}: cannot read plan ({err.strerror}); fix: check the path") from None
    plan = decode_plan(data, source)
    validate_plan(plan, source)
    return plan


# --- structure ---------------------------------------------------------------------------------
#
# A plan that passes its checksum can still be damaged (written by another
# tool, edited, or produced by a compiler bug). `validate_plan` checks what
# every reader indexes with: keys, types, lengths and index bounds. It does
# not check the plan's meaning (sharing, rounds, replay, windows): that is
# `harts check`, which relies on these guarantees to report instead of crash.

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
_ROW_KEYS = ("row_token", "row_position", "row_parent")
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
    for i, mb in enumerate(microbatches):
        record = _as_record(source, f"microbatch {i}", mb)
        record.integer("replica", 0, dp)
        record.integer("slot", 0, count)
        if "window" in mb:
            record.integer("window", 0, count)
        _validate_computation(record, trajectories, consumer=True)
    if plan.producers is not None:
        if not isinstance(plan.producers, list):
            raise PlanFormatError(f"{source}: 'producers' is {type(plan.producers).__name__}, not a list; fix: {_FIX}")
        for p, producer in enumerate(plan.producers):
            record = _as_record(source, f"producer {p}", producer)
            record.integer("replica", 0, dp)
            record.integer("window", 0, max(count, 1))
            _validate_computation(record, trajectories, consumer=False)


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
    tokens = int(step.array("token_offsets", _INTEGER, n + 1)[-1])
    step.offsets("token_offsets", n, tokens)
    step.array("loss_mask", "iub", tokens)
    step.array("advantages", "f", tokens)
    for key in ("old_logprobs", "ref_logprobs"):
        if step.get(key) is not None:
            step.array(key, "f", tokens)
    for key in ("has_old_logprobs", "has_ref_logprobs"):
        step.array(key, "b", n)
    step.integer("original_tokens", tokens, tokens + 1)
    # Step totals may pass 2**31 (token_offsets is int64).
    step.integer("trie_unique_tokens", 0, 2**63)
    if "l1_compact_tokens" in step.fields:
        step.integer("l1_compact_tokens", 0, 2**63)
    return n


def _validate_computation(record: _Record, trajectories: int, consumer: bool) -> None:
    """The row, sequence, export, member-run and segment tables of a microbatch (consumer) or producer."""
    rows = len(record.array("row_token"))
    record.bounded("row_token", 0, _INT32_END, rows)
    record.bounded("row_position", 0, _INT32_END, rows)
    record.bounded("row_parent", -1, rows, rows)
    if consumer:
        record.bounded("row_multiplicity", 0, _INT32_END, rows)
        if "row_cached_by" in record.fields:
            record.bounded("row_cached_by", -1, _INT32_END, rows)

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
    record.bounded("segment_parent", -1, segments)
    record.bounded("segment_level", 0)
    if consumer and any(key in record.fields for key in _RESIDUAL_KEYS):
        _validate_residual(record, rows)


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
    record.bounded("residual_sequence_producer_state", -1)
    record.bounded("residual_sequence_start_state", -1, exports)
