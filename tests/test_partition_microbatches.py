"""L1 partition pass: invariants, exactness against brute force, golden tiny cases, errors.

Run: `cd /work/main && python -m pytest tests/test_partition_microbatches.py -q` (~20 s).
Inputs are built from real token sequences (sorted, lcp by comparison), so
they are always consistent. Slow references live here, beside the fast code
they check: a brute force over every contiguous partition, and a plain-loop
greedy that prices each insertion as C(M + x) - C(M) from token prefixes.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harts.compiler.passes.partition_microbatches import (
    GREEDY_ORDERS, L1Options, align_by_singleton_splits, candidate_counts, contiguous_evolve,
    contiguous_exact, contiguous_min_max, dense_lcp_table, eliminate_small_groups, greedy_candidates, greedy_fill,
    greedy_orders, initial_assignment, natural_partition, partition_microbatches, sample_counts, verify_partition)
from harts.compiler.prefix_cost import PrefixCostModel
from harts.schema.errors import PassFailedError, VerificationError

from prefix_inputs import lengths_and_lcp, token_batches, trie_nodes

SETTINGS = settings(max_examples=50, deadline=None)


# --------------------------------------------------------------------------- inputs and references


def brute_force_contiguous(sequences, capacity, k, score=sum):
    """The least score (of the list of group costs) over all feasible contiguous k-partitions, or None."""
    n = len(sequences)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        costs = [trie_nodes(sequences[a:b]) for a, b in zip(bounds, bounds[1:])]
        if max(costs) <= capacity and (best is None or score(costs) < best):
            best = score(costs)
    return best


def naive_greedy(sequences, capacity, order, rule):
    """Plain-loop greedy: microbatch id per position, same rules and tie-breaks as the fast one."""
    microbatches: list[list[int]] = []
    owner = [0] * len(sequences)
    for x in order:
        best, best_key = -1, None
        for m, members in enumerate(microbatches):
            before = trie_nodes([sequences[i] for i in members])
            after = trie_nodes([sequences[i] for i in sorted(members + [x])])
            if after > capacity:
                continue
            shared = len(sequences[x]) - (after - before)
            key = (shared, after) if rule == "max-shared" else (after,)
            if best_key is None or key > best_key:  # strict: the lowest index wins ties
                best, best_key = m, key
        if best < 0:
            microbatches.append([])
            best = len(microbatches) - 1
        microbatches[best].append(x)
        owner[x] = best
    return owner


def groups_from_starts(starts, n):
    bounds = list(starts) + [n]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def check_candidate(model, candidate_of, capacity, dp=None):
    """Every position in one microbatch, ids dense, every microbatch within capacity."""
    count = int(candidate_of.max()) + 1
    assert set(candidate_of.tolist()) == set(range(count))
    for m in range(count):
        assert model.cost(np.flatnonzero(candidate_of == m)) <= capacity
    if dp is not None:
        assert count % dp == 0


# --------------------------------------------------------------------------- properties


@SETTINGS
@given(token_batches(), st.data())
def test_every_result_satisfies_the_l1_invariants(sequences, data):
    """On any input the pass either returns a partition verify_partition accepts, or fails
    only because no multiple of dp non-empty microbatches can fit."""
    lengths, lcp = lengths_and_lcp(sequences)
    capacity = data.draw(st.integers(int(lengths.max()), trie_nodes(sequences) + 1))
    dp = data.draw(st.integers(1, len(sequences)))
    options = data.draw(st.sampled_from([L1Options(), L1Options(exact_max_cells=0), L1Options(greedy=False),
                                         L1Options(count_span=0, max_sampled_counts=1)]))
    try:
        partition = partition_microbatches(lengths, lcp, capacity=capacity, dp=dp, options=options)
    except PassFailedError as err:
        model = PrefixCostModel.build(lengths, lcp)
        natural = len(natural_partition(model, capacity))
        assert dp * -(-natural // dp) > len(sequences), str(err)
        return
    verify_partition(lengths, lcp, partition, capacity, dp)
    assert partition.work.sum() == partition.j_init[0]
    assert partition.decisions and partition.decisions[-1].startswith("selected")


@settings(max_examples=40, deadline=None)
@given(token_batches(max_n=9), st.data(), st.sampled_from([(contiguous_exact, sum), (contiguous_min_max, max)]))
def test_contiguous_searches_equal_brute_force(sequences, data, search_and_score):
    """The exact search's total and the min-max search's heaviest group, for every k, equal the least
    over all feasible contiguous k-partitions; a k is missing exactly when none fits."""
    search, score = search_and_score
    lengths, lcp = lengths_and_lcp(sequences)
    model = PrefixCostModel.build(lengths, lcp)
    n = len(sequences)
    capacity = data.draw(st.integers(int(lengths.max()), trie_nodes(sequences) + 1))
    found = search(model, capacity, range(1, n + 1))
    for k in range(1, n + 1):
        expected = brute_force_contiguous(sequences, capacity, k, score)
        if expected is None:
            assert k not in found, f"k={k} has no feasible contiguous partition"
            continue
        groups = groups_from_starts(found[k], n)
        assert len(groups) == k and all(groups)
        costs = [trie_nodes([sequences[i] for i in g]) for g in groups]
        assert max(costs) <= capacity
        assert score(costs) == expected, f"k={k}"


@SETTINGS
@given(token_batches(), st.data())
def test_scalable_search_is_feasible_and_never_beats_exact(sequences, data):
    lengths, lcp = lengths_and_lcp(sequences)
    model = PrefixCostModel.build(lengths, lcp)
    n = len(sequences)
    capacity = data.draw(st.integers(int(lengths.max()), trie_nodes(sequences) + 1))
    exact = contiguous_exact(model, capacity, range(1, n + 1))
    natural = natural_partition(model, capacity)
    assert min(exact) == len(natural), "greedy maximal filling has the fewest contiguous groups"
    # From P_0 (splits) and from all singletons (merges, the other direction).
    for start in (natural, np.arange(n)):
        evolved = contiguous_evolve(model, capacity, start, range(1, n + 1))
        for k, starts in evolved.items():
            assert len(starts) == k and starts[0] == 0 and np.all(np.diff(starts) > 0)
            work = model.contiguous_cost(starts, np.append(starts[1:] - 1, n - 1))
            assert work.max() <= capacity
            assert k in exact
            exact_work = model.contiguous_cost(exact[k], np.append(exact[k][1:] - 1, n - 1)).sum()
            assert work.sum() >= exact_work
    assert set(contiguous_evolve(model, capacity, natural, range(1, n + 1))) == set(range(len(natural), n + 1))


@SETTINGS
@given(token_batches(), st.data())
def test_greedy_fill_matches_plain_loop_reference(sequences, data):
    lengths, lcp = lengths_and_lcp(sequences)
    model = PrefixCostModel.build(lengths, lcp)
    capacity = data.draw(st.integers(int(lengths.max()), trie_nodes(sequences) + 1))
    orders = greedy_orders(model)
    names = [(order, rule) for order in GREEDY_ORDERS for rule in ("best-fit", "max-shared")]
    order_PN = np.stack([orders[order] for order, _ in names])
    max_shared = np.array([rule == "max-shared" for _, rule in names])
    # All eight at once read the neighbour table; the sorted and reverse-sorted orders alone read only each
    # microbatch's last member (greedy_fill picks by the orders' shape).
    monotone = [i for i, (order, _) in enumerate(names) if order in ("sorted", "reverse-sorted")]
    for group in (list(range(len(names))), monotone):
        for dense in (True, False):
            # A starting capacity of 1 microbatch exercises the array growth too.
            filled = greedy_fill(model, capacity, order_PN[group], max_shared[group], initial_capacity=1,
                                 dense_lcp=dense)
            for (order, rule), got in zip([names[i] for i in group], filled):
                assert got.tolist() == naive_greedy(sequences, capacity, orders[order].tolist(), rule), (order, rule)


@SETTINGS
@given(token_batches(), st.data())
def test_greedy_candidates_are_feasible_and_aligned(sequences, data):
    lengths, lcp = lengths_and_lcp(sequences)
    model = PrefixCostModel.build(lengths, lcp)
    capacity = data.draw(st.integers(int(lengths.max()), trie_nodes(sequences) + 1))
    dp = data.draw(st.integers(1, len(sequences)))
    for candidate in greedy_candidates(model, capacity, dp):
        check_candidate(model, candidate.microbatch_of, capacity, dp)
        count = int(candidate.microbatch_of.max()) + 1
        assert candidate.work.tolist() == [model.cost(np.flatnonzero(candidate.microbatch_of == m))
                                           for m in range(count)]


@SETTINGS
@given(token_batches(min_n=2), st.data())
def test_elimination_and_singleton_splits_keep_feasibility(sequences, data):
    lengths, lcp = lengths_and_lcp(sequences)
    model = PrefixCostModel.build(lengths, lcp)
    n = len(sequences)
    capacity = data.draw(st.integers(int(lengths.max()), trie_nodes(sequences) + 1))
    owner = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n)))
    owner = np.unique(owner, return_inverse=True)[1]  # dense ids
    assume(all(model.cost(np.flatnonzero(owner == m)) <= capacity for m in range(owner.max() + 1)))
    for max_shared in (False, True):
        fewer = eliminate_small_groups(model, capacity, owner, max_shared)
        check_candidate(model, fewer, capacity)
        assert fewer.max() <= owner.max()
    dp = data.draw(st.integers(1, n))
    before = sum(model.cost(np.flatnonzero(owner == m)) for m in range(owner.max() + 1))
    aligned = align_by_singleton_splits(model, owner, dp)
    if dp * -(-(owner.max() + 1) // dp) > n:
        assert aligned is None
        return
    check_candidate(model, aligned, capacity, dp)
    moved = np.flatnonzero(aligned != owner)
    assert np.all(aligned[moved] > owner.max()), "only moves into new singleton microbatches"
    after = sum(model.cost(np.flatnonzero(aligned == m)) for m in range(aligned.max() + 1))
    assert after - before <= sum(int(lengths[i]) for i in moved)


@SETTINGS
@given(st.lists(st.integers(1, 100), min_size=1, max_size=24), st.integers(1, 6))
def test_initial_assignment_fills_the_grid_and_reports_j_init(work, dp):
    work = np.array(work[:len(work) - len(work) % dp] or [1] * dp, dtype=np.int64)
    replica, slot, j_init = initial_assignment(work, dp)
    count = len(work)
    assert sorted(zip(replica.tolist(), slot.tolist())) == [(d, j) for d in range(dp) for j in range(count // dp)]
    per_slot = [work[slot == j] for j in range(count // dp)]
    assert all(a.min() >= b.max() for a, b in zip(per_slot, per_slot[1:])), "slots hold decreasing work"
    totals = [int(work[replica == d].sum()) for d in range(dp)]
    assert j_init == (int(work.sum()), sum(int(s.max()) for s in per_slot), max(totals))


@settings(max_examples=30, deadline=None)
@given(token_batches(min_n=2), st.data())
def test_winner_has_the_least_j_init_among_contiguous_candidates(sequences, data):
    lengths, lcp = lengths_and_lcp(sequences)
    model = PrefixCostModel.build(lengths, lcp)
    capacity = data.draw(st.integers(int(lengths.max()), trie_nodes(sequences) + 1))
    dp = data.draw(st.integers(1, len(sequences)))
    natural = natural_partition(model, capacity)
    counts = candidate_counts(model, capacity, dp, L1Options(), len(natural))
    assume(counts)
    partition = partition_microbatches(lengths, lcp, capacity=capacity, dp=dp,
                                       options=L1Options(objective="compression"))
    for k, starts in contiguous_exact(model, capacity, counts).items():
        work = model.contiguous_cost(starts, np.append(starts[1:] - 1, len(sequences) - 1))
        assert partition.j_init <= initial_assignment(work, dp)[2], f"k={k}"


def critical_path_first(j_init):
    total, critical_path, busiest = j_init
    return critical_path, total, busiest


@settings(max_examples=30, deadline=None)
@given(token_batches(min_n=2), st.data())
def test_step_time_winner_has_the_shortest_critical_path_among_contiguous_candidates(sequences, data):
    """Least (critical path, total, busiest replica) over the exact and min-max candidates of every
    Eq. A.4 count; and against the paper's objective on the same input, never a longer critical path
    and never less total work."""
    lengths, lcp = lengths_and_lcp(sequences)
    model = PrefixCostModel.build(lengths, lcp)
    n = len(sequences)
    capacity = data.draw(st.integers(int(lengths.max()), trie_nodes(sequences) + 1))
    dp = data.draw(st.integers(1, n))
    counts = candidate_counts(model, capacity, dp, L1Options(), len(natural_partition(model, capacity)))
    assume(counts)
    partition = partition_microbatches(lengths, lcp, capacity=capacity, dp=dp)
    for search in (contiguous_exact, contiguous_min_max):
        for k, starts in search(model, capacity, counts).items():
            work = model.contiguous_cost(starts, np.append(starts[1:] - 1, n - 1))
            assert critical_path_first(partition.j_init) <= critical_path_first(initial_assignment(work, dp)[2]), \
                f"{search.__name__} k={k}"
    paper = partition_microbatches(lengths, lcp, capacity=capacity, dp=dp, options=L1Options(objective="compression"))
    assert partition.j_init[1] <= paper.j_init[1] and partition.j_init[0] >= paper.j_init[0]


def comb(trunk: int, branch_lengths) -> list[list[int]]:
    """One rollout's trunk of distinct tokens and one branch per entry of `branch_lengths` forking off its end."""
    shared = list(range(trunk))
    return sorted(shared + [trunk + b] * length for b, length in enumerate(branch_lengths))


