"""The CUDA check run when a GPU machine is lent: fla's kernels against our ops, and a timing table.

Usage (on a machine with CUDA and `pip install -e '.[dev,cuda]'`):
    python benchmarks/device_check.py [--rounds 8] [--repeat 5]

1. Correctness: random packed rounds (B = 64, mid-sequence exports, handed-in
   initial states, per-channel and scalar gates, grouped heads) through
   `fla_linear_attention` (fla's chunk_kda / chunk_gated_delta_rule) and our
   torch `chunk_linear_attention`, both on the GPU, in float32 and bfloat16:
   max relative difference of outputs, exported states and the gradients of
   every input, against the float64 torch op as the reference.
2. Timing: forward + backward of one round per size, torch op vs fla, and
   the tiny Kimi Linear step compact vs node-wise with each backend.

Without CUDA or fla it says so and exits 0: nothing here is a test, and no
test depends on it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def make_round(lengths, gate, dtype, device, heads=4, qk_heads=2, key_dim=64, value_dim=64, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    n, s = sum(lengths), len(lengths)

    def leaf(*shape, fn=torch.randn, scale=1.0):
        return (scale * fn(*shape, generator=gen, dtype=torch.float64)).to(device=device, dtype=dtype).requires_grad_()

    g_shape = (n, heads, key_dim) if gate == "channel" else (n, heads)
    inputs = dict(q=leaf(n, qk_heads, key_dim), k=leaf(n, qk_heads, key_dim), v=leaf(n, heads, value_dim),
                  g=leaf(*g_shape, fn=torch.rand, scale=-0.2), beta=leaf(n, heads, fn=torch.rand),
                  initial_state=leaf(s, heads, key_dim, value_dim, scale=0.5))
    cu = torch.tensor([0, *lengths], device=device).cumsum(0)
    seqs, chunks = [], []
    for i, length in enumerate(lengths):
        total = -(-length // 64)
        for c in sorted({1, (total + 1) // 2, total}):
            seqs.append(i)
            chunks.append(c)
    return inputs, cu, torch.tensor(seqs, device=device), torch.tensor(chunks, device=device)


def round_outputs(fn, inputs, cu, export_seq, export_chunk, dtype=None):
    import torch

    x = {k: (v.detach().to(dtype).requires_grad_() if dtype else v) for k, v in inputs.items()}
    state0 = x["initial_state"].float() if x["initial_state"].dtype != torch.float64 else x["initial_state"]
    o, ex = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, state0, export_seq, export_chunk,
               chunk_size=64, use_qk_l2norm_in_kernel=True)
    gen = torch.Generator(device=o.device).manual_seed(1)
    loss = (o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum() + \
        (ex.float() * torch.randn(ex.shape, generator=gen, device=o.device)).sum()
    grads = torch.autograd.grad(loss, list(x.values()))
    return [o, ex, *grads]


def relative(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def correctness(device) -> list[str]:
    import torch

    from harts.executor.ops.linear_attention import chunk_linear_attention, fla_linear_attention

    names = ["o", "exports", "dq", "dk", "dv", "dg", "dbeta", "dstate0"]
    lines = [f"{'gate':<8} {'dtype':<9} {'path':<6} " + " ".join(f"{n:>9}" for n in names)]
    for gate in ("channel", "scalar"):
        inputs, cu, es, ec = make_round([37, 64, 300, 129, 1000, 5], gate, torch.float64, device)
        reference = round_outputs(chunk_linear_attention, inputs, cu, es, ec)
        for dtype in (torch.float32, torch.bfloat16):
            for name, fn in (("torch", chunk_linear_attention), ("fla", fla_linear_attention)):
                got = round_outputs(fn, inputs, cu, es, ec, dtype)
                lines.append(f"{gate:<8} {str(dtype)[6:]:<9} {name:<6} "
                             + " ".join(f"{relative(a, b):>9.2e}" for a, b in zip(got, reference)))
    return lines


def timing(device, repeat: int) -> list[str]:
    import torch

    from harts.executor.ops.linear_attention import chunk_linear_attention, fla_linear_attention

    lines = [f"{'tokens':>8} {'seqs':>5} {'gate':<8} {'torch ms':>9} {'fla ms':>9}"]
    for lengths in ([4096], [256] * 16, [64] * 64, [8192, 4096, 2048, 999]):
        for gate in ("channel", "scalar"):
            inputs, cu, es, ec = make_round(lengths, gate, torch.bfloat16, device)
            row = []
            for fn in (chunk_linear_attention, fla_linear_attention):
                round_outputs(fn, inputs, cu, es, ec)            # warm-up (Triton compiles)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(repeat):
                    round_outputs(fn, inputs, cu, es, ec)
                torch.cuda.synchronize()
                row.append(1000 * (time.perf_counter() - t0) / repeat)
            lines.append(f"{sum(lengths):>8} {len(lengths):>5} {gate:<8} {row[0]:>9.2f} {row[1]:>9.2f}")
    return lines


def model_step(device) -> list[str]:
    import tempfile

    import torch

    from harts.compiler.pipeline import CompileOptions, compile_batch
    from harts.compiler.read_trees import read_trees
    from harts.executor.cli import load_model
    from harts.executor.models.init_model import init_model
    from harts.executor.runtime import run_step
    from harts.tools import gen

    folder = tempfile.mkdtemp(prefix="harts-device-")
    init_model("kimi_linear", "tiny", f"{folder}/model", vocab_size=4096)
    config = gen.GenConfig(kind="treestep", vocab_size=4096, seed=0, tasks=2, group_size=3,
                           system_prompt_tokens=768, branch_prob=0.6, max_branches=24)
    gen.write_jsonl(gen.generate(config), f"{folder}/trees.jsonl")
    batch = read_trees(f"{folder}/trees.jsonl")
    plan = compile_batch(batch, CompileOptions(capacity=16384, levels="l1")).plan
    model = load_model(f"{folder}/model").to(device)
    lines = [f"{'backend':<7} {'mode':<9} {'seconds':>8} {'tokens/s':>10}"]
    for backend in ("torch", "fla"):
        os.environ["HARTS_LINEAR_ATTENTION"] = backend
        for mode in ("compact", "nodewise"):
            run_step(plan, model, mode=mode)                    # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run_step(plan, model, mode=mode)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            lines.append(f"{backend:<7} {mode:<9} {seconds:>8.3f} {batch.num_tokens / seconds:>10.0f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions per round (default 5)")
    parser.add_argument("--no-model", action="store_true", help="skip the model step")
    args = parser.parse_args()
    import torch

    from harts.executor.ops.linear_attention.backend import fla_import_error

    if not torch.cuda.is_available() or fla_import_error() is not None:
        print(f"device check: nothing to check (CUDA available: {torch.cuda.is_available()}, "
              f"fla: {fla_import_error() or 'importable'})")
        return 0
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(0)}")
    sections = [("fla vs torch op, relative to the float64 torch op", correctness(device)),
                ("one round, forward + backward (bfloat16)", timing(device, args.repeat))]
    if not args.no_model:
        try:
            step = model_step(device)
        except Exception as err:   # the executor's index tensors are built on the CPU; report, do not hide
            step = [f"model step failed on {device}: {type(err).__name__}: {err}"]
        sections.append(("tiny Kimi Linear step, tree-step workload", step))
    for title, lines in sections:
        print(f"\n{title}")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
