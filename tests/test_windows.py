"""Sharing windows at run time (`--levels l1+l2`): producer forward, consumers on uncached rows,
one producer backward per window.

References: the same plan run with windows off (every consumer on its
complete layout, nothing reused) and the Hugging Face model run per
trajectory. A producer's backward passes are counted by an autograd hook on
its first tensor, so "once" is measured, not asserted by construction.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.executor.layout import build_layout
from harts.executor.losses import LossConfig
from harts.executor import windows as windows_module
from harts.executor.runtime import run_step
from harts.schema.plan_invariants import check_plan

from prefix_inputs import forests, unless_dp_refused

from fidelity import (VOCAB, boundary_tree, gradient_floor, hf_reference, relative_error, tiny_kimi_linear,
                      tiny_qwen3_next)


def two_trees() -> list[list[int]]:
    """Two boundary trees: forks on, before and after chunk boundaries, duplicates, strict prefixes."""
    return boundary_tree(np.random.default_rng(0)) + boundary_tree(np.random.default_rng(5))


def compile_windows(lists, *, capacity=250, chunk_size=64, dp=1, advantages=None, max_window_slots=0,
                    loss_masks=None):
    batch = TrajectoryBatch.from_token_lists(lists, advantages=advantages, loss_masks=loss_masks)
    plan = compile_batch(batch, CompileOptions(levels="l1+l2", capacity=capacity, chunk_size=chunk_size, dp=dp,
                                               max_window_slots=max_window_slots, verify=True)).plan
    check_plan(plan, batch.tokens, batch.token_offsets)
    return plan


@pytest.fixture(scope="module")
def kimi():
    return tiny_kimi_linear()


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen3_next()


def assert_same_step(got, want, what: str) -> None:
    assert abs(got.loss - want.loss) <= 1e-5 * max(1.0, abs(want.loss)), what
    assert abs(got.moe_aux_loss - want.moe_aux_loss) <= 1e-6, what
    assert abs(got.moe_z_loss - want.moe_z_loss) <= 1e-5, what
    for layer, load in want.moe_load.items():
        np.testing.assert_array_equal(got.moe_load[layer], load, err_msg=what)
    for key, lp in want.logprobs.items():
        assert np.nanmax(np.abs(got.logprobs[key] - lp)) <= 1e-5, (what, key)
    floor = gradient_floor(want.grads)
    worst = max((relative_error(got.grads[name], grad, floor), name) for name, grad in want.grads.items())
    assert worst[0] <= 1e-4, (what, worst)


@pytest.mark.parametrize("chunk_size,dp", [(64, 1), (16, 2)])
def test_windows_give_the_gradients_of_running_every_consumer_without_reuse(kimi, chunk_size, dp):
    rng = np.random.default_rng(3)
    lists = two_trees()
    plan = compile_windows(lists, chunk_size=chunk_size, dp=dp, advantages=rng.normal(size=len(lists)))
    assert plan.producers, "the workload must give windows something to share"
    for loss in (LossConfig("nll", moe_aux_coef=0.01, moe_z_coef=0.001), LossConfig("grpo")):
        reuse = run_step(plan, kimi, loss=loss)
        alone = run_step(plan, kimi, loss=loss, windows=False)
        assert_same_step(reuse, alone, loss.kind)
        # Each producer ran once and its graph was traversed by exactly one backward pass.
        assert reuse.producers_run == len(plan.producers)
        assert reuse.producer_backward_passes == reuse.producers_run
        assert reuse.most_live_producers == 1   # replica by replica, even for a dp = 2 plan in one process
        assert alone.producers_run == 0
        decoder = sum(len(p["row_token"]) for p in plan.producers) + sum(
            int(np.count_nonzero(np.asarray(mb["row_cached_by"]) < 0)) for mb in plan.microbatches)
        assert reuse.rows == decoder < alone.rows


def test_each_cached_rows_lm_head_normalizer_is_computed_once_per_window(kimi, monkeypatch):
    """The producer computes a cached row's log-sum-exp and entropy the first time a consumer reads the
    row; later consumers share it. Counted against the plan: the rows a consumer's positions read are
    its rows with a child (row_parent), the cached ones name their producer row in row_cached_by. With
    an entropy bonus and prompt-like unweighted positions, and with logprobs "loss" (only weighed
    positions' rows), log-probabilities, entropy and gradients stay those of no reuse."""
    rng = np.random.default_rng(7)
    lists = two_trees()
    masks = [(rng.random(len(t)) < 0.6).astype(np.int64) for t in lists]
    plan = compile_windows(lists, chunk_size=16, advantages=rng.normal(size=len(lists)), loss_masks=masks)
    read_by_window = set()
    for mb in plan.microbatches:
        parent, cached_by = np.asarray(mb["row_parent"]), np.asarray(mb["row_cached_by"])
        read = np.unique(parent[parent >= 0])
        read_by_window |= {(int(mb["window"]), int(mb["replica"]), int(r)) for r in cached_by[read] if r >= 0}
    assert len(read_by_window) > 0
    computed = []
    real = windows_module.row_normalizers

    def counting(hidden, weight, rows, **kwargs):
        computed.append(rows.numel())
        return real(hidden, weight, rows, **kwargs)

    monkeypatch.setattr(windows_module, "row_normalizers", counting)
    loss = LossConfig("grpo", entropy_coef=0.05)
    for logprobs in ("all", "loss"):
        computed.clear()
        reuse = run_step(plan, kimi, loss=loss, logprobs=logprobs)
        alone = run_step(plan, kimi, loss=loss, logprobs=logprobs, windows=False)
        assert_same_step(reuse, alone, logprobs)
        assert abs(reuse.entropy - alone.entropy) <= 1e-5 * abs(alone.entropy), logprobs
        if logprobs == "all":
            assert sum(computed) == len(read_by_window)
        else:   # only rows a weighed position reads
            assert 0 < sum(computed) < len(read_by_window)


def test_short_windows_release_each_producer_before_the_next(kimi):
    """--max-window-slots 2 splits the step into two windows, each with its own producer, run one at a time."""
    plan = compile_windows(two_trees(), chunk_size=16, max_window_slots=2)
    windows = {int(mb["window"]) for mb in plan.microbatches}
    assert windows == {0, 1} and sorted(int(p["window"]) for p in plan.producers) == [0, 1]
    reuse = run_step(plan, kimi)
    assert reuse.producers_run == reuse.producer_backward_passes == 2
    assert reuse.most_live_producers == 1
    assert_same_step(reuse, run_step(plan, kimi, windows=False), "two windows")


def test_windows_match_the_hugging_face_model_run_per_trajectory(kimi):
    lists = two_trees()
    plan = compile_windows(lists)
    result = run_step(plan, kimi)
    want_logprobs, want_grads = hf_reference(kimi, lists)
    for i, want in enumerate(want_logprobs):
        assert np.max(np.abs(result.logprobs[str(i)][1:] - want)) <= 1e-5, f"trajectory {i}"
    floor = gradient_floor(want_grads)
    worst = max((relative_error(result.grads[n], g, floor), n) for n, g in want_grads.items())
    assert worst[0] <= 1e-4, worst


def test_windows_on_qwen3_next_match_no_reuse(qwen):
    plan = compile_windows(two_trees(), chunk_size=16)
    loss = LossConfig("nll", moe_aux_coef=0.01, moe_z_coef=0.001)
    assert_same_step(run_step(plan, qwen, loss=loss), run_step(plan, qwen, loss=loss, windows=False), "qwen3-next")


def test_recomputation_keeps_window_gradients_and_the_single_producer_backward(kimi):
    plan = compile_windows(two_trees(), chunk_size=16)
    plain = run_step(plan, kimi)
    recomputed = run_step(plan, kimi, recompute=True)
    assert recomputed.producer_backward_passes == recomputed.producers_run == len(plan.producers)
    assert_same_step(recomputed, plain, "recompute")


def test_a_step_that_stops_early_keeps_no_producer_alive(kimi):
    """An interrupt (or a failing objective, or an out-of-memory error caught and retried) between two
    consumers of a window: the producer's graph must not outlive the step (found by an audit: a hook
    bound to the producer record kept it alive in a cycle through autograd that gc cannot see)."""
    import gc

    from harts.executor.windows import ProducerRecord

    plan = compile_windows(two_trees(), chunk_size=16)
    assert len(plan.microbatches) > 1 and plan.producers

    def interrupted(work, _label):
        for i, item in enumerate(work):
            if i == 1:
                raise KeyboardInterrupt
            yield item

    def live():
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is ProducerRecord)

    run_step(plan, kimi, loss=LossConfig("grpo"))   # warm every cache a run fills
    kimi.zero_grad(set_to_none=True)
    before = live()
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            run_step(plan, kimi, loss=LossConfig("grpo"), progress=interrupted)
    kimi.zero_grad(set_to_none=True)
    assert live() == before == 0


