"""Bad input of every kind gets one line and exit status 2, never a traceback, and writes nothing.

Run: `python -m pytest tests/test_bad_input.py -q`. Covers `hartsc`'s output
paths and numeric flags (checked before the input is read), strings and
bytes the reader must refuse (lone surrogates, non-UTF-8 lines, floats beyond
float32 without numpy's warnings), and plans that pass their checksum but are
damaged inside: every tool (`stats`, `check`, `diff`, `viz`) names the
record and field in one line. Damaged plans are made with the project's own
`decode_plan` / `encode_plan`, so only the structure is wrong.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import harts.compiler.read_trees as read_trees_module
from harts.api import compile_trajectories
from harts.cli import main as harts_main
from harts.compiler.cli import main as hartsc_main
from harts.schema.timing import timing_path
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.compiler.read_trees import read_trees
from harts.schema.errors import HartsError, InputError, PassFailedError, PlanFormatError
from harts.schema.plan import decode_plan, encode_plan, read_plan

# Six trajectories sharing a 40-token prefix, one per microbatch at capacity 70:
# with --levels l1+l2 and --dp 2 the plan has producers and residual calls.
PREFIX = list(range(1, 41))
TREES = [{"id": f"t{k}", "tokens": PREFIX + [100 + 20 * k + j for j in range(20)], "tree": "a"} for k in range(6)]
COMPILE_FLAGS = ["--dp", "2", "--capacity", "70", "--chunk-size", "8"]


def write_lines(path, lines: list[bytes]):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def write_trees(path, records=TREES):
    return write_lines(path, [json.dumps(r).encode() for r in records])


def one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(prefix) and "fix:" in err and "Traceback" not in err, err
    return err


@pytest.fixture
def unread(monkeypatch):
    """Fails the test if hartsc reads its input: these errors must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("hartsc read the input before checking its flags and output")
    monkeypatch.setattr(read_trees_module, "read_trees", refuse)


# --- hartsc: output paths -------------------------------------------------------------------------

@pytest.mark.parametrize("case, words", [
    ("folder", "names a folder"),
    ("under-a-file", "is a file, not a folder"),
    ("empty", "output path is empty"),
    ("trailing-slash", "names a folder"),
    ("the-input", "also an input"),
    ("sidecar-is-a-folder", "names a folder"),
    ("sidecar-name-too-long", "plan.timing.json: its file name is 245 bytes"),
])
def test_bad_output_path_is_one_line_before_reading(tmp_path, capsys, unread, case, words):
    trees = write_trees(tmp_path / "trees.jsonl")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("keep")
    output = {"folder": tmp_path / "adir", "under-a-file": tmp_path / "afile" / "x.plan", "empty": "",
              "trailing-slash": f"{tmp_path / 'newdir'}/", "the-input": trees,
              "sidecar-is-a-folder": tmp_path / "p.plan",
              # The plan's name fits; the timing record's beside it, 12 bytes longer, does not.
              "sidecar-name-too-long": tmp_path / ("p" * 228 + ".plan")}[case]
    if case == "sidecar-is-a-folder":
        timing_path(output).mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    assert hartsc_main([str(trees), "-o", str(output)]) == 2
    line = one_line(capsys, "hartsc: cannot write")
    assert words in line
    if case == "sidecar-is-a-folder":   # not "give a file name": the user cannot choose the sidecar's
        assert "fix: move it away: hartsc writes the plan's timing record there" in line
    if case == "sidecar-name-too-long":   # found by a review: nothing is there to move away
        assert "fix: shorten the plan's file name: hartsc writes its timing record beside it under a name 12 " \
               "bytes longer" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert trees.read_bytes() == write_trees(tmp_path / "again.jsonl").read_bytes()
    assert (tmp_path / "afile").read_text() == "keep"


