"""The command lines: `hartsc`, `harts stats|check|gen|demo`, run as a user would.

Run: `python -m pytest tests/test_cli.py -q`. Commands run in-process through
their `main(argv)`; one test runs the installed console scripts.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from harts.cli import main as harts_main
from harts.compiler.cli import main as hartsc_main
from harts.schema.plan import read_plan, write_plan
from harts.schema.summary import STATS_KEYS

TREES = [
    {"id": "a", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9], "advantages": 1.0},
    {"id": "b", "tokens": [1, 2, 3, 4, 5, 6, 7, 8, 10, 11], "loss_mask": [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]},
    {"id": 3, "tokens": [1, 2, 3, 4], "tree": "t0"},
    {"id": "d", "tokens": [20, 21, 22]},
]


def write_trees(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def trees(tmp_path):
    return write_trees(tmp_path / "trees.jsonl", TREES)


def test_compile_stats_and_check(tmp_path, trees, capsys):
    plan = tmp_path / "step.plan"
    assert hartsc_main([str(trees), "-o", str(plan), "--chunk-size", "4", "--capacity", "32"]) == 0
    capsys.readouterr()
    assert harts_main(["stats", str(plan), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    for key in STATS_KEYS:
        assert isinstance(stats[key], (int, float)) and math.isfinite(stats[key]), key
    assert stats["trajectories"] == 4 and stats["original_tokens"] == 26
    assert stats["compact_tokens"] == 9 + 2 + 3   # the trie: 1..9, 10 11, 20 21 22
    assert stats["chunk_size"] == 4 and stats["capacity"] == 32 and stats["planning_seconds"] > 0
    assert harts_main(["check", str(plan), "--trees", str(trees)]) == 0


@pytest.mark.parametrize("sidecar, says", [
    (None, "no p.plan.timing.json beside the plan"),
    ('{"planning_seconds": "oops"}', "holds no planning_seconds >= 0"),
    ('{"planning_seconds": NaN}', "holds no planning_seconds >= 0"),
    ("{", "holds no planning_seconds >= 0"),
], ids=["missing", "a-string", "nan", "not-json"])
def test_stats_says_why_planning_seconds_is_unknown(tmp_path, trees, capsys, sidecar, says):
    plan = tmp_path / "p.plan"
    assert hartsc_main([str(trees), "-o", str(plan), "--chunk-size", "4", "--capacity", "32"]) == 0
    timing = tmp_path / "p.plan.timing.json"
    timing.unlink()
    if sidecar is not None:
        timing.write_text(sidecar)
    capsys.readouterr()
    assert harts_main(["stats", str(plan), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["planning_seconds"] == 0
    assert captured.err.startswith("harts stats: ") and says in captured.err
    assert captured.err.endswith("; planning_seconds shown as 0 (unknown)\n") and captured.err.count("\n") == 1


def test_stats_ignores_timing_recorded_for_a_plan_since_replaced(tmp_path, trees, capsys):
    """`harts.api.write_plan` over a hartsc plan writes no timing: the old record names other bytes. A record
    from an earlier hartsc, without the digest, is still read."""
    from harts.api import compile_trajectories, write_plan
    plan = tmp_path / "p.plan"
    assert hartsc_main([str(trees), "-o", str(plan), "--chunk-size", "4", "--capacity", "32"]) == 0
    timing = tmp_path / "p.plan.timing.json"
    record = json.loads(timing.read_text())
    write_plan(compile_trajectories([[1, 2, 3], [1, 2, 4]]), plan)
    capsys.readouterr()
    assert harts_main(["stats", str(plan), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["planning_seconds"] == 0
    assert "p.plan.timing.json was written for other plan bytes" in captured.err
    del record["plan_sha256"]
    timing.write_text(json.dumps(record))
    assert harts_main(["stats", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["planning_seconds"] == record["planning_seconds"] > 0


def test_same_input_and_flags_give_a_byte_identical_plan(tmp_path, trees):
    a, b = tmp_path / "a.plan", tmp_path / "b.plan"
    for out in (a, b):
        assert hartsc_main([str(trees), "-o", str(out), "--dp", "2", "--chunk-size", "2"]) == 0
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("record, line, words", [
    ({"id": "x", "tokens": [1, -2]}, 5, "tokens"),
    ({"id": "a", "tokens": [1, 2]}, 5, "id"),
    ({"id": "x", "tokens": list(range(40))}, 5, "capacity"),
])
def test_bad_input_prints_one_line_and_writes_nothing(tmp_path, capsys, record, line, words):
    trees = write_trees(tmp_path / "bad.jsonl", TREES + [record])
    plan = tmp_path / "step.plan"
    assert hartsc_main([str(trees), "-o", str(plan), "--capacity", "32"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"bad.jsonl:{line}" in err and words in err and "fix" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


@pytest.mark.parametrize("flag", ["--pairs-per-token", "--max-window-slots"])
def test_bad_flag_prints_one_line_and_writes_nothing(tmp_path, trees, capsys, flag):
    plan = tmp_path / "step.plan"
    assert hartsc_main([str(trees), "-o", str(plan), flag, "-1"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{flag} must be >= 0" in err and "fix" in err
    assert not plan.exists()


def test_unreadable_plan_is_one_line(tmp_path, capsys):
    junk = tmp_path / "junk.plan"
    junk.write_bytes(b"junk")
    assert harts_main(["stats", str(junk)]) == 2
    assert harts_main(["check", str(junk)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("not a HARTS plan" in line for line in err)


def test_check_against_other_trees_fails(tmp_path, trees, capsys):
    plan = tmp_path / "step.plan"
    assert hartsc_main([str(trees), "-o", str(plan)]) == 0
    other = write_trees(tmp_path / "other.jsonl", [dict(r, tokens=[t + 1 for t in r["tokens"]]) for r in TREES])
    assert harts_main(["check", str(plan), "--trees", str(other)]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert "has its token" in err and err.startswith(f"harts check: {plan}: invariant ")
    assert err.endswith("; fix: recompile the plan with hartsc (a plan hartsc writes passes; if it wrote this one, "
                        "report it)")


@pytest.mark.parametrize("edit, words", [
    (lambda r: [dict(r[0], id="b"), dict(r[1], id="a"), *r[2:]], "trajectory 0 has id 'a' in the plan, 'b' in the input"),
    (lambda r: [dict(r[0], id="z"), *r[1:]], "has id 'a' in the plan, 'z'"),
    (lambda r: [dict(r[0], advantages=0.5), *r[1:]], "advantages differs from the input file at trajectory 'a' position 0"),
    (lambda r: [r[0], dict(r[1], loss_mask=[1] * 10), *r[2:]], "loss_mask differs from the input file at trajectory 'b' position 0"),
    (lambda r: [dict(r[0], old_logprobs=[-1.0] * 9), *r[1:]], "old_logprobs is absent in the plan, present in the input file"),
    (lambda r: [*r[:2], dict(r[2], id="3"), r[3]], "trajectory 2 has id 3 in the plan, '3' in the input file"),
    (lambda r: [*r[:2], dict(r[2], tree="t1"), r[3]], "trajectory 2 has tree 't0' in the plan, 't1' in the input file"),
    (lambda r: [dict(r[0], tree=0), *r[1:]], "trajectory 0 has tree None in the plan, 0 in the input file"),
], ids=["ids-swapped", "id-renamed", "advantages", "loss-mask", "old-logprobs", "id-as-string", "tree", "tree-added"])
def test_check_trees_compares_ids_and_rl_fields_not_only_tokens(tmp_path, trees, capsys, edit, words):
    """Same tokens, different ids or RL fields: outputs would be filed under the wrong ids, or the loss would
    weigh what the file does not say (found by fuzzing: swapped ids passed `--trees`)."""
    plan = tmp_path / "step.plan"
    assert hartsc_main([str(trees), "-o", str(plan)]) == 0
    assert harts_main(["check", str(plan), "--trees", str(trees)]) == 0
    capsys.readouterr()
    other = write_trees(tmp_path / "other.jsonl", edit(TREES))
    assert harts_main(["check", str(plan), "--trees", str(other)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "plan matches --trees" in err and words in err, err
    assert err.endswith(f"; fix: pass the trees file {plan} was compiled from, or recompile it from this one")


@pytest.mark.parametrize("edit, words", [
    (lambda r: [r[0], dict(r[1], tokens=r[1]["tokens"] + [12], loss_mask=r[1]["loss_mask"] + [1]), *r[2:]],
     "trajectory 1 (id 'b' in the plan) has 10 tokens in the plan, 11 in the input file"),
    (lambda r: r[:-1], "the plan has 4 trajectories, the input file 3"),
], ids=["longer", "fewer"])
def test_check_trees_names_where_lengths_differ(tmp_path, trees, capsys, edit, words):
    plan = tmp_path / "step.plan"
    assert hartsc_main([str(trees), "-o", str(plan)]) == 0
    capsys.readouterr()
    other = write_trees(tmp_path / "other.jsonl", edit(TREES))
    assert harts_main(["check", str(plan), "--trees", str(other)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err and "compiled from another file?" in err, err


def test_check_refuses_tokens_outside_the_compiled_vocabulary(tmp_path, trees, capsys):
    plan_path = tmp_path / "step.plan"
    assert hartsc_main([str(trees), "-o", str(plan_path), "--vocab-size", "32"]) == 0
    plan = read_plan(plan_path)
    plan.header["flags"]["vocab_size"] = 22      # token 22 (trajectory d) is now outside it
    write_plan(plan, plan_path)
    assert harts_main(["check", str(plan_path)]) == 1
    assert "token 22 >= vocab_size 22" in capsys.readouterr().err


def test_console_scripts_run_the_demo(tmp_path):
    out = subprocess.run(["harts", "demo", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "compression" in out.stdout and (tmp_path / "step.plan").exists()
    # The demo's step needs several microbatches, so its windows have something to share.
    windows = next(line for line in out.stdout.splitlines() if line.startswith("microbatches, sharing windows"))
    assert int(windows.split()[-1]) >= 1 and "compact with windows" in out.stdout
    check = subprocess.run([sys.executable, "-m", "harts.tools.check", str(tmp_path / "step.plan")],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr


def test_positive_logprobs_are_compiled_with_a_warning_naming_where(tmp_path, capsys):
    # Negative log-likelihoods passed as old_logprobs: legal input (the plan is written), but every ppo ratio
    # exp(logprob - old) would vanish; one warning line per field says where. Rounding above 0 (1e-7) and
    # untrained positions (index 0, loss_mask 0) are not counted.
    records = [
        {"id": "ok", "tokens": [1, 2, 3, 4], "old_logprobs": [5.0, -1.0, 1e-7, -0.5], "ref_logprobs": [0, -1, -2, -3]},
        {"id": "nll", "tokens": [1, 2, 5, 6], "loss_mask": [0, 0, 1, 1], "old_logprobs": [0.0, 9.0, 0.7, 1.25]},
    ]
    trees = write_trees(tmp_path / "trees.jsonl", records)
    assert hartsc_main([str(trees), "-o", str(tmp_path / "step.plan")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert ("old_logprobs: 2 trained positions hold a log-probability above 0 (largest 1.25; first: "
            "trajectory 'nll', line 2, index 2)") in warnings[0]
    assert (tmp_path / "step.plan").exists()


def test_positive_logprobs_warn_in_python_too():
    import harts.api as harts
    with pytest.warns(UserWarning, match="ref_logprobs: 1 trained positions hold a log-probability above 0"):
        harts.compile_trajectories([[1, 2, 3], [1, 2, 4]], ref_logprobs=[[0.0, -1.0, 2.0], [0.0, -1.0, -1.0]],
                                   capacity=64)


@pytest.mark.parametrize("flags, warned", [
    (["--ffd-time-budget", "5"], ["--ffd-time-budget has no effect without --planner ffd"]),
    (["--ffd-first-feasible", "--ffd-shard", "trajectory"],
     ["--ffd-first-feasible has no effect without --planner ffd", "--ffd-shard has no effect without --planner ffd"]),
    (["--levels", "l1", "--max-window-slots", "2"], ["--max-window-slots has no effect without --levels l1+l2"]),
    (["--max-window-slots", "2"], []),      # --levels left out: l1+l2, which reads it (found by a docs audit)
    (["--levels", "l1", "--pairs-per-token", "0"], []),      # harts stats' cost_balance reads it at either level
    (["--planner", "ffd", "--levels", "l1", "--ffd-time-budget", "1"], []),
    (["--planner", "ffd", "--levels", "l1", "--l1-objective", "compression"],
     ["--l1-objective has no effect without --planner harts"]),
    (["--levels", "l1", "--l1-objective", "compression"], []),
])
def test_flags_the_chosen_planner_never_reads_are_warned_about(tmp_path, trees, capsys, flags, warned):
    assert hartsc_main([str(trees), "-o", str(tmp_path / "p.plan"), *flags]) == 0
    warnings = [line.removeprefix("hartsc: warning: ") for line in capsys.readouterr().err.splitlines()
                if line.startswith("hartsc: warning: ")]
    assert [w.split(" (")[0] for w in warnings] == warned


def test_l1_objective_is_recorded_and_a_bad_one_refused_before_reading(tmp_path, trees, capsys):
    import harts.api as harts
    assert hartsc_main([str(trees), "-o", str(tmp_path / "p.plan"), "--l1-objective", "compression"]) == 0
    assert harts.read_plan(tmp_path / "p.plan").flags["l1_objective"] == "compression"
    assert hartsc_main([str(trees), "-o", str(tmp_path / "q.plan")]) == 0
    assert harts.read_plan(tmp_path / "q.plan").flags["l1_objective"] == "step-time"
    with pytest.raises(SystemExit) as refused:
        hartsc_main([str(trees), "-o", str(tmp_path / "r.plan"), "--l1-objective", "fast"])
    assert refused.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown --l1-objective 'fast'; fix: use one of step-time, compression"):
        harts.compile_trajectories([[1, 2, 3], [1, 2, 4]], capacity=64, l1_objective="fast")
    plan = harts.compile_trajectories([[1, 2, 3], [1, 2, 4]], capacity=64, l1_objective="compression")
    assert plan.flags["l1_objective"] == "compression"


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "harts.cli", *args]   # the `harts` console script's own entry


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/full is Linux's")
@pytest.mark.parametrize("args", [["stats", "{plan}", "--json"], ["diff", "{plan}", "{other}"]], ids=["stats", "diff"])
def test_standard_output_on_a_full_disk_is_one_line(tmp_path, trees, args):
    plan, other = tmp_path / "a.plan", tmp_path / "b.plan"
    assert hartsc_main([str(trees), "-o", str(plan), "--chunk-size", "4", "--capacity", "32"]) == 0
    assert hartsc_main([str(trees), "-o", str(other), "--chunk-size", "2", "--capacity", "32"]) == 0
    with open("/dev/full", "w") as full:
        done = subprocess.run(_command(*(a.format(plan=plan, other=other) for a in args)), stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"harts {args[0]}: cannot write standard output: No space left on device; "
                                        "fix: free disk space, or send the output somewhere else"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/full is Linux's")
def test_hartsc_json_on_a_full_disk_is_one_line_after_a_complete_plan(tmp_path, trees):
    plan = tmp_path / "a.plan"
    compile_command = [sys.executable, "-m", "harts.compiler.cli", str(trees), "-o", str(plan), "--chunk-size", "4",
                       "--capacity", "32", "--json"]
    with open("/dev/full", "w") as full:
        done = subprocess.run(compile_command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2 and "hartsc: cannot write standard output" in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr
    read_plan(plan)   # written whole before the summary


def test_diff_exit_code_survives_a_reader_that_leaves(tmp_path, trees):
    # `harts diff --exit-code A B | head -1` under `set -o pipefail` must still say "different".
    plan, other = tmp_path / "a.plan", tmp_path / "b.plan"
    assert hartsc_main([str(trees), "-o", str(plan), "--chunk-size", "4", "--capacity", "32"]) == 0
    assert hartsc_main([str(trees), "-o", str(other), "--chunk-size", "2", "--capacity", "32"]) == 0
    reader_gone = subprocess.Popen(_command("diff", str(plan), str(other), "--exit-code"), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    reader_gone.stdout.close()   # before the command writes anything: its first write meets a closed pipe
    stderr = reader_gone.stderr.read()
    assert reader_gone.wait(timeout=120) == 1, stderr
    assert stderr == ""
    same = subprocess.Popen(_command("diff", str(plan), str(plan), "--exit-code"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    same.stdout.close()
    assert same.wait(timeout=120) == 0 and same.stderr.read() == ""


def test_a_stream_closed_at_startup_is_left_alone(tmp_path, trees):
    # `harts stats PLAN >&-`: Python starts with sys.stdout None, and printing to None does nothing.
    plan = tmp_path / "a.plan"
    assert hartsc_main([str(trees), "-o", str(plan), "--chunk-size", "4", "--capacity", "32"]) == 0
    done = subprocess.run(_command("stats", str(plan)), preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE,
                          text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_reader_of_standard_error_that_leaves_is_not_an_error(tmp_path):
    # `harts gen -o x.jsonl 2>&1 | head`: the summary line meets a closed pipe after the file is written.
    out = tmp_path / "trees.jsonl"
    gone = subprocess.Popen(_command("gen", "--tasks", "1", "-o", str(out)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    gone.stderr.close()
    assert gone.wait(timeout=300) == 0
    assert out.stat().st_size > 0