def test_one_prefix_spanning_the_step_is_spread_over_the_replicas():
    """The case the step-time objective exists for. Every microbatch holds the trunk, so with K >= D
    microbatches the critical path is at least the mean replica's work, >= trunk + branches / D. The
    paper's candidates keep the step in one microbatch beside D - 1 singletons: here every 8-way
    partition has the same total (8 trunks + the branches), and the least-total search breaks ties
    toward one, never reaching the balanced ones the min-max search adds."""
    rng = np.random.default_rng(0)
    branches = rng.integers(20, 60, size=400)
    trunk, dp = 2_000, 8
    lengths, lcp = lengths_and_lcp(comb(trunk, branches))
    bound = trunk + branches.sum() / dp
    step_time = partition_microbatches(lengths, lcp, capacity=65536, dp=dp)
    paper = partition_microbatches(lengths, lcp, capacity=65536, dp=dp, options=L1Options(objective="compression"))
    assert step_time.j_init[1] <= bound + branches.max(), (step_time.j_init, bound)
    assert paper.j_init[1] >= 3 * bound and sorted(len(m) for m in paper.members)[:dp - 1] == [1] * (dp - 1)
    assert paper.j_init[0] == step_time.j_init[0] == dp * trunk + branches.sum()
    assert step_time.candidate.startswith("contiguous-min-max")


