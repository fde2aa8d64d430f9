"""Ancestor attention's tile size B on this device: forward + backward time by B and head shape.

Usage:
    python benchmarks/bench_attention_blocks.py [--blocks 256,512,768,1024,2048] [--heads 2x24,16x128]
                                                [--capacity 4096] [--repeat 5] [--device cpu]

`bench_update.py`'s step-wise and tree-step workloads are compiled with
`--levels l1` at `--capacity`; every microbatch's compact layout then runs
`ancestor_attention` forward and backward on random q, k, v (H heads of
width D, `--heads HxD`) with each tile size B of `--blocks`. The table shows
the median over `--repeat` runs of the whole step's attention, and its ratio
to B = 1024. Queries go in tiles of B rows and keys in chunks of B: a larger B
means fewer, larger matmuls (less Python overhead per tile), a smaller B less
masked work on the causal diagonal and in blocks packing several short views.
`default_block_tokens` (executor/ops/ancestor_attention/blocked.py) takes
its CPU value from this table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_update import generate  # noqa: E402  (the same workloads as the update benchmark)

from harts.compiler.read_trees import read_trees  # noqa: E402
from harts.compiler.pipeline import CompileOptions, compile_batch  # noqa: E402
from harts.executor.layout import build_layout  # noqa: E402
from harts.executor.ops.ancestor_attention import ancestor_attention  # noqa: E402


def layouts(workload: str, capacity: int, folder: Path, device: torch.device) -> list:
    trees = folder / f"{workload}.jsonl"
    generate(workload, 4096, trees)
    plan = compile_batch(read_trees(trees), CompileOptions(capacity=capacity, levels="l1")).plan
    offsets = np.asarray(plan.step["token_offsets"])
    return [build_layout(mb, offsets, int(plan.flags["chunk_size"]), "compact").to(device) for mb in plan.microbatches]


def step_seconds(microbatches: list, heads: int, width: int, block: int, repeat: int, device: torch.device) -> float:
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(layout.num_rows, heads, width, generator=generator).to(device).requires_grad_()
               for _ in range(3)] for layout in microbatches]
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for layout, (q, k, v) in zip(microbatches, inputs):
            ancestor_attention(q, k, v, layout.views, block_tokens=block).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def parse_list(text: str, flag: str, parse) -> list:
    try:
        values = [parse(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values:
        raise SystemExit(f"bench_attention_blocks.py: error: {flag} {text!r} is not a comma-separated list; "
                         f"fix: e.g. {flag} {'512,1024' if flag == '--blocks' else '2x24,16x128'}")
    return values


def head_shape(text: str) -> tuple[int, int]:
    heads, width = (int(x) for x in text.lower().split("x"))
    if heads < 1 or width < 1:
        raise ValueError(text)
    return heads, width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="256,512,768,1024,2048", help="tile sizes B to time")
    parser.add_argument("--heads", default="2x24,16x128", help="head shapes HxD (tiny Kimi Linear's MLA: 2x24)")
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    blocks = parse_list(args.blocks, "--blocks", int)
    if any(b < 1 for b in blocks):
        raise SystemExit("bench_attention_blocks.py: error: every --blocks value must be >= 1")
    shapes = parse_list(args.heads, "--heads", head_shape)
    device = torch.device(args.device)
    print(f"{'workload':<10} {'heads':>7} " + " ".join(f"{f'B={b}':>15}" for b in blocks))
    with tempfile.TemporaryDirectory(prefix="harts-bench-blocks-") as folder:
        for workload in ("stepwise", "treestep"):
            microbatches = layouts(workload, args.capacity, Path(folder), device)
            for heads, width in shapes:
                seconds = {b: step_seconds(microbatches, heads, width, b, args.repeat, device) for b in blocks}
                reference = seconds.get(1024)
                cells = [f"{s:6.3f}s" + (f" {s / reference:5.2f}x" if reference else "") for s in seconds.values()]
                print(f"{workload:<10} {f'{heads}x{width}':>7} " + " ".join(f"{c:>15}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
