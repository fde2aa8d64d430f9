"""`harts.api` rejects what the file reader rejects, with one clear error each.

Run: `python -m pytest tests/test_api.py -q`.
"""
from __future__ import annotations

import contextlib
import copy
import json
import time

import numpy as np
import pytest
import torch

import harts.api as api
from harts.schema.plan import encode_plan
from harts.schema.errors import PlanFormatError

TOKENS = [[1, 2, 3], [1, 2, 4]]


@pytest.mark.parametrize("kwargs, words", [
    (dict(tokens=[[1, -2, 3]]), "token ids must lie in"),
    (dict(tokens=[[1, 2.5, 3]]), "integer token ids"),
    (dict(tokens=[[1]]), "at least 2 ids"),
    (dict(tokens=TOKENS, vocab_size=4), "token ids must lie in"),
    (dict(tokens=TOKENS, loss_masks=[[1, 1], [1, 1, 1]]), "loss_masks has shape"),
    (dict(tokens=TOKENS, loss_masks=[[1, 2, 1], [1, 1, 1]]), "other than 0 and 1"),
    (dict(tokens=TOKENS, old_logprobs=[[0.0, float("nan"), 1.0], [0.0, 0.0, 0.0]]),
     r"trajectory 0: old_logprobs\[1\] = nan is not a finite float32"),
    (dict(tokens=TOKENS, advantages=[float("nan"), 1.0]), "advantages"),
    (dict(tokens=[]), "no trajectories"),
    (dict(tokens=TOKENS, advantages=[1.0]), "advantages: 1 entries"),
    (dict(tokens=TOKENS, ids=["a", "a"]), "as a string, the id of trajectory 0"),
    (dict(tokens=TOKENS, ids=[1, "1"]), "as a string, the id of trajectory 0"),
    (dict(tokens=TOKENS, ids=["a"]), "ids: 1 entries for 2"),
    (dict(tokens=TOKENS, ids=[None, "b"]), "trajectory 0: id None is not a str or an int"),
    (dict(tokens=TOKENS, ids=[1.5, "b"]), "trajectory 0: id 1.5 is not"),
    (dict(tokens=TOKENS, ids=["a", True]), "trajectory 1: id True is not"),
    (dict(tokens=TOKENS, ids=[b"x", "b"]), "trajectory 0: id b'x' is not"),
    (dict(tokens=TOKENS, ids=[2**70, "b"]), r"in \[-2\*\*63, 2\*\*64\)"),
    (dict(tokens=TOKENS, ids=["\ud800", "b"]), "lone surrogate"),
    (dict(tokens=TOKENS, trees=[("t",), "t"]), "trajectory 0: tree"),
    (dict(tokens=TOKENS, trees="t"), "trees must be a sequence"),
    (dict(tokens=None), "tokens must be a sequence"),
    (dict(tokens=[[1, [2, 3]], [1, 2]]), "trajectory 0: tokens are not a flat list"),
    (dict(tokens=[[1, 2, 3], [1, 2, True]]), r"trajectory 1: tokens\[2\] is True \(a boolean\)"),
    (dict(tokens=TOKENS, advantages=0.5), "advantages must be a sequence"),
    (dict(tokens=TOKENS, loss_masks=[[1, 1, 1], [1, 3, 1]]), "trajectory 1: loss_masks hold a value"),
    (dict(tokens=TOKENS, capacity=2), "more than capacity"),
    (dict(tokens=TOKENS, advantages=[True, False]), "advantages holds booleans"),
    (dict(tokens=TOKENS, old_logprobs=[[0.0, -1.0, -1.0], [False, True, True]]), "old_logprobs holds booleans"),
    (dict(tokens=TOKENS, dp=0), "--dp must be >= 1"),
    (dict(tokens=TOKENS, chunk_size=0), "--chunk-size must be >= 1"),
    (dict(tokens=TOKENS, levels="l3"), "unknown levels"),
    (dict(tokens=TOKENS, vocab_size=0), "--vocab-size must be >= 1"),
    # Three unrelated trajectories that fit only one per microbatch cannot fill 2 replicas equally.
    (dict(tokens=[[1] * 12, [2] * 37, [3] * 37], dp=2, capacity=41), "e.g. 1 or 3"),
    (dict(tokens=TOKENS, advantages=[[0.0, True, 1.0], [0.1, 0.2, 0.3]]), "trajectory 0: advantages holds booleans"),
    (dict(tokens=TOKENS, advantages=[True, [0.1, 0.2, 0.3]]), "trajectory 0: advantages holds booleans"),
    (dict(tokens=TOKENS, old_logprobs=[[0.0, -1.0, -1.0], [0.0, True, -1.0]]), "trajectory 1: old_logprobs holds"),
    (dict(tokens=TOKENS, advantages=["0.5", 1.0]), "trajectory 0: advantages holds <U3 values, not numbers"),
    (dict(tokens=TOKENS, advantages=[[0.5, np.True_, 0.2], 1.0]), "trajectory 0: advantages holds booleans"),
    (dict(tokens=TOKENS, advantages=[[0.0, [1.0], 0.2], 1.0]), "trajectory 0: advantages is not a flat list"),
    (dict(tokens=TOKENS, old_logprobs=[[None, True, -1.0], [0.0, -1.0, -1.0]]), "trajectory 0: old_logprobs holds b"),
    (dict(tokens=TOKENS, advantages=[[0.1, 0.2, 0.3], [[0.1], [0.2], [0.3]]]),
     r"trajectory 1: advantages has shape \(3, 1\)"),
], ids=["negative", "float", "short", "vocab", "mask-length", "mask-value", "nan", "nan-advantage", "empty",
        "advantages", "ids", "ids-as-strings", "ids-count", "id-none", "id-float", "id-bool", "id-bytes", "id-huge",
        "id-surrogate", "tree-tuple", "trees-str", "tokens-none", "tokens-nested", "token-bool", "advantages-scalar",
        "mask-value-names-trajectory", "capacity", "bool-advantages", "bool-logprobs", "dp-0", "chunk-0", "levels", "vocab-0",
        "dp-cannot-fill", "advantages-bool-in-list", "advantages-bool-scalar-among-lists", "logprobs-bool-in-list",
        "advantages-string", "advantages-numpy-bool-in-list", "advantages-ragged", "logprobs-bool-beside-none",
        "advantages-nested"])
