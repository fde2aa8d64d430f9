"""The CUDA check run when a GPU machine is lent: fla's kernels against our ops, the model against
Hugging Face on the GPU, host synchronisations, and timing tables.

Usage (on a machine with CUDA and `pip install -e '.[dev,cuda]'`):
    python benchmarks/device_check.py [--repeat 5] [--sections ops,fidelity,...] [--budget-s S]

Sections, in order (each prints as it finishes; one that fails prints its
error and the rest still run):

* `ops`: random packed rounds (B = 64, mid-sequence exports, handed-in
  initial states, per-channel and scalar gates, grouped heads) through
  `fla_linear_attention` (fla's chunk_kda / chunk_gated_delta_rule) and our
  torch `chunk_linear_attention`, both on the GPU, in float32 and bfloat16:
  max relative difference of outputs, exported states and the gradients of
  every input, against the float64 torch op.
* `fidelity`: the tests' boundary tree (forks on, just before and just after
  chunk boundaries, duplicates, strict prefixes) on tiny Kimi Linear and
  Qwen3-Next in float32 on the GPU. Reference: the Hugging Face model's own
  forward and backward per trajectory on the GPU (which calls fla's kernels
  itself when fla imports). Ours: compact with fla where it imports (backend
  `auto`: layers fla refuses run the torch op), compact with the torch op,
  and an L1+L2 plan with a sharing window. Max |d logprob| and
  the worst relative gradient error (the tests' rule and floor). Then a
  critic (loss `value`) on the windows plan: the backbone under a seeded
  linear head against `head(model.model(ids).last_hidden_state)` per
  trajectory, max |d value| and the worst gradient, head included.
* `lm-head`: the blocked log-probability and entropy recovery on the GPU in
  float32 and bfloat16 against the plain log_softmax in float64 (values and
  gradients), and its time with and without entropies (a V = 32k head).
* `syncs`: host synchronisations of one compact step (torch's sync debug
  mode), by source line.
* `op-timing`: forward + backward of one round per size, torch op vs fla.
* `update`: `benchmarks/bench_update.py`'s configurations in one process on
  the GPU (warm-up, then the median of `--repeat`), planning included:
  per-trajectory HF, expanded, compact, node-wise, each linear-attention
  backend; L1 vs L1+L2 windows at a capacity that gives several microbatches.
* `nccl`: `harts run` under a 1-process torchrun (nccl) against the plain
  run: the same loss, log-probabilities and gradients.
* `fla-compile`: how long fla's first calls take, with every thread's stack
  printed every 30 s while they run (`TRITON_PRINT_AUTOTUNING=1` names each
  kernel and its autotuning time).

fla's first calls in a process compile and autotune every kernel, one
configuration after another: on an H200 (fla 0.6.0, Triton 3.6), 78 s for the
first bfloat16 KDA forward and 171 s for its backward (one kernel alone,
chunk_kda_bwd_kernel_wy_dqkg_fused, 102 s), then again for float32 and for the
scalar gate. Triton keeps the results on disk, so a later process on the same
machine starts fast; a lent machine starts bare. `--fla-autotune-configs 1`
keeps one configuration per kernel (fla's smallest tile, so fla's timings are
then understated), and `benchmarks/device_run.sh` runs a session's checks as
parallel processes (fla as a user runs it, fla in true float32 with the whole
model, and two with `--no-fla` for the rest):

    bash benchmarks/device_run.sh 420       # logs in $OUT; ~470 s of device time

How it was installed there (an image with torch, Triton, msgpack, networkx and
hypothesis, no registry; the rest carried as wheels in an ignored `.whl/`:
fla-core, flash-linear-attention, transformers, regex, zstandard, orjson):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/hp .
    export PYTHONPATH=/tmp/hp:/tmp/site PATH=/tmp/hp/bin:/tmp/site/bin:$PATH

(run the script as `python3 benchmarks/device_check.py`: from the repository
root, `python3 -c` would import the checkout's bare `harts/` folder first).

Without CUDA it says so and exits 0: nothing here is a test, and no test
depends on it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("ops", "fidelity", "lm-head", "syncs", "op-timing", "update", "nccl", "fla-compile")


def say(line: str = "") -> None:
    print(line, flush=True)


def backends() -> tuple[str, ...]:
    """Our linear-attention backends that can run here: fla's only where it imports."""
    from harts.executor.ops.linear_attention.backend import fla_import_error

    return ("fla", "torch") if fla_import_error() is None else ("torch",)


