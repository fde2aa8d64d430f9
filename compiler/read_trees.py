"""Read `trees.jsonl` / `trees.jsonl.zst` into a validated `TrajectoryBatch`.

Reads: one JSON object per line, exactly as contract section 1 defines it
(`id`, `tokens`, and optional `tree`, `loss_mask`, `advantages`,
`old_logprobs`, `ref_logprobs`; other keys are ignored). A file or pipe that
starts with zstd's magic number, or whose name ends in `.zst` (any case), is
zstd-compressed and is decompressed as a stream; gzip and HARTS plans are
refused by name (`read_lines.open_lines`; this module parses and assembles).

Produces: a `TrajectoryBatch` in file order whose every documented invariant
holds, or raises `InputError` naming the file, the 1-based physical line, the
field and the fix. No partial batch is ever returned.

Decisions beyond the contract table, each chosen so that a later stage cannot
be surprised:
* Blank (whitespace-only) lines are skipped but still counted, so line numbers
  always match what an editor shows. A UTF-8 byte-order mark on line 1 is
  skipped.
* `null` for an optional field means "not given"; for `id` or `tokens` it is a
  type error.
* JSON `true`/`false` are rejected wherever a number is expected (tokens,
  loss_mask, advantages, logprobs) and as `id`/`tree`, although Python would
  treat them as 1/0.
* A field HARTS reads that a line names twice (`"tokens": [...], "tokens":
  [...]`) is an error: JSON parsers silently keep one of the two.
* Ids must also be unique as strings (`1` and `"1"` collide), because the
  executor keys per-trajectory outputs by `str(id)` (contract section 3).
* Float fields must be finite after rounding to float32, the precision they
  are stored in (`1e39` would become inf).
* Every line must be UTF-8, and `id` / `tree` strings must not hold a lone
  surrogate escape (`"\\ud800"`): the plan stores them as UTF-8.

Speed: a paper-scale step is ~43M tokens. Each line is parsed once by orjson
and each per-token list becomes a numpy array in one C-level call; types and
ranges are then checked with whole-array numpy reductions (dtype kind,
min/max, isfinite). Only a line already known to be bad is walked element by
element, to name the first offending index. See `benchmarks/bench_read.py`.

Parallel parsing (`workers > 1`, `_read_parallel`): the main process still
reads the numbered lines (`open_lines`: files, pipes and zstd streams as
above), sends chunks of consecutive non-blank lines to forked worker
processes that run the same `_parse_line`, and consumes their results in file
order, so the batch and the first error are exactly those of `workers=1`.
`workers=1`, the default, starts no process: `harts.api` runs inside training
processes, where forking is unsafe.
"""
from __future__ import annotations

import array as pyarray
import json
import math
import numbers
import os
import re
from collections import deque
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np
import orjson

from harts.compiler.ir.trajectories import TrajectoryBatch, never_read
from harts.workers import can_fork, start_workers, stop_workers
from harts.compiler.read_lines import open_lines
from harts.schema.errors import HartsError, InputError, UsageError

__all__ = ["read_trees"]

# Token ids are stored as int32 (TrajectoryBatch invariant).
_TOKEN_LIMIT = 2**31
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_UTF8_BOM = b"\xef\xbb\xbf"
_MISSING = object()
# A whole JSON string (escapes included), and what makes one an object key: a colon after it
# (`_reject_repeated_fields`).
_STRING = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_COLON = re.compile(rb'\s*:')
_READ_FIELDS = frozenset({b"id", b"tokens", b"tree", b"loss_mask", b"advantages", b"old_logprobs", b"ref_logprobs"})

# Lines go to worker processes in chunks of about this many bytes: large beside the per-chunk costs (a task,
# a pickle, a process switch; a paper-scale line is ~200 KB), small enough that the chunks in flight hold a
# few tens of MB. Tests shrink it to put a chunk boundary between any two lines.
_CHUNK_BYTES = 4 << 20
# Chunks submitted but not yet consumed, per worker: one being parsed and one waiting, so a worker never idles
# while the main process assembles; reading further ahead would only hold more of the file in memory.
_IN_FLIGHT_PER_WORKER = 2

_FIX_LINE = 'write one JSON object per line, e.g. {"id": 7, "tokens": [1, 2, 3]}'
_FIX_FLOAT_LIST = "write a list of finite JSON numbers, one per token"
_FIX_LOGPROBS = _FIX_FLOAT_LIST + " (null or NaN only where no loss reads one: index 0, and where loss_mask is 0)"


