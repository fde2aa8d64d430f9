"""Custom objectives (`LossConfig(kind="custom", objective=...)`, `harts run --objective`) against Hugging Face.

Run: `python -m pytest tests/test_custom_objective.py -q` (about 30 s on 2 cores).

The reference is a sequence-level objective (GSPO's: the ratio of a
trajectory's geometric-mean likelihood, clipped per trajectory, averaged over
trajectories) evaluated from its definition on the unmodified HF model, one
trajectory at a time, in plain Python. HARTS runs the same definition written
against `PositionMeta`, microbatch by microbatch, on plans with several
microbatches, two replicas and sharing windows; loss and gradients must agree.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import harts.api as harts
from harts.cli import main as harts_cli
from harts.executor.cli import load_objective
from harts.executor.losses import LossConfig, PositionMeta, policy_loss
from harts.executor.models.hf_reference import trajectory_logprobs
from harts.executor.runtime import run_step
from harts.schema.errors import UsageError

from fidelity import boundary_tree, gradient_floor, relative_error, tiny_kimi_linear
from run_workspace import make_run_workspace

EPS = 0.2
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def model():
    return tiny_kimi_linear()


@pytest.fixture(scope="module")
def step(model):
    """Sequence advantages of both signs (per token, 0 where masked), masks, and old log-probabilities
    perturbed per trajectory so that sequence ratios fall on both sides of the clip range; one trajectory
    has no trained position."""
    rng = np.random.default_rng(11)
    lists = boundary_tree(rng)
    with torch.no_grad():
        current = [trajectory_logprobs(model, t).numpy().astype(np.float64) for t in lists]
    masks, advantages, sequence_advantage, old = [], [], [], []
    for i, (tokens, lp) in enumerate(zip(lists, current)):
        n = len(tokens)
        mask = (rng.random(n) < 0.8).astype(int)
        if i == 3:
            mask[:] = 0
        masks.append(mask.tolist())
        # One advantage per trajectory, stored per token as frameworks often do: 0 where not trained.
        sequence_advantage.append(float(rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 2.0)))
        advantages.append((sequence_advantage[-1] * mask).tolist())
        shift = rng.choice([-0.6, 0.0, 0.6])      # moves the sequence ratio outside [1 - EPS, 1 + EPS] or not
        old.append([0.0] + (lp + shift + rng.normal(0.0, 0.1, n - 1)).tolist())
    return dict(lists=lists, masks=masks, advantages=advantages, sequence_advantage=sequence_advantage, old=old)


def gspo_reference(lp_of, data) -> torch.Tensor:
    """-1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean over trained t of lp - old), one position at a time."""
    terms = []
    for i, tokens in enumerate(data["lists"]):
        trained = [t for t in range(1, len(tokens)) if data["masks"][i][t]]
        if not trained:
            continue
        old = [None] * len(tokens) if data["old"] is None else data["old"][i]
        mean = sum(lp_of[i][t - 1] - (lp_of[i][t - 1].detach() if old[t] is None else old[t])
                   for t in trained) / len(trained)
        ratio = torch.exp(mean)
        advantage = data["sequence_advantage"][i]
        terms.append(-torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - EPS, 1 + EPS) * advantage))
    return sum(terms) / len(terms)


def example(name: str):
    """An objective of examples/objectives.py, loaded as `harts run --objective PATH.py:NAME` loads it."""
    return load_objective(f"{EXAMPLES / 'objectives.py'}:{name}")


def tis_reference(lp_of, data, cap: float = 1.5) -> torch.Tensor:
    """Token-mean REINFORCE with truncated importance weights min(exp(lp - old), cap), held constant."""
    terms, count = [], 0
    for i, tokens in enumerate(data["lists"]):
        for t in range(1, len(tokens)):
            if data["masks"][i][t]:
                weight = min(math.exp(float(lp_of[i][t - 1].detach()) - data["old"][i][t]), cap)
                terms.append(-weight * data["advantages"][i][t] * lp_of[i][t - 1])
                count += 1
    return sum(terms) / count


def compile_step(data, **options):
    return harts.compile_trajectories(data["lists"], loss_masks=data["masks"], advantages=data["advantages"],
                                      old_logprobs=data["old"], **options)


def hf_objective(model, data, reference):
    model.zero_grad(set_to_none=True)
    lp_of = [trajectory_logprobs(model, t).to(torch.float64) for t in data["lists"]]
    objective = reference(lp_of, data)
    objective.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(objective.detach()), grads


@pytest.mark.parametrize("options", [dict(capacity=4096, levels="l1"),
                                     dict(capacity=180, dp=2, levels="l1"),
                                     dict(capacity=180, dp=2, levels="l1+l2")],
                         ids=["one-microbatch", "dp2-small", "dp2-windows"])
def test_sequence_level_objective_matches_hugging_face(model, step, options):
    plan = compile_step(step, **options)
    if options["capacity"] == 180:
        assert len(plan.microbatches) >= 4   # the objective really is split over microbatches
    if options["levels"] == "l1+l2":
        assert plan.producers                # and some rows come from a window's producer
    result = harts.run(plan, model, loss=example("gspo"))
    want, want_grads = hf_objective(model, step, gspo_reference)
    # Clipping must be exercised on both sides of the range, or the test would not see it.
    ratios = []
    for i, tokens in enumerate(step["lists"]):
        trained = np.flatnonzero(np.asarray(step["masks"][i][1:])) + 1
        if len(trained):
            lp = np.asarray(result.logprobs[str(i)], np.float64)
            ratios.append(math.exp(np.mean(lp[trained] - np.asarray(step["old"][i])[trained])))
    assert min(ratios) < 1 - EPS and max(ratios) > 1 + EPS and any(abs(r - 1) < EPS for r in ratios)
    assert result.loss == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert result.objective == pytest.approx(result.loss)
    floor = gradient_floor(want_grads)
    worst = max((relative_error(result.grads[n], g, floor), n) for n, g in want_grads.items())
    assert worst[0] <= 1e-4, worst


def test_sequence_level_objective_without_old_logprobs_is_on_policy(model, step):
    # No old_logprobs in the step: every ratio is 1, the loss is minus the mean advantage, and the
    # gradient is that of -1/G sum_i A_i x (mean trained log-probability of i).
    data = dict(step, old=None)
    plan = compile_step(data, capacity=180, dp=2, levels="l1+l2")
    result = harts.run(plan, model, loss=example("gspo"))
    want, want_grads = hf_objective(model, data, gspo_reference)
    active = [a for a, m in zip(step["sequence_advantage"], step["masks"]) if any(m[1:])]
    assert result.loss == pytest.approx(-np.mean(active), rel=1e-6) and want == pytest.approx(-np.mean(active))
    floor = gradient_floor(want_grads)
    worst = max((relative_error(result.grads[n], g, floor), n) for n, g in want_grads.items())
    assert worst[0] <= 1e-4, worst


def test_truncated_importance_sampling_matches_hugging_face(model, step):
    plan = compile_step(step, capacity=180, dp=2, levels="l1+l2")
    result = harts.run(plan, model, loss=functools.partial(example("reinforce_tis"), cap=1.5))
    want, want_grads = hf_objective(model, step, tis_reference)
    ratios = np.exp(np.concatenate([np.asarray(result.logprobs[str(i)], np.float64)[1:] - np.asarray(o[1:])
                                    for i, o in enumerate(step["old"])]))
    assert (ratios > 1.5).any() and (ratios < 1.5).any()   # truncation is exercised, and so is its absence
    assert result.loss == pytest.approx(want, rel=1e-5, abs=1e-7)
    floor = gradient_floor(want_grads)
    worst = max((relative_error(result.grads[n], g, floor), n) for n, g in want_grads.items())
    assert worst[0] <= 1e-4, worst


def test_trained_positions_only_give_the_same_step(model, step):
    plan = compile_step(step, capacity=180, dp=2, levels="l1")
    objective = example("gspo")
    everything = harts.run(plan, model, loss=objective)
    grads = {n: g.clone() for n, g in everything.grads.items()}
    trained_only = harts.run(plan, model, loss=objective, logprobs="loss")
    assert trained_only.loss == pytest.approx(everything.loss, rel=1e-9)
    for name, grad in grads.items():
        torch.testing.assert_close(trained_only.grads[name], grad, rtol=1e-6, atol=1e-9)


def test_custom_grpo_equals_the_built_in(model, step):
    # The built-in objective written as a custom one: the plumbing adds nothing and drops nothing.
    plan = compile_step(step, capacity=180, dp=2, levels="l1+l2")

    def grpo(logprobs, inputs):
        trained = inputs.weight > 0
        old = torch.where(trained, inputs.old_logprobs, logprobs.detach())
        ratio = torch.exp(logprobs - old)
        clipped = torch.clamp(ratio, 0.8, 1.2)
        return (-torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages) * inputs.weight).sum()

    for reduction in ("token-mean", "seq-mean-token-mean"):
        built_in = harts.run(plan, model, loss=LossConfig(kind="grpo", reduction=reduction))
        grads = {n: g.clone() for n, g in built_in.grads.items()}
        custom = harts.run(plan, model, loss=LossConfig(kind="custom", objective=grpo, reduction=reduction))
        assert custom.loss == pytest.approx(built_in.loss, rel=1e-12)
        for name, grad in grads.items():
            torch.testing.assert_close(custom.grads[name], grad, rtol=1e-9, atol=1e-12)


def test_inputs_cover_whole_trajectories_with_their_metadata(model, step):
    plan = compile_step(step, capacity=180, dp=2, levels="l1+l2")
    seen, counts = [], set()

    def record(logprobs, inputs):
        counts.add((inputs.trained_positions, inputs.trained_trajectories))
        seen.append({k: getattr(inputs, k).cpu().numpy() for k in
                     ("trajectory", "position", "loss_mask", "advantages", "old_logprobs", "weight")})
        assert len(logprobs) == len(inputs.trajectory)
        return (logprobs * 0.0).sum()

    run_step(plan, model, loss=LossConfig(kind="custom", objective=record), backward=False)
    assert len(seen) == len(plan.microbatches)
    owner = {}
    for index, mb in enumerate(seen):
        for t in np.unique(mb["trajectory"]).tolist():
            assert t not in owner, f"trajectory {t} split over microbatches {owner[t]} and {index}"
            owner[t] = index
            at = mb["trajectory"] == t
            n = len(step["lists"][t])
            # Whole: every labelled position (index 0 has no label) exactly once.
            np.testing.assert_array_equal(np.sort(mb["position"][at]), np.arange(1, n))
            order = np.argsort(mb["position"][at])
            np.testing.assert_array_equal(mb["loss_mask"][at][order], step["masks"][t][1:])
            np.testing.assert_allclose(mb["advantages"][at][order], step["advantages"][t][1:], rtol=1e-6)
            np.testing.assert_allclose(mb["old_logprobs"][at][order], step["old"][t][1:], rtol=1e-6)
            np.testing.assert_array_equal(mb["weight"][at][order] > 0, np.asarray(step["masks"][t][1:]) > 0)
    assert sorted(owner) == list(range(len(step["lists"])))
    # The step-level denominators, the same in every microbatch.
    trained = [int(np.sum(m[1:])) for m in step["masks"]]
    assert counts == {(sum(trained), sum(1 for n in trained if n))}


@pytest.mark.parametrize("returned, message", [
    (lambda lp, inputs: lp * 2.0, "of shape"),
    (lambda lp, inputs: lp.sum().to(torch.int64), "torch.int64"),
    (lambda lp, inputs: float(lp.detach().sum()), "a float"),
    (lambda lp, inputs: torch.tensor(float(lp.detach().sum())), "no gradient path"),
], ids=["vector", "integer", "python-float", "detached"])
def test_an_objective_that_cannot_be_summed_is_refused(model, step, returned, message):
    plan = compile_step(step, capacity=4096, levels="l1")
    with pytest.raises(UsageError, match=message):
        harts.run(plan, model, loss=returned)


def test_a_detached_zero_where_nothing_is_trained_is_accepted(model, step):
    # A microbatch whose positions are all untrained may return a constant: it contributes nothing.
    data = dict(step, masks=[[0] * len(t) for t in step["lists"]])
    plan = compile_step(data, capacity=180, dp=2, levels="l1")
    for constant in (torch.zeros((), dtype=torch.float64), 0.0, 0):
        result = harts.run(plan, model, loss=lambda lp, inputs: constant, entropy=True)
        assert result.loss == 0.0
        assert all(float(g.abs().max()) == 0.0 for g in result.grads.values())
        assert result.entropy is None   # nothing trained: no entropy to report (0.0 would read as collapse)


def test_a_constant_share_is_refused_only_where_positions_are_trained():
    # The common early return: `0.0` for a microbatch with nothing to train is a share; the same return for a
    # microbatch with trained positions would train nothing and is refused.
    def meta(weight):
        n = len(weight)
        return PositionMeta(weight=torch.tensor(weight, dtype=torch.float64), advantages=torch.zeros(n),
                            old_logprobs=None, ref_logprobs=None, trajectory=torch.zeros(n, dtype=torch.long),
                            position=torch.arange(1, n + 1), loss_mask=torch.tensor(weight).gt(0).double(),
                            trained_positions=1, trained_trajectories=1)

    def early_return(lp, inputs):
        return 0.0 if not bool((inputs.weight > 0).any()) else (lp * inputs.weight).sum()

    config = LossConfig(kind="custom", objective=lambda lp, inputs: 0.0)
    lam = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    share = policy_loss(lam, meta([0.0, 0.0]), config)
    share.backward()
    assert float(share.detach()) == 0.0 and torch.equal(lam.grad, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(UsageError, match="a float"):
        policy_loss(lam, meta([0.0, 1.0]), config)
    assert policy_loss(lam, meta([0.0, 1.0]), LossConfig(kind="custom", objective=early_return)).requires_grad


def test_an_objective_that_raises_is_one_line_naming_where(model, step):
    plan = compile_step(step, capacity=4096, levels="l1")

    def broken(logprobs, inputs):
        return {"a": logprobs.sum()}["boom"]

    with pytest.raises(UsageError, match=r"raised KeyError: 'boom' at .*test_custom_objective.py:\d+") as caught:
        harts.run(plan, model, loss=broken)
    assert isinstance(caught.value.__cause__, KeyError)   # the original, with its traceback, is chained
    with pytest.raises(UsageError, match="entropies need run\\(entropy=True\\)"):
        harts.run(plan, model, loss=lambda lp, inputs: (lp * inputs.entropy).sum())


@pytest.mark.parametrize("fields, message", [
    (dict(kind="custom"), "needs objective"),
    (dict(kind="grpo", objective=lambda lp, inputs: lp.sum()), "would ignore it"),
    (dict(kind="custom", objective=lambda lp, inputs: lp.sum(), kl_coef=0.1), "inside your objective"),
    (dict(kind="custom", objective="my_module:fn"), "needs objective, a callable"),
    (dict(kind="custom", objective=lambda lp, inputs: lp.sum(), clip_high=0.28), "clip inside your objective"),
    (dict(kind="nll", clip_low=0.1), "pick kind 'grpo' or 'ppo'"),
])
def test_loss_config_refuses_an_objective_it_cannot_use(fields, message):
    with pytest.raises(UsageError, match=message):
        LossConfig(**fields)


OBJECTIVE_FILE = '''
import torch
from my_constants import SIGN   # a module beside this file

def mean_logprob(logprobs, inputs):
    return SIGN * (logprobs * inputs.weight).sum()

not_callable = 3
'''


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    trees = [{"id": "a", "tokens": [5, 6, 7, 8, 9, 10, 11, 12], "advantages": 0.5},
             {"id": "b", "tokens": [5, 6, 7, 8, 20, 21], "advantages": -0.5, "loss_mask": [0, 0, 0, 0, 1, 1]}]
    path = make_run_workspace(tmp_path_factory.mktemp("objective"), trees)
    (path / "my_objectives.py").write_text(OBJECTIVE_FILE)
    (path / "my_constants.py").write_text("SIGN = -1.0\n")
    return path


def _run(workspace, *flags, out="g.safetensors"):
    return harts_cli(["run", str(workspace / "step.plan"), "--model", str(workspace / "model"), "--json",
                      "--grads-out", str(workspace / out), *flags])


@pytest.mark.parametrize("spec", ["FILE:mean_logprob", "my_objectives:mean_logprob"], ids=["path", "module"])
def test_harts_run_objective_flag_equals_nll(workspace, spec, monkeypatch, capsys, tmp_path):
    # -(weight x logprob) summed is exactly the built-in nll, so the two runs must write the same gradients.
    # A module is found from the working directory; a PATH.py from anywhere, with the modules beside it.
    monkeypatch.chdir(workspace if spec.startswith("my_objectives") else tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    spec = spec.replace("FILE", str(workspace / "my_objectives.py"))
    assert _run(workspace, "--objective", spec, out="custom.safetensors") == 0
    custom = capsys.readouterr().out
    assert _run(workspace, "--loss", "nll", out="nll.safetensors") == 0
    nll = capsys.readouterr().out
    import json
    assert json.loads(custom)["loss"] == pytest.approx(json.loads(nll)["loss"], rel=1e-12)
    from safetensors.numpy import load_file
    a, b = load_file(workspace / "custom.safetensors"), load_file(workspace / "nll.safetensors")
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("flags, message", [
    (["--objective", "no_colon"], "is not MODULE:FUNCTION"),
    (["--objective", "FILE:missing"], "has no callable missing"),
    (["--objective", "FILE:not_callable"], "has no callable not_callable"),
    (["--objective", "no_such_module_xyz:f"], "importing no_such_module_xyz failed: ModuleNotFoundError"),
    (["--objective", "nowhere/x.py:f"], "no file nowhere/x.py"),
    (["--objective", "FILE:mean_logprob", "--loss", "grpo"], "replaces the built-in loss"),
    (["--objective", "FILE:mean_logprob", "--kl-coef", "0.1"], "inside your objective"),
    (["--objective", "FILE:mean_logprob", "--clip-high", "0.3"], "clip inside your objective"),
    (["--loss", "custom"], "needs objective"),
])
def test_harts_run_refuses_a_bad_objective_flag_in_one_line(workspace, flags, message, capsys):
    flags = [f.replace("FILE", str(workspace / "my_objectives.py")) for f in flags]
    out = f"bad-{abs(hash(tuple(flags)))}.safetensors"
    assert _run(workspace, *flags, out=out) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (workspace / out).exists()


def test_custom_objective_sees_differentiable_entropies(model, step):
    # With entropy=True the objective gets each position's entropy: weighing it itself equals entropy_coef.
    plan = compile_step(step, capacity=180, dp=2, levels="l1+l2")
    built_in = harts.run(plan, model, loss=LossConfig(kind="nll", entropy_coef=0.1))
    grads = {n: g.clone() for n, g in built_in.grads.items()}

    def nll_minus_entropy(logprobs, inputs):
        return ((-logprobs - 0.1 * inputs.entropy) * inputs.weight).sum()

    custom = harts.run(plan, model, loss=nll_minus_entropy, entropy=True)
    assert custom.objective == pytest.approx(built_in.objective, rel=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(custom.grads[name], grad, rtol=1e-9, atol=1e-12)
    seen = []
    harts.run(plan, model, loss=lambda lp, inputs: seen.append(inputs.entropy) or (lp * 0.0).sum(), backward=False)
    assert seen and all(e is None for e in seen)   # off unless asked for