# ----------------------------------------------------------------------------- ops


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


def ops(device, args) -> list[str]:
    import torch

    from harts.executor.ops.linear_attention import chunk_linear_attention, fla_linear_attention

    names = ["o", "exports", "dq", "dk", "dv", "dg", "dbeta", "dstate0"]
    lines = ["max |x - x_ref| / max |x_ref|, reference: our torch op in float64 on the GPU",
             f"{'gate':<8} {'dtype':<9} {'path':<6} " + " ".join(f"{n:>9}" for n in names)]
    for gate in args.gates.split(","):
        inputs, cu, es, ec = make_round([37, 64, 300, 129, 1000, 5], gate, torch.float64, device)
        reference = round_outputs(chunk_linear_attention, inputs, cu, es, ec)
        for dtype in (torch.float32, torch.bfloat16):
            for name, fn in (("torch", chunk_linear_attention), ("fla", fla_linear_attention)):
                head = f"{gate:<8} {str(dtype)[6:]:<9} {name:<6} "
                try:   # fla may refuse a case (a scalar gate on Hopper, backend.fla_scalar_gate_defect)
                    got = round_outputs(fn, inputs, cu, es, ec, dtype)
                except RuntimeError as err:
                    lines.append(head + f"failed: {str(err).splitlines()[0][:200]}")
                    continue
                lines.append(head + " ".join(f"{relative(a, b):>9.2e}" for a, b in zip(got, reference)))
    return lines


def lm_head(device, args) -> list[str]:
    """Blocked log-probabilities and entropies on the GPU against log_softmax in float64, then their time."""
    import torch

    from harts.executor.ops.logprobs import (naive_position_entropy, naive_position_logprobs, position_logprobs,
                                            position_logprobs_and_entropy)

    g = torch.Generator(device="cpu").manual_seed(0)
    rows, hidden_size, vocab, positions = 3000, 256, 32768, 4000
    hidden = torch.randn(rows, hidden_size, generator=g, dtype=torch.float64).to(device)
    weight = (torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) * 0.05).to(device)
    row = torch.randint(0, rows, (positions,), generator=g).to(device)
    label = torch.randint(0, vocab, (positions,), generator=g).to(device)
    upstream = torch.randn(positions, generator=g, dtype=torch.float64).to(device)
    upstream_entropy = (0.1 * torch.randn(positions, generator=g, dtype=torch.float64)).to(device)

    def run(fn, dtype):
        h, w = hidden.detach().to(dtype).requires_grad_(), weight.detach().to(dtype).requires_grad_()
        lp, entropy = fn(h, w)
        (lp.double() * upstream + entropy.double() * upstream_entropy).sum().backward()
        return lp.double(), entropy.double(), h.grad.double(), w.grad.double()

    want = run(lambda h, w: (naive_position_logprobs(h, w, row, label), naive_position_entropy(h, w, row)),
               torch.float64)
    lines = ["max |x - x_ref| / max |x_ref|, reference: log_softmax in float64 on the GPU",
             f"{'dtype':<9} {'logprob':>9} {'entropy':>9} {'d hidden':>9} {'d weight':>9}"]
    for dtype in (torch.float32, torch.bfloat16):
        got = run(lambda h, w: position_logprobs_and_entropy(h, w, row, label), dtype)
        lines.append(f"{str(dtype)[6:]:<9} " + " ".join(f"{relative(a, b):>9.2e}" for a, b in zip(got, want)))
    h, w = hidden.to(torch.bfloat16).requires_grad_(), weight.to(torch.bfloat16).requires_grad_()
    loss_weight = (torch.rand(positions, generator=g) < 0.2).to(device, torch.float32)

    def timed(with_entropy: bool, weigh_entropy: bool) -> float:
        times = []
        for _ in range(args.repeat + 1):
            h.grad = w.grad = None
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            if with_entropy:
                lp, entropy = position_logprobs_and_entropy(h, w, row, label)
                loss = (lp * loss_weight).sum() + (entropy * loss_weight).sum() * float(weigh_entropy)
            else:
                loss = (position_logprobs(h, w, row, label) * loss_weight).sum()
            loss.backward()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        return sorted(times[1:])[len(times[1:]) // 2] * 1e3
    alone, reported, weighed = timed(False, False), timed(True, False), timed(True, True)
    lines.append(f"bfloat16, {positions} positions (20% weighed) over {rows} rows, V = {vocab}: forward + backward "
                 f"{alone:.2f} ms; with entropies reported {reported:.2f} ms; weighed {weighed:.2f} ms")
    return lines


def milliseconds_per_round(fn, inputs, cu, export_seq, export_chunk, repeat: int) -> float:
    """Forward + backward of one round, after a warm-up (where Triton compiles); NaN if `fn` refuses."""
    import torch

    try:
        round_outputs(fn, inputs, cu, export_seq, export_chunk)
    except RuntimeError:   # fla refusing a case (backend.fla_scalar_gate_defect); ops prints why
        return float("nan")
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        round_outputs(fn, inputs, cu, export_seq, export_chunk)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - started) / repeat


