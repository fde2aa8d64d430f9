"""Prefix-cost helpers for L1: the work C(M) of a microbatch, read off the LCP array.

Legend: N trajectories in lexicographic (sorted) order; a *position* is an
index into that order. `lengths[i]` is trajectory i's token count and
`lcp[i] = LCP(traj i-1, traj i)` with `lcp[0] = 0`, so for positions i < j
LCP(i, j) = min(lcp[i+1..j]). Suffixes: `_N` per position, `_LN` per
sparse-table level and position.

The cost of a microbatch M = {m_1 < ... < m_k} (Appendix A.1, "exact prefix
costs") is the size of its complete compact layout, i.e. the number of nodes
of the unique-prefix trie of its members:

    C(M) = |x_1| + sum_{i>=2} (|x_i| - LCP(x_{i-1}, x_i)).

Two facts make L1 cheap and are used throughout:
* for a contiguous run [s, e], C = lcp[s] + U[e+1] - U[s] with
  U = prefix sums of (lengths - lcp), so C(all) = U[N] = G;
* the LCP of x with its nearest member below (p) or above (q) is the largest
  LCP of x with any member, because LCP(x, .) never grows moving away from x.

Nothing here knows about microbatch counts, replicas or candidates; the pass
`compiler.passes.partition_microbatches` builds on these helpers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Larger than any real token count and safe to add a few int32 values to
# without overflowing int64: marks "no feasible value" in min-plus tables.
INFEASIBLE = np.int64(1) << 62


def floor_log2_table(n: int) -> np.ndarray:
    """int64[n + 1]: floor(log2(i)) for i >= 1 (entry 0 is unused and 0).

    frexp returns the exact binary exponent, so no float rounding can shift a
    power of two into the wrong level.
    """
    table = np.zeros(n + 1, dtype=np.int64)
    if n >= 1:
        _, exponent = np.frexp(np.arange(1, n + 1, dtype=np.float64))
        table[1:] = exponent.astype(np.int64) - 1
    return table


@dataclass(frozen=True, slots=True)
class RangeMin:
    """Sparse table answering min / leftmost-argmin over inclusive ranges in O(1).

    Level l at index i covers `values[i : i + 2**l]`; entries past the last
    full window are padding and are never read by a legal query.
    """

    values: np.ndarray      # int64[N], the array being queried
    min_LN: np.ndarray      # int64[L, N], min of each power-of-two window
    argmin_LN: np.ndarray   # int64[L, N], leftmost position of that min
    floor_log2: np.ndarray  # int64[N + 1], level to use for a window of each length

    @staticmethod
    def build(values: np.ndarray) -> "RangeMin":
        values = np.ascontiguousarray(values, dtype=np.int64)
        n = len(values)
        levels = max(1, int(n).bit_length())
        min_LN = np.full((levels, max(n, 1)), INFEASIBLE, dtype=np.int64)
        argmin_LN = np.zeros((levels, max(n, 1)), dtype=np.int64)
        min_LN[0, :n] = values
        argmin_LN[0, :n] = np.arange(n, dtype=np.int64)
        for level in range(1, levels):
            half = 1 << (level - 1)
            count = n - (1 << level) + 1
            if count <= 0:
                break
            left_min, right_min = min_LN[level - 1, :count], min_LN[level - 1, half:half + count]
            # Strict "<" keeps the left (smaller) position on ties: leftmost argmin.
            take_right = right_min < left_min
            min_LN[level, :count] = np.where(take_right, right_min, left_min)
            argmin_LN[level, :count] = np.where(take_right, argmin_LN[level - 1, half:half + count],
                                                argmin_LN[level - 1, :count])
        return RangeMin(values, min_LN, argmin_LN, floor_log2_table(n))

    def _windows(self, lo, hi):
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        level = self.floor_log2[hi - lo + 1]
        return level, lo, hi - (np.int64(1) << level) + 1

    def min(self, lo, hi) -> np.ndarray:
        """min(values[lo..hi]) elementwise; requires 0 <= lo <= hi < N."""
        level, left, right = self._windows(lo, hi)
        return np.minimum(self.min_LN[level, left], self.min_LN[level, right])

    def argmin(self, lo, hi) -> np.ndarray:
        """Leftmost position of min(values[lo..hi]) elementwise; requires 0 <= lo <= hi < N."""
        level, left, right = self._windows(lo, hi)
        left_pos, right_pos = self.argmin_LN[level, left], self.argmin_LN[level, right]
        return np.where(self.values[right_pos] < self.values[left_pos], right_pos, left_pos)


def validate_sorted_lcp(lengths, lcp) -> tuple[np.ndarray, np.ndarray]:
    """Return (lengths, lcp) as int64 arrays or raise ValueError naming what is inconsistent.

    These arrays come from the trie pass, not from a user, so a violation is a
    programming error (ValueError), not a PassFailedError.
    """
    lengths = np.asarray(lengths)
    lcp = np.asarray(lcp)
    if lengths.ndim != 1 or lcp.shape != lengths.shape:
        raise ValueError(f"lengths and lcp must be 1-D of equal length, got {lengths.shape} and {lcp.shape}")
    if lengths.size and not (np.issubdtype(lengths.dtype, np.integer) and np.issubdtype(lcp.dtype, np.integer)):
        raise ValueError(f"lengths and lcp must be integer arrays, got {lengths.dtype} and {lcp.dtype}")
    lengths = lengths.astype(np.int64, copy=False)
    lcp = lcp.astype(np.int64, copy=False)
    if lengths.size == 0:
        return lengths, lcp
    if lengths.min() < 1:
        raise ValueError(f"every trajectory needs at least one token, got min length {lengths.min()}")
    if lcp[0] != 0:
        raise ValueError(f"lcp[0] must be 0 (no predecessor), got {lcp[0]}")
    if lcp.min() < 0:
        raise ValueError(f"lcp must be >= 0, got {lcp.min()}")
    bound = np.minimum(lengths[:-1], lengths[1:])
    bad = np.flatnonzero(lcp[1:] > bound)
    if bad.size:
        i = int(bad[0]) + 1
        raise ValueError(f"lcp[{i}] = {lcp[i]} exceeds min(lengths[{i - 1}], lengths[{i}]) = {bound[i - 1]}")
    # In lexicographic order a strict prefix sorts *before* its extensions, so
    # trajectory i can be a prefix of i-1 only when the two are identical.
    bad = np.flatnonzero((lcp[1:] == lengths[1:]) & (lengths[:-1] != lengths[1:]))
    if bad.size:
        i = int(bad[0]) + 1
        raise ValueError(f"trajectory {i} is a strict prefix of trajectory {i - 1} but sorts after it: "
                         f"the input is not in lexicographic order")
    return lengths, lcp


@dataclass(frozen=True, slots=True)
class PrefixCostModel:
    """Everything needed to price microbatches of one step's sorted trajectories."""

    lengths: np.ndarray          # int64[N]
    lcp: np.ndarray              # int64[N], lcp[0] == 0
    lcp_min: RangeMin            # range minimum over lcp: LCP(i, j) = lcp_min.min(i + 1, j)
    unique_prefix_sum: np.ndarray  # int64[N + 1], U[i] = sum_{j < i}(lengths[j] - lcp[j])
    # The prefix every trajectory of the step shares (a scaffold prompt), min(lcp[1:]); 0 for N < 2.
    shared_depth: int
    # Trees: maximal runs of positions with LCP > shared_depth to their neighbour. Position i's tree is
    # [tree_start[i], tree_stop[i]); a position outside it shares exactly shared_depth tokens with i (the
    # step-wide prompt alone, or nothing), so a step whose every rollout starts from one prompt still
    # splits into its tasks' trees.
    tree_start: np.ndarray       # int64[N]
    tree_stop: np.ndarray        # int64[N]

    @staticmethod
    def build(lengths, lcp) -> "PrefixCostModel":
        lengths, lcp = validate_sorted_lcp(lengths, lcp)
        unique = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths - lcp, out=unique[1:])
        n = len(lengths)
        index = np.arange(n, dtype=np.int64)
        shared_depth = int(lcp[1:].min()) if n > 1 else 0
        roots = lcp <= shared_depth   # lcp[0] == 0: position 0 starts the first tree
        tree_start = np.maximum.accumulate(np.where(roots, index, 0)) if n else index
        # The next root after i (n past the last): the reversed running minimum of root indices.
        next_root = np.append(np.where(roots, index, n)[1:], n)
        tree_stop = np.minimum.accumulate(next_root[::-1])[::-1] if n else index
        return PrefixCostModel(lengths, lcp, RangeMin.build(lcp), unique, shared_depth, tree_start, tree_stop)

    @property
    def num_trajectories(self) -> int:
        return len(self.lengths)

    @property
    def total_unique_tokens(self) -> int:
        """G = C(all trajectories): the node count of the step's global unique-prefix trie."""
        return int(self.unique_prefix_sum[-1])

    def lcp_between(self, i, j) -> np.ndarray:
        """LCP(i, j) for positions i < j (elementwise)."""
        return self.lcp_min.min(np.asarray(i) + 1, j)

    def neighbour_lcp(self, i, j) -> np.ndarray:
        """LCP(i, j) for i < j, and 0 where a neighbour is missing (i < 0 or j >= N)."""
        i = np.asarray(i, dtype=np.int64)
        j = np.asarray(j, dtype=np.int64)
        n = self.num_trajectories
        present = (i >= 0) & (j < n)
        # Route missing neighbours to a harmless legal query, then zero them.
        lo = np.where(present, i + 1, 0)
        hi = np.where(present, j, 0)
        return np.where(present, self.lcp_min.min(lo, hi), 0)

    def cost(self, members) -> int:
        """C(M) for sorted, distinct positions `members` (empty -> 0)."""
        members = np.asarray(members, dtype=np.int64)
        if members.size == 0:
            return 0
        shared = self.lcp_between(members[:-1], members[1:]).sum() if members.size > 1 else 0
        return int(self.lengths[members].sum() - shared)

    def contiguous_cost(self, start, end) -> np.ndarray:
        """C([start..end]) elementwise for start <= end: lcp[start] + U[end+1] - U[start]."""
        start = np.asarray(start, dtype=np.int64)
        end = np.asarray(end, dtype=np.int64)
        return self.lcp[start] + self.unique_prefix_sum[end + 1] - self.unique_prefix_sum[start]

    def earliest_feasible_start(self, capacity: int) -> np.ndarray:
        """int64[N]: for each end e, the smallest s with C([s..e]) <= capacity.

        C([s..e]) = U[e+1] - V[s] with V[s] = U[s] - lcp[s]; V is nondecreasing
        (V[s+1] - V[s] = lengths[s] - lcp[s+1] >= 0), so one searchsorted finds
        every window start. Requires every length <= capacity (then s = e fits).
        """
        v = self.unique_prefix_sum[:-1] - self.lcp
        return np.searchsorted(v, self.unique_prefix_sum[1:] - capacity, side="left").astype(np.int64)

    def insertion_delta(self, x, predecessor, successor) -> np.ndarray:
        """ΔC of inserting position x into a microbatch whose nearest members are p, q.

        Appendix A.1: ΔC = |x| - LCP(p, x) - LCP(x, q) + LCP(p, q), where a
        missing neighbour (p < 0, q >= N) contributes 0. Since p < x < q,
        LCP(p, q) = min(LCP(p, x), LCP(x, q)), so ΔC = |x| - max(LCP(p, x), LCP(x, q)):
        x shares exactly its longest prefix in common with any member.
        Broadcasts: x may be (P, 1) against neighbour arrays of shape (P, K).
        """
        x = np.asarray(x, dtype=np.int64)
        below = self.neighbour_lcp(predecessor, np.broadcast_to(x, np.shape(predecessor)))
        above = self.neighbour_lcp(np.broadcast_to(x, np.shape(successor)), successor)
        return self.lengths[x] - below - above + np.minimum(below, above)

    def lcp_to_all(self, x: int) -> np.ndarray:
        """int64[N]: LCP(x, i) for every position i (entry x holds |x|)."""
        row = np.empty(self.num_trajectories, dtype=np.int64)
        row[x] = self.lengths[x]
        if x > 0:
            row[:x] = np.minimum.accumulate(self.lcp[x:0:-1])[::-1]
        row[x + 1:] = np.minimum.accumulate(self.lcp[x + 1:])
        return row
