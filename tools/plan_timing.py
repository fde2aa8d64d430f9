"""A plan's step timed as `harts run` runs it, and its balance in seconds and in the cost model's units.

`time_plan` runs the step with windows on and `run_step(device_timing=True)`,
so each consumer (its decoder rows and LM head) and each window producer
(forward + backward) is timed on the device; `plan_balances` gives the
paper's eta_sched over consumer slots and window producers in seconds,
rows (`harts stats`' `balance`), the cost model at the plan's P (its
`cost_balance`) and at a fitted P.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from harts.schema.cost_model import DEFAULT_PAIRS_PER_TOKEN, row_cost_weights
from harts.schema.summary import balance, computed_terms, slot_grid, window_count
from harts.tools.cost_fit import Fit, pairs_per_token, training_pair_units


@dataclass(frozen=True)
class Computation:
    """One consumer's residual rows or one window producer of a plan, timed as `harts run` runs the step."""
    kind: str               # "consumer" or "producer"
    replica: int
    slot_or_window: int     # a consumer's slot, a producer's window
    rows: int
    pairs: int
    rectangle: int
    seconds: float          # median over the timed steps


def time_plan(plan, model, repeat: int, progress) -> list[Computation]:
    """The plan's step as `harts run` runs it (windows on), `repeat` times after one untimed run, each
    consumer and producer timed on the device (`run_step(device_timing=True)`); medians."""
    from harts.executor.runtime import run_step
    run_step(plan, model)
    consumer_runs: dict[int, list[float]] = {}
    producer_runs: dict[tuple[int, int], list[float]] = {}
    for attempt in range(repeat):
        result = run_step(plan, model, device_timing=True)
        for index, seconds in zip(result.unit_microbatches, result.microbatch_seconds):
            consumer_runs.setdefault(index, []).append(seconds)
        for cell, seconds in result.producer_seconds.items():
            producer_runs.setdefault(cell, []).append(seconds)
        progress(f"plan step {attempt + 1} of {repeat}: {result.seconds:.3f} s")
    computations = []
    for index, runs in sorted(consumer_runs.items()):
        mb = plan.microbatches[index]
        computations.append(Computation("consumer", int(mb["replica"]), int(mb["slot"]),
                                        *computed_terms(mb, mb.get("row_cached_by")), statistics.median(runs)))
    producers = {(int(p["window"]), int(p["replica"])): p for p in plan.producers or ()}
    for (window, replica), runs in sorted(producer_runs.items()):
        computations.append(Computation("producer", replica, window, *computed_terms(producers[window, replica]),
                                        statistics.median(runs)))
    return computations


def plan_grids(plan, computations: list[Computation], value) -> tuple[np.ndarray, np.ndarray]:
    """(r[d, j], p[d, h]): `value` of each consumer at its (replica, slot) and producer at (replica, window)."""
    grids = {"consumer": np.zeros(slot_grid(plan)), "producer": np.zeros((int(plan.flags["dp"]), window_count(plan)))}
    for c in computations:
        grids[c.kind][c.replica, c.slot_or_window] += value(c)
    return grids["consumer"], grids["producer"]


def plan_balances(plan, computations: list[Computation], fit: Fit) -> dict[str, float]:
    """eta_sched (consumer slots and window producers) of the plan as run, in each unit: measured seconds,
    rows, the cost model at the plan's P and (when the fit gave one) at the fitted P, and the fit's seconds
    (t0 in every computation)."""
    plan_weights = row_cost_weights(plan_pairs_per_token(plan))
    fitted = pairs_per_token(fit, 3)
    units = {"seconds": lambda c: c.seconds,
             "rows": lambda c: c.rows,
             "cost_plan_p": lambda c: plan_weights.cost(c.rows, c.pairs, c.rectangle),
             "fitted_seconds": lambda c: float(fit.predict(c.rows, training_pair_units(c.pairs, c.rectangle)))}
    if fitted is not None:   # no fitted P: no such cost model (P = 0 would be rows again)
        fitted_weights = row_cost_weights(max(1, round(fitted)))
        units["cost_fitted_p"] = lambda c: fitted_weights.cost(c.rows, c.pairs, c.rectangle)
    return {name: balance(*plan_grids(plan, computations, value)) for name, value in units.items()}


# How the table names `plan_balances`' keys.
BALANCE_LABELS = {"seconds": "seconds", "rows": "rows", "cost_plan_p": "cost model at the plan's P",
                  "cost_fitted_p": "cost model at the fitted P", "fitted_seconds": "fitted seconds"}


def plan_pairs_per_token(plan) -> int:
    return int(plan.flags.get("pairs_per_token", DEFAULT_PAIRS_PER_TOKEN))
