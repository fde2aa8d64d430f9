"""`read_trees`: contract section 1, one test per kind of bad input and the good-input shapes.

Run: `python -m pytest tests/test_read_trees.py -q`.

Why: the reader is the only gate between user files and the compiler. Every
bad input must stop here with one line naming the file, the line, the field
and the fix; every good input must come out as a `TrajectoryBatch` whose
invariants the rest of the compiler relies on without re-checking.
"""
from __future__ import annotations

import gzip
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.api import compile_trajectories, write_plan
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.read_lines import _split_lines
from harts.compiler.read_trees import read_trees
from harts.schema.errors import InputError

GOOD = '{"id": 0, "tokens": [1, 2, 3]}'


def write(tmp_path: Path, lines: list[str] | str, name: str = "trees.jsonl") -> Path:
    text = lines if isinstance(lines, str) else "\n".join(lines) + "\n"
    data = text.encode("utf-8", errors="surrogateescape")  # lets a test write a raw invalid byte
    path = tmp_path / name
    path.write_bytes(zstandard.ZstdCompressor().compress(data) if name.endswith(".zst") else data)
    return path


def assert_invariants(batch: TrajectoryBatch) -> None:
    """The TrajectoryBatch docstring's invariants, checked literally."""
    n, s = batch.num_trajectories, batch.num_tokens
    offsets = batch.token_offsets
    assert offsets.dtype == np.int64 and offsets[0] == 0 and np.all(np.diff(offsets) >= 2)
    assert batch.tokens.dtype == np.int32 and batch.tokens.shape == (s,) and batch.tokens.min() >= 0
    assert batch.loss_mask.dtype == np.uint8 and batch.loss_mask.shape == (s,)
    assert set(np.unique(batch.loss_mask).tolist()) <= {0, 1}
    assert batch.advantages.dtype == np.float32 and np.isfinite(batch.advantages).all()
    for values, has in ((batch.old_logprobs, batch.has_old_logprobs),
                        (batch.ref_logprobs, batch.has_ref_logprobs)):
        assert has.dtype == bool and has.shape == (n,)
        if values is None:
            assert not has.any()
            continue
        assert values.dtype == np.float32 and values.shape == (s,)
        present = np.repeat(has, batch.lengths)
        assert np.isfinite(values[present]).all() and np.isnan(values[~present]).all()
    assert len(set(map(str, batch.ids))) == n and len(batch.trees) == n
    assert batch.lines.dtype == np.int64 and np.all(np.diff(batch.lines) > 0)


# --- bad input: one case per way a line can be wrong ------------------------------------------

@dataclass
class Bad:
    name: str
    lines: list[str]
    line: int                  # the line the error must name
    field: str | None          # the field it must name (None: a whole-line problem)
    says: str                  # a phrase of the problem it must state
    kwargs: dict = field(default_factory=dict)


def tok(extra: str = "", tokens: str = "[1, 2, 3]") -> str:
    return '{"id": 9, "tokens": ' + tokens + extra + "}"


