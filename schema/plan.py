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
    reserved; written empty ({}). `harts stats` computes every statistic from
    the arrays above (`harts.schema.summary`), so no stored copy can disagree.

Reading: `decode_plan` checks the file format (magic, version, checksum,
msgpack); `read_plan` adds `validate_plan` (`harts.schema.plan_structure`),
which checks the structure above (keys, dtypes, lengths, index bounds) so
that a damaged plan whose checksum still holds is one `PlanFormatError`
line, not a crash in a reader.
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
from harts.schema.plan_structure import validate_plan

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
    if plan.producers is not None:   # absent for L1-only plans
        body["producers"] = plan.producers
    body["summary"] = plan.summary
    pieces = _packed_pieces(body)
    stream = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True).compressobj(
        size=sum(len(piece) for piece in pieces))
    compressed = [stream.compress(piece) for piece in pieces]
    compressed.append(stream.flush())
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *compressed])


# An array's bytes at least this long are handed to zstd as a view of the array; shorter ones are copied into
# the surrounding packed bytes, so that zstd is not called once per small array.
_VIEW_BYTES = 1 << 16


def _packed_pieces(body: dict) -> list:
    """`msgpack.packb(body, default=_encode)` as pieces (bytes, or views of arrays) whose concatenation is exactly
    those bytes.

    A large step's body is a gigabyte, nearly all of it array data. msgpack
    copies each array twice (`tobytes`, then into its buffer), and packing the
    body whole would grow one buffer by copying again; here containers and
    scalars are packed by msgpack, and each array becomes its `_encode` wrapper
    written by hand (map, key, dtype, shape, a bin header) followed by the
    array's own memory, which zstd reads in place. The result is what msgpack
    writes (a test compares the two byte for byte).
    """
    packer = msgpack.Packer(default=_encode, use_bin_type=True)
    pieces: list = []
    pending = bytearray()   # packed bytes not yet in `pieces`

    def emit(value) -> None:
        if isinstance(value, np.ndarray):
            array = np.ascontiguousarray(value)
            if array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("<"))
            pending.extend(_ARRAY_WRAPPER + packer.pack(array.dtype.str) + packer.pack(list(array.shape)))
            pending.extend(_bin_header(array.nbytes))
            raw = array.reshape(-1).view(np.uint8)
            if array.nbytes < _VIEW_BYTES:
                pending.extend(memoryview(raw))
            else:
                pieces.append(bytes(pending))
                pending.clear()
                pieces.append(memoryview(raw))
        elif type(value) is dict:
            pending.extend(packer.pack_map_header(len(value)))
            for key, item in value.items():
                pending.extend(packer.pack(key))
                emit(item)
        elif type(value) in (list, tuple) and any(type(item) in _CONTAINERS for item in value):
            pending.extend(packer.pack_array_header(len(value)))
            for item in value:
                emit(item)
        else:   # a scalar, a string, None, or a container holding none of the types above: msgpack's own bytes
            pending.extend(packer.pack(value))

    emit(body)
    pieces.append(bytes(pending))
    return pieces


_CONTAINERS = (dict, list, tuple, np.ndarray)
_ARRAY_WRAPPER = msgpack.packb({"__ndarray__": []})[:-1] + b"\x93"   # a 1-entry map, its key, a 3-element array