@dataclass(frozen=True, slots=True)
class _Trajectory:
    """One validated line. Per-token arrays already have the batch's dtypes.

    The token array travels separately (see `_parse_line`) so that the
    assembler can free every trajectory's copy as soon as the flat array
    exists, which keeps peak memory near one copy of the tokens.
    """

    id: str | int
    tree: str | int | None
    line: int
    num_tokens: int                     # >= 2
    loss_mask: np.ndarray | None        # uint8 in {0, 1}; None = all ones
    advantages: float | np.ndarray      # float32-representable scalar, or float32 per token
    old_logprobs: np.ndarray | None     # float32, finite
    ref_logprobs: np.ndarray | None     # float32, finite


@dataclass(frozen=True, slots=True)
class _Where:
    """Where a line came from and the limits it must respect (for error messages)."""

    source: str
    line: int
    vocab_size: int | None
    capacity: int | None

    def error(self, field: str | None, problem: str, fix: str) -> InputError:
        return InputError(self.source, self.line, field, problem, fix)


def read_trees(path: str | os.PathLike, *, vocab_size: int | None = None,
               capacity: int | None = None, workers: int = 1) -> TrajectoryBatch:
    """Read and validate a `trees.jsonl` (or `.jsonl.zst`) file, contract section 1.

    `vocab_size`, when given, rejects any token >= vocab_size; `capacity`, when
    given, rejects any trajectory longer than capacity tokens (it could not fit
    in one microbatch). Raises `InputError` for every violation, for a missing
    or unreadable file, a corrupted or truncated zstd stream, and a file with no
    trajectories. Returns a batch satisfying every `TrajectoryBatch` invariant.

    `workers` > 1 parses lines in that many forked processes (`_read_parallel`;
    where "fork" is unavailable, in this process): the same batch, bit for bit,
    and the same first error as `workers=1`, which starts no process.
    """
    # Caller arguments, not file content: front ends check their flags first
    # (`harts.compiler.pipeline.check_options`), so only API misuse gets here.
    if vocab_size is not None and vocab_size < 1:
        raise UsageError(f"vocab_size must be >= 1, got {vocab_size}; fix: pass the model's vocabulary size or None")
    if capacity is not None and capacity < 2:
        raise UsageError(f"capacity must be >= 2, got {capacity}; fix: pass the microbatch capacity or None")
    if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 1:
        raise UsageError(f"workers must be an int >= 1, got {workers!r}; fix: pass 1 to parse in this process, "
                         "or the number of parse processes")
    source = os.fspath(path)
    if isinstance(source, bytes):
        source = os.fsdecode(source)

    compressed, numbered_lines = open_lines(source)
    try:
        if workers > 1 and can_fork():
            trajectories, token_arrays = _read_parallel(source, compressed, numbered_lines, vocab_size, capacity,
                                                        int(workers))
        else:
            trajectories, token_arrays = _read_serial(source, compressed, numbered_lines, vocab_size, capacity)
    finally:
        numbered_lines.close()  # closes the file now, not when the traceback is freed

    if not trajectories:
        raise InputError(source, None, None, "no trajectories (the file is empty or only blank lines)",
                         _FIX_LINE)
    return _assemble(source, trajectories, token_arrays)


def _read_serial(source: str, compressed: bool, numbered_lines, vocab_size: int | None,
                 capacity: int | None) -> tuple[list[_Trajectory], list[np.ndarray]]:
    """Parse every non-blank line in this process: (records, their int32 token arrays), in file order.

    Raises the first error in file order: a line's (`_parse_line`, a duplicate id) or the stream's. On a
    compressed stream the rest is read after a line's error, so that a corrupted stream, not the garbage
    lines it decompressed to, is what gets reported.
    """
    trajectories: list[_Trajectory] = []
    token_arrays: list[np.ndarray] = []  # int32, parallel to `trajectories`
    # str(id) -> (line, id): ids must be unique as strings, see module docstring.
    first_line_of: dict[str, tuple[int, str | int]] = {}
    try:
        for line_number, line in _content_lines(numbered_lines):
            where = _Where(source, line_number, vocab_size, capacity)
            trajectory, tokens = _parse_line(line, where)
            _check_unique_id(first_line_of, trajectory, where)
            trajectories.append(trajectory)
            token_arrays.append(tokens)
    except InputError:
        if compressed:
            # Decompressed garbage reaches the parser before the zstd checksum
            # at the frame's end is checked; if the rest of the stream is
            # corrupt, that, not a "malformed line", is the error to report.
            for _ in numbered_lines:
                pass
        raise
    return trajectories, token_arrays


