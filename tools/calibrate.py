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
random trajectories (distinct first tokens, so no shared prefix), one
microbatch each: for every length L, one trajectory of L tokens and `--rows`
// L of them, so rows and pairs vary independently. At least four probes
(three unknowns), none shorter than the chunk size (a shorter one times
chunk padding, which the cost model leaves out). Each is timed after one
untimed run. Forward and backward are also fitted apart (backward = a
training step's time less a forward-only step's), which shows whether the
model's "backward costs twice forward" holds. The fit is flagged when it
misses a probe by over 20% or when repeats scatter.

`--plan PLAN` then runs the plan's step as `harts run` does (windows on),
timing every consumer (its decoder rows and LM head) and every window
producer on the device (`run_step(device_timing=True)`), compares them with
the fit, and reports the plan's balance (eta_sched: consumer slots and
window producers) measured in seconds against what rows (`harts stats`'
`balance`), the cost model at the plan's P (its `cost_balance`) and at the
fitted P, and the fit's seconds predict.

Invariant: the probes' n, A and R are read from their compiled plans
(`harts.schema.summary.computed_terms`), never assumed from their shapes.

The fit lives in `harts.tools.cost_fit`, the plan's timing and balances in
`harts.tools.plan_timing`; this module builds and times the probes and is
the command line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from dataclasses import asdict, dataclass

import numpy as np

from harts.schema.errors import HartsError
from harts.schema.summary import computed_terms, critical_path
from harts.tools.cost_fit import Fit, fit_nonnegative, pairs_per_token, training_pair_units
from harts.tools.plan_timing import (BALANCE_LABELS, Computation, plan_balances, plan_grids, plan_pairs_per_token,
                                     time_plan)

DEFAULT_LENGTHS = (256, 1024, 4096, 16384)
DEFAULT_ROWS = 16384
# Repeats of one probe whose median deviation exceeds this fraction of their median make the fit unreliable
# (one slow repeat among several does not count: it is what a median is for).
NOISY_SPREAD = 0.1
# A fit that misses some probe by more than this is flagged.
POOR_FIT = 0.2
# Three unknowns: a fourth probe is the least that can test the fit.
MIN_PROBES = 4


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


def time_step(plan, model, device, repeat: int) -> tuple[float, float, float]:
    """Median seconds of a forward-only step and of a forward + backward step (the objective is `nll`),
    and the spread of the latter's repeats; after one untimed training step (a new shape's first run
    allocates, and on a GPU may compile kernels)."""
    from harts.executor.runtime import device_clock, run_step
    clock = device_clock(device)

    def seconds(backward: bool) -> float:
        started = clock()
        run_step(plan, model, backward=backward)
        return clock() - started

    seconds(True)
    forward_seconds = [seconds(False) for _ in range(repeat)]
    total_seconds = [seconds(True) for _ in range(repeat)]
    median = statistics.median(total_seconds)
    deviation = statistics.median(abs(t - median) for t in total_seconds)
    return statistics.median(forward_seconds), median, deviation / median


def run_probes(model, device, *, lengths, rows: int, chunk_size: int, repeat: int, progress) -> list[Timing]:
    from harts.api import compile_trajectories
    vocab = int(model.config.vocab_size)
    timings = []
    for index, (length, count) in enumerate(probe_shapes(lengths, rows)):
        plan = compile_trajectories(probe_tokens(length, count, vocab, seed=index), levels="l1", dp=1,
                                    capacity=max(length * count, chunk_size), chunk_size=chunk_size,
                                    vocab_size=vocab)
        if len(plan.microbatches) != 1:   # the capacity holds every row: L1 never splits such a step
            raise HartsError(f"probe {length} x {count} compiled into {len(plan.microbatches)} microbatches; "
                             "fix: report this (a probe should be one microbatch)")
        forward, total, spread = time_step(plan, model, device, repeat)
        timing = Timing(f"{count} x {length}", *computed_terms(plan.microbatches[0]), forward, total, spread)
        timings.append(timing)
        progress(f"probe {timing.name}: forward {forward:.4f} s, forward + backward {total:.4f} s")
    return timings


