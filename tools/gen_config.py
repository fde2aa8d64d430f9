"""The configuration of `harts gen`: `GenConfig`, its validation and the presets.

A `GenConfig` is one synthetic RL step: how many tasks (GRPO groups), how
their rollouts are shaped, how long each part is, and the seed. Invariants:

* a `GenConfig` that exists is valid: `__post_init__` refuses any value the
  generator cannot honour with one `UsageError` line, `GenConfig: what was
  expected, got what was found; fix: the flag to change`;
* every field carries its `harts gen` help text (`metadata["help"]`, plus
  `metadata["choices"]` for enumerations) and is a plain int, float, str or
  bool, so the CLI builds one flag per field (`cli_flag`) without a table
  to keep in step;
* field types are annotation strings (`from __future__ import annotations`):
  the CLI maps them by name ("int", "float", "str", "bool").
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields

import numpy as np

from harts.schema.errors import UsageError

KINDS = ("stepwise", "treestep")
SHARED_STEPS = ("once", "per-branch")
PRESETS = ("small", "paper", "grpo")

# Hard limits of the output format; `GenConfig.__post_init__` says why each holds.
_MAX_LOGPROB_SCALE = 1e30
_MAX_VOCAB = 2**31


def _help(text: str, **extra) -> dict:
    """Field metadata: the flag's help text, plus argparse extras such as `choices`."""
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
        for f in fields(c):
            _need_type(f.name, f.type, getattr(c, f.name))
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
                  f"set {name} ({cli_flag(name)}) to a positive length, e.g. {_default(name):g}")
        for name in ("action_tokens_sigma", "tool_tokens_sigma"):
            value = getattr(c, name)
            _need(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0", value,
                  f"set {name} ({cli_flag(name)}) to 0 or more, e.g. 0.8")
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
              f"vocab_size must be >= {low_vocab} (at least 2, group_size and branch_factor: siblings need "
              "distinct first tokens)", c.vocab_size, f"set vocab_size (--vocab-size) to {low_vocab} or more")
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


# Fields only tree-step rollouts read: those whose help starts "treestep:".
TREESTEP_ONLY = frozenset(f.name for f in fields(GenConfig) if f.metadata["help"].startswith("treestep:"))


def _default(name: str):
    return GenConfig.__dataclass_fields__[name].default


def cli_flag(name: str) -> str:
    """The `harts gen` flag of a GenConfig field (the CLI and the error lines share it)."""
    return "--" + name.replace("_", "-")


def _need(ok: bool, what: str, got, fix: str) -> None:
    """Raise the GenConfig error line unless `ok`: what was expected, what was found, the fix."""
    if not ok:
        raise UsageError(f"GenConfig: {what}, got {got}; fix: {fix}")


# Per annotation: the types accepted and how the fix names them. bool is an int to Python, but `tasks=True`
# is a mistake, not one task; an int is a fine float.
_ACCEPTS = {"int": ((numbers.Integral,), "an integer"), "float": ((numbers.Real,), "a number"),
            "str": ((str,), "a string"), "bool": ((bool, np.bool_), "True or False")}


def _need_type(name: str, annotation: str, value) -> None:
    """The value has its field's type (the CLI's argparse types guarantee it; Python callers may not)."""
    accepted, described = _ACCEPTS[annotation]
    boolean = isinstance(value, (bool, np.bool_))
    _need(isinstance(value, accepted) and (annotation == "bool" or not boolean), f"{name} must be {described}",
          f"{value!r} ({type(value).__name__})", f"pass {name} as {described}")


def _need_range(c: GenConfig, stem: str, *, low: int) -> None:
    """`low <= STEM_min <= STEM_max` for a clipped or uniform length range."""
    lo, hi = getattr(c, f"{stem}_min"), getattr(c, f"{stem}_max")
    _need(low <= lo <= hi, f"need {low} <= {stem}_min <= {stem}_max", (lo, hi),
          f"set {cli_flag(stem + '_min')} to at least {low} and at most {cli_flag(stem + '_max')}")


def preset(name: str, kind: str = "stepwise") -> GenConfig:
    """A named starting point: 'small' (the defaults), 'paper' (one paper-scale step) or 'grpo'.

    'paper' matches a step of the paper's SWE-bench runs (Section 5.3: 16,170
    records and 435M tokens over ten steps): about 1,600 trajectories and
    43M tokens for stepwise (mean trajectory 27k tokens), with a 6,000-token
    scaffold prompt, GRPO groups of 8, 6..24 turns of a 150-token action and a
    1,600-token (median) tool output, cut at 65,536 tokens. Those sizes pin
    the mean rollout near 14 turns; more turns would overshoot the paper's
    prefix compression (docs/gen.md). The treestep variant keeps the rollout
    shape and sizes its tasks for the same ~1,600 trajectories.

    'grpo' is single-turn GRPO at a common training scale, not an agent: 1,024
    prompts with 16 responses each (16,384 trajectories, ~51M tokens), a
    300-token system prompt, prompts of 100..1,500 tokens and responses of
    median 1,500 tokens (lognormal, sigma 0.8) cut at 16,000. A group shares
    its prompt and nothing after it, so the trie bound is ~1.5x. Stepwise only:
    one turn per rollout leaves no turn to fork at.
    """
    if name == "small":
        return GenConfig(kind=kind)
    if name == "paper":
        return GenConfig(
            kind=kind, tasks=14 if kind == "stepwise" else 8, group_size=8,
            system_prompt_tokens=6000, turns_min=6, turns_max=24, action_tokens_median=150.0,
            tool_tokens_median=1600.0, max_branches=16)
    if name == "grpo":
        if kind != "stepwise":
            raise UsageError(f"preset 'grpo' is single-turn, got kind {kind!r}: a rollout is one response, with no "
                             "turn to fork at; fix: use --kind stepwise (the default) with --preset grpo")
        return GenConfig(
            kind=kind, tasks=1024, group_size=16, system_prompt_tokens=300, task_tokens_min=100,
            task_tokens_max=1500, turns_min=1, turns_max=1, action_tokens_median=1500.0, action_tokens_sigma=0.8,
            action_tokens_min=1, action_tokens_max=16000)
    raise UsageError(f"preset must be one of {PRESETS}, got {name!r}")