def _content_lines(numbered_lines):
    """The (line number, bytes) of every line to parse: blank (whitespace-only) lines are skipped but keep their
    numbers, and line 1's UTF-8 byte-order mark is dropped (module docstring)."""
    for line_number, line in numbered_lines:
        if line_number == 1 and line.startswith(_UTF8_BOM):
            line = line[len(_UTF8_BOM):]
        if line and not line.isspace():
            yield line_number, line


def _check_unique_id(first_line_of: dict[str, tuple[int, str | int]], trajectory: _Trajectory,
                     where: _Where) -> None:
    """Record `trajectory`'s id in `first_line_of` (str(id) -> (line, id)), or raise if an earlier line has it."""
    key = str(trajectory.id)
    earlier = first_line_of.get(key)
    if earlier is not None:
        raise _duplicate_id_error(where, trajectory.id, *earlier)
    first_line_of[key] = (where.line, trajectory.id)


# --- parsing in worker processes ---------------------------------------------------------------

def _read_parallel(source: str, compressed: bool, numbered_lines, vocab_size: int | None, capacity: int | None,
                   workers: int) -> tuple[list[_Trajectory], list[np.ndarray]]:
    """`_read_serial`'s result and first error, with `_parse_line` run in `workers` forked processes.

    Invariants: chunk results are consumed strictly in file order, and within a chunk a worker returns
    the records before its first bad line, so the duplicate-id check sees records in the serial loop's
    order and the first error by line wins; at most `_IN_FLIGHT_PER_WORKER * workers` chunks are submitted
    and not yet consumed (memory stays bounded whatever the file's size); the processes have ended when
    this returns or raises, whatever it raises (`stop_workers` in `finally`).
    The returned token arrays are one per chunk; they concatenate to the serial loop's.
    """
    trajectories: list[_Trajectory] = []
    token_arrays: list[np.ndarray] = []
    first_line_of: dict[str, tuple[int, str | int]] = {}
    chunks = _chunks(numbered_lines, _CHUNK_BYTES)
    in_flight: deque[Future] = deque()
    # The stream's own failure (I/O, zstd) met while reading ahead: raised only after every line read before
    # it was checked, as the serial loop would meet them first.
    read_error: InputError | None = None
    executor = None
    try:
        executor = start_workers(workers)
        while True:
            while read_error is None and len(in_flight) < _IN_FLIGHT_PER_WORKER * workers:
                try:
                    chunk = next(chunks, None)
                except InputError as err:
                    read_error = err
                    break
                if chunk is None:
                    break
                in_flight.append(executor.submit(_parse_chunk, chunk, source, vocab_size, capacity))
            if not in_flight:
                break
            try:
                records, tokens, error = in_flight.popleft().result()   # a worker's other exceptions raise here
            except BrokenProcessPool:
                # Not the input's fault: the system killed a worker (most often for memory). One line, not a
                # traceback, and how to read without workers.
                raise HartsError(f"{source}: a parse worker process died while reading (killed by the system, "
                                 "most often for lack of memory); fix: read in one process (hartsc --read-workers "
                                 "1, read_trees(workers=1)) or free memory") from None
            for record in records:
                _check_unique_id(first_line_of, record, _Where(source, record.line, vocab_size, capacity))
            if error is not None:
                raise error
            trajectories.extend(records)
            token_arrays.append(tokens)
    except InputError:
        # A line's error: later chunks can only hold later errors, so stop parsing them now.
        stop_workers(executor)
        if compressed:   # as in `_read_serial`, a corrupted stream is the error to report
            if read_error is not None:
                raise read_error
            for _ in numbered_lines:
                pass
        raise
    finally:
        stop_workers(executor)
    if read_error is not None:
        raise read_error
    return trajectories, token_arrays


def _chunks(numbered_lines, chunk_bytes: int):
    """The non-blank lines as lists of (line number, bytes) of about `chunk_bytes` each, in file order.

    The lines are `_content_lines`, as `_read_serial` reads them, so the workers parse exactly the lines it
    would. When reading fails (InputError), the lines read before the failure
    are yielded first: one of them may hold an earlier error, which must win over it.
    """
    chunk: list[tuple[int, bytes]] = []
    size = 0
    try:
        for line_number, line in _content_lines(numbered_lines):
            chunk.append((line_number, line))
            size += len(line)
            if size >= chunk_bytes:
                yield chunk
                chunk, size = [], 0
    except InputError:
        if chunk:
            yield chunk
        raise
    if chunk:
        yield chunk


