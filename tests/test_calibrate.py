"""`harts calibrate`: the fit against scipy's NNLS, probe terms against closed forms, the command end to end.

Run: `python -m pytest tests/test_calibrate.py -q`.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.optimize import nnls

from harts.api import compile_trajectories
from harts.cli import main as harts
from harts.compiler.cli import main as hartsc
from harts.schema.plan import read_plan
from harts.schema.summary import computed_terms, plan_statistics
from harts.schema.errors import HartsError
from harts.tools.calibrate import (Timing, fits_of, memory_errors_reported, probe_shapes, probe_tokens, report,
                                   summarize)
from harts.tools.cost_fit import Fit, fit_nonnegative, pairs_per_token
from harts.tools.plan_timing import Computation, plan_balances

from run_workspace import make_run_workspace


def test_fit_recovers_the_coefficients_of_exact_timings():
    rows = np.array([256, 16384, 1024, 16384, 4096, 16384], dtype=np.float64)
    pair_term = np.array([3e4, 2e6, 5e5, 8e6, 8e6, 3e7]) * 3
    seconds = 0.01 + 2e-5 * rows + 3e-9 * pair_term
    fit = fit_nonnegative(rows, pair_term, seconds)
    assert fit.intercept == pytest.approx(0.01, rel=1e-9)
    assert fit.per_row == pytest.approx(2e-5, rel=1e-9)
    assert fit.per_pair == pytest.approx(3e-9, rel=1e-9)
    assert fit.worst_relative_error < 1e-9
    assert pairs_per_token(fit, 3) == pytest.approx(2e-5 / 9e-9, rel=1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_fit_is_scipys_nonnegative_least_squares_of_relative_errors(seed):
    """The subset enumeration against scipy.optimize.nnls on the same relative-error system, including
    timings a negative coefficient would fit better (noise, or a falling cost)."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(3, 9))
    rows = rng.integers(1, 20000, count).astype(np.float64)
    pair_term = rng.integers(1, 10**8, count).astype(np.float64)
    coefficients = rng.normal(size=3) * np.array([0.05, 1e-5, 1e-9])
    seconds = np.abs(coefficients[0] + coefficients[1] * rows + coefficients[2] * pair_term) + 1e-3
    seconds *= np.exp(rng.normal(scale=0.2, size=count))
    fit = fit_nonnegative(rows, pair_term, seconds)
    columns = np.stack([np.ones(count), rows, pair_term], axis=1) / seconds[:, None]
    scale = np.abs(columns).max(axis=0)   # scipy's active-set method wants columns of like size
    reference, _ = nnls(columns / scale, np.ones(count))
    reference /= scale
    ours = np.array([fit.intercept, fit.per_row, fit.per_pair])
    residual = lambda c: np.sum((columns @ c - 1.0) ** 2)   # noqa: E731
    assert np.all(ours >= 0)
    assert residual(ours) <= residual(reference) * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("length, count", [(5, 1), (5, 7), (64, 3), (130, 2)])
def test_probe_terms_are_those_of_independent_sequences(length, count):
    """A probe shares nothing: n = cL, A = c L(L+1)/2 and R = c L^2, read from its compiled plan."""
    plan = compile_trajectories(probe_tokens(length, count, vocab=64, seed=1), levels="l1", dp=1,
                                capacity=length * count, chunk_size=4, vocab_size=64)
    assert len(plan.microbatches) == 1
    assert computed_terms(plan.microbatches[0]) == (count * length, count * length * (length + 1) // 2,
                                                    count * length * length)