def test_bad_batches_are_value_errors_with_a_fix(kwargs, words):
    tokens = kwargs.pop("tokens")
    with pytest.raises(ValueError, match=words) as info:
        api.compile_trajectories(tokens, **kwargs)
    assert "fix:" in str(info.value)


def test_ids_and_trees_give_the_plan_hartsc_writes(tmp_path):
    """The same records through the API and through the file reader compile to the same bytes, trees included
    (`harts viz --tree` reads them); numpy integer ids count as ints."""
    from harts.compiler.cli import main as hartsc_main
    from harts.schema.plan import encode_plan
    records = [{"id": 7, "tree": "task0", "tokens": [1, 2, 3, 4]}, {"id": "b", "tree": 3, "tokens": [1, 2, 3, 5]},
               {"id": 9, "tokens": [6, 7, 8]}]
    path = tmp_path / "trees.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert hartsc_main([str(path), "-o", str(tmp_path / "cli.plan"), "--capacity", "16", "--chunk-size", "2"]) == 0
    plan = api.compile_trajectories([r["tokens"] for r in records], ids=[np.int64(7), "b", 9],
                                    trees=[r.get("tree") for r in records], capacity=16, chunk_size=2)
    assert plan.step["trees"] == ["task0", 3, None]
    assert encode_plan(plan) == (tmp_path / "cli.plan").read_bytes()


def test_scalar_and_per_token_advantages_mix_as_in_records(tmp_path):
    """A scalar advantage is its value at every token, next to per-token lists, as in trees.jsonl records:
    the same bytes as hartsc writes from them."""
    from harts.compiler.cli import main as hartsc_main
    records = [{"id": "a", "tokens": [1, 2, 3, 4], "advantages": 0.5},
               {"id": "b", "tokens": [1, 2, 3, 5], "advantages": [0.0, 0.1, 0.2, -0.3]},
               {"id": "c", "tokens": [6, 7, 8], "advantages": -1}]
    path = tmp_path / "trees.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert hartsc_main([str(path), "-o", str(tmp_path / "cli.plan"), "--capacity", "16", "--chunk-size", "2"]) == 0
    plan = api.compile_trajectories([r["tokens"] for r in records], ids=[r["id"] for r in records],
                                    advantages=[r["advantages"] for r in records], capacity=16, chunk_size=2)
    np.testing.assert_array_equal(plan.step["advantages"], np.float32([0.5] * 4 + [0.0, 0.1, 0.2, -0.3] + [-1] * 3))
    assert encode_plan(plan) == (tmp_path / "cli.plan").read_bytes()


