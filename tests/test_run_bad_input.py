"""Bad input to `harts run`, `harts init-model` and `harts demo`: one line, exit 2, nothing half-written.

Run: `python -m pytest tests/test_run_bad_input.py -q` (about a minute on two CPU cores).
Why: these front ends sit at the end of an RL framework's pipeline; a
traceback, a silently NaN loss, a JSON line a strict parser rejects, or one
output file of two would each cost a training step or corrupt one. Most cases
stop before the model runs; the few that need a step result fake it, so the
file stays fast.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from harts.cli import main as harts

from run_workspace import make_run_workspace
from harts.executor import cli as run_cli
from harts.executor import runtime
from harts.executor.losses import LossConfig
from harts.executor.models import init_model as init_model_module
from harts.schema.errors import OutputError, UsageError
from harts.schema.plan import read_plan, write_plan

TREES = [
    {"id": "a", "tokens": [5, 6, 7, 8, 9, 10], "advantages": 0.5},
    {"id": "b", "tokens": [5, 6, 7, 11, 12], "advantages": -0.5},
]
DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny model and a plan without ref_logprobs, shared by the module's tests."""
    return make_run_workspace(tmp_path_factory.mktemp("bad-run"), TREES)


def one_line(capsys) -> str:
    """The single stderr line a refused command prints (fails on a traceback or several lines)."""
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    assert "fix:" in err, err
    return err


def run_argv(workspace, *flags, model=None) -> list[str]:
    return ["run", str(workspace / "step.plan"), "--model", str(model or workspace / "model"), *flags]


def fake_result() -> runtime.StepResult:
    """A step result without running the model: the CLI's writing and reporting under test."""
    logprobs = {r["id"]: np.full(len(r["tokens"]), -1.0, dtype=np.float32) for r in TREES}
    return runtime.StepResult(logprobs=logprobs, loss=0.5, objective=0.5, grads={"w": torch.ones(2)},
                              moe_load={}, moe_aux_loss=0.0, moe_z_loss=0.0, seconds=0.1, rows=9)


# --------------------------------------------------------------------------- harts run: the model


