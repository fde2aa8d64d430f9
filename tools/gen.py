"""Synthetic agentic RL workloads shaped like SWE-bench agent rollouts (`harts gen`).

Reads a `GenConfig`; writes `trees.jsonl` (contract section 1): one training
trajectory per line. Invariants of every output, relied on by the tests:

* every trajectory is at most `context_limit` tokens long and at least 2;
* `loss_mask` is 1 exactly on the policy's action tokens (never on index 0),
  and every trajectory ends with an action token;
* the step-wise samples of one branch are nested strict prefixes, one per turn;
* two branches share their history token for token up to their fork (or up
  to the end of the task prompt for the rollouts of one GRPO group) and differ
  at the first action token after it, so the prefix trie of a task is known
  from lengths alone (`summarize`).

Generation runs in two phases with independent random streams: `plan` draws
the token-free shape of each task (turn lengths, forks, rewards); `generate`
then fills in tokens. The shape of task t depends only on (seed, t), so lengths
and counts of a paper-scale step are available in milliseconds, and adding
tasks never changes the earlier ones.

Per-token fields of the records `generate` yields are 1-D numpy arrays (views
into one buffer per branch): `tokens` int32, `loss_mask` uint8,
`old_logprobs` float32. `write_jsonl` serialises them directly (orjson);
use `.tolist()` where plain lists are needed.

Run `python -m harts.tools.gen --help` (or `harts gen --help`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from harts.schema.atomic import atomic_output, check_output_path
from harts.schema.errors import HartsError, UsageError

KINDS = ("stepwise", "treestep")
SHARED_STEPS = ("once", "per-branch")
PRESETS = ("small", "paper")

# GRPO's usual guard against a zero standard deviation (all rewards equal):
# the advantages of such a group are then exactly 0.
_ADV_EPS = 1e-6

# Random stream keys: (stream, task). Separate streams keep the shape of a
# task independent of its tokens and tokens independent of `with_logprobs`.
_SYSTEM_TOKENS, _SYSTEM_LOGPROBS, _SHAPE, _TOKENS, _LOGPROBS = range(5)


def _help(text: str, **extra) -> dict:
    return {"help": text, **extra}


@dataclass(frozen=True, slots=True)
class GenConfig:
    """One synthetic RL step: `tasks` GRPO groups of agent rollouts.

    The defaults keep the shape of a SWE-bench agent rollout (a long shared
    scaffold prompt, a task statement per GRPO group, short actions between
    long heavy-tailed tool outputs) at demo size: about 0.4M tokens stepwise.
    `preset("paper", kind)` is a paper-scale step (Section 5.3). Lengths are
    in tokens.
    """

    kind: str = field(default="stepwise", metadata=_help(
        "sampling scheme: 'stepwise' (every turn's cumulative history of every rollout is a "
        "sample) or 'treestep' (rollouts also fork; step-wise samples along every branch); "
        "default stepwise", choices=KINDS))
    tasks: int = field(default=2, metadata=_help(
        "number of tasks (GRPO groups, one rollout tree each) in the step; default 2"))
    group_size: int = field(default=4, metadata=_help(
        "rollouts per task (GRPO group size); treestep forks add branches on top; default 4"))
    # A scaffold's system prompt plus tool schemas: thousands of tokens, identical
    # in every rollout of the step, so every trajectory shares it.
    system_prompt_tokens: int = field(default=4096, metadata=_help(
        "length of the system/tool prompt shared by every rollout of the step; default 4096"))
    # An issue statement: shared by the rollouts of one task only.
    task_tokens_min: int = field(default=200, metadata=_help(
        "shortest task description (uniform in [min, max], shared within a task); default 200"))
    task_tokens_max: int = field(default=2000, metadata=_help(
        "longest task description; default 2000"))
    turns_min: int = field(default=4, metadata=_help(
        "fewest turns (action + tool output) a rollout aims for (uniform in [min, max]; "
        "the context limit may end it sooner); default 4"))
    turns_max: int = field(default=12, metadata=_help(
        "most turns a rollout aims for; default 12 (the paper preset: 6..24)"))
    # Actions are short commands or edits; tool outputs (file views, test logs)
    # are long and heavy-tailed: both lognormal, clipped.
    action_tokens_median: float = field(default=96.0, metadata=_help(
        "median assistant-action length (lognormal); default 96"))
    action_tokens_sigma: float = field(default=0.8, metadata=_help(
        "lognormal sigma of action lengths (0 = every action the median); default 0.8"))
    action_tokens_min: int = field(default=8, metadata=_help(
        "shortest action (clip); default 8"))
    action_tokens_max: int = field(default=1024, metadata=_help(
        "longest action (clip); default 1024"))
    tool_tokens_median: float = field(default=400.0, metadata=_help(
        "median tool-output length (lognormal, heavy-tailed); default 400"))
    tool_tokens_sigma: float = field(default=1.0, metadata=_help(
        "lognormal sigma of tool-output lengths; default 1.0"))
    tool_tokens_min: int = field(default=16, metadata=_help(
        "shortest tool output (clip); default 16"))
    tool_tokens_max: int = field(default=16384, metadata=_help(
        "longest tool output (clip); default 16384"))
    # HARTS rejects a trajectory longer than its microbatch capacity (65,536 in
    # the paper's Tiny runs), so a rollout stops at the limit: the action that
    # reaches it is cut to fit, as a generation cut by max length would be.
    context_limit: int = field(default=65536, metadata=_help(
        "no trajectory is longer than this; the rollout's last action is cut to fit; "
        "default 65536"))
    vocab_size: int = field(default=32000, metadata=_help(
        "tokens are drawn uniformly from [0, vocab_size); default 32000"))
    branch_prob: float = field(default=0.15, metadata=_help(
        "treestep: probability that a branch forks before a turn's action (turns >= 1); "
        "default 0.15"))
    branch_factor: int = field(default=2, metadata=_help(
        "treestep: children of a fork, each sampling its own action; default 2"))
    max_branches: int = field(default=8, metadata=_help(
        "treestep: most branches (leaves) per task, group rollouts included; forks stop "
        "once another would exceed it; default 8"))
    shared_steps: str = field(default="once", metadata=_help(
        "treestep: emit a step shared by several branches 'once' (advantage = mean over its "
        "branches) or 'per-branch' (identical duplicates, each with its branch's "
        "advantage); default once", choices=SHARED_STEPS))
    with_logprobs: bool = field(default=False, metadata=_help(
        "also emit old_logprobs (negative, identical on shared prefixes; index 0 is 0.0) "
        "for PPO tests; default off"))
    logprob_scale: float = field(default=1.0, metadata=_help(
        "old_logprobs are -|N(0, 1)| * scale; default 1.0"))
    seed: int = field(default=0, metadata=_help(
        "random seed (>= 0); the same config and seed give the same file; default 0"))

    def __post_init__(self) -> None:
        """Refuse any value the generator cannot honour: one ValueError, `GenConfig: ...; fix: ...`."""
        c = self
        _need(c.kind in KINDS, f"kind must be one of {KINDS}", repr(c.kind),
              f"set kind (--kind) to {' or '.join(KINDS)}")
        _need(c.shared_steps in SHARED_STEPS, f"shared_steps must be one of {SHARED_STEPS}",
              repr(c.shared_steps), f"set shared_steps (--shared-steps) to {' or '.join(SHARED_STEPS)}")
        _need(c.tasks >= 1, "tasks must be >= 1", c.tasks, "set tasks (--tasks) to 1 or more")
        _need(c.group_size >= 1, "group_size must be >= 1", c.group_size,
              "set group_size (--group-size) to 1 or more")
        _need(c.system_prompt_tokens >= 0, "system_prompt_tokens must be >= 0", c.system_prompt_tokens,
              "set system_prompt_tokens (--system-prompt-tokens) to 0 or more")
        _need_range(c, "task_tokens", low=1)
        _need_range(c, "turns", low=1)
        _need_range(c, "action_tokens", low=1)
        _need_range(c, "tool_tokens", low=0)
        for name in ("action_tokens_median", "tool_tokens_median"):
            value = getattr(c, name)
            _need(math.isfinite(value) and value > 0, f"{name} must be finite and > 0", value,
                  f"set {name} ({_flag(name)}) to a positive length, e.g. 96")
        for name in ("action_tokens_sigma", "tool_tokens_sigma"):
            value = getattr(c, name)
            _need(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0", value,
                  f"set {name} ({_flag(name)}) to 0 or more, e.g. 0.8")
        # float32 holds magnitudes up to 3.4e38; with the scale at most 1e30 a
        # value overflows only for a normal draw beyond 3.4e8 sigma, which never
        # happens, so every written old_logprob is a finite float32 hartsc accepts.
        _need(math.isfinite(c.logprob_scale) and 0 <= c.logprob_scale <= _MAX_LOGPROB_SCALE,
              f"logprob_scale must be finite and in [0, {_MAX_LOGPROB_SCALE:g}] (old_logprobs are float32)",
              c.logprob_scale, "set logprob_scale (--logprob-scale) to a modest value, e.g. 1.0")
        prompt_max = c.system_prompt_tokens + c.task_tokens_max
        _need(prompt_max < c.context_limit,
              "system_prompt_tokens + task_tokens_max must leave room for one action token "
              "below context_limit", (prompt_max, c.context_limit),
              f"raise context_limit (--context-limit) above {prompt_max}, or shorten the prompts")
        low_vocab = max(2, c.group_size, c.branch_factor)
        _need(c.vocab_size >= low_vocab,
              "vocab_size must be >= 2, group_size and branch_factor (siblings need distinct "
              "first tokens)", c.vocab_size, f"set vocab_size (--vocab-size) to {low_vocab} or more")
        # Tokens are int32 (as in the plan format): ids up to 2**31 - 1.
        _need(c.vocab_size <= _MAX_VOCAB, f"vocab_size must be <= 2**31 = {_MAX_VOCAB} (token ids are int32)",
              c.vocab_size, "set vocab_size (--vocab-size) to the model's vocabulary size")
        _need(0.0 <= c.branch_prob <= 1.0, "branch_prob must be in [0, 1]", c.branch_prob,
              "set branch_prob (--branch-prob) to a probability, e.g. 0.15")
        _need(c.branch_factor >= 2, "branch_factor must be >= 2", c.branch_factor,
              "set branch_factor (--branch-factor) to 2 or more")
        # Only forks read max_branches: a stepwise group may be larger.
        _need(c.kind != "treestep" or c.max_branches >= c.group_size,
              "treestep needs max_branches >= group_size", (c.max_branches, c.group_size),
              f"set max_branches (--max-branches) to {c.group_size} or more, or lower group_size")
        _need(c.seed >= 0, "seed must be >= 0", c.seed, "set seed (--seed) to 0 or more")


_MAX_LOGPROB_SCALE = 1e30
_MAX_VOCAB = 2**31


def _flag(name: str) -> str:
    """The `harts gen` flag of a GenConfig field."""
    return "--" + name.replace("_", "-")


def _need(ok: bool, what: str, got, fix: str) -> None:
    """Raise the GenConfig error line unless `ok`: what was expected, what was found, the fix."""
    if not ok:
        raise UsageError(f"GenConfig: {what}, got {got}; fix: {fix}")


def _need_range(c: GenConfig, stem: str, *, low: int) -> None:
    """`low <= STEM_min <= STEM_max` for a clipped or uniform length range."""
    lo, hi = getattr(c, f"{stem}_min"), getattr(c, f"{stem}_max")
    _need(low <= lo <= hi, f"need {low} <= {stem}_min <= {stem}_max", (lo, hi),
          f"set {_flag(stem + '_min')} to at least {low} and at most {_flag(stem + '_max')}")


def preset(name: str, kind: str = "stepwise") -> GenConfig:
    """A named starting point: 'small' (the defaults) or 'paper' (one paper-scale step).

    'paper' matches a step of the paper's SWE-bench runs (Section 5.3: 16,170
    records and 435M tokens over ten steps): about 1,600 trajectories and
    43M tokens for stepwise (mean trajectory 27k tokens), with a 6,000-token
    scaffold prompt, GRPO groups of 8, 6..24 turns of a 150-token action and a
    1,600-token (median) tool output, cut at 65,536 tokens. Those sizes pin
    the mean rollout near 14 turns; more turns would overshoot the paper's
    prefix compression (docs/gen.md). The treestep variant keeps the rollout
    shape and sizes its tasks for the same ~1,600 trajectories.
    """
    if name == "small":
        return GenConfig(kind=kind)
    if name == "paper":
        return GenConfig(
            kind=kind, tasks=14 if kind == "stepwise" else 8, group_size=8,
            system_prompt_tokens=6000, turns_min=6, turns_max=24, action_tokens_median=150.0,
            tool_tokens_median=1600.0, max_branches=16)
    raise UsageError(f"preset must be one of {PRESETS}, got {name!r}")


# --------------------------------------------------------------------------- shape

@dataclass(frozen=True, slots=True)
class TaskPlan:
    """The token-free shape of one task's rollout tree.

    Nodes are turns: node i is the action (length `action_len[i]`) then the
    tool output (`tool_len[i]`, 0 on a branch's last turn, which no sample
    contains) of turn `turn[i]`, starting at position `start[i]` of its branch.
    `parent[i]` is the previous turn's node (-1 after the task prompt); a node
    with several children is a fork. Nodes are numbered in creation order, so
    a parent's index is smaller than its children's.
    """

    task: int
    tree: str
    prompt_tokens: int          # system prompt + task description
    task_tokens: int
    parent: np.ndarray          # int64 [nodes]
    turn: np.ndarray            # int64 [nodes]
    start: np.ndarray           # int64 [nodes]
    action_len: np.ndarray      # int64 [nodes]
    tool_len: np.ndarray        # int64 [nodes]
    label: tuple                # branch label per node: 'r03', 'r03.1', 'r03.1.0'
    advantage: np.ndarray       # float64 [nodes]: mean advantage of the leaves below
    leaves: np.ndarray          # int64: leaf nodes in depth-first order
    reward: np.ndarray          # float64 per leaf (same order)

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    def path(self, leaf: int) -> list[int]:
        """Nodes from the first turn down to `leaf`."""
        nodes = []
        while leaf >= 0:
            nodes.append(leaf)
            leaf = int(self.parent[leaf])
        return nodes[::-1]

    def samples(self, shared_steps: str) -> Iterator[tuple[int, list[int], list[int]]]:
        """(leaf, nodes to emit, path from the first turn to leaf) per leaf, depth-first.

        'once' emits each node with the first leaf whose path holds it, so the
        order is a preorder walk; 'per-branch' emits the whole path per leaf.
        """
        emitted = np.zeros(self.num_nodes, dtype=bool)
        for leaf in self.leaves.tolist():
            path = self.path(leaf)
            if shared_steps == "per-branch":
                emit = path
            else:
                emit = [n for n in path if not emitted[n]]
                emitted[emit] = True
            yield leaf, emit, path

    @property
    def unique_tokens(self) -> int:
        """Tokens of this task's prefix trie: siblings differ at their first action token."""
        return self.prompt_tokens + int(self.action_len.sum() + self.tool_len.sum())