@pytest.mark.parametrize("kind", ["named pipe", "character device"])
def test_a_special_file_as_output_is_refused_and_kept(tmp_path, capsys, unread, kind):
    """The rename that makes an output appear would replace the node itself (as root, `-o /dev/null`
    turned the null device into a plain file); it is refused and left as it was."""
    trees = write_trees(tmp_path / "trees.jsonl")
    node = tmp_path / "node"
    if kind == "named pipe":
        os.mkfifo(node)
    else:
        try:
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))   # a second null device
        except PermissionError:
            pytest.skip("creating a device node needs root")
    assert hartsc_main([str(trees), "-o", str(node)]) == 2
    assert f"it is a {kind}, not a regular file" in one_line(capsys, "hartsc: cannot write")
    assert (stat.S_ISFIFO if kind == "named pipe" else stat.S_ISCHR)(node.lstat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node", "trees.jsonl"]


def test_a_symlinked_output_is_written_through(tmp_path, capsys):
    """The link stays and its target gets the plan; the sidecar sits beside the name given, where
    `harts stats` looks for it."""
    trees = write_trees(tmp_path / "trees.jsonl")
    (tmp_path / "plans").mkdir()
    link = tmp_path / "link.plan"
    link.symlink_to(tmp_path / "plans" / "real.plan")
    assert hartsc_main([str(trees), "-o", str(link), *COMPILE_FLAGS]) == 0
    assert link.is_symlink() and (tmp_path / "plans" / "real.plan").is_file()
    assert timing_path(link).is_file() and not timing_path(tmp_path / "plans" / "real.plan").exists()
    assert len(read_plan(link).microbatches) == 6


@pytest.mark.parametrize("front", ["hartsc", "harts gen"])
def test_ctrl_c_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, front):
    """An interrupt while writing: exit 130, one line instead of a traceback, no file or temporary left."""
    import harts.schema.atomic as atomic

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    trees = write_trees(tmp_path / "trees.jsonl")
    monkeypatch.setattr(atomic.os, "replace", interrupted)
    if front == "hartsc":
        assert hartsc_main([str(trees), "-o", str(tmp_path / "p.plan"), *COMPILE_FLAGS]) == 130
    else:
        assert harts_main(["gen", "-o", str(tmp_path / "gen.jsonl")]) == 130
    err = capsys.readouterr().err
    assert err == f"{front}: interrupted; no output is left half-written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trees.jsonl"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, signum):
    """Found by a CLI audit: SIGTERM (what `kill`, `timeout` and schedulers send) killed the process before the
    temporary file beside the target was removed. Now it is handled as Ctrl-C is, with exit 128 + signum, and
    the handlers in place before the command are back after it."""
    import harts.schema.atomic as atomic

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signum)
    trees = write_trees(tmp_path / "trees.jsonl")
    before = signal.getsignal(signum)
    monkeypatch.setattr(atomic.os, "replace", signalled)
    assert hartsc_main([str(trees), "-o", str(tmp_path / "p.plan"), *COMPILE_FLAGS]) == 128 + signum
    assert capsys.readouterr().err == f"hartsc: {signal.Signals(signum).name}: interrupted; no output is left half-written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trees.jsonl"]
    assert signal.getsignal(signum) is before