BAD = [
    Bad("malformed_json", [GOOD, '{"id": 1, "tokens": [1, 2'], 2, None, "malformed JSON"),
    Bad("two_objects_on_a_line", ['{"id": 1, "tokens": [1, 2]} {"id": 2, "tokens": [1, 2]}'], 1, None,
        "malformed JSON"),
    Bad("not_an_object", ["[1, 2, 3]"], 1, None, "expected a JSON object"),
    Bad("invalid_utf8", ['{"id": "\udcff", "tokens": [1, 2]}'], 1, None, "malformed JSON"),
    Bad("missing_id", ['{"tokens": [1, 2]}'], 1, "id", "missing"),
    Bad("missing_tokens", ['{"id": 1}'], 1, "tokens", "missing"),
    Bad("id_bool", ['{"id": true, "tokens": [1, 2]}'], 1, "id", "boolean"),
    Bad("id_float", ['{"id": 1.5, "tokens": [1, 2]}'], 1, "id", "float"),
    Bad("id_null", ['{"id": null, "tokens": [1, 2]}'], 1, "id", "null"),
    Bad("id_list", ['{"id": [1], "tokens": [1, 2]}'], 1, "id", "list"),
    # orjson reads integers beyond 64 bits as floats: the line must say the number is too large, not a float.
    Bad("id_beyond_64_bits", ['{"id": 18446744073709551616, "tokens": [1, 2]}'], 1, "id", "64-bit integer range"),
    Bad("id_below_64_bits", ['{"id": -9223372036854775809, "tokens": [1, 2]}'], 1, "id", "64-bit integer range"),
    Bad("tree_beyond_64_bits", [tok(', "tree": 100000000000000000000000')], 1, "tree", "64-bit integer range"),
    Bad("tree_float", [tok(', "tree": 2.5')], 1, "tree", "float"),
    Bad("tree_bool", [tok(', "tree": false')], 1, "tree", "boolean"),
    Bad("tokens_not_a_list", [tok(tokens='"1 2 3"')], 1, "tokens", "string"),
    Bad("tokens_too_short", [tok(tokens="[5]")], 1, "tokens", "at least 2"),
    Bad("tokens_empty", [tok(tokens="[]")], 1, "tokens", "at least 2"),
    Bad("tokens_float", [tok(tokens="[1, 2.0, 3]")], 1, "tokens", "tokens[1]"),
    Bad("tokens_bool_among_ints", [tok(tokens="[1, true, 3]")], 1, "tokens", "tokens[1] is true"),
    Bad("tokens_all_bool", [tok(tokens="[false, true]")], 1, "tokens", "tokens[0] is false"),
    # Lines over 8 KiB take the memchr path of the bool pre-check, with few and with many 'e's.
    Bad("long_line_tokens_bool", [tok(tokens="[" + "7, " * 3000 + "true]")], 1, "tokens",
        "tokens[3000] is true"),
    Bad("long_line_exponents_loss_mask_bool",
        [tok(', "old_logprobs": [' + "-1e-05, " * 2999 + '0], "loss_mask": [' + "1, " * 2999 + "false]",
             tokens="[" + "7, " * 2999 + "7]")], 1, "loss_mask", "loss_mask[2999] is false"),
    Bad("tokens_string_element", [tok(tokens='[1, "2"]')], 1, "tokens", "tokens[1] is a string"),
    Bad("tokens_null_element", [tok(tokens="[1, null]")], 1, "tokens", "tokens[1] is null"),
    Bad("tokens_nested", [tok(tokens="[[1, 2], [3, 4]]")], 1, "tokens", "tokens[0] is a list"),
    Bad("tokens_negative", [GOOD, tok(tokens="[4, -1, 2]")], 2, "tokens", "tokens[1] = -1 is negative"),
    Bad("tokens_out_of_vocab", [tok(tokens="[4, 99, 100]")], 1, "tokens", "tokens[2] = 100 is outside",
        {"vocab_size": 100}),
    Bad("tokens_beyond_int32", [tok(tokens=f"[4, {2**31}]")], 1, "tokens", "does not fit in int32"),
    Bad("tokens_beyond_int64", [tok(tokens=f"[4, {10**30}]")], 1, "tokens", "an integer of about 1e+30, which does not fit"),
    Bad("tokens_over_capacity", [GOOD, GOOD.replace("0", "1"), tok(tokens="[1, 2, 3, 4]")], 3, "tokens",
        "more than the microbatch capacity 3", {"capacity": 3}),
    Bad("loss_mask_not_a_list", [tok(', "loss_mask": 1')], 1, "loss_mask", "expected a list"),
    Bad("loss_mask_wrong_length", [tok(', "loss_mask": [0, 1]')], 1, "loss_mask", "has 2 entries"),
    Bad("loss_mask_two", [tok(', "loss_mask": [0, 2, 1]')], 1, "loss_mask", "loss_mask[1]"),
    Bad("loss_mask_negative", [tok(', "loss_mask": [0, -1, 1]')], 1, "loss_mask", "loss_mask[1]"),
    Bad("loss_mask_bool", [tok(', "loss_mask": [0, true, 1]')], 1, "loss_mask", "loss_mask[1] is true"),
    Bad("loss_mask_float", [tok(', "loss_mask": [0, 1.0, 1]')], 1, "loss_mask", "loss_mask[1] is a float"),
    Bad("advantages_string", [tok(', "advantages": "0.5"')], 1, "advantages", "string"),
    Bad("advantages_bool", [tok(', "advantages": true')], 1, "advantages", "boolean"),
    Bad("advantages_wrong_length", [tok(', "advantages": [0.5]')], 1, "advantages", "has 1 entries"),
    Bad("advantages_element_string", [tok(', "advantages": [0.5, "x", 1]')], 1, "advantages",
        "advantages[1] is a string"),
    Bad("advantages_element_bool", [tok(', "advantages": [0.5, false, 1]')], 1, "advantages",
        "advantages[1] is false"),
    Bad("advantages_nan_literal", [tok(', "advantages": NaN')], 1, "advantages", "not a finite"),
    Bad("advantages_infinity_in_list", [tok(', "advantages": [0, Infinity, 1]')], 1, "advantages",
        "advantages[1] = inf"),
    Bad("advantages_float32_overflow", [tok(', "advantages": 1e39')], 1, "advantages", "not a finite float32"),
    Bad("advantages_double_overflow", [tok(', "advantages": [0, 1e999, 0]')], 1, "advantages",
        "advantages[1] = inf"),
    Bad("old_logprobs_not_a_list", [tok(', "old_logprobs": -1.0')], 1, "old_logprobs", "expected a list"),
    Bad("old_logprobs_wrong_length", [tok(', "old_logprobs": [0, -1, -2, -3]')], 1, "old_logprobs",
        "has 4 entries"),
    Bad("old_logprobs_nan_literal", [tok(', "old_logprobs": [0, NaN, -1]')], 1, "old_logprobs",
        "old_logprobs[1] = nan"),
    # NaN and null pass only where no loss reads them (test_logprobs_may_be_missing_where_no_loss_reads_them).
    Bad("old_logprobs_nan_where_trained", [tok(', "loss_mask": [0, 0, 1], "old_logprobs": [NaN, -1, NaN]')], 1,
        "old_logprobs", "old_logprobs[2] = nan"),
    Bad("ref_logprobs_null_where_trained", [tok(', "loss_mask": [1, 1, 0], "ref_logprobs": [null, null, null]')], 1,
        "ref_logprobs", "ref_logprobs[1] is null"),
    Bad("old_logprobs_bool_beside_a_nan", [tok(', "old_logprobs": [NaN, true, -1]')], 1, "old_logprobs",
        "old_logprobs[1] is true"),
    Bad("ref_logprobs_bool_beside_a_null", [tok(', "loss_mask": [0, 0, 1], "ref_logprobs": [null, false, -1]')], 1,
        "ref_logprobs", "ref_logprobs[1] is false"),
    Bad("old_logprobs_string_where_untrained", [tok(', "loss_mask": [0, 0, 1], "old_logprobs": [0, "x", -1]')], 1,
        "old_logprobs", "old_logprobs[1] is a string"),
    Bad("old_logprobs_minus_infinity", [tok(', "old_logprobs": [0, -1, -Infinity]')], 1, "old_logprobs",
        "old_logprobs[2] = -inf"),
    Bad("ref_logprobs_null_element", [tok(', "ref_logprobs": [0, null, -1]')], 1, "ref_logprobs",
        "ref_logprobs[1] is null"),
    Bad("ref_logprobs_nested", [tok(', "ref_logprobs": [[0], [1], [2]]')], 1, "ref_logprobs",
        "ref_logprobs[0] is a list"),
    Bad("duplicate_id", ['{"id": "a", "tokens": [1, 2]}', GOOD, '{"id": "a", "tokens": [3, 4]}'], 3, "id",
        "first used on line 1"),
    Bad("duplicate_id_as_string", ['{"id": 7, "tokens": [1, 2]}', '{"id": "7", "tokens": [3, 4]}'], 2, "id",
        "line 1"),
    # JSON parsers keep one of two equal keys silently (orjson the last): a buggy writer's second token list
    # would be trained on without a word.
    Bad("tokens_twice", ['{"id": 1, "tokens": [1, 2, 3], "tokens": [4, 5, 6]}'], 1, "tokens",
        "appears 2 times in the line's object"),
    Bad("id_twice", [GOOD, '{"id": 1, "tokens": [1, 2, 3], "id": 2}'], 2, "id", "appears 2 times"),
    Bad("advantages_twice_spaced", [tok(', "advantages": 1.0, "advantages" : -1.0')], 1, "advantages",
        "appears 2 times"),
    Bad("tokens_twice_one_escaped", ['{"id": 1, "\\u0074okens": [1, 2], "tokens": [1, 2, 4]}'], 1, "tokens",
        "appears 2 times"),
    Bad("old_logprobs_twice_beside_a_nan", [tok(', "old_logprobs": [0, NaN, 1], "old_logprobs": [0, -1, -1]')], 1,
        "old_logprobs", "appears 2 times"),
    # Deep, but within every JSON reader's depth (orjson >= 3.9 stops at 1024, Python's json near 1000).
    Bad("tokens_twice_after_deep_nesting", ['{"id": 1, "x": ' + "[" * 900 + "]" * 900
                                             + ', "tokens": [1, 2], "tokens": [1, 2, 3]}'], 1, "tokens",
        "appears 2 times"),
    # Lines with a nested object or a "{" in a string take the brace-counting path, not the flat line's.
    Bad("tokens_twice_after_a_nested_object", ['{"id": 1, "meta": {"tokens": 0}, "tokens": [1, 2], "tokens": [3]}'],
        1, "tokens", "appears 2 times"),
    Bad("tokens_twice_beside_a_brace_in_a_string", ['{"id": "a{", "tokens": [1, 2], "tokens": [3]}'], 1, "tokens",
        "appears 2 times"),
    Bad("line_number_counts_blank_lines", [GOOD, "", "   ", '{"id": 1, "tokens": [1, -2]}'], 4, "tokens",
        "negative"),
]


