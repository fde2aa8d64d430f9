"""The step-level prefix trie: trajectories in sorted order and their neighbour LCPs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.compiler.ir.layout import CompactLayout


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
    * `layout` is the compact layout of all trajectories together: its row
      count is the number of unique trie tokens, the compression bound.
    """

    order: np.ndarray    # int64[N]
    lcp: np.ndarray      # int64[N]
    lengths: np.ndarray  # int64[N]
    layout: CompactLayout

    @property
    def unique_tokens(self) -> int:
        return self.layout.num_rows
