"""A critic on the plan (loss 'value'): its value head and its per-position targets.

PPO's critic shares prefixes exactly as the policy does, so the runtime runs it
on the same plan: the value head reads the final hidden state of the row that
would score token i (value v_i is read before token i, aligned as
logprobs[i]), and the caller's returns and old values arrive per trajectory and
become flat float64 arrays over the step's positions, as the plan's own
per-token fields are. The loss itself is `losses.value_loss`.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from harts.executor.losses import VALUE, LossConfig
from harts.schema.errors import UsageError
from harts.schema.plan import Plan


def value_head_of(model, loss: LossConfig, value_head):
    """The module mapping final hidden states [R, D] to values, for loss 'value' (else None, and refuse a
    head given to a policy loss): `value_head`, or the model's own `score` behind its `dropout` (a
    `*ForTokenClassification` model with one label, as RL frameworks load critics)."""
    if loss.kind != VALUE:
        if value_head is not None:
            raise UsageError(f"value_head is read by loss 'value' only, not '{loss.kind}'; fix: pass "
                             "loss='value' to train a critic, or drop value_head")
        return None
    if value_head is None:
        score = getattr(model, "score", None)
        if not isinstance(score, torch.nn.Module):
            raise UsageError(f"loss 'value' needs a value head, and {type(model).__name__} has no score layer; "
                             "fix: pass value_head=torch.nn.Linear(hidden_size, 1) (trained with the model), or "
                             "load the critic with one label: harts.critic_class(model_type), or "
                             "harts.executor.models.critics.critic_from_policy(policy_dir)")
        dropout = getattr(model, "dropout", None)   # as the model's forward applies it before `score`
        return torch.nn.Sequential(dropout, score) if isinstance(dropout, torch.nn.Module) else score
    if not isinstance(value_head, torch.nn.Module):
        # A module's parameters are what run_step zeroes and all_reduce_result sums; a bare function's are not.
        raise UsageError(f"value_head must be a torch.nn.Module [R, D] -> [R, 1], got {type(value_head).__name__}; "
                         "fix: pass the head module itself, e.g. torch.nn.Linear(hidden_size, 1)")
    reference = next(model.parameters())
    for name, parameter in value_head.named_parameters():
        if parameter.dtype != reference.dtype or parameter.device != reference.device:
            raise UsageError(f"value_head's {name} is {parameter.dtype} on {parameter.device}, the model's "
                             f"parameters {reference.dtype} on {reference.device}; fix: "
                             "value_head.to(device=..., dtype=...) as the model")
    return value_head


def critic_targets(plan: Plan, per_trajectory, name: str) -> np.ndarray | None:
    """A critic's per-token input (`returns`, `old_values`) as one float64 array over the step's positions,
    trajectories in plan order; None when not given. Takes a mapping keyed by id or str(id) (an .npz as
    `harts run --logprobs-out` writes it), or a sequence in the plan's trajectory order; each entry one
    number per token. NaN is allowed here: `check_value_inputs` refuses it only where the loss reads it."""
    if per_trajectory is None:
        return None
    ids = [str(i) for i in plan.step["ids"]]
    lengths = np.diff(np.asarray(plan.step["token_offsets"], dtype=np.int64))
    if isinstance(per_trajectory, Mapping):   # np.load's NpzFile is one too
        given = {str(key): per_trajectory[key] for key in per_trajectory.keys()}
        missing = [i for i in ids if i not in given]
        if missing or len(given) != len(ids):
            unknown = sorted(set(given) - set(ids))
            what = f"no entry for id {missing[0]!r}" if missing else f"an entry for id {unknown[0]!r}, not in the plan"
            raise UsageError(f"{name} has {what}; fix: give one entry per trajectory of the plan, keyed by its id")
        entries = [given[i] for i in ids]
    elif isinstance(per_trajectory, (str, bytes)) or not hasattr(per_trajectory, "__iter__"):
        raise UsageError(f"{name} must be a dict keyed by id or a list with one entry per trajectory, got "
                         f"{type(per_trajectory).__name__}; fix: give one float per token of every trajectory")
    else:
        entries = list(per_trajectory)
        if len(entries) != len(ids):
            raise UsageError(f"{name}: {len(entries)} entries for {len(ids)} trajectories; fix: give one per "
                             "trajectory, in the plan's order (or a dict keyed by id)")
    arrays = []
    for key, entry, length in zip(ids, entries, lengths.tolist()):
        if isinstance(entry, torch.Tensor):
            entry = entry.detach().cpu().double().numpy()
        try:
            array = np.asarray(entry)
        except (TypeError, ValueError):   # ragged nesting
            array = np.asarray([None])
        if array.dtype.kind not in "iuf":
            raise UsageError(f"trajectory {key!r}: {name} holds {array.dtype} values, not numbers; fix: give "
                             f"{length} numbers, one per token (NaN where nothing is trained)")
        if array.ndim != 1 or len(array) != length:
            raise UsageError(f"trajectory {key!r}: {name} has shape {array.shape} but tokens has {length}; fix: "
                             f"give {length} numbers, one per token (NaN where nothing is trained)")
        arrays.append(array.astype(np.float64))
    return np.concatenate(arrays) if arrays else np.zeros(0)


def flat_targets(name: str, given, num_positions: int) -> np.ndarray | None:
    """A critic's per-position input as float64 over the step's flat positions, or None when not given."""
    if given is None:
        return None
    array = np.asarray(given, dtype=np.float64)
    if array.shape != (num_positions,):
        raise UsageError(f"{name} must hold one float per position of the step ({num_positions} in all, "
                         f"trajectories in plan order), got shape {array.shape}; fix: harts.api.run takes it per "
                         "trajectory and flattens it")
    return array


def head_values(head, hidden_RD: torch.Tensor) -> torch.Tensor:
    """The head's values [R] for hidden states [R, D]; one UsageError when it gives another shape."""
    out = head(hidden_RD)
    if out.dim() == 2 and out.shape[1] == 1:
        out = out[:, 0]
    if out.shape != hidden_RD.shape[:1]:
        raise UsageError(f"the value head maps hidden states {tuple(hidden_RD.shape)} to shape {tuple(out.shape)}; "
                         "fix: give a head with one output per row, [R, 1] or [R] (num_labels=1)")
    return out