@pytest.mark.parametrize("case", BAD, ids=[c.name for c in BAD])
@pytest.mark.parametrize("name", ["trees.jsonl", "trees.jsonl.zst"])
def test_bad_line_is_rejected_with_file_line_field_and_fix(tmp_path, case, name):
    path = write(tmp_path, case.lines, name)
    with pytest.raises(InputError) as caught:
        read_trees(path, **case.kwargs)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{case.line}: ")
    assert case.says in message
    assert "fix: " in message
    if case.field is not None:
        assert f"field '{case.field}'" in message
    err = caught.value
    assert (err.path, err.line, err.field) == (str(path), case.line, case.field)


def _assert_file_error(path: Path, says: str, **kwargs) -> None:
    with pytest.raises(InputError) as caught:
        read_trees(path, **kwargs)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and caught.value.line is None
    assert says in message and "fix: " in message and "\n" not in message


@pytest.mark.parametrize("text", ["", "\n", "  \n\t\n"], ids=["zero_bytes", "one_newline", "whitespace"])
@pytest.mark.parametrize("name", ["trees.jsonl", "trees.jsonl.zst"])
def test_file_without_trajectories_is_rejected(tmp_path, text, name):
    _assert_file_error(write(tmp_path, text, name), "no trajectories")


def test_missing_file_is_rejected(tmp_path):
    _assert_file_error(tmp_path / "absent.jsonl", "cannot read")