def _parse_chunk(lines: list[tuple[int, bytes]], source: str, vocab_size: int | None, capacity: int | None):
    """In a worker: (records, their tokens as one int32 array, None) for a chunk of lines, or (the records
    before the first bad line, None, that line's InputError). Lines after a bad one are not parsed: the
    main process stops at the first error."""
    records: list[_Trajectory] = []
    token_arrays: list[np.ndarray] = []
    try:
        for line_number, line in lines:
            record, tokens = _parse_line(line, _Where(source, line_number, vocab_size, capacity))
            records.append(record)
            token_arrays.append(tokens)
    except InputError as err:
        return records, None, err
    # One array per chunk: fewer objects to pickle, and the same bytes once `_assemble` concatenates.
    return records, np.concatenate(token_arrays), None


# --- parsing one line ------------------------------------------------------------------------

def _parse_line(line: bytes, where: _Where) -> tuple[_Trajectory, np.ndarray]:
    """Validate one non-blank line into (record, int32 tokens), or raise InputError for that line."""
    try:
        obj = orjson.loads(line)
        may_hold_bool = _may_hold_bool(line)
    except orjson.JSONDecodeError as err:
        obj = _loads_nonstandard(line, where, err)
        may_hold_bool = True
    if type(obj) is not dict:
        raise where.error(None, f"expected a JSON object, found {_describe(obj)}", _FIX_LINE)
    _reject_repeated_fields(line, where)

    traj_id = obj.get("id", _MISSING)
    if traj_id is _MISSING:
        raise where.error("id", "missing required field", 'add "id": a unique string or int')
    if type(traj_id) is not str and type(traj_id) is not int:
        raise where.error("id", f"expected a string or an int, found {_describe_label(traj_id)}",
                          'write "id" as a JSON string or integer' + _fix_huge_label(traj_id))

    tree = obj.get("tree")
    if tree is not None and type(tree) is not str and type(tree) is not int:
        raise where.error("tree", f"expected a string or an int, found {_describe_label(tree)}",
                          'write "tree" as a JSON string or integer, or leave it out' + _fix_huge_label(tree))

    tokens = _parse_tokens(obj.get("tokens", _MISSING), where, may_hold_bool)
    num_tokens = len(tokens)
    loss_mask = _parse_loss_mask(obj.get("loss_mask"), num_tokens, where, may_hold_bool)
    advantages = _parse_advantages(obj.get("advantages"), num_tokens, where, may_hold_bool)
    # Only lines that give log-probabilities pay for the mask of positions no loss reads.
    given = obj.get("old_logprobs") is not None or obj.get("ref_logprobs") is not None
    unread = never_read(loss_mask, num_tokens) if given else None
    # A NaN / Infinity literal left unchecked sits in a field HARTS ignores (Python's json.dumps writes
    # one for a float('nan') reward): ignored, like the rest of that field.
    old_logprobs = _parse_logprobs(obj.get("old_logprobs"), "old_logprobs", num_tokens, where, may_hold_bool, unread)
    ref_logprobs = _parse_logprobs(obj.get("ref_logprobs"), "ref_logprobs", num_tokens, where, may_hold_bool, unread)
    record = _Trajectory(traj_id, tree, where.line, num_tokens, loss_mask, advantages, old_logprobs,
                         ref_logprobs)
    return record, tokens


def _reject_repeated_fields(line: bytes, where: _Where) -> None:
    """A field HARTS reads that the line's top-level object names twice is an error, not a silent choice.

    JSON parsers keep one of two equal keys without a word (orjson the last),
    so `{"tokens": [...], "tokens": [...]}` from a buggy writer would train on
    whichever came last. One left-to-right pass over the line's JSON strings
    (a regex that matches whole strings, escapes included, so it is linear
    however many escaped quotes a text field holds) finds the keys: a string
    followed by a colon. The braces between strings, counted at C speed,
    give each key's depth, so only the top-level object's keys count and
    nested objects of ignored fields may reuse the names. On a digit-heavy
    line this costs a few percent of parsing.
    """
    seen: set[bytes] = set()
    depth = end = 0
    # A line with one "{" (the usual flat object) nests nothing, not even in a string: every key is top-level,
    # and one memchr-speed search replaces counting both braces between every two strings.
    outer = line.find(b"{")
    flat = line.find(b"{", outer + 1) < 0
    for match in _STRING.finditer(line):
        if flat:
            depth = 1
        else:
            depth += line.count(b"{", end, match.start()) - line.count(b"}", end, match.start())
        end = match.end()
        if depth != 1 or not _COLON.match(line, end):
            continue
        key = match.group(1)
        if b"\\" in key:   # an escaped key ("\u0074okens") names what it decodes to
            try:
                key = json.loads(b'"' + key + b'"').encode()
            except ValueError:
                continue
        if key in _READ_FIELDS:
            if key in seen:
                raise where.error(key.decode(), "appears 2 times in the line's object (a JSON reader keeps one of "
                                                "them silently)", "write each field once per line")
            seen.add(key)


