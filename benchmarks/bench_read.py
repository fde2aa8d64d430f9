"""Time `read_trees` on a synthetic paper-scale `trees.jsonl`.

Run:  python benchmarks/bench_read.py                       # 1,600 trajectories, ~43M tokens
      python benchmarks/bench_read.py --tokens 2000000      # a quick run
      python benchmarks/bench_read.py --loss-mask --logprobs --zst
      python benchmarks/bench_read.py --workers 1,2               # a row per read_trees(workers=N)
      python benchmarks/bench_read.py --input paper.jsonl --workers 1,2   # an existing file (harts gen)

Why: a paper-scale step is ~1,600 trajectories and 43M tokens (~250 MB of
JSON); reading it must never be the step's bottleneck. The file is generated
here with seeded numpy (no other project code), and each read runs in a fresh
interpreter so the reported peak RSS is the reader's own (with --workers N > 1,
the main process's: the workers' memory is not counted).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import orjson


def write_trees(path: str, *, trajectories: int, tokens: int, vocab_size: int, seed: int,
                loss_mask: bool, logprobs: bool) -> int:
    """Write a synthetic trees.jsonl (or .zst) and return the number of tokens written.

    Lengths are log-normal (agentic trajectories vary widely) scaled to sum to
    about `tokens`; groups of 8 trajectories share a `tree` id and a scalar
    advantage, as GRPO groups do.
    """
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=0.0, sigma=0.8, size=trajectories)
    lengths = np.maximum(2, np.round(raw / raw.sum() * tokens)).astype(np.int64)
    sink = open(path, "wb")
    if path.endswith(".zst"):
        import zstandard
        sink = zstandard.ZstdCompressor(level=3).stream_writer(sink, closefd=True)
    with sink:
        for t, n in enumerate(lengths.tolist()):
            record = {"id": f"traj-{t}", "tree": t // 8,
                      "tokens": rng.integers(0, vocab_size, n, dtype=np.int32),
                      "advantages": round(float(rng.normal()), 4)}
            if loss_mask:
                mask = np.ones(n, dtype=np.int8)
                mask[: n // 4] = 0  # the prompt is not a policy target
                record["loss_mask"] = mask
            if logprobs:
                record["old_logprobs"] = -rng.exponential(1.0, n).astype(np.float32)
            sink.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY))
            sink.write(b"\n")
    return int(lengths.sum())


def _read_once(path: str, repeat: int, workers: int) -> None:
    """Child-process mode: read `path` `repeat` times with `workers`, print one JSON line of timings."""
    import resource

    from harts.compiler.read_trees import read_trees

    rss_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        batch = read_trees(path, workers=workers)
        seconds.append(time.perf_counter() - start)
        num_tokens = batch.num_tokens
        del batch
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "tokens": num_tokens, "rss_before_mb": rss_before_mb,
                      "peak_rss_mb": peak_rss_mb}))


def _worker_list(text: str) -> list[int]:
    """`--workers 1,2,4` as [1, 2, 4]; each must be >= 1."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"every worker count must be >= 1, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=1600,
                        help="number of lines (default 1600)")
    parser.add_argument("--tokens", type=int, default=43_000_000,
                        help="total tokens, approximately (default 43M)")
    parser.add_argument("--vocab-size", type=int, default=151_936, help="token ids drawn uniformly below this")
    parser.add_argument("--seed", type=int, default=0, help="numpy seed for the synthetic file")
    parser.add_argument("--loss-mask", action="store_true", help="add a per-token loss_mask to every line")
    parser.add_argument("--logprobs", action="store_true", help="add per-token old_logprobs to every line")
    parser.add_argument("--zst", action="store_true", help="also time a zstd-compressed copy")
    parser.add_argument("--repeat", type=int, default=3, help="reads per file; the table shows the fastest")
    parser.add_argument("--workers", type=_worker_list, default=[1], metavar="N[,N...]",
                        help="read_trees(workers=N) settings to time, a row each (default 1: one process)")
    parser.add_argument("--input", metavar="PATH",
                        help="time this trees.jsonl[.zst] (e.g. `harts gen --preset paper`'s) instead of writing one")
    parser.add_argument("--read", metavar="PATH", help=argparse.SUPPRESS)  # child-process mode
    parser.add_argument("--read-workers", type=int, default=1, help=argparse.SUPPRESS)  # child-process mode
    args = parser.parse_args(argv)
    if args.input and not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file; fix: give a trees.jsonl[.zst], e.g. one `harts gen` wrote")
    if args.read:
        _read_once(args.read, args.repeat, args.read_workers)
        return 0

    rows = []
    with tempfile.TemporaryDirectory(prefix="harts-bench-read-") as tmp:
        if args.input:
            paths = [args.input]
        else:
            paths = [os.path.join(tmp, name) for name in ["trees.jsonl"] + (["trees.jsonl.zst"] if args.zst else [])]
            for path in paths:
                write_trees(path, trajectories=args.trajectories, tokens=args.tokens,
                            vocab_size=args.vocab_size, seed=args.seed, loss_mask=args.loss_mask,
                            logprobs=args.logprobs)
        for path in paths:
            for workers in args.workers:
                child = subprocess.run([sys.executable, os.path.abspath(__file__), "--read", path,
                                        "--repeat", str(args.repeat), "--read-workers", str(workers)],
                                       check=True, capture_output=True, text=True)
                result = json.loads(child.stdout.strip().splitlines()[-1])
                result["name"], result["mb"] = os.path.basename(path), os.path.getsize(path) / 1e6
                result["workers"] = workers
                rows.append(result)

    if args.input:
        print(f"read_trees: {args.input}; best of {args.repeat}")
    else:
        fields = ("tokens" + (" + loss_mask" if args.loss_mask else "")
                  + (" + old_logprobs" if args.logprobs else ""))
        print(f"read_trees: {args.trajectories} trajectories, per-token fields: {fields}; best of {args.repeat}")
    print(f"{'file':<17} {'workers':>7} {'tokens':>12} {'MB':>8} {'seconds':>8} {'Mtok/s':>7} {'MB/s':>7} "
          f"{'peak RSS MB':>12}")
    for r in rows:
        best = min(r["seconds"])
        print(f"{r['name']:<17} {r['workers']:>7} {r['tokens']:>12,} {r['mb']:>8.1f} {best:>8.2f} "
              f"{r['tokens'] / best / 1e6:>7.1f} {r['mb'] / best:>7.1f} {r['peak_rss_mb']:>12.0f}")
    print(f"(peak RSS includes ~{rows[0]['rss_before_mb']:.0f} MB of interpreter and imports)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
