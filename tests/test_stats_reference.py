"""`harts stats`' balance numbers against a brute-force recount written from their definitions.

Run: `python -m pytest tests/test_stats_reference.py -q` (a few seconds).

schema/summary.py derives eta_sched, P5 and step-total balance (Section 5.3)
from vectorised per-(replica, slot) grids and counts L2's cost model with
prefix sums over runs. Here every number is recounted row by row from the
plan's own arrays, following the definitions in docs and the paper: a
consumer's work is its rows no producer computes, a producer's work is all its
rows; a computed row at position t costs alpha_F + alpha_B plus beta_F (t + 1)
query-key pairs forward and beta_B k backward, where k is the length of the
member whose path first reaches the row (its rectangle term).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.schema.cost_model import DEFAULT_PAIRS_PER_TOKEN, row_cost_weights
from harts.schema.summary import plan_statistics
from harts.tools import gen


def _rows_of_members(entity: dict) -> list[list[int]]:
    """For each member in order, the rows its positions 0..n-1 map to."""
    offsets = entity["member_run_offsets"]
    starts, lengths = entity["run_row_start"], entity["run_length"]
    members = []
    for m in range(len(offsets) - 1):
        rows: list[int] = []
        for run in range(int(offsets[m]), int(offsets[m + 1])):
            rows.extend(range(int(starts[run]), int(starts[run]) + int(lengths[run])))
        members.append(rows)
    return members


def _recount(entity: dict, weights, consumer: bool) -> tuple[int, int]:
    """(rows computed, their forward + backward cost), one row at a time."""
    cached_by = entity.get("row_cached_by") if consumer else None
    creator_length: dict[int, int] = {}
    for rows in _rows_of_members(entity):
        for row in rows:
            creator_length.setdefault(row, len(rows))
    rows = pairs = rectangle = 0
    for row in range(len(entity["row_token"])):
        if cached_by is not None and int(cached_by[row]) >= 0:
            continue
        rows += 1
        pairs += int(entity["row_position"][row]) + 1
        rectangle += creator_length[row]
    return rows, weights.cost(rows, pairs, rectangle)


def _percentile_5(values: list[float]) -> float:
    """Linear interpolation between closest ranks, written out."""
    ordered = sorted(values)
    rank = 0.05 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _balances(columns: list[list[int]]) -> tuple[float, float, float, int]:
    """(eta_sched, P5 of mean/max per column, mean/max of replica totals, sum of column maxima) of per-replica
    column loads."""
    total = sum(sum(c) for c in columns)
    replicas = len(columns[0])
    peak = sum(max(c) for c in columns)
    ratios = [sum(c) / len(c) / max(c) for c in columns if max(c) > 0]
    totals = [sum(c[d] for c in columns) for d in range(replicas)]
    return total / (replicas * peak), _percentile_5(ratios), sum(totals) / len(totals) / max(totals), peak


def brute_force_statistics(plan) -> dict:
    dp = int(plan.flags["dp"])
    weights = row_cost_weights(int(plan.flags.get("pairs_per_token", DEFAULT_PAIRS_PER_TOKEN)))
    slots = 1 + max(int(mb["slot"]) for mb in plan.microbatches)
    windows = 1 + max((int(p["window"]) for p in plan.producers or ()), default=-1)
    rows = {("slot", j): [0] * dp for j in range(slots)} | {("window", h): [0] * dp for h in range(windows)}
    cost = {key: [0] * dp for key in rows}
    for mb in plan.microbatches:
        n, c = _recount(mb, weights, consumer=True)
        rows["slot", int(mb["slot"])][int(mb["replica"])] += n
        cost["slot", int(mb["slot"])][int(mb["replica"])] += c
    for producer in plan.producers or ():
        n, c = _recount(producer, weights, consumer=False)
        rows["window", int(producer["window"])][int(producer["replica"])] += n
        cost["window", int(producer["window"])][int(producer["replica"])] += c
    balance, p5, step_total, critical_path = _balances(list(rows.values()))
    cost_balance, cost_p5, _, cost_critical_path = _balances(list(cost.values()))
    producers = sum(1 for key, per_replica in rows.items() if key[0] == "window" for n in per_replica if n)
    return {"decoder_tokens": sum(sum(c) for c in rows.values()), "slots": slots, "windows": windows,
            "producers": producers,
            "balance": balance, "balance_p5": p5, "step_total_balance": step_total,
            "cost_balance": cost_balance, "cost_balance_p5": cost_p5,
            "critical_path_tokens": critical_path, "cost_critical_path": cost_critical_path}


@pytest.mark.parametrize("kind,dp,capacity,levels", [
    ("treestep", 2, 4096, "l1+l2"), ("stepwise", 4, 8192, "l1+l2"), ("treestep", 3, 6000, "l1"),
])
def test_balance_statistics_equal_a_row_by_row_recount(kind, dp, capacity, levels):
    config = gen.GenConfig(kind=kind, tasks=3, seed=5, context_limit=capacity, system_prompt_tokens=512,
                           task_tokens_min=50, task_tokens_max=300, tool_tokens_median=300.0)
    records = list(gen.generate(config))
    batch = TrajectoryBatch.from_token_lists([r["tokens"] for r in records], ids=[r["id"] for r in records])
    plan = compile_batch(batch, CompileOptions(dp=dp, capacity=capacity, levels=levels)).plan
    want = brute_force_statistics(plan)
    if levels == "l1+l2":
        assert want["windows"] >= 1 and want["decoder_tokens"] < sum(len(mb["row_token"]) for mb in plan.microbatches)
    got = plan_statistics(plan)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=0), key
    # The recount must have something to disagree about: uneven slots, so P5 differs from the mean.
    assert want["balance_p5"] < want["balance"] < 1.0


def _forking_trajectories(seed: int, trial: int) -> tuple[list[list[int]], int, int]:
    """Small random prefix trees (each trajectory forks from an earlier one), a chunk size and a capacity."""
    rng = np.random.default_rng(seed)
    for _ in range(trial + 1):
        base = [list(rng.integers(3, 60, size=rng.integers(2, 40)))]
        trajectories = []
        for _ in range(rng.integers(4, 25)):
            parent = base[rng.integers(len(base))]
            t = parent[:rng.integers(1, len(parent) + 1)] + list(rng.integers(3, 60, size=rng.integers(1, 30)))
            base.append(t)
            trajectories.append([int(x) for x in t])
        chunk_size = int(rng.choice([2, 4, 8]))
        capacity = max(map(len, trajectories)) + int(rng.integers(0, 80))
        rng.integers(1, 3)   # the dp of the search this case came from; kept so the stream stays the same
    return trajectories, chunk_size, capacity


def _rounds_of_calls(sequence_round) -> int:
    """Sequential calls of one decoder run, from its call table: one per distinct round index."""
    return len(np.unique(np.asarray(sequence_round)))


def test_max_rounds_counts_every_decoder_run_the_plan_schedules():
    # Seed 1, trial 4: a window producer runs 3 rounds where every consumer's complete layout runs 2 (found
    # by a random search); max_rounds must count the producer's (and the consumers' residual) calls too.
    trajectories, chunk_size, capacity = _forking_trajectories(1, 4)
    batch = TrajectoryBatch.from_token_lists(trajectories, ids=list(range(len(trajectories))))
    plan = compile_batch(batch, CompileOptions(capacity=capacity, chunk_size=chunk_size, levels="l1+l2")).plan
    complete = max(_rounds_of_calls(mb["sequence_round"]) for mb in plan.microbatches)
    others = [_rounds_of_calls(p["sequence_round"]) for p in plan.producers]
    others += [_rounds_of_calls(mb["residual_sequence_round"]) for mb in plan.microbatches
               if "residual_sequence_round" in mb]
    assert max(others) > complete, "the case no longer has a run longer than the complete layouts'"
    assert plan_statistics(plan)["max_rounds"] == max(others)


def test_every_statistic_has_a_row_in_the_concepts_table():
    """docs/concepts.md's `harts stats` table names every key the command prints, in its order, and no other."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "concepts.md").read_text()
    table = text[text.index("## What `harts stats` prints"):]
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.MULTILINE)
    batch = TrajectoryBatch.from_token_lists([[1, 2, 3], [1, 2, 4]])
    printed = plan_statistics(compile_batch(batch, CompileOptions(capacity=64)).plan)
    assert documented == list(printed)
