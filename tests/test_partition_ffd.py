"""The OR-Tools+FFD comparison planner (`hartsc --planner ffd`): invariants, exactness, balance, CLI.

Run: `cd /work/main && python -m pytest tests/test_partition_ffd.py -q` (~30 s; CP-SAT runs single-threaded).
The planner is a baseline, so the tests pin what makes the comparison fair:
its plans are as legal as HARTS's (verify_partition, exact C(M) <= T, the
checker accepts them), its CP-SAT model is exact (it matches a brute force
over every set partition of small replicas), its sharding keeps FFD's
balance bound, and the same seed gives the same plan.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harts.compiler.cli import main as hartsc_main
from harts.compiler.passes import partition_ffd as ffd_module
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.passes.partition_ffd import (SHARD_UNITS, _best_cut, build_prefix_trie, ffd_shard, pack_replica,
                                                 partition_ffd, shard_replicas, subtree_shards)
from harts.compiler.passes.partition_microbatches import verify_partition
from harts.compiler.pipeline import CompileOptions, compile_batch
from harts.compiler.prefix_cost import PrefixCostModel
from harts.schema.errors import PassFailedError
from harts.schema.plan import encode_plan, read_plan
from harts.schema.plan_invariants import check_plan

from prefix_inputs import lengths_and_lcp, token_batches, trie_nodes

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- inputs and references


def set_partitions(items):
    """Every partition of `items` into non-empty blocks (Bell-number many; small inputs only)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for k in range(len(partition)):
            yield [*partition[:k], [first, *partition[k]], *partition[k + 1:]]


