"""Attention views of one microbatch: which compact rows each query reads, as path runs.

A member trajectory that created rows (its *own* rows, positions
`own_start .. n - 1`) is one view: its queries are those own rows and its keys
are its whole path, positions `0 .. n - 1`. Members that created no row
(duplicates, strict prefixes of an earlier member) need no view, because a
row's attention output depends only on its ancestors, which are the same for
every member that shares the row. Every row is a query of exactly one view.

Paths are kept as runs of consecutive rows (the plan's own encoding), never as
a per-position list: the index arrays of a view scale with its runs, and the
ops expand one block of views at a time.

Legend: R compact rows, k members, M views (members with own rows),
P path runs of the views, B block token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts.schema.runs import expand_runs


def _as_int64(name: str, x, ndim: int = 1) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.ndim != ndim or (x.size and not np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"{name} must be a {ndim}-D integer array, got dtype {x.dtype} and shape {x.shape}")
    return x.astype(np.int64, copy=False)


@dataclass(frozen=True, slots=True, eq=False)
class AttentionViews:
    """Key paths and query rows of the members that created rows, in run form.

    Invariants (checked by `from_plan`):
    * view v's key path is runs `[view_run_offsets[v], view_run_offsets[v + 1])`,
      `view_length[v]` rows in all, whose row at position p has
      `row_position == p` and (for p > 0) `row_parent ==` the row at p - 1;
    * its query rows are the path's positions `view_query_start[v] .. n - 1`,
      a non-empty range;
    * over all views every row `0 .. R - 1` is a query exactly once, or, for
      views made by `with_queries`, every row with `query_slot[r] >= 0`
      exactly once (q and the output then hold only those rows, row r at
      `query_slot[r]`) and no other row.

    `eq=False`: equality is identity, since numpy fields do not compare to a bool.
    """

    num_rows: int               # R
    view_member: np.ndarray     # int64[M]: member index of the view inside the microbatch
    view_length: np.ndarray     # int64[M]: n, length of the key path
    view_query_start: np.ndarray  # int64[M]: own_start, first query position
    view_run_offsets: np.ndarray  # int64[M + 1]
    run_row_start: np.ndarray   # int64[P]
    run_length: np.ndarray      # int64[P], every run non-empty
    query_slot: np.ndarray | None = None  # int64[R]: row -> index in q/o, -1 if not queried; None: identity

    @property
    def num_views(self) -> int:
        return len(self.view_length)

    @property
    def num_queries(self) -> int:
        """Rows of q and of the output."""
        return self.num_rows if self.query_slot is None else int(np.count_nonzero(self.query_slot >= 0))

    def query_slots(self, lo: int, hi: int) -> np.ndarray:
        """Index into q/o of the query rows of views lo..hi-1 (`query_rows` order)."""
        rows = self.query_rows(lo, hi)
        return rows if self.query_slot is None else self.query_slot[rows]

    def with_queries(self, is_query: np.ndarray) -> "AttentionViews":
        """The same key paths with only the rows in `is_query` (bool[R]) as queries.

        A window consumer queries only the rows it computes; the rows a
        producer cached stay keys. Along every view's own rows the excluded
        rows must come first (cached rows are prefix-closed), so each view keeps
        a suffix of its queries; views left with none are dropped.
        """
        is_query = np.asarray(is_query, dtype=bool)
        if is_query.shape != (self.num_rows,):
            raise ValueError(f"is_query must be bool[R={self.num_rows}], got shape {is_query.shape}")
        own = self.query_rows(0, self.num_views)
        own_count = self.view_length - self.view_query_start
        view_of_own = np.repeat(np.arange(self.num_views), own_count)
        skipped = np.bincount(view_of_own[~is_query[own]], minlength=self.num_views)
        first = np.cumsum(own_count) - own_count
        position = np.arange(len(own)) - np.repeat(first, own_count)
        if np.any(is_query[own] != (position >= np.repeat(skipped, own_count))):
            raise ValueError("the rows left out of a view's queries must be a prefix of its own rows")
        keep = skipped < own_count
        offsets = self.view_run_offsets
        runs = expand_runs(offsets[:-1][keep], np.diff(offsets)[keep])
        view_run_offsets = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
        np.cumsum(np.diff(offsets)[keep], out=view_run_offsets[1:])
        slot = np.full(self.num_rows, -1, dtype=np.int64)
        slot[is_query] = np.arange(int(is_query.sum()))
        return AttentionViews(num_rows=self.num_rows, view_member=self.view_member[keep],
                              view_length=self.view_length[keep],
                              view_query_start=(self.view_query_start + skipped)[keep],
                              view_run_offsets=view_run_offsets, run_row_start=self.run_row_start[runs],
                              run_length=self.run_length[runs], query_slot=slot)

    @classmethod
    def from_microbatch(cls, microbatch: dict) -> "AttentionViews":
        """Views of one `plan.microbatches[i]` dict (schema v1 keys)."""
        return cls.from_plan(
            row_parent=microbatch["row_parent"],
            row_position=microbatch["row_position"],
            member_own_start=microbatch["member_own_start"],
            member_run_offsets=microbatch["member_run_offsets"],
            run_row_start=microbatch["run_row_start"],
            run_length=microbatch["run_length"],
        )

    @classmethod
    def from_plan(
        cls,
        row_parent,
        row_position,
        member_own_start,
        member_run_offsets,
        run_row_start,
        run_length,
    ) -> "AttentionViews":
        """Build and validate the views from a microbatch's plan arrays.

        Validation is O(R + runs + members), never per path position: a path is
        valid iff each run is a parent chain inside (one prefix count over
        rows), each run starts at the position where the previous run ended,
        and each run's first row hangs below the previous run's last row.
        """
        parent_R = _as_int64("row_parent", row_parent)
        position_R = _as_int64("row_position", row_position)
        own_start_k = _as_int64("member_own_start", member_own_start)
        offsets = _as_int64("member_run_offsets", member_run_offsets)
        starts_P = _as_int64("run_row_start", run_row_start)
        lengths_P = _as_int64("run_length", run_length)
        num_rows = len(parent_R)
        num_members = len(own_start_k)
        rows = np.arange(num_rows, dtype=np.int64)

        if len(position_R) != num_rows:
            raise ValueError(f"row_position must have R={num_rows} entries like row_parent, got {len(position_R)}")
        if np.any(parent_R >= rows) or np.any(parent_R < -1):
            bad = int(np.flatnonzero((parent_R >= rows) | (parent_R < -1))[0])
            raise ValueError(f"row_parent[r] must be -1 or < r, got row_parent[{bad}] = {int(parent_R[bad])}")
        roots = parent_R < 0
        expected_position = np.where(roots, 0, position_R[np.maximum(parent_R, 0)] + 1)
        if np.any(position_R != expected_position):
            bad = int(np.flatnonzero(position_R != expected_position)[0])
            raise ValueError(
                f"row_position must be 0 at roots and parent's + 1 elsewhere, got row_position[{bad}] = "
                f"{int(position_R[bad])} (expected {int(expected_position[bad])})"
            )
        if len(offsets) != num_members + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise ValueError(
                f"member_run_offsets must be k+1={num_members + 1} non-decreasing entries from 0, "
                f"got {len(offsets)} entries starting {offsets[:4].tolist()}"
            )
        if len(starts_P) != len(lengths_P) or offsets[-1] != len(starts_P):
            raise ValueError(
                f"run_row_start ({len(starts_P)}) and run_length ({len(lengths_P)}) must both have "
                f"member_run_offsets[-1]={int(offsets[-1])} entries"
            )
        if np.any(lengths_P < 1) or np.any(starts_P < 0) or np.any(starts_P + lengths_P > num_rows):
            raise ValueError(f"every run must be non-empty and inside rows [0, {num_rows})")

        # Per member: path length and run positions (run-level, not token-level).
        member_of_run = np.repeat(np.arange(num_members), np.diff(offsets))
        length_k = np.bincount(member_of_run, weights=lengths_P, minlength=num_members).astype(np.int64)
        run_end_cum = np.cumsum(lengths_P)
        member_base = np.concatenate(([0], run_end_cum))[offsets[:-1]]
        run_position_P = run_end_cum - lengths_P - member_base[member_of_run]  # position of each run's first row
        if np.any((own_start_k < 0) | (own_start_k > length_k)):
            bad = int(np.flatnonzero((own_start_k < 0) | (own_start_k > length_k))[0])
            raise ValueError(
                f"member_own_start must be in [0, n], got {int(own_start_k[bad])} for member {bad} of length "
                f"{int(length_k[bad])}"
            )

        # Inside a run each row's parent is the row before it: count chain breaks by prefix sums.
        chained = np.concatenate(([0], np.cumsum(parent_R[1:] == rows[1:] - 1))) if num_rows else np.zeros(1, np.int64)
        links = chained[starts_P + lengths_P - 1] - chained[starts_P]
        if np.any(links != lengths_P - 1):
            bad = int(np.flatnonzero(links != lengths_P - 1)[0])
            raise ValueError(f"run {bad} (rows {int(starts_P[bad])}+{int(lengths_P[bad])}) is not a parent chain")
        first_of_member = np.zeros(len(starts_P), dtype=bool)
        first_of_member[offsets[:-1][np.diff(offsets) > 0]] = True
        previous_last = np.concatenate(([-1], starts_P[:-1] + lengths_P[:-1] - 1))
        expected_parent = np.where(first_of_member, -1, previous_last)
        if np.any(parent_R[starts_P] != expected_parent) or np.any(position_R[starts_P] != run_position_P):
            bad = int(np.flatnonzero((parent_R[starts_P] != expected_parent)
                                     | (position_R[starts_P] != run_position_P))[0])
            raise ValueError(
                f"run {bad} of member {int(member_of_run[bad])} does not continue its path "
                f"(row {int(starts_P[bad])} has parent {int(parent_R[starts_P[bad]])}, position "
                f"{int(position_R[starts_P[bad]])}; expected {int(expected_parent[bad])}, {int(run_position_P[bad])})"
            )

        has_view = own_start_k < length_k
        view_member = np.flatnonzero(has_view).astype(np.int64)
        view_counts = np.diff(offsets)[view_member]
        keep_run = has_view[member_of_run]
        view_run_offsets = np.zeros(len(view_member) + 1, dtype=np.int64)
        np.cumsum(view_counts, out=view_run_offsets[1:])
        views = cls(
            num_rows=num_rows,
            view_member=view_member,
            view_length=length_k[view_member],
            view_query_start=own_start_k[view_member],
            view_run_offsets=view_run_offsets,
            run_row_start=np.ascontiguousarray(starts_P[keep_run]),
            run_length=np.ascontiguousarray(lengths_P[keep_run]),
        )
        if int((views.view_length - views.view_query_start).sum()) != num_rows:
            raise ValueError(
                f"own rows must cover every row once: members own {int((length_k - own_start_k).sum())} positions "
                f"for R={num_rows} rows"
            )
        counts = np.bincount(views.query_rows(0, views.num_views), minlength=num_rows)
        if np.any(counts != 1):
            bad = int(np.flatnonzero(counts != 1)[0])
            raise ValueError(
                f"every row must be created by exactly one member, row {bad} is created {int(counts[bad])} times"
            )
        return views

    # Expansion of a contiguous range of views [lo, hi): O(rows of those views).

    def key_rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows of the key paths of views lo..hi-1, concatenated (positions 0..n-1 each)."""
        a, b = self.view_run_offsets[lo], self.view_run_offsets[hi]
        return expand_runs(self.run_row_start[a:b], self.run_length[a:b])

    def query_rows(self, lo: int, hi: int) -> np.ndarray:
        """Own rows of views lo..hi-1, concatenated (positions own_start..n-1 each)."""
        a, b = self.view_run_offsets[lo], self.view_run_offsets[hi]
        lengths = self.run_length[a:b]
        view_of_run = np.repeat(np.arange(hi - lo), np.diff(self.view_run_offsets[lo:hi + 1]))
        run_end = np.cumsum(lengths)
        run_pos = run_end - lengths - np.concatenate(([0], run_end))[self.view_run_offsets[lo:hi] - a][view_of_run]
        # Clip every run to positions >= own_start of its view.
        skip = np.clip(self.view_query_start[lo:hi][view_of_run] - run_pos, 0, lengths)
        return expand_runs(self.run_row_start[a:b] + skip, lengths - skip)

    def blocks(self, block_tokens: int) -> list[tuple[int, int]]:
        """Greedy ranges of consecutive views whose key paths total <= block_tokens.

        A view longer than the budget is a block alone (the op then tiles its
        queries and keys). One Python step per view, none per token.
        """
        spans: list[tuple[int, int]] = []
        lo, total = 0, 0
        for v, n in enumerate(self.view_length.tolist()):
            if v > lo and total + n > block_tokens:
                spans.append((lo, v))
                lo, total = v, 0
            total += n
        if self.num_views:
            spans.append((lo, self.num_views))
        return spans
