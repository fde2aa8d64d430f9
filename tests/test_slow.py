"""Heavy checks, excluded from CI's default run: `python -m pytest -m slow -q`.

* a paper-scale step (~1,600 trajectories, ~43M tokens, D = 8) compiles and
  passes every invariant of the independent checker, tokens included;
* a longer tree (forks deep into the second and third chunk) still matches the
  Hugging Face model run per trajectory, in one microbatch and split over
  microbatches that share its stem through a window producer.
"""
from __future__ import annotations

import numpy as np
import pytest

from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.compiler.read_trees import read_trees
from harts.tools import gen
from harts.schema.plan_invariants import check_plan

pytestmark = pytest.mark.slow


def test_paper_scale_step_compiles_and_checks(tmp_path):
    trees = tmp_path / "trees.jsonl"
    gen.write_jsonl(gen.generate(gen.preset("paper", "stepwise")), trees)
    batch = read_trees(trees, capacity=65536)
    result = compile_batch(batch, CompileOptions(dp=8, capacity=65536, chunk_size=64))
    check_plan(result.plan, batch.tokens, batch.token_offsets)
    assert len(result.plan.microbatches) % 8 == 0


def test_long_tree_matches_hugging_face(tmp_path):
    import torch
    from transformers import KimiLinearForCausalLM

    from harts.executor.models.hf_reference import trajectory_logprobs
    from harts.executor.models.init_model import kimi_linear_config
    from harts.executor.runtime import run_step
    from harts.compiler.ir.trajectories import TrajectoryBatch

    torch.manual_seed(1)
    model = KimiLinearForCausalLM(kimi_linear_config("tiny", 512)).float().eval()
    rng = np.random.default_rng(5)
    base = list(rng.integers(3, 512, 400))
    lists = [base[:cut] + list(rng.integers(3, 512, 60)) for cut in (127, 128, 129, 191, 256, 300, 333)] + [base]
    # One microbatch (compact alone), then a capacity that needs several microbatches sharing the
    # 400-token stem through window producers (handoffs deep in the stem's chunks).
    for capacity, windows in ((8192, False), (700, True)):
        plan = compile_batch(TrajectoryBatch.from_token_lists(lists), CompileOptions(capacity=capacity)).plan
        result = run_step(plan, model, backward=False)
        assert (result.producers_run > 0) == windows
        with torch.no_grad():
            for i, tokens in enumerate(lists):
                want = trajectory_logprobs(model, tokens).numpy()
                assert np.max(np.abs(result.logprobs[str(i)][1:] - want)) <= 1e-5, (capacity, i)