def fits_of(timings: list[Timing]) -> dict[str, Fit]:
    """The cost model's fits: forward + backward against A + 2R, forward against A, and backward against R
    over the probes whose backward (a difference of two noisy times) came out positive, when three did."""
    rows = [t.rows for t in timings]
    fits = {"total": fit_nonnegative(rows, [training_pair_units(t.pairs, t.rectangle) for t in timings],
                                     [t.total for t in timings]),
            "forward": fit_nonnegative(rows, [t.pairs for t in timings], [t.forward for t in timings])}
    positive = [t for t in timings if t.backward > 0]
    if len(positive) >= 3:
        fits["backward"] = fit_nonnegative([t.rows for t in positive], [t.rectangle for t in positive],
                                           [t.backward for t in positive])
    return fits


def _timing_row(t: Timing, fit: Fit) -> dict:
    predicted = float(fit.predict(t.rows, training_pair_units(t.pairs, t.rectangle)))
    return dict(asdict(t), backward=t.backward, fitted=predicted, error=(predicted - t.total) / t.total)


def summarize(timings: list[Timing], fits: dict[str, Fit], plan=None,
              computations: list[Computation] | None = None) -> dict:
    """Everything the table shows, as one JSON-ready dict (`--json` prints it)."""
    total, forward, backward = fits["total"], fits["forward"], fits.get("backward")
    ppt = pairs_per_token(total, 3)
    warnings = []
    spread = max(t.spread for t in timings)
    if spread > NOISY_SPREAD:
        warnings.append(f"a probe's repeats deviate by {spread:.0%} of their median: the machine is busy or its "
                        "clock varies, and the fit is unreliable; rerun on a quiet machine")
    if total.worst_relative_error > POOR_FIT:
        warnings.append(f"the fit misses a probe by {total.worst_relative_error:.0%}: the model's time is not "
                        "rows plus attention pairs here (fixed costs of small probes, or noise); prefer probes "
                        "as long and as full as your microbatches")
    if ppt is None:
        warnings.append(f"attention's cost was not measurable with probes up to {max_length(timings):,} tokens; "
                        "rerun with --lengths up to your longest trajectories")
    result = {
        "probes": [_timing_row(t, total) for t in timings],
        "fits": {name: dict(asdict(fit), pairs_per_token=pairs_per_token(fit, 3 if name == "total" else 1))
                 for name, fit in fits.items()},
        "backward_over_forward": {} if backward is None else {
            name: (b / f if f > 0 and b > 0 else None) for name, b, f in (
                ("rows", backward.per_row, forward.per_row), ("pairs", backward.per_pair, forward.per_pair))},
        "pairs_per_token": ppt,
        "recommended_pairs_per_token": None if ppt is None else max(1, round(ppt)),
        "warnings": warnings,
        "plan": None,
    }
    if computations is not None:
        rows = []
        for c in computations:
            fitted = float(total.predict(c.rows, training_pair_units(c.pairs, c.rectangle)))
            rows.append(dict(asdict(c), fitted=fitted, error=(fitted - c.seconds) / c.seconds))
        errors = np.abs([row["error"] for row in rows])
        seconds = plan_grids(plan, computations, lambda c: c.seconds)
        result["plan"] = {"dp": int(plan.flags["dp"]), "pairs_per_token": plan_pairs_per_token(plan),
                          "computations": rows,
                          "work_seconds": float(seconds[0].sum() + seconds[1].sum()),
                          "critical_path_seconds": float(critical_path(*seconds)),
                          "fit_error_median": float(np.median(errors)), "fit_error_largest": float(errors.max()),
                          "balance": plan_balances(plan, computations, total)}
    return result