def op_timing(device, args) -> list[str]:
    import torch

    from harts.executor.ops.linear_attention import chunk_linear_attention, fla_linear_attention

    lines = [f"{'tokens':>8} {'seqs':>5} {'gate':<8} {'torch ms':>9} {'fla ms':>9} {'speedup':>8}"]
    for lengths in ([4096], [256] * 16, [64] * 64, [8192, 4096, 2048, 999], [300] * 200):
        for gate in args.gates.split(","):
            inputs, cu, es, ec = make_round(lengths, gate, torch.bfloat16, device)
            torch_ms, fla_ms = (milliseconds_per_round(fn, inputs, cu, es, ec, args.repeat)
                                for fn in (chunk_linear_attention, fla_linear_attention))
            lines.append(f"{sum(lengths):>8} {len(lengths):>5} {gate:<8} {torch_ms:>9.2f} {fla_ms:>9.2f} "
                         f"{torch_ms / fla_ms:>7.2f}x")
    return lines


# ----------------------------------------------------------------------------- model on the GPU


def _fidelity_helpers():
    sys.path.insert(0, str(ROOT / "tests"))
    import fidelity

    return fidelity


def compare(result, want_logprobs, want_grads, fidelity) -> tuple[float, float, str]:
    import numpy as np

    worst_lp = max(float(np.max(np.abs(result.logprobs[str(i)][1:] - want)))
                   for i, want in enumerate(want_logprobs))
    floor = fidelity.gradient_floor(want_grads)
    worst = max((fidelity.relative_error(result.grads[n].float(), g.float(), floor), n)
                for n, g in want_grads.items())
    return worst_lp, worst[0], worst[1]