def test_sample_counts_keeps_endpoints_and_dense_low_counts():
    counts = list(range(8, 8 * 101, 8))
    sampled = sample_counts(counts, 32)
    assert len(sampled) <= 32 and sampled[0] == counts[0] and sampled[-1] == counts[-1]
    assert sampled[:16] == counts[:16]
    assert sample_counts(counts[:5], 32) == counts[:5]


def test_dense_lcp_table_matches_pairwise_lcp():
    sequences = sorted([[1, 2, 3], [1, 2], [1, 2], [1, 3], [2], [2, 1, 1]])
    model = PrefixCostModel.build(*lengths_and_lcp(sequences))
    table = dense_lcp_table(model)
    assert table[:, 0].tolist() == [0] * 6 and table[:, -1].tolist() == [0] * 6
    for x in range(6):
        assert table[x, 1:7].tolist() == model.lcp_to_all(x).tolist()


# --------------------------------------------------------------------------- golden tiny cases


# Sorted: [1,2] [1,2] [1,2,3] [1,2,3,4] [5,6,7] -> lengths 2 2 3 4 3, lcp 0 2 2 3 0, G = 7.
# Duplicates and strict prefixes cost nothing beside their extension: the
# family {0, 1, 2, 3} is exactly 4 tokens, the capacity.
FAMILY = [[1, 2], [1, 2], [1, 2, 3], [1, 2, 3, 4], [5, 6, 7]]