def test_probe_shapes_vary_rows_and_depth_apart():
    assert probe_shapes([256, 1024, 16384], 16384) == [(256, 1), (256, 64), (1024, 1), (1024, 16), (16384, 1)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    rng = np.random.default_rng(0)
    trees = [{"id": i, "tokens": [1, 2, 3, 4, 5, 6] + rng.integers(7, 64, int(rng.integers(2, 9))).tolist()}
             for i in range(10)]
    folder = make_run_workspace(tmp_path_factory.mktemp("calibrate"), trees)
    for levels in ("l1", "l1+l2"):
        assert hartsc([str(folder / "trees.jsonl"), "-o", str(folder / f"dp2-{levels}.plan"), "--chunk-size", "2",
                       "--dp", "2", "--capacity", "24", "--levels", levels, "--vocab-size", "64"]) == 0
    return folder


@pytest.mark.parametrize("levels", ["l1", "l1+l2"])
def test_calibrate_times_probes_and_the_plan(workspace, capsys, levels):
    assert harts(["calibrate", "--model", str(workspace / "model"), "--lengths", "8,32", "--rows", "64",
                  "--repeat", "1", "--chunk-size", "2", "--plan", str(workspace / f"dp2-{levels}.plan"),
                  "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(p["rows"], p["pairs"], p["rectangle"]) for p in result["probes"]] == [
        (8, 36, 64), (64, 288, 512), (32, 528, 1024), (64, 1056, 2048)]
    assert all(p["total"] > 0 and p["forward"] > 0 for p in result["probes"])
    assert {"total", "forward"} <= set(result["fits"])
    assert all(p["fitted"] > 0 and p["backward"] >= 0 for p in result["probes"])
    plan = read_plan(workspace / f"dp2-{levels}.plan")
    stats = plan_statistics(plan)
    kinds = [c["kind"] for c in result["plan"]["computations"]]
    assert kinds.count("consumer") == len(plan.microbatches) > 2
    assert kinds.count("producer") == len(plan.producers or ()) == (stats["producers"] if levels == "l1+l2" else 0)
    if levels == "l1+l2":
        assert stats["producers"] > 0 and stats["decoder_tokens"] < stats["compact_tokens"]
    assert all(c["seconds"] > 0 for c in result["plan"]["computations"])
    # In rows and in the plan's cost model, the balance of the step as run is harts stats' (consumers' decoder
    # rows and window producers).
    assert result["plan"]["balance"]["rows"] == pytest.approx(stats["balance"], abs=1e-12)
    assert result["plan"]["balance"]["cost_plan_p"] == pytest.approx(stats["cost_balance"], abs=1e-12)
    assert 0 < result["plan"]["balance"]["seconds"] <= 1
    # eta_sched = work / (D x critical path), in seconds too.
    assert result["plan"]["balance"]["seconds"] == pytest.approx(
        result["plan"]["work_seconds"] / (2 * result["plan"]["critical_path_seconds"]), rel=1e-12)


def test_calibrate_prints_the_flag_to_use(workspace, capsys):
    assert harts(["calibrate", "--model", str(workspace / "model"), "--lengths", "8,32", "--rows", "64",
                  "--repeat", "1", "--chunk-size", "2"]) == 0
    out = capsys.readouterr().out
    # Probes this short may leave attention unmeasurable: then the line says there is nothing to recommend.
    assert "fit of forward + backward" in out
    assert sum(line.startswith(("use: hartsc --pairs-per-token ", "use: no --pairs-per-token to recommend"))
               for line in out.splitlines()) == 1


def test_device_timing_splits_the_step_into_consumers_and_producers(workspace):
    """Every unit is timed once, producers apart, and together they fit inside the step's own time."""
    from harts.executor.cli import load_model
    from harts.executor.runtime import run_step
    plan, model = read_plan(workspace / "dp2-l1+l2.plan"), load_model(str(workspace / "model"))
    result = run_step(plan, model, device_timing=True)
    assert sorted(result.unit_microbatches) == list(range(len(plan.microbatches)))
    assert set(result.producer_seconds) == {(int(p["window"]), int(p["replica"])) for p in plan.producers}
    times = [*result.microbatch_seconds, *result.producer_seconds.values()]
    assert all(t > 0 for t in times) and sum(times) <= result.seconds
    plain = run_step(plan, model)
    assert set(plain.producer_seconds) == set(result.producer_seconds)   # host clock: timed all the same
    assert run_step(plan, model, windows=False).producer_seconds == {}


@pytest.mark.parametrize("flags, words", [
    (["--lengths", "64"], "--lengths '64': not two or more positive integers"),
    (["--lengths", "8,x"], "not two or more positive integers"),
    (["--rows", "0"], "--rows 0: must be positive"),
    (["--repeat", "0"], "--repeat 0: must be positive"),
    (["--chunk-size", "0"], "--chunk-size 0: must be positive"),
    (["--lengths", "64,128", "--rows", "32"], "fewer than 4 probes"),
    (["--lengths", "1024,2048", "--rows", "2048"], "three probes always fit exactly"),
    (["--lengths", "16,256"], "16 is shorter than the chunk size 64"),
    (["--lengths", "2,4", "--rows", "1024", "--chunk-size", "2"], "512 trajectories, more than the model's "
                                                                 "vocabulary of 64 tokens"),
    (["--plan", "dp2-l1.plan", "--chunk-size", "4"], "compiled with chunk size 2"),
])
def test_bad_flags_are_one_line(workspace, capsys, monkeypatch, flags, words):
    monkeypatch.chdir(workspace)
    assert harts(["calibrate", "--model", str(workspace / "model"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("DefaultCPUAllocator: can't allocate memory"),
                                   torch.OutOfMemoryError("CUDA out of memory")])
def test_running_out_of_memory_is_one_line(error):
    with pytest.raises(HartsError, match=r"ran out of memory \(\w+\); fix: lower the longest --lengths or --rows"):
        with memory_errors_reported():
            raise error


def test_other_runtime_errors_are_not_taken_for_memory():
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with memory_errors_reported():
            raise RuntimeError("shape mismatch")


def timings_from(seconds_of, shapes=((256, 1), (256, 64), (1024, 1), (1024, 16), (4096, 4))):
    return [Timing(f"{c} x {L}", c * L, c * L * (L + 1) // 2, c * L * L, 0.4 * seconds_of(c, L),
                   seconds_of(c, L)) for L, c in shapes]


def test_no_recommendation_when_attention_is_not_measurable():
    """Time in rows alone fits the pair term to 0: say so and recommend nothing, rather than "use 0"."""
    timings = timings_from(lambda c, L: 0.01 + 1e-5 * c * L)
    result = summarize(timings, fits_of(timings))
    assert result["pairs_per_token"] is None and result["recommended_pairs_per_token"] is None
    assert any("not measurable with probes up to 4,096 tokens" in w for w in result["warnings"])
    assert "use: no --pairs-per-token to recommend" in report(result)


def test_a_poor_fit_is_flagged():
    timings = timings_from(lambda c, L: 0.01 + 1e-5 * c * L + (0.5 if c > 1 else 0.0))
    result = summarize(timings, fits_of(timings))
    assert any("the fit misses a probe by" in w for w in result["warnings"])
    exact = timings_from(lambda c, L: 0.01 + 1e-5 * c * L + 1e-9 * (c * L * (L + 1) // 2 + 2 * c * L * L))
    exact_result = summarize(exact, fits_of(exact))
    assert exact_result["warnings"] == [] and exact_result["recommended_pairs_per_token"] == round(1e-5 / 3e-9)


def test_a_producer_is_charged_for_the_normalizers_it_computes_when_first_read():
    """The LM-head normalizers of cached rows are computed in the turn of the consumer that first reads them,
    but are the producer's work (their backward joins the producer's): its timer counts them, once per row."""
    from harts.executor.windows import CellTimer, ProducerRecord
    ticks = iter(range(100))
    totals: dict = {}
    record = ProducerRecord(CellTimer(lambda: float(next(ticks)), totals, (0, 1)))
    record.tensors[("final", -1)] = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(7, 4)
    record.normalizers(np.array([0, 2]), weight, with_entropy=False)
    assert totals == {(0, 1): 1.0}
    record.normalizers(np.array([0, 2]), weight, with_entropy=False)   # computed already: nothing to count
    assert totals == {(0, 1): 1.0}
    record.normalizers(np.array([2, 4]), weight, with_entropy=False)
    assert totals == {(0, 1): 2.0}


def test_without_a_fitted_p_there_is_no_fitted_cost_model_balance(workspace):
    """P = 0 would be rows again, shown under another name: the entry is left out instead."""
    plan = read_plan(workspace / "dp2-l1.plan")
    computations = [Computation("consumer", int(mb["replica"]), int(mb["slot"]), *computed_terms(mb), 1.0 + i)
                    for i, mb in enumerate(plan.microbatches)]
    rows_only = Fit(0.01, 1e-5, 0.0, 0.0)
    assert set(plan_balances(plan, computations, rows_only)) == {"seconds", "rows", "cost_plan_p", "fitted_seconds"}
    with_pairs = Fit(0.01, 1e-5, 1e-9, 0.0)
    assert "cost_fitted_p" in plan_balances(plan, computations, with_pairs)


def test_probes_whose_backward_came_out_negative_are_left_out_of_its_fit():
    timings = timings_from(lambda c, L: 0.01 + 1e-5 * c * L)
    noisy = [Timing(t.name, t.rows, t.pairs, t.rectangle, t.total * 1.1, t.total) for t in timings[:3]] + timings[3:]
    fits = fits_of(noisy)
    assert "backward" not in fits and {"total", "forward"} <= set(fits)
    assert "fewer than three probes with a positive backward time" in report(summarize(noisy, fits))
    assert "backward" in fits_of(timings)