def test_directory_is_rejected(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    _assert_file_error(tmp_path / "dir.jsonl", "cannot read")


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_corrupted_zstd_is_rejected(tmp_path, where):
    # The zstd CLI writes a content checksum by default; that is what exposes
    # corruption inside a block, even after garbage lines were decompressed.
    lines = [f'{{"id": {i}, "tokens": [{i}, {2 * i}, 3]}}' for i in range(2000)]
    path = tmp_path / "trees.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress("\n".join(lines).encode()))
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x5A
    path.write_bytes(bytes(data))
    _assert_file_error(path, "corrupted zstd")


def test_garbage_after_the_last_zstd_frame_is_rejected(tmp_path):
    path = write(tmp_path, [GOOD], "trees.jsonl.zst")
    path.write_bytes(path.read_bytes() + b"garbage")
    _assert_file_error(path, "corrupted zstd")


def test_plain_text_named_zst_is_rejected(tmp_path):
    path = tmp_path / "trees.jsonl.zst"
    path.write_text(GOOD + "\n")
    _assert_file_error(path, "corrupted zstd")


@pytest.mark.parametrize("name", ["trees.jsonl.ZST", "trees.jsonl.zstd", "trees"])
def test_zstd_is_recognised_by_its_magic_number_whatever_the_name(tmp_path, name):
    lines = [GOOD, '{"id": "b", "tokens": [4, 5, 6, 7]}']
    path = tmp_path / name
    path.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
    packed = read_trees(path)
    plain = read_trees(write(tmp_path, lines))
    assert packed.ids == plain.ids == (0, "b")
    np.testing.assert_array_equal(packed.tokens, plain.tokens)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("first_write", [None, 1, 3])
@pytest.mark.parametrize("compressed", [False, True])
def test_a_pipe_is_read_whole(tmp_path, compressed, first_write):
    # `hartsc /dev/stdin` or `hartsc <(zstd -c ...)`: the first bytes are peeked at through the buffer, so a pipe
    # keeps them and a zstd stream in a pipe is recognised (reopening a drained pipe would wait for a writer
    # forever, hence the reader's own thread). A writer may send the first bytes alone (`first_write`): the
    # reader then reads the magic numbers' length before telling zstd from JSON.
    lines = [GOOD, '{"id": "b", "tokens": [4, 5, 6, 7]}']
    data = ("\n".join(lines) + "\n").encode()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result = {}

    def read():
        try:
            result["batch"] = read_trees(fifo)
        except Exception as err:   # reported by the assertion below
            result["error"] = err
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = zstandard.ZstdCompressor().compress(data) if compressed else data
    with open(fifo, "wb", buffering=0) as writer:
        for piece in (sent,) if first_write is None else (sent[:first_write], sent[first_write:]):
            writer.write(piece)
            time.sleep(0.05)   # the reader's first read returns the first piece alone
    reader.join(timeout=30)
    if reader.is_alive():
        fifo.write_text("")   # let the stuck reader finish
    assert not reader.is_alive() and "batch" in result, result.get("error", "the pipe was not read in one pass")
    assert result["batch"].ids == (0, "b")
    np.testing.assert_array_equal(result["batch"].tokens, read_trees(write(tmp_path, lines)).tokens)


def test_a_gzip_file_is_refused_by_name(tmp_path):
    path = tmp_path / "trees.jsonl.gz"
    path.write_bytes(gzip.compress((GOOD + "\n").encode()))
    _assert_file_error(path, "a gzip stream, which HARTS does not read")


def test_a_plan_given_as_trajectories_is_refused_by_name(tmp_path):
    plan = compile_trajectories([[1, 2, 3, 4]], capacity=8, chunk_size=2)
    path = tmp_path / "step.plan"
    write_plan(plan, path)
    _assert_file_error(path, "a HARTS plan, not trajectories")


def test_truncated_zstd_is_rejected_not_read_short(tmp_path):
    # Cut the stream at a line boundary's worth of data: without the frame-end
    # check this would silently read as a shorter valid file.
    path = write(tmp_path, [GOOD.replace("0", str(i)) for i in range(50)], "trees.jsonl.zst")
    path.write_bytes(path.read_bytes()[:-4])
    _assert_file_error(path, "truncated")


# --- good input ------------------------------------------------------------------------------

def test_defaults_fill_optional_fields(tmp_path):
    batch = read_trees(write(tmp_path, ['{"id": "a", "tokens": [5, 6, 7]}', '{"id": "b", "tokens": [5, 8]}']))
    assert_invariants(batch)
    assert batch.source == str(tmp_path / "trees.jsonl")
    assert batch.ids == ("a", "b") and batch.trees == (None, None)
    np.testing.assert_array_equal(batch.token_offsets, [0, 3, 5])
    np.testing.assert_array_equal(batch.tokens, [5, 6, 7, 5, 8])
    np.testing.assert_array_equal(batch.loss_mask, np.ones(5))
    np.testing.assert_array_equal(batch.advantages, np.zeros(5))
    assert batch.old_logprobs is None and batch.ref_logprobs is None
    assert not batch.has_old_logprobs.any() and not batch.has_ref_logprobs.any()
    np.testing.assert_array_equal(batch.lines, [1, 2])


def test_scalar_advantage_broadcasts_and_list_is_kept(tmp_path):
    batch = read_trees(write(tmp_path, [
        '{"id": 1, "tokens": [1, 2, 3], "advantages": 0.5}',
        '{"id": 2, "tokens": [1, 2], "advantages": [0, -1.25]}',
        '{"id": 3, "tokens": [4, 5], "advantages": -2}',
    ]))
    assert_invariants(batch)
    np.testing.assert_array_equal(batch.advantages, [0.5, 0.5, 0.5, 0, -1.25, -2, -2])


def test_null_optional_fields_mean_absent_and_unknown_fields_are_ignored(tmp_path):
    batch = read_trees(write(tmp_path, [
        '{"id": 1, "tokens": [1, 2], "tree": null, "loss_mask": null, "advantages": null, '
        '"old_logprobs": null, "ref_logprobs": null, "reward": 1.0, "meta": {"x": [true]}}',
    ]))
    assert_invariants(batch)
    assert batch.trees == (None,) and batch.old_logprobs is None
    np.testing.assert_array_equal(batch.loss_mask, [1, 1])


@pytest.mark.parametrize("extra", [', "reward": NaN', ', "meta": {"score": -Infinity}',
                                   ', "old_logprobs": [NaN, -1, -2], "reward": Infinity'])
def test_nan_or_infinity_in_an_ignored_field_is_ignored(tmp_path, extra):
    # Python's json.dumps writes float('nan') as the literal NaN: a reward kept beside the trajectory must
    # not refuse the step. Fields HARTS reads still refuse one where it would be read (the Bad cases).
    batch = read_trees(write(tmp_path, ['{"id": 1, "tokens": [1, 2, 3]' + extra + '}', GOOD.replace('0', '2', 1)]))
    assert_invariants(batch)
    assert batch.ids == (1, 2) and batch.loss_mask.sum() == 6


def test_nesting_deeper_than_the_reader_goes_is_one_line_or_read(tmp_path):
    # orjson before 3.9 reads any depth; from 3.9 it stops at 1024, and Python's json (the fallback) near
    # 1000. Whichever is installed, the line is read or refused in one line that says why.
    path = write(tmp_path, ['{"id": 1, "x": ' + "[" * 5000 + "]" * 5000 + ', "tokens": [1, 2]}', GOOD])
    try:
        batch = read_trees(path)
    except InputError as err:
        assert str(err) == (f"{path}:1: the line nests arrays or objects deeper than the JSON reader goes (about "
                            "1000 levels); fix: write that field flatter, or leave it out")
    else:
        assert_invariants(batch)
        assert batch.ids == (1, 0)


def test_loss_mask_and_tree(tmp_path):
    batch = read_trees(write(tmp_path, [
        '{"id": 1, "tree": "g0", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1]}',
        '{"id": 2, "tree": 4, "tokens": [1, 2, 4], "loss_mask": [0, 0, 1]}',
        '{"id": 3, "tokens": [9, 9]}',
    ]))
    assert_invariants(batch)
    assert batch.trees == ("g0", 4, None)
    np.testing.assert_array_equal(batch.loss_mask, [0, 1, 1, 0, 0, 1, 1, 1])


def test_string_and_int_ids(tmp_path):
    batch = read_trees(write(tmp_path, ['{"id": 3, "tokens": [1, 2]}', '{"id": "3a", "tokens": [1, 2]}',
                                        '{"id": -4, "tokens": [1, 2]}', '{"id": "", "tokens": [1, 2]}']))
    assert batch.ids == (3, "3a", -4, "")
    assert type(batch.ids[0]) is int and type(batch.ids[1]) is str
    # The whole 64-bit range the plan can store (msgpack: int64 and uint64).
    batch = read_trees(write(tmp_path, [f'{{"id": {2**64 - 1}, "tokens": [1, 2], "tree": {-2**63}}}',
                                        f'{{"id": {-2**63}, "tokens": [1, 2]}}']))
    assert batch.ids == (2**64 - 1, -2**63)


def test_partial_old_logprobs_are_nan_where_absent(tmp_path):
    batch = read_trees(write(tmp_path, [
        '{"id": 1, "tokens": [1, 2, 3], "old_logprobs": [0, -0.5, -1]}',
        '{"id": 2, "tokens": [1, 2]}',
        '{"id": 3, "tokens": [7, 8], "old_logprobs": [0, -3], "ref_logprobs": [0, -2]}',
    ]))
    assert_invariants(batch)
    np.testing.assert_array_equal(batch.has_old_logprobs, [True, False, True])
    np.testing.assert_array_equal(batch.has_ref_logprobs, [False, False, True])
    np.testing.assert_array_equal(batch.old_logprobs, [0, -0.5, -1, np.nan, np.nan, 0, -3])
    np.testing.assert_array_equal(batch.ref_logprobs, [np.nan] * 5 + [0, -2])


@pytest.mark.parametrize("name", ["trees.jsonl", "trees.jsonl.zst"])
def test_logprobs_may_be_missing_where_no_loss_reads_them(tmp_path, name):
    # What `harts run --logprobs-out` writes (NaN at index 0; with --logprobs loss, NaN wherever loss_mask
    # is 0) passes back as old/ref log-probabilities, however the writer spelled NaN: null (orjson), the
    # literal NaN (Python's json), or something else no float32 holds. Stored as 0.0: never read.
    batch = read_trees(write(tmp_path, [
        '{"id": "a", "tokens": [5, 6, 7, 8], "old_logprobs": [NaN, -1, -2, -3], "ref_logprobs": [null, -1, -2, -3]}',
        '{"id": "b", "tokens": [5, 6, 7, 9], "loss_mask": [0, 0, 1, 1], "old_logprobs": [null, -Infinity, -2, -3], '
        '"ref_logprobs": [1e39, NaN, -2.5, -3]}',
        '{"id": "c", "tokens": [1, 2]}',
    ], name))
    assert_invariants(batch)
    np.testing.assert_array_equal(batch.has_old_logprobs, [True, True, False])
    np.testing.assert_array_equal(batch.old_logprobs, [0, -1, -2, -3, 0, 0, -2, -3, np.nan, np.nan])
    np.testing.assert_array_equal(batch.ref_logprobs, [0, -1, -2, -3, 0, 0, -2.5, -3, np.nan, np.nan])


def test_blank_lines_are_skipped_but_counted(tmp_path):
    batch = read_trees(write(tmp_path, "\n  \n" + GOOD + "\n\t\r\n\n" + GOOD.replace("0", "1") + "\n\n"))
    np.testing.assert_array_equal(batch.lines, [3, 6])
    assert batch.ids == (0, 1)


def test_crlf_bom_and_missing_final_newline(tmp_path):
    path = tmp_path / "trees.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n" + GOOD.replace("0", "1").encode())
    batch = read_trees(path)
    assert batch.ids == (0, 1)
    np.testing.assert_array_equal(batch.lines, [1, 2])


