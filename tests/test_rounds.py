"""Minimum-call rounds and replay: the planner against an exhaustive search.

Run: `python -m pytest tests/test_rounds.py -q`. The brute force below knows
nothing of the T_in/T_pre recurrence: it searches every schedule of the
packed-call model (a sequence starts at the nearest anchor of its first
segment once that anchor state exists, then continues down one path), so an
agreeing round count means the planner is optimal, not merely consistent.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts.compiler.ir.layout import CompactLayout
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.passes.assign_rounds import assign_rounds, verify_rounds
from harts.compiler.passes.build_trie import build_trie, global_layout, verify_trie
from harts.compiler.passes.plan_replay import plan_replay


def layout_of(token_lists) -> CompactLayout:
    batch = TrajectoryBatch.from_token_lists(token_lists)
    trie = build_trie(batch)
    verify_trie(trie, batch)
    return global_layout(trie, batch)


def brute_force_rounds(layout: CompactLayout, chunk_size: int) -> int:
    """Fewest rounds over every legal schedule (exhaustive; small trees only)."""
    V = layout.num_segments
    parent = layout.segment_parent.tolist()
    s = layout.segment_start_depth.tolist()
    e = layout.segment_end_depth.tolist()

    def anchor_owner(u: int) -> int:
        """Segment whose rows include depth a(s_u) - 1 on u's path; -1 for the zero state."""
        anchor = s[u] // chunk_size * chunk_size
        if anchor == 0:
            return -1
        v = parent[u]
        while not (s[v] <= anchor - 1 < e[v]):
            v = parent[v]
        return v

    owner = [anchor_owner(u) for u in range(V)]
    full = frozenset(range(V))

    def transitions(done: frozenset):
        choices = []   # per segment: options among "skip", "start", "cont"
        for u in range(V):
            if u in done:
                choices.append(("done",))
                continue
            opts = ["skip"]
            if owner[u] == -1 or owner[u] in done:
                opts.append("start")
            if parent[u] >= 0 and parent[u] not in done:
                opts.append("cont")
            choices.append(tuple(opts))
        for pick in itertools.product(*choices):
            continued_parent = set()
            legal = True
            for u, how in enumerate(pick):   # parents precede children
                if how == "cont":
                    p = parent[u]
                    if pick[p] not in ("start", "cont") or p in continued_parent:
                        legal = False
                        break
                    continued_parent.add(p)
            chosen = {u for u, how in enumerate(pick) if how in ("start", "cont")}
            if legal and chosen:
                yield done | chosen

    frontier = {frozenset()}
    rounds = 0
    while full not in frontier:
        rounds += 1
        frontier = {nxt for done in frontier for nxt in transitions(done)}
        assert rounds <= V, "search did not converge"
    return rounds


token_lists = st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=14), min_size=1, max_size=6)


@st.composite
def forking_lists(draw, max_trajectories=7):
    """Trajectories that branch off earlier ones at random depths: deep trees with many forks."""
    lists = [draw(st.lists(st.integers(0, 3), min_size=2, max_size=12))]
    for _ in range(draw(st.integers(0, max_trajectories - 1))):
        base = lists[draw(st.integers(0, len(lists) - 1))]
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(0, 3), min_size=0 if cut >= 2 else 2 - cut, max_size=8))
        lists.append(base[:cut] + tail)
    return lists


trees = st.one_of(token_lists, forking_lists())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(trees, st.integers(1, 5))
def test_round_count_equals_exhaustive_search(lists, chunk_size):
    layout = layout_of(lists)
    if layout.num_segments > 8:
        return
    schedule = assign_rounds(layout, chunk_size)
    verify_rounds(layout, schedule)
    assert schedule.num_rounds == brute_force_rounds(layout, chunk_size)


