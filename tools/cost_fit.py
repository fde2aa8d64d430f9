"""The cost model's fit: seconds = t0 + x n + y (pair term), non-negative, on relative errors.

`harts calibrate` times probe steps and fits each of forward + backward
(pair term A + 2R), forward (A) and backward (R) with `fit_nonnegative`;
`pairs_per_token` turns a fit into the `hartsc --pairs-per-token` that
makes L2's cost model (`harts.schema.cost_model`) proportional to it.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np


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


def training_pair_units(pairs, rectangle):
    """A + 2R: the cost model's pair term of a forward + backward (beta_F = 1, beta_B = 2), the quantity
    the forward + backward fit is against."""
    return pairs + 2 * rectangle


def pairs_per_token(fit: Fit, rows_weight: int) -> float | None:
    """The P that makes the fit proportional to the cost model: a row weighs `rows_weight` x P of the fitted
    pair term. That is 3 for forward + backward against A + 2R (3P n + A + 2R), 1 for forward against A
    (P n + A) and for backward against R (2P n + 2R). None when the pair term was not measurable (fitted 0)."""
    return fit.per_row / (rows_weight * fit.per_pair) if fit.per_pair > 0 else None