def _bin_header(length: int) -> bytes:
    """msgpack's header of a bin value (bin 8, 16 or 32, use_bin_type=True) of `length` bytes."""
    if length < 1 << 8:
        return struct.pack(">BB", 0xC4, length)
    if length < 1 << 16:
        return struct.pack(">BH", 0xC5, length)
    if length < 1 << 32:
        return struct.pack(">BI", 0xC6, length)
    raise ValueError(f"an array of {length} bytes is over msgpack's 4 GiB limit on one value")


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
    msgpack), bytes after the body's frame, a body without `step` and
    `microbatches`. Arrays come back
    exactly as written, whatever their shape; `read_plan` adds the structural
    checks (`validate_plan`) that readers rely on.
    """
    header, body_start = read_header(data, source)
    stream = _FrameReader(memoryview(data)[body_start:])
    fix = "fix: recompile the plan with hartsc"
    # msgpack's default limits on one value (100 MiB, or 4 GiB "unlimited") would refuse a large step's token
    # arrays; a value claiming more bytes than the body holds just runs out of data.
    unpacker = msgpack.Unpacker(stream, raw=False, object_hook=_decode, strict_map_key=False,
                                read_size=_READ_SIZE, max_buffer_size=_MAX_VALUE_BYTES)
    try:
        body = _unpack_body(unpacker)
        if body is not None:
            stream.read()   # to the frame's end: its checksum is verified there
        extra = stream.produced - unpacker.tell() if body is not None else 0
    except zstandard.ZstdError as err:
        raise PlanFormatError(f"{source}: plan body is truncated or corrupted ({err}); {fix}") from None
    except msgpack.OutOfData:
        if not stream.eof:
            raise PlanFormatError(f"{source}: plan body is truncated (its zstd frame does not end); {fix}") from None
        raise PlanFormatError(f"{source}: plan body is corrupted (it ends inside a value); {fix}") from None
    except Exception as err:   # msgpack raises several unrelated types
        raise PlanFormatError(f"{source}: plan body is corrupted ({err}); {fix}") from None
    if body is None or not {"step", "microbatches"} <= body.keys():
        raise PlanFormatError(f"{source}: plan body lacks 'step' or 'microbatches'; {fix}")
    if not stream.eof:
        raise PlanFormatError(f"{source}: plan body is truncated (its zstd frame does not end); {fix}")
    if extra:
        raise PlanFormatError(f"{source}: plan body is corrupted ({extra} bytes follow its value); {fix}")
    if stream.trailing_bytes:   # the body is one frame: bytes after it are not part of what hartsc wrote
        raise PlanFormatError(f"{source}: {stream.trailing_bytes} bytes follow the plan body; "
                              "fix: recompile the plan with hartsc, or copy the file again")
    return Plan(header=header, step=body["step"], microbatches=body["microbatches"], summary=body.get("summary", {}),
                producers=body.get("producers"))


# Decompressed bytes msgpack asks for at a time; compressed bytes fed to zstd at a time.
_READ_SIZE = 8 << 20
_FEED_SIZE = 1 << 20
_MAX_VALUE_BYTES = 1 << 40


class _FrameReader:
    """The decompressed bytes of the zstd frame at the start of `compressed`, read on demand.

    A large step's body is a gigabyte: decompressing it whole and then
    unpacking it held it twice (the bytes and the arrays copied out of them).
    `eof` tells whether the frame ended (its checksum then verified),
    `produced` how many bytes were read, `trailing_bytes` the input after the frame.
    """

    def __init__(self, compressed: memoryview):
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._compressed = compressed
        self._fed = 0
        self._pending = bytearray()
        self.produced = 0   # bytes read so far

    def read(self, size: int = -1) -> bytes:
        while (size < 0 or len(self._pending) < size) and not self._frame.eof and self._fed < len(self._compressed):
            chunk = self._compressed[self._fed:self._fed + _FEED_SIZE]
            self._fed += len(chunk)
            self._pending += self._frame.decompress(chunk)
        size = len(self._pending) if size < 0 else size
        out = bytes(self._pending[:size])
        del self._pending[:size]
        self.produced += len(out)
        return out

    @property
    def eof(self) -> bool:
        return self._frame.eof

    @property
    def trailing_bytes(self) -> int:
        return len(self._frame.unused_data) + len(self._compressed) - self._fed if self._frame.eof else 0


def _unpack_body(unpacker: msgpack.Unpacker) -> dict | None:
    """The body map, unpacked one microbatch and producer at a time (what `_packed_pieces` wrote);
    None when the body is no map. Raises `msgpack.OutOfData` if the bytes end first."""
    try:
        count = unpacker.read_map_header()
    except ValueError:   # msgpack's "Unexpected type header on stream"
        return None
    body = {}
    for _ in range(count):
        key = unpacker.unpack()
        if key in ("microbatches", "producers"):
            try:
                items = unpacker.read_array_header()
            except ValueError:   # not a list (another writer's nil producers): `validate_plan` judges the value
                body[key] = unpacker.unpack()
            else:
                body[key] = [unpacker.unpack() for _ in range(items)]
        else:
            body[key] = unpacker.unpack()
    return body


def read_plan(path: str | os.PathLike) -> Plan:
    """Load a plan file: `decode_plan`, then `validate_plan`; any problem is one `PlanFormatError` line."""
    return read_plan_and_bytes(path)[0]


def read_plan_and_bytes(path: str | os.PathLike) -> tuple[Plan, bytes]:
    """`read_plan`, with the file's bytes: what a digest of the plan must be taken of (one read, so a
    plan replaced meanwhile cannot pair one file's digest with another's contents)."""
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise PlanFormatError(f"{source}: cannot read plan ({err.strerror}); fix: check the path") from None
    return plan_from_bytes(data, source), data


def plan_from_bytes(data: bytes, source: str = "<plan>") -> Plan:
    """A plan file's bytes as `read_plan` gives them: `decode_plan`, then `validate_plan`."""
    plan = decode_plan(data, source)
    validate_plan(plan, source)
    return plan