def test_a_producer_backward_that_fails_keeps_no_producer_alive(kimi, monkeypatch):
    """Out of memory in the producer's one backward, with recomputation (whose checkpoints hold the graph
    in a cycle gc cannot see): the record is released all the same (found by a regression audit)."""
    import gc

    from harts.executor.windows import ProducerRecord

    def out_of_memory(self):
        raise torch.OutOfMemoryError("simulated")

    plan = compile_windows(two_trees(), chunk_size=16)
    monkeypatch.setattr(ProducerRecord, "backward", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        run_step(plan, kimi, loss=LossConfig("grpo"), recompute=True)
    kimi.zero_grad(set_to_none=True)
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is ProducerRecord]


@pytest.mark.parametrize("recompute", [False, True])
def test_a_backward_that_fails_keeps_nothing_alive(kimi, monkeypatch, recompute):
    """Out of memory part-way through a consumer's backward: once the step has raised, the microbatch's
    graph and what was recomputed for it are gone, so a retry starts from the memory of a clean step.
    Two audits found them held: with recomputation, torch's checkpoint frames (reached from inside the
    graph) held the window and statistics record, which hold graph tensors, a cycle gc cannot see, ~100
    tensors more per failure; and in every mode autograd kept the failed backward's pending work until
    the next backward anywhere in the process (390 tensors, 10.7 MB here)."""
    import gc

    import harts.executor.models.kimi_linear as kimi_module

    attention = kimi_module.ancestor_attention

    def failing_in_backward(*args, **kwargs):
        out = attention(*args, **kwargs)
        if out.requires_grad:   # the first backward to reach it is a consumer's, mid-layer

            def out_of_memory(_grad):
                raise torch.OutOfMemoryError("simulated")

            out.register_hook(out_of_memory)
        return out

    def live_tensors():
        gc.collect()
        # type(), not isinstance(): some gc objects warn when probed (torch.distributed's deprecated names).
        return sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter))

    plan = compile_windows(two_trees(), chunk_size=16)
    loss = LossConfig("grpo", moe_aux_coef=0.01)
    run_step(plan, kimi, loss=loss, recompute=recompute)   # warm every cache a run fills
    kimi.zero_grad(set_to_none=True)
    clean = live_tensors()
    monkeypatch.setattr(kimi_module, "ancestor_attention", failing_in_backward)
    counts = []
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            run_step(plan, kimi, loss=loss, recompute=recompute)
        kimi.zero_grad(set_to_none=True)
        counts.append(live_tensors())
    assert counts == [clean, clean], f"live tensors: {clean} after a clean step, {counts} after each failed one"


