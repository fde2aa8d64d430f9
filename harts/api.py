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

Errors: a bad argument or an argument the batch cannot satisfy is a
`ValueError` (`UsageError` and `PassFailedError` are both); every error HARTS
reports is a `HartsError`.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from harts.background import BackgroundCompiler
from harts.compiler.ir.trajectories import TrajectoryBatch, never_read, positive_logprob_warnings
from harts.compiler.pipeline import CompileOptions, check_options, compile_batch
from harts.executor.losses import VALUE, LossConfig, Objective, PositionMeta
from harts.executor.critic import critic_targets
from harts.executor.runtime import StepResult, run_step
from harts.schema.cost_model import DEFAULT_PAIRS_PER_TOKEN
from harts.schema.plan import Plan, write_plan
from harts.schema.plan import read_plan as _read_plan_file
from harts.schema.errors import HartsError, UsageError
from harts.schema.plan_invariants import require_valid_plan

__all__ = ["compile_trajectories", "BackgroundCompiler", "run", "read_plan", "write_plan", "critic_class", "Plan",
           "StepResult", "LossConfig", "Objective", "PositionMeta", "HartsError", "UsageError"]


def _as_numpy(values, dtype=None) -> np.ndarray:
    """A list, numpy array or torch tensor (any device, bfloat16 included) as a numpy array."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):   # a torch tensor: numpy knows no bfloat16
        values = values.detach().cpu()
        if values.is_floating_point():
            values = values.double()
        values = values.numpy()
    return np.asarray(values, dtype=dtype)


def _is_boolean(x) -> bool:
    """A Python, numpy or torch boolean scalar."""
    return isinstance(x, (bool, np.bool_)) or (hasattr(x, "dtype") and getattr(x, "ndim", 1) == 0
                                               and str(x.dtype) in ("bool", "torch.bool"))


def _first_boolean(values, array: np.ndarray) -> int | None:
    """Index of the first boolean in a list or tuple `values` that numpy read as numbers (`array`), or None.

    numpy reads [True, 2, 3] as ints and [0.5, True] as floats without a trace; a bool can only have become
    0 or 1, so only those entries are looked at (a few per trajectory), not every value."""
    if not isinstance(values, (list, tuple)) or array.ndim != 1 or array.dtype.kind not in "iuf":
        return None
    return next((j for j in np.flatnonzero((array == 0) | (array == 1)).tolist() if _is_boolean(values[j])), None)


def _per_token(values, lengths, name, dtype) -> list[np.ndarray]:
    """One array per trajectory, each exactly as long as its tokens (one clear error otherwise)."""
    if len(values) != len(lengths):
        raise ValueError(f"{name}: {len(values)} entries for {len(lengths)} trajectories; fix: give one per trajectory")
    arrays = []
    for i, v in enumerate(values):
        try:
            arrays.append(_as_numpy(v))
        except (TypeError, ValueError, RuntimeError):   # ragged nesting, tensors numpy cannot take, ...
            raise ValueError(f"trajectory {i}: {name} is not a flat list of numbers; "
                             "fix: give one number per token") from None
    for i, (v, a) in enumerate(zip(values, arrays)):
        # numpy would parse "0.5" as a number; None (mixed with numbers: an object array) is NaN, as null is
        # in a record, and is refused later wherever a loss reads it.
        elements = a.ravel().tolist() if a.dtype.kind == "O" else ()
        if a.dtype.kind not in "biufO" or not all(x is None or isinstance(x, (int, float, np.number))
                                                  for x in elements):
            raise ValueError(f"trajectory {i}: {name} holds {a.dtype} values, not numbers; fix: give numbers")
        # A bool mask is natural; a bool advantage or log-probability is a slip.
        if name != "loss_masks" and (a.dtype == bool or any(_is_boolean(x) for x in elements)
                                     or _first_boolean(v, a) is not None):
            raise ValueError(f"trajectory {i}: {name} holds booleans; fix: give numbers (e.g. .float() first)")
    arrays = [a.astype(dtype) for a in arrays]
    for i, (a, n) in enumerate(zip(arrays, lengths)):
        if a.ndim != 1 or len(a) != n:
            raise ValueError(f"trajectory {i}: {name} has shape {a.shape} but tokens has {n}; "
                             f"fix: give one value per token")
    return arrays


def _flat(values, lengths, name, unread: list[np.ndarray] | None = None) -> np.ndarray | None:
    """Per-token floats as one float32 array; every value finite, except at the positions `unread[i]` of
    trajectory i, where anything is stored as 0.0. With `unread` (old and reference log-probabilities)
    an entry may be None: that trajectory gave none, stored as NaN as `read_trees` stores it."""
    if values is None:
        return None
    missing = [unread is not None and v is None for v in values]
    if len(values) == len(lengths):
        values = [np.full(n, np.nan) if gone else v for v, gone, n in zip(values, missing, lengths)]
    arrays = _per_token(values, lengths, name, np.float64)
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    # Checked on the whole step at once (a few passes, not a few numpy calls per trajectory); the first bad value
    # in trajectory order is the one reported.
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])   # each array is as long as its tokens (`_per_token` checked)
    not_float32 = ~np.isfinite(flat) | (np.abs(flat) > np.finfo(np.float32).max)
    if unread is not None:
        # Positions no loss reads (`never_read`): StepResult.logprobs holds NaN at index 0, and with
        # logprobs="loss" wherever loss_mask is 0, so a run's log-probabilities pass back as they are.
        # Stored 0.0 there, as read_trees stores them; finite values are kept (a custom objective sees them).
        # A trajectory that gave none stays NaN throughout.
        given = np.repeat(~np.asarray(missing, dtype=bool), np.diff(offsets))
        skipped = np.concatenate(unread) & given if unread else np.zeros(0, dtype=bool)
        flat[skipped & not_float32] = 0.0
        not_float32 &= given & ~skipped
    bad = np.flatnonzero(not_float32)
    if len(bad):
        i = int(np.searchsorted(offsets, bad[0], side="right")) - 1
        raise ValueError(f"trajectory {i}: {name}[{bad[0] - offsets[i]}] = {flat[bad[0]]} is not a finite float32; "
                         "fix: give finite numbers" + (" (NaN only where no loss reads it: index 0, "
                                                       "and where loss_mask is 0)" if unread is not None else ""))
    return flat.astype(np.float32)


def _sequence(values, name: str, fix: str):
    """`values` as something with a length and indexing (a generator becomes a list); one clear error otherwise."""
    if (values is None or isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__")
            or getattr(values, "ndim", 1) == 0):
        raise ValueError(f"{name} must be a sequence, one entry per trajectory, got {type(values).__name__}; fix: {fix}")
    return values if hasattr(values, "__len__") and hasattr(values, "__getitem__") else list(values)


def _check_labels(values, name: str, count: int, *, unique: bool) -> tuple | None:
    """`ids` or `trees` as the reader takes them: one str or int per trajectory (not a bool; an int within
    [-2**63, 2**64), what a plan stores; a str without lone surrogates); a tree may be None (no tree, as a
    record without "tree"); ids are unique as strings (they key per-trajectory outputs). numpy integers
    count as ints. Returns them as a tuple, or None."""
    if values is None:
        return None
    values = _sequence(values, name, "give one str or int per trajectory")
    if len(values) != count:
        raise ValueError(f"{name}: {len(values)} entries for {count} trajectories; fix: give one per trajectory")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, np.integer):
            v = int(v)
        elif isinstance(v, str):   # numpy's and other str subclasses: the plan stores plain text
            v = str(v)
        if v is None and not unique:   # a trajectory in no named tree, as a record without "tree"
            out.append(v)
            continue
        if not (type(v) is str or type(v) is int) or (type(v) is int and not -2**63 <= v < 2**64):
            raise ValueError(f"trajectory {i}: {name[:-1]} {v!r:.40} is not a str or an int in [-2**63, 2**64); "
                             f"fix: give a string or a 64-bit integer")
        if type(v) is str:
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"trajectory {i}: {name[:-1]} holds a lone surrogate; "
                                 "fix: give a string that is valid Unicode") from None
        out.append(v)
    if unique:
        first = {}
        for i, v in enumerate(out):
            if str(v) in first:
                raise ValueError(f"trajectory {i}: id {v!r} is, as a string, the id of trajectory {first[str(v)]}; "
                                 "fix: give distinct ids (they key per-trajectory outputs)")
            first[str(v)] = i
    return tuple(out)


def _check_tokens(tokens, vocab_size: int | None) -> None:
    if len(tokens) == 0:
        raise ValueError("no trajectories to compile; fix: pass at least one token list")
    for i, t in enumerate(tokens):
        try:
            a = _as_numpy(t)
        except (TypeError, ValueError):
            raise ValueError(f"trajectory {i}: tokens are not a flat list of integer ids; "
                             "fix: give one list of ints per trajectory") from None
        if a.ndim != 1 or len(a) < 2:
            raise ValueError(f"trajectory {i}: tokens must be a list of at least 2 ids; fix: drop or extend it")
        if a.dtype.kind not in "iu":
            raise ValueError(f"trajectory {i}: tokens have dtype {a.dtype}; fix: give integer token ids")
        flagged = _first_boolean(t, a)
        if flagged is not None:
            raise ValueError(f"trajectory {i}: tokens[{flagged}] is {t[flagged]} (a boolean); "
                             "fix: give integer token ids")
        if a.min() < 0 or (vocab_size is not None and a.max() >= vocab_size) or a.max() >= 2**31:
            raise ValueError(f"trajectory {i}: token ids must lie in [0, {vocab_size or 2**31}); "
                             f"got [{int(a.min())}, {int(a.max())}]; fix: use the model tokenizer's ids")


def compile_trajectories(tokens: Sequence[Sequence[int]], *, ids: Sequence | None = None,
                         trees: Sequence | None = None, loss_masks: Sequence[Sequence[int]] | None = None,
                         advantages: Sequence[float] | Sequence[Sequence[float]] | None = None,
                         old_logprobs: Sequence[Sequence[float]] | None = None,
                         ref_logprobs: Sequence[Sequence[float]] | None = None,
                         dp: int = 1, capacity: int = 65536, chunk_size: int = 64,
                         vocab_size: int | None = None, levels: str = "l1+l2",
                         pairs_per_token: int = DEFAULT_PAIRS_PER_TOKEN, max_window_slots: int = 0,
                         l1_objective: str = "step-time") -> Plan:
    """Compile trajectories held in memory (same alignment as trees.jsonl: index i belongs to tokens[i]).

    `ids` and `trees` are the records' `id` and `tree` (a str or int each; ids
    unique as strings; trees name rollout trees for `harts viz --tree`).
    `levels` is hartsc's `--levels`: "l1+l2" (default) adds sharing windows,
    "l1" stops after L1 microbatches. `pairs_per_token` is `--pairs-per-token`
    (L2's cost model; 0 balances tokens only), `max_window_slots` is
    `--max-window-slots` (0: windows of any length), `l1_objective` is
    `--l1-objective` ("step-time" or the paper's "compression").

    Checks what the file reader checks, raising `ValueError` with a fix:
    token ids are integers in [0, vocab_size), masks are 0/1 and every
    per-token list is as long as its tokens, floats are finite. Options are
    checked first, as `hartsc` checks its flags (a `PassFailedError`, which is
    a `ValueError` too).
    """
    options = CompileOptions(dp=dp, capacity=capacity, chunk_size=chunk_size, vocab_size=vocab_size, levels=levels,
                             pairs_per_token=pairs_per_token, max_window_slots=max_window_slots,
                             l1_objective=l1_objective)
    check_options(options)
    tokens = _sequence(tokens, "tokens", "give one list of token ids per trajectory")
    _check_tokens(tokens, vocab_size)
    lengths = [len(t) for t in tokens]
    ids = _check_labels(ids, "ids", len(lengths), unique=True)
    trees = _check_labels(trees, "trees", len(lengths), unique=False)
    if loss_masks is not None:
        loss_masks = _sequence(loss_masks, "loss_masks", "give one 0/1 list per trajectory")
        masks = _per_token(loss_masks, lengths, "loss_masks", np.float64)
        for i, m in enumerate(masks):
            if np.any((m != 0) & (m != 1)):
                raise ValueError(f"trajectory {i}: loss_masks hold a value other than 0 and 1; fix: give 0/1 per token")
    if advantages is not None and hasattr(advantages, "detach"):   # one torch tensor of per-trajectory values
        advantages = _as_numpy(advantages)
    if advantages is not None:
        advantages = _sequence(advantages, "advantages",
                               "give one per trajectory, a scalar or a per-token list (for one value for all, "
                               "[a] * len(tokens))")
    if advantages is not None and len(advantages) != len(lengths):
        raise ValueError(f"advantages: {len(advantages)} entries for {len(lengths)} trajectories; "
                         "fix: give one (scalar or per-token list) per trajectory")
    if advantages is not None:
        # None is "not given" (0.0), as null in a record; a torch scalar (bfloat16, or one that requires a
        # gradient) goes through numpy here, where np.ndim below could not take it.
        advantages = [0.0 if a is None else _as_numpy(a) if hasattr(a, "detach") else a for a in advantages]
    scalar = None if advantages is None else [not isinstance(a, (list, tuple)) and np.ndim(a) == 0
                                               for a in advantages]   # (np.ndim fails on a ragged list)
    per_token_adv = scalar is not None and not all(scalar)
    if per_token_adv:
        # Forms may mix, as in trees.jsonl records: a scalar is its value at every token (kept a list of the
        # value itself, so a bool is refused below as in a per-token list).
        advantages = [[a] * n if one else a for a, n, one in zip(advantages, lengths, scalar)]
    elif advantages is not None:
        advantages = _flat([[a] for a in advantages], [1] * len(lengths), "advantages")   # finite scalars
    batch = TrajectoryBatch.from_token_lists(tokens, ids=ids, loss_masks=loss_masks,
                                             advantages=None if per_token_adv else advantages)
    from dataclasses import replace
    updates = {} if trees is None else {"trees": trees}
    if per_token_adv:
        updates["advantages"] = _flat(advantages, lengths, "advantages")
    unread = [never_read(batch.loss_mask[start:end], end - start)
              for start, end in zip(batch.token_offsets[:-1].tolist(), batch.token_offsets[1:].tolist())]
    for name, values in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if values is not None:
            values = _sequence(values, name, "give one list per trajectory (None for one that has none)")
        flat = _flat(values, lengths, name, unread)
        given = None if values is None else np.array([v is not None for v in values], dtype=bool)
        if flat is not None and given.any():   # None for every trajectory: as if not given at all
            updates[name] = flat
            updates[f"has_{name}"] = given
    if updates:
        batch = replace(batch, **updates)
    if max(lengths) > capacity:
        raise ValueError(f"a trajectory has {max(lengths)} tokens, more than capacity {capacity}; "
                         "fix: raise capacity or truncate it")
    for line in positive_logprob_warnings(batch):   # legal, but almost always a sign mistake
        warnings.warn(line, stacklevel=2)
    return compile_batch(batch, options).plan


def read_plan(path, *, check: bool = True) -> Plan:
    """A plan written by `hartsc` or `write_plan`. With `check` (the default) every invariant is verified
    first, as `harts run` does: `run` trusts the plan's index tables, and a plan that reads but breaks an
    invariant would run to wrong log-probabilities. Raises `PlanFormatError` (one line, naming the file);
    the check costs about 0.2 s on a paper-scale step (plans from `compile_trajectories` need none)."""
    plan = _read_plan_file(path)
    if check:
        require_valid_plan(str(path), plan)
    return plan


def critic_class(model_type: str) -> type:
    """The critic class of a family HARTS runs (`"kimi_linear"`, `"qwen3_next"`): its `*ForTokenClassification`,
    transformers' or the one HARTS adds where transformers has none (`harts.executor.models.critics`), which
    `AutoModelForTokenClassification` also loads once this has been called. Start a critic from a policy with
    `harts.executor.models.critics.critic_from_policy(policy_dir)` (or `harts init-model --critic --from`): the
    policy's backbone, a new `score`, no dropout before it."""
    from harts.executor.models.critics import critic_class as family_critic, register_critics
    from harts.executor.models.registry import RUNNERS

    if model_type not in RUNNERS:
        raise UsageError(f"model type {model_type!r} is not supported; fix: use one of {', '.join(sorted(RUNNERS))}")
    register_critics()
    return family_critic(model_type)


def run(plan: Plan, model, *, loss: str | LossConfig | Objective = "nll", mode: str = "compact",
        backward: bool = True, recompute: bool = False, windows: bool = True,
        logprobs: str = "all", accumulate: bool = False, entropy: bool = False,
        device_timing: bool = False, returns=None, old_values=None, value_head=None) -> StepResult:
    """Run the step on `model`. The parameters' `.grad` are zeroed first and then hold the
    gradient of the step's objective (as one backward over the whole step would leave them);
    `accumulate` keeps what `.grad` holds and adds this step's gradient to it (several plans
    into one optimizer step, in one process; each plan's loss is normalised over its own
    positions, so weigh them with `LossConfig` coefficients or scale afterwards). `windows`
    False runs every consumer of a two-level plan without its producer's reuse. `logprobs`
    "loss" recovers only the positions the objective weighs (others NaN), so the LM head
    skips prompt and tool-output rows; loss and gradients are unchanged. `entropy` reports
    `StepResult.entropy` (the trained positions' entropy, reduced as the loss is; also on
    when `LossConfig.entropy_coef` > 0 weighs it into the objective). `device_timing` waits for the device
    at every clock read, so `StepResult.microbatch_seconds` and `producer_seconds` time each consumer and
    window producer on a GPU (host time otherwise; results are the same, the step a little slower).

    `loss` is a built-in's name, a `LossConfig`, or your own objective: a callable
    (logprobs, inputs: PositionMeta) -> this microbatch's share of the step objective
    (shorthand for `LossConfig(kind="custom", objective=...)`; docs/integration.md#custom-objectives).

    `loss="value"` (or `LossConfig(kind="value", value_clip=0.2)`) trains a critic on the same plan: `model`
    is the critic (a `*ForTokenClassification` with one label, or any supported model with `value_head`, a
    module [rows, hidden] -> [rows, 1], run once per compact row); `returns`, and with `value_clip`
    `old_values`, give one float per token of every trajectory, as a dict keyed by id (str(id), as
    `StepResult.logprobs` is) or a list in the plan's trajectory order, read where loss_mask is 1 (index 0
    and masked positions may be NaN; with backward=False `returns` may be left out, for the values alone);
    `StepResult.values` holds the values, aligned as log-probabilities are (docs/integration.md#a-critic)."""
    if isinstance(loss, str):
        config = LossConfig(kind=loss)
    elif isinstance(loss, LossConfig):
        config = loss
    elif callable(loss):
        config = LossConfig(kind="custom", objective=loss)
    else:
        raise UsageError(f"loss must be a loss name, a LossConfig or a callable objective, got "
                         f"{type(loss).__name__}; fix: pass e.g. loss='grpo' or loss=LossConfig(kind='ppo')")
    # Only a critic's targets are converted; given to another loss, run_step refuses them as they are.
    targets = {name: critic_targets(plan, given, name) if config.kind == VALUE and isinstance(plan, Plan) else given
               for name, given in (("returns", returns), ("old_values", old_values))}
    return run_step(plan, model, mode=mode, loss=config, backward=backward, recompute=recompute, windows=windows,
                    logprobs=logprobs, accumulate=accumulate, entropy=entropy, device_timing=device_timing,
                    value_head=value_head, **targets)
