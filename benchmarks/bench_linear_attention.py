"""Forward + backward time of `chunk_linear_attention` against transformers' torch fallbacks.

Not a test. Run (CPU; keep other work off the cores while it runs):

    python benchmarks/bench_linear_attention.py --threads 1
    python benchmarks/bench_linear_attention.py --tokens 2048 --shapes 2x32 --repeats 5

Per-channel gate is compared with `chunk_kimi_delta_attention` (Kimi Linear),
scalar gate with `torch_chunk_gated_delta_rule` (Qwen3-Next); both on one
sequence of N tokens with l2-normed q/k and chunk size 64, the way the models
call them. `ours x8` runs the same tokens as a packed round of 8 sequences.
Times are the best of --repeats runs after one warm-up, in milliseconds: on
shared cores the minimum is the stable statistic, a median swings with other load.
"""

from __future__ import annotations

import argparse
import time

import torch

from harts.executor.ops.linear_attention.chunk import chunk_linear_attention


def _fallbacks():
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    # __wrapped__ skips the hub-kernel wrapper (and its "falling back" warning).
    unwrap = lambda f: getattr(f, "__wrapped__", f)  # noqa: E731
    return unwrap(chunk_kimi_delta_attention), unwrap(torch_chunk_gated_delta_rule)


def _time_ms(step, repeats: int) -> tuple[float, float]:
    """Best forward and forward+backward milliseconds of `step() -> loss`."""
    forward, total = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        loss = step()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i:  # the first run warms up allocators and BLAS
            forward.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
    return min(forward), min(total)


def bench_one(per_channel: bool, num_tokens: int, num_heads: int, dim: int, chunk_size: int, repeats: int):
    kda, gdn = _fallbacks()
    gen = torch.Generator().manual_seed(0)
    leaf = lambda *shape: torch.randn(*shape, generator=gen).requires_grad_()  # noqa: E731
    q, k, v = leaf(num_tokens, num_heads, dim), leaf(num_tokens, num_heads, dim), leaf(num_tokens, num_heads, dim)
    gate_shape = (num_tokens, num_heads, dim) if per_channel else (num_tokens, num_heads)
    g = (-torch.rand(*gate_shape, generator=gen)).requires_grad_()
    beta = torch.rand(num_tokens, num_heads, generator=gen).requires_grad_()

    def ours(num_seqs: int):
        bounds = torch.linspace(0, num_tokens, num_seqs + 1).round().to(torch.int64)
        last_chunk = -(-(bounds[1:] - bounds[:-1]) // chunk_size)

        def step():
            o, final = chunk_linear_attention(
                q, k, v, g, beta, bounds, None, torch.arange(num_seqs), last_chunk,
                chunk_size=chunk_size, use_qk_l2norm_in_kernel=True,
            )
            return o.sum() + final.sum()

        return step

    def fallback():
        fn = kda if per_channel else gdn
        o, final = fn(
            q[None], k[None], v[None], g=g[None], beta=beta[None], chunk_size=chunk_size,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        return o.sum() + final.sum()

    return _time_ms(ours(1), repeats), _time_ms(ours(8), repeats), _time_ms(fallback, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="tokens N per call")
    parser.add_argument(
        "--shapes", nargs="+", default=["2x32", "4x64"], help="HxD pairs: H heads (q, k, v alike), head dims K = V = D"
    )
    parser.add_argument("--chunk-size", type=int, default=64, help="chunk size B for both sides")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell, after one warm-up")
    parser.add_argument(
        "--threads", type=int, default=0,
        help="torch threads (0: torch's default); 1 on shared cores, where parallel ops wait on descheduled workers",
    )
    args = parser.parse_args(argv)
    shapes = [shape.split("x") for shape in args.shapes]
    if not all(len(shape) == 2 and all(x.isdigit() for x in shape) for shape in shapes):
        parser.error(f"--shapes takes HxD pairs such as 4x64, got {args.shapes}")
    shapes = [(int(h), int(d)) for h, d in shapes]
    if args.threads:
        torch.set_num_threads(args.threads)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, chunk {args.chunk_size}, "
        f"ms (best of {args.repeats})"
    )
    header = (
        f"{'gate':<8} {'N':>5} {'H':>2} {'K=V':>3} | {'ours fwd':>9} {'fwd+bwd':>9} | {'ours x8':>9} | "
        f"{'hf fwd':>9} {'fwd+bwd':>9} | {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    for per_channel in (True, False):
        for num_tokens in args.tokens:
            for num_heads, dim in shapes:
                (of, ot), (_, packed), (hf, ht) = bench_one(
                    per_channel, num_tokens, num_heads, dim, args.chunk_size, args.repeats
                )
                gate = "channel" if per_channel else "scalar"
                print(
                    f"{gate:<8} {num_tokens:>5} {num_heads:>2} {dim:>3} | {of:>9.1f} {ot:>9.1f} | {packed:>9.1f} | "
                    f"{hf:>9.1f} {ht:>9.1f} | {ht / ot:>6.1f}x",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
