"""Shared inputs of the planner tests: sorted token sequences, their LCPs, C(M) by definition, and forests."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from harts.schema.errors import PassFailedError


@st.composite
def token_batches(draw, min_n: int = 1, max_n: int = 10, max_len: int = 7, alphabet: int = 3):
    """Sorted token sequences rich in shared prefixes, strict prefixes and duplicates."""
    n = draw(st.integers(min_n, max_n))
    sequences: list[list[int]] = []
    for _ in range(n):
        kind = draw(st.sampled_from(["new", "prefix", "extend", "duplicate"])) if sequences else "new"
        if kind == "new":
            seq = draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=max_len))
        else:
            base = sequences[draw(st.integers(0, len(sequences) - 1))]
            if kind == "prefix":
                seq = base[:draw(st.integers(1, len(base)))]
            elif kind == "extend":
                seq = base + draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=3))
            else:
                seq = list(base)
        sequences.append(seq)
    sequences.sort()  # lexicographic: a strict prefix sorts before its extensions
    return sequences


def lengths_and_lcp(sequences):
    """The trie pass's inputs to the partitioners, computed the slow, obvious way."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    lcp = np.zeros(len(sequences), dtype=np.int64)
    for i in range(1, len(sequences)):
        a, b = sequences[i - 1], sequences[i]
        while lcp[i] < min(len(a), len(b)) and a[lcp[i]] == b[lcp[i]]:
            lcp[i] += 1
    return lengths, lcp


def trie_nodes(sequences) -> int:
    """C(M) by definition: distinct non-empty prefixes of the member sequences."""
    return len({tuple(s[:k]) for s in sequences for k in range(1, len(s) + 1)})


@st.composite
def forests(draw):
    """Trajectories branching off earlier ones: forks anywhere, duplicates, strict prefixes, long shared stems."""
    stem = draw(st.lists(st.integers(0, 3), min_size=0, max_size=25))
    lists = [stem + draw(st.lists(st.integers(0, 3), min_size=max(0, 2 - len(stem)), max_size=20))]
    for _ in range(draw(st.integers(1, 16))):
        base = lists[draw(st.integers(0, len(lists) - 1))]
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(0, 3), min_size=max(0, 2 - cut), max_size=20))
        lists.append(base[:cut] + tail)
    return lists


def unless_dp_refused(compile, dp: int):
    """compile(), or None when it refuses a random forest the one legal way: the trajectories
    cannot be split into a multiple of dp non-empty microbatches."""
    try:
        return compile()
    except PassFailedError as err:
        assert f"into a multiple of {dp} non-empty microbatches" in str(err)
        return None
