"""Plan file format: round trip, determinism, and clear rejection of bad files.

Run: `python -m pytest tests/test_plan_format.py -q`.
"""
from __future__ import annotations

import re
import struct

import msgpack
import numpy as np
import pytest
import zstandard

from harts.schema import plan as plan_module
from harts.schema.errors import PlanFormatError
from harts.schema.plan import (FORMAT, MAGIC, SCHEMA_VERSION, Plan, _VIEW_BYTES, _encode, _packed_pieces, decode_plan,
                               encode_plan, read_plan, write_plan)


def sample_plan() -> Plan:
    return Plan(
        header={"format": FORMAT, "schema_version": SCHEMA_VERSION, "flags": {"dp": 2, "capacity": 8}, "compiler": "t"},
        step={"ids": ["a", 3], "token_offsets": np.array([0, 3, 5], dtype=np.int64), "old_logprobs": None,
              "advantages": np.array([0.5, -1.0], dtype=np.float32)},
        microbatches=[{"replica": 0, "row_token": np.arange(6, dtype=np.int32).reshape(2, 3),
                       "flags": np.array([True, False])}],
    )


def test_round_trip_keeps_arrays_exactly(tmp_path):
    path = tmp_path / "p.plan"
    write_plan(sample_plan(), path)
    # The format layer alone: sample_plan is no compiled plan, so read_plan's structure checks would refuse it.
    plan = decode_plan(path.read_bytes(), str(path))
    assert plan.flags == {"dp": 2, "capacity": 8}
    assert plan.step["ids"] == ["a", 3]
    assert plan.step["old_logprobs"] is None
    np.testing.assert_array_equal(plan.step["token_offsets"], [0, 3, 5])
    assert plan.step["advantages"].dtype == np.float32
    mb = plan.microbatches[0]
    assert mb["row_token"].shape == (2, 3) and mb["row_token"].dtype == np.int32
    assert mb["flags"].tolist() == [True, False]


def test_encoding_is_deterministic():
    assert encode_plan(sample_plan()) == encode_plan(sample_plan())


