"""The LM head's share of a step: log-probability recovery by the fraction of positions the loss weighs.

Usage:
    python benchmarks/bench_logprobs.py [--rows 16384] [--hidden 128] [--vocab 4096] [--repeat 5]

`position_logprobs` on C compact rows, one position per row (as a compact
layout has), timed forward + backward (median of `--repeat`), for three cases
per loss fraction f (the share of positions with loss_mask 1; SWE-style
rollouts have 10-20%):

* all positions, every one with a gradient: what the op cost before it
  skipped anything (the backward recomputed every row's logits);
* all positions, gradient on a fraction f (`harts run`, default
  `--logprobs all`): backward recomputes only the rows whose positions carry
  a gradient;
* only the f positions (`harts run --logprobs loss`): forward also computes
  logits only for the rows those positions read.

`--entropy` adds a second table: the same default case with the entropies
also computed (`harts run --entropy`: reported, no gradient) and weighed in
the loss (`--entropy-coef`: their gradient too), against log-probabilities
alone.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from harts.executor.ops.logprobs import position_logprobs, position_logprobs_and_entropy


def timed(hidden, weight, rows, labels, upstream, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        hidden.grad = weight.grad = None
        started = time.perf_counter()
        (position_logprobs(hidden, weight, rows, labels) * upstream).sum().backward()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def timed_entropy(hidden, weight, rows, labels, upstream, entropy_upstream, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        hidden.grad = weight.grad = None
        started = time.perf_counter()
        logprobs, entropy = position_logprobs_and_entropy(hidden, weight, rows, labels)
        (logprobs * upstream + entropy * entropy_upstream).sum().backward()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def entropy_table(hidden, weight, rows, labels, g, repeat: int) -> None:
    print(f"\nentropy (default positions); forward + backward seconds, median of {repeat}")
    print(f"{'loss fraction':>13} {'logprobs':>9} {'+ entropy reported':>19} {'+ entropy in loss':>18}")
    for fraction in (0.1, 0.2, 1.0):
        upstream = (torch.rand(len(rows), generator=g) < fraction).to(torch.float32)
        alone = timed(hidden, weight, rows, labels, upstream, repeat)
        reported = timed_entropy(hidden, weight, rows, labels, upstream, torch.zeros_like(upstream), repeat)
        weighed = timed_entropy(hidden, weight, rows, labels, upstream, 0.01 * upstream, repeat)
        print(f"{fraction:>13.0%} {alone:>9.3f} {reported:>10.3f} ({reported / alone - 1:+4.0%}) "
              f"{weighed:>9.3f} ({weighed / alone - 1:+4.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384, help="compact rows C (default 16384)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size D (default 128)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary V (default 4096)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per case; the table shows the median (default 5)")
    parser.add_argument("--entropy", action="store_true", help="also time entropy recovery (a second table)")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=g, requires_grad=True)
    weight = torch.randn(args.vocab, args.hidden, generator=g, requires_grad=True)
    rows = torch.arange(args.rows - 1)
    labels = torch.randint(0, args.vocab, (args.rows - 1,), generator=g)
    every = timed(hidden, weight, rows, labels, torch.ones(len(rows)), args.repeat)
    print(f"C={args.rows} D={args.hidden} V={args.vocab}; forward + backward seconds, median of {args.repeat}")
    print(f"{'loss fraction':>13} {'all, all grads':>15} {'all (default)':>14} {'--logprobs loss':>16} "
          f"{'saved (default)':>16} {'saved (loss)':>13}")
    for fraction in (0.1, 0.2, 0.5, 1.0):
        weighed = torch.rand(len(rows), generator=g) < fraction
        upstream = weighed.to(torch.float32)
        default = timed(hidden, weight, rows, labels, upstream, args.repeat)
        kept = torch.nonzero(weighed).squeeze(1)
        only = timed(hidden, weight, rows[kept], labels[kept], torch.ones(len(kept)), args.repeat)
        print(f"{fraction:>13.0%} {every:>15.3f} {default:>14.3f} {only:>16.3f} "
              f"{1 - default / every:>16.0%} {1 - only / every:>13.0%}")
    if args.entropy:
        entropy_table(hidden, weight, rows, labels, g, args.repeat)


if __name__ == "__main__":
    main()