def random_step(seed: int, trees: int = 6, steps: int = 8, prompt: int = 40, turn: int = 30):
    """Stepwise rollouts: a shared prompt, then per tree a chain of growing trajectories."""
    rng = np.random.default_rng(seed)
    head = list(rng.integers(0, 50, prompt))
    lists = []
    for _ in range(trees):
        history = head + list(rng.integers(50, 100, rng.integers(5, 20)))
        for _ in range(steps):
            history = history + list(rng.integers(0, 100, rng.integers(turn // 2, turn)))
            lists.append(list(history))
    return lists


# --------------------------------------------------------------------------- the model's pieces


@SETTINGS
@given(token_batches(max_n=9), st.data())
def test_prefix_trie_weights_sum_to_the_exact_cost_of_every_member_set(sequences, data):
    """C(M) read off the replica trie (union of root paths) equals the distinct-prefix count of M."""
    lengths, lcp = lengths_and_lcp(sequences)
    trie = build_prefix_trie(lengths, lcp)
    assert trie.weight[0] == 0 and np.all(trie.weight[1:] >= 1)
    members = sorted(data.draw(st.sets(st.integers(0, len(sequences) - 1), min_size=1)))
    assert trie.cost(members) == trie_nodes([sequences[i] for i in members])


@settings(max_examples=60, deadline=None)
@given(token_batches(max_n=6), st.integers(0, 6))
def test_cpsat_packing_matches_brute_force_over_all_set_partitions(sequences, extra):
    """The model is exact: fewest microbatches, then least total work, over every partition with C(M) <= T."""
    lengths, lcp = lengths_and_lcp(sequences)
    capacity = int(lengths.max()) + extra
    best = None
    for partition in set_partitions(list(range(len(sequences)))):
        costs = [trie_nodes([sequences[i] for i in block]) for block in partition]
        if max(costs) <= capacity:
            key = (len(partition), sum(costs))
            best = key if best is None or key < best else best
    bin_of, status = pack_replica(PrefixCostModel.build(lengths, lcp), capacity, time_budget_s=20.0, seed=0,
                                  first_feasible=False)
    costs = [trie_nodes([sequences[i] for i in np.flatnonzero(bin_of == b)]) for b in range(bin_of.max() + 1)]
    assert max(costs) <= capacity
    assert (len(costs), sum(costs)) == best, status


@SETTINGS
@given(token_batches(min_n=2, max_n=9), st.data())
def test_least_lcp_cut_is_the_cheapest_two_way_split(sequences, data):
    lengths, lcp = lengths_and_lcp(sequences)
    model = PrefixCostModel.build(lengths, lcp)
    members = np.array(sorted(data.draw(st.sets(st.integers(0, len(sequences) - 1), min_size=2))))
    whole = model.cost(members)
    increase, cut = _best_cut(model, members)
    assert model.cost(members[:cut]) + model.cost(members[cut:]) - whole == increase
    for mask in range(1, 2 ** len(members) - 1):
        left = members[[(mask >> k) & 1 == 1 for k in range(len(members))]]
        right = np.setdiff1d(members, left)
        assert model.cost(left) + model.cost(right) - whole >= increase


# --------------------------------------------------------------------------- sharding


@SETTINGS
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=40), st.integers(1, 8))
def test_ffd_shard_keeps_the_list_scheduling_bound(lengths, dp):
    """D * max replica load <= S + (D - 1) * largest item: no replica exceeds the share by more than one item."""
    lengths = np.array(lengths, dtype=np.int64)
    replica_of = ffd_shard(lengths, dp)
    load = np.bincount(replica_of, weights=lengths, minlength=dp)
    assert replica_of.min() >= 0 and replica_of.max() < dp
    assert dp * load.max() <= lengths.sum() + (dp - 1) * lengths.max()


@SETTINGS
@given(token_batches(max_n=12), st.integers(1, 4))
def test_subtree_shards_are_subtrees_within_the_share_and_balanced_as_ffd(sequences, dp):
    lengths, lcp = lengths_and_lcp(sequences)
    model = PrefixCostModel.build(lengths, lcp)
    shard_of = subtree_shards(model, dp)
    share = -(-int(lengths.sum()) // dp)
    assert shard_of[0] == 0 and np.all(np.diff(shard_of) >= 0) and np.all(np.diff(shard_of) <= 1)  # contiguous runs
    size = np.bincount(shard_of, weights=lengths).astype(np.int64)
    single = np.bincount(shard_of) == 1
    assert np.all((size <= share) | single)
    # Cuts only where needed: the subtree just above each shard (the run around it whose neighbour
    # LCPs reach the shard's branch depth) holds more than the share.
    bounds = np.flatnonzero(np.diff(shard_of)) + 1
    starts, ends = np.append(0, bounds), np.append(bounds, len(lengths))  # [start, end)
    for start, end in zip(starts, ends):
        if len(starts) == 1:
            break
        depth = max(lcp[start], lcp[end] if end < len(lengths) else 0)
        while start > 0 and lcp[start] >= depth:
            start -= 1
        while end < len(lengths) and lcp[end] >= depth:
            end += 1
        assert lengths[start:end].sum() > share
    replica_of = shard_replicas(model, dp, "subtree")
    assert np.all(replica_of[1:][np.diff(shard_of) == 0] == replica_of[:-1][np.diff(shard_of) == 0])
    load = np.bincount(replica_of, weights=lengths, minlength=dp)
    assert dp * load.max() <= lengths.sum() + (dp - 1) * size.max()


# --------------------------------------------------------------------------- the pass


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_batches(max_n=9), st.integers(1, 3), st.integers(0, 8), st.booleans(), st.sampled_from(SHARD_UNITS))
def test_every_plan_verifies_with_exact_costs_within_capacity(sequences, dp, extra, first_feasible, shard):
    """verify_partition holds, each work is the distinct-prefix count of its members, and C(M) <= T."""
    lengths, lcp = lengths_and_lcp(sequences)
    capacity = int(lengths.max()) + extra
    try:
        partition = partition_ffd(lengths, lcp, capacity=capacity, dp=dp, time_budget_s=2.0, seed=0,
                                  first_feasible=first_feasible, shard=shard)
    except PassFailedError as err:
        # The only legal refusals: fewer trajectories than replicas, or fewer than D x (a replica's count).
        assert "DP replicas" in str(err) or "FFD sharding needs" in str(err)
        return
    verify_partition(lengths, lcp, partition, capacity, dp)
    for members, work in zip(partition.members, partition.work):
        assert work == trie_nodes([sequences[i] for i in members]) <= capacity
    assert not any("rejected" in line for line in partition.decisions)
    k = partition.num_microbatches
    assert np.array_equal(partition.slot, np.arange(k) // dp) and np.array_equal(partition.replica, np.arange(k) % dp)
    for r in range(dp):  # slots run from heaviest to lightest on every replica
        assert np.all(np.diff(partition.work[partition.replica == r]) <= 0)


def test_a_replica_short_of_trajectories_receives_one_from_a_replica_with_spares():
    # FFD under share 2: [1 1] fills replica 0, [2] and [3] both fit replica 1, replica 2 gets nothing.
    sequences = [[1, 1], [2], [3]]
    lengths, lcp = lengths_and_lcp(sequences)
    assert ffd_shard(lengths, 3).tolist() == [0, 1, 1]
    partition = partition_ffd(lengths, lcp, capacity=2, dp=3, time_budget_s=1.0, seed=0, first_feasible=False)
    verify_partition(lengths, lcp, partition, 2, 3)
    assert partition.num_microbatches == 3
    assert any("moved position" in line for line in partition.decisions)


def test_counts_are_aligned_by_splitting_the_heaviest_microbatch_at_its_cheapest_cut():
    # FFD under share 11: the two unrelated 5-token trajectories fill replica 0 and need two
    # microbatches at T = 8; the family of four fills replica 1 and fits one (C = 7), so it
    # must split, at its least-LCP cut (LCPs 2, 1, 2 between sorted neighbours).
    sequences = sorted([[8] * 5, [9] * 5, [1, 2, 3], [1, 2, 4], [1, 5, 6], [1, 5, 7]])
    lengths, lcp = lengths_and_lcp(sequences)
    assert ffd_shard(lengths, 2).tolist() == [1, 1, 1, 1, 0, 0]
    partition = partition_ffd(lengths, lcp, capacity=8, dp=2, time_budget_s=1.0, seed=0, first_feasible=False)
    verify_partition(lengths, lcp, partition, 8, 2)
    assert partition.num_microbatches == 4
    family = sorted(tuple(m.tolist()) for m, r in zip(partition.members, partition.replica) if r == 1)
    assert family == [(0, 1), (2, 3)]
    assert any("replica 1 split 1 microbatches" in line for line in partition.decisions)


def test_same_seed_gives_the_same_plan_even_when_the_budget_cuts_the_search():
    # The budget is CP-SAT deterministic time, so a search cut short stops at the same point every run.
    batch = TrajectoryBatch.from_token_lists(random_step(0, trees=12, steps=10))
    options = CompileOptions(dp=2, capacity=700, chunk_size=16, planner="ffd", ffd_time_budget=0.2,
                             ffd_shard="trajectory")
    first, second = compile_batch(batch, options), compile_batch(batch, options)
    assert encode_plan(first.plan) == encode_plan(second.plan)
    untimed = [re.sub(r" \(\d+\.\d+s\)$", "", line) for line in first.partition.decisions]
    assert untimed == [re.sub(r" \(\d+\.\d+s\)$", "", line) for line in second.partition.decisions]
    assert any("cp-sat feasible" in line for line in untimed)  # the budget, not optimality, ended a search


def test_a_replica_whose_model_is_too_large_keeps_its_next_fit_packing(monkeypatch):
    """Building the CP-SAT model costs time and memory outside the search budget (about 2 KB a variable): past
    FFD_MAX_VARIABLES a replica keeps the next-fit packing the model would have been hinted with, and says so."""
    batch = TrajectoryBatch.from_token_lists(random_step(0, trees=12, steps=10))
    options = CompileOptions(dp=2, capacity=700, chunk_size=16, planner="ffd", ffd_shard="trajectory")
    searched = compile_batch(batch, options)
    monkeypatch.setattr(ffd_module, "FFD_MAX_VARIABLES", 10)
    capped = compile_batch(batch, options)
    check_plan(capped.plan, batch.tokens, batch.token_offsets)
    assert sum("model too large" in line and "kept the next-fit packing" in line
               for line in capped.partition.decisions) == 2, capped.partition.decisions
    assert not any("model too large" in line for line in searched.partition.decisions)
    assert sum("model too large" in line for line in capped.decisions()) == 2   # what hartsc -v prints
    assert sum(len(mb["row_token"]) for mb in capped.plan.microbatches) >= \
        sum(len(mb["row_token"]) for mb in searched.plan.microbatches)


def test_a_trajectory_longer_than_capacity_is_a_clear_error():
    lengths, lcp = lengths_and_lcp([[1, 2, 3], [1, 2, 3, 4, 5]])
    with pytest.raises(PassFailedError, match="has 5 tokens, more than the microbatch capacity 4.*raise the capacity"):
        partition_ffd(lengths, lcp, capacity=4, dp=1, time_budget_s=1.0, seed=0, first_feasible=True)


def test_bad_ffd_options_are_refused_clearly():
    batch = TrajectoryBatch.from_token_lists([[1, 2], [1, 3]])
    for options, words in ((CompileOptions(planner="ffd", ffd_time_budget=0), "--ffd-time-budget"),
                           (CompileOptions(planner="ffd", ffd_shard="tree"), "--ffd-shard")):
        with pytest.raises(PassFailedError, match=words):
            compile_batch(batch, options)


# --------------------------------------------------------------------------- command line


def test_hartsc_planner_ffd_writes_a_plan_that_harts_check_accepts(tmp_path, capsys):
    from harts.cli import main as harts_main
    from harts.compiler.read_trees import read_trees

    trees = tmp_path / "trees.jsonl"
    trees.write_text("".join(json.dumps({"id": f"t{i}", "tokens": [int(x) for x in tokens]}) + "\n"
                             for i, tokens in enumerate(random_step(1, trees=4, steps=5))))
    plan_path = tmp_path / "step.plan"
    argv = [str(trees), "-o", str(plan_path), "--planner", "ffd", "--dp", "2", "--capacity", "500",
            "--chunk-size", "16", "--ffd-time-budget", "0.5", "--json", "-v"]
    assert hartsc_main(argv) == 0
    out = capsys.readouterr()
    assert "ffd shard=subtree cp-sat budget=0.5" in out.err
    stats = json.loads(out.out)
    assert stats["microbatches"] % 2 == 0 and stats["compact_tokens"] >= stats["trie_unique_tokens"]
    plan = read_plan(plan_path)
    assert plan.flags["planner"] == "ffd" and plan.flags["ffd_time_budget"] == 0.5
    batch = read_trees(trees)
    check_plan(plan, batch.tokens, batch.token_offsets)
    assert harts_main(["check", str(plan_path), "--trees", str(trees)]) == 0
    assert hartsc_main([*argv[:-2], "--ffd-first-feasible", "--ffd-shard", "trajectory"]) == 0
    check_plan(read_plan(plan_path), batch.tokens, batch.token_offsets)


def test_hartsc_planner_ffd_reports_an_overlong_trajectory_in_one_line(tmp_path, capsys):
    trees = tmp_path / "trees.jsonl"
    trees.write_text("".join(json.dumps(record) + "\n" for record in ({"id": "a", "tokens": [1, 2, 3]},
                                                                      {"id": "b", "tokens": [4] * 9})))
    assert hartsc_main([str(trees), "-o", str(tmp_path / "p.plan"), "--planner", "ffd", "--capacity", "8"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "capacity" in err and "Traceback" not in err
    assert not (tmp_path / "p.plan").exists()
