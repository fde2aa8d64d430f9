"""Writing `harts gen` records: `write_jsonl`, one JSON object a line, atomically.

Invariants: the output file appears only when complete (a temporary file in
the same folder, then `os.replace`; on any error the temporary file is
removed), and its bytes depend on the records alone (for fixed orjson and
zstandard versions), so the same records give the same file, comparable
with `cmp`. Numpy arrays in records are written as JSON lists (orjson).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson

from harts.schema.atomic import atomic_output


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What `write_jsonl` wrote: the file, its record and token counts, its size."""

    path: str
    trajectories: int
    tokens: int
    bytes: int          # size of the file written (compressed for .zst)


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> WriteResult:
    """Write records as JSON lines to `path` atomically; a `.zst` suffix (any case) compresses.

    The file appears only when complete (temporary file in the same folder,
    then `os.replace`); on any error the temporary file is removed. Numpy
    arrays in records are written as JSON lists.
    """
    path = Path(path)
    option = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
    count = num_tokens = 0
    with atomic_output(path) as raw:
        if path.suffix.lower() == ".zst":
            import zstandard

            out = zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False)
        else:
            out = raw
        for record in records:
            out.write(orjson.dumps(record, option=option))
            count += 1
            num_tokens += len(record["tokens"])
        if out is not raw:
            out.close()
        size = raw.tell()
    return WriteResult(path=str(path), trajectories=count, tokens=num_tokens, bytes=size)