def critic_line(family: str, model, lists, plan, fidelity) -> str:
    """Loss 'value' on the windows plan against the HF backbone run per trajectory under the same linear head:
    the largest value difference (v_i read before token i) and the worst gradient of the token-mean
    0.5 (v - R)^2, model and head together."""
    import numpy as np
    import torch

    from harts.executor.losses import LossConfig
    from harts.executor.models.hf_reference import trajectory_values
    from harts.executor.runtime import run_step

    torch.manual_seed(2)
    parameter = next(model.parameters())
    head = torch.nn.Linear(model.config.hidden_size, 1).to(device=parameter.device, dtype=parameter.dtype)
    rng = np.random.default_rng(3)
    returns = [rng.normal(size=len(t)) for t in lists]
    result = run_step(plan, model, loss=LossConfig(kind="value"), value_head=head, returns=np.concatenate(returns))
    ours = {**result.grads, **{f"head.{n}": p.grad.clone() for n, p in head.named_parameters()}}
    named = {**dict(model.named_parameters()), **{f"head.{n}": p for n, p in head.named_parameters()}}
    for p in named.values():
        p.grad = None
    total, count, worst_value = 0.0, sum(len(t) - 1 for t in lists), 0.0
    for i, tokens in enumerate(lists):
        values = trajectory_values(model, head, tokens)
        worst_value = max(worst_value, float(np.max(np.abs(result.values[str(i)][1:] - values.detach().cpu().numpy()))))
        total = total + 0.5 * ((values - torch.as_tensor(returns[i][1:], device=parameter.device)) ** 2).sum()
    (total / count).backward()
    want = {n: p.grad for n, p in named.items() if p.grad is not None}
    floor = fidelity.gradient_floor(want)
    grad, name = max((fidelity.relative_error(ours[n].float(), g.float(), floor), n) for n, g in want.items())
    return f"{family:<11} {'critic (loss value), windows':<26} {worst_value:>15.2e} {grad:>15.2e}  {name}"


