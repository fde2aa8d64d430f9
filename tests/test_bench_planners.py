"""`benchmarks/bench_planners.py`, the script issue #4's targets are read from.

Run: `python -m pytest tests/test_bench_planners.py -q` (seconds). Pooling one
step must reproduce that step's `harts stats`; pooling two must add tokens
and slots, take the least step-total balance, and print a row per planner.
"""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harts.compiler.pipeline import CompileOptions
from harts.schema.summary import balance

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_planners  # noqa: E402


@pytest.fixture(scope="module")
def two_steps():
    options = CompileOptions(dp=2, capacity=32768, levels="l1+l2")
    return [bench_planners.run(bench_planners.build_batch("small", "treestep", seed=seed), options)
            for seed in (0, 1)]


def test_pooling_one_step_reproduces_its_stats(two_steps):
    step = two_steps[0]
    pooled = bench_planners.combine([step])
    for key in ("original_tokens", "decoder_tokens", "balance", "cost_balance", "balance_p5", "cost_balance_p5",
                "step_total_balance", "slots", "windows", "planning_seconds"):
        assert pooled[key] == pytest.approx(step[key]), key


def test_pooling_two_steps_sums_tokens_and_takes_the_least_step_total(two_steps):
    pooled = bench_planners.combine(two_steps)
    assert pooled["decoder_tokens"] == sum(s["decoder_tokens"] for s in two_steps)
    assert pooled["slots"] == sum(s["slots"] for s in two_steps)
    assert pooled["step_total_balance"] == min(s["step_total_balance"] for s in two_steps)
    assert min(s["balance"] for s in two_steps) <= pooled["balance"] <= max(s["balance"] for s in two_steps)
    assert pooled["least_decoder"] <= pooled["decoder_tokens"], "no plan beats the bound"
    # Balance and P5 over both steps' slots and producers side by side, recounted column by column.
    columns = [column for step in two_steps for grid in step["arrays"][:2] for column in grid.T.tolist()]
    dp = len(columns[0])
    assert pooled["balance"] == pytest.approx(sum(map(sum, columns)) / (dp * sum(map(max, columns))))
    ratios = sorted(sum(c) / dp / max(c) for c in columns if max(c) > 0)
    rank = 0.05 * (len(ratios) - 1)
    low = int(rank)
    want_p5 = ratios[low] + (ratios[min(low + 1, len(ratios) - 1)] - ratios[low]) * (rank - low)
    assert pooled["balance_p5"] == pytest.approx(want_p5)


def test_script_prints_a_row_per_planner_and_step_count():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_planners.py"), "--preset", "small", "--dp", "2",
                          "--kinds", "stepwise", "--steps", "2", "--no-ffd", "--capacity", "32768"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("stepwise")]
    assert [row[2] for row in rows] == ["L1", "L1+L2"]


@pytest.mark.parametrize("flags, words", [(["--kinds", "tree-step"], "unknown kind 'tree-step'"),
                                          (["--dp", "2,x"], "--dp: give comma-separated integers"),
                                          (["--dp", "0"], "--dp: give comma-separated integers")])
def test_bad_lists_are_one_usage_line(flags, words):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_planners.py"), *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and words in done.stderr.splitlines()[-1]


def _least_slot_maxima_brute_force(values: list[int], dp: int) -> int:
    """Every way to deal `values` into slots of `dp` (set partitions into equal groups), the least sum of maxima."""
    if not values:
        return 0
    first, rest = values[0], values[1:]
    return min(max(first, *group) + _least_slot_maxima_brute_force([v for i, v in enumerate(rest) if i not in pick],
                                                                    dp)
               for pick in itertools.combinations(range(len(rest)), dp - 1)
               for group in [[rest[i] for i in pick]])


@pytest.mark.parametrize("seed", range(6))
def test_regrouped_is_the_least_sum_of_slot_maxima_of_each_window(seed):
    rng = np.random.default_rng(seed)
    dp, slots = 2 + seed % 2, 4
    work = rng.integers(0, 100, size=(dp, slots))
    window = np.array([0, 0, 1, 1]) if seed % 3 else np.zeros(slots, dtype=np.int64)
    out = bench_planners.regrouped(work, window)
    for w in np.unique(window):
        columns = np.flatnonzero(window == w)
        assert sorted(out[:, columns].ravel()) == sorted(work[:, columns].ravel()), "the same values, re-dealt"
        want = _least_slot_maxima_brute_force(work[:, columns].ravel().tolist(), dp)
        assert out[:, columns].max(axis=0).sum() == want
    assert balance(out) >= balance(work) - 1e-12


def test_regrouped_balance_bounds_the_plans_own(two_steps):
    pooled = bench_planners.combine(two_steps)
    assert pooled["cost_balance"] <= pooled["regrouped_cost_balance"] + 1e-12


def test_balance_loss_parts_add_up_to_what_the_cost_balance_lacks(two_steps):
    pooled = bench_planners.combine(two_steps)
    parts = pooled["cost_balance_loss"]
    assert set(parts) == {"first slot", "middle slots", "last slot", "producers"}
    assert min(parts.values()) >= 0
    assert sum(parts.values()) == pytest.approx(1 - pooled["cost_balance"])


def test_balance_loss_splits_a_hand_grid_by_slot():
    # Two replicas, three slots and one producer: leads (max - mean) 1, 0, 2 and 3 over maxima 4+2+6+9 = 21.
    cost = np.array([[4, 2, 6], [2, 2, 2]])
    producers = np.array([[9], [3]])
    step = {"arrays": (cost, producers, cost, producers)}
    assert bench_planners.balance_loss([step]) == pytest.approx(
        {"first slot": 1 / 21, "middle slots": 0.0, "last slot": 2 / 21, "producers": 3 / 21})
    assert sum(bench_planners.balance_loss([step]).values()) == pytest.approx(1 - balance(cost, producers))
