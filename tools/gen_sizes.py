"""Sizes of a `harts gen` step from its shape alone: `summarize`, `GenStats`, `scale_to`.

Everything here reads `TaskPlan`s (`harts.tools.gen_shape`), never tokens, so
a paper-scale step is sized in milliseconds. Invariants:

* `step_stats(config, plan(config))` counts exactly the records
  `generate(config)` yields, in file order (`lengths`), with the same lengths;
* `trie_tokens` is exact, not an estimate: siblings differ at their first
  action token, so a task's prefix trie is its prompt plus every node once;
* `scale_to` changes only `tasks`: task shapes do not depend on the task
  count, so the first tasks of the scaled step are those of the original.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from harts.schema.errors import UsageError
from harts.tools.gen_config import GenConfig
from harts.tools.gen_shape import TaskPlan, plan, plan_task


@dataclass(frozen=True, slots=True)
class GenStats:
    """Sizes of a generated step, computed from its shape alone."""

    trajectories: int
    tokens: int                 # sum of trajectory lengths (the paper's original tokens)
    max_tokens: int
    tasks: int
    branches: int               # leaves of all rollout trees
    trie_tokens: int            # sum over tasks of the task's prefix-trie tokens
    step_trie_tokens: int       # one trie for the step: the system prompt counted once
    lengths: np.ndarray         # int64, one per trajectory, in file order

    @property
    def trie_bound(self) -> float:
        """Compression bound with one trie per task: tokens / trie_tokens."""
        return self.tokens / self.trie_tokens

    @property
    def step_trie_bound(self) -> float:
        """Compression bound with one trie for the whole step (unbounded microbatch)."""
        return self.tokens / self.step_trie_tokens


def step_stats(config: GenConfig, plans: list[TaskPlan]) -> GenStats:
    """The sizes of the step made of `plans` (`summarize` of an already planned step)."""
    lengths = []
    for p in plans:
        ends = p.start + p.action_len
        for _, emit, _ in p.samples(config.shared_steps):
            lengths.append(ends[emit])
    lengths_a = np.concatenate(lengths)
    trie = sum(p.unique_tokens for p in plans)
    return GenStats(
        trajectories=len(lengths_a), tokens=int(lengths_a.sum()), max_tokens=int(lengths_a.max()),
        tasks=len(plans), branches=sum(len(p.leaves) for p in plans), trie_tokens=trie,
        step_trie_tokens=trie - (len(plans) - 1) * config.system_prompt_tokens,
        lengths=lengths_a)


def summarize(config: GenConfig) -> GenStats:
    """Trajectory count, token count and trie bound of `generate(config)`, without tokens."""
    return step_stats(config, plan(config))


def scale_to(config: GenConfig, *, trajectories: int | None = None,
             tokens: int | None = None) -> GenConfig:
    """`config` with `tasks` set so the step is as close as possible to the target size.

    Give exactly one target. Task shapes do not depend on the task count, so
    this adds whole tasks one by one (shapes only, milliseconds each) and keeps
    the count whose cumulative size is nearest the target.
    """
    if (trajectories is None) == (tokens is None):
        raise UsageError(f"scale_to: give exactly one of trajectories, tokens; got "
                         f"trajectories={trajectories}, tokens={tokens}; fix: pass one target")
    target = trajectories if trajectories is not None else tokens
    if target <= 0:
        raise UsageError(f"scale_to: the target must be > 0, got {target}; "
                         "fix: pass --target-trajectories or --target-tokens of 1 or more")
    total, task = 0, 0
    while True:
        p = plan_task(config, task)
        ends = p.start + p.action_len
        size = 0
        for _, emit, _ in p.samples(config.shared_steps):
            size += len(emit) if trajectories is not None else int(ends[emit].sum())
        if total + size >= target:
            # Keep this task if that lands nearer the target (always keep one).
            tasks = task + 1 if task == 0 or total + size - target < target - total else task
            return dataclasses.replace(config, tasks=tasks)
        total += size
        task += 1
