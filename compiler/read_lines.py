"""Numbered raw lines of a trajectories file: plain, or a zstd stream, from a file or a pipe.

`open_lines(source)` tells the format from the name and the first bytes,
refuses a gzip stream and a HARTS plan by name, and yields (1-based physical
line, bytes) lazily; every failure to open, read or decompress (a corrupted
or truncated zstd stream included) is an `InputError` naming the file.
Parsing the lines is `read_trees`' job.
"""
from __future__ import annotations

import io
from typing import Iterator

import zstandard

from harts.schema.errors import InputError
from harts.schema.plan import MAGIC as PLAN_MAGIC

__all__ = ["open_lines"]

# Compressed bytes fed to the decompressor per call. zstandard's decompress()
# has no output limit, and JSON of repeated values (a loss_mask of ones)
# compresses ~100x, so a small input step keeps each output chunk small.
_ZSTD_READ_BYTES = 1 << 17
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"   # every zstd frame starts with 0xFD2FB528, little-endian
_GZIP_MAGIC = b"\x1f\x8b"


def open_lines(source: str) -> tuple[bool, Iterator[tuple[int, bytes]]]:
    """Open `source` and tell its format from its first bytes: (compressed, its numbered lines).

    The first bytes are peeked at through the file's buffer, not consumed, so
    a pipe (`/dev/stdin`, `<(zstd -c ...)`) is recognised as well as a file;
    should a pipe's first write be shorter than that, they are read and handed
    back in front of the rest (`_HeadFirst`).
    zstd: the name ends in .zst (any case; then anything else is a corrupted
    stream) or the bytes start with a zstd frame's magic number. A gzip
    stream and a HARTS plan are refused by name rather than parsed as
    malformed JSON. Failures to open or read raise `InputError`.
    """
    try:
        file = open(source, "rb")
    except OSError as err:
        raise _read_error(source, err) from None
    try:
        head = file.peek(len(PLAN_MAGIC))[:len(PLAN_MAGIC)]
        if len(head) < len(PLAN_MAGIC):   # a peek returns one read's bytes: a pipe may have sent fewer yet
            head = file.read(len(PLAN_MAGIC))
            file = io.BufferedReader(_HeadFirst(head, file))
    except OSError as err:
        file.close()
        raise _read_error(source, err) from None
    compressed = source.lower().endswith(".zst") or head.startswith(_ZSTD_MAGIC)
    refusal = None
    if not compressed and head.startswith(_GZIP_MAGIC):
        refusal = ("a gzip stream, which HARTS does not read",
                   "decompress it (`gunzip -k FILE`) or compress with zstd instead (`zstd trees.jsonl`)")
    elif head == PLAN_MAGIC:
        refusal = ("a HARTS plan, not trajectories", "pass the trees.jsonl the plan was compiled from")
    if refusal is not None:
        file.close()
        raise InputError(source, None, None, *refusal)
    return compressed, _numbered_lines(file, source, compressed)


class _HeadFirst(io.RawIOBase):
    """A stream that gives `head`, bytes already read from the open file `rest`, and then the rest of it."""

    def __init__(self, head: bytes, rest):
        super().__init__()
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._head:
            count = min(len(buffer), len(self._head))
            buffer[:count] = self._head[:count]
            self._head = self._head[count:]
            return count
        return self._rest.readinto1(buffer)

    def close(self) -> None:
        self._rest.close()
        super().close()


def _read_error(source: str, err: OSError) -> InputError:
    return InputError(source, None, None, f"cannot read the file ({err.strerror or err})",
                      "check the path and the file's permissions")


def _numbered_lines(file, source: str, compressed: bool) -> Iterator[tuple[int, bytes]]:
    """Yield (1-based physical line number, raw line bytes) of the open `file`, then close it; I/O failures
    become InputError.

    Errors are raised inside this generator, so an InputError raised by the
    caller's loop body is never mistaken for a read failure.
    """
    try:
        with file:
            lines = _split_lines(_zstd_chunks(file, source)) if compressed else file
            yield from enumerate(lines, start=1)
    except OSError as err:
        raise _read_error(source, err) from None
    except zstandard.ZstdError as err:
        raise InputError(source, None, None, f"corrupted zstd stream ({err})",
                         "re-create the file with `zstd`, or pass the uncompressed .jsonl") from None


def _zstd_chunks(file, source: str) -> Iterator[bytes]:
    """Decompressed bytes of every zstd frame in `file`, in order.

    A decompression object per frame (rather than `stream_reader`) lets us see
    whether the last frame ended: a truncated download would otherwise read as
    a shorter, perfectly valid file.
    """
    dctx = zstandard.ZstdDecompressor()
    frame = dctx.decompressobj()
    frame_started = False
    while chunk := file.read(_ZSTD_READ_BYTES):
        while chunk:
            frame_started = True
            out = frame.decompress(chunk)
            if out:
                yield out
            if not frame.eof:
                break
            # Concatenated frames (`cat a.zst b.zst`, pzstd) are one valid stream.
            chunk = frame.unused_data
            frame = dctx.decompressobj()
            frame_started = False
    if frame_started:
        raise InputError(source, None, None, "the zstd stream ends in the middle of a frame (truncated file)",
                         "re-copy or re-create the file; `zstd -t` checks it")


def _split_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Split a byte stream into lines (each keeps its b'\\n'), linear in the total size.

    Pieces of a line that spans chunks are joined once, so a line far longer
    than a chunk costs no repeated copying.
    """
    pending: list[bytes] = []
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:end + 1]
            if pending:
                pending.append(piece)
                piece = b"".join(pending)
                pending = []
            yield piece
            start = end + 1
        if start < len(chunk):
            pending.append(chunk[start:])
    if pending:
        yield b"".join(pending)
