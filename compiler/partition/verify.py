"""`verify_partition`: L1's invariants (`partition_microbatches`' docstring), checked from the
partition alone, sharing no code with the search."""
from __future__ import annotations

import numpy as np

from harts.compiler.ir.partition import L1Partition
from harts.compiler.prefix_cost import PrefixCostModel
from harts.schema.errors import VerificationError


def verify_partition(lengths, lcp, partition: L1Partition, capacity: int, dp: int) -> None:
    """Raise VerificationError naming the first L1 invariant that does not hold."""
    model = PrefixCostModel.build(lengths, lcp)
    n = model.num_trajectories
    count = len(partition.members)
    work = np.asarray(partition.work)
    replica = np.asarray(partition.replica)
    slot = np.asarray(partition.slot)
    if not (work.shape == replica.shape == slot.shape == (count,)):
        raise VerificationError("one work/replica/slot entry per microbatch",
                                f"{count} microbatches, work {work.shape}, replica {replica.shape}, slot {slot.shape}")
    seen = np.zeros(n, dtype=np.int64)
    for i, members in enumerate(partition.members):
        members = np.asarray(members)
        if members.size == 0:
            raise VerificationError("every microbatch is non-empty", f"microbatch {i} has no trajectory")
        if members.ndim != 1 or members.min() < 0 or members.max() >= n:
            raise VerificationError("members are sorted positions in [0, N)", f"microbatch {i} holds {members}")
        if members.size > 1 and np.any(np.diff(members) <= 0):
            raise VerificationError("members are sorted positions in [0, N)",
                                    f"microbatch {i} is not strictly ascending")
        np.add.at(seen, members, 1)
        cost = model.cost(members)
        if cost > capacity:
            raise VerificationError("C(M) <= capacity", f"microbatch {i} has C(M)={cost} > {capacity}")
        if int(work[i]) != cost:
            raise VerificationError("work equals C(M)", f"microbatch {i} records work {int(work[i])}, C(M)={cost}")
    if np.any(seen == 0):
        raise VerificationError("every trajectory is in exactly one microbatch",
                                f"trajectory {int(np.flatnonzero(seen == 0)[0])} is missing")
    if np.any(seen > 1):
        raise VerificationError("every trajectory is in exactly one microbatch",
                                f"trajectory {int(np.flatnonzero(seen > 1)[0])} appears {int(seen.max())} times")
    if count % dp:
        raise VerificationError("K is a multiple of dp", f"K={count}, dp={dp}")
    if count and (replica.min() < 0 or replica.max() >= dp or slot.min() < 0 or slot.max() >= count // dp):
        raise VerificationError("(replica, slot) pairs form the dp x K/dp grid",
                                f"replica in [{replica.min()}, {replica.max()}], slot in [{slot.min()}, {slot.max()}]")
    cells = np.unique(replica.astype(np.int64) * max(count // dp, 1) + slot)
    if cells.size != count:
        raise VerificationError("(replica, slot) pairs form the dp x K/dp grid",
                                f"{count - cells.size} (replica, slot) pairs are repeated")
