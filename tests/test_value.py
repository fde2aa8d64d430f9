"""Loss 'value': training a critic on the plan, against the Hugging Face critic run per trajectory.

Run: `python -m pytest tests/test_value.py -q`. The references are the models' own forwards: a
`Qwen3NextForTokenClassification` with one label (`critic(ids).logits`), Kimi Linear's critic (transformers'
`GenericForTokenClassification` forward over the Kimi backbone, the class HARTS adds), and a Kimi Linear
backbone (`model.model(ids).last_hidden_state`) under a separate linear head, each run on every trajectory
alone and differentiated through PPO's clipped value loss (or the plain squared error) written out here.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import harts.api as harts
from harts.executor.losses import LossConfig
from harts.executor.models.registry import RUNNERS
from harts.executor.runtime import run_step
from harts.schema.errors import UsageError

from fidelity import VOCAB, boundary_tree, compile_lists, gradient_floor, relative_error, tiny_kimi_linear

CLIP = 0.2


def two_trees() -> list[list[int]]:
    return boundary_tree(np.random.default_rng(0)) + boundary_tree(np.random.default_rng(5))


@pytest.fixture(scope="module")
def qwen_critic():
    from transformers import Qwen3NextForTokenClassification

    from harts.executor.models.init_model import qwen3_next_config

    torch.manual_seed(0)
    config = qwen3_next_config("tiny", VOCAB)
    config.num_labels = 1
    return Qwen3NextForTokenClassification(config).float().eval()


@pytest.fixture(scope="module")
def kimi():
    return tiny_kimi_linear()


def targets(lists, seed: int):
    rng = np.random.default_rng(seed)
    returns = {str(i): rng.normal(size=len(t)) for i, t in enumerate(lists)}
    old = {str(i): rng.normal(scale=0.1, size=len(t)) for i, t in enumerate(lists)}
    return returns, old


def reference(values_of, parameters, lists, returns, old, clip, masks=None):
    """Per-trajectory values (v_i from the hidden state of position i - 1) and the gradients of the
    step's token-mean value loss, every trajectory run alone."""
    for p in parameters:
        p.grad = None
    total, count, values = 0.0, 0, []
    for i, tokens in enumerate(lists):
        v = values_of(torch.tensor([tokens]))[:-1].double()   # positions 1 .. n - 1
        values.append(v.detach().numpy())
        trained = torch.ones(len(tokens) - 1, dtype=torch.float64) if masks is None else \
            torch.tensor(masks[i][1:], dtype=torch.float64)
        ret = torch.tensor(np.nan_to_num(returns[str(i)][1:]))   # NaN only where untrained
        terms = (v - ret) ** 2
        if clip is not None:
            o = torch.tensor(old[str(i)][1:])
            terms = torch.maximum(terms, (o + torch.clamp(v - o, -clip, clip) - ret) ** 2)
        total = total + 0.5 * (terms * trained).sum()
        count += int(trained.sum())
    loss = total / count
    loss.backward()
    grads = {id(p): p.grad.clone() for p in parameters if p.grad is not None}
    for p in parameters:
        p.grad = None
    return values, float(loss.detach()), grads


def assert_values(result, want_values, tol=1e-5):
    for i, want in enumerate(want_values):
        got = result.values[str(i)]
        assert np.isnan(got[0])
        assert np.max(np.abs(got[1:] - want)) <= tol, i


def assert_gradients(got: dict, want: dict) -> None:
    floor = gradient_floor(want)
    worst = max((relative_error(got[key], grad, floor), key) for key, grad in want.items())
    assert worst[0] <= 1e-4, worst