def test_forward_only_runs_producers_without_backward(kimi):
    plan = compile_windows(two_trees())
    result = run_step(plan, kimi, backward=False)
    alone = run_step(plan, kimi, backward=False, windows=False)
    assert result.producers_run == len(plan.producers) and result.producer_backward_passes == 0
    for key, lp in alone.logprobs.items():
        assert np.nanmax(np.abs(result.logprobs[key] - lp)) <= 1e-5


def test_a_consumer_whose_rows_are_all_cached_still_gets_its_logprobs(kimi):
    """A strict prefix alone in its consumer: every row it has comes from the producer."""
    rng = np.random.default_rng(7)
    stem = list(rng.integers(3, VOCAB, 26))
    tail = lambda n: list(rng.integers(3, VOCAB, n))   # noqa: E731
    lists = [stem[:11] + tail(17), stem[:15], stem[:24], stem[:17] + tail(14), stem[:16] + tail(15),
             stem[:16] + tail(16)]
    plan = compile_windows(lists, capacity=33, chunk_size=8, dp=2)
    assert any(np.all(np.asarray(mb["row_cached_by"]) >= 0) for mb in plan.microbatches)
    reuse, alone = run_step(plan, kimi), run_step(plan, kimi, windows=False)
    assert_same_step(reuse, alone, "all cached")