def test_true_false_outside_numeric_fields_is_not_mistaken_for_a_bool(tmp_path):
    # The raw line holds "true"/"false", so the exact per-element bool scan runs and must pass.
    batch = read_trees(write(tmp_path, [
        '{"id": "true-false", "tokens": [1, 2], "loss_mask": [0, 1], "advantages": [0, 1], '
        '"old_logprobs": [0, -1], "done": true}']))
    assert_invariants(batch)
    np.testing.assert_array_equal(batch.loss_mask, [0, 1])


@pytest.mark.parametrize("exponents", [0, 3000], ids=["few_e", "many_e"])
def test_long_line_with_true_in_an_ignored_field_is_read(tmp_path, exponents):
    n = 3000
    logprobs = ", ".join(["-1e-05"] * exponents + ["-0.5"] * (n - exponents))
    line = (f'{{"id": 1, "done": true, "tokens": [{", ".join(["12345"] * n)}], '
            f'"loss_mask": [{", ".join(["1"] * n)}], "old_logprobs": [{logprobs}]}}')
    batch = read_trees(write(tmp_path, [line]))
    assert_invariants(batch)
    assert batch.num_tokens == n and batch.has_old_logprobs.all()


def test_limits_are_inclusive_of_the_largest_legal_value(tmp_path):
    batch = read_trees(write(tmp_path, ['{"id": 1, "tokens": [0, 99, 98]}']), vocab_size=100, capacity=3)
    np.testing.assert_array_equal(batch.tokens, [0, 99, 98])
    batch = read_trees(write(tmp_path, [f'{{"id": 1, "tokens": [0, {2**31 - 1}]}}']))
    assert batch.tokens[1] == 2**31 - 1


