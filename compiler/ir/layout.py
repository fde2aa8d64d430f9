"""Compact layout of a set of trajectories: the prefix trie as compact rows.

Legend: k member trajectories (sorted lexicographically by tokens), C compact
rows, V segments, R path runs.

Rows are numbered in *creation order*: members are visited in sorted order and
each member appends the rows of its positions that no earlier member shares,
`[member_lcp[i], lengths[i])`. Because the members are sorted, a member's new
rows always hang below the path of the member just before it, which gives the
three facts everything else here relies on:

* every segment (maximal fork-free path) is a contiguous range of rows with
  consecutive depths, and its rows follow each other as parent -> child;
* a segment's parent segment has a smaller index (segment order is a
  pre-order, so reversed order is a post-order);
* each member's path is a short list of runs of consecutive rows
  (at most one run per member before it), never a per-token list.

Two positions of different members share a row exactly when the members have
identical tokens up to and including that position.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.schema.errors import VerificationError
from harts.schema.runs import expand_runs


@dataclass(frozen=True, slots=True)
class CompactLayout:
    """The compact rows, segments and position map of one set of trajectories.

    Invariants (see `verify`):
    * `row_parent[r] < r`, and -1 exactly for rows of depth 0;
    * `row_depth[r] == row_depth[row_parent[r]] + 1`;
    * segment v covers rows `[segment_row_start[v], segment_row_start[v + 1])`;
      its first row's parent is -1 or a row with >= 2 children, and every other
      row's parent is the row just before it with exactly one child;
    * member i's path is runs `[run_offsets[i], run_offsets[i + 1])`, each run
      rows `[run_row_start, run_row_start + run_length)` at consecutive depths,
      together covering depths `[0, lengths[i])` in order;
    * `row_multiplicity[r]` is the number of members whose path contains r.
    """

    trajectories: np.ndarray      # int64[k]: file index of each member, in sorted order
    lengths: np.ndarray           # int64[k]
    member_lcp: np.ndarray        # int64[k]: LCP with the previous member; 0 for the first
    row_token: np.ndarray         # int32[C]
    row_depth: np.ndarray         # int32[C]: original position in the trajectory
    row_parent: np.ndarray        # int32[C]: row of the previous position on the path, -1 at depth 0
    row_multiplicity: np.ndarray  # int32[C]: occurrence count q of the row among the members
    segment_row_start: np.ndarray  # int64[V + 1]
    segment_parent: np.ndarray    # int32[V]: parent segment, -1 for a root
    run_offsets: np.ndarray       # int64[k + 1]
    run_row_start: np.ndarray     # int64[R]
    run_length: np.ndarray        # int64[R]

    @property
    def num_rows(self) -> int:
        return len(self.row_token)

    @property
    def num_segments(self) -> int:
        return len(self.segment_parent)

    @property
    def segment_start_depth(self) -> np.ndarray:
        """s_v: depth of each segment's first row."""
        return self.row_depth[self.segment_row_start[:-1]].astype(np.int64)

    @property
    def segment_end_depth(self) -> np.ndarray:
        """e_v: one past the depth of each segment's last row."""
        return self.segment_start_depth + np.diff(self.segment_row_start)

    def member_rows(self, member: int) -> np.ndarray:
        """Row of every position of one member (position -> row map m); tests and tools only."""
        lo, hi = self.run_offsets[member], self.run_offsets[member + 1]
        return expand_runs(self.run_row_start[lo:hi], self.run_length[lo:hi])


def build_layout(token_offsets: np.ndarray, tokens: np.ndarray, trajectories: np.ndarray,
                 member_lcp: np.ndarray) -> CompactLayout:
    """Compact layout of `trajectories` (sorted lexicographically), given LCPs of neighbours.

    The work is numpy over rows; the only Python loop is over members, each
    step touching that member's few path runs.
    """
    trajectories = np.asarray(trajectories, dtype=np.int64)
    member_lcp = np.asarray(member_lcp, dtype=np.int64)
    lengths = (token_offsets[trajectories + 1] - token_offsets[trajectories]).astype(np.int64)
    own_length = lengths - member_lcp
    own_start = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(own_length, out=own_start[1:])
    num_rows = int(own_start[-1])

    rows = np.arange(num_rows, dtype=np.int64)
    depth_shift = np.repeat(member_lcp - own_start[:-1], own_length)
    row_depth = rows + depth_shift
    row_token = tokens[np.repeat(token_offsets[trajectories], own_length) + row_depth]
    row_parent = rows - 1

    # Runs per member: (row_start, depth_start, length). Member i's path is the
    # previous member's path cut at depth member_lcp[i] plus its own rows.
    run_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    run_starts: list[int] = []
    run_lengths: list[int] = []
    path: list[list[int]] = []   # [row_start, depth_start, length] of the current member
    for i in range(len(lengths)):
        keep = int(member_lcp[i])
        while path and path[-1][1] >= keep:
            path.pop()
        if path and path[-1][1] + path[-1][2] > keep:
            path[-1] = [path[-1][0], path[-1][1], keep - path[-1][1]]
        first_own = int(own_start[i])
        if own_length[i] > 0:
            if keep == 0:
                row_parent[first_own] = -1
            else:
                row_parent[first_own] = path[-1][0] + path[-1][2] - 1
            if path and path[-1][0] + path[-1][2] == first_own:
                # Strict-prefix extension: the new rows continue the last run.
                path[-1] = [path[-1][0], path[-1][1], path[-1][2] + int(own_length[i])]
            else:
                path.append([first_own, keep, int(own_length[i])])
        for run in path:
            run_starts.append(run[0])
            run_lengths.append(run[2])
        run_offsets[i + 1] = len(run_starts)
    run_row_start = np.asarray(run_starts, dtype=np.int64)
    run_length = np.asarray(run_lengths, dtype=np.int64)

    # Multiplicity: +1 over every run's rows, via a difference array.
    delta = np.bincount(run_row_start, minlength=num_rows + 1) - np.bincount(
        run_row_start + run_length, minlength=num_rows + 1)
    row_multiplicity = np.cumsum(delta[:num_rows])

    segment_row_start, segment_parent = segments_of(row_parent)

    return CompactLayout(
        trajectories=trajectories,
        lengths=lengths,
        member_lcp=member_lcp,
        row_token=row_token.astype(np.int32),
        row_depth=row_depth.astype(np.int32),
        row_parent=row_parent.astype(np.int32),
        row_multiplicity=row_multiplicity.astype(np.int32),
        segment_row_start=segment_row_start,
        segment_parent=segment_parent.astype(np.int32),
        run_offsets=run_offsets,
        run_row_start=run_row_start,
        run_length=run_length,
    )


