"""Tests of `harts gen` (tools/gen.py), the synthetic agentic-workload generator.

Run: python -m pytest tests/test_gen.py -q   (a few seconds, 2 cores)
Why: benchmarks and end-to-end tests feed the compiler these files. A record
that breaks the contract, or a prefix structure other than the documented
one (nested step-wise samples, branches that part exactly at their fork),
would make every compression number measured on them meaningless. The
paper-scale checks use shapes only (`summarize`), so none needs tokens or the
`slow` mark.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import os
import re
import subprocess
import sys

import numpy as np
import orjson
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts.schema.errors import UsageError
from harts.tools.gen import (
    GenConfig, generate, main, plan, preset, scale_to, summarize, write_jsonl)
from harts.tools.gen_config import TREESTEP_ONLY

# Small enough to check every pair of records, forky enough to have forks of forks.
TREE = GenConfig(kind="treestep", tasks=3, group_size=3, system_prompt_tokens=64,
                 task_tokens_min=8, task_tokens_max=32, turns_min=3, turns_max=10,
                 action_tokens_median=12, tool_tokens_median=40, context_limit=4096,
                 branch_prob=0.5, max_branches=9, seed=7)
STEP = dataclasses.replace(TREE, kind="stepwise")
# Rollouts that aim for far more turns than fit: most are cut at the limit.
TIGHT = dataclasses.replace(STEP, turns_min=30, turns_max=40, tool_tokens_median=200,
                            context_limit=2048)

CONFIGS = {
    "small-stepwise": GenConfig(),
    "small-treestep": GenConfig(kind="treestep"),
    "tree-once-logprobs": dataclasses.replace(TREE, with_logprobs=True),
    "tree-per-branch": dataclasses.replace(TREE, shared_steps="per-branch"),
    "step-tight": TIGHT,
}


def _read(path) -> list[dict]:
    data = open(path, "rb").read()
    if str(path).endswith(".zst"):
        data = zstandard.ZstdDecompressor().stream_reader(data).read()
    return [orjson.loads(line) for line in data.splitlines()]


def _round_trip(config: GenConfig, tmp_path, name="trees.jsonl") -> list[dict]:
    path = tmp_path / name
    write_jsonl(generate(config), path)
    return _read(path)


def _check_contract(records: list[dict], config: GenConfig) -> None:
    """Contract section 1, plus the generator's own promises (mask ends on an action)."""
    assert records, "an empty file is invalid input"
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids), "ids must be unique"
    for r in records:
        assert isinstance(r["id"], str) and isinstance(r["tree"], str)
        assert r["id"].startswith(r["tree"] + "-")
        tokens = np.asarray(r["tokens"])
        mask = np.asarray(r["loss_mask"])
        assert tokens.dtype.kind in "iu" and 2 <= len(tokens) <= config.context_limit
        assert tokens.min() >= 0 and tokens.max() < config.vocab_size
        assert len(mask) == len(tokens) and set(np.unique(mask).tolist()) <= {0, 1}
        assert mask[0] == 0, "index 0 is never a target"
        assert mask[-1] == 1, "every sample ends with the policy's own action"
        assert isinstance(r["advantages"], float) and math.isfinite(r["advantages"])
        if config.with_logprobs:
            lp = np.asarray(r["old_logprobs"], dtype=np.float64)
            assert len(lp) == len(tokens) and np.isfinite(lp).all() and (lp <= 0).all()
        else:
            assert "old_logprobs" not in r


def _lcp(a, b) -> int:
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _branches(records) -> dict[tuple[str, str], list[dict]]:
    """(tree, branch label) -> that branch's records in turn order."""
    out = collections.defaultdict(list)
    for r in records:
        tree, label, turn = r["id"].split("-")
        out[tree, label].append((int(turn), r))
    return {k: [r for _, r in sorted(v, key=lambda x: x[0])] for k, v in out.items()}