def _may_hold_bool(line: bytes) -> bool:
    """False only when the raw line cannot contain a JSON `true` or `false`.

    numpy turns a list mixing bools and ints into ints without a trace, so a
    bool must be caught before conversion. Both literals end in 'e', and a
    one-byte find() is a memchr: digit-heavy lines hold few 'e's (key names,
    float exponents), so on a long line this costs far less than searching for
    the words. On a short line the key names' 'e's dominate, and the word
    search is cheaper.
    """
    if len(line) < 8192:
        return b"true" in line or b"false" in line
    hits = 0
    i = line.find(b"e")
    while i >= 0:
        if (i >= 3 and line.startswith(b"tru", i - 3)) or (i >= 4 and line.startswith(b"fals", i - 4)):
            return True
        hits += 1
        if hits > 32:  # many exponents: one full search is cheaper than more probing
            return b"true" in line or b"false" in line
        i = line.find(b"e", i + 1)
    return False


def _loads_nonstandard(line: bytes, where: _Where, err: orjson.JSONDecodeError):
    """Parse a line orjson rejected, so NaN/Infinity is reported on the field that holds it.

    orjson refuses the `NaN` / `Infinity` literals (they are not JSON) with a
    message that names only a column; Python's json accepts them, so the field
    checks can then say e.g. "old_logprobs[3] = nan is not a finite float32"
    (every field HARTS reads rejects a non-finite value where it matters). A
    line that only orjson rejects for another reason (a lone surrogate escape)
    is valid JSON and is read as such, except that `id` and `tree` may not hold
    a lone surrogate (`_reject_lone_surrogates`). A line nested deeper than
    Python's json goes is refused as such; one that is not UTF-8 is reported
    with its first bad byte.
    """
    try:
        # Strict UTF-8 first: json.loads(bytes) would guess UTF-16 from a stray
        # b"\xff\xfe" and let UTF-8-encoded surrogates through.
        text = line.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise where.error(None, f"malformed JSON: the line is not valid UTF-8 (byte {bad.start + 1} is 0x{line[bad.start]:02x})",
                          "save the file as UTF-8 (JSON text must be UTF-8)") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        # Valid JSON, but nested deeper than Python's json goes (near 1000 levels). orjson read the line
        # first: since 3.9 it stops at 1024 levels; older versions read any depth, so a deep line gets
        # here with them only when orjson refused something else on it (a NaN literal).
        raise where.error(None, "the line nests arrays or objects deeper than the JSON reader goes (about 1000 "
                                "levels)", "write that field flatter, or leave it out") from None
    except ValueError:
        # orjson's column is the useful part. A line cut short and ending in its newline reads to orjson
        # as ending on a second, empty line ("line 2, column 1"): the column is then taken without it.
        if getattr(err, "lineno", 1) > 1:
            try:
                orjson.loads(line.rstrip(b"\r\n"))
            except orjson.JSONDecodeError as within:
                err = within
        column = f" at column {err.colno}" if getattr(err, "colno", None) else ""
        raise where.error(None, f"malformed JSON: {err.msg}{column}", _FIX_LINE) from None
    _reject_lone_surrogates(obj, where)
    return obj


def _reject_lone_surrogates(obj, where: _Where) -> None:
    """The string fields a plan keeps (`id`, `tree`) must be encodable as UTF-8.

    JSON's `\\ud800` escape can name half of a surrogate pair; Python's json
    accepts it, but the plan (msgpack, UTF-8) cannot store the result. Fields
    HARTS ignores may hold one: they never reach the plan.
    """
    if type(obj) is not dict:
        return
    for field in ("id", "tree"):
        value = obj.get(field)
        if type(value) is not str:
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as bad:
            raise where.error(field, f"holds a lone surrogate \\u{ord(value[bad.start]):04x} at index {bad.start} "
                              "(half of a surrogate pair, not a character)",
                              "escape a character beyond U+FFFF as a surrogate pair (e.g. \\ud83d\\ude00) "
                              "or write it as UTF-8") from None