def _rng(seed: int, stream: int, task: int = 0) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream, task)))


def _lognormal_lengths(rng, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    draws = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(draws), lo, hi).astype(np.int64)


def _widths(config: GenConfig) -> tuple[int, int, int]:
    return (max(4, len(str(config.tasks - 1))), max(2, len(str(config.group_size - 1))),
            max(3, len(str(config.turns_max - 1))))


def plan_task(config: GenConfig, task: int) -> TaskPlan:
    """Draw the shape of task `task`; depends only on (config shape fields, seed, task)."""
    c = config
    rng = _rng(c.seed, _SHAPE, task)
    task_w, rollout_w, _ = _widths(c)
    task_tokens = int(rng.integers(c.task_tokens_min, c.task_tokens_max + 1))
    prompt = c.system_prompt_tokens + task_tokens
    success_p = float(rng.random())
    forks = c.kind == "treestep" and c.branch_prob > 0
    parent, turn, start, action, tool, label = [], [], [], [], [], []
    # An active branch: (previous node, label, position of its next action, target turns).
    targets = rng.integers(c.turns_min, c.turns_max + 1, size=c.group_size)
    active = [(-1, f"r{r:0{rollout_w}d}", prompt, int(targets[r])) for r in range(c.group_size)]
    leaves_count = c.group_size
    k = 0
    while active:
        if forks and k >= 1:
            draws = rng.random(len(active))
            forked = []
            for branch, u in zip(active, draws.tolist()):
                if u < c.branch_prob and leaves_count + c.branch_factor - 1 <= c.max_branches:
                    leaves_count += c.branch_factor - 1
                    child_targets = rng.integers(max(c.turns_min, k + 1), c.turns_max + 1,
                                                 size=c.branch_factor)
                    forked.extend((branch[0], f"{branch[1]}.{j}", branch[2], int(t))
                                  for j, t in enumerate(child_targets.tolist()))
                else:
                    forked.append(branch)
            active = forked
        n = len(active)
        a_n = _lognormal_lengths(rng, n, c.action_tokens_median, c.action_tokens_sigma,
                                 c.action_tokens_min, c.action_tokens_max).tolist()
        o_n = _lognormal_lengths(rng, n, c.tool_tokens_median, c.tool_tokens_sigma,
                                 c.tool_tokens_min, c.tool_tokens_max).tolist()
        survivors = []
        for (prev, lab, pos, target), a, o in zip(active, a_n, o_n):
            a = min(a, c.context_limit - pos)      # pos < limit, so a >= 1
            # The branch ends when it reaches its target, or when the next action
            # could not start below the limit; its last tool output is never seen.
            last = k + 1 >= target or pos + a + o >= c.context_limit
            node = len(parent)
            parent.append(prev)
            turn.append(k)
            start.append(pos)
            action.append(a)
            tool.append(0 if last else o)
            label.append(lab)
            if not last:
                survivors.append((node, lab, pos + a + o, target))
        active = survivors
        k += 1

    parent_a = np.asarray(parent, dtype=np.int64)
    num_nodes = len(parent_a)
    children: list[list[int]] = [[] for _ in range(num_nodes)]
    roots = []
    for i, p in enumerate(parent):
        (roots if p < 0 else children[p]).append(i)
    # Depth-first leaf order, so a branch's records stay together in the file.
    leaves, stack = [], roots[::-1]
    while stack:
        i = stack.pop()
        if children[i]:
            stack.extend(children[i][::-1])
        else:
            leaves.append(i)
    leaves_a = np.asarray(leaves, dtype=np.int64)
    reward = (rng.random(len(leaves_a)) < success_p).astype(np.float64)
    leaf_adv = (reward - reward.mean()) / (reward.std() + _ADV_EPS)
    # A shared step's advantage: the mean over the branches below it (the
    # Monte Carlo value estimate tree-search RL uses for an internal node).
    adv_sum = np.zeros(num_nodes)
    adv_sum[leaves_a] = leaf_adv
    count = np.zeros(num_nodes)
    count[leaves_a] = 1.0
    for i in range(num_nodes - 1, -1, -1):    # children have larger indices
        p = parent[i]
        if p >= 0:
            adv_sum[p] += adv_sum[i]
            count[p] += count[i]
    return TaskPlan(
        task=task, tree=f"task{task:0{task_w}d}", prompt_tokens=prompt, task_tokens=task_tokens,
        parent=parent_a, turn=np.asarray(turn, dtype=np.int64),
        start=np.asarray(start, dtype=np.int64), action_len=np.asarray(action, dtype=np.int64),
        tool_len=np.asarray(tool, dtype=np.int64), label=tuple(label),
        advantage=adv_sum / count, leaves=leaves_a, reward=reward)


