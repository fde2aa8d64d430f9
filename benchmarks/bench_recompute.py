"""Activation recomputation: peak memory and time of compact execution with and without it.

Usage:
    python benchmarks/bench_recompute.py [--preset tiny|small] [--workload stepwise|treestep]

Each run happens in its own process so its peak RSS is its own. Gradients are
identical either way (tests/test_executor.py checks it); this prints what the
recomputation saves and costs.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(plan_path: str, model_dir: str, recompute: bool) -> None:
    from harts.executor.cli import load_model
    from harts.executor.runtime import run_step
    from harts.schema.plan import read_plan

    plan, model = read_plan(plan_path), load_model(model_dir)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    run_step(plan, model, recompute=recompute)
    print(json.dumps({"seconds": time.perf_counter() - started,
                      "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "before_mib": base / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="model preset (default small)")
    parser.add_argument("--workload", default="treestep", help="benchmarks/bench_update.py workload (default treestep)")
    parser.add_argument("--capacity", type=int, default=16384, help="microbatch capacity (default 16384)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2] == "1")
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_update import generate

    from harts.compiler.cli import main as hartsc
    from harts.executor.models.init_model import init_model

    folder = Path(tempfile.mkdtemp(prefix="harts-recompute-"))
    init_model("kimi_linear", args.preset, folder / "model", vocab_size=4096)
    generate(args.workload, 4096, folder / "trees.jsonl")
    hartsc([str(folder / "trees.jsonl"), "-o", str(folder / "step.plan"), "--capacity", str(args.capacity)])
    print(f"{'recompute':<10} {'seconds':>8} {'peak RSS MiB':>13} {'growth MiB':>11}")
    for flag in ("0", "1"):
        out = subprocess.run([sys.executable, __file__, "--child", str(folder / "step.plan"), str(folder / "model"),
                              flag], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{'on' if flag == '1' else 'off':<10} {r['seconds']:>8.2f} {r['peak_mib']:>13.0f} "
              f"{r['peak_mib'] - r['before_mib']:>11.0f}")


if __name__ == "__main__":
    main()