def _parse_tokens(value, where: _Where, may_hold_bool: bool) -> np.ndarray:
    """`tokens` as an int32 array: a list of >= 2 ints in [0, min(vocab_size, 2**31))."""
    if value is _MISSING:
        raise where.error("tokens", "missing required field", 'add "tokens": [list of token ids]')
    if type(value) is not list:
        raise where.error("tokens", f"expected a list of ints, found {_describe(value)}",
                          'write "tokens" as a JSON list of non-negative integers')
    if len(value) < 2:
        raise where.error("tokens", f"needs at least 2 tokens, found {len(value)}",
                          "drop this trajectory: with fewer than 2 tokens there is no next token to predict")
    if where.capacity is not None and len(value) > where.capacity:
        raise where.error("tokens", f"trajectory has {len(value)} tokens, more than the microbatch "
                          f"capacity {where.capacity}",
                          f"raise --capacity to at least {len(value)}, or split the trajectory")
    limit = _TOKEN_LIMIT if where.vocab_size is None else min(where.vocab_size, _TOKEN_LIMIT)
    array = _int_array(value, may_hold_bool)
    # min/max are two vectorised passes; only a failing line pays for the element scan.
    if array is None or array.min() < 0 or array.max() >= limit:
        raise _token_error(value, where)
    return array.astype(np.int32)


def _token_error(value: list, where: _Where) -> InputError:
    """The error for the first bad element of a token list already known to hold one."""
    vocab = where.vocab_size
    for i, x in enumerate(value):
        if type(x) is float and x.is_integer() and x >= 2**63:
            # orjson reads integers beyond 64 bits as floats: the digits are lost, say it was an integer.
            return where.error("tokens", f"tokens[{i}] is an integer of about {x:.3g}, which does not fit in int32",
                               "token ids must be < 2**31; check the tokenizer output")
        if type(x) is not int:
            return where.error("tokens", f"tokens[{i}] is {_describe(x)}, expected an int >= 0",
                               "write token ids as plain non-negative JSON integers")
        if x < 0:
            return where.error("tokens", f"tokens[{i}] = {x} is negative",
                               "token ids are >= 0; check the tokenizer output")
        if vocab is not None and x >= vocab:
            return where.error("tokens", f"tokens[{i}] = {x} is outside the vocabulary (size {vocab})",
                               "tokenize with the model's own tokenizer, or pass the model's vocab size")
        if x >= _TOKEN_LIMIT:
            return where.error("tokens", f"tokens[{i}] = {_short(x)} does not fit in int32",
                               "token ids must be < 2**31; check the tokenizer output")
    raise AssertionError("_token_error called on a valid token list")  # pragma: no cover


def _parse_loss_mask(value, num_tokens: int, where: _Where, may_hold_bool: bool) -> np.ndarray | None:
    """`loss_mask` as a uint8 array of 0/1, or None (all ones) when absent."""
    if value is None:
        return None
    fix = f'write "loss_mask" as a list of {num_tokens} zeros and ones, or leave it out'
    if type(value) is not list:
        raise where.error("loss_mask", f"expected a list of 0/1, found {_describe(value)}", fix)
    if len(value) != num_tokens:
        raise where.error("loss_mask", f"has {len(value)} entries but tokens has {num_tokens}", fix)
    array = _flag_array(value, may_hold_bool)
    if array is None or array.max() > 1:
        for i, x in enumerate(value):
            if type(x) is not int or x not in (0, 1):
                raise where.error("loss_mask", f"loss_mask[{i}] is {_describe(x)}, expected 0 or 1", fix)
    return array.copy()


def _parse_advantages(value, num_tokens: int, where: _Where, may_hold_bool: bool) -> float | np.ndarray:
    """`advantages` as a float32-finite scalar (default 0.0) or a float32 array of num_tokens."""
    if value is None:
        return 0.0
    if type(value) is int or type(value) is float:
        if not _finite_float32(value):
            raise where.error("advantages", f"{_describe(value)} is not a finite float32",
                              "write a finite number")
        return float(value)
    if type(value) is not list:
        raise where.error("advantages", f"expected a number or a list of numbers, found {_describe(value)}",
                          f"write one number for the trajectory, or a list of {num_tokens} numbers")
    return _parse_float_list(value, "advantages", num_tokens, where, may_hold_bool)


def _parse_float_list(value, field: str, num_tokens: int, where: _Where,
                      may_hold_bool: bool, fix: str = _FIX_FLOAT_LIST, array=_MISSING) -> np.ndarray | None:
    """A per-token float field as a finite float32 array of num_tokens, or None when absent (`fix`: the
    fix its element errors suggest; `array`: `_numeric_array(value)` when the caller has it already)."""
    if value is None:
        return None
    if type(value) is not list:
        raise where.error(field, f"expected a list of {num_tokens} numbers, found {_describe(value)}",
                          _FIX_FLOAT_LIST)
    if len(value) != num_tokens:
        raise where.error(field, f"has {len(value)} entries but tokens has {num_tokens}", _FIX_FLOAT_LIST)
    if array is _MISSING:
        array = _numeric_array(value)
    # A list of ints is fine (JSON writers print 0.0 as 0); bools are not numbers here.
    ok = (array is not None and array.ndim == 1 and array.dtype.kind in "iuf"
          and not (may_hold_bool and _holds_bool(value)))
    if ok:
        # Values beyond float32 become inf here and are reported below, one line
        # per bad input; numpy's overflow warning would only add noise.
        with np.errstate(over="ignore"):
            array = array.astype(np.float32, copy=False)
        ok = bool(np.isfinite(array).all())
    if not ok:
        for i, x in enumerate(value):
            if type(x) is not int and type(x) is not float:
                raise where.error(field, f"{field}[{i}] is {_describe(x)}, expected a number", fix)
            if not _finite_float32(x):
                raise where.error(field, f"{field}[{i}] = {_short(x)} is not a finite float32", fix)
        raise AssertionError("float list rejected without a bad element")  # pragma: no cover
    return array