def _trie_tokens(sequences) -> int:
    """Tokens of the prefix trie of `sequences`: sort, then sum len - LCP with the previous."""
    ordered = sorted(np.asarray(s, dtype=">i4").tobytes() for s in sequences)
    total, prev = 0, np.zeros(0, dtype=">i4")
    for raw in ordered:
        seq = np.frombuffer(raw, dtype=">i4")    # big-endian bytes sort like the numbers
        total += len(seq) - _lcp(prev, seq)
        prev = seq
    return total


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("kind", ["stepwise", "treestep"])
def test_same_seed_gives_the_same_file_and_another_seed_does_not(kind, tmp_path):
    config = dataclasses.replace(TREE, kind=kind, with_logprobs=True)
    write_jsonl(generate(config), tmp_path / "a.jsonl")
    write_jsonl(generate(config), tmp_path / "b.jsonl")
    write_jsonl(generate(dataclasses.replace(config, seed=8)), tmp_path / "c.jsonl")
    a, b, c = ((tmp_path / f"{x}.jsonl").read_bytes() for x in "abc")
    assert a == b
    assert a != c


def test_tokens_and_shapes_do_not_depend_on_logprobs_or_on_later_tasks():
    """Separate random streams: adding old_logprobs or more tasks changes nothing already there."""
    base = list(generate(TREE))
    with_lp = list(generate(dataclasses.replace(TREE, with_logprobs=True)))
    more = list(generate(dataclasses.replace(TREE, tasks=TREE.tasks + 2)))
    for r, s, m in zip(base, with_lp, more):
        assert r["id"] == s["id"] == m["id"]
        assert np.array_equal(r["tokens"], s["tokens"]) and np.array_equal(r["tokens"], m["tokens"])
        assert r["advantages"] == s["advantages"] == m["advantages"]
    assert len(more) > len(base)


# --------------------------------------------------------------------------- contract


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_record_follows_the_contract(name, tmp_path):
    config = CONFIGS[name]
    _check_contract(_round_trip(config, tmp_path), config)


def test_context_limit_cuts_rollouts_but_is_never_exceeded(tmp_path):
    records = _round_trip(TIGHT, tmp_path)
    lengths = [len(r["tokens"]) for r in records]
    assert max(lengths) == TIGHT.context_limit, "the last action is cut to end exactly at the limit"
    for branch in _branches(records).values():
        assert len(branch) < TIGHT.turns_min, "the limit, not the turn target, ended these rollouts"


# --------------------------------------------------------------------------- prefix structure


def _check_nested_steps(branch: list[dict]) -> None:
    """A branch's samples: nested strict prefixes; each next one starts with a tool output."""
    for prev, nxt in itertools.pairwise(branch):
        n = len(prev["tokens"])
        assert len(nxt["tokens"]) > n
        assert nxt["tokens"][:n] == prev["tokens"] and nxt["loss_mask"][:n] == prev["loss_mask"]
        assert nxt["loss_mask"][n] == 0, "the tool output follows the action in the next sample"
    for r in branch:
        assert r["loss_mask"][-1] == 1


def test_stepwise_samples_of_a_rollout_are_nested_prefixes_ending_in_actions(tmp_path):
    records = _round_trip(STEP, tmp_path)
    branches = _branches(records)
    assert len(branches) == STEP.tasks * STEP.group_size
    for (_, label), branch in branches.items():
        assert "." not in label
        assert [int(r["id"].split("-")[2]) for r in branch] == list(range(len(branch)))
        _check_nested_steps(branch)
        assert len({r["advantages"] for r in branch}) == 1, "one GRPO advantage per rollout"


def _check_parting(firsts: list[dict], history: int) -> None:
    """Siblings' first samples agree on exactly `history` tokens, then differ on an action token."""
    for a, b in itertools.combinations(firsts, 2):
        assert _lcp(a["tokens"], b["tokens"]) == history
        assert a["loss_mask"][history] == b["loss_mask"][history] == 1
    for r in firsts:
        assert r["loss_mask"][history - 1] == 0, "the shared history ends with a prompt or tool output"


