"""The checker's member-path invariants against a position-by-position brute force.

Run: `python -m pytest tests/test_check_paths_reference.py -q` (a few seconds).
Why: `check_member_paths` reads runs, not positions (a paper-scale plan holds
~50M path positions), so its verdict rests on an argument (a path is valid iff
each run is a chain that continues the previous one). Here every member path
is expanded and walked position by position instead, on small compiled plans
(consumers and window producers) with one path-table entry damaged, and the
two must accept and reject the same plans.
"""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest

import harts.api as api
from harts.schema.errors import HartsError, VerificationError
from harts.schema.plan_invariants import check_member_paths
from harts.schema.plan_structure import validate_plan

PATH_FIELDS = ("run_row_start", "run_length", "member_run_offsets", "member_own_start", "row_parent", "row_position",
               "row_token")


def brute_force_paths_hold(record: dict, members: np.ndarray, lengths: np.ndarray, tokens: np.ndarray | None,
                           offsets: np.ndarray) -> bool:
    """Walk every position of every member: its row has its position (and token, given the tokens), follows the
    previous position's row, every row is on some path, and exactly one member creates each row (from
    member_own_start on)."""
    rows = len(record["row_token"])
    runs = record["member_run_offsets"]
    if len(runs) != len(members) + 1 or len(record["member_own_start"]) != len(members):
        return False
    on_path = np.zeros(rows, dtype=np.int64)
    created = np.zeros(rows, dtype=np.int64)
    for j, (trajectory, n) in enumerate(zip(members.tolist(), lengths.tolist())):
        path = []
        for r in range(runs[j], runs[j + 1]):
            if record["run_length"][r] < 1:
                return False
            path += range(record["run_row_start"][r], record["run_row_start"][r] + record["run_length"][r])
        if len(path) != n or any(not 0 <= row < rows for row in path):
            return False
        for position, row in enumerate(path):
            if record["row_position"][row] != position:
                return False
            if tokens is not None and record["row_token"][row] != tokens[offsets[trajectory] + position]:
                return False
            if position and record["row_parent"][row] != path[position - 1]:
                return False
            on_path[row] += 1
        own = int(record["member_own_start"][j])
        if not 0 <= own <= n:
            return False
        for row in path[own:]:
            created[row] += 1
    return bool(np.all(on_path > 0) and np.all(created == 1))


def random_plan(rng: random.Random):
    """A small two-level plan over prefix-sharing trajectories (often with window producers), and its tokens."""
    vocab = 6
    roots = [[rng.randrange(vocab) for _ in range(rng.randint(3, 12))] for _ in range(2)]
    lists = []
    for _ in range(rng.randint(2, 9)):
        base = rng.choice(roots + lists)
        lists.append(base[:rng.randint(1, len(base))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 8))])
    longest = max(map(len, lists))
    try:
        plan = api.compile_trajectories(lists, dp=rng.choice([1, 2]), capacity=rng.randint(longest, longest + 6),
                                        chunk_size=rng.choice([2, 4]))
    except (ValueError, HartsError):   # e.g. fewer trajectories than dp x microbatches need
        return None
    tokens = np.concatenate([np.asarray(t) for t in lists])
    return plan, tokens, plan.step["token_offsets"]


def members_of(plan, record) -> tuple[np.ndarray, np.ndarray]:
    offsets = plan.step["token_offsets"]
    if "member_trajectory" in record:
        members = np.asarray(record["member_trajectory"], dtype=np.int64)
        return members, offsets[members + 1] - offsets[members]
    return np.asarray(record["prefix_trajectory"], dtype=np.int64), np.asarray(record["prefix_length"], dtype=np.int64)


