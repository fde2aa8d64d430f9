"""`harts diff`: what changed between two plans, for a terminal or as JSON.

Run: `python -m pytest tests/test_diff.py -q`. The plans are compiled from one
small tree-step workload with different flags; `harts diff` exits 0 whether or
not they differ.
"""
from __future__ import annotations

import json
import re

import pytest

from harts.cli import main as harts_main
from harts.compiler.cli import main as hartsc_main
from harts.schema.plan import read_plan
from harts.tools import gen
from harts.tools.diff import diff_plans

WORKLOAD = gen.GenConfig(kind="treestep", tasks=6, group_size=3, system_prompt_tokens=128, task_tokens_min=32,
                         task_tokens_max=64, turns_min=2, turns_max=4, action_tokens_median=16.0,
                         tool_tokens_median=32.0, tool_tokens_max=128, context_limit=512, vocab_size=1000,
                         seed=0, branch_prob=0.4)
JSON_KEYS = {"a", "b", "identical", "changed", "flags", "trajectories", "statistics", "membership", "placement",
             "windows", "rounds"}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diff")
    trees = folder / "trees.jsonl"
    gen.write_jsonl(gen.generate(WORKLOAD), trees)
    # L1 plans under the paper's objective: its least-total partition of this step is the same whatever D
    # is, which the placement test relies on (the default, critical path first, rebalances per D).
    paper = ["--l1-objective", "compression"]
    flags = {"dp2": ["--dp", "2", "--capacity", "700", *paper], "dp4": ["--dp", "4", "--capacity", "700", *paper],
             "dp4_again": ["--dp", "4", "--capacity", "700", *paper],
             "dp4_small": ["--dp", "4", "--capacity", "600", *paper],
             "dp2_step_time": ["--dp", "2", "--capacity", "700"]}
    paths = {}
    for name, extra in flags.items():
        paths[name] = folder / f"{name}.plan"
        assert hartsc_main([str(trees), "-o", str(paths[name]), "--chunk-size", "16", "--levels", "l1", *extra]) == 0
    return paths


def run_diff(capsys, *argv):
    code = harts_main(["diff", *map(str, argv)])
    out = capsys.readouterr().out
    assert code == 0, "harts diff exits 0 whether or not the plans differ"
    return out


def test_identical_plans_print_one_line(plans, capsys):
    out = run_diff(capsys, plans["dp4"], plans["dp4_again"])
    assert out.strip().splitlines() == [f"identical: {plans['dp4']} and {plans['dp4_again']} are byte-identical"]
    data = json.loads(run_diff(capsys, plans["dp4"], plans["dp4_again"], "--json"))
    assert data["identical"] is True and data["changed"] == []


def test_identical_plans_are_decoded_once(plans, capsys, monkeypatch):
    """Equal bytes are one plan: B is not decoded and validated again (seconds and gigabytes at scale)."""
    import harts.tools.diff as diff

    def second_read(data, path):
        raise AssertionError(f"{path} decoded although its bytes equal A's")
    monkeypatch.setattr(diff, "plan_from_bytes", second_read)
    out = run_diff(capsys, plans["dp4"], plans["dp4_again"])
    assert out.startswith("identical:")
    with pytest.raises(AssertionError, match="decoded although"):
        run_diff(capsys, plans["dp4"], plans["dp2"])