def test_golden_duplicates_and_strict_prefixes_share_one_microbatch():
    lengths, lcp = lengths_and_lcp(FAMILY)
    assert lengths.tolist() == [2, 2, 3, 4, 3] and lcp.tolist() == [0, 2, 2, 3, 0]
    partition = partition_microbatches(lengths, lcp, capacity=4, dp=2)
    verify_partition(lengths, lcp, partition, 4, 2)
    assert [m.tolist() for m in partition.members] == [[0, 1, 2, 3], [4]]
    assert partition.work.tolist() == [4, 3]
    assert partition.replica.tolist() == [0, 1] and partition.slot.tolist() == [0, 0]
    assert partition.j_init == (7, 4, 4)
    assert partition.candidate == "contiguous-exact k=2"
    assert partition.members[0].dtype == np.int64 and partition.replica.dtype == np.int32


def test_golden_everything_fits_one_microbatch():
    lengths, lcp = lengths_and_lcp(FAMILY)
    partition = partition_microbatches(lengths, lcp, capacity=100, dp=1)
    assert [m.tolist() for m in partition.members] == [[0, 1, 2, 3, 4]]
    assert partition.work.tolist() == [7] and partition.j_init == (7, 7, 7)


def test_dp_larger_than_the_natural_count_forces_splits():
    lengths, lcp = lengths_and_lcp(FAMILY)
    partition = partition_microbatches(lengths, lcp, capacity=100, dp=4)
    verify_partition(lengths, lcp, partition, 100, 4)
    assert partition.num_microbatches == 4
    # Cutting at the lcp-0 boundary is free; the two other cuts cost the least
    # shared prefixes available (2 tokens each): 7 + 0 + 2 + 2.
    assert partition.j_init[0] == 11