def _parse_logprobs(value, field: str, num_tokens: int, where: _Where, may_hold_bool: bool,
                    unread: np.ndarray | None) -> np.ndarray | None:
    """`old_logprobs` / `ref_logprobs`: `_parse_float_list`, except that positions no loss reads (`unread`:
    index 0, loss_mask 0) may hold null, NaN, an infinity or a number beyond float32, stored as 0.0.

    That is what `harts run --logprobs-out` writes there (NaN, which orjson writes as null and Python's
    json as the literal NaN), so a run's log-probabilities pass back as the next step's input. Only lists
    holding such a value take the slower path.
    """
    if unread is None or type(value) is not list or len(value) != num_tokens:   # absent, or an error
        return _parse_float_list(value, field, num_tokens, where, may_hold_bool, _FIX_LOGPROBS)
    if may_hold_bool and _holds_bool(value):
        # An error (numpy would read the bool as a number, so it is found first): name it, not a value
        # that may stand where it stands.
        value = [0.0 if unread[i] and (x is None or (type(x) is float and not _finite_float32(x))) else x
                 for i, x in enumerate(value)]
        return _parse_float_list(value, field, num_tokens, where, may_hold_bool, _FIX_LOGPROBS)
    array = _numeric_array(value)
    if array is not None and array.ndim == 1 and array.dtype == object:
        # A null somewhere (or a non-number, which _parse_float_list reports): 0.0 where never read.
        skipped = np.equal(array, None) & unread
        if skipped.any():
            array[skipped] = 0.0
            value = array.tolist()
            array = _numeric_array(value)
    if array is not None and array.ndim == 1 and array.dtype.kind == "f":
        with np.errstate(over="ignore"):
            narrow = array.astype(np.float32)   # what _parse_float_list checks (and then keeps, not copies)
        skipped = ~np.isfinite(narrow) & unread
        if skipped.any():
            narrow[skipped] = 0.0
            value = narrow.tolist()
        array = narrow
    return _parse_float_list(value, field, num_tokens, where, may_hold_bool, _FIX_LOGPROBS, array)


def _numeric_array(value: list) -> np.ndarray | None:
    """np.array(value), or None when numpy cannot build one (ragged nesting, an int beyond 64 bits)."""
    try:
        return np.array(value)
    except (ValueError, TypeError, OverflowError):
        return None


def _int_array(value: list, may_hold_bool: bool) -> np.ndarray | None:
    """`value` as a 1-D int64 array, or None if any element is not a JSON int (or is beyond 64 bits).

    `array.array("q", ...)` (`pyarray`) converts in C and refuses, by raising, any float,
    string, null or nested list: the type check and the conversion are one
    pass, about twice as fast as `np.array` (which must first discover a
    dtype). The one case it hides, bools mixed with ints, is checked only when
    the raw line could hold a bool. An int in [2**63, 2**64) also gives None;
    the callers' element walk names it as out of range.
    """
    try:
        packed = pyarray.array("q", value)
    except (TypeError, OverflowError):
        return None
    if may_hold_bool and _holds_bool(value):
        return None
    return np.frombuffer(packed, dtype=np.int64)


def _flag_array(value: list, may_hold_bool: bool) -> np.ndarray | None:
    """`value` as a 1-D uint8 array, or None unless every element is a JSON int in [0, 255].

    `bytes(list)` converts and range-checks in C, several times faster than
    `np.array` on a list of small ints (a loss_mask is as long as its tokens).
    """
    try:
        packed = bytes(value)
    except (TypeError, ValueError):
        return None
    if may_hold_bool and _holds_bool(value):
        return None
    return np.frombuffer(packed, dtype=np.uint8)


def _holds_bool(value: list) -> bool:
    # Per-element, but only on lines whose raw bytes contain a true/false literal.
    return any(type(x) is bool for x in value)