def test_missing_second_plan_is_one_line(plans, tmp_path, capsys):
    assert harts_main(["diff", str(plans["dp4"]), str(tmp_path / "none.plan")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.plan: cannot read plan" in err[0] and "fix:" in err[0]


def test_different_dp_shows_flags_and_placement_not_membership(plans, capsys):
    out = run_diff(capsys, plans["dp2"], plans["dp4"])
    assert out.startswith("differ: flags")
    flag_lines = [line.split() for line in out.splitlines() if line.strip().startswith("dp ")]
    assert ["dp", "2", "4"] in flag_lines
    # The same L1 microbatches, dealt out to more replicas: nobody changes microbatch.
    result = diff_plans(read_plan(plans["dp2"]), read_plan(plans["dp4"]))
    assert result["flags"]["dp"] == [2, 4] and result["flags"]["capacity"] == [700, 700]
    assert result["membership"]["moved"] == [] and "membership" not in result["changed"]
    assert "placement" in result["changed"] and "placement:" in out
    assert result["statistics"]["slots"]["a"] == 2 * result["statistics"]["slots"]["b"]
    assert "capacity" not in out, "only what changed is shown"


def test_l1_objective_is_a_flag_and_moves_trajectories(plans, capsys):
    out = run_diff(capsys, plans["dp2"], plans["dp2_step_time"])
    assert ["l1_objective", "compression", "step-time"] in [line.split() for line in out.splitlines()]
    result = diff_plans(read_plan(plans["dp2"]), read_plan(plans["dp2_step_time"]))
    assert {name for name, (a, b) in result["flags"].items() if a != b} == {"l1_objective"}
    assert "membership" in result["changed"] and result["membership"]["moved"]


def test_different_capacity_moves_trajectories_by_id(plans, capsys):
    a, b = read_plan(plans["dp4"]), read_plan(plans["dp4_small"])
    result = diff_plans(a, b)
    moved = result["membership"]["moved"]
    assert moved and "membership" in result["changed"]
    where_b = {tid: i for i, mb in enumerate(b.microbatches) for tid in (b.step["ids"][t] for t in mb["member_trajectory"])}
    where_a = {tid: i for i, mb in enumerate(a.microbatches) for tid in (a.step["ids"][t] for t in mb["member_trajectory"])}
    for move in moved:
        assert where_b[move["id"]] == move["to"]["microbatch"]
        assert move["id"] in a.step["ids"]
        # A move is into a B microbatch standing for another A microbatch, or for none (a new one).
        assert move["to_matches"] != where_a[move["id"]]
        assert move["to_matches"] is None or move["to"]["microbatch"] not in result["membership"]["unmatched_b"]
    out = run_diff(capsys, plans["dp4"], plans["dp4_small"])
    assert f"membership: {len(moved)} of" in out
    assert str(moved[0]["id"]) in out
    counts = re.search(r"^  microbatches +(\d+) +(\d+) +\+(\d+)$", out, re.M)
    assert counts and counts.groups() == (str(len(a.microbatches)), str(len(b.microbatches)),
                                          str(len(b.microbatches) - len(a.microbatches)))


def test_json_is_one_object_with_every_section(plans, capsys):
    out = run_diff(capsys, plans["dp4"], plans["dp4_small"], "--json")
    assert len(out.strip().splitlines()) == 1
    data = json.loads(out)
    assert set(data) == JSON_KEYS
    assert data["identical"] is False
    assert {"flags", "statistics", "membership"} <= set(data["changed"])
    assert data["flags"]["capacity"] == [700, 600]
    for key in ("compression", "balance", "decoder_tokens", "max_rounds", "windows", "microbatches"):
        assert set(data["statistics"][key]) == {"a", "b", "delta"}
    assert data["windows"]["a"]["count"] == 0 and data["windows"]["b"]["spans"] == []
    assert set(data["membership"]) == {"moved", "unmatched_a", "unmatched_b"}
    assert all(set(m) == {"id", "from", "to", "to_matches"} for m in data["membership"]["moved"])


def test_unreadable_plan_is_one_line_and_nonzero(plans, tmp_path, capsys):
    bad = tmp_path / "bad.plan"
    bad.write_bytes(b"not a plan")
    assert harts_main(["diff", str(plans["dp4"]), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a HARTS plan" in err[0]


def test_exit_code_says_whether_the_plans_differ(plans, capsys):
    # Scripts asking "did the plan change?" get diff(1)'s answer only when they ask for it.
    assert harts_main(["diff", str(plans["dp4"]), str(plans["dp4_again"]), "--exit-code"]) == 0
    assert harts_main(["diff", str(plans["dp2"]), str(plans["dp4"]), "--exit-code"]) == 1
    assert harts_main(["diff", str(plans["dp2"]), str(plans["dp4"]), "--exit-code", "--json"]) == 1
    capsys.readouterr()


def test_ids_that_could_mislead_the_terminal_are_quoted(tmp_path, capsys):
    """A control character in an id would break or colour the line, a comma would blur the list: such ids are
    shown as repr; plain ids as written."""
    records = {"a": ["plain", "evil\nline", "\x1b[31mred", "x, y"], "b": ["plain", "other"]}
    paths = {}
    for name, ids in records.items():
        trees = tmp_path / f"{name}.jsonl"
        trees.write_text("".join(json.dumps({"id": i, "tokens": [1, 2, 3 + k]}) + "\n" for k, i in enumerate(ids)))
        paths[name] = tmp_path / f"{name}.plan"
        assert hartsc_main([str(trees), "-o", str(paths[name])]) == 0
    capsys.readouterr()
    assert harts_main(["diff", str(paths["a"]), str(paths["b"])]) == 0
    out = capsys.readouterr().out
    assert "only in A: 'evil\\nline', '\\x1b[31mred', 'x, y'" in out and "only in B: other" in out
    assert "\x1b" not in out


def test_negative_limit_is_refused(plans, capsys):
    with pytest.raises(SystemExit) as info:
        harts_main(["diff", str(plans["dp2"]), str(plans["dp4"]), "--limit", "-1"])
    assert info.value.code == 2 and "--limit must be >= 0" in capsys.readouterr().err