def test_a_token_classification_critic_matches_hugging_face_per_trajectory(qwen_critic):
    """Windows on (producers run), two replicas, clipped loss: values, loss and every gradient as the
    HF critic's own forward per trajectory gives them."""
    lists = two_trees()
    plan = compile_lists(lists, chunk_size=16, dp=2, capacity=250, levels="l1+l2")
    assert plan.producers, "the workload must give windows something to share"
    returns, old = targets(lists, 1)
    result = harts.run(plan, qwen_critic, loss=LossConfig(kind="value", value_clip=CLIP), returns=returns,
                       old_values=old)
    assert result.producers_run == len(plan.producers) and result.logprobs == {}
    names = dict(qwen_critic.named_parameters())
    want_values, want_loss, want = reference(lambda ids: qwen_critic(ids).logits[0, :, 0], list(names.values()),
                                             lists, returns, old, CLIP)
    assert_values(result, want_values)
    assert abs(result.loss - want_loss) <= 1e-6 * max(1.0, want_loss)
    assert_gradients({id(names[n]): g for n, g in result.grads.items()}, want)
    assert "score.weight" in result.grads

    alone = harts.run(plan, qwen_critic, loss=LossConfig(kind="value", value_clip=CLIP), returns=returns,
                      old_values=old, windows=False)
    assert alone.producers_run == 0 and abs(alone.loss - result.loss) <= 1e-6 * max(1.0, want_loss)


def test_a_backbone_with_its_own_value_head_matches_and_trains_the_head(kimi):
    """A causal-LM backbone under a separate head, unclipped loss, returns given as a list in plan order,
    a loss mask: the head's gradient lands in its own .grad, zeroed first; the LM head gets none."""
    lists = two_trees()
    rng = np.random.default_rng(2)
    masks = [(rng.random(len(t)) < 0.7).astype(np.int64) for t in lists]
    plan = compile_lists(lists, chunk_size=16, capacity=250, levels="l1+l2", loss_masks=masks)
    torch.manual_seed(1)
    head = torch.nn.Linear(kimi.config.hidden_size, 1)
    returns, _ = targets(lists, 3)
    for i, mask in enumerate(masks):   # untrained positions may hold anything
        returns[str(i)][mask == 0] = np.nan
    head.weight.grad = torch.ones_like(head.weight)   # a stale gradient, to be replaced
    result = harts.run(plan, kimi, loss="value", returns=[returns[str(i)] for i in range(len(lists))],
                       value_head=head)
    parameters = [*kimi.parameters(), *head.parameters()]
    want_values, want_loss, want = reference(lambda ids: head(kimi.model(ids).last_hidden_state)[0, :, 0],
                                             parameters, lists, returns, None, None, masks)
    # run_step left the head's .grad; the reference cleared it: compare against a second run, counting the
    # rows the head reads: one per compact row of each microbatch, not one per position.
    seen = []
    hook = head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    got = run_step(plan, kimi, loss=LossConfig(kind="value"), value_head=head,
                   returns=np.concatenate([returns[str(i)] for i in range(len(lists))]))
    hook.remove()
    assert sum(seen) == sum(len(mb["row_token"]) for mb in plan.microbatches) < sum(map(len, lists))
    assert_values(result, want_values)
    assert abs(result.loss - want_loss) <= 1e-6 * max(1.0, want_loss) and abs(got.loss - result.loss) <= 1e-12
    names = dict(kimi.named_parameters())
    ours = {id(names[n]): g for n, g in got.grads.items()}
    ours.update({id(p): p.grad for p in head.parameters()})
    assert_gradients(ours, want)
    assert float(got.grads["lm_head.weight"].abs().sum()) == 0.0


def test_a_forward_pass_without_returns_gives_the_values_gae_needs(qwen_critic):
    lists = two_trees()
    plan = compile_lists(lists, chunk_size=16, capacity=250, levels="l1+l2")
    returns, _ = targets(lists, 9)
    trained = harts.run(plan, qwen_critic, loss="value", returns=returns)
    values = harts.run(plan, qwen_critic, loss="value", backward=False)
    assert np.isnan(values.loss) and values.grads == {}
    for key, got in values.values.items():
        np.testing.assert_array_equal(got, trained.values[key])
    with pytest.raises(UsageError, match="or backward=False for the values alone"):
        harts.run(plan, qwen_critic, loss="value")