def test_write_is_atomic_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "p.plan"
    write_plan(sample_plan(), path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["p.plan"]


def test_failed_write_leaves_nothing(tmp_path):
    bad = sample_plan()
    bad.step["unstorable"] = object()
    with pytest.raises(TypeError):
        write_plan(bad, tmp_path / "p.plan")
    assert list(tmp_path.iterdir()) == []


def corrupt(data: bytes, how: str) -> bytes:
    if how == "truncated":
        return data[: len(data) - 7]
    if how == "flipped":
        body = bytearray(data)
        body[-6] ^= 0xFF   # inside the compressed body: caught by the zstd checksum or decoder
        return bytes(body)
    if how == "appended":   # found by a CLI audit: zstd ignored bytes after the body's frame
        return data + b"GARBAGE-APPENDED"
    if how == "zero-padded":
        return data + bytes(7)
    if how == "magic":
        return b"NOTAPLAN" + data[8:]
    if how == "empty":
        return b""
    if how in ("version", "format"):
        (n,) = struct.unpack("<I", data[8:12])
        header = msgpack.unpackb(data[12:12 + n])
        header["schema_version" if how == "version" else "format"] = 99 if how == "version" else "other"
        packed = msgpack.packb(header)
        return MAGIC + struct.pack("<I", len(packed)) + packed + data[12 + n:]
    raise AssertionError(how)


@pytest.mark.parametrize("how, words", [
    ("truncated", "plan body is truncated"),
    ("flipped", "corrupted"),
    ("appended", "16 bytes follow the plan body"),
    ("zero-padded", "7 bytes follow the plan body"),
    ("magic", "not a HARTS plan"),
    ("empty", "not a HARTS plan"),
    ("version", "schema version 99"),
    ("format", "expected 'harts-plan'"),
])
def test_bad_files_are_rejected_in_one_line(tmp_path, how, words):
    path = tmp_path / "p.plan"
    path.write_bytes(corrupt(encode_plan(sample_plan()), how))
    with pytest.raises(PlanFormatError) as info:
        read_plan(path)
    message = str(info.value)
    assert words in message and "fix:" in message and str(path) in message and "\n" not in message


def test_missing_file_is_a_plan_error(tmp_path):
    with pytest.raises(PlanFormatError, match="cannot read plan"):
        read_plan(tmp_path / "absent.plan")


def test_written_plan_gets_ordinary_file_permissions(tmp_path):
    import os

    umask = os.umask(0o022)
    try:
        write_plan(sample_plan(), tmp_path / "p.plan")
    finally:
        os.umask(umask)
    assert (tmp_path / "p.plan").stat().st_mode & 0o777 == 0o644


def test_the_body_is_packed_in_pieces_that_join_to_one_msgpack_document():
    # encode_plan packs containers and small arrays itself and hands large arrays to zstd in place; readers
    # unpack the body as one document, so the pieces must join to exactly what msgpack writes.
    plan = sample_plan()
    large = np.arange(_VIEW_BYTES // 8 + 3, dtype=np.int64)
    odd = {"big_endian": np.arange(_VIEW_BYTES, dtype=">i4"), "strided": large[::2], "scalar": np.array(7),
           "empty": np.zeros((0, 3), dtype=np.float32), "flags": np.array([True, False]),
           "nested": [[large[:5]], (large[:300], 1, "x")], "tuple": (1, None, 2.5), "numpy_scalar": np.int32(3)}
    body = {"step": plan.step, "microbatches": [*plan.microbatches * 3, {"large": large, **odd}],
            "producers": plan.microbatches, "summary": {"seconds": 1.5}}
    pieces = _packed_pieces(body)
    assert b"".join(bytes(piece) for piece in pieces) == msgpack.packb(body, default=_encode, use_bin_type=True)
    # The large arrays travel as views of their own memory, not as copies.
    assert any(isinstance(piece, memoryview) and np.shares_memory(np.asarray(piece), large) for piece in pieces)
    with_producers = Plan(header=plan.header, step=plan.step, microbatches=body["microbatches"],
                          summary=body["summary"], producers=body["producers"])
    decoded = decode_plan(encode_plan(with_producers))
    assert len(decoded.microbatches) == 4 and len(decoded.producers) == 1 and decoded.summary == {"seconds": 1.5}
    np.testing.assert_array_equal(decoded.producers[0]["row_token"], plan.microbatches[0]["row_token"])
    for key in ("big_endian", "strided", "scalar", "empty", "flags"):
        np.testing.assert_array_equal(decoded.microbatches[-1][key], np.asarray(odd[key]))


def _with_body(body: bytes) -> bytes:
    """A plan file around raw msgpack body bytes (as an older or broken writer could leave)."""
    header = msgpack.packb({"format": FORMAT, "schema_version": SCHEMA_VERSION, "flags": {}})
    return MAGIC + struct.pack("<I", len(header)) + header + zstandard.ZstdCompressor(write_checksum=True).compress(body)


@pytest.mark.parametrize("body, words", [
    (msgpack.packb({"step": {}, "microbatches": []}) + msgpack.packb(5), "corrupted (1 bytes follow its value)"),
    (msgpack.packb({"step": {}, "microbatches": []}) + b"\xdc", "corrupted (1 bytes follow its value)"),
    (msgpack.packb({"step": {}, "microbatches": [1, 2, 3]})[:-2], "corrupted (it ends inside a value)"),
    (msgpack.packb([1, 2]), "lacks 'step' or 'microbatches'"),
    (msgpack.packb({"step": {}}), "lacks 'step' or 'microbatches'"),
])
def test_a_body_that_is_not_one_plan_map_is_refused(body, words):
    with pytest.raises(PlanFormatError, match=re.escape(words)):
        decode_plan(_with_body(body), "x.plan")


def test_the_body_decodes_the_same_across_any_read_and_feed_sizes(monkeypatch):
    # The body is decompressed and unpacked a piece at a time; tiny pieces put every boundary inside values.
    plan = sample_plan()
    plan = Plan(header=plan.header, step=plan.step, microbatches=plan.microbatches * 40,
                producers=plan.microbatches * 3, summary={"seconds": 2.0})
    data = encode_plan(plan)
    expected = decode_plan(data)
    monkeypatch.setattr(plan_module, "_READ_SIZE", 7)
    monkeypatch.setattr(plan_module, "_FEED_SIZE", 5)
    decoded = decode_plan(data)
    assert encode_plan(decoded) == data == encode_plan(expected)
    assert len(decoded.microbatches) == 40 and len(decoded.producers) == 3
    with pytest.raises(PlanFormatError, match="plan body is truncated"):
        decode_plan(data[:-9])


def test_nil_producers_read_as_a_plan_without_windows():
    """Found by a review: the piecewise decoder refused `"producers": nil`, which the whole-body one read as
    an L1-only plan."""
    plan = decode_plan(_with_body(msgpack.packb({"step": {}, "microbatches": [], "producers": None})), "x.plan")
    assert plan.producers is None and plan.microbatches == []
