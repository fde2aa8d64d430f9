"""The documented examples run as a user runs them.

Run: `python -m pytest tests/test_examples.py -q` (about 10 s on 2 cores).
`examples/train_loop.py` is the loop docs/integration.md walks through and
`examples/ppo_critic.py` its PPO step with a critic; CI runs them here as
subprocesses so that the documented code cannot rot.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_loop_example_runs_and_prints_the_loss():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_loop.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = re.findall(r"^step (\d): loss (-?\d+\.\d+) \(on-policy value (-?\d+\.\d+)\)", out.stdout, re.M)
    assert [step for step, _, _ in losses] == ["0", "1"], out.stdout
    for _, loss, expected in losses:
        # On-policy GRPO: the loss is -sum(A * mask) / count, computed independently by the example.
        assert abs(float(loss) - float(expected)) <= 1e-5
    assert "logprobs[" in out.stdout and "nan" in out.stdout


def test_ppo_critic_example_runs_gae_and_both_updates():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "ppo_critic.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = re.findall(r"^step (\d): policy ppo loss (-?\d+\.\d+), critic value loss (\d+\.\d+), "
                       r"values agree across the two plans within (\S+)$", out.stdout, re.M)
    assert [step for step, *_ in lines] == ["0", "1"], out.stdout
    # The probe plan has several microbatches, the update's one: a value must not depend on the grouping.
    assert all(float(drift) <= 1e-5 for *_, drift in lines), out.stdout
    probes = re.findall(r"\((\d+) microbatches in the probe plan, 1 in the update's\)", out.stdout)
    assert len(probes) == 2 and all(int(count) > 1 for count in probes), out.stdout
