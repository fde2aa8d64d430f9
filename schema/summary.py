"""Step statistics computed from a plan (the numbers of `harts stats`).

Everything here is derived from the plan's arrays, so the compiler, the tools
and the executor report the same numbers. Legend: D replicas, J slots, H
windows, r[d, j] the decoder work (rows the consumer at replica d, slot j runs
through the decoder: all its compact rows without windows, its rows with
`row_cached_by == -1` with them), p[d, h] the rows the producer of replica d,
window h computes (0 without windows). Replay rows are never counted.

Balance (Section 5.3): eta_sched = (sum r + sum p) / (D (sum_j max_d r[d, j]
+ sum_h max_d p[d, h])). `balance_p5` is the 5th percentile (linear
interpolation) of mean/max over replicas of every slot and every window's
producers (computations whose maximum is 0 are skipped); `step_total_balance`
is mean/max over replicas of each replica's total r + p. `cost_balance` and
`cost_balance_p5` are the same with r and p in L2's cost model
(`harts.schema.cost_model`) instead of rows, recounted from the plan's rows.
`producers` counts the (window, replica) cells with p[d, h] > 0.
"""
from __future__ import annotations

import numpy as np

from harts.schema.cost_model import DEFAULT_PAIRS_PER_TOKEN, RowCostWeights, row_cost_weights
from harts.schema.plan import Plan

STATS_KEYS = ("trajectories", "original_tokens", "compact_tokens", "compression", "decoder_tokens",
              "replay_tokens", "microbatches", "dp", "slots", "windows", "balance", "max_rounds",
              "capacity", "chunk_size", "planning_seconds")


def decoder_rows(mb: dict) -> int:
    """Rows a consumer runs through the decoder: all of them, or those no producer computes."""
    cached_by = mb.get("row_cached_by")
    return len(mb["row_token"]) if cached_by is None else int(np.count_nonzero(np.asarray(cached_by) < 0))


def slot_grid(plan: Plan) -> tuple[int, int]:
    """(D, J): the shape of a per-(replica, slot) array."""
    return int(plan.flags["dp"]), 1 + max((int(mb["slot"]) for mb in plan.microbatches), default=-1)


def slot_work(plan: Plan) -> np.ndarray:
    """r[d, j]: decoder rows of each consumer, zero where a replica has no microbatch at a slot."""
    work = np.zeros(slot_grid(plan), dtype=np.int64)
    for mb in plan.microbatches:
        work[int(mb["replica"]), int(mb["slot"])] += decoder_rows(mb)
    return work


def window_count(plan: Plan) -> int:
    return 1 + max((int(mb["window"]) for mb in plan.microbatches if "window" in mb), default=-1)


def producer_work(plan: Plan) -> np.ndarray:
    """p[d, h]: rows each window's producer computes on each replica (shape D x H; H = 0 without windows)."""
    dp = int(plan.flags["dp"])
    work = np.zeros((dp, window_count(plan)), dtype=np.int64)
    for producer in plan.producers or ():
        work[int(producer["replica"]), int(producer["window"])] += len(producer["row_token"])
    return work


def computed_terms(entity: dict, cached_by=None) -> tuple[int, int, int]:
    """(n, A, R) of the rows a consumer or producer computes (`harts.schema.cost_model`).

    A row is computed unless `cached_by` (aligned with the rows) is >= 0. Each
    computed row's pairs are its position + 1; its rectangle term is the length
    of the member that created it (the member whose positions from
    `member_own_start` on map to new rows). Cached rows of a member are a
    prefix of its path, so a member creates computed rows at positions
    [max(own start, cached count), length): counted from the member runs alone.
    """
    positions = np.asarray(entity["row_position"], dtype=np.int64)
    computed = np.ones(len(positions), dtype=bool) if cached_by is None else np.asarray(cached_by) < 0
    rows = int(np.count_nonzero(computed))
    pairs = int((positions[computed] + 1).sum())
    run_start = np.asarray(entity["run_row_start"], dtype=np.int64)
    run_length = np.asarray(entity["run_length"], dtype=np.int64)
    offsets = np.asarray(entity["member_run_offsets"], dtype=np.int64)
    cached_prefix_sum = np.concatenate([[0], np.cumsum(~computed)])
    run_cached = cached_prefix_sum[run_start + run_length] - cached_prefix_sum[run_start]
    member_runs = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    members = len(offsets) - 1
    length = np.bincount(member_runs, weights=run_length, minlength=members).astype(np.int64)
    cached = np.bincount(member_runs, weights=run_cached, minlength=members).astype(np.int64)
    created = length - np.maximum(np.asarray(entity["member_own_start"], dtype=np.int64), cached)
    rectangle = int((np.maximum(created, 0) * length).sum())
    return rows, pairs, rectangle


def computed_cost(entity: dict, weights: RowCostWeights, cached_by=None) -> int:
    """Forward + backward cost of the rows a consumer or producer computes (`computed_terms`)."""
    return weights.cost(*computed_terms(entity, cached_by))


