"""`harts check` catches every kind of broken plan, naming the invariant.

Run: `python -m pytest tests/test_check.py -q`. Each case breaks one thing in
a legal plan and expects the checker to name that invariant.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.schema.errors import VerificationError
from harts.schema.plan_invariants import check_plan, check_step_counts

B = 4
LISTS = [
    [1] * 9 + [2, 2, 2],          # forks at 9 (replay 1 from S_8) and on the boundary at 4
    [1] * 9 + [3, 3],
    [1] * 4 + [5, 5, 5, 5, 5],
    [1] * 4 + [5, 5, 5, 5, 5, 6],  # strict extension
    [1] * 4 + [5, 5, 5, 5, 5, 6],  # duplicate
    [8, 8, 8],
]


@pytest.fixture(scope="module")
def compiled():
    batch = TrajectoryBatch.from_token_lists(LISTS)
    plan = compile_batch(batch, CompileOptions(dp=1, capacity=64, chunk_size=B)).plan
    check_plan(plan, batch.tokens, batch.token_offsets)
    mb = plan.microbatches[0]
    assert len(mb["export_row"]) >= 1 and len(mb["replay_rows"]) >= 1, "the fixture must exercise handoff and replay"
    return batch, plan


def mutable(plan):
    plan = copy.deepcopy(plan)
    for mb in plan.microbatches:
        for key, value in mb.items():
            if isinstance(value, np.ndarray):
                mb[key] = value.copy()
    return plan


def first_replaying_sequence(mb):
    return int(np.flatnonzero(np.diff(mb["sequence_replay_offsets"]) > 0)[0])


def first_handoff_sequence(mb):
    return int(np.flatnonzero(mb["sequence_start_state"] >= 0)[0])


def break_capacity(plan, mb):
    plan.header["flags"]["capacity"] = len(mb["row_token"]) - 1


def break_token(plan, mb):
    mb["row_token"][len(mb["row_token"]) - 1] += 100


def break_multiplicity(plan, mb):
    mb["row_multiplicity"][0] += 1


def break_run(plan, mb):
    mb["run_length"][0] -= 1


def break_sharing(plan, mb):
    # Two rows with the same parent and token: a prefix that was not shared.
    parent, token = mb["row_parent"], mb["row_token"]
    fork = np.flatnonzero(np.bincount(parent[parent >= 0]) >= 2)[0]
    children = np.flatnonzero(parent == fork)
    token[children[1]] = token[children[0]]


def break_replay_length(plan, mb):
    q = first_replaying_sequence(mb)
    mb["sequence_start_position"][q] += B


def break_replay_rows(plan, mb):
    q = first_replaying_sequence(mb)
    mb["replay_rows"][mb["sequence_replay_offsets"][q]] = mb["sequence_row_start"][q] + 1


def break_export_chunk(plan, mb):
    mb["export_chunk"][0] += 1


def break_export_round(plan, mb):
    q = first_handoff_sequence(mb)
    producer = mb["export_sequence"][mb["sequence_start_state"][q]]
    mb["sequence_round"][producer] = mb["sequence_round"][q]
    rounds = np.maximum.accumulate(mb["sequence_round"])   # keep the tables consistent otherwise
    mb["sequence_round"][:] = rounds
    mb["num_rounds"] = int(rounds.max())
    mb["round_offsets"] = np.searchsorted(rounds, np.arange(1, rounds.max() + 2))


def break_start_state(plan, mb):
    q = first_handoff_sequence(mb)
    mb["sequence_start_state"][q] = -1


def break_grid(plan, mb):
    mb["replica"] = 1


def break_membership(plan, mb):
    # Trajectories 3 and 4 are identical, so only the membership count can tell.
    mb["member_trajectory"][mb["member_trajectory"] == 4] = 3


def break_segment_level(plan, mb):
    mb["segment_level"][-1] += 1


def break_segment_parent(plan, mb):
    child = int(np.flatnonzero(mb["segment_parent"] >= 0)[0])
    mb["segment_parent"][child] = -1


def break_member_range(plan, mb):
    mb["member_trajectory"][0] = plan.step["num_trajectories"]


def break_own_start_early(plan, mb):
    # A member claims a row an earlier member created: the row would be queried twice.
    j = int(np.flatnonzero(mb["member_own_start"] > 0)[0])
    mb["member_own_start"][j] -= 1


def break_own_start_late(plan, mb):
    # The last member gives up its first own row: nobody queries that row.
    lengths = np.diff(plan.step["token_offsets"])[mb["member_trajectory"]]
    j = int(np.flatnonzero(mb["member_own_start"] < lengths)[-1])
    mb["member_own_start"][j] += 1


def break_token_offsets(plan, mb):
    plan.step["token_offsets"] = plan.step["token_offsets"][:-2]


CASES = {
    "segment-level": (break_segment_level, "segment level"),
    "segment-parent": (break_segment_parent, "hangs below its parent segment"),
    "capacity": (break_capacity, "capacity"),
    "token": (break_token, "has its token"),
    "multiplicity": (break_multiplicity, "multiplicity counts occurrences"),
    "run": (break_run, "every semantic position maps to one row"),
    "sharing": (break_sharing, "identical prefixes share one row"),
    "replay-length": (break_replay_length, "nearest anchor"),
    "replay-rows": (break_replay_rows, "replay rows are the path before the sequence"),
    "export-chunk": (break_export_chunk, "chunk boundaries"),
    "export-round": (break_export_round, "exported in an earlier round"),
    "start-state": (break_start_state, "starts from the state after the row before its anchor"),
    "grid": (break_grid, "replica x slot grid"),
    "membership": (break_membership, "every trajectory is in exactly one microbatch"),
    # Damage that used to crash the checker with an IndexError: it reports instead.
    "member-range": (break_member_range, "members are trajectories of the step"),
    "token-offsets": (break_token_offsets, "token_offsets has one entry per trajectory"),
    # Damage `harts run` used to meet as a traceback in its attention views (found by fuzzing).
    "own-start-early": (break_own_start_early, "each row is created by exactly one member"),
    "own-start-late": (break_own_start_late, "each row is created by exactly one member"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_checker_names_the_broken_invariant(compiled, case):
    batch, plan = compiled
    broken = mutable(plan)
    breaker, words = CASES[case]
    breaker(broken, broken.microbatches[0])
    with pytest.raises(VerificationError) as info:
        check_plan(broken, batch.tokens, batch.token_offsets)
    assert words in str(info.value)


def test_stored_step_counts_are_recounted(compiled):
    """Found by a tools audit: `harts check` passed a plan whose stored trie_unique_tokens and
    l1_compact_tokens were wrong, and `harts stats` then printed a compression bound below the compression."""
    batch, plan = compiled
    # Sorted: 1^9 2^3, 1^9 3^2, 1^4 5^5, 1^4 5^5 6, the same again, 8^3; LCPs with the one before: 9, 4, 9, 10, 0.
    expected = sum(len(t) for t in LISTS) - (9 + 4 + 9 + 10)
    assert plan.step["trie_unique_tokens"] == expected
    check_step_counts(plan)
    broken = mutable(plan)
    broken.step["trie_unique_tokens"] = expected + 1
    with pytest.raises(VerificationError, match=f"the plan stores {expected + 1}, its trajectories have {expected}"):
        check_step_counts(broken)

    two_levels = TrajectoryBatch.from_token_lists(LISTS * 2)
    l2 = compile_batch(two_levels, CompileOptions(dp=2, capacity=24, chunk_size=B)).plan
    check_step_counts(l2)
    for wrong in (l2.step["trie_unique_tokens"] - 1, sum(len(t) for t in LISTS * 2) + 1):
        broken = mutable(l2)
        broken.step["l1_compact_tokens"] = wrong
        with pytest.raises(VerificationError, match="l1_compact_tokens lies between"):
            check_step_counts(broken)