def test_a_frozen_backbone_trains_its_head_alone(kimi):
    lists = boundary_tree(np.random.default_rng(1))
    plan = compile_lists(lists)
    returns, _ = targets(lists, 10)
    head = torch.nn.Linear(kimi.config.hidden_size, 1)
    frozen = [p for p in kimi.parameters() if p.requires_grad]
    try:
        for p in frozen:
            p.requires_grad_(False)
        result = harts.run(plan, kimi, loss="value", returns=returns, value_head=head)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    assert result.grads == {} and float(head.weight.grad.abs().sum()) > 0


def test_expanded_mode_and_loss_positions_agree_with_compact(qwen_critic):
    lists = two_trees()
    rng = np.random.default_rng(4)
    masks = [(rng.random(len(t)) < 0.6).astype(np.int64) for t in lists]
    plan = compile_lists(lists, chunk_size=16, capacity=250, levels="l1+l2", loss_masks=masks)
    returns, old = targets(lists, 5)
    config = LossConfig(kind="value", value_clip=CLIP)
    compact = harts.run(plan, qwen_critic, loss=config, returns=returns, old_values=old)
    for other in (harts.run(plan, qwen_critic, loss=config, returns=returns, old_values=old, mode="expanded"),
                  harts.run(plan, qwen_critic, loss=config, returns=returns, old_values=old, logprobs="loss")):
        assert abs(other.loss - compact.loss) <= 1e-6 * max(1.0, compact.loss)
        assert_gradients(other.grads, compact.grads)
        for key, values in other.values.items():
            seen = ~np.isnan(values)
            assert np.max(np.abs(values[seen] - compact.values[key][seen])) <= 1e-5


