"""The step-level prefix trie: trajectories in sorted order and their neighbour LCPs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TrieIR:
    """Sorted order of the step's trajectories and the global prefix trie.

    Invariants:
    * `order` is a permutation of trajectory indices, sorted lexicographically
      by tokens (a strict prefix before its extensions; duplicates adjacent,
      ties by file order);
    * `lcp[0] == 0` and `lcp[i]` is the longest common prefix of sorted
      trajectories i-1 and i; for i < j, LCP(i, j) = min(lcp[i+1 .. j]);
    * `lengths[i]` is the length of sorted trajectory i;
    * `num_segments` is the number of maximal fork-free paths of the trie
      (the segments of the step's compact layout, `build_trie.global_layout`).

    The trie's rows are not materialised: its size is `unique_tokens`, and
    the passes only need `lengths` and `lcp`. A whole-step layout of a step
    with little sharing has as many rows as tokens (33M for a 40M-token GRPO
    step, ~6 s and GBs to build), so only tests and `--debug` build it.
    """

    order: np.ndarray    # int64[N]
    lcp: np.ndarray      # int64[N]
    lengths: np.ndarray  # int64[N]
    num_segments: int

    @property
    def unique_tokens(self) -> int:
        """Rows of the whole-step trie: every trajectory adds the tokens past its LCP with the previous one."""
        return int(self.lengths.sum() - self.lcp.sum())
