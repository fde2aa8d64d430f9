"""Pass `build-trie`: sort trajectories, neighbour LCPs, and the trie's size and segment count.

Reads: a `TrajectoryBatch`. Adds: a `TrieIR`. Afterwards the trajectories are
in lexicographic token order and every neighbour LCP is exact. The trie's
rows are counted, not built: `global_layout` builds them (the compact layout
mapping every semantic position to its unique trie row) for `--debug`, the
IR printer and tests.
"""
from __future__ import annotations

import numpy as np

from harts.compiler.ir.layout import CompactLayout, build_layout, verify_layout
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


def count_segments(lengths: np.ndarray, lcp: np.ndarray) -> int:
    """Maximal fork-free paths of the trie of sorted trajectories, from their lengths and neighbour LCPs.

    A segment starts at a root (a trajectory with lcp 0) or at a child of a
    node with two or more children. Trajectory i with c = lcp[i] > 0 leaves
    its predecessor's path below the depth-(c-1) node v; v is shared by the
    run of trajectories from a (the last s < i with lcp[s] < c) on, so (c, a)
    names v. Each such i with a token at depth c adds one child to v, and v
    has one more, the one its first leaver's predecessor continues into, when
    that predecessor is longer than c. One Python step per trajectory (the
    previous-smaller stack), the rest numpy.
    """
    lcp_list = lcp.tolist()
    run_start = np.empty(len(lcp_list), dtype=np.int64)
    stack: list[int] = []     # indices of strictly increasing lcp
    for i, c in enumerate(lcp_list):
        while stack and lcp_list[stack[-1]] >= c:
            stack.pop()
        run_start[i] = stack[-1] if stack else -1
        stack.append(i)
    roots = int(np.count_nonzero((lcp == 0) & (lengths > 0)))   # an empty trajectory adds no node
    leavers = np.flatnonzero(lcp > 0)
    if not leavers.size:
        return roots
    depth = lcp[leavers]
    # return_index: the first leaver of each node (leavers ascend).
    nodes, first, group = np.unique(np.stack([depth, run_start[leavers]], axis=1), axis=0,
                                    return_index=True, return_inverse=True)
    children = np.bincount(group.reshape(-1), weights=lengths[leavers] > depth, minlength=len(nodes)).astype(np.int64)
    children += lengths[leavers[first] - 1] > nodes[:, 0]
    return roots + int(children[children >= 2].sum())


def build_trie(batch: TrajectoryBatch) -> TrieIR:
    order = sort_trajectories(batch)
    lcp = neighbour_lcp(batch, order)
    lengths = batch.lengths[order].astype(np.int64)
    return TrieIR(order=order, lcp=lcp, lengths=lengths, num_segments=count_segments(lengths, lcp))


def global_layout(trie: TrieIR, batch: TrajectoryBatch) -> CompactLayout:
    """The compact layout of the whole step: one row per unique trie token (`trie.unique_tokens` rows)."""
    return build_layout(batch.token_offsets, batch.tokens, trie.order, trie.lcp)


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
    layout = global_layout(trie, batch)
    verify_layout(layout, batch.token_offsets, batch.tokens)
    if layout.num_rows != trie.unique_tokens or layout.num_segments != trie.num_segments:
        raise VerificationError("trie counts", f"{trie.unique_tokens} rows and {trie.num_segments} segments counted, "
                                               f"{layout.num_rows} and {layout.num_segments} built")