def test_consumer_layout_runs_only_uncached_rows():
    plan = compile_windows(two_trees())
    offsets = plan.step["token_offsets"]
    for mb in plan.microbatches:
        complete = build_layout(mb, offsets, 64)
        layout = build_layout(mb, offsets, 64, windows=True)
        uncached = np.flatnonzero(np.asarray(mb["row_cached_by"]) < 0)
        if len(uncached) == len(mb["row_token"]):
            assert layout.decoder_rows is None
            continue
        np.testing.assert_array_equal(layout.decoder_rows.numpy(), uncached)
        assert layout.views.num_queries == len(uncached)
        # Everything the LM head and the loss read is unchanged.
        np.testing.assert_array_equal(layout.position_row.numpy(), complete.position_row.numpy())
        assert layout.row_weight.sum() == complete.row_weight.sum()
        # A consumer that reads a producer needs its residual calls.
        with pytest.raises(KeyError):
            build_layout({k: v for k, v in mb.items() if not k.startswith("residual_")}, offsets, 64, windows=True)


def test_hartsc_defaults_to_windows_and_harts_run_realises_them(tmp_path, capsys):
    """As a user runs it: the default plan has producers; `--no-windows` is the same step without reuse."""
    import json

    from harts.cli import main as harts
    from harts.compiler.cli import main as hartsc

    trees = tmp_path / "trees.jsonl"
    trees.write_text("".join(json.dumps({"id": i, "tokens": [int(t) for t in tokens]}) + "\n"
                             for i, tokens in enumerate(two_trees())))
    assert harts(["init-model", "--preset", "tiny", "--vocab-size", str(VOCAB), "-o", str(tmp_path / "model")]) == 0
    assert hartsc([str(trees), "-o", str(tmp_path / "step.plan"), "--capacity", "250", "--chunk-size", "16"]) == 0
    summaries, logprobs = {}, {}
    for name, flags in (("windows", []), ("alone", ["--no-windows"])):
        capsys.readouterr()
        out = tmp_path / f"{name}.npz"
        assert harts(["run", str(tmp_path / "step.plan"), "--model", str(tmp_path / "model"), "--json",
                      "--logprobs-out", str(out), *flags]) == 0
        summaries[name] = json.loads(capsys.readouterr().out)
        logprobs[name] = np.load(out)
    assert summaries["windows"]["window_producers"] > 0 == summaries["alone"]["window_producers"]
    assert summaries["windows"]["decoder_rows"] < summaries["alone"]["decoder_rows"]
    assert abs(summaries["windows"]["loss"] - summaries["alone"]["loss"]) <= 1e-5
    for key in logprobs["alone"].files:
        np.testing.assert_allclose(logprobs["windows"][key][1:], logprobs["alone"][key][1:], atol=1e-5)


