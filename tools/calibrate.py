"""`harts calibrate --model DIR`: measure L2's cost model on a model and device, and check it on a plan.

L2 balances replicas in a cost model (`harts.schema.cost_model`): an entity
computing n rows with A query-key pairs and backward rectangle R costs
3 x P x n + A + 2 R pair units forward + backward, where P is `hartsc
--pairs-per-token` (default the paper's models, 65,536). P is a property of
the model and the hardware: how many attention pairs cost as much as one
row's linear work (projections, MLP or MoE, the LM head). This tool times
forward and backward of probe steps on the model itself and fits

    seconds = t0 + x n + y (A + 2 R),   so P = x / (3 y),

by non-negative least squares on relative errors. Probes are independent
random trajectories (no shared prefixes), one microbatch each: for every
length L, one trajectory of L tokens and `--rows` // L of them, so rows and
pairs vary independently. Forward and backward are also fitted apart
(backward = a training step's time less a forward-only step's), which shows
whether the model's "backward costs twice forward" holds.

`--plan PLAN` then times each of the plan's microbatches alone (complete
layouts, windows off) and compares them with the fit, and reports the
plan's balance (eta_sched over its replica x slot grid) measured in seconds
against what rows, the plan's own cost model and the fitted one predict.

Invariant: the probes' n, A and R are read from their compiled plans
(`harts.schema.summary.computed_terms`), never assumed from their shapes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from itertools import combinations

import numpy as np

from harts.schema.errors import HartsError

DEFAULT_LENGTHS = (256, 1024, 4096, 16384)
DEFAULT_ROWS = 16384
# Repeats of one probe whose median deviation exceeds this fraction of their median make the fit unreliable
# (one slow repeat among several does not count: it is what a median is for).
NOISY_SPREAD = 0.1


@dataclass(frozen=True)
class Timing:
    """One timed step: its computed rows n, pairs A and rectangle R, and median seconds."""
    name: str
    rows: int
    pairs: int
    rectangle: int
    forward: float          # forward-only step (no graph kept)
    total: float            # forward + backward step
    spread: float = 0.0     # median |repeat - median| / median of the forward + backward repeats

    @property
    def backward(self) -> float:
        return max(self.total - self.forward, 0.0)


@dataclass(frozen=True)
class Fit:
    """seconds = intercept + per_row x rows + per_pair x pair_term, fitted with non-negative coefficients."""
    intercept: float
    per_row: float
    per_pair: float
    worst_relative_error: float

    def predict(self, rows, pair_term):
        return self.intercept + self.per_row * np.asarray(rows, dtype=np.float64) + \
            self.per_pair * np.asarray(pair_term, dtype=np.float64)


def fit_nonnegative(rows, pair_term, seconds) -> Fit:
    """Least squares of relative errors over the three coefficients, each >= 0: the best of every subset's
    unconstrained solution that is non-negative (exact for three unknowns)."""
    rows, pair_term, seconds = (np.asarray(v, dtype=np.float64) for v in (rows, pair_term, seconds))
    if len(seconds) < 3 or np.any(seconds <= 0):
        raise ValueError("a fit needs at least three timings, each positive")
    columns = np.stack([np.ones_like(rows), rows, pair_term], axis=1) / seconds[:, None]
    target = np.ones_like(seconds)   # each equation divided by its own time: relative errors
    best, best_residual = np.zeros(3), float(target @ target)
    for size in (1, 2, 3):
        for subset in combinations(range(3), size):
            solution, *_ = np.linalg.lstsq(columns[:, subset], target, rcond=None)
            if np.any(solution < 0):
                continue
            residual = target - columns[:, subset] @ solution
            if residual @ residual < best_residual:
                best = np.zeros(3)
                best[list(subset)] = solution
                best_residual = float(residual @ residual)
    predicted = best[0] + best[1] * rows + best[2] * pair_term
    return Fit(float(best[0]), float(best[1]), float(best[2]),
               float(np.max(np.abs(predicted - seconds) / seconds)))


def pairs_per_token(fit: Fit, rows_weight: int) -> float | None:
    """P such that rows cost `rows_weight` x P pair units (3 forward + backward, 1 forward, 1 backward with
    the backward's own pair weight folded in); None when the pair term was not measurable (fitted 0)."""
    return fit.per_row / (rows_weight * fit.per_pair) if fit.per_pair > 0 else None


def probe_tokens(length: int, count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(count, length))
    tokens[:, 0] = np.arange(count) % vocab   # distinct first tokens: no shared prefix when count <= vocab
    return tokens.tolist()


def probe_shapes(lengths, rows: int) -> list[tuple[int, int]]:
    """(length, trajectories) per probe: one trajectory, and `rows` // length of them; duplicates once."""
    shapes = []
    for length in lengths:
        for count in (1, max(1, rows // length)):
            if (length, count) not in shapes:
                shapes.append((length, count))
    return shapes


def _synchronized_seconds(device, work) -> float:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def time_step(plan, model, device, repeat: int, microbatches=None,
              windows: bool = True) -> tuple[float, float, float]:
    """Median seconds of a forward-only step and of a forward + backward step (the objective is `nll`),
    and the spread of the latter's repeats."""
    from harts.executor.runtime import run_step

    def forward():
        run_step(plan, model, backward=False, microbatches=microbatches, windows=windows)

    def training():
        run_step(plan, model, backward=True, microbatches=microbatches, windows=windows)

    forward_seconds = [_synchronized_seconds(device, forward) for _ in range(repeat)]
    total_seconds = [_synchronized_seconds(device, training) for _ in range(repeat)]
    median = statistics.median(total_seconds)
    deviation = statistics.median(abs(t - median) for t in total_seconds)
    return statistics.median(forward_seconds), median, deviation / median


def entity_terms(mb: dict) -> tuple[int, int, int]:
    from harts.schema.summary import computed_terms
    return computed_terms(mb)


def run_probes(model, device, *, lengths, rows: int, chunk_size: int, repeat: int, progress) -> list[Timing]:
    from harts.api import compile_trajectories
    vocab = int(model.config.vocab_size)
    timings, warmed = [], False
    for index, (length, count) in enumerate(probe_shapes(lengths, rows)):
        plan = compile_trajectories(probe_tokens(length, count, vocab, seed=index), levels="l1", dp=1,
                                    capacity=max(length * count, chunk_size), chunk_size=chunk_size,
                                    vocab_size=vocab)
        if len(plan.microbatches) != 1:   # the capacity holds every row: L1 never splits such a step
            raise HartsError(f"probe {length} x {count} compiled into {len(plan.microbatches)} microbatches; "
                             "fix: report this (a probe should be one microbatch)")
        if not warmed:   # allocator and thread-pool warm-up, not timed
            time_step(plan, model, device, 1)
            warmed = True
        forward, total, spread = time_step(plan, model, device, repeat)
        timing = Timing(f"{count} x {length}", *entity_terms(plan.microbatches[0]), forward, total, spread)
        timings.append(timing)
        progress(f"probe {timing.name}: forward {forward:.4f} s, forward + backward {total:.4f} s")
    return timings


def fits_of(timings: list[Timing]) -> dict[str, Fit]:
    """The cost model's three fits: forward + backward against A + 2R, forward against A, backward against R."""
    rows = [t.rows for t in timings]
    return {"total": fit_nonnegative(rows, [t.pairs + 2 * t.rectangle for t in timings], [t.total for t in timings]),
            "forward": fit_nonnegative(rows, [t.pairs for t in timings], [t.forward for t in timings]),
            "backward": fit_nonnegative(rows, [t.rectangle for t in timings],
                                        [max(t.backward, 1e-9) for t in timings])}


def time_plan(plan, model, device, repeat: int, progress) -> list[tuple[dict, Timing]]:
    """Each microbatch of `plan` alone, on its complete layout (windows off)."""
    results = []
    time_step(plan, model, device, 1, microbatches=[0], windows=False)   # warm-up
    for index, mb in enumerate(plan.microbatches):
        forward, total, spread = time_step(plan, model, device, repeat, microbatches=[index], windows=False)
        results.append((mb, Timing(f"microbatch {index}", *entity_terms(mb), forward, total, spread)))
        progress(f"microbatch {index}: forward + backward {total:.4f} s")
    return results


def plan_balances(plan, timed: list[tuple[dict, Timing]], fit: Fit) -> dict[str, float]:
    """eta_sched of the plan's (replica, slot) grid, windows off, in each unit."""
    from harts.schema.cost_model import DEFAULT_PAIRS_PER_TOKEN, row_cost_weights
    from harts.schema.summary import balance
    dp = int(plan.flags["dp"])
    slots = 1 + max(int(mb["slot"]) for mb, _ in timed)
    weights = row_cost_weights(int(plan.flags.get("pairs_per_token", DEFAULT_PAIRS_PER_TOKEN)))
    grids = {name: np.zeros((dp, slots)) for name in ("seconds", "rows", "plan cost model", "fitted cost model")}
    for mb, t in timed:
        cell = (int(mb["replica"]), int(mb["slot"]))
        grids["seconds"][cell] += t.total
        grids["rows"][cell] += t.rows
        grids["plan cost model"][cell] += weights.cost(t.rows, t.pairs, t.rectangle)
        grids["fitted cost model"][cell] += float(fit.predict(t.rows, t.pairs + 2 * t.rectangle))
    return {name: balance(grid) for name, grid in grids.items()}


def _format_ppt(value: float | None) -> str:
    return "not measurable (attention too cheap to time)" if value is None else f"{value:,.0f}"


def report(timings: list[Timing], fits: dict[str, Fit], plan_rows=None, balances=None) -> str:
    total = fits["total"]
    lines = [f"{'probe':>14} {'rows n':>9} {'pairs A':>15} {'rect R':>15} {'fwd s':>8} {'bwd s':>8} "
             f"{'fwd+bwd s':>9} {'fitted':>8} {'error':>7}"]
    for t in timings:
        predicted = float(total.predict(t.rows, t.pairs + 2 * t.rectangle))
        lines.append(f"{t.name:>14} {t.rows:>9,} {t.pairs:>15,} {t.rectangle:>15,} {t.forward:>8.4f} "
                     f"{t.backward:>8.4f} {t.total:>9.4f} {predicted:>8.4f} {(predicted - t.total) / t.total:>+7.1%}")
    lines += ["", "fit of forward + backward: seconds = t0 + x n + y (A + 2R)",
              f"  t0 {total.intercept * 1e3:.3f} ms per step, x {total.per_row * 1e6:.4f} us per row, "
              f"y {total.per_pair * 1e9:.5f} ns per pair unit; largest error {total.worst_relative_error:.1%}",
              f"  pairs per token P = x / 3y: {_format_ppt(pairs_per_token(total, 3))}"]
    forward, backward = fits["forward"], fits["backward"]
    lines.append(f"  forward alone (A): P = {_format_ppt(pairs_per_token(forward, 1))}, largest error "
                 f"{forward.worst_relative_error:.1%}; backward alone (R): P = "
                 f"{_format_ppt(pairs_per_token(backward, 1))}, largest error {backward.worst_relative_error:.1%}")
    ratios = [f"{name} {b / f:.2f}x" for name, b, f in (("rows", backward.per_row, forward.per_row),
                                                       ("pairs", backward.per_pair, forward.per_pair)) if f > 0]
    if ratios:
        lines.append(f"  backward / forward per unit: {', '.join(ratios)} (the cost model assumes 2x)")
    spread = max(t.spread for t in timings)
    if spread > NOISY_SPREAD:
        lines.append(f"  warning: a probe's repeats deviate by {spread:.0%} of their median: the machine is busy "
                     "or its clock varies, and the fit is unreliable; rerun on a quiet machine")
    ppt = pairs_per_token(total, 3)
    lines.append(f"use: hartsc --pairs-per-token {0 if ppt is None else max(1, round(ppt))}")
    if plan_rows:
        errors = np.array([(float(total.predict(t.rows, t.pairs + 2 * t.rectangle)) - t.total) / t.total
                           for _, t in plan_rows])
        lines += ["", f"plan: {len(plan_rows)} microbatches alone on their complete layouts; the fit's error "
                      f"median {np.median(np.abs(errors)):.1%}, largest {np.max(np.abs(errors)):.1%}"]
        lines.append("  balance (eta_sched, windows off): " + ", ".join(
            f"{name} {value:.2%}" for name, value in balances.items()))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harts calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (harts init-model writes one)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs (default auto: cuda when available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model dtype (default float32)")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                   help=f"comma-separated probe trajectory lengths (default {','.join(map(str, DEFAULT_LENGTHS))})")
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS,
                   help=f"rows of the many-trajectory probe of each length (default {DEFAULT_ROWS}; use your "
                        "microbatch capacity on a GPU)")
    p.add_argument("--chunk-size", type=int, default=64, help="linear-attention chunk size B (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per probe, the median is used (default 3)")
    p.add_argument("--plan", help="also time this plan's microbatches and compare its balance in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if len(lengths) < 2 or min(lengths) < 1:
        raise HartsError(f"--lengths {text!r}: not two or more positive integers; fix: e.g. --lengths 256,1024,4096")
    return lengths


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return calibrate(args)
    except HartsError as err:
        print(f"harts calibrate: {err}", file=sys.stderr)
        return err.exit_code


def calibrate(args) -> int:
    lengths = parse_lengths(args.lengths)
    if args.rows < 1 or args.repeat < 1 or args.chunk_size < 1:
        raise HartsError("--rows, --repeat and --chunk-size must be positive; fix: give positive integers")
    if len(probe_shapes(lengths, args.rows)) < 3:
        raise HartsError(f"--lengths {args.lengths} with --rows {args.rows} give fewer than three probes; "
                         "fix: give more lengths, or --rows above the shortest length")
    from harts.executor.cli import load_model, model_device
    device = model_device(args.device)
    plan = None
    if args.plan:
        from harts.api import read_plan
        plan = read_plan(args.plan)
    model = load_model(args.model, args.dtype).to(device)
    if plan is not None:
        from harts.executor.runtime import check_model_fits
        check_model_fits(plan, model)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    timings = run_probes(model, device, lengths=lengths, rows=args.rows, chunk_size=args.chunk_size,
                         repeat=args.repeat, progress=progress)
    fits = fits_of(timings)
    plan_rows = balances = None
    if plan is not None:
        plan_rows = time_plan(plan, model, device, args.repeat, progress)
        balances = plan_balances(plan, plan_rows, fits["total"])
    if args.json:
        ppt = pairs_per_token(fits["total"], 3)
        print(json.dumps({"probes": [asdict(t) for t in timings],
                          "fits": {name: asdict(fit) for name, fit in fits.items()},
                          "pairs_per_token": ppt,
                          "plan_microbatches": None if plan_rows is None else [asdict(t) for _, t in plan_rows],
                          "plan_balance": balances}))
    else:
        print(report(timings, fits, plan_rows, balances))
    return 0


if __name__ == "__main__":
    sys.exit(main())
