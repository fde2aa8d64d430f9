"""Golden tests: every pass's IR printed for tiny inputs, compared with tests/golden/*.txt.

Run: `python -m pytest tests/test_golden.py -q`. After an intended change,
refresh with `HARTS_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py`
and read the diff before committing: the files are the reviewed expectation.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from harts.compiler.ir.printer import format_compile_result
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.compiler.read_trees import read_trees
from harts.schema.plan import encode_plan

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    # name: (input, options)
    "forks-b4": ("forks.jsonl", CompileOptions(chunk_size=4, capacity=64, levels="l1", verify=True)),
    "forks-b2-dp2": ("forks.jsonl", CompileOptions(chunk_size=2, capacity=24, dp=2, levels="l1", verify=True)),
    "stepwise-b3": ("stepwise.jsonl", CompileOptions(chunk_size=3, capacity=32, levels="l1", verify=True)),
    # Windows: three consumers share the 10-token stem through one producer; residual calls
    # start from its exported anchors.
    "forks-b4-windows": ("forks.jsonl", CompileOptions(chunk_size=4, capacity=12, levels="l1+l2", verify=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pass_output_matches_golden(name):
    source, options = CASES[name]
    batch = read_trees(GOLDEN / source)
    text = format_compile_result(compile_batch(batch, options, keep_ir=True), batch)
    expected = GOLDEN / f"{name}.txt"
    if os.environ.get("HARTS_UPDATE_GOLDEN") == "1":
        expected.write_text(text)
    assert expected.exists(), f"no golden file {expected.name}; create it with HARTS_UPDATE_GOLDEN=1"
    assert text == expected.read_text()


@pytest.mark.parametrize("name", sorted(CASES))
def test_keeping_the_ir_does_not_change_the_plan(name):
    """The IR is dropped by default once lowered; keeping it must not change a byte of the plan, and the
    printer must say what it needs rather than print nothing."""
    source, options = CASES[name]
    batch = read_trees(GOLDEN / source)
    kept, dropped = compile_batch(batch, options, keep_ir=True), compile_batch(batch, options)
    assert dropped.microbatches is None and len(kept.microbatches) == len(kept.plan.microbatches)
    assert encode_plan(kept.plan) == encode_plan(dropped.plan)
    lines = _without_seconds(dropped)   # hartsc -v reads the records, not the IR; they must agree with it
    assert lines == _without_seconds(kept)
    ir = kept.microbatches
    assert f"lower: {sum(m.layout.num_rows for m in ir)} compact rows " in lines
    assert any(line.startswith(f"plan-replay: {sum(m.replay.replay_tokens for m in ir)} replay tokens, "
                               f"{sum(len(m.replay.export_row) for m in ir)} exported states") for line in lines)
    assert any(line.startswith(f"assign-rounds: max {max(m.schedule.num_rounds for m in ir)} rounds") for line in lines)
    with pytest.raises(ValueError, match="keep_ir=True"):
        format_compile_result(dropped, batch)


def _without_seconds(result) -> list[str]:
    return [re.sub(r"\(\d+\.\d+s\)", "", line) for line in result.decisions()]