def max_length(timings: list[Timing]) -> int:
    """The longest probe trajectory: a probe of one trajectory has n = its length, and R = c L^2 = n L."""
    return max(t.rectangle // t.rows for t in timings)


def _format_ppt(value: float | None) -> str:
    return "not measurable" if value is None else f"{value:,.0f}"


def report(result: dict) -> str:
    """The table `harts calibrate` prints, from `summarize`'s dict."""
    lines = [f"{'probe':>14} {'rows n':>9} {'pairs A':>15} {'rect R':>15} {'fwd s':>8} {'bwd s':>8} "
             f"{'fwd+bwd s':>9} {'fitted':>8} {'error':>7}"]
    for row in result["probes"]:
        lines.append(f"{row['name']:>14} {row['rows']:>9,} {row['pairs']:>15,} {row['rectangle']:>15,} "
                     f"{row['forward']:>8.4f} {row['backward']:>8.4f} {row['total']:>9.4f} {row['fitted']:>8.4f} "
                     f"{row['error']:>+7.1%}")
    fits = result["fits"]
    total = fits["total"]
    lines += ["", "fit of forward + backward: seconds = t0 + x n + y (A + 2R)",
              f"  t0 {total['intercept'] * 1e3:.3f} ms per call (a one-microbatch step), x "
              f"{total['per_row'] * 1e6:.4f} us per row, y {total['per_pair'] * 1e9:.5f} ns per pair unit; "
              f"largest error {total['worst_relative_error']:.1%}",
              f"  pairs per token P = x / 3y: {_format_ppt(result['pairs_per_token'])}",
              f"  forward alone (A): P = {_format_ppt(fits['forward']['pairs_per_token'])}, largest error "
              f"{fits['forward']['worst_relative_error']:.1%}; " + (
                  "backward alone: fewer than three probes with a positive backward time" if "backward" not in fits
                  else f"backward alone (R): P = {_format_ppt(fits['backward']['pairs_per_token'])}, largest error "
                       f"{fits['backward']['worst_relative_error']:.1%}") +
              " (backward = a training step less a no-grad forward, so it includes recording the graph)"]
    ratios = [f"{name} {value:.2f}x" for name, value in result["backward_over_forward"].items() if value is not None]
    if ratios:
        lines.append(f"  backward / forward per unit: {', '.join(ratios)} (the cost model assumes 2x)")
    lines += [f"  warning: {warning}" for warning in result["warnings"]]
    recommended = result["recommended_pairs_per_token"]
    lines.append("use: no --pairs-per-token to recommend (see the warning)" if recommended is None
                 else f"use: hartsc --pairs-per-token {recommended}")
    plan = result["plan"]
    if plan is not None:
        kinds = [c["kind"] for c in plan["computations"]]
        lines += ["", f"plan, run as harts run runs it: {kinds.count('consumer')} consumers (their decoder rows and "
                      f"LM head) and {kinds.count('producer')} window producers (with the LM-head normalizers of the "
                      f"rows they cache), each timed on the device; the fit's error median "
                      f"{plan['fit_error_median']:.1%}, largest {plan['fit_error_largest']:.1%}",
                  f"  work {plan['work_seconds']:.3f} s; on {plan['dp']} replicas that wait for each other at every "
                  f"slot, {plan['critical_path_seconds']:.3f} s (the sum of slot and producer maxima)",
                  f"  balance (eta_sched; the plan's P is {plan['pairs_per_token']:,}): " + ", ".join(
                      f"{BALANCE_LABELS[name]} {value:.2%}" for name, value in plan["balance"].items())]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harts calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (harts init-model writes one)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs (default auto: cuda when available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model dtype (default float32)")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                   help=f"comma-separated probe trajectory lengths, each at least the chunk size (default "
                        f"{','.join(map(str, DEFAULT_LENGTHS))}; go up to your longest trajectories)")
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS,
                   help=f"rows of the many-trajectory probe of each length (default {DEFAULT_ROWS}; use your "
                        "microbatch capacity on a GPU)")
    p.add_argument("--chunk-size", type=int,
                   help="linear-attention chunk size B (default: the plan's with --plan, else 64)")
    p.add_argument("--repeat", type=int, default=3,
                   help="timed runs per probe after one untimed, the median is used (default 3)")
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


def check_arguments(args, lengths: list[int], chunk_size: int) -> None:
    """One HartsError with a fix for flags whose probes could not measure the cost model."""
    for flag, value in (("--rows", args.rows), ("--repeat", args.repeat), ("--chunk-size", chunk_size)):
        if value < 1:
            raise HartsError(f"{flag} {value}: must be positive; fix: give a positive integer")
    if min(lengths) < chunk_size:
        raise HartsError(f"--lengths: {min(lengths)} is shorter than the chunk size {chunk_size}, so that probe "
                         "would time chunk padding, which the cost model leaves out; fix: give lengths of at "
                         f"least {chunk_size}")
    if len(probe_shapes(lengths, args.rows)) < MIN_PROBES:
        raise HartsError(f"--lengths {args.lengths} with --rows {args.rows} give fewer than {MIN_PROBES} probes "
                         "(the fit has three unknowns, so three probes always fit exactly and test nothing); "
                         "fix: give more lengths, or --rows above the shortest length")


def check_probes_differ(lengths: list[int], rows: int, vocab: int) -> None:
    """Probes share no prefix only while their trajectories' first tokens differ."""
    count = max(count for _, count in probe_shapes(lengths, rows))
    if count > vocab:
        raise HartsError(f"--rows {rows} makes a probe of {count} trajectories, more than the model's vocabulary of "
                         f"{vocab} tokens, so some would share a first token and a prefix; fix: raise the shortest "
                         f"--lengths to at least {-(-rows // vocab)}, or lower --rows")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return calibrate(args)
    except HartsError as err:
        print(f"harts calibrate: {err}", file=sys.stderr)
        return err.exit_code


def calibrate(args) -> int:
    lengths = parse_lengths(args.lengths)
    plan = None
    if args.plan:
        from harts.api import read_plan
        plan = read_plan(args.plan)
    plan_chunk = None if plan is None else int(plan.flags["chunk_size"])
    chunk_size = args.chunk_size if args.chunk_size is not None else plan_chunk or 64
    if plan_chunk is not None and chunk_size != plan_chunk:
        raise HartsError(f"--chunk-size {chunk_size}, but {args.plan} was compiled with chunk size {plan_chunk}; "
                         "fix: drop --chunk-size (the plan's is used) or compile the plan with it")
    check_arguments(args, lengths, chunk_size)
    from harts.executor.cli import load_model, model_device
    device = model_device(args.device)
    model = load_model(args.model, args.dtype).to(device)
    check_probes_differ(lengths, args.rows, int(model.config.vocab_size))
    if plan is not None:
        from harts.executor.runtime import check_model_fits
        check_model_fits(plan, model)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with memory_errors_reported():
        timings = run_probes(model, device, lengths=lengths, rows=args.rows, chunk_size=chunk_size,
                             repeat=args.repeat, progress=progress)
        computations = None if plan is None else time_plan(plan, model, args.repeat, progress)
    result = summarize(timings, fits_of(timings), plan, computations)
    print(json.dumps(result) if args.json else report(result))
    return 0


@contextlib.contextmanager
def memory_errors_reported():
    """An allocation that fails (host or device) is one line with a fix, not a traceback."""
    import torch
    try:
        yield
    except (MemoryError, RuntimeError) as err:   # torch.OutOfMemoryError is a RuntimeError
        if isinstance(err, RuntimeError) and not isinstance(err, torch.OutOfMemoryError) and not any(
                words in str(err) for words in ("can't allocate memory", "out of memory")):
            raise
        raise HartsError(f"a probe ran out of memory ({type(err).__name__}); fix: lower the longest --lengths or "
                         "--rows") from None


if __name__ == "__main__":
    sys.exit(main())
