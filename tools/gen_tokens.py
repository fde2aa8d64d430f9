"""The tokens of a `harts gen` step: `generate` fills planned shapes in with records.

The second of the generator's two phases: each `TaskPlan`
(`harts.tools.gen_shape`) becomes contract records (contract section 1), one
per emitted turn node. Invariants of the records:

* tokens are uniform in [0, vocab_size) from their own random streams, so the
  tokens do not depend on `with_logprobs` and the shapes not on the tokens;
* a trajectory is the system prompt, the task description, then the action
  and tool output of each turn on its path, ending with the emitted node's
  action: `loss_mask` is 1 exactly on action tokens;
* siblings (a group's rollouts, a fork's children) differ at their first
  action token and agree token for token before it, so the prefix trie is
  the one `harts.tools.gen_sizes` counts from lengths;
* `old_logprobs` (with `with_logprobs`) are -|N(0, 1)| * logprob_scale,
  identical on shared prefixes, 0.0 at index 0.

Per-token fields are 1-D numpy arrays, views into one buffer per branch:
`tokens` int32, `loss_mask` uint8, `old_logprobs` float32.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from harts.tools.gen_config import GenConfig
from harts.tools.gen_shape import (STREAM_LOGPROBS, STREAM_SYSTEM_LOGPROBS, STREAM_SYSTEM_TOKENS,
                                   STREAM_TOKENS, TaskPlan, id_widths, plan_task, stream_rng)


def _records_of_task(config: GenConfig, p: TaskPlan, system_tokens, system_lp) -> Iterator[dict]:
    """The records of task `p`: per leaf, depth-first, its emitted nodes in turn order."""
    c = config
    _, _, turn_w = id_widths(c)
    rng = stream_rng(c.seed, STREAM_TOKENS, p.task)
    task_tokens = rng.integers(0, c.vocab_size, size=p.task_tokens, dtype=np.int32)
    seg_len = p.action_len + p.tool_len
    seg_off = np.zeros(p.num_nodes + 1, dtype=np.int64)
    np.cumsum(seg_len, out=seg_off[1:])
    total = int(seg_off[-1])
    seg_tokens = rng.integers(0, c.vocab_size, size=total, dtype=np.int32)
    # Siblings (a group's rollouts, a fork's children) must part at their first
    # sampled token, or the trie would merge them for a token or more.
    sibling_order = np.argsort(p.parent, kind="stable")
    bounds = np.flatnonzero(np.diff(p.parent[sibling_order])) + 1
    for group in np.split(sibling_order, bounds):
        if len(group) > 1:
            seg_tokens[seg_off[group]] = rng.choice(c.vocab_size, size=len(group), replace=False)
    seg_node = np.repeat(np.arange(p.num_nodes), seg_len)
    within = np.arange(total, dtype=np.int64) - seg_off[seg_node]
    seg_mask = (within < p.action_len[seg_node]).astype(np.uint8)
    if c.with_logprobs:
        lp_rng = stream_rng(c.seed, STREAM_LOGPROBS, p.task)
        task_lp = (-np.abs(lp_rng.standard_normal(p.task_tokens)) * c.logprob_scale).astype(np.float32)
        seg_lp = (-np.abs(lp_rng.standard_normal(total)) * c.logprob_scale).astype(np.float32)
    prompt_mask = np.zeros(p.prompt_tokens, dtype=np.uint8)
    ends = (p.start + p.action_len).tolist()
    for leaf, emit, path in p.samples(c.shared_steps):
        slices = [slice(seg_off[n], seg_off[n + 1]) for n in path]
        tokens = np.concatenate([system_tokens, task_tokens] + [seg_tokens[s] for s in slices])
        mask = np.concatenate([prompt_mask] + [seg_mask[s] for s in slices])
        if c.with_logprobs:
            lp = np.concatenate([system_lp, task_lp] + [seg_lp[s] for s in slices])
            lp[0] = 0.0    # index 0 is never a target
        for n in emit:
            label = p.label[leaf] if c.shared_steps == "per-branch" else p.label[n]
            adv = p.advantage[leaf] if c.shared_steps == "per-branch" else p.advantage[n]
            end = ends[n]
            record = {"id": f"{p.tree}-{label}-{int(p.turn[n]):0{turn_w}d}", "tree": p.tree,
                      "tokens": tokens[:end], "loss_mask": mask[:end], "advantages": float(adv)}
            if c.with_logprobs:
                record["old_logprobs"] = lp[:end]
            yield record


def generate_from(config: GenConfig, plans: Iterable[TaskPlan]) -> Iterator[dict]:
    """The records of the step made of `plans`, in order (`generate` of an already planned step)."""
    system_tokens = stream_rng(config.seed, STREAM_SYSTEM_TOKENS).integers(
        0, config.vocab_size, size=config.system_prompt_tokens, dtype=np.int32)
    system_lp = (-np.abs(stream_rng(config.seed, STREAM_SYSTEM_LOGPROBS).standard_normal(
        config.system_prompt_tokens)) * config.logprob_scale).astype(np.float32)
    for p in plans:
        yield from _records_of_task(config, p, system_tokens, system_lp)


def generate(config: GenConfig) -> Iterator[dict]:
    """Yield the step's training trajectories as contract records, deterministically.

    Record: {"id": "<task>-<branch>-<turn>", "tree": "<task>", "tokens": int32[n],
    "loss_mask": uint8[n], "advantages": float[, "old_logprobs": float32[n]]}.
    Arrays are views of one buffer per branch; records of one branch come
    together, in turn order.
    """
    return generate_from(config, (plan_task(config, t) for t in range(config.tasks)))
