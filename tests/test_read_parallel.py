"""`read_trees(..., workers=N)`: parsing in worker processes reads exactly what one process reads.

Run: `python -m pytest tests/test_read_parallel.py -q`.

Why: `hartsc` parses a paper-scale step in forked processes (`--read-workers`), and nothing downstream may
tell: every array of the batch must be bit-identical to `workers=1`'s, and bad input must give the same
single first error (by line) with the same text, also when the lines involved sit in different chunks.
`_CHUNK_BYTES` is shrunk so that chunk boundaries fall between lines; every test also checks that no worker
process outlives the read.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest
import zstandard

import harts.compiler.read_trees as read_trees_module
from harts.compiler.cli import main as hartsc_main
from harts.tools.check import main as check_main
from harts.workers import AUTO_MIN_BYTES, auto_workers
from harts.compiler.read_trees import read_trees
from harts.schema.errors import HartsError, InputError, UsageError
from test_read_trees import BAD, GOOD, assert_invariants, assert_same_batch, write


@pytest.fixture(autouse=True)
def no_worker_outlives_the_test():
    yield
    assert multiprocessing.active_children() == []


@pytest.fixture
def one_line_chunks(monkeypatch):
    """Every chunk holds one line: any two lines are in different chunks."""
    monkeypatch.setattr(read_trees_module, "_CHUNK_BYTES", 1)


@pytest.fixture(params=[1, 30, 1 << 22], ids=["one_line_chunks", "two_line_chunks", "one_chunk"])
def chunk_bytes(request, monkeypatch):
    """Chunks of one line, of about two short lines, and the default size (one chunk for a test's file):
    an error's line and the lines before it in the same chunk or in different ones."""
    monkeypatch.setattr(read_trees_module, "_CHUNK_BYTES", request.param)


def read_both(path, workers: int = 2, **kwargs):
    """(workers=1's batch, workers=N's batch), after checking they are the same batch."""
    serial = read_trees(path, workers=1, **kwargs)
    parallel = read_trees(path, workers=workers, **kwargs)
    assert_same_batch(serial, parallel)
    assert parallel.source == serial.source
    assert_invariants(parallel)
    return serial, parallel


def same_error(path, workers: int = 2, **kwargs) -> InputError:
    """workers=N's error is workers=1's, field for field and word for word; returns it."""
    with pytest.raises(InputError) as serial:
        read_trees(path, workers=1, **kwargs)
    with pytest.raises(InputError) as parallel:
        read_trees(path, workers=workers, **kwargs)
    a, b = serial.value, parallel.value
    assert str(b) == str(a)
    assert (b.path, b.line, b.field, b.problem, b.fix) == (a.path, a.line, a.field, a.problem, a.fix)
    return b


# --- good input --------------------------------------------------------------------------------

# The shapes test_read_trees.py's good-input tests read: optional fields, nulls, NaN where no loss reads it,
# blank lines, CRLF, a byte-order mark, string and int ids, long lines on both bool-scan paths.
GOOD_FILES = {
    "defaults": ['{"id": "a", "tokens": [5, 6, 7]}', '{"id": "b", "tokens": [5, 8]}'],
    "advantages": ['{"id": 1, "tokens": [1, 2, 3], "advantages": 0.5}',
                   '{"id": 2, "tokens": [1, 2], "advantages": [0, -1.25]}',
                   '{"id": 3, "tokens": [4, 5], "advantages": -2}'],
    "nulls_and_ignored": ['{"id": 1, "tokens": [1, 2], "tree": null, "loss_mask": null, "advantages": null, '
                          '"old_logprobs": null, "ref_logprobs": null, "reward": NaN, "meta": {"x": [true]}}', GOOD],
    "mask_and_tree": ['{"id": 1, "tree": "g0", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1]}',
                      '{"id": 2, "tree": 4, "tokens": [1, 2, 4], "loss_mask": [0, 0, 1]}',
                      '{"id": 3, "tokens": [9, 9]}'],
    "ids": [f'{{"id": {2**64 - 1}, "tokens": [1, 2], "tree": {-2**63}}}', '{"id": "3a", "tokens": [1, 2]}',
            '{"id": -4, "tokens": [1, 2]}', '{"id": "", "tokens": [1, 2]}',
            '{"id": "\\ud83d\\ude00", "tokens": [3, 4]}'],
    "partial_logprobs": ['{"id": 1, "tokens": [1, 2, 3], "old_logprobs": [0, -0.5, -1]}', '{"id": 2, "tokens": [1, 2]}',
                         '{"id": 3, "tokens": [7, 8], "old_logprobs": [0, -3], "ref_logprobs": [0, -2]}'],
    "logprobs_unread": ['{"id": "a", "tokens": [5, 6, 7, 8], "old_logprobs": [NaN, -1, -2, -3], '
                        '"ref_logprobs": [null, -1, -2, -3]}',
                        '{"id": "b", "tokens": [5, 6, 7, 9], "loss_mask": [0, 0, 1, 1], '
                        '"old_logprobs": [null, -Infinity, -2, -3], "ref_logprobs": [1e39, NaN, -2.5, -3]}',
                        '{"id": "c", "tokens": [1, 2]}'],
    "blank_lines": "\n  \n" + GOOD + "\n\t\r\n\n" + GOOD.replace("0", "1") + "\n\n",
    "bom_crlf_no_final_newline": "\ufeff" + GOOD + "\r\n" + GOOD.replace("0", "1"),
    "long_lines": ['{"id": 1, "done": true, "tokens": [' + ", ".join(["12345"] * 3000) + '], "loss_mask": ['
                   + ", ".join(["1"] * 3000) + '], "old_logprobs": [' + ", ".join(["-1e-05"] * 3000) + "]}",
                   '{"id": 2, "tokens": [' + ", ".join(["7"] * 3000) + "]}"],
}


@pytest.mark.parametrize("name", ["trees.jsonl", "trees.jsonl.zst"])
@pytest.mark.parametrize("case", GOOD_FILES, ids=list(GOOD_FILES))
def test_good_files_read_the_same(tmp_path, one_line_chunks, case, name):
    read_both(write(tmp_path, GOOD_FILES[case], name))


def many_lines(count: int, seed: int = 0) -> list[str]:
    """`count` valid lines of every shape, of varied lengths, with blank lines among them."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(count):
        n = int(rng.integers(2, 400))
        record = {"id": f"t{i}" if i % 3 else i, "tree": i // 4, "tokens": rng.integers(0, 50_000, n).tolist()}
        if i % 2:
            record["loss_mask"] = [0] * (n // 3) + [1] * (n - n // 3)
        record["advantages"] = rng.normal(size=n).astype(np.float32).tolist() if i % 5 == 0 else float(i) / 8
        if i % 3 == 0:
            record["old_logprobs"] = (-rng.exponential(size=n)).astype(np.float32).tolist()
        if i % 7 == 0:
            record["ref_logprobs"] = (-rng.exponential(size=n)).astype(np.float32).tolist()
        lines.append(json.dumps(record))
        if i % 11 == 0:
            lines.append("   ")
    return lines


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("name", ["trees.jsonl", "trees.jsonl.zst"])
def test_a_many_chunk_file_reads_the_same_with_bounded_read_ahead(tmp_path, monkeypatch, name, workers):
    """300 one-line chunks, then chunks of a few lines: the batch of one process; and the main process never
    has more than 2 x workers chunks handed out and not yet consumed (a reader that ran ahead, as Pool.imap's
    feeder thread does, would hold the whole file)."""
    path = write(tmp_path, many_lines(300), name)
    serial = read_trees(path)
    handed_out, consumed, ahead = [0], [0], []
    real_chunks, real_check = read_trees_module._chunks, read_trees_module._check_unique_id

    def counted_chunks(*args):
        for chunk in real_chunks(*args):
            handed_out[0] += 1
            ahead.append(handed_out[0] - consumed[0])
            yield chunk

    def counted_check(first_line_of, record, where):
        real_check(first_line_of, record, where)
        consumed[0] += 1   # one line per chunk: a record checked is a chunk consumed
    monkeypatch.setattr(read_trees_module, "_chunks", counted_chunks)
    monkeypatch.setattr(read_trees_module, "_check_unique_id", counted_check)
    monkeypatch.setattr(read_trees_module, "_CHUNK_BYTES", 1)
    assert_same_batch(serial, read_trees(path, workers=workers))
    assert handed_out[0] == serial.num_trajectories == 300
    assert max(ahead) == 2 * workers
    monkeypatch.setattr(read_trees_module, "_CHUNK_BYTES", 4000)
    assert_same_batch(serial, read_trees(path, workers=workers))


def test_default_chunks_read_the_same(tmp_path):
    read_both(write(tmp_path, many_lines(60)))


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", BAD, ids=[c.name for c in BAD])
def test_every_bad_line_is_the_same_error(tmp_path, one_line_chunks, case):
    same_error(write(tmp_path, case.lines), **case.kwargs)


CROSS_CHUNK = {
    # The first occurrence is several chunks before the second.
    "duplicate_of_an_earlier_chunk": (['{"id": "a", "tokens": [1, 2]}', GOOD, "", '{"id": 1, "tokens": [1, 2]}',
                                       '{"id": 2, "tokens": [1, 2]}', '{"id": "a", "tokens": [3, 4]}'],
                                      6, "duplicate id 'a', first used on line 1"),
    "int_and_string_ids_collide_across_chunks": (['{"id": 7, "tokens": [1, 2]}', GOOD, '{"id": "7", "tokens": [3, 4]}'],
                                                 3, "the same string '7'"),
    # A later chunk's bad line must not win over an earlier chunk's duplicate (the later chunk may be parsed
    # first), nor a later duplicate over an earlier bad line.
    "duplicate_before_a_bad_line": (['{"id": "a", "tokens": [1, 2]}', '{"id": "a", "tokens": [1, 2]}', GOOD,
                                     '{"id": 1, "tokens": [1, 2'], 2, "duplicate id 'a'"),
    "bad_line_before_a_duplicate": ([GOOD, '{"id": 1, "tokens": [1, -2]}', '{"id": 0, "tokens": [1, 2]}'], 2,
                                    "negative"),
    "bad_line_after_many_good_chunks": ([f'{{"id": {i}, "tokens": [1, 2]}}' for i in range(40)]
                                        + ['{"id": 40, "tokens": [1, 2], "tokens": [3]}'], 41, "appears 2 times"),
}


@pytest.mark.parametrize("name", ["trees.jsonl", "trees.jsonl.zst"])
@pytest.mark.parametrize("case", CROSS_CHUNK, ids=list(CROSS_CHUNK))
def test_the_first_error_wins_within_and_across_chunks(tmp_path, chunk_bytes, case, name):
    lines, line, says = CROSS_CHUNK[case]
    err = same_error(write(tmp_path, lines, name))
    assert err.line == line and says in str(err)


@pytest.mark.parametrize("text", ["", "\n", "  \n\t\n"], ids=["zero_bytes", "one_newline", "whitespace"])
@pytest.mark.parametrize("name", ["trees.jsonl", "trees.jsonl.zst"])
def test_a_file_without_trajectories_is_the_same_error(tmp_path, text, name):
    assert "no trajectories" in str(same_error(write(tmp_path, text, name)))


def test_a_missing_file_is_the_same_error(tmp_path):
    assert "cannot read" in str(same_error(tmp_path / "absent.jsonl"))


def corrupted_zst(tmp_path, where: float):
    """A checksummed zstd file of 3000 lines with one byte flipped at `where` of its length."""
    lines = [f'{{"id": {i}, "tokens": [{i}, {2 * i}, 3]}}' for i in range(3000)]
    path = tmp_path / "trees.jsonl.zst"
    data = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress("\n".join(lines).encode()))
    data[int(len(data) * where)] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_a_corrupted_zstd_stream_is_the_same_error(tmp_path, chunk_bytes, where):
    # Lines decompressed from the damage may be garbage that reaches a worker before the checksum fails:
    # the stream's error must still be the one reported.
    assert "corrupted zstd" in str(same_error(corrupted_zst(tmp_path, where)))


def test_a_truncated_zstd_stream_is_the_same_error(tmp_path, one_line_chunks):
    path = write(tmp_path, [GOOD.replace("0", str(i)) for i in range(50)], "trees.jsonl.zst")
    path.write_bytes(path.read_bytes()[:-4])
    assert "truncated" in str(same_error(path))


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "zstd"])
@pytest.mark.parametrize("bad_line", [None, 2, 5])
def test_a_read_failure_after_a_bad_line(tmp_path, monkeypatch, chunk_bytes, compressed, bad_line):
    """A stream that fails after 6 lines: a bad line before the failure wins on a plain file (it comes first),
    the stream's failure on a compressed one (the garbage may be its doing), as with one process."""
    lines = [GOOD.replace("0", str(i)).encode() + b"\n" for i in range(6)]
    if bad_line is not None:
        lines[bad_line - 1] = b'{"id": "x", "tokens": [1]}\n'
    failure = InputError("trees.jsonl", None, None, "cannot read the file (Input/output error)", "check the disk")

    def failing_lines(source):
        def numbered():
            yield from enumerate(lines, start=1)
            raise failure
        return compressed, numbered()
    monkeypatch.setattr(read_trees_module, "open_lines", failing_lines)
    err = same_error(tmp_path / "trees.jsonl")
    expected = failure if compressed or bad_line is None else None
    if expected is not None:
        assert str(err) == str(failure)
    else:
        assert err.line == bad_line and "at least 2" in str(err)


def test_bad_limits_and_workers_are_caller_errors(tmp_path):
    path = write(tmp_path, [GOOD])
    for kwargs in ({"vocab_size": 0}, {"capacity": 1}, {"workers": 0}, {"workers": True}, {"workers": 1.5},
                   {"workers": "2"}):
        with pytest.raises(UsageError):
            read_trees(path, **({"workers": 2} | kwargs))


def test_limits_are_the_same_error(tmp_path, one_line_chunks):
    path = write(tmp_path, [GOOD, '{"id": 1, "tokens": [1, 2, 3, 4]}', '{"id": 2, "tokens": [1, 200]}'])
    assert same_error(path, capacity=3).line == 2
    assert same_error(path, vocab_size=100).line == 3


def test_input_error_pickles_with_every_field():
    err = InputError("a.jsonl", 7, "tokens", "tokens[1] = -1 is negative", "token ids are >= 0")
    err.add_note("a note")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is InputError and str(back) == str(err) and back.__notes__ == ["a note"]
    assert (back.path, back.line, back.field, back.problem, back.fix) == (err.path, 7, "tokens", err.problem, err.fix)
    back = pickle.loads(pickle.dumps(InputError("a.jsonl", None, None, "empty", "write lines")))
    assert back.line is None and back.field is None and str(back) == "a.jsonl: empty; fix: write lines"


# --- failures that are not the input's ---------------------------------------------------------------

def failing_on_line(monkeypatch, line: int, action) -> None:
    """Workers (forked after this) run `action()` instead of parsing `line`."""
    real = read_trees_module._parse_line

    def parse(raw, where):
        if where.line == line:
            action()
        return real(raw, where)
    monkeypatch.setattr(read_trees_module, "_parse_line", parse)


def test_a_worker_bug_propagates(tmp_path, monkeypatch, one_line_chunks):
    def bug():
        raise ZeroDivisionError("a bug in the parser")
    failing_on_line(monkeypatch, 5, bug)
    with pytest.raises(ZeroDivisionError, match="a bug in the parser"):
        read_trees(write(tmp_path, many_lines(20)), workers=2)


def test_a_dead_worker_is_an_error_not_a_hang(tmp_path, monkeypatch, one_line_chunks):
    failing_on_line(monkeypatch, 5, lambda: os._exit(9))
    path = write(tmp_path, many_lines(20))
    outcome = {}

    def read():
        try:
            read_trees(path, workers=2)
        except BaseException as err:   # reported below
            outcome["error"] = err
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "read_trees waits forever for a dead worker's chunk"
    error = outcome.get("error")
    assert type(error) is HartsError and "a parse worker process died" in str(error) and "\n" not in str(error)
    assert isinstance(error.__context__, BrokenProcessPool) and "--read-workers 1" in str(error)


def test_ctrl_c_reaches_the_main_process_only(tmp_path, monkeypatch, one_line_chunks):
    """A terminal sends Ctrl-C to every process of the group: workers leave it to the main process."""
    path = write(tmp_path, many_lines(10))
    serial = read_trees(path)
    failing_on_line(monkeypatch, 3, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        parallel = read_trees(path, workers=2)
    except KeyboardInterrupt:
        pytest.fail("a worker raised the Ctrl-C it got, and it stopped the read")
    assert_same_batch(serial, parallel)


WAITING_WORKERS = """
import os, sys, time
import harts.compiler.read_trees as module

def parse(line, where):
    os.write(1, b"%d\\n" % os.getpid())   # one write: a pipe keeps it whole, where print's could interleave
    time.sleep(60)
module._parse_line = parse
module._CHUNK_BYTES = 1   # a chunk for each worker
module.read_trees(sys.argv[1], workers=2)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_workers_die_with_a_killed_main_process(tmp_path):
    """SIGKILL gives the main process no chance to stop its workers: the kernel must, or they would wait for
    their next chunk forever."""
    script = tmp_path / "waiting.py"
    script.write_text(WAITING_WORKERS)
    main = subprocess.Popen([sys.executable, str(script), str(write(tmp_path, many_lines(10)))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        lines = [main.stdout.readline() for _ in range(2)]   # both workers are parsing (sleeping on) a line
        if not all(line.strip().isdigit() for line in lines):
            main.kill()   # its stderr ends only when it does
            pytest.fail(f"the workers did not say who they are: {lines}, main's stderr: {main.stderr.read()}")
        workers = [int(line) for line in lines]
        main.kill()
        main.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        states = {pid: _state(pid) for pid in workers}
        assert not any(_alive(pid) for pid in workers), f"a worker outlived its killed main process: {states}"
    finally:
        main.kill()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: the killed main process's children are reaped by init)."""
    return _state(pid) not in ("Z", "gone")


def _state(pid: int) -> str:
    """The process's state letter in /proc (R, S, Z, ...), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_an_interrupt_stops_every_worker(tmp_path, monkeypatch, one_line_chunks):
    real = read_trees_module._check_unique_id

    def interrupted(first_line_of, record, where):
        if where.line > 3:
            raise KeyboardInterrupt
        real(first_line_of, record, where)
    monkeypatch.setattr(read_trees_module, "_check_unique_id", interrupted)
    with pytest.raises(KeyboardInterrupt):
        read_trees(write(tmp_path, many_lines(40)), workers=2)
    # no_worker_outlives_the_test checks that the pool is gone.


# --- hartsc and harts check ------------------------------------------------------------------------

def _forty_trees(tmp_path, tail: int = 0):
    """Forty trajectories in ten trees (tail shifts every trajectory's last token)."""
    records = [{"id": f"t{k}", "tree": k // 4, "advantages": k / 10,
                "tokens": list(range(1, 60)) + [100 + 7 * k + j + tail for j in range(k % 9 + 2)]} for k in range(40)]
    trees = tmp_path / f"trees{tail}.jsonl"
    trees.write_text("".join(json.dumps(r) + "\n" for r in records))
    return trees


@pytest.fixture
def asked_workers(monkeypatch):
    """The `workers` each read_trees call is given (small chunks, so two workers both parse)."""
    monkeypatch.setattr(read_trees_module, "_CHUNK_BYTES", 2000)
    real, asked = read_trees_module.read_trees, []

    def spy(*args, **kwargs):
        asked.append(kwargs.get("workers"))
        return real(*args, **kwargs)
    monkeypatch.setattr(read_trees_module, "read_trees", spy)
    return asked


def test_hartsc_writes_the_same_plan_with_read_workers(tmp_path, asked_workers):
    trees = _forty_trees(tmp_path)
    plans = []
    for workers in ("1", "2"):
        plan = tmp_path / f"w{workers}.plan"
        assert hartsc_main([str(trees), "-o", str(plan), "--dp", "2", "--capacity", "256", "--chunk-size", "8",
                            "--read-workers", workers]) == 0
        plans.append(plan.read_bytes())
    assert asked_workers == [1, 2] and plans[0] == plans[1]


def test_harts_check_reads_trees_with_read_workers(tmp_path, capsys, asked_workers):
    """The same verdicts for any --read-workers: a plan matches its own trees and not another step's."""
    trees, other = _forty_trees(tmp_path), _forty_trees(tmp_path, tail=3)
    plan = tmp_path / "step.plan"
    assert hartsc_main([str(trees), "-o", str(plan), "--dp", "2", "--capacity", "256", "--read-workers", "1"]) == 0
    asked_workers.clear()
    capsys.readouterr()
    verdicts = []
    for workers in ("1", "2"):
        assert check_main([str(plan), "--trees", str(trees), "--read-workers", workers]) == 0
        assert check_main([str(plan), "--trees", str(other), "--read-workers", workers]) == 1
        out, err = capsys.readouterr()
        verdicts.append((out, err))
    assert asked_workers == [1, 1, 2, 2] and verdicts[0] == verdicts[1]
    assert ": ok (" in verdicts[0][0] and "token" in verdicts[0][1] and "fix:" in verdicts[0][1]


def test_harts_check_says_read_workers_needs_trees(tmp_path, capsys):
    plan = tmp_path / "step.plan"
    assert hartsc_main([str(_forty_trees(tmp_path)), "-o", str(plan), "--dp", "2", "--capacity", "256"]) == 0
    capsys.readouterr()
    assert check_main([str(plan), "--read-workers", "2"]) == 0
    assert capsys.readouterr().err == "harts check: warning: --read-workers has no effect without --trees\n"
    assert check_main([str(plan)]) == 0 and capsys.readouterr().err == ""
    assert check_main([str(plan), "--read-workers", "0"]) == 2   # still refused: the value is wrong either way


@pytest.mark.parametrize("value, says", [("0", "must be >= 1, got 0"), ("-3", "must be >= 1"),
                                         ("two", "must be an integer or auto, got 'two'"), ("1000", "must be <= 256")])
@pytest.mark.parametrize("command", ["hartsc", "harts check"])
def test_a_bad_read_workers_is_refused_in_one_line(tmp_path, capsys, value, says, command):
    trees = write(tmp_path, [GOOD])
    if command == "hartsc":
        assert hartsc_main([str(trees), "-o", str(tmp_path / "p.plan"), "--read-workers", value]) == 2
    else:   # refused before the plan, absent here, is read
        assert check_main([str(tmp_path / "absent.plan"), "--trees", str(trees), "--read-workers", value]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"{command}: ") and f"--read-workers {says}" in err and "fix:" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trees.jsonl"]


def test_auto_workers(tmp_path):
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    small = write(tmp_path, [GOOD])
    large = tmp_path / "large.jsonl"
    with open(large, "wb") as f:
        f.truncate(AUTO_MIN_BYTES)   # sparse: no disk written
    assert auto_workers(small) == 1 and auto_workers(tmp_path / "absent.jsonl") == 1 and auto_workers(tmp_path) == 1
    assert auto_workers(large) == min(cpus, 8)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe")
        assert auto_workers(tmp_path / "pipe") == min(cpus, 8)   # a pipe's size is unknown: taken as large
