"""`verify_placement`: every L2 invariant, recomputed from the LCP array alone.

Shares nothing with the search but `PrefixCostModel`, so a search bug cannot
hide itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from harts.compiler.prefix_cost import PrefixCostModel
from harts.schema.errors import VerificationError

if TYPE_CHECKING:
    from harts.compiler.ir.placement import L2Placement


def verify_placement(lengths, lcp, placement: L2Placement, capacity: int, dp: int) -> None:
    """Raise VerificationError naming the first L2 invariant that does not hold.

    Recomputes everything from the LCP array, independently of how the pass
    built the placement.
    """
    model = PrefixCostModel.build(lengths, lcp)
    n = model.num_trajectories
    K = len(placement.members)
    replica = np.asarray(placement.replica, dtype=np.int64)
    slot = np.asarray(placement.slot, dtype=np.int64)
    if len(placement.cached_prefix) != K or replica.shape != (K,) or slot.shape != (K,):
        raise VerificationError("one replica, slot and cached-prefix list per consumer",
                                f"{K} consumers, {replica.shape} replicas, {slot.shape} slots, "
                                f"{len(placement.cached_prefix)} cached-prefix lists")
    if K == 0 or K % dp:
        raise VerificationError("every replica has the same number of slots", f"K={K}, dp={dp}")
    J = K // dp
    if replica.min() < 0 or replica.max() >= dp or slot.min() < 0 or slot.max() >= J or \
            len(np.unique(replica * J + slot)) != K:
        raise VerificationError("consumers fill the replica x slot grid", "a (replica, slot) pair is missing or repeated")
    start = np.asarray(placement.window_start, dtype=np.int64)
    if len(start) < 2 or start[0] != 0 or start[-1] != J or np.any(np.diff(start) <= 0):
        raise VerificationError("windows tile the slots", f"window_start={start.tolist()} for {J} slots")
    W = len(start) - 1
    window = np.searchsorted(start, slot, side="right") - 1
    if len(placement.producer_positions) != W * dp or len(placement.producer_lengths) != W * dp:
        raise VerificationError("one producer per (window, replica)",
                                f"{len(placement.producer_positions)} producers for {W} windows x {dp} replicas")

    consumer_of = np.full(n, -1, dtype=np.int64)
    cached_of = np.zeros(n, dtype=np.int64)
    seen = np.zeros(n, dtype=np.int64)
    for k, members in enumerate(placement.members):
        members = np.asarray(members, dtype=np.int64)
        if members.size == 0:
            raise VerificationError("every consumer is non-empty", f"consumer {k} has no trajectory")
        if members.min() < 0 or members.max() >= n or np.any(np.diff(members) <= 0):
            raise VerificationError("members are sorted positions in [0, N)", f"consumer {k}")
        np.add.at(seen, members, 1)
        consumer_of[members] = k
        cost = model.cost(members)
        if cost > capacity:
            raise VerificationError("complete consumer layouts fit the capacity",
                                    f"consumer {k} has C(M)={cost} > {capacity}")
        cached = np.asarray(placement.cached_prefix[k], dtype=np.int64)
        if cached.shape != members.shape or cached.min() < 0 or np.any(cached > model.lengths[members]):
            raise VerificationError("a cached prefix is a prefix of its trajectory", f"consumer {k}")
        cached_of[members] = cached
        if len(members) > 1:
            shared = model.neighbour_lcp(members[:-1], members[1:])
            if np.any(np.minimum(cached[:-1], shared) != np.minimum(cached[1:], shared)):
                raise VerificationError("a row shared inside a consumer has one cached status",
                                        f"consumer {k}: neighbouring members disagree on a shared row")
    if np.any(seen != 1):
        bad = int(np.flatnonzero(seen != 1)[0])
        raise VerificationError("every trajectory is in exactly one consumer",
                                f"sorted position {bad} appears {int(seen[bad])} times")

    cell_of_consumer = window * dp + replica
    for g in range(W * dp):
        entries = np.asarray(placement.producer_positions[g], dtype=np.int64)
        depth = np.asarray(placement.producer_lengths[g], dtype=np.int64)
        if entries.shape != depth.shape or (entries.size and (np.any(np.diff(entries) <= 0) or depth.min() < 1
                                                              or np.any(depth > model.lengths[entries]))):
            raise VerificationError("producer prefixes are sorted trajectory prefixes", f"producer {g}")
        rows = 0
        if entries.size:
            between = model.neighbour_lcp(entries[:-1], entries[1:]) if entries.size > 1 else np.zeros(0, np.int64)
            truncated = np.minimum(between, np.minimum(depth[:-1], depth[1:]))
            if np.any(truncated >= depth[1:]):
                raise VerificationError("producer prefixes are sorted trajectory prefixes",
                                        f"producer {g}: a prefix repeats or sorts after its extension")
            rows = int(depth.sum() - truncated.sum())
        if rows > capacity:
            raise VerificationError("producers fit the capacity", f"producer {g} computes {rows} rows > {capacity}")
        mine = np.flatnonzero(cell_of_consumer[consumer_of] == g)
        if not mine.size:
            if entries.size:
                raise VerificationError("a producer serves its window's consumers", f"producer {g} has no consumer")
            continue
        cached = cached_of[mine]
        needed = cached > 0
        if np.any(needed) and not entries.size:
            raise VerificationError("every cached prefix is produced in its window on its replica",
                                    f"producer {g} computes nothing but its consumers cache rows")
        if np.any(needed):
            x = mine[needed]
            want = cached[needed]
            lcp_xe = _lcp_matrix(model, x, entries)
            served = np.minimum(lcp_xe, depth[None, :]).max(axis=1)
            if np.any(served < want):
                bad = int(x[np.argmax(served < want)])
                raise VerificationError("every cached prefix is produced in its window on its replica",
                                        f"sorted position {bad}: its producer computes fewer leading positions")
            lcp_xy = _lcp_matrix(model, x, mine)
            other = consumer_of[mine][None, :] != consumer_of[x][:, None]
            shared = np.where(other, lcp_xy, 0).max(axis=1)
            if np.any(shared < want):
                bad = int(x[np.argmax(shared < want)])
                raise VerificationError("a cached prefix is shared with another consumer of its window",
                                        f"sorted position {bad} caches a prefix no other consumer there uses")
        if entries.size:
            # Nothing computed for nobody: each prefix's deepest row is cached by >= 2 consumers.
            use = np.minimum(_lcp_matrix(model, entries, mine), cached[None, :]) >= depth[:, None]
            users = np.array([len(np.unique(consumer_of[mine][row])) for row in use])
            if np.any(users < 2):
                raise VerificationError("a producer computes only rows two consumers use",
                                        f"producer {g}: prefix of sorted position {int(entries[np.argmax(users < 2)])}")


def _lcp_matrix(model: PrefixCostModel, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int64[len(a), len(b)]: LCP of every pair (the length itself where a position meets itself)."""
    lo = np.minimum(a[:, None], b[None, :])
    hi = np.maximum(a[:, None], b[None, :])
    same = lo == hi
    out = model.lcp_min.min(np.where(same, 0, lo + 1), np.where(same, 0, hi))
    return np.where(same, model.lengths[lo], out)