def test_treestep_branches_share_history_up_to_the_fork_then_diverge(tmp_path):
    records = _round_trip(TREE, tmp_path)
    branches = _branches(records)
    children = collections.defaultdict(list)
    for tree, label in branches:
        if "." in label:
            children[tree, label.rsplit(".", 1)[0]].append(label)
    assert any("." in parent for _, parent in children), "the config must fork a fork"
    for branch in branches.values():
        _check_nested_steps(branch)
    prompt = TREE.system_prompt_tokens
    for tree in {t for t, _ in branches}:
        # A group's rollouts share system prompt + task description, nothing more.
        roots = [branches[tree, lab][0] for t, lab in branches if t == tree and "." not in lab]
        assert len(roots) == TREE.group_size
        history = _lcp(roots[0]["tokens"], roots[1]["tokens"])
        assert prompt + TREE.task_tokens_min <= history <= prompt + TREE.task_tokens_max
        _check_parting(roots, history)
    for (tree, parent), labels in children.items():
        # Shared steps are emitted once, under the parent's label; children
        # start at the turn after the parent's last one.
        assert len(labels) == TREE.branch_factor
        parent_last = branches[tree, parent][-1]
        fork_turn = int(parent_last["id"].split("-")[2]) + 1
        firsts = [branches[tree, lab][0] for lab in labels]
        assert all(int(r["id"].split("-")[2]) == fork_turn for r in firsts)
        history = _lcp(firsts[0]["tokens"], firsts[1]["tokens"])
        assert len(parent_last["tokens"]) < history, "the parent's tool output is shared too"
        assert firsts[0]["tokens"][:len(parent_last["tokens"])] == parent_last["tokens"]
        _check_parting(firsts, history)


def test_shared_step_advantage_is_the_mean_over_its_branches(tmp_path):
    records = _round_trip(TREE, tmp_path)
    branches = _branches(records)
    leaf_adv = {key: b[0]["advantages"] for key, b in branches.items()
                if not any(k[0] == key[0] and k[1].startswith(key[1] + ".") for k in branches)}
    for tree in {t for t, _ in branches}:
        values = [a for (t, _), a in leaf_adv.items() if t == tree]
        assert abs(sum(values)) < 1e-9, "GRPO advantages of a group sum to zero"
    for (tree, label), branch in branches.items():
        below = [a for (t, lab), a in leaf_adv.items()
                 if t == tree and (lab == label or lab.startswith(label + "."))]
        for r in branch:
            assert r["advantages"] == pytest.approx(np.mean(below), abs=1e-12)


def test_per_branch_repeats_each_shared_step_once_per_branch(tmp_path):
    once = _round_trip(TREE, tmp_path, "once.jsonl")
    per = _round_trip(dataclasses.replace(TREE, shared_steps="per-branch"), tmp_path, "per.jsonl")
    unique = {tuple(r["tokens"]) for r in once}
    assert len(unique) == len(once), "'once' emits no identical duplicates"
    assert {tuple(r["tokens"]) for r in per} == unique
    plans = plan(TREE)
    assert len(per) == sum(len(p.path(leaf)) for p in plans for leaf in p.leaves.tolist())
    for branch in _branches(per).values():
        # Every branch spells out its whole history, turn 0 onwards, with one advantage.
        assert [int(r["id"].split("-")[2]) for r in branch] == list(range(len(branch)))
        _check_nested_steps(branch)
        assert len({r["advantages"] for r in branch}) == 1


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("name", list(CONFIGS))
def test_summarize_matches_the_generated_records(name):
    config = CONFIGS[name]
    stats = summarize(config)
    records = list(generate(config))
    lengths = np.array([len(r["tokens"]) for r in records])
    assert stats.trajectories == len(records)
    assert np.array_equal(stats.lengths, lengths)
    assert stats.tokens == lengths.sum() and stats.max_tokens == lengths.max()
    by_tree = collections.defaultdict(list)
    for r in records:
        by_tree[r["tree"]].append(r["tokens"])
    assert stats.trie_tokens == sum(_trie_tokens(seqs) for seqs in by_tree.values())
    assert stats.step_trie_tokens == _trie_tokens(r["tokens"] for r in records)