def segments_of(row_parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segments of a row forest whose parents precede their children: (row_start[V + 1], parent[V]).

    A segment starts at a root, below a fork, or where a row's parent is not the
    row just before it; so every segment is a contiguous range of rows.
    """
    row_parent = np.asarray(row_parent, dtype=np.int64)
    num_rows = len(row_parent)
    # Roots and rows whose parent is not the row before them (row 0, a root, compares -1 with -1: set it too).
    segment_first = row_parent != np.arange(-1, num_rows - 1)
    segment_first[:1] = True
    # Below a fork: a row whose parent has another child. That other child cannot be the row after the parent,
    # so it is a jump row; marking the parents of jump rows marks every fork that has a child right after it.
    jump_parent = row_parent[np.flatnonzero(segment_first)]
    fork = np.zeros(num_rows, dtype=bool)
    fork[jump_parent[jump_parent >= 0]] = True
    segment_first[1:] |= fork[:-1]
    starts = np.flatnonzero(segment_first)
    segment_row_start = np.append(starts, num_rows).astype(np.int64)
    # A parent row's segment is the last segment starting at or before it (no per-row cumsum).
    first_parent = row_parent[starts]
    segment_parent = np.where(first_parent >= 0, np.searchsorted(starts, first_parent, side="right") - 1, -1)
    return segment_row_start, segment_parent


def verify_layout(layout: CompactLayout, token_offsets: np.ndarray, tokens: np.ndarray) -> None:
    """Check every invariant of `CompactLayout` against the source tokens."""
    C = layout.num_rows
    rows = np.arange(C)
    parent = layout.row_parent.astype(np.int64)
    if np.any(parent >= rows):
        raise VerificationError("row parent precedes row", "a row's parent is not an earlier row")
    roots = parent < 0
    if np.any(layout.row_depth[roots] != 0) or np.any(
            layout.row_depth[~roots] != layout.row_depth[parent[~roots]] + 1):
        raise VerificationError("parent is one position shallower", "row depths do not follow parents")
    starts = layout.segment_row_start
    if starts[0] != 0 or starts[-1] != C or np.any(np.diff(starts) <= 0):
        raise VerificationError("segments tile the rows", "segment row ranges are not a partition")
    child_count = np.bincount(parent[~roots], minlength=C)
    is_first = np.zeros(C, dtype=bool)
    is_first[starts[:-1]] = True
    inner = ~is_first
    if np.any(parent[inner] != rows[inner] - 1) or np.any(child_count[parent[inner]] != 1):
        raise VerificationError("segments are fork-free", "a segment's inner row is not the single child of the row before it")
    first_parent = parent[starts[:-1]]
    bad = (first_parent >= 0) & (child_count[np.maximum(first_parent, 0)] < 2)
    if np.any(bad):
        raise VerificationError("segments are maximal", f"segment {int(np.flatnonzero(bad)[0])} could be merged with its parent")
    coverage = np.zeros(C, dtype=np.int64)
    for i, traj in enumerate(layout.trajectories):
        m = layout.member_rows(i)
        src = tokens[token_offsets[traj]:token_offsets[traj + 1]]
        if len(m) != len(src):
            raise VerificationError("every position maps to a row", f"member {i} maps {len(m)} of {len(src)} positions")
        if np.any(layout.row_token[m] != src) or np.any(layout.row_depth[m] != np.arange(len(src))):
            raise VerificationError("row has the position's token and depth", f"member {i} (trajectory {int(traj)})")
        if len(m) > 1 and np.any(parent[m[1:]] != m[:-1]):
            raise VerificationError("path follows parents", f"member {i} (trajectory {int(traj)})")
        coverage[m] += 1
    if np.any(coverage != layout.row_multiplicity):
        raise VerificationError("multiplicity counts occurrences", "row_multiplicity differs from the member paths")
    if np.any(coverage == 0):
        raise VerificationError("no orphan rows", "a row belongs to no member's path")