@settings(max_examples=150, deadline=None)
@given(trees, st.integers(1, 6))
def test_replay_is_anchor_aligned_and_short(lists, chunk_size):
    """Every sequence starts at a(s), replays the < B path rows before s, and reads a state
    that a sequence of an earlier round exports after a whole number of chunks; the outputs tile the
    memory rows in sequence order."""
    layout = layout_of(lists)
    schedule = assign_rounds(layout, chunk_size)
    plan = plan_replay(layout, schedule)
    B = chunk_size
    parent_exec = {}
    for r in range(layout.num_rows):
        p = layout.row_parent[plan.row_of_exec[r]]
        parent_exec[r] = -1 if p < 0 else int(plan.exec_of_row[p])
    depth_exec = layout.row_depth[plan.row_of_exec]
    seen = np.zeros(layout.num_rows, dtype=int)
    for q in range(len(plan.sequence_round)):
        lo, n = plan.sequence_row_start[q], plan.sequence_num_rows[q]
        seen[lo:lo + n] += 1
        first_depth = int(depth_exec[lo])
        anchor = int(plan.sequence_start_depth[q])
        assert anchor == first_depth // B * B
        replay = plan.replay_rows[plan.sequence_replay_offsets[q]:plan.sequence_replay_offsets[q + 1]]
        assert len(replay) == first_depth - anchor < B
        assert list(depth_exec[replay]) == list(range(anchor, first_depth))
        state = plan.sequence_start_state[q]
        if anchor == 0:
            assert state == -1
        else:
            row = plan.export_row[state]
            assert depth_exec[row] == anchor - 1
            head = int(replay[0]) if len(replay) else int(lo)
            assert parent_exec[head] == row
            producer = plan.export_sequence[state]
            assert plan.sequence_round[producer] < plan.sequence_round[q]
    assert np.all(seen == 1), "every row is produced exactly once"
    # ... one sequence after another: the residual planner reads output i as memory row i.
    assert np.array_equal(plan.sequence_row_start, np.cumsum(plan.sequence_num_rows) - plan.sequence_num_rows)


def rounds_of(lists, B):
    layout = layout_of(lists)
    schedule = assign_rounds(layout, B)
    verify_rounds(layout, schedule)
    return schedule.num_rounds, plan_replay(layout, schedule)


def test_fork_on_chunk_boundary_needs_no_replay():
    # Fork at depth 4 == B: the side branch starts from the exported S_4 in round 2.
    rounds, plan = rounds_of([[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 3, 3]], 4)
    assert rounds == 2
    assert plan.replay_tokens == 0
    assert list(plan.export_chunk) == [1]


def test_fork_one_after_boundary_replays_one_token():
    rounds, plan = rounds_of([[1, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 3, 3]], 4)
    assert rounds == 2
    assert plan.replay_tokens == 1


def test_fork_before_first_boundary_starts_at_once_from_zero():
    # The root never reaches a boundary: both children start in round 1 from the zero state.
    rounds, plan = rounds_of([[1, 1, 1, 2, 2], [1, 1, 1, 3, 3]], 4)
    assert rounds == 1
    assert plan.replay_tokens == 3


def test_chain_of_short_segments_adds_no_round():
    # Forks at depths 5, 6, 7 within chunk [4, 8): each side child replays from S_4.
    lists = [[0] * 5 + [1, 1], [0] * 5 + [2, 1, 1], [0] * 5 + [2, 3, 1], [0] * 5 + [2, 3, 4]]
    rounds, _ = rounds_of(lists, 4)
    assert rounds == 2


def test_duplicates_and_strict_prefixes_share_rows():
    layout = layout_of([[5, 6, 7], [5, 6, 7], [5, 6], [5, 6, 7, 8]])
    assert layout.num_rows == 4
    assert layout.num_segments == 1
    assert list(layout.row_multiplicity) == [4, 4, 3, 1]
    assert rounds_of([[5, 6, 7], [5, 6, 7], [5, 6], [5, 6, 7, 8]], 2)[0] == 1


def test_deep_chain_of_boundary_forks_needs_a_round_per_level():
    # Each level forks exactly on a boundary with two equally deep children.
    B = 2
    lists = []
    for mask in range(8):
        seq = [9] * B
        for level in range(3):
            seq += [1 + ((mask >> level) & 1)] * B
        lists.append(seq)
    rounds, _ = rounds_of(lists, B)
    assert rounds == 4


@pytest.mark.parametrize("B", [1, 2, 3, 64])
def test_unrelated_trees_run_side_by_side(B):
    rounds, plan = rounds_of([[1, 2, 3], [4, 5, 6], [7, 8]], B)
    assert rounds == 1
    assert len(plan.sequence_round) == 3


def test_round_count_on_a_seeded_sweep_of_forking_trees():
    """1,500 seeded random forests (deeper than hypothesis tends to draw) against the exhaustive search."""
    rng = np.random.default_rng(7)
    checked = rounds_seen = 0
    for _ in range(1500):
        lists = [list(rng.integers(0, 3, rng.integers(2, 10)))]
        for _ in range(rng.integers(1, 7)):
            base = lists[rng.integers(len(lists))]
            cut = int(rng.integers(0, len(base) + 1))
            lists.append(base[:cut] + list(rng.integers(0, 3, max(2 - cut, int(rng.integers(0, 6))))))
        layout = layout_of(lists)
        if layout.num_segments > 8:
            continue
        B = int(rng.integers(1, 5))
        planned = assign_rounds(layout, B).num_rounds
        assert planned == brute_force_rounds(layout, B), (lists, B)
        checked += 1
        rounds_seen = max(rounds_seen, planned)
    assert checked > 1000 and rounds_seen >= 3