def plan(config: GenConfig) -> list[TaskPlan]:
    """The shapes of all tasks of the step (no tokens)."""
    return [plan_task(config, t) for t in range(config.tasks)]


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


def _stats(config: GenConfig, plans: list[TaskPlan]) -> GenStats:
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
    return _stats(config, plan(config))


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


# --------------------------------------------------------------------------- tokens

def _records_of_task(config: GenConfig, p: TaskPlan, system_tokens, system_lp) -> Iterator[dict]:
    c = config
    _, _, turn_w = _widths(c)
    rng = _rng(c.seed, _TOKENS, p.task)
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
        lp_rng = _rng(c.seed, _LOGPROBS, p.task)
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


def _generate(config: GenConfig, plans: Iterable[TaskPlan]) -> Iterator[dict]:
    system_tokens = _rng(config.seed, _SYSTEM_TOKENS).integers(
        0, config.vocab_size, size=config.system_prompt_tokens, dtype=np.int32)
    system_lp = (-np.abs(_rng(config.seed, _SYSTEM_LOGPROBS).standard_normal(
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
    return _generate(config, (plan_task(config, t) for t in range(config.tasks)))


@dataclass(frozen=True, slots=True)
class WriteResult:
    path: str
    trajectories: int
    tokens: int
    bytes: int          # size of the file written (compressed for .zst)


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> WriteResult:
    """Write records as JSON lines to `path` atomically; a `.zst` suffix compresses.

    The file appears only when complete (temporary file in the same folder,
    then `os.replace`); on any error the temporary file is removed. Numpy
    arrays in records are written as JSON lists.
    """
    path = Path(path)
    option = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
    count = num_tokens = 0
    with atomic_output(path) as raw:
        if path.suffix == ".zst":
            import zstandard

            out = zstandard.ZstdCompressor(level=3).stream_writer(raw, closefd=False)
        else:
            out = raw
        for record in records:
            out.write(orjson.dumps(record, option=option))
            count += 1
            num_tokens += len(record["tokens"])
        if out is not raw:
            out.close()
        size = raw.tell()
    return WriteResult(path=str(path), trajectories=count, tokens=num_tokens, bytes=size)


# --------------------------------------------------------------------------- CLI

_CLI_TYPES = {"int": int, "float": float, "str": str}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="harts gen",
        description="Write a synthetic agentic RL step (SWE-bench-shaped rollouts) as trees.jsonl. "
                    "Start from --preset, override any field with its flag. The defaults "
                    "named below are the small preset's.")
    ap.add_argument("-o", "--output", help="output file (.jsonl, or .jsonl.zst to compress); "
                                           "required unless --dry-run")
    ap.add_argument("--preset", choices=PRESETS, default="small",
                    help="starting config: 'small' (the defaults, ~0.4M tokens stepwise) or "
                         "'paper' (one paper-scale step, ~1,600 trajectories, ~44M tokens "
                         "stepwise); default small")
    target = ap.add_mutually_exclusive_group()
    target.add_argument("--target-trajectories", type=int, metavar="N",
                        help="set --tasks so the step has about N trajectories (after overrides)")
    target.add_argument("--target-tokens", type=int, metavar="N",
                        help="set --tasks so the step has about N tokens (after overrides)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the step's sizes and trie bound from its shape; write nothing")
    for f in dataclasses.fields(GenConfig):
        flag = "--" + f.name.replace("_", "-")
        kwargs = {"dest": f.name, "default": None, "help": f.metadata["help"]}
        if f.type == "bool":
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            ap.add_argument(flag, type=_CLI_TYPES[f.type], choices=f.metadata.get("choices"),
                            **kwargs)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(GenConfig)
                 if getattr(args, f.name) is not None}
    try:
        config = dataclasses.replace(preset(args.preset, overrides.get("kind", "stepwise")),
                                     **overrides)
        if args.target_trajectories is not None:
            config = scale_to(config, trajectories=args.target_trajectories)
        elif args.target_tokens is not None:
            config = scale_to(config, tokens=args.target_tokens)
        if args.output is None and not args.dry_run:
            raise UsageError("no output file; fix: give -o/--output FILE, or --dry-run")
        if not args.dry_run:
            # Before any work: a bad path must not cost a paper-scale generation.
            check_output_path(args.output)
        t0 = time.perf_counter()
        plans = plan(config)
        stats = _stats(config, plans)
        sizes = (f"{stats.trajectories:,} trajectories, {stats.tokens:,} tokens "
                 f"(max {stats.max_tokens:,}), {config.tasks} tasks, "
                 f"trie bound {stats.trie_bound:.2f}x")
        if args.dry_run:
            print(f"harts gen: {config.kind}: {sizes} (dry run, nothing written)", file=sys.stderr)
            return 0
        result = write_jsonl(_generate(config, plans), args.output)
    except (OSError, HartsError) as err:
        print(f"harts gen: error: {err}", file=sys.stderr)
        return 2
    print(f"harts gen: {config.kind}: {sizes} -> {result.path} ({result.bytes:,} bytes, "
          f"{time.perf_counter() - t0:.2f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
