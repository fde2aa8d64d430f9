"""`benchmarks/bench_launches.py`'s counting: the numbers quoted for kernel launches come from it.

An operator counts once where it launches work: view and metadata operators do not count, an
operator inside another is the other's, forward work goes to the innermost component range
around it, and everything autograd's engine runs is backward.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_launches  # noqa: E402


def test_count_launches_attributes_each_launching_operator_once():
    x = torch.randn(4, 4, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("component::kda"):
            a = x * 2                                  # mul: 1
            b = a.view(16).reshape(4, 4).t()           # views only: 0
            with record_function("component::linear_rounds"):
                c = torch.matmul(a, b)                 # matmul dispatches to mm: 1, in the inner component
        d = c + 1                                      # add: 1, outside every component
        d.sum().backward()                             # sum: 1, and the seed gradient (ones_like): 1
    counts = bench_launches.count_launches(prof.events())
    assert counts["kda"] == 1
    assert counts["linear_rounds"] == 1
    assert counts["other forward"] == 3
    assert counts["backward (all)"] >= 3               # mm's two products and mul's gradient, at least
    assert set(counts) == {"kda", "linear_rounds", "other forward", "backward (all)"}


def test_labelled_components_restores_the_runners():
    from harts.executor.models.kimi_linear import KimiLinearRunner
    from harts.executor.models.runner import RowRunner

    before = (KimiLinearRunner.__dict__["mla"], RowRunner.__dict__["linear_rounds"])
    with bench_launches.labelled_components():
        assert KimiLinearRunner.__dict__["mla"] is not before[0]
    assert (KimiLinearRunner.__dict__["mla"], RowRunner.__dict__["linear_rounds"]) == before
