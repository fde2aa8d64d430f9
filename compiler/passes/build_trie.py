"""Pass `build-trie`: sort trajectories, neighbour LCPs, and the global compact layout.

Reads: a `TrajectoryBatch`. Adds: a `TrieIR`. Afterwards the trajectories are
in lexicographic token order, every neighbour LCP is exact, and the global
layout maps every semantic position to its unique trie row.
"""
from __future__ import annotations

import numpy as np

from harts.compiler.ir.layout import build_layout, verify_layout
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.ir.trie import TrieIR
from harts.schema.errors import VerificationError


def sort_trajectories(batch: TrajectoryBatch) -> np.ndarray:
    """Trajectory indices in lexicographic token order, ties (duplicates) by file order.

    Big-endian unsigned bytes compare like the token sequences themselves, and
    a prefix's bytes sort before its extensions', so one `bytes` sort does it.
    """
    big_endian = batch.tokens.astype(">u4")
    offsets = batch.token_offsets
    keys = [(big_endian[offsets[t]:offsets[t + 1]].tobytes(), t) for t in range(batch.num_trajectories)]
    keys.sort()
    return np.fromiter((t for _, t in keys), dtype=np.int64, count=len(keys))


def neighbour_lcp(batch: TrajectoryBatch, order: np.ndarray) -> np.ndarray:
    """lcp[i] = LCP(order[i-1], order[i]), lcp[0] = 0: one vectorised compare per pair."""
    lcp = np.zeros(len(order), dtype=np.int64)
    for i in range(1, len(order)):
        a, b = batch.tokens_of(int(order[i - 1])), batch.tokens_of(int(order[i]))
        n = min(len(a), len(b))
        differ = np.flatnonzero(a[:n] != b[:n])
        lcp[i] = differ[0] if differ.size else n
    return lcp


def build_trie(batch: TrajectoryBatch) -> TrieIR:
    order = sort_trajectories(batch)
    lcp = neighbour_lcp(batch, order)
    layout = build_layout(batch.token_offsets, batch.tokens, order, lcp)
    return TrieIR(order=order, lcp=lcp, lengths=layout.lengths, layout=layout)


def verify_trie(trie: TrieIR, batch: TrajectoryBatch) -> None:
    if not np.array_equal(np.sort(trie.order), np.arange(batch.num_trajectories)):
        raise VerificationError("order is a permutation", "sorted order misses or repeats a trajectory")
    if trie.lcp[0] != 0 if len(trie.lcp) else False:
        raise VerificationError("first LCP is zero", f"lcp[0] = {int(trie.lcp[0])}")
    for i in range(1, len(trie.order)):
        a, b = batch.tokens_of(int(trie.order[i - 1])), batch.tokens_of(int(trie.order[i]))
        k = int(trie.lcp[i])
        n = min(len(a), len(b))
        if not np.array_equal(a[:k], b[:k]) or (k < n and a[k] == b[k]):
            raise VerificationError("LCP is exact", f"sorted neighbours {i - 1}, {i}")
        if k < n and a[k] > b[k] or (k == n and len(a) > len(b)):
            raise VerificationError("trajectories are sorted", f"sorted neighbours {i - 1}, {i}")
    verify_layout(trie.layout, batch.token_offsets, batch.tokens)
