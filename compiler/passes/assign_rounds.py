"""Pass `assign-rounds`: the minimum number of sequential linear-attention calls.

Reads: a microbatch's `CompactLayout` and the chunk size B. Adds: a
`RoundSchedule` (for every segment its round and its direct continuation; the
sequences of each round). Afterwards every segment is produced in exactly one
round by exactly one sequence, every sequence starts from a state that is
ready before its round (zero, or an anchor state exported by an earlier
round), and the number of rounds is the minimum under the packed-call model of
`shared/design/minimum-call-model.md` (Section 3.3 of the paper):

    T_in(v)  = min_o max(T_in(o), 1 + max_{u != o} T_pre(u))
    T_pre(v) = max_u T_pre(u)   if a(e_v) == a(s_v)   else T_in(v)

with a(p) = B * floor(p / B) and leaves at 1. One post-order sweep computes the
values from each node's largest child values; one pre-order sweep recovers the
schedule. Both are O(segments); per-token work never happens here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.compiler.ir.layout import CompactLayout
from harts.schema.errors import VerificationError


@dataclass(frozen=True, slots=True)
class RoundSchedule:
    """Rounds of one microbatch.

    Invariants:
    * `segment_round[v]` in 1..num_rounds; a continuation runs in its parent's round;
    * `segment_next[v]` is -1 or a child of v; every non-root segment is either
      its parent's continuation or a sequence head (`segment_is_head`);
    * sequences are listed by (round, head segment), `sequence_round` ascending;
    * `num_rounds == max over roots of t_pre` (0 for an empty microbatch).
    """

    chunk_size: int
    t_pre: np.ndarray            # int32[V]
    t_in: np.ndarray             # int32[V]
    segment_round: np.ndarray    # int32[V]
    segment_next: np.ndarray     # int32[V]
    segment_is_head: np.ndarray  # bool[V]
    sequence_head: np.ndarray    # int32[Q]
    sequence_round: np.ndarray   # int32[Q]
    num_rounds: int


def children_lists(segment_parent: np.ndarray) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in range(len(segment_parent))]
    for v, p in enumerate(segment_parent.tolist()):
        if p >= 0:
            children[p].append(v)
    return children


def assign_rounds(layout: CompactLayout, chunk_size: int) -> RoundSchedule:
    B = chunk_size
    V = layout.num_segments
    parent = layout.segment_parent.tolist()
    start = layout.segment_start_depth.tolist()
    end = layout.segment_end_depth.tolist()
    # a(e_v) == a(s_v): no chunk boundary in (a(s_v), e_v], so v's children enter at v's own anchor.
    same_anchor = [e // B == s // B for s, e in zip(start, end)]
    children = children_lists(layout.segment_parent)

    t_pre = [1] * V
    t_in = [1] * V
    continuation = [-1] * V
    for v in range(V - 1, -1, -1):   # children have larger indices: reversed order is a post-order
        kids = children[v]
        if not kids:
            continue
        top = max(t_pre[u] for u in kids)
        tied = [u for u in kids if t_pre[u] == top]
        # Continue directly into a child with the largest T_pre, preferring one whose
        # T_in equals its T_pre (it does not need the extra round itself).
        best = next((u for u in tied if t_in[u] == top), tied[0])
        continuation[v] = best
        t_in[v] = top + 1 if len(tied) >= 2 else t_in[best]
        t_pre[v] = top if same_anchor[v] else t_in[v]

    segment_round = [0] * V
    anchor_ready = [False] * V   # the entry anchor state is ready before the segment's round
    is_head = [False] * V
    for v in range(V):           # parents first
        if parent[v] < 0:
            segment_round[v], anchor_ready[v], is_head[v] = 1, True, True
        kids = children[v]
        if not kids:
            continue
        r, ready = segment_round[v], anchor_ready[v]
        shared_ready_anchor = ready and same_anchor[v]
        for u in kids:
            if u == continuation[v]:
                segment_round[u], anchor_ready[u] = r, shared_ready_anchor
            else:
                # A side child starts a new sequence from its anchor: this round if
                # that anchor was ready before it, else once this round has returned.
                segment_round[u] = r if shared_ready_anchor else r + 1
                anchor_ready[u], is_head[u] = True, True

    heads = [v for v in range(V) if is_head[v]]
    heads.sort(key=lambda v: (segment_round[v], v))
    rounds = np.asarray(segment_round, dtype=np.int32)
    return RoundSchedule(
        chunk_size=B,
        t_pre=np.asarray(t_pre, dtype=np.int32),
        t_in=np.asarray(t_in, dtype=np.int32),
        segment_round=rounds,
        segment_next=np.asarray(continuation, dtype=np.int32),
        segment_is_head=np.asarray(is_head, dtype=bool),
        sequence_head=np.asarray(heads, dtype=np.int32),
        sequence_round=rounds[np.asarray(heads, dtype=np.int64)] if heads else np.zeros(0, np.int32),
        num_rounds=int(rounds.max()) if V else 0,
    )


def verify_rounds(layout: CompactLayout, schedule: RoundSchedule) -> None:
    parent = layout.segment_parent
    roots = np.flatnonzero(parent < 0)
    expected = int(schedule.t_pre[roots].max()) if len(roots) else 0
    if schedule.num_rounds != expected:
        raise VerificationError("rounds attain the recurrence's minimum",
                                f"{schedule.num_rounds} rounds scheduled, T_pre(roots) = {expected}")
    nxt = schedule.segment_next
    has_next = np.flatnonzero(nxt >= 0)
    if np.any(parent[nxt[has_next]] != has_next):
        raise VerificationError("a continuation is a child", "segment_next points outside the children")
    if np.any(schedule.segment_round[nxt[has_next]] != schedule.segment_round[has_next]):
        raise VerificationError("a continuation runs in its parent's round", "continuation round differs")
    continued = np.zeros(layout.num_segments, dtype=bool)
    continued[nxt[has_next]] = True
    if np.any(continued == schedule.segment_is_head) :
        raise VerificationError("each segment is a head or a continuation, not both",
                                "a segment is both or neither")
