"""A folder a user would run `harts run` in: trees, a tiny random model, and a plan compiled from them
(shared by tests/test_run_cli.py and tests/test_run_bad_input.py, each with its own trees)."""
from __future__ import annotations

import json
from pathlib import Path

from harts.cli import main as harts
from harts.compiler.cli import main as hartsc


def make_run_workspace(folder: Path, trees: list[dict]) -> Path:
    """trees.jsonl, model/ (tiny Kimi Linear, vocabulary 64) and step.plan (B = 2) under `folder`."""
    (folder / "trees.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trees))
    assert harts(["init-model", "--preset", "tiny", "--vocab-size", "64", "-o", str(folder / "model")]) == 0
    assert hartsc([str(folder / "trees.jsonl"), "-o", str(folder / "step.plan"), "--chunk-size", "2",
                   "--vocab-size", "64"]) == 0
    return folder
