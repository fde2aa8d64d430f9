"""The step's trajectories as read from `trees.jsonl`, in file order.

Legend: N trajectories, S semantic positions (sum of trajectory lengths).
Per-token fields are flat arrays of length S; trajectory t owns
`[token_offsets[t], token_offsets[t + 1])`. Index 0 of every trajectory is
never a target; its per-token values are kept only to preserve alignment.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def never_read(loss_mask: np.ndarray | None, num_tokens: int) -> np.ndarray:
    """bool[num_tokens]: the positions of one trajectory no loss reads, index 0 and every loss_mask 0.

    Old and reference log-probabilities there may be missing or not finite (null, NaN, -inf, beyond
    float32: `harts run --logprobs-out` writes NaN at index 0, and with `--logprobs loss` at every
    untrained position); readers store 0.0, so a run's output passes back as the next step's input.
    """
    unread = np.zeros(num_tokens, dtype=bool) if loss_mask is None else np.asarray(loss_mask) == 0
    unread[0] = True
    return unread


# A log-probability is <= 0; samplers' rounding can leave a hair above it, a sign mistake leaves far more.
POSITIVE_LOGPROB_TOLERANCE = 1e-3


def positive_logprob_warnings(batch: "TrajectoryBatch") -> list[str]:
    """One line per RL field whose trained positions (loss_mask 1, index >= 1) hold log-probabilities above 0
    (beyond rounding): legal input, but almost always negative log-likelihoods or probabilities given by
    mistake, which would make every ppo/grpo ratio exp(logprob - old) vanish or explode without an error."""
    trained = batch.loss_mask.astype(bool)
    trained[batch.token_offsets[:-1]] = False
    lines = []
    for field in ("old_logprobs", "ref_logprobs"):
        values = getattr(batch, field)
        if values is None:
            continue
        positive = np.flatnonzero(trained & (values > POSITIVE_LOGPROB_TOLERANCE))   # NaN compares False
        if not len(positive):
            continue
        first = int(positive[0])
        t = int(np.searchsorted(batch.token_offsets, first, side="right") - 1)
        line = f", line {int(batch.lines[t])}" if batch.source != "<memory>" else ""
        lines.append(f"{field}: {len(positive)} trained positions hold a log-probability above 0 (largest "
                     f"{float(values[positive].max()):.4g}; first: trajectory {batch.ids[t]!r}{line}, index "
                     f"{first - int(batch.token_offsets[t])}); log-probabilities are <= 0: were negative "
                     "log-likelihoods or probabilities given?")
    return lines


@dataclass(frozen=True, slots=True)
class TrajectoryBatch:
    """Validated trajectories of one training step.

    Invariants (checked by the reader, relied on everywhere else):
    * `token_offsets` is int64, starts at 0, strictly increasing by >= 2;
    * `tokens` is int32 and >= 0; `loss_mask` is uint8 in {0, 1};
    * `advantages` is float32 and finite (a per-trajectory scalar is broadcast);
    * `old_logprobs` / `ref_logprobs` are float32 or None; positions of
      trajectories that did not provide them are NaN and `has_old_logprobs`
      / `has_ref_logprobs` say which did; a trajectory that did has finite
      values, 0.0 where it gave none a loss would read (`never_read`);
    * `ids` are unique; `lines` are the 1-based source line numbers.
    """

    source: str
    ids: tuple
    trees: tuple
    lines: np.ndarray
    token_offsets: np.ndarray
    tokens: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    old_logprobs: np.ndarray | None
    ref_logprobs: np.ndarray | None
    has_old_logprobs: np.ndarray
    has_ref_logprobs: np.ndarray

    @property
    def num_trajectories(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.token_offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.token_offsets[-1])

    def tokens_of(self, trajectory: int) -> np.ndarray:
        return self.tokens[self.token_offsets[trajectory]:self.token_offsets[trajectory + 1]]

    @staticmethod
    def from_token_lists(token_lists, *, ids=None, source: str = "<memory>", loss_masks=None,
                         advantages=None) -> "TrajectoryBatch":
        """Build a batch from in-memory lists (tests, the Python API). No RL logprobs."""
        n = len(token_lists)
        lengths = np.array([len(t) for t in token_lists], dtype=np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate([np.asarray(t, dtype=np.int32) for t in token_lists]) if n else np.zeros(0, np.int32)
        mask = (np.concatenate([np.asarray(m, dtype=np.uint8) for m in loss_masks])
                if loss_masks is not None else np.ones(len(flat), dtype=np.uint8))
        if advantages is None:
            adv = np.zeros(len(flat), dtype=np.float32)
        else:
            # Filled slice by slice, as read_trees does: np.repeat of per-trajectory values costs ~10 ns a token.
            adv = np.empty(len(flat), dtype=np.float32)
            values = np.asarray(advantages, dtype=np.float32).reshape(-1).tolist()
            if len(values) != n:
                raise ValueError(f"advantages: {len(values)} values for {n} trajectories; fix: give one per trajectory")
            for value, start, end in zip(values, offsets[:-1].tolist(), offsets[1:].tolist()):
                adv[start:end] = value
        return TrajectoryBatch(
            source=source,
            ids=tuple(ids if ids is not None else range(n)),
            trees=(None,) * n,
            lines=np.arange(1, n + 1, dtype=np.int64),
            token_offsets=offsets,
            tokens=flat,
            loss_mask=mask,
            advantages=adv,
            old_logprobs=None,
            ref_logprobs=None,
            has_old_logprobs=np.zeros(n, dtype=bool),
            has_ref_logprobs=np.zeros(n, dtype=bool),
        )
