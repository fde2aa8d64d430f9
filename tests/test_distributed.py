"""Data parallelism: `torchrun --nproc-per-node 2 harts run` equals one process running the whole step.

Run: `python -m pytest tests/test_distributed.py -q` (starts 2 gloo processes; ~30 s).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from harts.cli import main as harts
from harts.compiler.cli import main as hartsc
from harts.schema.plan import read_plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(processes: int, argv: list[str], monitor_seconds: float = 0.1) -> subprocess.CompletedProcess:
    """`monitor_seconds`: how often torchrun looks at its workers; once one has failed it stops the others."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(["torchrun", "--nproc-per-node", str(processes), "--master-addr", "127.0.0.1",
                           "--master-port", str(free_port()), "--monitor-interval", str(monitor_seconds),
                           "--no-python", *argv],
                          capture_output=True, text=True, timeout=600, env=env)


# A sequence-level objective (a trajectory's mean log-probability, squared): not a sum of per-position terms,
# so it is only right if every rank sees whole trajectories and the shares add up across ranks.
SEQUENCE_OBJECTIVE = """
import torch

def squared_means(logprobs, inputs):
    ids, local = torch.unique(inputs.trajectory, return_inverse=True)
    zeros = torch.zeros(len(ids), dtype=torch.float64)
    count = zeros.index_add(0, local, torch.ones_like(logprobs))
    mean = zeros.index_add(0, local, logprobs) / count
    return (mean ** 2).sum() / 8
"""


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
@pytest.mark.parametrize("loss", ["grpo", "custom"])
def test_two_ranks_give_the_single_process_gradients(tmp_path, loss):
    rng = np.random.default_rng(0)
    base = [int(t) for t in rng.integers(3, 64, 40)]
    records = [{"id": i, "tokens": base[: 10 + 3 * i] + [int(t) for t in rng.integers(3, 64, 5 + i)],
                "advantages": float(rng.normal())} for i in range(8)]
    (tmp_path / "trees.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert harts(["init-model", "--vocab-size", "64", "-o", str(tmp_path / "model")]) == 0
    # Capacity 50: two consumers per replica in one window, so each rank runs its own producer.
    assert hartsc([str(tmp_path / "trees.jsonl"), "-o", str(tmp_path / "step.plan"), "--dp", "2",
                   "--capacity", "50", "--chunk-size", "4"]) == 0
    assert len(read_plan(tmp_path / "step.plan").producers) == 2
    (tmp_path / "objective.py").write_text(SEQUENCE_OBJECTIVE)
    objective = (["--loss", "grpo", "--entropy-coef", "0.01"] if loss == "grpo"
                 else ["--objective", f"{tmp_path / 'objective.py'}:squared_means", "--entropy"])
    common = [str(tmp_path / "step.plan"), "--model", str(tmp_path / "model"), *objective]
    single = subprocess.run(["harts", "run", *common, "--json", "--logprobs-out", str(tmp_path / "one.npz"),
                             "--grads-out", str(tmp_path / "one.safetensors")],
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    out = torchrun(2, ["harts", "run", *common, "--json", "--logprobs-out", str(tmp_path / "two.npz"),
                       "--grads-out", str(tmp_path / "two.safetensors")])
    assert out.returncode == 0, out.stderr
    # Step totals are the whole step's: every rank's rows and window producers, the same loss.
    want, got = json.loads(single.stdout), json.loads(out.stdout)
    assert got["window_producers"] == want["window_producers"] == 2
    assert got["decoder_rows"] == want["decoder_rows"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert got["entropy"] == pytest.approx(want["entropy"], rel=1e-6) and want["entropy"] > 0
    one, two = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    assert one.keys() == two.keys()
    for name, grad in one.items():
        np.testing.assert_allclose(two[name], grad, rtol=1e-5, atol=1e-7, err_msg=name)
    lp_one, lp_two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    for key in lp_one.files:
        np.testing.assert_allclose(lp_two[key][1:], lp_one[key][1:], rtol=0, atol=1e-6)


def test_world_size_must_match_the_plan(tmp_path, monkeypatch):
    from harts.executor.distributed import init_data_parallel
    from harts.schema.errors import HartsError

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(HartsError, match="compiled for --dp 2"):
        init_data_parallel(2, torch.device("cpu"))


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_one_process_under_torchrun_refuses_a_two_replica_plan(tmp_path):
    """Under torchrun the processes must match the plan's replicas, one process included."""
    records = [{"id": i, "tokens": [3, 4, 5 + i, 6]} for i in range(4)]
    (tmp_path / "trees.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert hartsc([str(tmp_path / "trees.jsonl"), "-o", str(tmp_path / "step.plan"), "--dp", "2"]) == 0
    assert harts(["init-model", "--vocab-size", "64", "-o", str(tmp_path / "model")]) == 0
    out = torchrun(1, ["harts", "run", str(tmp_path / "step.plan"), "--model", str(tmp_path / "model")])
    assert out.returncode != 0
    assert "compiled for --dp 2 but torchrun started 1 process;" in out.stderr


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_a_refusal_every_rank_meets_reads_as_one_line_and_its_copies(tmp_path):
    """Every rank says why it stopped (one may fail alone); rank 0's line is plain, the other ranks' carry
    their rank, so a refusal they all meet reads as one line and its labelled copies. torchrun stops the other
    workers at its first look after one fails; looking every 5 s lets a rank that started late on a loaded
    machine reach its own refusal first (a full run here once saw one line: the likely cause)."""
    out = torchrun(2, ["harts", "run", str(tmp_path / "missing.plan"), "--model", str(tmp_path / "model")],
                   monitor_seconds=5)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("harts run: ")]
    assert len(lines) == 2, out.stderr
    assert sum(line.startswith("harts run: rank 1: ") for line in lines) == 1
    assert all("missing.plan: cannot read plan" in line for line in lines)


RANK_ONE_FAILS = """
import os

def objective(logprobs, inputs):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("boom on rank 1")
    return -(logprobs * inputs.weight).sum()
"""


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_a_rank_failing_alone_stops_every_rank_with_one_line(tmp_path):
    """A failure during the step on one rank only (its custom objective raises): that rank says why, the other
    says which rank stopped it, instead of a transport traceback from the all-reduce it was left waiting in."""
    records = [{"id": i, "tokens": [3, 4, 5, 6 + i, 7, 8], "advantages": 1.0} for i in range(4)]
    (tmp_path / "trees.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert hartsc([str(tmp_path / "trees.jsonl"), "-o", str(tmp_path / "step.plan"), "--dp", "2"]) == 0
    assert harts(["init-model", "--vocab-size", "64", "-o", str(tmp_path / "model")]) == 0
    (tmp_path / "fails.py").write_text(RANK_ONE_FAILS)
    out = torchrun(2, ["harts", "run", str(tmp_path / "step.plan"), "--model", str(tmp_path / "model"),
                       "--objective", f"{tmp_path / 'fails.py'}:objective", "--logprobs-out",
                       str(tmp_path / "lp.npz")], monitor_seconds=5)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("harts run: ")]
    assert len(lines) == 2, out.stderr
    assert any(line.startswith("harts run: rank 1: the custom objective raised RuntimeError: boom on rank 1")
               for line in lines), out.stderr
    assert "harts run: stopped: rank 1 failed during the step, so no output is written; fix: see rank 1's message" \
        in lines, out.stderr
    assert not any(line.startswith("[rank") for line in out.stderr.splitlines()), out.stderr
    assert "Connection closed" not in out.stderr and "terminate called" not in out.stderr, out.stderr
    assert not (tmp_path / "lp.npz").exists()
