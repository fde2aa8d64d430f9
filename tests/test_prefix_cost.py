"""Prefix-cost helpers against definitions a reader can check by hand.

Run: `cd /work/main && python -m pytest tests/test_prefix_cost.py -q` (a few seconds).
Every input is built from real token sequences, sorted and compared, so
lengths and lcp are always consistent; C(M) is checked against the number of
distinct non-empty prefixes of M's sequences (the nodes of its unique trie).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.compiler.prefix_cost import PrefixCostModel, RangeMin, floor_log2_table, validate_sorted_lcp

from prefix_inputs import lengths_and_lcp, token_batches, trie_nodes

SETTINGS = settings(max_examples=60, deadline=None)


def naive_lcp(a, b) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


@SETTINGS
@given(st.lists(st.integers(0, 9), min_size=1, max_size=40))
def test_range_min_matches_a_scan_on_every_range(values):
    table = RangeMin.build(np.array(values))
    lo, hi = np.triu_indices(len(values))
    got_min, got_arg = table.min(lo, hi), table.argmin(lo, hi)
    for a, b, m, i in zip(lo, hi, got_min, got_arg):
        window = values[a:b + 1]
        assert m == min(window)
        assert i == a + window.index(min(window)), "argmin is the leftmost minimum"


def test_floor_log2_is_exact_at_powers_of_two():
    table = floor_log2_table(1 << 12)
    for k in range(13):
        assert table[1 << k] == k
        if k:
            assert table[(1 << k) - 1] == k - 1


@SETTINGS
@given(token_batches(), st.data())
def test_cost_counts_the_unique_trie_of_the_members(sequences, data):
    model = PrefixCostModel.build(*lengths_and_lcp(sequences))
    assert model.total_unique_tokens == trie_nodes(sequences)
    members = sorted(data.draw(st.sets(st.integers(0, len(sequences) - 1), min_size=1)))
    assert model.cost(members) == trie_nodes([sequences[i] for i in members])
    assert model.cost([]) == 0


@SETTINGS
@given(token_batches())
def test_lcp_between_and_lcp_to_all_match_token_comparison(sequences):
    model = PrefixCostModel.build(*lengths_and_lcp(sequences))
    n = len(sequences)
    for x in range(n):
        row = model.lcp_to_all(x)
        assert row.tolist() == [naive_lcp(sequences[x], s) for s in sequences]
        for j in range(x + 1, n):
            assert model.lcp_between(x, j) == naive_lcp(sequences[x], sequences[j])


@SETTINGS
@given(token_batches())
def test_contiguous_cost_and_feasible_windows(sequences):
    model = PrefixCostModel.build(*lengths_and_lcp(sequences))
    n = len(sequences)
    for start in range(n):
        for end in range(start, n):
            assert model.contiguous_cost(start, end) == trie_nodes(sequences[start:end + 1])
    capacity = int(model.lengths.max()) + 2
    lo = model.earliest_feasible_start(capacity)
    for end in range(n):
        fits = [s for s in range(end + 1) if trie_nodes(sequences[s:end + 1]) <= capacity]
        assert lo[end] == min(fits), "the feasible starts of an end form one window [lo, end]"


@SETTINGS
@given(token_batches(), st.data())
def test_insertion_delta_is_the_change_in_cost(sequences, data):
    model = PrefixCostModel.build(*lengths_and_lcp(sequences))
    n = len(sequences)
    x = data.draw(st.integers(0, n - 1))
    others = [i for i in range(n) if i != x]
    members = sorted(data.draw(st.sets(st.sampled_from(others), min_size=0, max_size=len(others)))) if others else []
    predecessor = max([m for m in members if m < x], default=-1)
    successor = min([m for m in members if m > x], default=n)
    delta = model.insertion_delta(x, np.array([predecessor]), np.array([successor]))[0]
    with_x = trie_nodes([sequences[i] for i in sorted(members + [x])])
    assert delta == with_x - trie_nodes([sequences[i] for i in members])


@pytest.mark.parametrize("lengths, lcp, problem", [
    ([3, 3], [1, 2], "lcp[0] must be 0"),
    ([3, 2], [0, 3], "exceeds"),
    ([3, 2], [0, 2], "strict prefix"),
    ([3, 0], [0, 0], "at least one token"),
    ([3, 3], [0, -1], ">= 0"),
    ([3.0, 3.0], [0, 1], "integer"),
    ([3, 3], [0], "equal length"),
], ids=["lcp0", "lcp-too-long", "prefix-after-extension", "empty-trajectory", "negative", "float", "shape"])
def test_inconsistent_trie_output_is_a_value_error(lengths, lcp, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        validate_sorted_lcp(np.array(lengths), np.array(lcp))
