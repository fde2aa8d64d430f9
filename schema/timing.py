"""The timing sidecar `PLAN.timing.json` that `hartsc` writes beside a plan and `harts stats` reads.

Planning time lives outside the plan so that the same input and flags give a
byte-identical plan. The record names the plan bytes it was measured for
(`plan_sha256`), so a record left beside a plan written since is recognised.
"""
from __future__ import annotations

import hashlib
from pathlib import Path


def timing_path(plan_path: str | Path) -> Path:
    """Where a plan's timing record lives: beside it, named after it."""
    plan_path = Path(plan_path)
    return plan_path.with_name(plan_path.name + ".timing.json")


def plan_digest(encoded: bytes) -> str:
    """The record's `plan_sha256`: the SHA-256 of the plan file's bytes, in hex."""
    return hashlib.sha256(encoded).hexdigest()