@pytest.mark.parametrize("kind", ["stepwise", "treestep"])
def test_paper_preset_is_a_paper_scale_step(kind):
    """Paper Section 5.3: 16,170 records and 435M tokens over ten steps."""
    stats = summarize(preset("paper", kind))
    assert abs(stats.trajectories - 1600) <= 160
    if kind == "stepwise":
        assert abs(stats.tokens - 43e6) <= 4.3e6
    assert stats.max_tokens <= 65536
    # Within-microbatch compression cannot beat the trie bound; the paper
    # measured 6.6-7.6x, so the bound must be above that, not far above.
    assert 7.6 < stats.trie_bound < 15


def test_grpo_preset_is_single_turn_grpo_groups(tmp_path):
    """1,024 prompts x 16 responses, ~51M tokens; each group shares its prompt (system + task) and nothing more."""
    full = preset("grpo")
    stats = summarize(full)
    assert (stats.trajectories, full.group_size) == (16384, 16)
    assert abs(stats.tokens - 51e6) <= 5e6 and stats.max_tokens <= 300 + 1500 + 16000
    assert 1.3 < stats.trie_bound < 1.7
    records = _round_trip(dataclasses.replace(full, tasks=6), tmp_path)
    by_tree = collections.defaultdict(list)
    for r in records:
        by_tree[r["tree"]].append(r["tokens"])
    assert len(by_tree) == 6 and all(len(group) == 16 for group in by_tree.values())
    system = records[0]["tokens"][:300]
    prompts = []
    for group in by_tree.values():
        prompt = min(_lcp(group[0], other) for other in group[1:])
        assert 300 + 100 <= prompt <= 300 + 1500
        # Every two responses of a group part right after the prompt: one sample per rollout, no shared turn.
        assert all(_lcp(a, b) == prompt for a, b in itertools.combinations(group, 2))
        assert all(1 <= len(seq) - prompt <= 16000 and seq[:300] == system for seq in group)
        prompts.append(group[0][:prompt])
    assert all(_lcp(a, b) < 300 + 8 for a, b in itertools.combinations(prompts, 2))   # groups share the system only
    with pytest.raises(UsageError, match="single-turn"):
        preset("grpo", "treestep")


def test_small_default_is_small():
    stats = summarize(GenConfig())
    assert 1e5 <= stats.tokens <= 1e6


@pytest.mark.parametrize("target", [("trajectories", 300), ("tokens", 3_000_000)])
def test_scale_to_picks_the_task_count_nearest_the_target(target):
    what, value = target
    config = scale_to(GenConfig(), **{what: value})

    def miss(tasks: int) -> float:
        stats = summarize(dataclasses.replace(config, tasks=tasks))
        return abs(getattr(stats, what) - value)

    assert config.tasks > 1
    assert miss(config.tasks) <= min(miss(config.tasks - 1), miss(config.tasks + 1))


# --------------------------------------------------------------------------- files


def test_zst_output_round_trips(tmp_path):
    config = CONFIGS["tree-once-logprobs"]
    plain = write_jsonl(generate(config), tmp_path / "t.jsonl")
    packed = write_jsonl(generate(config), tmp_path / "t.jsonl.zst")
    assert packed.bytes < plain.bytes
    assert (plain.trajectories, plain.tokens) == (packed.trajectories, packed.tokens)
    assert _read(tmp_path / "t.jsonl.zst") == _read(tmp_path / "t.jsonl")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "trees.jsonl"
    target.write_text("old\n")

    def broken():
        yield from itertools.islice(generate(STEP), 3)
        raise RuntimeError("rollout worker died")

    with pytest.raises(RuntimeError):
        write_jsonl(broken(), target)
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["trees.jsonl"]


