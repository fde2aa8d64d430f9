"""The Python API: compile a batch in memory and run it inside an existing training loop.

    import harts.api as harts

    plan = harts.compile_trajectories(token_lists, loss_masks=masks, advantages=adv,
                                      old_logprobs=old, dp=1, capacity=65536)
    result = harts.run(plan, model, loss="grpo")          # forward + backward, grads in model.*.grad
    result.logprobs["17"]                                 # float32[n], NaN at index 0
    optimizer.step()

`compile_trajectories` takes what an RL framework's batch holds (token ids,
loss masks, advantages, old and reference log-probabilities per trajectory)
and returns a `Plan` (the same object `hartsc` writes to disk). `run` runs the
plan's step through a loaded Hugging Face model, leaves the gradients of the
step's loss in the model's `.grad` fields (as one `loss.backward()` over the
whole step would) and returns per-trajectory log-probabilities and the loss.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.executor.losses import LossConfig
from harts.executor.runtime import StepResult, run_step
from harts.schema.plan import Plan, read_plan, write_plan

__all__ = ["compile_trajectories", "run", "read_plan", "write_plan", "Plan", "StepResult", "LossConfig"]


def _flat(values, lengths, name) -> np.ndarray | None:
    if values is None:
        return None
    arrays = [np.asarray(v, dtype=np.float32) for v in values]
    if len(arrays) != len(lengths) or any(len(a) != n for a, n in zip(arrays, lengths)):
        raise ValueError(f"{name} must hold one list per trajectory, each as long as its tokens")
    return np.concatenate(arrays) if arrays else np.zeros(0, np.float32)


def compile_trajectories(tokens: Sequence[Sequence[int]], *, ids: Sequence | None = None,
                         loss_masks: Sequence[Sequence[int]] | None = None,
                         advantages: Sequence[float] | Sequence[Sequence[float]] | None = None,
                         old_logprobs: Sequence[Sequence[float]] | None = None,
                         ref_logprobs: Sequence[Sequence[float]] | None = None,
                         dp: int = 1, capacity: int = 65536, chunk_size: int = 64) -> Plan:
    """Compile trajectories held in memory (same alignment as trees.jsonl: index i belongs to tokens[i])."""
    lengths = [len(t) for t in tokens]
    if any(n < 2 for n in lengths):
        raise ValueError("every trajectory needs at least 2 tokens")
    if ids is not None and len(set(map(str, ids))) != len(lengths):
        raise ValueError("ids must be unique (as strings) and one per trajectory")
    per_token_adv = advantages is not None and len(advantages) and np.ndim(advantages[0]) == 1
    batch = TrajectoryBatch.from_token_lists(tokens, ids=ids, loss_masks=loss_masks,
                                             advantages=None if per_token_adv else advantages)
    from dataclasses import replace
    updates = {}
    if per_token_adv:
        updates["advantages"] = _flat(advantages, lengths, "advantages")
    for name, values in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        flat = _flat(values, lengths, name)
        if flat is not None:
            updates[name] = flat
            updates[f"has_{name}"] = np.ones(len(lengths), dtype=bool)
    if updates:
        batch = replace(batch, **updates)
    return compile_batch(batch, CompileOptions(dp=dp, capacity=capacity, chunk_size=chunk_size)).plan


def run(plan: Plan, model, *, loss: str | LossConfig = "nll", mode: str = "compact",
        backward: bool = True) -> StepResult:
    """Run the step on `model`; gradients accumulate into the parameters' `.grad` (zeroed first)."""
    config = LossConfig(kind=loss) if isinstance(loss, str) else loss
    return run_step(plan, model, mode=mode, loss=config, backward=backward)