def _finite_float32(x) -> bool:
    try:
        return math.isfinite(x) and abs(float(x)) <= _FLOAT32_MAX
    except OverflowError:  # an int too large for a double
        return False


def _describe(x) -> str:
    """A short human phrase for a JSON value: its JSON type and, if short, the value."""
    if x is None:
        return "null"
    if type(x) is bool:
        return "true (a boolean)" if x else "false (a boolean)"
    if isinstance(x, dict):
        return "an object"
    if isinstance(x, list):
        return "a list"
    kind = {str: "a string", int: "an int", float: "a float"}.get(type(x), type(x).__name__)
    return f"{kind} {_short(x)}"


def _is_huge_integer(x) -> bool:
    """orjson reads a JSON integer outside [-2**63, 2**64) as a float: such a float is integral and that large
    (-2**63 - 1 rounds to the float -2**63, so that bound is excluded too)."""
    return type(x) is float and math.isfinite(x) and x.is_integer() and not -2**63 < x < 2**64


def _describe_label(x) -> str:
    """`_describe` for an id or tree, naming an integer too large for 64 bits as such."""
    if _is_huge_integer(x):
        return f"the number {x:.4g}, outside the 64-bit integer range [-2**63, 2**64)"
    return _describe(x)


def _fix_huge_label(x) -> str:
    return " (an integer this large only as a string, e.g. \"18446744073709551616\")" if _is_huge_integer(x) else ""


def _short(x) -> str:
    """repr(x) cut to 40 characters: an error line stays one readable line."""
    text = repr(x)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _duplicate_id_error(where: _Where, traj_id, earlier_line: int, earlier_id) -> InputError:
    if type(earlier_id) is type(traj_id):
        problem = f"duplicate id {traj_id!r}, first used on line {earlier_line}"
    else:
        problem = (f"id {traj_id!r} and id {earlier_id!r} on line {earlier_line} are the same "
                   f"string {str(traj_id)!r}, which keys per-trajectory outputs")
    return where.error("id", problem, "give every trajectory a unique id")


# --- assembling the batch --------------------------------------------------------------------

def _assemble(source: str, trajectories: list[_Trajectory],
              token_arrays: list[np.ndarray]) -> TrajectoryBatch:
    """Flatten validated trajectories into the batch's arrays; empties `token_arrays`.

    Tokens are joined with one concatenate; optional fields are allocated once
    at their default and only the trajectories that gave a value are written,
    so the common case (no mask, scalar advantages) copies nothing per token.
    """
    n = len(trajectories)
    lengths = np.fromiter((t.num_tokens for t in trajectories), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    num_tokens = int(offsets[-1])
    tokens = np.concatenate(token_arrays)
    token_arrays.clear()  # the per-line copies are dead from here on; free them before allocating more

    loss_mask = np.ones(num_tokens, dtype=np.uint8)
    # Filled slice by slice (a scalar fills like memset): np.repeat of per-trajectory values
    # costs ~10 ns per token, half a second on a paper-scale step.
    advantages = np.empty(num_tokens, dtype=np.float32)
    for t, start, end in zip(trajectories, offsets[:-1].tolist(), offsets[1:].tolist()):
        if t.loss_mask is not None:
            loss_mask[start:end] = t.loss_mask
        advantages[start:end] = t.advantages

    has_old = np.fromiter((t.old_logprobs is not None for t in trajectories), dtype=bool, count=n)
    has_ref = np.fromiter((t.ref_logprobs is not None for t in trajectories), dtype=bool, count=n)
    return TrajectoryBatch(
        source=source,
        ids=tuple(t.id for t in trajectories),
        trees=tuple(t.tree for t in trajectories),
        lines=np.fromiter((t.line for t in trajectories), dtype=np.int64, count=n),
        token_offsets=offsets,
        tokens=tokens,
        loss_mask=loss_mask,
        advantages=advantages,
        old_logprobs=_scatter_optional(trajectories, "old_logprobs", has_old, offsets),
        ref_logprobs=_scatter_optional(trajectories, "ref_logprobs", has_ref, offsets),
        has_old_logprobs=has_old,
        has_ref_logprobs=has_ref,
    )


def _scatter_optional(trajectories: list[_Trajectory], field: str, present: np.ndarray,
                      offsets: np.ndarray) -> np.ndarray | None:
    """A flat float32 array, NaN where a trajectory lacks `field`; None if none has it."""
    if not present.any():
        return None
    flat = np.full(int(offsets[-1]), np.nan, dtype=np.float32)
    for k in np.flatnonzero(present):
        flat[offsets[k]:offsets[k + 1]] = getattr(trajectories[k], field)
    return flat