# ----------------------------------------------------------------- the linear-attention handoff alone, in float64


def node_index(records) -> tuple[list[np.ndarray], int]:
    """Per record, the trie node of each row: rows with the same token path share a node."""
    nodes: dict = {}
    out = []
    for record in records:
        parent = np.asarray(record["row_parent"], dtype=np.int64)
        token = np.asarray(record["row_token"]).tolist()
        keys: list = []
        for r in range(len(parent)):   # parents precede children in memory
            keys.append((keys[parent[r]] if parent[r] >= 0 else ()) + (token[r],))
        out.append(np.array([nodes.setdefault(key, len(nodes)) for key in keys], dtype=np.int64))
    return out, len(nodes)


def check_residual_handoff(plan, B: int) -> None:
    """Producer rounds, then every consumer's residual rounds starting from the producer's exported
    states, against the naive token-by-token recurrence over each trajectory alone (float64):
    outputs on every uncached row, and gradients of the inputs through every handoff."""
    from types import SimpleNamespace

    from harts.executor.layout import producer_layout
    from harts.executor.models.runner import RowRunner
    from harts.executor.ops.linear_attention import naive_linear_attention
    from harts.executor.windows import ConsumerView, ProducerRecord
    from harts.schema.runs import expand_runs

    producers = plan.producers or []
    node_of, num_nodes = node_index([*producers, *plan.microbatches])
    node_of_producer, node_of_consumer = node_of[:len(producers)], node_of[len(producers):]
    gen = torch.Generator().manual_seed(0)
    H, K, V = 2, 4, 3
    inputs = [torch.randn(num_nodes, H, K, generator=gen, dtype=torch.float64, requires_grad=True),
              torch.randn(num_nodes, H, K, generator=gen, dtype=torch.float64, requires_grad=True),
              torch.randn(num_nodes, H, V, generator=gen, dtype=torch.float64, requires_grad=True),
              (-torch.rand(num_nodes, H, K, generator=gen, dtype=torch.float64) * 0.2).requires_grad_(),
              torch.rand(num_nodes, H, generator=gen, dtype=torch.float64).requires_grad_()]
    weight = torch.randn(num_nodes, H, V, generator=gen, dtype=torch.float64)
    runner = SimpleNamespace(chunk_size=B)
    offsets = plan.step["token_offsets"]

    # HARTS: producer forward, consumers on uncached rows, one producer backward per window.
    records = {}
    for p, producer in enumerate(producers):
        record = records[(int(producer["window"]), int(producer["replica"]))] = ProducerRecord()
        rows = torch.from_numpy(node_of_producer[p])
        RowRunner.linear_rounds(runner, *(x[rows] for x in inputs), producer_layout(producer), 0, record)
    loss = 0
    for mb, nodes in zip(plan.microbatches, node_of_consumer):
        if not np.any(np.asarray(mb["row_cached_by"]) >= 0):
            continue
        layout = build_layout(mb, offsets, B, windows=True)
        window = ConsumerView(records[(int(mb["window"]), int(mb["replica"]))], layout.cached)
        rows = torch.from_numpy(nodes)
        o = RowRunner.linear_rounds(runner, *(x[rows] for x in inputs), layout, 0, window)
        loss = loss + (o * weight[rows[layout.decoder_rows]]).sum()
    if not isinstance(loss, torch.Tensor):   # no consumer reads a producer: nothing handed over
        return
    # As at run time: consumer backward into the inputs and the leaves, then each producer backward once.
    loss.backward()
    for record in records.values():
        record.backward()
    harts_grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]

    # Reference: every consumer member trajectory alone, outputs kept on that consumer's uncached rows.
    reference = 0
    for mb, nodes in zip(plan.microbatches, node_of_consumer):
        cached = np.asarray(mb["row_cached_by"]) >= 0
        if not cached.any():
            continue
        done = np.zeros(len(cached), dtype=bool)
        runs = np.asarray(mb["member_run_offsets"])
        for m in range(len(mb["member_trajectory"])):
            path = expand_runs(mb["run_row_start"][runs[m]:runs[m + 1]], mb["run_length"][runs[m]:runs[m + 1]])
            keep = ~cached[path] & ~done[path]
            if not keep.any():
                continue
            done[path] = True
            rows = torch.from_numpy(nodes[path])
            o, _ = naive_linear_attention(*(x[rows] for x in inputs), torch.tensor([0, len(path)]), None,
                                          torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                          chunk_size=B, use_qk_l2norm_in_kernel=True)
            keep_t = torch.from_numpy(np.flatnonzero(keep))
            reference = reference + (o[keep_t] * weight[rows[keep_t]]).sum()
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-9)
    for got, want in zip(harts_grads, torch.autograd.grad(reference, inputs)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_windows_run_in_bfloat16(kimi):
    """The paper trains in bfloat16: windows keep working there, within bfloat16 rounding of no reuse."""
    import copy

    model = copy.deepcopy(kimi).to(torch.bfloat16)
    plan = compile_windows(two_trees(), chunk_size=16)
    reuse, alone = run_step(plan, model), run_step(plan, model, windows=False)
    assert reuse.producer_backward_passes == reuse.producers_run == len(plan.producers)
    assert abs(reuse.loss - alone.loss) <= 1e-2 * abs(alone.loss)
    # bfloat16 against float32 differs by ~2e-2 here; reuse must not add more than that.
    worst = max(float(np.nanmax(np.abs(reuse.logprobs[k] - lp))) for k, lp in alone.logprobs.items())
    assert worst <= 2e-2, worst
    floor = gradient_floor({name: grad.float() for name, grad in alone.grads.items()})
    for name, grad in alone.grads.items():
        assert relative_error(reuse.grads[name].float(), grad.float(), floor) <= 5e-2, name


def test_residual_calls_from_producer_states_equal_each_trajectory_alone():
    B = 8
    plan = compile_windows(two_trees(), chunk_size=B, capacity=250)
    consumers = [mb for mb in plan.microbatches if np.any(np.asarray(mb["row_cached_by"]) >= 0)]
    assert plan.producers and any(np.any(mb["residual_sequence_producer_state"] >= 0) for mb in consumers)
    check_residual_handoff(plan, B)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests(), st.integers(2, 6), st.integers(1, 2), st.integers(0, 20))