def cost_work(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """`slot_work` and `producer_work` in L2's cost model, with the plan's `pairs_per_token` (default the
    paper's models for plans that do not record it)."""
    weights = row_cost_weights(int(plan.flags.get("pairs_per_token", DEFAULT_PAIRS_PER_TOKEN)))
    work = np.zeros(slot_grid(plan), dtype=np.int64)
    for mb in plan.microbatches:
        work[int(mb["replica"]), int(mb["slot"])] += computed_cost(mb, weights, mb.get("row_cached_by"))
    producers = np.zeros((int(plan.flags["dp"]), window_count(plan)), dtype=np.int64)
    for producer in plan.producers or ():
        producers[int(producer["replica"]), int(producer["window"])] += computed_cost(producer, weights)
    return work, producers


def work_grids(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(`slot_work`, `producer_work`, *`cost_work`): every per-computation array the statistics read."""
    return slot_work(plan), producer_work(plan), *cost_work(plan)


def critical_path(work: np.ndarray, producers: np.ndarray | None = None):
    """Sum of slot maxima and window-producer maxima (the paper's Phi in the grids' unit): a step's time on
    replicas that wait for each other at every slot and window producer."""
    return ((work.max(axis=0).sum() if work.size else 0)
            + (producers.max(axis=0).sum() if producers is not None and producers.size else 0))


def balance(work: np.ndarray, producers: np.ndarray | None = None) -> float:
    """The paper's eta_sched: all work over D * `critical_path`."""
    producers = np.zeros((work.shape[0], 0), dtype=np.int64) if producers is None else producers
    denominator = work.shape[0] * critical_path(work, producers)
    return float((work.sum() + producers.sum()) / denominator) if denominator else 1.0


def balance_percentile(work: np.ndarray, producers: np.ndarray, q: float = 5.0) -> float:
    """q-th percentile of mean/max over replicas of every slot and every window producer."""
    columns = [c for c in (*work.T, *producers.T) if c.max() > 0]
    if not columns:
        return 1.0
    return float(np.percentile([c.mean() / c.max() for c in columns], q))


def step_total_balance(work: np.ndarray, producers: np.ndarray) -> float:
    """Mean over max of each replica's total non-replay work in the step."""
    totals = work.sum(axis=1) + producers.sum(axis=1)
    return float(totals.mean() / totals.max()) if totals.size and totals.max() > 0 else 1.0


def max_rounds(plan: Plan) -> int:
    """The most sequential linear-attention calls (per layer) of any decoder run the plan schedules: a
    consumer on its complete layout (windows off), a consumer on its uncached rows, a window producer."""
    runs = [int(mb["num_rounds"]) for mb in plan.microbatches]
    runs += [int(mb["residual_num_rounds"]) for mb in plan.microbatches if "residual_num_rounds" in mb]
    runs += [int(producer["num_rounds"]) for producer in plan.producers or ()]
    return max(runs, default=0)


def plan_statistics(plan: Plan, planning_seconds: float = 0.0, grids: tuple | None = None) -> dict:
    """Every `harts stats` key; `grids`, when given, is this plan's `work_grids` (not recounted)."""
    flags = plan.flags
    compact = sum(len(mb["row_token"]) for mb in plan.microbatches)
    original = int(plan.step["original_tokens"])
    work, producers, *costs = work_grids(plan) if grids is None else grids
    decoder = int(work.sum() + producers.sum())
    l1_compact = int(plan.step.get("l1_compact_tokens", compact))
    return {
        "trajectories": int(plan.step["num_trajectories"]),
        "original_tokens": original,
        "compact_tokens": compact,
        "compression": original / compact if compact else 0.0,
        # Producer rows plus consumer rows no producer computes (= compact_tokens without windows).
        "decoder_tokens": decoder,
        "replay_tokens": sum(len(mb["replay_rows"]) for mb in plan.microbatches),
        "microbatches": len(plan.microbatches),
        "dp": int(flags["dp"]),
        "slots": int(work.shape[1]),
        "windows": int(producers.shape[1]),
        "balance": balance(work, producers),
        "max_rounds": max_rounds(plan),
        "capacity": int(flags["capacity"]),
        "chunk_size": int(flags["chunk_size"]),
        "planning_seconds": float(planning_seconds),
        # Additions beyond the contract's keys: the trie's compression bound.
        "trie_unique_tokens": int(plan.step["trie_unique_tokens"]),
        "compression_bound": original / int(plan.step["trie_unique_tokens"]) if plan.step["trie_unique_tokens"] else 0.0,
        # Additions for L2 windows (meaningful for L1 plans too: no windows, no reduction).
        "compression_l2": original / decoder if decoder else 0.0,
        "decoder_reduction_vs_l1": 1.0 - decoder / l1_compact if l1_compact else 0.0,
        "balance_p5": balance_percentile(work, producers),
        "step_total_balance": step_total_balance(work, producers),
        # Balance in L2's cost model (forward + backward, attention pairs included), what placement levels.
        "cost_balance": balance(*costs),
        "cost_balance_p5": balance_percentile(*costs),
        # What the planners shorten: the sum over slots of the largest consumer plus over windows of the largest
        # producer (the step's time when replicas wait for each other there), in rows and in L2's cost model.
        "critical_path_tokens": int(critical_path(work, producers)),
        "cost_critical_path": int(critical_path(*costs)),
        # `windows` counts slot groups, even one whose producers cache nothing (no row two of its
        # consumers on one replica share): this counts the (window, replica) producers that compute rows.
        "producers": int(np.count_nonzero(producers)),
    }