def test_advantages_take_none_and_any_torch_scalar():
    """None is 'not given' (0.0), as null in a record; torch scalars in bfloat16 or requiring a gradient are
    numbers (found by an audit: raw torch/numpy errors)."""
    plan = api.compile_trajectories(TOKENS, advantages=[None, torch.tensor(0.5, dtype=torch.bfloat16,
                                                                              requires_grad=True)])
    np.testing.assert_array_equal(plan.step["advantages"], np.float32([0, 0, 0, 0.5, 0.5, 0.5]))
    mixed = api.compile_trajectories(TOKENS, advantages=[torch.tensor(-1.0, requires_grad=True), [0.1, 0.2, 0.3]])
    np.testing.assert_array_equal(mixed.step["advantages"], np.float32([-1, -1, -1, 0.1, 0.2, 0.3]))


def test_generators_are_taken_as_sequences():
    plan = api.compile_trajectories((t for t in TOKENS), ids=(i for i in "xy"))
    assert plan.step["ids"] == ["x", "y"]
    lists = api.compile_trajectories(TOKENS, loss_masks=[[0, 1, 1]] * 2, old_logprobs=[[0.0, -1.0, -1.0]] * 2)
    made = api.compile_trajectories(TOKENS, loss_masks=(m for m in [[0, 1, 1]] * 2),
                                    old_logprobs=(v for v in [[0.0, -1.0, -1.0]] * 2))
    assert encode_plan(made) == encode_plan(lists)


def test_good_batch_compiles():
    plan = api.compile_trajectories(TOKENS, ids=["x", "y"], advantages=[[0.0, 1.0, 1.0], [0.0, -1.0, -1.0]],
                                    old_logprobs=[[0.0, -1.0, -1.0]] * 2, vocab_size=8)
    assert plan.step["ids"] == ["x", "y"] and plan.step["original_tokens"] == 6


def test_a_runs_logprobs_pass_back_with_nan_where_no_loss_reads():
    """`StepResult.logprobs` holds NaN at index 0 (and with logprobs="loss" where loss_mask is 0), which
    nothing reads: compile_trajectories takes it, and stores 0.0 there; elsewhere NaN is refused."""
    nan = float("nan")
    plan = api.compile_trajectories(TOKENS, loss_masks=[[1, 1, 1], [0, 0, 1]],
                                    old_logprobs=[[nan, -1.0, -2.0], [nan, -float("inf"), -3.0]],
                                    ref_logprobs=[[nan, -1.5, -2.5], [1e39, nan, -3.5]])
    np.testing.assert_array_equal(plan.step["old_logprobs"], [0.0, -1.0, -2.0, 0.0, 0.0, -3.0])
    np.testing.assert_array_equal(plan.step["ref_logprobs"], [0.0, -1.5, -2.5, 0.0, 0.0, -3.5])
    with pytest.raises(ValueError, match=r"old_logprobs\[1\] = nan .* where loss_mask is 0"):
        api.compile_trajectories(TOKENS, loss_masks=[[1, 1, 1], [0, 1, 1]],
                                 old_logprobs=[[nan, -1.0, -2.0], [nan, nan, -3.0]])


def test_the_first_bad_float_in_trajectory_order_is_reported():
    """Values are checked over the whole step at once; the error still names the first bad one, trajectory by
    trajectory, with its index inside its own trajectory."""
    nan, inf = float("nan"), float("inf")
    tokens = TOKENS + [[5, 6, 7, 8]]
    with pytest.raises(ValueError, match=r"^trajectory 1: old_logprobs\[2\] = inf is not"):
        api.compile_trajectories(tokens, old_logprobs=[[0.0, -1.0, -1.0], [0.0, -1.0, inf], [0.0, nan, -1.0, 2e39]])
    with pytest.raises(ValueError, match=r"^trajectory 2: advantages\[3\] = 1e\+39 is not"):
        api.compile_trajectories(tokens, advantages=[0.5, [0.1, 0.2, 0.3], [0.0, 1.0, 2.0, 1e39]])
    with pytest.raises(ValueError, match=r"^trajectory 2: ref_logprobs\[1\] = nan"):   # trajectory 1 gave none
        api.compile_trajectories(tokens, ref_logprobs=[[0.0, -1.0, -1.0], None, [0.0, nan, -1.0, -1.0]])


