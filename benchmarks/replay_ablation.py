"""Replay ablation: |delta NLL| against the per-trajectory reference, by handoff depth.

Usage:
    python benchmarks/replay_ablation.py [--levels 5] [--branches 3] [--seed 0]

Builds a tiny Kimi Linear model and a rollout tree whose forks sit at
arbitrary (mostly chunk-unaligned) positions, `--levels` deep. For float32 and
bfloat16 it runs

* the reference: the Hugging Face model's own forward on each trajectory alone;
* replay (`harts run`): sequences start at the nearest chunk anchor and replay
  fewer than B tokens, so each trajectory keeps its own chunk grid;
* no-replay (`harts run --no-replay`): each segment starts from its parent's
  exact final state, on a chunk grid that starts at the fork;

and prints, per handoff depth d (segment boundaries crossed above the row
whose logits score the position; root rows have d = 0), the mean and max
|NLL - NLL_reference| over the positions.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.executor.layout import build_layout
from harts.executor.models.hf_reference import trajectory_logprobs
from harts.executor.models.init_model import init_model
from harts.executor.runtime import run_step


def forking_tree(levels: int, branches: int, vocab: int, rng) -> list[list[int]]:
    """Every node forks into `branches` children at a random offset 20..150 tokens below it."""
    frontier = [list(rng.integers(3, vocab, int(rng.integers(80, 200))))]
    leaves = []
    for level in range(levels):
        nxt = []
        for path in frontier:
            for _ in range(branches if level < levels - 1 else 1):
                nxt.append(path + list(rng.integers(3, vocab, int(rng.integers(20, 150)))))
        frontier = nxt
        leaves = frontier
    # Keep the tree affordable for the per-trajectory reference: a bounded sample of leaves.
    picked = rng.choice(len(leaves), size=min(len(leaves), 16), replace=False)
    return [leaves[i] for i in sorted(picked)]


def depth_of_positions(plan, layout) -> np.ndarray:
    mb = plan.microbatches[0]
    seg_start = np.asarray(mb["segment_row_start"])
    level = np.asarray(mb["segment_level"])
    segment_of_row = np.searchsorted(seg_start, np.arange(len(mb["row_token"])), side="right") - 1
    return level[segment_of_row[layout.position_row.numpy()]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, default=5, help="fork levels below the root (default 5)")
    parser.add_argument("--branches", type=int, default=3, help="children per fork (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="tree and model seed (default 0)")
    parser.add_argument("--chunk-size", type=int, default=64, help="chunk size B (default 64)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    vocab = 512
    folder = Path(tempfile.mkdtemp(prefix="harts-replay-"))
    base_model = init_model("kimi_linear", "tiny", folder / "model", vocab_size=vocab, seed=args.seed)
    lists = forking_tree(args.levels, args.branches, vocab, rng)
    batch = TrajectoryBatch.from_token_lists(lists)
    plan = compile_batch(batch, CompileOptions(chunk_size=args.chunk_size, capacity=1 << 20)).plan
    layout = build_layout(plan.microbatches[0], plan.step["token_offsets"], args.chunk_size, "compact")
    depth = depth_of_positions(plan, layout)
    flat = layout.position_flat
    offsets = np.asarray(plan.step["token_offsets"])
    print(f"tree: {len(lists)} trajectories, {batch.num_tokens} tokens, "
          f"{len(plan.microbatches[0]['row_token'])} compact rows, B={args.chunk_size}, "
          f"replay tokens {len(plan.microbatches[0]['replay_rows'])}")
    print(f"{'dtype':<9} {'d':>2} {'positions':>9} {'replay mean':>12} {'replay max':>11} "
          f"{'no-replay mean':>15} {'no-replay max':>14}")
    for dtype in (torch.float32, torch.bfloat16):
        model = base_model.to(dtype)
        reference = np.full(batch.num_tokens, np.nan)
        with torch.no_grad():
            for t, tokens in enumerate(lists):
                reference[offsets[t] + 1:offsets[t + 1]] = trajectory_logprobs(model, tokens).double().numpy()
        runs = {}
        for name, mode in (("replay", "compact"), ("no-replay", "nodewise")):
            result = run_step(plan, model, mode=mode, backward=False)
            got = np.concatenate([result.logprobs[str(t)] for t in range(len(lists))]).astype(np.float64)
            runs[name] = np.abs(got[flat] - reference[flat])
        for d in range(int(depth.max()) + 1):
            at = depth == d
            if not at.any():
                continue
            r, n = runs["replay"][at], runs["no-replay"][at]
            print(f"{str(dtype).split('.')[-1]:<9} {d:>2} {int(at.sum()):>9} {r.mean():>12.3e} {r.max():>11.3e} "
                  f"{n.mean():>15.3e} {n.max():>14.3e}")


if __name__ == "__main__":
    main()