def fidelity_check(device, args) -> list[str]:
    import numpy as np
    import torch

    from harts.executor.runtime import run_step

    fidelity = _fidelity_helpers()
    lines = [f"{'model':<11} {'ours':<26} {'max |dlogprob|':>15} {'worst grad rel':>15}  worst parameter"]
    lists = fidelity.boundary_tree(np.random.default_rng(0))
    plans = {"compact": fidelity.compile_lists(lists),
             "windows": fidelity.compile_lists(lists, capacity=250, levels="l1+l2")}
    assert plans["windows"].producers, "capacity 250 should give the L1+L2 plan a window producer"
    say(lines.pop())
    for family, build in (("kimi_linear", fidelity.tiny_kimi_linear), ("qwen3_next", fidelity.tiny_qwen3_next)):
        model = build().to(device)
        try:   # one family failing (say, fla refusing a kernel inside the HF model) must not hide the other
            started = time.perf_counter()
            want_logprobs, want_grads = fidelity.hf_reference(model, lists)
            torch.cuda.synchronize()
            say(f"{family:<11} {'(HF per trajectory)':<26} {'':>15} {'':>15}  "
                f"{time.perf_counter() - started:.2f} s incl. first calls")
            label = {"fla": "auto (fla)", "torch": "torch"}   # auto: layers fla refuses run the torch op
            runs = [(f"compact, {label[b]}", plans["compact"], b) for b in backends()]
            runs.append((f"L1+L2 windows, {label[backends()[0]]}", plans["windows"], backends()[0]))
            for label, plan, backend in runs:
                # "auto", not "fla": where fla has a known defect for a gate (backend.fla_scalar_gate_defect)
                # those layers run the torch op, as in a user's run.
                os.environ["HARTS_LINEAR_ATTENTION"] = "auto" if backend == "fla" else backend
                result = run_step(plan, model, mode="compact")
                lp, grad, name = compare(result, want_logprobs, want_grads, fidelity)
                say(f"{family:<11} {label:<26} {lp:>15.2e} {grad:>15.2e}  {name}")
            say(critic_line(family, model, lists, plans["windows"], fidelity))
        except Exception as err:   # noqa: BLE001 - reported, and the next family still runs
            say(f"{family:<11} failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        os.environ["HARTS_LINEAR_ATTENTION"] = "auto"
        del model
        torch.cuda.empty_cache()
    lines.append("CPU tests require <= 1e-5 (logprob) and <= 1e-4 (gradient) against the CPU reference.")
    return lines


def syncs(device, args) -> list[str]:
    """Host synchronisations of one compact step, grouped by the line that caused them."""
    import collections
    import warnings

    import numpy as np
    import torch

    from harts.executor.runtime import run_step

    fidelity = _fidelity_helpers()
    lists = fidelity.boundary_tree(np.random.default_rng(0))
    plan = fidelity.compile_lists(lists, capacity=250)
    model = fidelity.tiny_kimi_linear().to(device)
    run_step(plan, model, mode="compact")                        # warm-up
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_step(plan, model, mode="compact")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(f"{Path(w.filename).relative_to(ROOT) if w.filename.startswith(str(ROOT)) else w.filename}"
                                f":{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    rounds = sum(int(mb["num_rounds"]) for mb in plan.microbatches)
    lines = [f"{sum(sites.values())} synchronising calls in one step ({len(plan.microbatches)} microbatches, "
             f"{rounds} linear-attention rounds per layer in all)"]
    lines += [f"{count:>6}  {site}" for site, count in sites.most_common(12)]
    return lines


def update(device, args) -> list[str]:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_update

    from harts.compiler.read_trees import read_trees
    from harts.executor.cli import load_model
    from harts.executor.models.init_model import init_model

    folder = Path(tempfile.mkdtemp(prefix="harts-device-update-"))
    init_model("kimi_linear", args.preset, folder / "model", vocab_size=4096)
    model = load_model(str(folder / "model"), args.dtype).to(device)
    best = backends()[0]
    rows = [("hf-per-trajectory", "auto", 16384), ("expanded", "auto", 16384)]
    rows += [(config, backend, 16384) for backend in backends() for config in ("compact", "nodewise")]
    rows += [("compact", best, 4096), ("windows", best, 4096)]
    say(f"kimi_linear {args.preset} in {args.dtype}; seconds = median of {args.repeat} after a warm-up, planning "
        "included; hf-per-trajectory runs " + ("fla's kernels" if best == "fla" else "our KDA chunk core"))
    say(f"{'workload':<16} {'configuration':<18} {'backend':<7} {'T':>6} {'tokens':>7} {'rows':>7} "
        f"{'compr.':>7} {'seconds':>8} {'tokens/s':>9} {'peak MiB':>9}")
    lines = []
    for workload in args.workloads.split(","):
        trees = folder / f"{workload}.jsonl"
        bench_update.generate(workload, 4096, trees)
        batch = read_trees(str(trees))
        rate = {}
        for config, backend, capacity in rows:
            os.environ["HARTS_LINEAR_ATTENTION"] = backend
            bench_update.median_update(config, batch, model, 64, capacity, 1)   # warm-up
            torch.cuda.reset_peak_memory_stats()
            seconds, count, compression = bench_update.median_update(config, batch, model, 64, capacity, args.repeat)
            rate[(config, backend, capacity)] = batch.num_tokens / seconds
            say(f"{workload:<16} {config:<18} {backend:<7} {capacity:>6} {batch.num_tokens:>7} {count:>7} "
                f"{compression:>6.2f}x {seconds:>8.3f} {batch.num_tokens / seconds:>9.0f} "
                f"{torch.cuda.max_memory_allocated() / 2**20:>9.0f}")
        for backend in backends():
            lines.append(f"{workload:<16} compact/nodewise ({backend}) "
                         f"{rate[('compact', backend, 16384)] / rate[('nodewise', backend, 16384)]:.2f}x "
                         "(issue #3 target >= 1.5x)")
        lines.append(f"{workload:<16} compact/expanded "
                     f"{rate[('compact', best, 16384)] / rate[('expanded', 'auto', 16384)]:.2f}x; "
                     f"windows/compact at T=4096 "
                     f"{rate[('windows', best, 4096)] / rate[('compact', best, 4096)]:.2f}x")
    os.environ["HARTS_LINEAR_ATTENTION"] = "auto"
    return lines


def nccl(device, args) -> list[str]:
    """`harts run` under a 1-process torchrun (nccl backend) gives the plain run's loss and logprobs."""
    import shutil

    import numpy as np
    from safetensors.torch import load_file

    from harts.executor.models.init_model import init_model
    from harts.tools import gen

    folder = Path(tempfile.mkdtemp(prefix="harts-device-nccl-"))
    init_model("kimi_linear", "tiny", folder / "model", vocab_size=4096)
    gen.write_jsonl(gen.generate(gen.GenConfig(kind="treestep", vocab_size=4096, seed=1, tasks=1, group_size=2,
                                               system_prompt_tokens=300)), folder / "trees.jsonl")
    harts = shutil.which("harts")
    hartsc = shutil.which("hartsc")
    done = subprocess.run([hartsc, str(folder / "trees.jsonl"), "-o", str(folder / "step.plan"),
                           "--capacity", "8192"], capture_output=True, text=True)
    if done.returncode != 0:
        return [f"hartsc failed ({done.returncode}): {done.stderr.strip()[-1500:]}"]
    # The collective is what this checks; fla's first calls would only add their compile time.
    torch_linear_attention = dict(os.environ, HARTS_LINEAR_ATTENTION="torch")
    runs, logprobs, grads = {}, {}, {}
    for label, prefix in (("plain", []), ("torchrun", [shutil.which("torchrun"), "--nproc-per-node", "1",
                                                       "--no-python"])):
        outputs = [f"--logprobs-out={folder / label}.npz", f"--grads-out={folder / label}.safetensors"]
        done = subprocess.run(prefix + [harts, "run", str(folder / "step.plan"), "--model", str(folder / "model"),
                                        "--device", device.type, "--json", "--loss", "nll", *outputs],
                              capture_output=True, text=True, env=torch_linear_attention)
        if done.returncode != 0:
            return [f"{label} failed ({done.returncode}): {done.stderr.strip()[-1500:]}"]
        runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
        with np.load(f"{folder / label}.npz") as saved:
            logprobs[label] = {key: saved[key] for key in saved.files}
        grads[label] = load_file(f"{folder / label}.safetensors")
    lines = [f"{key:<28} plain {runs['plain'][key]!s:<24} torchrun {runs['torchrun'][key]!s:<24}"
             for key in sorted(set(runs["plain"]) & set(runs["torchrun"]))
             if isinstance(runs["plain"][key], (int, float)) and "second" not in key]
    lp = max(float(np.nanmax(np.abs(logprobs["plain"][k] - logprobs["torchrun"][k]))) for k in logprobs["plain"])
    gr = max(float((grads["plain"][k] - grads["torchrun"][k]).abs().max()) for k in grads["plain"])
    lines.append(f"max |d logprob| {lp:.2e}, max |d grad| {gr:.2e} (torchrun/{'nccl' if device.type == 'cuda' else 'gloo'}"
                 " vs plain)")
    return lines


def fla_compile(device, args) -> list[str]:
    """How long fla's first calls take (Triton compiles and autotunes each kernel on first use).

    On the first lent H200 (fla 0.6.0, Triton 3.6, torch 2.11) the first forward had not returned
    after 220 s: every 30 s this prints every thread's stack, to show where the time goes.
    """
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(30, repeat=True)

    from harts.executor.ops.linear_attention import fla_linear_attention

    lines = []
    for gate, dtype, attempt in itertools.product(args.gates.split(","), (torch.bfloat16, torch.float32), range(2)):
        inputs, cu, es, ec = make_round([300, 1000, 64], gate, dtype, device)
        x = {k: v.detach().requires_grad_() for k, v in inputs.items()}
        t0 = time.perf_counter()
        o, ex = fla_linear_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, x["initial_state"].float(),
                                     es, ec, chunk_size=64, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        (o.float().sum() + ex.sum()).backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        say(f"fla {gate} {str(dtype)[6:]} call {attempt}: forward {t1 - t0:.1f} s, backward {t2 - t1:.1f} s")
    faulthandler.cancel_dump_traceback_later()
    return lines


# ----------------------------------------------------------------------------- main


def environment() -> list[str]:
    import importlib.metadata as md

    import torch

    versions = []
    for name in ("torch", "triton", "fla-core", "flash-linear-attention", "transformers", "numpy"):
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            versions.append(f"{name} missing")
    return [f"device: {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}", ", ".join(versions)]


def cap_triton_autotuning(count: int) -> None:
    """Every Triton autotuner made from now on keeps only its first `count` configurations.

    Must run before fla is imported: its kernels build their autotuners at import. With one
    configuration Triton compiles it and runs it, benchmarking nothing. fla lists its smallest tiles
    first, the ones least likely to run out of shared memory, so timings with a cap understate fla.
    """
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.configs = self.configs[:count]

    Autotuner.__init__ = init


def block_fla() -> None:
    """`import fla` fails here and in every process this one starts, as if fla were not installed."""
    sys.modules["fla"] = None
    stub = Path(tempfile.mkdtemp(prefix="harts-no-fla-")) / "fla"
    stub.mkdir()
    (stub / "__init__.py").write_text('raise ModuleNotFoundError("fla blocked by device_check --no-fla")\n')
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions (default 5)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"which of {', '.join(SECTIONS)} (default all)")
    parser.add_argument("--workloads", default="stepwise,treestep,treestep-branchy",
                        help="update section: bench_update.py workloads (default all three)")
    parser.add_argument("--preset", default="tiny", help="update section: model preset (default tiny)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="update section: model dtype (default bfloat16, what a GPU trains in; "
                             "the fidelity section is always float32)")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="start no section after this many seconds (default 0: no limit); a lent GPU's "
                             "minutes are few, so the sections run in order of importance")
    parser.add_argument("--no-fla", action="store_true",
                        help="make fla unimportable in this process: transformers and our backend run their torch "
                             "paths (for when fla's first calls are too slow for the time at hand)")
    parser.add_argument("--fla-autotune-configs", type=int, default=0, metavar="N",
                        help="keep only the first N of each Triton autotuner's configurations (default 0: all); "
                             "fla 0.6.0 compiles every configuration of a kernel one after another on first use")
    parser.add_argument("--gates", default="channel,scalar",
                        help="ops, op-timing and fla-compile: which gates (default channel,scalar), to split "
                             "fla's first compiles over processes")
    args = parser.parse_args()
    if args.no_fla:
        block_fla()
    elif args.fla_autotune_configs > 0:
        cap_triton_autotuning(args.fla_autotune_configs)
    import torch

    from harts.executor.ops.linear_attention.backend import fla_import_error

    if not torch.cuda.is_available():
        say("device check: nothing to check (no CUDA device)")
        return 0
    if fla_import_error() is not None:
        say(f"fla cannot be imported ({fla_import_error()}): its rows will fail")
    # HARTS_DEVICE_CHECK_DEVICE=cpu (with CUDA calls stubbed) dry-runs this script itself; it checks nothing.
    device = torch.device(os.environ.get("HARTS_DEVICE_CHECK_DEVICE", "cuda"))
    # Float32 means float32: no TF32 in cuBLAS or cuDNN (the reference's short convolution is a cuDNN conv).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    say("\n".join(environment()))
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    checks = {"ops": ops, "fidelity": fidelity_check, "lm-head": lm_head, "syncs": syncs, "op-timing": op_timing, "update": update,
              "nccl": nccl, "fla-compile": fla_compile}
    began = time.perf_counter()
    for name in (s for s in SECTIONS if s in args.sections.split(",")):
        say(f"\n== {name}")
        if args.budget_s and time.perf_counter() - began > args.budget_s:
            say(f"skipped: {time.perf_counter() - began:.0f} s spent of the {args.budget_s:.0f} s budget")
            continue
        started = time.perf_counter()
        try:
            say("\n".join(checks[name](device, args)))
        except Exception:   # noqa: BLE001 - report and go on: the other sections still say something
            say(traceback.format_exc(limit=8))
        say(f"({name}: {time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