def test_cli_writes_the_file_and_prints_one_summary_line(tmp_path, capsys):
    out = tmp_path / "trees.jsonl.zst"
    assert main(["--kind", "treestep", "--tasks", "1", "--turns-max", "6", "-o", str(out),
                 "--with-logprobs", "--seed", "3"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    records = _read(out)
    assert len(err) == 1 and f"{len(records)} trajectories" in err[0] and str(out) in err[0]
    config = GenConfig(kind="treestep", tasks=1, turns_max=6, with_logprobs=True, seed=3)
    _check_contract(records, config)
    assert records == [orjson.loads(orjson.dumps(r, option=orjson.OPT_SERIALIZE_NUMPY))
                       for r in generate(config)]


@pytest.mark.parametrize("argv", [["--tasks", "0", "-o", "x.jsonl"],
                                  ["--turns-min", "9", "--turns-max", "3", "--dry-run"],
                                  ["--kind", "stepwise"],
                                  ["--system-prompt-tokens", "70000", "--dry-run"],
                                  ["--with-logprobs", "--logprob-scale", "inf", "-o", "x.jsonl"],
                                  ["--with-logprobs", "--logprob-scale", "1e300", "-o", "x.jsonl"],
                                  ["--logprob-scale", "nan", "-o", "x.jsonl"],
                                  ["--vocab-size", str(2**32), "-o", "x.jsonl"],
                                  ["--tool-tokens-median", "nan", "-o", "x.jsonl"],
                                  ["--target-tokens", "0", "-o", "x.jsonl"],
                                  ["--tasks", "1", "-o", "x.jsonl.gz"],
                                  ["--tasks", "1", "-o", "x.jsonl.XZ"]],
                         ids=["no-tasks", "turns-reversed", "no-output", "prompt-over-limit",
                              "logprob-scale-inf", "logprob-scale-overflows-float32", "logprob-scale-nan",
                              "vocab-over-int32", "median-nan", "target-0", "gzip-name", "xz-name"])
def test_cli_rejects_bad_input_with_one_line(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harts gen: error:") and "; fix: " in err[0]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("output", ["adir", "afile/x.jsonl"], ids=["a-folder", "under-a-file"])
def test_cli_refuses_an_output_path_that_cannot_be_a_file(output, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("keep")
    assert main(["--tasks", "1", "-o", output]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harts gen: error: cannot write") and "; fix: " in err[0]
    assert sorted(os.listdir(tmp_path)) == ["adir", "afile"] and os.listdir("adir") == []


def test_the_largest_logprob_scale_still_writes_finite_float32(tmp_path):
    config = GenConfig(tasks=1, group_size=2, turns_min=1, turns_max=2, system_prompt_tokens=8,
                       task_tokens_min=4, task_tokens_max=8, tool_tokens_min=1, tool_tokens_max=16,
                       context_limit=128, with_logprobs=True, logprob_scale=1e30)
    for record in generate(config):
        assert np.isfinite(record["old_logprobs"]).all()


def test_python_dash_m_runs(tmp_path):
    run = subprocess.run([sys.executable, "-m", "harts.tools.gen", "--preset", "paper",
                          "--dry-run"], capture_output=True, text=True, check=False)
    assert run.returncode == 0 and "trajectories" in run.stderr


def test_refusals_name_the_bound_and_the_default_they_suggest():
    """Found by a CLI audit: vocab_size 2 was refused with "must be >= 2, ...", and a tool-output median with
    the action median's default."""
    with pytest.raises(ValueError, match=r"vocab_size must be >= 4 \(.*\), got 2; fix: .* to 4 or more"):
        GenConfig(vocab_size=2)
    with pytest.raises(ValueError, match=r"tool_tokens_median .* e\.g\. 400$"):
        GenConfig(tool_tokens_median=math.inf)


@pytest.mark.parametrize("field, value, words", [
    ("system_prompt_tokens", 10.5, "system_prompt_tokens must be an integer, got 10.5 (float)"),
    ("tasks", True, "tasks must be an integer, got True (bool)"),
    ("tasks", "2", "tasks must be an integer, got '2' (str)"),
    ("with_logprobs", 1, "with_logprobs must be True or False, got 1 (int)"),
    ("kind", None, "kind must be a string, got None (NoneType)"),
])
def test_python_callers_get_one_line_for_a_value_of_the_wrong_type(field, value, words):
    """Found by a tools audit: a float length was accepted and failed later inside numpy; True was one task."""
    with pytest.raises(ValueError, match=re.escape(words)):
        GenConfig(**{field: value})
    GenConfig(tasks=np.int64(2), branch_prob=1, action_tokens_median=np.float32(50))   # any integer; ints as floats


@pytest.mark.parametrize("bad", [
    {"kind": "tree"}, {"group_size": 0}, {"task_tokens_min": 0}, {"turns_min": 0},
    {"action_tokens_median": 0.0}, {"tool_tokens_sigma": -1.0}, {"vocab_size": 1},
    {"branch_prob": 1.5}, {"branch_factor": 1}, {"kind": "treestep", "max_branches": 2},
    {"shared_steps": "twice"}, {"seed": -1}, {"context_limit": 4096},
    {"logprob_scale": math.inf}, {"logprob_scale": 1e31}, {"logprob_scale": math.nan},
    {"vocab_size": 2**31 + 1}, {"action_tokens_sigma": math.nan}, {"tool_tokens_median": math.inf},
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_config_rejects_bad_values(bad):
    """Every refusal says what was expected, what was found and the fix, naming the flag."""
    flag = "--" + list(bad)[-1].replace("_", "-")
    with pytest.raises(ValueError, match=r"^GenConfig: .*, got .*; fix: .*") as caught:
        GenConfig(**bad)
    assert flag in str(caught.value)


def test_a_large_stepwise_group_needs_no_max_branches():
    assert GenConfig(group_size=32).max_branches < 32


# --------------------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["stepwise", "treestep"]),
       shared=st.sampled_from(["once", "per-branch"]),
       group=st.integers(1, 4), turns=st.integers(1, 8), extra_turns=st.integers(0, 6),
       limit=st.integers(100, 3000), prob=st.floats(0.0, 1.0), vocab=st.integers(4, 50),
       seed=st.integers(0, 2**32))
def test_any_small_config_gives_valid_prefix_structured_samples(
        kind, shared, group, turns, extra_turns, limit, prob, vocab, seed):
    """Whatever the knobs: contract-valid records; each branch's samples nested prefixes;
    siblings part at their first token even in a tiny vocabulary (the trie is as planned)."""
    config = GenConfig(kind=kind, shared_steps=shared, tasks=2, group_size=group,
                       system_prompt_tokens=16, task_tokens_min=1, task_tokens_max=40,
                       turns_min=turns, turns_max=turns + extra_turns, action_tokens_median=10,
                       tool_tokens_median=30, tool_tokens_min=1, context_limit=limit,
                       vocab_size=vocab, branch_prob=prob, max_branches=group + 4,
                       with_logprobs=True, seed=seed)
    records = [orjson.loads(orjson.dumps(r, option=orjson.OPT_SERIALIZE_NUMPY))
               for r in generate(config)]
    _check_contract(records, config)
    for branch in _branches(records).values():
        _check_nested_steps(branch)
    stats = summarize(config)
    assert stats.trajectories == len(records)
    by_tree = collections.defaultdict(list)
    for r in records:
        by_tree[r["tree"]].append(r["tokens"])
    assert stats.trie_tokens == sum(_trie_tokens(seqs) for seqs in by_tree.values())


def _file_size_limit_of_4_kib():
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit then fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE semantics are Linux's")
@pytest.mark.parametrize("name", ["trees.jsonl", "trees.jsonl.zst"])
def test_a_write_that_fails_midway_is_one_line_naming_the_file(tmp_path, name):
    done = subprocess.run([sys.executable, "-m", "harts.cli", "gen", "-o", str(tmp_path / name)],
                          preexec_fn=_file_size_limit_of_4_kib,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"harts gen: error: cannot write {tmp_path / name}: File too large; "
                                        "fix: free disk space or choose another folder"]
    assert os.listdir(tmp_path) == []


def test_tree_step_flags_warn_with_step_wise_rollouts(tmp_path, capsys):
    """Found by a tools audit: `--kind stepwise --max-branches 0` was taken silently."""
    assert TREESTEP_ONLY == {"branch_prob", "branch_factor", "max_branches", "shared_steps"}
    assert main(["--max-branches", "3", "--shared-steps", "per-branch", "--dry-run"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"harts gen: warning: --{flag} has no effect with --kind stepwise (only tree-step rollouts "
                        "fork)" for flag in ("max-branches", "shared-steps")]
    assert main(["--kind", "treestep", "--max-branches", "9", "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err