def test_sigterm_while_a_paper_step_is_written_leaves_nothing(tmp_path):
    """The audit's case, end to end: `harts gen` killed with SIGTERM while its temporary file is being written."""
    out = tmp_path / "step.jsonl.zst"
    proc = subprocess.Popen([sys.executable, "-m", "harts.cli", "gen", "--preset", "paper", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
        assert proc.poll() is None, "the step was written before a temporary file was seen"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines() == ["harts gen: SIGTERM: interrupted; no output is left half-written"]
    assert list(tmp_path.iterdir()) == []


def test_under_torchrun_a_stop_signal_keeps_its_default_action(tmp_path, monkeypatch):
    """A rank blocked in a collective would run a Python handler only when the wait ends; torchrun's agent
    stops ranks with SIGTERM, so with WORLD_SIZE > 1 the front ends leave the handlers alone."""
    from harts.console import run_command
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = []
    assert run_command("harts x", lambda argv: seen.append(signal.getsignal(signal.SIGTERM)) or 0, []) == 0
    assert seen == [signal.getsignal(signal.SIGTERM)]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert run_command("harts x", lambda argv: seen.append(signal.getsignal(signal.SIGTERM)) or 0, []) == 0
    assert seen[1] is not signal.getsignal(signal.SIGTERM)


def test_a_sidecar_linked_to_the_plan_is_refused(tmp_path, capsys, unread):
    """Found by a regression audit: with PLAN.timing.json a link to PLAN, the timing record was written over
    the plan (outputs are written through links)."""
    trees = write_trees(tmp_path / "trees.jsonl")
    timing_path(tmp_path / "p.plan").symlink_to("p.plan")
    assert hartsc_main([str(trees), "-o", str(tmp_path / "p.plan")]) == 2
    assert "it leads to the plan file itself" in one_line(capsys, "hartsc: cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.plan.timing.json", "trees.jsonl"]


def test_plan_and_sidecar_are_written_all_or_none(tmp_path, capsys, monkeypatch):
    """A sidecar that cannot be written at write time leaves no plan behind (and no traceback)."""
    import harts.compiler.cli as cli
    trees = write_trees(tmp_path / "trees.jsonl")
    plan = tmp_path / "p.plan"
    timing_path(plan).mkdir()
    # Skip the up-front check, as if the folder appeared while compiling.
    monkeypatch.setattr(cli, "check_output_path", lambda path, inputs=(): plan.__class__(path))
    assert hartsc_main([str(trees), "-o", str(plan)]) == 2
    assert "cannot write" in one_line(capsys, "hartsc: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.plan.timing.json", "trees.jsonl"]
    assert not list(timing_path(plan).iterdir())


# --- hartsc: numeric flags ------------------------------------------------------------------------

HUGE = str(10**20)


@pytest.mark.parametrize("flag, value", [
    ("--capacity", "0"), ("--capacity", "1"), ("--capacity", "-5"), ("--capacity", HUGE),
    ("--vocab-size", "0"), ("--vocab-size", "-1"), ("--vocab-size", HUGE),
    ("--chunk-size", "0"), ("--chunk-size", HUGE),
    ("--seed", "-1"), ("--seed", HUGE), ("--seed", str(2**63)),
    ("--dp", "0"), ("--dp", HUGE),
    ("--pairs-per-token", HUGE), ("--max-window-slots", HUGE),
    ("--ffd-time-budget", "-1"), ("--ffd-time-budget", "nan"), ("--ffd-time-budget", "inf"),
    ("--read-workers", "0"), ("--read-workers", "x"), ("--read-workers", HUGE),
])
def test_bad_number_is_one_line_naming_the_flag_before_reading(tmp_path, capsys, unread, flag, value):
    trees = write_trees(tmp_path / "trees.jsonl")
    assert hartsc_main([str(trees), "-o", str(tmp_path / "p.plan"), flag, value]) == 2
    assert flag in one_line(capsys, "hartsc: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trees.jsonl"]


def test_largest_seed_compiles_and_reads_back(tmp_path):
    trees = write_trees(tmp_path / "trees.jsonl")
    plan = tmp_path / "p.plan"
    assert hartsc_main([str(trees), "-o", str(plan), "--seed", str(2**63 - 1)]) == 0
    assert read_plan(plan).flags["seed"] == 2**63 - 1


@pytest.mark.parametrize("options", [dict(capacity=10**20), dict(chunk_size=10**20), dict(vocab_size=0),
                                     dict(pairs_per_token=10**20), dict(dp=0)])
def test_python_api_refuses_bad_options_with_a_fix(options):
    tokens = [t["tokens"] for t in TREES]
    with pytest.raises((ValueError, HartsError)) as info:
        compile_trajectories(tokens, **options)
    assert "fix" in str(info.value)


def test_compile_options_refuse_a_seed_the_plan_cannot_store():
    batch = TrajectoryBatch.from_token_lists([t["tokens"] for t in TREES])
    with pytest.raises(PassFailedError, match="--seed"):
        compile_batch(batch, CompileOptions(seed=2**64))
    with pytest.raises(PassFailedError, match="--capacity must be an integer"):
        compile_batch(batch, CompileOptions(capacity=70.5))


# --- the reader: strings and bytes ----------------------------------------------------------------

@pytest.mark.parametrize("line, field, words", [
    (rb'{"id": "\ud800", "tokens": [1, 2, 3]}', "id", "lone surrogate"),
    (rb'{"id": 1, "tree": "\udfff", "tokens": [1, 2, 3]}', "tree", "lone surrogate"),
    (rb'{"id": "a\udc00b", "tokens": [1, 2, 3]}', "id", "lone surrogate"),
    (b'\xff\xfe{"id": 2, "tokens": [1, 2]}', None, "not valid UTF-8 (byte 1 "),
    (b'{"id": "a\xff\xfeb", "tokens": [1, 2]}', None, "not valid UTF-8 (byte 10 "),
    (b'{"id": "a\xed\xa0\x80b", "tokens": [1, 2]}', None, "not valid UTF-8"),   # a surrogate, UTF-8 encoded
])
def test_strings_a_plan_cannot_hold_are_refused_on_their_line(tmp_path, capsys, line, field, words):
    trees = write_lines(tmp_path / "trees.jsonl", [b'{"id": 0, "tokens": [1, 2, 3]}', line])
    with pytest.raises(InputError) as info:
        read_trees(trees)
    assert info.value.line == 2 and info.value.field == field and words in str(info.value)
    assert hartsc_main([str(trees), "-o", str(tmp_path / "p.plan")]) == 2
    assert "trees.jsonl:2: " in one_line(capsys, "hartsc: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trees.jsonl"]


def test_surrogates_that_never_reach_the_plan_are_fine(tmp_path):
    trees = write_lines(tmp_path / "trees.jsonl", [rb'{"id": "\ud83d\ude00", "tokens": [1, 2, 3]}',
                                                  rb'{"id": 2, "tokens": [1, 2], "note": "\ud800"}'])
    assert read_trees(trees).ids == ("\U0001f600", 2)


@pytest.mark.parametrize("field, values", [("ref_logprobs", "[0, 1e39, 0]"), ("old_logprobs", "[0, 1e53, 1]"),
                                           ("advantages", "[0, -1e300, 1]")])
def test_float_beyond_float32_is_one_error_without_numpy_warnings(tmp_path, field, values):
    trees = write_lines(tmp_path / "trees.jsonl", [f'{{"id": 1, "tokens": [1, 2, 3], "{field}": {values}}}'.encode()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # numpy's RuntimeWarning would surface as an exception here
        with pytest.raises(InputError, match=rf"{field}\[1\] = .* is not a finite float32"):
            read_trees(trees)


# --- damaged plans --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("damaged")
    trees = write_trees(folder / "trees.jsonl")
    path = folder / "good.plan"
    assert hartsc_main([str(trees), "-o", str(path), *COMPILE_FLAGS]) == 0
    plan = read_plan(path)
    assert plan.producers and all("residual_token_rows" in mb for mb in plan.microbatches), \
        "the fixture must exercise producers and residual calls"
    return path


def _rows(mb):
    return len(mb["row_token"])


def _run_past_rows(plan):
    """Move the last run so that it ends one row past the microbatch's rows."""
    mb = plan.microbatches[0]
    mb["run_row_start"][-1] = _rows(mb) - mb["run_length"][-1] + 1


def _start_from_own_round(plan):
    """Make the sequence that exports a state start from that very state (its own round)."""
    mb = next(mb for mb in plan.microbatches + plan.producers if len(mb["export_row"]))
    mb["sequence_start_state"][mb["export_sequence"][0]] = 0


def _cached_beyond_producer(plan):
    mb = next(mb for mb in plan.microbatches if (mb.get("row_cached_by", np.zeros(0)) >= 0).any())
    mb["row_cached_by"][np.flatnonzero(mb["row_cached_by"] >= 0)[0]] = 10**6


def _second_producer(plan):
    plan.producers[1].update(replica=plan.producers[0]["replica"], window=plan.producers[0]["window"])


# (what is damaged, how, words the one line must hold)
def _with(array: np.ndarray, index: int, value) -> np.ndarray:
    out = array.copy()   # decoded arrays are read-only views of the plan's bytes
    out[index] = value
    return out


DAMAGE = {
    "start-state-same-round": (_start_from_own_round, "field 'sequence_start_state': a sequence starts from a "
                                                      "state exported in its own or a later round"),
    "mb-segment-parent-after": (lambda p: p.microbatches[0]["segment_parent"].__setitem__(0, 0),
                                "microbatch 0: field 'segment_parent'"),
    "mb-cached-beyond-producer": (_cached_beyond_producer, "field 'row_cached_by'"),
    "producer-duplicate": (_second_producer, "producer 1: field 'window': a second producer"),
    "flags-dp-type": (lambda p: p.header["flags"].update(dp="2"), "flags: field 'dp'"),
    "flags-dp-beyond-microbatches": (lambda p: p.header["flags"].update(dp=10**6), "flags: field 'dp'"),
    "flags-chunk-missing": (lambda p: p.header["flags"].pop("chunk_size"), "field 'chunk_size': missing"),
    "step-offsets-short": (lambda p: p.step.update(token_offsets=p.step["token_offsets"][:-2]),
                           "step: field 'token_offsets'"),
    "step-ids-unhashable": (lambda p: p.step["ids"].__setitem__(0, [1]), "step: field 'ids'"),
    # Found by a CLI audit: these passed `harts check`, and `harts run` then wrote one trajectory's
    # log-probabilities under the other's id, or ran to a NaN loss.
    "step-ids-duplicate": (lambda p: p.step["ids"].__setitem__(1, p.step["ids"][0]),
                           "trajectories 0 and 1 share the id 't0'"),
    "step-ids-duplicate-as-strings": (lambda p: p.step.update(ids=[7, "7", *p.step["ids"][2:]]),
                                      "trajectories 0 and 1 share the id '7' (as strings)"),
    "step-loss-mask-two": (lambda p: p.step.update(loss_mask=_with(p.step["loss_mask"], 3, 2)),
                           "field 'loss_mask': holds 2 at position 3, not 0 or 1"),
    "step-advantages-nan": (lambda p: p.step.update(advantages=_with(p.step["advantages"], 4, np.nan)),
                            "field 'advantages': holds nan at position 4"),
    "step-old-logprobs-nan": (lambda p: p.step.update(
        old_logprobs=_with(np.zeros(len(p.step["loss_mask"]), np.float32), 5, np.nan),
        has_old_logprobs=np.ones(p.step["num_trajectories"], bool)),
        "field 'old_logprobs': position 5 holds nan for a trajectory that gave them"),
    "step-old-logprobs-claimed": (lambda p: p.step.update(has_old_logprobs=np.ones(p.step["num_trajectories"], bool)),
                                  "field 'has_old_logprobs': says a trajectory gave old_logprobs"),
    "step-loss-mask-short": (lambda p: p.step.update(loss_mask=p.step["loss_mask"][:-1]), "step: field 'loss_mask'"),
    "mb-not-a-map": (lambda p: p.microbatches.__setitem__(1, [1, 2]), "microbatch 1 is list"),
    "mb-replica": (lambda p: p.microbatches[1].update(replica=2), "microbatch 1: field 'replica'"),
    "mb-slot": (lambda p: p.microbatches[1].update(slot=10**12), "microbatch 1: field 'slot'"),
    "mb-missing-key": (lambda p: p.microbatches[2].pop("export_row"), "microbatch 2: field 'export_row': missing"),
    "mb-row-parent": (lambda p: p.microbatches[0]["row_parent"].__setitem__(3, _rows(p.microbatches[0])),
                      "microbatch 0: field 'row_parent'"),
    "mb-rows-inconsistent": (lambda p: p.microbatches[0].update(row_position=p.microbatches[0]["row_position"][:-1]),
                             "microbatch 0: field 'row_position'"),
    "mb-row-token-2d": (lambda p: p.microbatches[0].update(row_token=p.microbatches[0]["row_token"].reshape(1, -1)),
                        "microbatch 0: field 'row_token'"),
    "mb-row-token-float": (lambda p: p.microbatches[0].update(row_token=p.microbatches[0]["row_token"] * 1.0),
                           "microbatch 0: field 'row_token'"),
    "mb-member-trajectory": (lambda p: p.microbatches[3]["member_trajectory"].__setitem__(0, 6),
                             "microbatch 3: field 'member_trajectory'"),
    "mb-run-length": (lambda p: p.microbatches[0]["run_length"].__setitem__(0, 10**12),
                      "microbatch 0: field 'run_length'"),
    "mb-run-past-rows": (_run_past_rows, "microbatch 0: field 'run_length': a run ends past"),
    "mb-replay-offsets": (lambda p: p.microbatches[0].update(sequence_replay_offsets=np.zeros(1, np.int64)),
                          "microbatch 0: field 'sequence_replay_offsets'"),
    "mb-start-state": (lambda p: p.microbatches[0]["sequence_start_state"].__setitem__(0, 99),
                       "microbatch 0: field 'sequence_start_state'"),
    "mb-residual-rows": (lambda p: p.microbatches[0]["residual_token_rows"].__setitem__(0, -1),
                         "microbatch 0: field 'residual_token_rows'"),
    "producer-replica": (lambda p: p.producers[1].update(replica=-1), "producer 1: field 'replica'"),
    "producer-prefix": (lambda p: p.producers[0]["prefix_trajectory"].__setitem__(0, 99),
                        "producer 0: field 'prefix_trajectory'"),
}


def damaged(good, tmp_path, case: str):
    plan = decode_plan(good.read_bytes(), str(good))
    plan = type(plan)(header=plan.header, step=plan.step, summary=plan.summary,
                      microbatches=[{k: v.copy() if isinstance(v, np.ndarray) else v for k, v in mb.items()}
                                    for mb in plan.microbatches],
                      producers=[{k: v.copy() if isinstance(v, np.ndarray) else v for k, v in pr.items()}
                                 for pr in plan.producers])
    DAMAGE[case][0](plan)
    path = tmp_path / "damaged.plan"
    path.write_bytes(encode_plan(plan))   # a valid checksum: only the structure is wrong
    return path


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_plan_is_one_line_in_every_tool(good_plan, tmp_path, capsys, case):
    path = damaged(good_plan, tmp_path, case)
    words = DAMAGE[case][1]
    with pytest.raises(PlanFormatError, match="fix: recompile the plan") as info:
        read_plan(path)
    assert words in str(info.value) and str(path) in str(info.value)
    for name, argv in (("stats", [str(path)]), ("check", [str(path)]), ("diff", [str(good_plan), str(path)]),
                       ("viz", [str(path), "-o", str(tmp_path / "page.html")])):
        assert harts_main([name, *argv]) == 2, name
        assert words in one_line(capsys, f"harts {name}: "), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged.plan"]


def test_the_fixture_plan_passes_every_tool(good_plan, tmp_path, capsys):
    for name, argv in (("stats", [str(good_plan)]), ("check", [str(good_plan)]),
                       ("diff", [str(good_plan), str(good_plan)]),
                       ("viz", [str(good_plan), "-o", str(tmp_path / "page.html")])):
        assert harts_main([name, *argv]) == 0, name


def test_viz_refuses_to_overwrite_its_plan(good_plan, capsys):
    before = good_plan.read_bytes()
    assert harts_main(["viz", str(good_plan), "-o", str(good_plan)]) == 2
    assert "also an input" in one_line(capsys, "harts viz: cannot write")
    assert good_plan.read_bytes() == before


def test_every_error_pickles_with_its_message_and_fields():
    """Errors cross processes (read_trees' parse workers, harts.api's background compiler): each class comes
    back as itself, with the same line and fields, although most __init__ take fields rather than a message."""
    import pickle

    from harts.schema import errors

    samples = [errors.HartsError("h"), errors.UsageError("u; fix: v"), errors.PlanFormatError("p"),
               errors.InputError("a.jsonl", 3, "id", "duplicate", "rename it"),
               errors.OutputError("out.plan", "read-only", "pick a folder"),
               errors.VerificationError("rows tile", "row 3 twice"), errors.PassFailedError("l1", "too long", "raise T")]
    classes = {cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, HartsError)}
    assert {type(error) for error in samples} == classes   # a new error class needs a sample here
    for error in samples:
        error.add_note("where it happened")
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error) and back.args == error.args
        assert vars(back) == vars(error) and back.__notes__ == ["where it happened"]