def test_some_trajectories_may_give_no_logprobs():
    """None for a trajectory is a trees.jsonl line without the field: NaN there, has_* False."""
    plan = api.compile_trajectories(TOKENS + [[5, 6, 7]], old_logprobs=[[0.0, -1.0, -1.0], None, [0.0, -2.0, -2.0]],
                                    ref_logprobs=[None, None, None])
    np.testing.assert_array_equal(plan.step["has_old_logprobs"], [True, False, True])
    np.testing.assert_array_equal(plan.step["old_logprobs"], [0, -1, -1, np.nan, np.nan, np.nan, 0, -2, -2])
    assert plan.step.get("ref_logprobs") is None and not any(plan.step["has_ref_logprobs"])


def test_torch_tensors_of_any_dtype_give_the_plan_of_lists():
    values = [[0.0, -0.5, -1.25], [0.0, -2.0, -0.75]]   # exact in bfloat16
    want = api.compile_trajectories(TOKENS, advantages=[0.5, -1.0], old_logprobs=values)
    got = api.compile_trajectories([torch.tensor(t) for t in TOKENS], advantages=torch.tensor([0.5, -1.0]).bfloat16(),
                                   old_logprobs=[torch.tensor(v).bfloat16() for v in values])
    for key in ("old_logprobs", "advantages", "token_offsets"):
        np.testing.assert_array_equal(got.step[key], want.step[key], err_msg=key)


def test_read_plan_refuses_a_plan_breaking_an_invariant_unless_told_not_to_check(tmp_path):
    plan = api.compile_trajectories(TOKENS)
    mb = plan.microbatches[0]
    mb["member_own_start"] = mb["member_own_start"].copy()
    mb["member_own_start"][1] -= 1      # the second member claims a row the first created
    path = tmp_path / "broken.plan"
    api.write_plan(plan, path)
    with pytest.raises(PlanFormatError, match="each row is created by exactly one member") as info:
        api.read_plan(path)
    assert str(path) in str(info.value) and "fix:" in str(info.value)
    assert api.read_plan(path, check=False).microbatches[0]["member_own_start"][1] == mb["member_own_start"][1]


@pytest.fixture(scope="module")
def tiny_model():
    from harts.executor.models.init_model import build_model
    return build_model("kimi_linear", "tiny", 16, 0)


@pytest.mark.parametrize("case, words", [
    ("plan-path", "plan must be a harts Plan, got str; fix: plan = harts.api.read_plan"),
    ("model-none", "model must be a Hugging Face model with parameters, got NoneType"),
    ("float64", "holds torch.float64 parameters; HARTS runs float32 or bfloat16 models"),
    ("all-frozen", "no model parameter requires a gradient"),
    ("inference-mode", "called inside torch.inference_mode()"),
    ("autocast", r"called inside torch.autocast\('cpu'\), which HARTS does not support"),
    ("microbatch-out-of-range", r"microbatches must be distinct indices in \[0, 1\), got \[99\]"),
    ("microbatch-negative", r"got \[-1\]"),
    ("microbatch-twice", r"got \[0, 0\]; fix: pass each microbatch once"),
    ("loss-name", "loss must be a LossConfig here, got str"),
    ("mode-typo", r"mode must be one of .*, got 'compat'; fix: pass one of them"),
    ("logprobs-typo", r"logprobs must be one of .*, got 'los'; fix: pass 'all'"),
    ("base-model", r"the model has no LM head \(KimiLinearModel: no lm_head layer\).*fix: pass the causal-LM model"),
    ("adapted-head", r"the model's lm_head is a Sequential, not a torch.nn.Linear.*fix: merge any adapter"),
])
def test_run_arguments_it_cannot_run_are_usage_errors(tiny_model, case, words):
    """Found by a user audit: each gave a raw torch or Python error from inside the step, and repeated
    microbatch indices silently doubled that microbatch's loss and gradient."""
    from harts.executor.runtime import run_step
    plan = api.compile_trajectories(TOKENS)
    model, kwargs = tiny_model, {}
    if case == "plan-path":
        plan = "step.plan"
    elif case == "model-none":
        model = None
    elif case == "float64":
        model = copy.deepcopy(tiny_model).double()
    elif case == "all-frozen":
        model = copy.deepcopy(tiny_model).requires_grad_(False)
    elif case == "base-model":
        model = tiny_model.model
    elif case == "adapted-head":
        model = copy.deepcopy(tiny_model)
        model.lm_head = torch.nn.Sequential(model.lm_head)
    elif case == "loss-name":
        kwargs["loss"] = "grpo"
    elif case == "mode-typo":
        kwargs["mode"] = "compat"
    elif case == "logprobs-typo":
        kwargs["logprobs"] = "los"
    elif case.startswith("microbatch"):
        kwargs["microbatches"] = {"microbatch-out-of-range": [99], "microbatch-negative": [-1],
                                  "microbatch-twice": [0, 0]}[case]
    context = {"inference-mode": torch.inference_mode(),
               "autocast": torch.autocast("cpu", dtype=torch.bfloat16)}.get(case, contextlib.nullcontext())
    with pytest.raises(api.UsageError, match=words), context:
        run_step(plan, model, **kwargs)