def test_trajectory_exactly_at_capacity_is_accepted():
    sequences = sorted([[1] * 6, [1, 1, 2], [3, 3]])
    lengths, lcp = lengths_and_lcp(sequences)
    partition = partition_microbatches(lengths, lcp, capacity=6, dp=1)
    verify_partition(lengths, lcp, partition, 6, 1)
    assert 6 in partition.work.tolist()


def test_same_input_gives_the_same_partition():
    rng = np.random.default_rng(7)
    sequences = sorted(rng.integers(0, 3, size=int(rng.integers(1, 12))).tolist() for _ in range(60))
    lengths, lcp = lengths_and_lcp(sequences)
    first = partition_microbatches(lengths, lcp, capacity=20, dp=4)
    second = partition_microbatches(lengths.copy(), lcp.copy(), capacity=20, dp=4)
    assert first.candidate == second.candidate and first.decisions == second.decisions
    assert all(np.array_equal(a, b) for a, b in zip(first.members, second.members))
    for name in ("work", "replica", "slot"):
        assert np.array_equal(getattr(first, name), getattr(second, name))


def test_scalable_mode_names_its_candidates():
    rng = np.random.default_rng(3)
    sequences = sorted(rng.integers(0, 3, size=int(rng.integers(1, 12))).tolist() for _ in range(40))
    lengths, lcp = lengths_and_lcp(sequences)
    partition = partition_microbatches(lengths, lcp, capacity=16, dp=2,
                                       options=L1Options(exact_max_cells=0, greedy=False))
    verify_partition(lengths, lcp, partition, 16, 2)
    assert partition.candidate.startswith("contiguous-scalable k=")


# --------------------------------------------------------------------------- errors


def test_trajectory_longer_than_capacity_fails_with_a_fix():
    lengths, lcp = lengths_and_lcp(FAMILY)
    with pytest.raises(PassFailedError, match="more than the microbatch capacity 3; fix: raise the capacity to at least 4"):
        partition_microbatches(lengths, lcp, capacity=3, dp=1)


def test_fewer_trajectories_than_replicas_fails_with_a_fix():
    lengths, lcp = lengths_and_lcp(FAMILY)
    with pytest.raises(PassFailedError, match="5 trajectories cannot give each of 8 DP replicas.*fix: lower dp"):
        partition_microbatches(lengths, lcp, capacity=10, dp=8)
    with pytest.raises(PassFailedError, match="0 trajectories"):
        partition_microbatches(np.zeros(0, np.int64), np.zeros(0, np.int64), capacity=10, dp=1)


def test_no_aligned_count_fails_with_a_fix():
    # Three unrelated 5-token trajectories need three microbatches at T=6; with
    # dp=2 that means 4 non-empty microbatches out of 3 trajectories.
    sequences = [[1] * 5, [2] * 5, [3] * 5]
    lengths, lcp = lengths_and_lcp(sequences)
    with pytest.raises(PassFailedError, match="multiple of 2 non-empty microbatches.*fix:"):
        partition_microbatches(lengths, lcp, capacity=6, dp=2)


def test_bad_arguments_are_value_errors():
    lengths, lcp = lengths_and_lcp(FAMILY)
    with pytest.raises(ValueError, match="dp must be >= 1"):
        partition_microbatches(lengths, lcp, capacity=10, dp=0)
    with pytest.raises(ValueError, match="L1Options"):
        partition_microbatches(lengths, lcp, capacity=10, dp=1, options=L1Options(max_sampled_counts=0))
    with pytest.raises(ValueError, match="unknown L1 objective 'fast': use one of step-time, compression"):
        partition_microbatches(lengths, lcp, capacity=10, dp=1, options=L1Options(objective="fast"))


