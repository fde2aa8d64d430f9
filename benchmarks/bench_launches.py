"""Kernel launches per update step, by component: what bounds a small model's step on a GPU.

On the lent H200 tiny Kimi Linear ran compact at a third of the speed its
compression predicts (docs/gpu-runs.md): with rows this few, a step costs what
its kernel launches cost. This counts, on the CPU, the torch operators of one
forward + backward that would each launch a kernel on a GPU (view and
metadata operators excluded; an operator inside another counts once), by the
component whose forward ran them; backward is one row.

    python benchmarks/bench_launches.py [--workloads stepwise,treestep] [--configs compact,nodewise,expanded]
                                        [--tiles cpu|accelerator]

`--tiles accelerator` gives ancestor attention the tile size it picks on a GPU
(`default_block_tokens`); the CPU's is smaller. The counts are exact for the
CPU path and a proxy for a GPU's: fla's kernels (not run here) replace the
linear-attention rows there.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update  # noqa: E402 - the same workloads and model as the throughput benchmark

# Operators that only make views or read metadata, or that dispatch to others (counted there).
NOT_LAUNCHES = frozenset(f"aten::{name}" for name in (
    "as_strided", "view", "reshape", "slice", "transpose", "select", "narrow", "expand", "permute", "unsqueeze",
    "squeeze", "_unsafe_view", "resolve_conj", "resolve_neg", "alias", "detach", "t", "split", "split_with_sizes",
    "unbind", "chunk", "flatten", "view_as", "expand_as", "result_type", "empty", "empty_strided", "empty_like",
    "contiguous", "to", "_to_copy", "lift_fresh", "matmul", "linear", "numpy_T", "is_nonzero", "item",
    "_local_scalar_dense", "size", "stride", "dim", "sum_to_size"))
COMPONENTS = {"kimi_linear.KimiLinearRunner": ("kda", "mla", "moe"), "runner.RowRunner": ("linear_rounds",)}


@contextlib.contextmanager
def labelled_components():
    """Each runner component's forward inside a profiler range named after it (restored on exit)."""
    from torch.autograd.profiler import record_function

    import harts.executor.models.kimi_linear as kimi_linear
    import harts.executor.models.runner as runner

    modules = {"kimi_linear": kimi_linear, "runner": runner}
    saved = []
    for path, names in COMPONENTS.items():
        module, cls = path.split(".")
        owner = getattr(modules[module], cls)
        for name in names:
            original = owner.__dict__[name]

            def wrapped(*args, _original=original, _name=name, **kwargs):
                with record_function(f"component::{_name}"):
                    return _original(*args, **kwargs)

            saved.append((owner, name, original))
            setattr(owner, name, functools.wraps(original)(wrapped))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def count_launches(events) -> collections.Counter:
    """Launching operators by component; 'linear_rounds' inside 'kda' is its own row."""
    counts = collections.Counter()
    for event in events:
        if not event.name.startswith("aten::") or event.name in NOT_LAUNCHES:
            continue
        if _inside_launching_operator(event):
            continue   # counted there
        component, scope = None, event.cpu_parent
        while scope is not None:
            if "autograd::engine" in scope.name or "Backward" in scope.name:
                component = "backward (all)"
                break
            if component is None and scope.name.startswith("component::"):
                component = scope.name.split("::")[1]
            scope = scope.cpu_parent
        counts[component or "other forward"] += 1
    return counts


def _inside_launching_operator(event) -> bool:
    scope = event.cpu_parent
    while scope is not None:
        if scope.name.startswith("aten::") and scope.name not in NOT_LAUNCHES:
            return True
        scope = scope.cpu_parent
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="stepwise,treestep", help="bench_update.py workloads (default "
                        "stepwise,treestep)")
    parser.add_argument("--configs", default="compact,nodewise,expanded", help="configurations (default "
                        "compact,nodewise,expanded)")
    parser.add_argument("--tiles", choices=("cpu", "accelerator"), default="accelerator",
                        help="ancestor attention's tile size: the CPU's or a GPU's (default accelerator)")
    parser.add_argument("--capacity", type=int, default=16384, help="microbatch capacity T (default 16384)")
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    import harts.executor.ops.ancestor_attention.blocked as blocked
    from harts.compiler.read_trees import read_trees
    from harts.executor.cli import load_model
    from harts.executor.models.init_model import init_model

    if args.tiles == "accelerator":
        cpu_policy = blocked.default_block_tokens
        blocked.default_block_tokens = lambda device, heads: cpu_policy(torch.device("cuda"), heads)
    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp(prefix="harts-bench-launches-"))
    init_model("kimi_linear", "tiny", folder / "model", vocab_size=4096)
    model = load_model(str(folder / "model"), "float32")
    rows = ["kda", "linear_rounds", "mla", "moe", "other forward", "backward (all)"]
    print(f"tiny Kimi Linear, {args.tiles} attention tiles, capacity {args.capacity}; launching operators of one "
          "forward + backward ('kda' excludes its linear_rounds)")
    print(f"{'workload':<10} {'config':<9} " + " ".join(f"{r:>14}" for r in rows) + f" {'total':>8}")
    for workload in args.workloads.split(","):
        trees = folder / f"{workload}.jsonl"
        bench_update.generate(workload, 4096, trees)
        batch = read_trees(str(trees))
        for config in args.configs.split(","):
            bench_update.one_update(config, batch, model, 64, args.capacity)   # warm-up: caches, first calls
            with labelled_components(), profile(activities=[ProfilerActivity.CPU]) as prof:
                bench_update.one_update(config, batch, model, 64, args.capacity)
            counts = count_launches(prof.events())
            print(f"{workload:<10} {config:<9} " + " ".join(f"{counts[r]:>14}" for r in rows)
                  + f" {sum(counts.values()):>8}", flush=True)


if __name__ == "__main__":
    main()
