"""Compact layout (the prefix trie as rows): properties on random trees and golden cases.

Run: `python -m pytest tests/test_layout.py -q`.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.compiler.ir.layout import segments_of, verify_layout
from harts.schema.runs import expand_runs
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.passes.build_trie import build_trie, global_layout, verify_trie


def brute_force_rows(token_lists) -> int:
    """Unique prefixes = rows of a maximally shared trie."""
    return len({tuple(t[:i + 1]) for t in token_lists for i in range(len(t))})


trees = st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=20), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(trees)
def test_every_position_maps_to_exactly_one_row_with_its_token_and_depth(lists):
    batch = TrajectoryBatch.from_token_lists(lists)
    trie = build_trie(batch)
    verify_trie(trie, batch)   # includes verify_layout against the source tokens
    layout = global_layout(trie, batch)
    assert layout.num_rows == brute_force_rows(lists) == trie.unique_tokens
    assert trie.num_segments == layout.num_segments, "counted from lengths and LCPs alone"
    assert int(layout.row_multiplicity.sum()) == sum(len(t) for t in lists)
    # Two positions share a row exactly when their prefixes are identical.
    row_of_prefix = {}
    for member, traj in enumerate(layout.trajectories):
        rows = layout.member_rows(member)
        for i, row in enumerate(rows):
            prefix = tuple(lists[traj][:i + 1])
            assert row_of_prefix.setdefault(prefix, row) == row


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 5)), max_size=20))
def test_expand_runs_concatenates_aranges(runs):
    starts = np.array([s for s, _ in runs], dtype=np.int64)
    lengths = np.array([n for _, n in runs], dtype=np.int64)
    expected = [x for s, n in runs for x in range(s, s + n)]
    assert expand_runs(starts, lengths).tolist() == expected


def test_golden_small_forest():
    lists = [[1, 2, 3, 4], [1, 2], [1, 2, 3, 4], [1, 2, 5, 6, 7], [9, 9], [1, 2, 3, 4, 8]]
    batch = TrajectoryBatch.from_token_lists(lists)
    trie = build_trie(batch)
    L = global_layout(trie, batch)
    assert trie.order.tolist() == [1, 0, 2, 5, 3, 4]
    assert trie.lcp.tolist() == [0, 2, 4, 4, 2, 0]
    assert L.row_token.tolist() == [1, 2, 3, 4, 8, 5, 6, 7, 9, 9]
    assert L.row_depth.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 0, 1]
    assert L.row_parent.tolist() == [-1, 0, 1, 2, 3, 1, 5, 6, -1, 8]
    assert L.row_multiplicity.tolist() == [5, 5, 3, 3, 1, 1, 1, 1, 1, 1]
    # Segments: "1 2" forks into "3 4 8" and "5 6 7"; "9 9" is a second tree.
    assert L.segment_row_start.tolist() == [0, 2, 5, 8, 10]
    assert L.segment_parent.tolist() == [-1, 0, 0, -1]
    assert L.segment_start_depth.tolist() == [0, 2, 2, 0]
    assert L.segment_end_depth.tolist() == [2, 5, 5, 2]
    verify_layout(L, batch.token_offsets, batch.tokens)


def test_segment_count_ignores_empty_trajectories():
    """An empty trajectory adds no trie node, so no root (found by an audit; readers refuse them, the
    in-memory batch does not)."""
    for lists in ([[], [1, 2]], [[], [], [1, 2], [1, 3]], [[]]):
        batch = TrajectoryBatch.from_token_lists(lists)
        trie = build_trie(batch)
        assert trie.num_segments == global_layout(trie, batch).num_segments, lists


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=40))
def test_segments_of_matches_its_definition(choices):
    """A segment starts at a root, where a row's parent is not the row before it, or below a fork (a parent
    with two or more children); its parent is the segment holding the first row's parent."""
    parent = []
    for row, choice in enumerate(choices):   # parents precede children, mostly chains, some forks and roots
        parent.append(-1 if row == 0 or choice == 0 else row - 1 if choice > 4 else (17 * choice) % row)
    parent = np.asarray(parent, dtype=np.int64)
    children = np.bincount(parent[parent >= 0], minlength=len(parent))
    first = [row for row in range(len(parent))
             if parent[row] < 0 or parent[row] != row - 1 or children[parent[row]] >= 2]
    row_start, segment_parent = segments_of(parent)
    assert row_start.tolist() == first + [len(parent)]
    segment_of_row = np.repeat(np.arange(len(first)), np.diff(row_start))
    expected = [-1 if parent[row] < 0 else int(segment_of_row[parent[row]]) for row in first]
    assert segment_parent.tolist() == expected