# --------------------------------------------------------------------------- verify_partition catches each break


def _good():
    lengths, lcp = lengths_and_lcp(FAMILY)
    return lengths, lcp, partition_microbatches(lengths, lcp, capacity=4, dp=2)


@pytest.mark.parametrize("invariant, breaks", [
    ("every trajectory is in exactly one microbatch",
     lambda p: dataclasses.replace(p, members=(p.members[0][:-1], p.members[1]), work=np.array([3, 3]))),
    ("every trajectory is in exactly one microbatch",
     lambda p: dataclasses.replace(p, members=(p.members[0], np.array([3, 4])), work=np.array([4, 7]))),
    ("every microbatch is non-empty",
     lambda p: dataclasses.replace(p, members=(p.members[0], np.array([], np.int64)))),
    ("C(M) <= capacity",
     lambda p: dataclasses.replace(p, members=(np.arange(5), np.array([], np.int64)))),
    ("K is a multiple of dp",
     lambda p: dataclasses.replace(p, members=(np.arange(5),), work=np.array([7]), replica=np.array([0], np.int32),
                                   slot=np.array([0], np.int32))),
    ("(replica, slot) pairs form the dp x K/dp grid",
     lambda p: dataclasses.replace(p, replica=np.array([0, 0], np.int32))),
    ("work equals C(M)", lambda p: dataclasses.replace(p, work=np.array([4, 2]))),
    ("one work/replica/slot entry per microbatch", lambda p: dataclasses.replace(p, work=np.array([4]))),
], ids=["missing", "twice", "empty", "capacity", "not-aligned", "grid", "work", "shapes"])
def test_verify_partition_names_the_broken_invariant(invariant, breaks):
    lengths, lcp, good = _good()
    verify_partition(lengths, lcp, good, 4, 2)
    # Breaks other than capacity use a roomy capacity so that only the intended invariant fails.
    capacity = 4 if invariant == "C(M) <= capacity" else 7
    with pytest.raises(VerificationError) as err:
        verify_partition(lengths, lcp, breaks(good), capacity, 2)
    assert err.value.invariant == invariant


def test_a_refusal_counts_the_greedy_plans_and_suggests_dps_that_work():
    """Sorted order needs 7 groups here, the greedy plans 6 (the 2-token trajectories pair up): dp 4 has no
    multiple in [6, 7], and every dp the message suggests then plans (found by a compiler fuzzer: the
    message said 'at least 7 are needed' and left out 2, 3 and 6)."""
    sequences = [[first, 9, 9] if first % 2 else [first, 9] for first in range(1, 8)]
    lengths, lcp = lengths_and_lcp(sequences)
    with pytest.raises(PassFailedError, match=r"the fewest found is 6, .* between 6 and 7, e\.g\. 1 or 2 or 3 or 6$"):
        partition_microbatches(lengths, lcp, capacity=4, dp=4)
    for dp in (1, 2, 3, 6):
        assert len(partition_microbatches(lengths, lcp, capacity=4, dp=dp).members) % dp == 0


def test_greedy_is_skipped_past_its_cell_budget_only_when_a_contiguous_candidate_exists():
    """Greedy scans every microbatch per insertion (trajectories x microbatches cells); past the budget L1
    keeps the contiguous candidates, but a step only greedy can place (dp 6 below) still gets greedy."""
    sequences = [[first, 9, 9] if first % 2 else [first, 9] for first in range(1, 8)]
    lengths, lcp = lengths_and_lcp(sequences)
    tight = L1Options(greedy_max_cells=0)
    skipped = partition_microbatches(lengths, lcp, capacity=4, dp=1, options=tight)
    assert any(line.startswith("greedy skipped") for line in skipped.decisions)
    assert not any("greedy" in line and line.startswith("candidate") for line in skipped.decisions)
    searched = partition_microbatches(lengths, lcp, capacity=4, dp=1)
    assert any(line.startswith("candidate greedy") for line in searched.decisions)
    only_greedy = partition_microbatches(lengths, lcp, capacity=4, dp=6, options=tight)
    assert len(only_greedy.members) == 6
    assert not any(line.startswith("greedy skipped") for line in only_greedy.decisions)
