"""The token-free shape of a `harts gen` step: `plan_task`, `plan` and `TaskPlan`.

The first of the generator's two phases: draw each task's rollout tree (turn
lengths, forks, rewards and advantages) with no tokens, so lengths and counts
of a paper-scale step are available in milliseconds (`harts.tools.gen_sizes`)
and the tokens (`harts.tools.gen_tokens`) are filled in afterwards.
Invariants:

* the shape (lengths, forks, rewards) of task t depends only on the config's
  shape fields, its seed and t (its own random stream), so adding tasks never
  changes the earlier ones;
* every branch (root to leaf) is at most `context_limit` tokens long and ends
  with an action of at least one token; its last tool output is 0 tokens;
* nodes are numbered in creation order, so a parent's index is smaller than
  its children's, and `leaves` are in depth-first order.

Random streams are keyed (stream, task) here for both phases: separate streams
keep the shape of a task independent of its tokens, and tokens independent of
`with_logprobs`.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from harts.tools.gen_config import GenConfig

# GRPO's usual guard against a zero standard deviation (all rewards equal):
# the advantages of such a group are then exactly 0.
_ADV_EPS = 1e-6

# Random stream keys, the first element of (stream, task); fixed forever, as files depend on them.
STREAM_SYSTEM_TOKENS, STREAM_SYSTEM_LOGPROBS, STREAM_SHAPE, STREAM_TOKENS, STREAM_LOGPROBS = range(5)


def stream_rng(seed: int, stream: int, task: int = 0) -> np.random.Generator:
    """The generator of one random stream: (seed, stream, task) alone fix its draws."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream, task)))


def id_widths(config: GenConfig) -> tuple[int, int, int]:
    """Zero-padding of the task, rollout and turn numbers in tree names and record ids.

    Fixed per config, so the names of one step have equal widths and sort in number order.
    """
    return (max(4, len(str(config.tasks - 1))), max(2, len(str(config.group_size - 1))),
            max(3, len(str(config.turns_max - 1))))


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


def _lognormal_lengths(rng, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    """`n` lengths, lognormal around `median`, rounded and clipped to [lo, hi]."""
    draws = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(draws), lo, hi).astype(np.int64)


def plan_task(config: GenConfig, task: int) -> TaskPlan:
    """Draw the shape of task `task`; depends only on (config shape fields, seed, task)."""
    c = config
    rng = stream_rng(c.seed, STREAM_SHAPE, task)
    task_w, rollout_w, _ = id_widths(c)
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