def test_numpy_string_ids_are_strings():
    plan = api.compile_trajectories(TOKENS, ids=[np.str_("a"), "b"])
    assert plan.step["ids"] == ["a", "b"] and type(plan.step["ids"][0]) is str


def test_microbatches_may_be_any_iterable_of_integers(tiny_model):
    """Found by a regression audit: torch integer tensors and generators, accepted before the argument checks,
    were refused by them."""
    from harts.executor.runtime import run_step
    plan = api.compile_trajectories(TOKENS)
    want = run_step(plan, tiny_model, backward=False, microbatches=[0]).loss
    for given in (torch.tensor([0]), (i for i in [0]), np.array([0], dtype=np.int32)):
        assert run_step(plan, tiny_model, backward=False, microbatches=given).loss == want


def test_float16_models_still_run(tiny_model):
    result = api.run(api.compile_trajectories(TOKENS), copy.deepcopy(tiny_model).half(), backward=False)
    assert np.isfinite(result.loss)


def test_device_timing_changes_only_the_clock(tiny_model):
    plan = api.compile_trajectories(TOKENS)
    model = copy.deepcopy(tiny_model)
    plain = api.run(plan, model, loss="nll")
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    timed = api.run(plan, model, loss="nll", device_timing=True)
    assert timed.loss == plain.loss
    for key in plain.logprobs:
        np.testing.assert_array_equal(timed.logprobs[key], plain.logprobs[key])
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, (p for p in model.parameters() if p.grad is not None)))
    assert len(timed.microbatch_seconds) == len(plan.microbatches) and all(t > 0 for t in timed.microbatch_seconds)


@pytest.fixture(scope="module")
def background():
    with api.BackgroundCompiler() as compiler:
        yield compiler


def _without_timing(plan):
    plan.flags.pop("planning_seconds", None)
    return encode_plan(plan)


def test_background_compiler_gives_compile_trajectories_plans_in_submission_order(background):
    """Tensors of any dtype go through numpy first; each Future holds the plan of its own request."""
    tokens = [torch.tensor(t) for t in TOKENS] + [torch.tensor([1, 2, 9, 9])]
    logprobs = [torch.tensor([0.0, -0.5, -1.25]).bfloat16(), [0.0, -2.0, -0.75], None]
    first = background.submit(tokens, old_logprobs=logprobs, advantages=torch.tensor([0.5, -1.0, 2.0]), dp=1)
    second = background.submit((t for t in TOKENS), loss_masks=[[1, 0, 1], [0, 1, 1]], levels="l1")
    third = background.submit([[3, 4, 5, 6], [3, 4, 5, 7], [3, 4]], dp=2, capacity=8)
    assert _without_timing(first.result(timeout=120)) == _without_timing(
        api.compile_trajectories(tokens, old_logprobs=logprobs, advantages=torch.tensor([0.5, -1.0, 2.0]), dp=1))
    assert _without_timing(second.result(timeout=120)) == _without_timing(
        api.compile_trajectories(TOKENS, loss_masks=[[1, 0, 1], [0, 1, 1]], levels="l1"))
    assert _without_timing(third.result(timeout=120)) == _without_timing(
        api.compile_trajectories([[3, 4, 5, 6], [3, 4, 5, 7], [3, 4]], dp=2, capacity=8))