def test_zst_reads_exactly_like_plain(tmp_path):
    lines = [json.dumps({"id": f"t{i}", "tree": i // 3, "tokens": list(range(i, i + 2 + i % 5)),
                         "loss_mask": [0] + [1] * (1 + i % 5), "advantages": 0.25 * i,
                         **({"old_logprobs": [-0.5] * (2 + i % 5)} if i % 2 else {})})
             for i in range(40)]
    lines.insert(10, "")
    plain = read_trees(write(tmp_path, lines, "trees.jsonl"))
    packed = read_trees(write(tmp_path, lines, "trees.jsonl.zst"))
    assert_same_batch(plain, packed)


def test_concatenated_zstd_frames_read_as_one_stream(tmp_path):
    first, second = [GOOD], ['{"id": 1, "tokens": [4, 5]}']
    path = tmp_path / "trees.jsonl.zst"
    cctx = zstandard.ZstdCompressor()
    path.write_bytes(cctx.compress(b"\n".join(s.encode() for s in first) + b"\n")
                     + cctx.compress(b"\n".join(s.encode() for s in second) + b"\n"))
    batch = read_trees(path)
    assert batch.ids == (0, 1)
    np.testing.assert_array_equal(batch.lines, [1, 2])


def assert_same_batch(a: TrajectoryBatch, b: TrajectoryBatch) -> None:
    assert a.ids == b.ids and a.trees == b.trees
    for name in ("lines", "token_offsets", "tokens", "loss_mask", "advantages", "old_logprobs",
                 "ref_logprobs", "has_old_logprobs", "has_ref_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_split_lines_is_independent_of_chunk_boundaries(chunk):
    data = b'{"a": 1}\n\n{"b": [1, 2, 3]}\r\nlast line without newline'
    chunks = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    assert list(_split_lines(iter(chunks))) == data.splitlines(keepends=True)


records = st.lists(
    st.tuples(st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=30),
              st.floats(-1e6, 1e6, width=32), st.booleans(), st.booleans()),
    min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(records)
def test_every_written_value_is_read_back_exactly(tmp_path_factory, recs):
    """Whatever valid file we write, tokens, masks, advantages and logprobs come back bit-for-bit."""
    lines = []
    for i, (tokens, adv, per_token, with_lp) in enumerate(recs):
        n = len(tokens)
        rec = {"id": i, "tokens": tokens, "loss_mask": [i % 2] * n,
               "advantages": [adv] * n if per_token else adv}
        if with_lp:
            rec["old_logprobs"] = [-float(k) for k in range(n)]
        lines.append(json.dumps(rec))
    batch = read_trees(write(tmp_path_factory.mktemp("rt"), lines))
    assert_invariants(batch)
    expected = TrajectoryBatch.from_token_lists([r[0] for r in recs],
                                                loss_masks=[[i % 2] * len(r[0]) for i, r in enumerate(recs)],
                                                advantages=[r[1] for r in recs])
    np.testing.assert_array_equal(batch.tokens, expected.tokens)
    np.testing.assert_array_equal(batch.token_offsets, expected.token_offsets)
    np.testing.assert_array_equal(batch.loss_mask, expected.loss_mask)
    np.testing.assert_array_equal(batch.advantages, expected.advantages)
    np.testing.assert_array_equal(batch.has_old_logprobs, [r[3] for r in recs])
    if not any(r[3] for r in recs):
        assert batch.old_logprobs is None
        return
    for i, (tokens, _, _, with_lp) in enumerate(recs):
        values = batch.old_logprobs[batch.token_offsets[i]:batch.token_offsets[i + 1]]
        if with_lp:
            np.testing.assert_array_equal(values, -np.arange(len(tokens), dtype=np.float32))
        else:
            assert np.isnan(values).all()


@pytest.mark.parametrize("kwargs", [{"vocab_size": 0}, {"capacity": 1}], ids=["vocab_size_0", "capacity_1"])
def test_nonsensical_limits_are_a_caller_bug(tmp_path, kwargs):
    with pytest.raises(ValueError):
        read_trees(write(tmp_path, [GOOD]), **kwargs)


def test_keys_inside_text_with_escaped_quotes_are_not_keys(tmp_path):
    """A tool output stored beside the tokens may hold quoted JSON; its "keys" are text. (The first key scan
    restarted at every escaped quote: a 112 KB line of them took 51 s to read; benchmarks/bench_read.py.)"""
    text = json.dumps({"tool": '\\"tokens\\": [9], ' * 500 + '{"tokens": [7], "id": 3}' * 200})
    line = '{"id": 1, "tokens": [1, 2, 3], "log": ' + text + ', "more": {"tokens": 0, "id": [{"id": 1}]}}'
    batch = read_trees(write(tmp_path, [line]))
    assert batch.ids == (1,)
    np.testing.assert_array_equal(batch.tokens, [1, 2, 3])


def test_field_names_elsewhere_in_a_line_are_not_repeats(tmp_path):
    """A nested object of an ignored field may use the same names, and a value may spell one."""
    line = '{"id": 1, "tokens": [1, 2, 3], "meta": {"tokens": 5, "id": "x", "meta": {"tokens": 1}}, "tree": "tokens"}'
    batch = read_trees(write(tmp_path, [line]))
    assert batch.ids == (1,) and batch.trees == ("tokens",)
    np.testing.assert_array_equal(batch.tokens, [1, 2, 3])