def test_residual_handoff_on_random_forests(lists, chunk_size, dp, extra_capacity):
    """Forks anywhere, duplicates, strict prefixes: every windowed plan's handoffs are exact."""
    dp = min(dp, len(lists))
    capacity = max(len(t) for t in lists) + extra_capacity
    plan = unless_dp_refused(lambda: compile_windows(lists, chunk_size=chunk_size, capacity=capacity, dp=dp), dp)
    if plan is None:
        return
    check_residual_handoff(plan, chunk_size)


def test_a_plan_without_residual_calls_runs_without_reuse(kimi):
    """Plans from the hartsc that wrote producers before consumers had residual calls still run exactly."""
    plan = compile_windows(two_trees(), chunk_size=16)
    old = [{k: v for k, v in mb.items() if not k.startswith("residual_")} for mb in plan.microbatches]
    old_plan = type(plan)(header=plan.header, step=plan.step, microbatches=old, summary=plan.summary,
                          producers=plan.producers)
    with pytest.warns(UserWarning, match="compiled by an older hartsc"):
        result = run_step(old_plan, kimi, backward=False)
    assert result.producers_run == 0
    want = run_step(plan, kimi, backward=False, windows=False)
    for key, lp in want.logprobs.items():
        np.testing.assert_array_equal(result.logprobs[key], lp)