@pytest.mark.parametrize("tokens, options", [
    (TOKENS, dict(capacity=2)),
    ([np.array([1, 2**31 + 5, 3]), np.array([1, 2])], {}),   # sent as int64: only ids that fit go as int32
    ([torch.tensor([1, -4, 3]), torch.tensor([1, 2])], {}),
    (TOKENS, dict(loss_masks=[np.array([1, 2, 1]), np.array([1, 1, 1])])),
], ids=["capacity", "id-beyond-int32", "negative-id", "mask-value"])
def test_background_compiler_raises_compile_trajectories_errors(background, tokens, options):
    with pytest.raises(ValueError) as here:
        api.compile_trajectories(tokens, **options)
    failing = background.submit(tokens, **options)
    following = background.submit(TOKENS)   # the process survives a refused batch
    with pytest.raises(ValueError) as there:
        failing.result(timeout=120)
    assert type(there.value) is type(here.value) and str(there.value) == str(here.value)
    assert following.result(timeout=120).step["num_trajectories"] == 2


def test_background_compiler_process_ignores_ctrl_c_ends_with_close_and_fails_futures_if_killed():
    import signal

    compiler = api.BackgroundCompiler()
    try:
        compiler._process.send_signal(signal.SIGINT)   # as a terminal's Ctrl-C reaches every process of the group
        assert compiler.submit(TOKENS).result(timeout=120).step["num_trajectories"] == 2
        compiler._process.kill()
        with pytest.raises(RuntimeError, match="process ended"):
            compiler.submit(TOKENS).result(timeout=120)
    finally:
        compiler.close()
    assert compiler._process.poll() is not None
    with pytest.raises(RuntimeError, match="closed"):
        compiler.submit(TOKENS)


class _ScriptList(list):
    """A class of the caller's own (this test module), which the compiler process cannot import."""


def test_background_compiler_keeps_each_answer_with_its_request(background):
    """A request that cannot be sent, one the compiler process cannot read, and a cancelled Future shift no
    later answer onto the wrong Future."""
    import threading

    with pytest.raises(TypeError, match="cannot send this batch"):
        background.submit(TOKENS, advantages=[lambda: 0.5, 1.0])
    unreadable = background.submit([_ScriptList([1, 2, 3]), _ScriptList([1, 2, 4])])
    cancelled = background.submit(TOKENS, dp=2)
    assert not cancelled.cancel()   # queued work cannot be called off; the Future says so
    last = background.submit([[5, 6, 7], [5, 6, 8], [5, 9]])
    with pytest.raises(RuntimeError, match="could not read this batch"):
        unreadable.result(timeout=120)
    assert cancelled.result(timeout=120).flags["dp"] == 2
    assert last.result(timeout=120).step["num_trajectories"] == 3
    # A compiler started by a thread that has since ended still answers (Linux's parent-death signal would
    # have followed that thread).
    made = []

    def start_and_use():
        made.append(api.BackgroundCompiler())
        made[0].submit(TOKENS).result(timeout=120)   # the compiler process is up before this thread ends

    starter = threading.Thread(target=start_and_use)
    starter.start()
    starter.join()
    with made[0] as compiler:
        time.sleep(0.5)
        assert compiler.submit(TOKENS).result(timeout=120).step["num_trajectories"] == 2


def test_closing_a_busy_background_compiler_returns_at_once_and_fails_what_it_had_not_answered():
    rng = np.random.default_rng(0)
    big = [rng.integers(0, 1000, 3000).tolist() for _ in range(400)]   # a compile that takes a while
    compiler = api.BackgroundCompiler()
    queued = [compiler.submit(big, capacity=65536) for _ in range(3)]
    start = time.perf_counter()
    compiler.close()
    assert time.perf_counter() - start < 10
    for future in queued:
        with pytest.raises(RuntimeError, match="closed before this plan was compiled"):
            future.result(timeout=10)
    assert compiler._process.poll() is not None