def test_critic_calls_that_cannot_run_are_one_usage_error(kimi, qwen_critic):
    lists = boundary_tree(np.random.default_rng(0))
    plan = compile_lists(lists)
    returns, old = targets(lists, 6)
    clip = LossConfig(kind="value", value_clip=CLIP)
    bad_return = {k: v.copy() for k, v in returns.items()}
    bad_return["3"][5] = np.nan
    cases = [
        (dict(model=kimi, loss="value", returns=returns), "no score layer"),
        (dict(model=qwen_critic, loss="value"), "needs returns"),
        (dict(model=qwen_critic, loss=clip, returns=returns), "needs old_values"),
        (dict(model=qwen_critic, loss="value", returns=returns, old_values=old), "value_clip is None"),
        (dict(model=qwen_critic, loss="value", returns=bad_return), "returns is nan at flat position"),
        (dict(model=kimi, loss="grpo", returns=returns), "read by loss 'value' only"),
        (dict(model=kimi, loss="nll", value_head=torch.nn.Linear(8, 1)), "value_head is read by loss 'value'"),
        (dict(model=qwen_critic, loss="value", returns={k: v for k, v in returns.items() if k != "2"}),
         "no entry for id '2'"),
        (dict(model=qwen_critic, loss="value", returns=list(returns.values())[:-1]), "entries for"),
        (dict(model=qwen_critic, loss="value", returns={**returns, "0": returns["0"][:-1]}), "but tokens has"),
        (dict(model=qwen_critic, loss="value", returns=returns, entropy=True), "entropy=True"),
        (dict(model=kimi, loss="value", returns=returns, value_head=torch.nn.Linear(kimi.config.hidden_size, 2)),
         "one output per row"),
        (dict(model=kimi, loss="value", returns=returns, value_head=lambda h: h[:, :1]), "must be a torch.nn.Module"),
        (dict(model=kimi, loss="value", returns=returns,
              value_head=torch.nn.Linear(kimi.config.hidden_size, 1).to(torch.bfloat16)), "value_head's weight is"),
        (dict(model=qwen_critic, loss="value", old_values=old, backward=False), "value_clip is None"),
        (dict(model=qwen_critic, loss=clip, old_values=old, backward=False), "old_values is given without returns"),
        (dict(model=kimi, loss="grpo", returns={**returns, "0": returns["0"][:-1]}), "read by loss 'value' only"),
        (dict(model=qwen_critic, loss="value", returns={**returns, "0": ["a"] * len(returns["0"])}),
         "values, not numbers"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            harts.run(plan, **kwargs)
    with pytest.raises(UsageError, match="no meaning with kind 'value'"):
        LossConfig(kind="value", entropy_coef=0.1)
    with pytest.raises(UsageError, match="has no effect with kind 'grpo'"):
        LossConfig(kind="grpo", value_clip=0.2)
    with pytest.raises(UsageError, match="value_clip"):
        LossConfig(kind="value", value_clip=float("nan"))


# ----------------------------------------------------------------------------- harts run --loss value


@pytest.fixture(scope="module")
def critic_step(tmp_path_factory, qwen_critic):
    """A saved critic, a two-replica plan with windows and its returns/old values as .npz files."""
    import json

    from harts.compiler.cli import main as hartsc

    folder = tmp_path_factory.mktemp("critic")
    qwen_critic.save_pretrained(folder / "critic")
    lists = two_trees()
    rng = np.random.default_rng(8)
    records = [{"id": f"t{i}", "tokens": [int(x) for x in t],
                "loss_mask": [int(rng.random() < 0.8) for _ in t]} for i, t in enumerate(lists)]
    (folder / "trees.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert hartsc([str(folder / "trees.jsonl"), "-o", str(folder / "step.plan"), "--dp", "2", "--capacity", "250",
                   "--chunk-size", "16"]) == 0
    returns = {r["id"]: rng.normal(size=len(r["tokens"])) for r in records}
    old = {r["id"]: rng.normal(scale=0.1, size=len(r["tokens"])) for r in records}
    np.savez(folder / "returns.npz", **returns)
    np.savez(folder / "old.npz", **old)
    return folder, returns, old


def test_harts_run_trains_a_saved_critic_as_the_api_does(critic_step, qwen_critic):
    from safetensors.torch import load_file

    from harts.cli import main as harts_main

    folder, returns, old = critic_step
    argv = ["run", str(folder / "step.plan"), "--model", str(folder / "critic"), "--loss", "value",
            "--returns", str(folder / "returns.npz"), "--old-values", str(folder / "old.npz"), "--value-clip", "0.2",
            "--values-out", str(folder / "values.npz"), "--grads-out", str(folder / "grads.safetensors")]
    assert harts_main(argv) == 0
    plan = harts.read_plan(folder / "step.plan")
    assert plan.producers
    want = harts.run(plan, qwen_critic, loss=LossConfig(kind="value", value_clip=0.2), returns=returns,
                     old_values=old)
    values, grads = np.load(folder / "values.npz"), load_file(folder / "grads.safetensors")
    assert sorted(values.files) == sorted(want.values)
    for key, got in want.values.items():   # the loaded model may pick other kernels: float rounding apart
        np.testing.assert_allclose(values[key], got, rtol=0, atol=1e-6)
    assert grads.keys() == want.grads.keys()
    assert_gradients(grads, want.grads)


def test_a_kimi_linear_critic_started_from_its_policy_trains_as_hugging_face_runs_it(critic_step, kimi, tmp_path,
                                                                                    capsys):
    """`harts init-model --critic --from POLICY` keeps the policy's backbone; `harts run --loss value` on it
    (windows, two replicas, loss masks, clipped loss) gives each trajectory the values, loss and gradients
    of the saved critic's own forward (transformers' GenericForTokenClassification) run on it alone."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForTokenClassification

    from harts.cli import main as harts_main

    folder, returns, old = critic_step
    kimi.save_pretrained(tmp_path / "policy")
    assert harts_main(["init-model", "--critic", "--from", str(tmp_path / "policy"), "--seed", "3",
                       "-o", str(tmp_path / "critic")]) == 0
    harts.critic_class("kimi_linear")
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic").eval()
    backbone = {name: p for name, p in critic.named_parameters() if name.startswith("model.")}
    assert backbone and all(torch.equal(p, kimi.get_parameter(name)) for name, p in backbone.items())
    assert critic.dropout.p == 0.0 and float(critic.score.weight.detach().abs().sum()) > 0

    argv = ["run", str(folder / "step.plan"), "--model", str(tmp_path / "critic"), "--loss", "value",
            "--returns", str(folder / "returns.npz"), "--old-values", str(folder / "old.npz"), "--value-clip",
            str(CLIP), "--values-out", str(tmp_path / "values.npz"), "--grads-out", str(tmp_path / "g.safetensors"),
            "--json"]
    capsys.readouterr()
    assert harts_main(argv) == 0
    loss = json.loads(capsys.readouterr().out)["loss"]
    records = [json.loads(line) for line in (folder / "trees.jsonl").read_text().splitlines()]
    lists, masks = [r["tokens"] for r in records], [r["loss_mask"] for r in records]
    by_index = {str(i): returns[r["id"]] for i, r in enumerate(records)}
    old_by_index = {str(i): old[r["id"]] for i, r in enumerate(records)}
    names = dict(critic.named_parameters())
    want_values, want_loss, want = reference(lambda ids: critic(ids).logits[0, :, 0], list(names.values()),
                                             lists, by_index, old_by_index, CLIP, masks)
    assert abs(loss - want_loss) <= 1e-6 * max(1.0, want_loss)
    values, grads = np.load(tmp_path / "values.npz"), load_file(tmp_path / "g.safetensors")
    for record, want_v in zip(records, want_values):
        got = values[record["id"]]
        assert np.isnan(got[0]) and np.max(np.abs(got[1:] - want_v)) <= 1e-5, record["id"]
    assert grads.keys() == {name for name, p in names.items() if p.requires_grad}
    assert_gradients({id(names[n]): g for n, g in grads.items()}, want)


def test_harts_run_refuses_critic_flags_it_cannot_honour(critic_step, tmp_path, capsys):
    from harts.cli import main as harts_main

    folder, _, _ = critic_step
    plan, critic, returns = str(folder / "step.plan"), str(folder / "critic"), str(folder / "returns.npz")
    (tmp_path / "broken.npz").write_bytes(b"not an npz")
    np.save(tmp_path / "one.npy", np.zeros(5))
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text(
        '{"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}')
    (tmp_path / "lone").mkdir()   # a lone string, not a list
    (tmp_path / "lone" / "config.json").write_text(
        '{"model_type": "qwen3_next", "architectures": "Qwen3NextForCausalLM"}')
    (tmp_path / "number").mkdir()   # malformed: read as no architectures, so the (missing) weights are what fails
    (tmp_path / "number" / "config.json").write_text(
        '{"model_type": "qwen3_next", "architectures": 5, "num_labels": 1}')
    cases = [
        (["--model", critic, "--loss", "value", "--returns", returns, "--values-out", returns],
         "it is also an input"),
        (["--model", critic, "--loss", "value", "--returns", returns, "--grads-out", returns], "it is also an input"),
        (["--model", str(tmp_path / "policy"), "--loss", "value", "--returns", returns],
         "holds a causal LM (Qwen3NextForCausalLM), not a critic"),
        (["--model", str(tmp_path / "lone"), "--loss", "value", "--returns", returns],
         "holds a causal LM (Qwen3NextForCausalLM), not a critic"),
        (["--model", str(tmp_path / "number"), "--loss", "value", "--returns", returns], "cannot load the model"),
        (["--model", str(tmp_path / "none"), "--loss", "value", "--returns", returns, "--old-values", returns],
         "value_clip is None"),   # refused before the (missing) model is looked for
        (["--model", critic, "--loss", "value", "--returns", returns, "--entropy"], "drop --entropy"),
        (["--model", critic, "--returns", returns], "--returns is read by --loss value only"),
        (["--model", critic, "--loss", "value", "--returns", returns, "--logprobs-out", str(tmp_path / "lp.npz")],
         "there are no log-probabilities"),
        (["--model", critic, "--loss", "value", "--returns", str(tmp_path / "broken.npz")],
         "cannot read it as an .npz"),
        (["--model", critic, "--loss", "value"], "needs returns"),
        (["--model", critic, "--loss", "value", "--returns", str(tmp_path / "one.npy")], "holds one array (.npy)"),
        (["--model", critic, "--loss", "value", "--returns", returns, "--value-clip", "0.2"], "needs old_values"),
    ]
    for extra, message in cases:
        assert harts_main(["run", plan, *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and "fix:" in err[0], (extra, err)


@pytest.mark.skipif(__import__("shutil").which("torchrun") is None, reason="torchrun is not installed")
def test_two_ranks_train_the_critic_as_one_process(critic_step):
    """torchrun with the plan's two replicas: the same loss, values and gradients as one process."""
    import json
    import subprocess

    from safetensors.torch import load_file

    from test_distributed import torchrun

    folder, _, _ = critic_step
    common = [str(folder / "step.plan"), "--model", str(folder / "critic"), "--loss", "value", "--returns",
              str(folder / "returns.npz"), "--old-values", str(folder / "old.npz"), "--value-clip", "0.2", "--json"]
    single = subprocess.run(["harts", "run", *common, "--values-out", str(folder / "v1.npz"),
                             "--grads-out", str(folder / "g1.safetensors")],
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    out = torchrun(2, ["harts", "run", *common, "--values-out", str(folder / "v2.npz"),
                       "--grads-out", str(folder / "g2.safetensors")])
    assert out.returncode == 0, out.stderr
    want, got = json.loads(single.stdout), json.loads(out.stdout)
    assert got["window_producers"] == want["window_producers"] == 2
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    one, two = load_file(folder / "g1.safetensors"), load_file(folder / "g2.safetensors")
    assert one.keys() == two.keys()
    for name, grad in one.items():
        np.testing.assert_allclose(two[name], grad, rtol=1e-5, atol=1e-7, err_msg=name)
    v1, v2 = np.load(folder / "v1.npz"), np.load(folder / "v2.npz")
    assert sorted(v1.files) == sorted(v2.files)
    for key in v1.files:
        np.testing.assert_allclose(v2[key][1:], v1[key][1:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", sorted(RUNNERS))
def test_init_model_writes_a_critic_harts_run_trains(critic_step, tmp_path, capsys, arch):
    """Every family HARTS runs has a critic: init-model writes it, transformers' auto class loads it."""
    from transformers import AutoModelForTokenClassification

    from harts.cli import main as harts_main

    folder, _, _ = critic_step
    assert harts_main(["init-model", "--arch", arch, "--critic", "--vocab-size", str(VOCAB),
                       "-o", str(tmp_path / "critic")]) == 0
    harts.critic_class(arch)   # registers the critic classes HARTS adds with the auto class
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert type(critic) is harts.critic_class(arch) and critic.config.model_type == arch
    assert critic.config.num_labels == 1 and critic.dropout.p == 0.0
    assert harts_main(["run", str(folder / "step.plan"), "--model", str(tmp_path / "critic"), "--loss", "value",
                       "--returns", str(folder / "returns.npz"), "--values-out", str(tmp_path / "v.npz")]) == 0
    assert len(np.load(tmp_path / "v.npz").files) == len(two_trees())
    capsys.readouterr()
    assert harts_main(["run", str(folder / "step.plan"), "--model", str(tmp_path / "critic"), "--loss", "value",
                       "--forward-only", "--values-out", str(tmp_path / "v2.npz")]) == 0
    assert ": values only (no --returns)," in capsys.readouterr().err
