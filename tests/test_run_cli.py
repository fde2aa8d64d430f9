"""`harts init-model` and `harts run` as a user runs them: files in, files out.

Run: `python -m pytest tests/test_run_cli.py -q`.
"""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import orjson
import pytest
from safetensors.numpy import load_file

from harts.cli import main as harts
from harts.compiler.cli import main as hartsc
from harts.executor.cli import check_npz_ids, logprobs_bytes
from harts.schema.errors import HartsError

from run_workspace import make_run_workspace

TREES = [
    {"id": "a", "tokens": [5, 6, 7, 8, 9, 10, 11, 12], "advantages": 0.5, "old_logprobs": [-1.0] * 8},
    {"id": 7, "tokens": [5, 6, 7, 8, 20, 21], "advantages": -0.5, "old_logprobs": [-2.0] * 6,
     "loss_mask": [0, 0, 0, 0, 1, 1]},
    {"id": "c", "tokens": [5, 6, 7], "advantages": 1.0, "old_logprobs": [-1.5] * 3},
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_run_workspace(tmp_path_factory.mktemp("run"), TREES)


@pytest.mark.parametrize("loss", ["nll", "grpo", "ppo"])
def test_run_writes_logprobs_and_gradients(workspace, loss):
    lp_path, g_path = workspace / f"lp-{loss}.npz", workspace / f"g-{loss}.safetensors"
    assert harts(["run", str(workspace / "step.plan"), "--model", str(workspace / "model"), "--loss", loss,
                  "--logprobs-out", str(lp_path), "--grads-out", str(g_path)]) == 0
    logprobs = np.load(lp_path)
    assert sorted(logprobs.files) == ["7", "a", "c"]
    for record in TREES:
        lp = logprobs[str(record["id"])]
        assert lp.dtype == np.float32 and len(lp) == len(record["tokens"])
        assert np.isnan(lp[0]) and np.all(lp[1:] < 0)
    # Shared prefixes get the same log-probability in every trajectory that contains them.
    np.testing.assert_array_equal(logprobs["a"][:3], logprobs["c"])
    grads = load_file(g_path)
    assert "model.embed_tokens.weight" in grads and "lm_head.weight" in grads
    assert all(np.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("ids, words", [
    (["a", "a.npy"], "ids 'a' and 'a.npy' cannot be told apart"),
    ([7, "7.npy"], "ids '7' and '7.npy'"),
    (["nul\x00x", "b"], "holds a NUL character"),
])
def test_ids_an_npz_cannot_give_back_are_refused_before_the_run(ids, words):
    """Found by a user audit: np.load(lp)["a.npy"] returned id "a"'s values, and an id with a NUL came back
    cut at it. Every id the check lets through does come back (test below); these do not."""
    with pytest.raises(HartsError, match=words):
        check_npz_ids(ids)
    logprobs = {str(key): np.full(3 + i, float(i), dtype=np.float32) for i, key in enumerate(ids)}
    with np.load(io.BytesIO(logprobs_bytes(logprobs))) as loaded:
        assert any(key not in loaded.files or not np.array_equal(loaded[key], values)
                   for key, values in logprobs.items())


def test_logprobs_file_keeps_every_id(tmp_path):
    # Ids are user strings: some spell np.savez's own parameters, others look like paths.
    ids = ["file", "allow_pickle", "args", "kwds", "a/b", "../up", "x.npy", "\u00fcn\u00efcode", "7", ""]
    check_npz_ids(ids)
    logprobs = {key: np.array([np.nan, -float(i), -0.5], dtype=np.float32) for i, key in enumerate(ids)}
    path = tmp_path / "lp.npz"
    path.write_bytes(logprobs_bytes(logprobs))
    with np.load(path) as loaded:
        assert sorted(loaded.files) == sorted(ids)
        for key, values in logprobs.items():
            assert loaded[key].dtype == np.float32
            np.testing.assert_array_equal(loaded[key], values)


def test_expanded_and_no_replay_give_the_same_outputs(workspace):
    outputs = {}
    for flags in ([], ["--mode", "expanded"], ["--no-replay"]):
        name = "-".join(flags) or "compact"
        lp, g = workspace / f"{name}.npz", workspace / f"{name}.safetensors"
        assert harts(["run", str(workspace / "step.plan"), "--model", str(workspace / "model"),
                      "--logprobs-out", str(lp), "--grads-out", str(g), *flags]) == 0
        outputs[name] = (np.load(lp), load_file(g))
    base_lp, base_g = outputs.pop("compact")
    for lp, g in outputs.values():
        for key in base_lp.files:
            np.testing.assert_allclose(lp[key][1:], base_lp[key][1:], atol=1e-5)
        for key, value in base_g.items():
            np.testing.assert_allclose(g[key], value, rtol=1e-3, atol=1e-6)


def test_loss_positions_only(workspace):
    """--logprobs loss writes NaN where the loss reads nothing (trajectory 7's masked prompt) and the same
    values and gradients elsewhere."""
    outputs = {}
    for which in ("all", "loss"):
        lp, g = workspace / f"which-{which}.npz", workspace / f"which-{which}.safetensors"
        assert harts(["run", str(workspace / "step.plan"), "--model", str(workspace / "model"), "--loss", "grpo",
                      "--logprobs", which, "--logprobs-out", str(lp), "--grads-out", str(g)]) == 0
        outputs[which] = (np.load(lp), load_file(g))
    (every, g_every), (only, g_only) = outputs["all"], outputs["loss"]
    assert np.all(np.isnan(only["7"][:4])) and not np.any(np.isnan(every["7"][1:4]))
    np.testing.assert_allclose(only["7"][4:], every["7"][4:], atol=1e-6)
    np.testing.assert_allclose(only["a"][1:], every["a"][1:], atol=1e-6)
    for key, value in g_every.items():
        np.testing.assert_allclose(g_only[key], value, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("spelling", ["json", "orjson"])
def test_a_runs_logprobs_pass_back_as_old_logprobs(workspace, spelling):
    """PPO's usual loop: the behaviour policy's log-probabilities, written by `harts run --logprobs loss`
    (NaN where no loss reads), become the next step's old_logprobs as they are, whichever JSON writer
    spells NaN (Python's json: the literal NaN; orjson: null). Same policy, so every ratio is 1 and the
    ppo loss is minus the token mean of the trained advantages."""
    folder = workspace / f"again-{spelling}"
    folder.mkdir()
    lp = folder / "behaviour.npz"
    assert harts(["run", str(workspace / "step.plan"), "--model", str(workspace / "model"), "--forward-only",
                  "--logprobs", "loss", "--logprobs-out", str(lp)]) == 0
    behaviour = np.load(lp)
    dumps = (lambda r: json.dumps(r)) if spelling == "json" else (lambda r: orjson.dumps(r).decode())
    records = [{**r, "old_logprobs": behaviour[str(r["id"])].astype(float).tolist()} for r in TREES]
    (folder / "trees.jsonl").write_text("".join(dumps(r) + "\n" for r in records))
    assert hartsc([str(folder / "trees.jsonl"), "-o", str(folder / "step.plan"), "--chunk-size", "2"]) == 0
    summary = folder / "summary.json"
    with open(summary, "w") as out, contextlib.redirect_stdout(out):
        assert harts(["run", str(folder / "step.plan"), "--model", str(workspace / "model"), "--loss", "ppo",
                      "--forward-only", "--json"]) == 0
    trained = [(r["advantages"], m) for r in TREES for m in (r.get("loss_mask") or [1] * len(r["tokens"]))[1:]]
    expected = -sum(a for a, m in trained if m) / sum(m for _, m in trained)
    assert json.loads(summary.read_text())["loss"] == pytest.approx(expected, abs=1e-5)


def test_a_step_that_trains_nothing_runs_with_a_warning(workspace, tmp_path, capsys):
    trees = tmp_path / "masked.jsonl"
    trees.write_text('{"id": 1, "tokens": [5, 6, 7], "loss_mask": [1, 0, 0]}\n'
                     '{"id": 2, "tokens": [5, 6, 8], "loss_mask": [0, 0, 0]}\n')
    assert hartsc([str(trees), "-o", str(tmp_path / "masked.plan"), "--chunk-size", "2"]) == 0
    capsys.readouterr()
    assert harts(["run", str(tmp_path / "masked.plan"), "--model", str(workspace / "model")]) == 0
    err = capsys.readouterr().err
    assert "warning: no position of the step has loss_mask 1" in err and "loss 0.000000" in err
    assert harts(["run", str(workspace / "step.plan"), "--model", str(workspace / "model")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_bad_model_directory_is_one_line(workspace, tmp_path, capsys):
    assert harts(["run", str(workspace / "step.plan"), "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no config.json" in err and "fix:" in err


def test_vocabulary_mismatch_is_one_line(workspace, tmp_path, capsys):
    assert harts(["init-model", "--vocab-size", "16", "-o", str(tmp_path / "small")]) == 0
    capsys.readouterr()
    assert harts(["run", str(workspace / "step.plan"), "--model", str(tmp_path / "small")]) == 2
    err = capsys.readouterr().err.strip()
    # The largest token, 21, is the last of trajectory 7: the line names where it sits.
    assert "\n" not in err and "trajectory 7: token 21 at position 5 is outside the model's vocabulary of 16" in err
    assert "the plan was compiled for a vocabulary of 64 (--vocab-size); fix: run it with the model" in err


def test_a_plan_compiled_for_another_vocabulary_says_so():
    """Without --vocab-size the plan checked nothing: compiling with it is the fix; with it, the model is."""
    from types import SimpleNamespace

    import harts.api as api
    from harts.executor.runtime import check_model_fits

    small = SimpleNamespace(config=SimpleNamespace(vocab_size=16))
    unchecked = api.compile_trajectories([[1, 2, 30], [1, 2, 3]], capacity=16, chunk_size=2)
    with pytest.raises(api.UsageError, match=r"fix: use the model the tokens come from \(compile with --vocab-size"):
        check_model_fits(unchecked, small)
    plan = api.compile_trajectories([[1, 2, 30], [1, 2, 3]], vocab_size=32, capacity=16, chunk_size=2)
    with pytest.raises(api.UsageError, match="token 30 at position 2 is outside the model's vocabulary of 16 entries; "
                                             "the plan was compiled for a vocabulary of 32"):
        check_model_fits(plan, small)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line(workspace, capsys):
    assert harts(["run", str(workspace / "step.plan"), "--model", str(workspace / "model"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no CUDA device" in err and "--device cpu" in err


def test_entropy_is_reported_and_weighed(workspace, capsys):
    # --entropy reports the trained positions' entropy without changing the gradient; --entropy-coef
    # subtracts coef x entropy from what is differentiated (objective), and the loss stays the policy loss.
    base = ["run", str(workspace / "step.plan"), "--model", str(workspace / "model"), "--loss", "grpo", "--json"]
    assert harts(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "entropy" not in plain
    assert harts([*base, "--entropy"]) == 0
    reported = json.loads(capsys.readouterr().out)
    assert reported["objective"] == pytest.approx(plain["objective"], rel=1e-12)
    # A tiny random model predicts nearly uniformly over its 64 tokens: the entropy is just below log 64.
    assert 0.9 * np.log(64) < reported["entropy"] <= np.log(64) + 1e-6
    assert harts([*base, "--entropy-coef", "0.5"]) == 0
    weighed = json.loads(capsys.readouterr().out)
    assert weighed["loss"] == pytest.approx(plain["loss"], rel=1e-12)
    assert weighed["objective"] == pytest.approx(plain["objective"] - 0.5 * reported["entropy"], rel=1e-9)