@pytest.mark.parametrize("with_tokens", [True, False], ids=["with-trees", "plan-alone"])
@pytest.mark.parametrize("seed", range(4))
def test_per_run_path_check_agrees_with_the_brute_force_on_damaged_plans(seed, with_tokens):
    """Without the input's tokens (`harts run`'s check) a damaged path that keeps every position legal can only
    be told by the path's structure; with them (`harts check --trees`) the tokens catch more."""
    rng = random.Random(seed)
    compared = rejected = producers = 0
    while compared < 120:
        made = random_plan(rng)
        if made is None:
            continue
        plan, tokens, offsets = made
        tokens = tokens if with_tokens else None
        producers += len(plan.producers or [])
        for record in plan.microbatches + (plan.producers or []):   # the compiled plan: both accept it
            members, lengths = members_of(plan, record)
            check_member_paths("record", record, members, lengths, plan.step, tokens)
            assert brute_force_paths_hold(record, members, lengths, tokens, offsets), seed
        for _ in range(10):
            damaged = copy.deepcopy(plan)
            record = rng.choice(damaged.microbatches + (damaged.producers or []))
            field = rng.choice([f for f in PATH_FIELDS if len(record[f])])
            values = np.array(record[field])
            values[rng.randrange(len(values))] += rng.choice([-2, -1, 1, 2])
            record[field] = values
            try:
                validate_plan(damaged, "damaged")   # what read_plan guarantees before any check runs
            except HartsError:
                continue
            # Rows must be legal first (the per-run check relies on "position 0 is a root"): skip those broken.
            parent, position = record["row_parent"].astype(np.int64), record["row_position"].astype(np.int64)
            roots = parent < 0
            if np.any(parent >= np.arange(len(parent))) or np.any(position[roots] != 0) or \
                    np.any(position[~roots] != position[parent[~roots]] + 1):
                continue
            members, lengths = members_of(damaged, record)
            try:
                check_member_paths("record", record, members, lengths, damaged.step, tokens)
                verdict = True
            except VerificationError:
                verdict = False
            assert verdict == brute_force_paths_hold(record, members, lengths, tokens, offsets), (seed, field)
            compared += 1
            rejected += not verdict
    # Damage is caught (one changed entry breaks a path); producers' paths are exercised too.
    assert rejected > compared // 2 and producers > 0, (rejected, compared, producers)


def hand_made_record(runs: list[list[tuple[int, int]]], own_start: list[int]) -> dict:
    """Rows of a small forest (position, parent): 0 (0, -1), 1 (1, 0), 2 (2, 1), 3 (1, 0), 4 (2, 3), 5 (3, 2);
    members are given as lists of (first row, length) runs."""
    flat = [run for member in runs for run in member]
    return {"row_token": np.array([1, 2, 3, 5, 6, 4]), "row_position": np.array([0, 1, 2, 1, 2, 3]),
            "row_parent": np.array([-1, 0, 1, 0, 3, 2]),
            "member_run_offsets": np.cumsum([0] + [len(member) for member in runs]),
            "run_row_start": np.array([start for start, _ in flat]), "run_length": np.array([n for _, n in flat]),
            "member_own_start": np.array(own_start)}


@pytest.mark.parametrize("third_member, legal", [
    ([(0, 1), (3, 2)], True),     # a duplicate of the second member: rows 0, 3, 4
    ([(0, 2), (4, 1)], False),    # rows 0, 1, 4: row 4 has position 2 but does not hang below row 1
    ([(1, 2), (5, 1)], False),    # rows 1, 2, 5: a chain, but starting at position 1, not at a root
], ids=["duplicate", "continues-below-another-row", "starts-below-the-root"])
def test_damage_only_the_path_structure_reveals(third_member, legal):
    """Paths that keep every row covered and created once (what random damage rarely finds): the run-level
    checks of continuation and of the first run's position must reject them, as the brute force does."""
    record = hand_made_record([[(0, 3), (5, 1)], [(0, 1), (3, 2)], third_member], own_start=[0, 1, 3])
    members, lengths = np.array([0, 1, 2]), np.array([4, 3, 3])
    step = {"token_offsets": np.array([0, 4, 7, 10])}
    assert brute_force_paths_hold(record, members, lengths, None, step["token_offsets"]) == legal
    if legal:
        check_member_paths("record", record, members, lengths, step, None)
    else:
        with pytest.raises(VerificationError):
            check_member_paths("record", record, members, lengths, step, None)