def test_truncated_weights_are_one_line_naming_the_model(workspace, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(workspace / "model"):
        data = (workspace / "model" / name).read_bytes()
        # Keep the header, cut the tensors: safetensors' "incomplete metadata".
        (broken / name).write_bytes(data[: len(data) // 2] if name.endswith(".safetensors") else data)
    assert harts(run_argv(workspace, model=broken)) == 2
    err = one_line(capsys)
    assert str(broken) in err and "cannot load the model" in err


@pytest.mark.parametrize("damage, words", [
    ("drop-one", "the weights lack 1 tensor(s) the config needs"),
    ("drop-all-but-embeddings", "tensor(s) the config needs"),
    ("reshape-lm-head", "tensor(s) in the weights have other shapes than the config says (first: lm_head.weight"),
])
def test_weights_missing_tensors_or_in_other_shapes_are_refused(workspace, tmp_path, capsys, damage, words):
    """transformers fills a missing or misshapen parameter with fresh random values and carries on (a found
    bug: gradients of a partly random model, exit 0, different each run); HARTS refuses in one line."""
    from safetensors.torch import load_file, save_file
    model = tmp_path / "model"
    shutil.copytree(workspace / "model", model)
    tensors = load_file(model / "model.safetensors")
    if damage == "drop-one":
        del tensors[sorted(k for k in tensors if ".layers.0." in k)[0]]
    elif damage == "drop-all-but-embeddings":
        tensors = {k: v for k, v in tensors.items() if "embed" in k or "lm_head" in k}
    else:
        tensors["lm_head.weight"] = tensors["lm_head.weight"][:3].contiguous()
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert harts(run_argv(workspace, model=model)) == 2
    err = one_line(capsys)
    assert err.startswith(f"harts run: {model}: ") and words in err


@pytest.mark.parametrize("model_type", ["llama", "foo_bar"])
def test_an_unsupported_model_type_is_named_before_the_weights_load(workspace, tmp_path, capsys, model_type):
    """Found by a user audit: a type transformers does not know got the fix for a damaged weights file."""
    model = tmp_path / "model"
    shutil.copytree(workspace / "model", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, model_type=model_type)))
    assert harts(run_argv(workspace, model=model)) == 2
    err = one_line(capsys)
    assert err == (f"harts run: {model}: model type {model_type!r} is not supported; fix: use one of kimi_linear, "
                   "qwen3_next (harts init-model writes one)")


def test_a_missing_model_folder_says_so(workspace, tmp_path, capsys):
    assert harts(run_argv(workspace, model=tmp_path / "nowhere")) == 2
    assert "nowhere: no such folder" in one_line(capsys)


# --------------------------------------------------------------------------- harts run: outputs


@pytest.fixture
def no_model_load(monkeypatch):
    """Output paths must be refused before the model loads: loading fails the test."""
    def refuse(*_, **__):
        raise AssertionError("the model was loaded before the output paths were checked")

    monkeypatch.setattr(run_cli, "load_model", refuse)


@pytest.mark.parametrize("outputs", [
    ("lp.npz", "adir"), ("afile/lp.npz", None), ("same.out", "same.out"), ("step.plan", None),
], ids=["grads-into-folder", "under-a-file", "same-path", "overwrites-plan"])
def test_bad_output_paths_are_refused_before_the_model_loads(workspace, tmp_path, capsys, no_model_load, outputs):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    before = sorted(os.listdir(tmp_path))
    logprobs, grads = (None if p is None else str(workspace / p if p == "step.plan" else tmp_path / p)
                       for p in outputs)
    flags = ["--logprobs-out", logprobs] + (["--grads-out", grads] if grads else [])
    assert harts(run_argv(workspace, *flags)) == 2
    assert "cannot write" in one_line(capsys)
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("flag", ["--logprobs-out", "--grads-out"])
def test_an_empty_output_path_is_refused_not_taken_as_none(workspace, capsys, no_model_load, flag):
    """`--logprobs-out "$UNSET"` ran and wrote nothing with exit 0 (found by a user audit)."""
    assert harts(run_argv(workspace, flag, "")) == 2
    assert "the output path is empty" in one_line(capsys)


def test_two_outputs_through_a_symlink_to_one_file_are_refused(workspace, tmp_path, capsys, no_model_load):
    """Outputs are written through symlinks, so a link and its target are the same output."""
    (tmp_path / "link.out").symlink_to(tmp_path / "real.out")
    flags = ["--logprobs-out", str(tmp_path / "link.out"), "--grads-out", str(tmp_path / "real.out")]
    assert harts(run_argv(workspace, *flags)) == 2
    assert "name the same file" in one_line(capsys)


def test_a_model_file_as_output_is_refused(workspace, capsys, no_model_load):
    target = workspace / "model" / "model.safetensors"
    before = target.read_bytes()
    assert harts(run_argv(workspace, "--grads-out", str(target))) == 2
    assert "also an input" in one_line(capsys)
    assert target.read_bytes() == before


def write_plan_breaking_an_invariant(workspace, tmp_path) -> Path:
    """The workspace plan with one sequence moved one row on: structurally sound (it reads), semantically
    broken (`harts check` rejects it). The executor would run it to wrong log-probabilities."""
    plan = read_plan(workspace / "step.plan")
    mb = plan.microbatches[0]
    mb["sequence_row_start"] = mb["sequence_row_start"].copy()
    mb["sequence_row_start"][-1] += 1
    mb["sequence_num_rows"] = mb["sequence_num_rows"].copy()
    mb["sequence_num_rows"][-1] -= 1
    path = tmp_path / "broken.plan"
    write_plan(plan, path)
    return path


def test_a_plan_breaking_an_invariant_is_refused_before_the_model_loads(workspace, tmp_path, capsys, no_model_load):
    broken = write_plan_breaking_an_invariant(workspace, tmp_path)
    assert harts(["run", str(broken), "--model", str(workspace / "model"),
                  "--logprobs-out", str(tmp_path / "lp.npz")]) == 2
    err = one_line(capsys)
    assert str(broken) in err and "sequences tile the rows" in err
    assert not (tmp_path / "lp.npz").exists()
    # --no-check skips the verification: the model is then loaded (and the fixture refuses it).
    with pytest.raises(AssertionError, match="the model was loaded"):
        harts(["run", str(broken), "--model", str(workspace / "model"), "--no-check"])


@pytest.mark.parametrize("backend, message", [
    ("triton", "HARTS_LINEAR_ATTENTION must be one of auto, torch, fla"),
    ("fla", "the fla backend needs CUDA tensors, chunk size 64"),   # the workspace plan has B = 2, on the CPU
])
def test_a_linear_attention_backend_that_cannot_run_is_refused_before_the_model_loads(
        workspace, capsys, no_model_load, monkeypatch, backend, message):
    monkeypatch.setenv("HARTS_LINEAR_ATTENTION", backend)
    assert harts(run_argv(workspace, "--device", "cpu")) == 2
    assert message in one_line(capsys)


def test_logprobs_and_grads_appear_together_or_not_at_all(workspace, tmp_path, capsys, monkeypatch):
    """The grads target turns into a folder while the step runs: no logprobs file may be left."""
    lp, grads = tmp_path / "lp.npz", tmp_path / "g.safetensors"

    def step_then_block_grads(plan, *_, **__):
        grads.mkdir()
        return fake_result()

    monkeypatch.setattr(runtime, "run_step", step_then_block_grads)
    assert harts(run_argv(workspace, "--logprobs-out", str(lp), "--grads-out", str(grads))) == 2
    assert "cannot write" in one_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ["g.safetensors"] and not lp.exists()


# --------------------------------------------------------------------------- harts run: the loss


@pytest.mark.parametrize("flags", [
    ["--loss", "grpo", "--clip-low", "nan"], ["--clip-low", "1"], ["--clip-low", "-0.1"],
    ["--clip-high", "-1"], ["--clip-high", "inf"], ["--kl-coef", "nan"], ["--kl-coef", "-0.1"],
    ["--moe-aux-coef", "inf"], ["--moe-z-coef", "-1"], ["--entropy-coef", "nan"], ["--entropy-coef", "-0.01"],
], ids=lambda f: "=".join(f[-2:]))
def test_illegal_loss_flags_are_one_line(workspace, capsys, no_model_load, flags):
    assert harts(run_argv(workspace, "--json", *flags)) == 2
    err = one_line(capsys)
    assert flags[-2] in err and "LossConfig" in err


@pytest.mark.parametrize("flags", [["--clip-low", "0.1"], ["--clip-high", "0.28"], ["--kl-coef", "0.05"]],
                         ids=lambda f: "=".join(f[-2:]))
def test_policy_flags_are_refused_with_nll(workspace, capsys, no_model_load, flags):
    # nll has no ratio and no KL term: a value it would ignore is a mistake worth one line, not a silent no-op.
    assert harts(run_argv(workspace, "--json", *flags)) == 2
    err = one_line(capsys)
    assert flags[-2] in err and "has no effect with" in err and "nll" in err


def test_policy_flags_at_their_defaults_pass_with_nll_and_apply_to_grpo():
    parse = run_cli.build_parser().parse_args
    common = ["step.plan", "--model", "m", "--clip-low", "0.2", "--clip-high", "0.2", "--kl-coef", "0"]
    assert run_cli.loss_config(parse(common)) == LossConfig()   # a launcher passing every default
    config = run_cli.loss_config(parse(["step.plan", "--model", "m", "--loss", "grpo", "--clip-high", "0.28"]))
    assert (config.kind, config.clip_low, config.clip_high, config.kl_coef) == ("grpo", 0.2, 0.28, 0.0)


def test_nll_rejects_a_kl_weight_from_python_too():
    with pytest.raises(UsageError, match="no effect with kind 'nll'"):
        LossConfig(kind="nll", kl_coef=0.1)
    assert LossConfig(kind="grpo", kl_coef=0.1).kl_coef == 0.1


@pytest.mark.parametrize("fields", [
    {"kind": "sft"}, {"reduction": "sum"}, {"clip_low": math.nan}, {"clip_high": math.inf},
    {"kl_coef": -1.0}, {"moe_aux_coef": math.nan}, {"moe_z_coef": True},
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_loss_config_refuses_illegal_fields(fields):
    with pytest.raises(ValueError, match=rf"LossConfig\.{next(iter(fields))} .*; fix: "):
        LossConfig(**fields)


def strict_json(text: str):
    """json.loads as strict parsers (Go, serde_json, JSON.parse) read it: no NaN, no Infinity."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_json_never_prints_nan(workspace, capsys, monkeypatch):
    """A diverged step (NaN loss) still prints strict JSON: null where the value is not finite."""
    def diverged(plan, *_, **__):
        result = fake_result()
        result.loss, result.objective, result.moe_z_loss = math.nan, math.nan, math.inf
        return result

    monkeypatch.setattr(runtime, "run_step", diverged)
    assert harts(run_argv(workspace, "--json")) == 0
    out, err = capsys.readouterr()
    summary = strict_json(out)
    assert summary["loss"] is None and summary["objective"] is None and summary["moe_z_loss"] is None
    assert summary["moe_aux_loss"] == 0.0 and summary["decoder_rows"] == 9
    assert "written as null" in err


def test_kl_coef_without_ref_logprobs_is_refused_as_the_contract_says(workspace, capsys):
    """docs/input-contract.md quotes the exact line; the plan has no ref_logprobs."""
    assert harts(run_argv(workspace, "--loss", "grpo", "--kl-coef", "0.1", "--forward-only")) == 2
    err = one_line(capsys)
    assert err.startswith("harts run: --kl-coef 0.1 needs ref_logprobs")
    assert err in (DOCS / "input-contract.md").read_text()


# --------------------------------------------------------------------------- harts init-model


@pytest.mark.parametrize("flags", [
    ["--vocab-size", "0"], ["--vocab-size", "-5"], ["--arch", "qwen3_next", "--vocab-size", "1"],
    ["--vocab-size", str(2**31)], ["--seed", "-1"],
], ids=["vocab-0", "vocab-negative", "qwen-vocab-1", "vocab-huge", "seed-negative"])
def test_init_model_refuses_out_of_range_flags(tmp_path, capsys, flags):
    assert harts(["init-model", *flags, "-o", str(tmp_path / "m")]) == 2
    assert flags[-2] in one_line(capsys)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("target", ["afile", "afile/m", "notes"], ids=["a-file", "under-a-file", "foreign-folder"])
def test_init_model_refuses_targets_it_must_not_write(tmp_path, capsys, target):
    (tmp_path / "afile").write_text("keep")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep")
    for replace in ([], ["--replace"]):
        assert harts(["init-model", "-o", str(tmp_path / target), *replace]) == 2
        assert "cannot write" in one_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ["afile", "notes"]
    assert (tmp_path / "afile").read_text() == "keep" and os.listdir(tmp_path / "notes") == ["todo.txt"]


def test_init_model_refuses_a_critic_it_cannot_start_from_the_given_policy(tmp_path, capsys):
    """`--critic --from POLICY`: each refusal one line before any weights load, and nothing written."""
    policy, critic = tmp_path / "policy", tmp_path / "critic"
    assert harts(["init-model", "--vocab-size", "16", "-o", str(policy)]) == 0
    assert harts(["init-model", "--vocab-size", "16", "--critic", "-o", str(critic)]) == 0
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "empty").mkdir()
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "config.json").write_text((policy / "config.json").read_text())
    (tmp_path / "torn" / "model.safetensors").write_bytes(b"not safetensors")
    from safetensors.torch import load_file, save_file
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text((policy / "config.json").read_text())
    weights = load_file(policy / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "partial" / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    cases = [
        (["--from", str(policy)], "--from is read with --critic only"),
        (["--critic", "--from", str(policy), "--arch", "qwen3_next"], "--arch does not apply with --from"),
        (["--critic", "--from", str(policy), "--vocab-size", "16"], "--vocab-size does not apply with --from"),
        (["--critic", "--from", str(tmp_path / "missing")], "no such folder"),
        (["--critic", "--from", str(tmp_path / "empty")], "cannot read its config.json"),
        (["--critic", "--from", str(tmp_path / "llama")], "model type 'llama' is not supported"),
        (["--critic", "--from", str(critic)], "not a causal LM"),
        (["--critic", "--from", str(tmp_path / "torn")], "cannot load its weights"),
        (["--critic", "--from", str(tmp_path / "partial")], "lack 1 backbone tensor(s) (first: model.norm.weight)"),
        (["--critic", "--from", str(policy), "--seed", "-1"], "--seed -1"),
    ]
    for flags, message in cases:
        assert harts(["init-model", *flags, "-o", str(tmp_path / "out")]) == 2, flags
        err = one_line(capsys)
        assert message in err and "fix:" in err, (flags, err)
    assert harts(["init-model", "--critic", "--from", str(policy), "-o", str(policy), "--replace"]) == 2
    assert "it is the --from folder" in one_line(capsys)
    assert harts(["init-model", "--critic", "--from", "", "-o", str(tmp_path / "out")]) == 2
    assert "the policy folder path is empty" in one_line(capsys)
    assert harts(["init-model", "--critic", "--from", str(tmp_path / "partial"), "-o", str(tmp_path / "out")]) == 2
    assert "cannot load" not in one_line(capsys)   # the missing tensor's own line, not wrapped in another
    assert sorted(os.listdir(tmp_path)) == ["critic", "empty", "llama", "partial", "policy", "torn"]
    assert json.loads((policy / "config.json").read_text())["architectures"] == ["KimiLinearForCausalLM"]


def test_init_model_starts_a_critic_whatever_architectures_a_policy_lists(tmp_path, capsys):
    """config.json's `architectures` may be missing or malformed (the family is `model_type`'s); a string
    naming another class is still refused. A sharded critic init-model wrote is replaced with --replace."""
    policy = tmp_path / "policy"
    assert harts(["init-model", "--vocab-size", "16", "-o", str(policy)]) == 0
    config = json.loads((policy / "config.json").read_text())
    for name, value in (("missing", None), ("number", 5), ("string", "KimiLinearForCausalLM")):
        folder = tmp_path / name
        shutil.copytree(policy, folder)
        (folder / "config.json").write_text(json.dumps({**config, "architectures": value}))
        assert harts(["init-model", "--critic", "--from", str(folder), "-o", str(tmp_path / f"critic-{name}")]) == 0
    (tmp_path / "number" / "config.json").write_text(json.dumps({**config, "architectures": "KimiLinearModel"}))
    capsys.readouterr()
    assert harts(["init-model", "--critic", "--from", str(tmp_path / "number"), "-o", str(tmp_path / "x")]) == 2
    assert "not a causal LM (architectures KimiLinearModel)" in one_line(capsys)

    from harts.api import critic_class
    sharded = tmp_path / "critic-missing"
    model = critic_class("kimi_linear").from_pretrained(sharded)
    shutil.rmtree(sharded)
    model.save_pretrained(sharded, max_shard_size="200KB")   # a large policy's critic is written in shards
    assert any(name.startswith("model-00001-of-") for name in os.listdir(sharded))
    assert harts(["init-model", "--critic", "--from", str(policy), "-o", str(sharded), "--replace"]) == 0
    assert sorted(os.listdir(sharded)) == ["config.json", "model.safetensors"]


def test_init_model_replaces_an_earlier_model_only_when_asked(tmp_path, capsys):
    target = tmp_path / "m"
    assert harts(["init-model", "--vocab-size", "16", "-o", str(target)]) == 0
    capsys.readouterr()
    assert harts(["init-model", "--vocab-size", "32", "-o", str(target)]) == 2
    assert "--replace" in one_line(capsys)
    assert json.loads((target / "config.json").read_text())["vocab_size"] == 16
    assert harts(["init-model", "--vocab-size", "32", "-o", str(target), "--replace"]) == 0
    assert json.loads((target / "config.json").read_text())["vocab_size"] == 32
    assert os.listdir(tmp_path) == ["m"]


def test_init_model_files_get_the_default_mode(tmp_path):
    # safetensors writes its weights 0o600; another account reading the model must be able to open them.
    old = os.umask(0o022)
    try:
        assert harts(["init-model", "--vocab-size", "16", "-o", str(tmp_path / "m")]) == 0
    finally:
        os.umask(old)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "m").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


class FailingModel:
    """save_pretrained writes part of a model, then the disk fills up."""

    def save_pretrained(self, folder):
        Path(folder).mkdir()
        (Path(folder) / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("earlier", [False, True], ids=["new-folder", "replacing"])
def test_a_failed_save_leaves_no_partial_model(tmp_path, earlier):
    target = tmp_path / "m"
    if earlier:
        target.mkdir()
        (target / "config.json").write_text('{"model_type": "kimi_linear"}')
    with pytest.raises(OutputError, match="No space left"):
        init_model_module.save_atomically(FailingModel(), target)
    assert os.listdir(tmp_path) == (["m"] if earlier else [])
    if earlier:
        assert (target / "config.json").read_text() == '{"model_type": "kimi_linear"}'


# --------------------------------------------------------------------------- harts demo


@pytest.mark.parametrize("flags", [["--seed", "-1", "--no-model"], ["--seed", "-1"]], ids=["no-model", "model"])
def test_demo_bad_seed_is_one_line_and_creates_nothing(tmp_path, capsys, flags):
    assert harts(["demo", "--out", str(tmp_path / "out"), *flags]) == 2
    assert "seed" in one_line(capsys)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("out", ["afile", "afile/demo"], ids=["a-file", "under-a-file"])
def test_demo_out_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, out):
    (tmp_path / "afile").write_text("keep")
    assert harts(["demo", "--out", str(tmp_path / out), "--no-model"]) == 2
    assert "cannot write" in one_line(capsys)
    assert os.listdir(tmp_path) == ["afile"] and (tmp_path / "afile").read_text() == "keep"


@pytest.mark.parametrize("seed", range(12))
def test_demo_compiles_whatever_the_seed(tmp_path, capsys, seed):
    """Found by a user audit: the workload's rollouts ran to 4,096 tokens against a 2,048-token capacity, so
    about half the seeds failed at the compile step."""
    assert harts(["demo", "--out", str(tmp_path), "--seed", str(seed), "--no-model"]) == 0


def test_demo_replaces_only_a_model_it_wrote(workspace, tmp_path, capsys, monkeypatch):
    """A model with exactly the files a demo writes (here the workspace's init-model output) is someone's:
    refused. A model/ beside the demo's mark is replaced."""
    from harts.tools import demo
    shutil.copytree(workspace / "model", tmp_path / "model")
    before = {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()}
    assert harts(["demo", "--out", str(tmp_path)]) == 2
    assert "holds a model no .harts-demo beside it lists as the demo's" in one_line(capsys)
    assert {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()} == before
    demo.mark_outputs(tmp_path, with_model=True)
    monkeypatch.setattr(demo, "run_model", lambda *args: 0)     # what is checked is the refusal, not the run
    assert harts(["demo", "--out", str(tmp_path)]) == 0


@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3_next"])
def test_a_short_conv_activation_our_op_lacks_is_one_line(arch):
    """Found by a user audit: a model saved with hidden_act 'gelu' loads and runs in transformers, and failed
    deep inside the first step with a traceback."""
    from transformers import AutoModelForCausalLM
    from harts.executor.models.init_model import build_model
    from harts.executor.models.registry import runner_for
    from harts.schema.errors import HartsError
    config = build_model(arch, "tiny", 64, 0).config
    config.hidden_act = "gelu"
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(HartsError, match="short convolution uses activation 'gelu'.*fix: save the model with "
                                         "hidden_act 'silu'"):
        runner_for(model)


@pytest.mark.parametrize("name", ["trees.jsonl", "step.plan"])
def test_demo_keeps_a_users_file_under_its_output_names(tmp_path, capsys, name):
    """Found by a docs audit: `harts demo --no-model --out DIR` replaced DIR's own trees.jsonl and step.plan."""
    (tmp_path / name).write_text("mine")
    assert harts(["demo", "--out", str(tmp_path), "--no-model"]) == 2
    assert "no .harts-demo beside it lists it as a demo output" in one_line(capsys)
    assert sorted(os.listdir(tmp_path)) == [name] and (tmp_path / name).read_text() == "mine"
    (tmp_path / name).unlink()
    assert harts(["demo", "--out", str(tmp_path), "--no-model"]) == 0
    assert harts(["demo", "--out", str(tmp_path), "--no-model"]) == 0     # its own outputs: replaced



def test_a_demo_without_its_model_does_not_claim_the_folders_model(workspace, tmp_path, capsys):
    """Found by a regression audit: `harts demo --no-model` wrote its mark, and the next full demo then
    replaced the user's checkpoint in model/."""
    shutil.copytree(workspace / "model", tmp_path / "model")
    before = {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()}
    assert harts(["demo", "--out", str(tmp_path), "--no-model"]) == 0
    assert harts(["demo", "--out", str(tmp_path)]) == 2
    assert "holds a model no .harts-demo beside it lists" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()} == before
