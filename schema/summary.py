"""Step statistics computed from a plan (the numbers of `harts stats`).

Everything here is derived from the plan's arrays, so the compiler, the tools
and the executor report the same numbers. Legend: D replicas, J slots,
r[d, j] the work (compact rows) of the consumer at replica d, slot j.
"""
from __future__ import annotations

import numpy as np

from harts.schema.plan import Plan

STATS_KEYS = ("trajectories", "original_tokens", "compact_tokens", "compression", "decoder_tokens",
              "replay_tokens", "microbatches", "dp", "slots", "windows", "balance", "max_rounds",
              "capacity", "chunk_size", "planning_seconds")


def slot_work(plan: Plan) -> np.ndarray:
    """r[d, j]: compact rows of each consumer, zero where a replica has no microbatch at a slot."""
    dp = int(plan.flags["dp"])
    slots = 1 + max((int(mb["slot"]) for mb in plan.microbatches), default=-1)
    work = np.zeros((dp, slots), dtype=np.int64)
    for mb in plan.microbatches:
        work[int(mb["replica"]), int(mb["slot"])] += len(mb["row_token"])
    return work


def balance(work: np.ndarray) -> float:
    """The paper's eta_sched without producers: sum of all work over D * sum of slot maxima."""
    denominator = work.shape[0] * work.max(axis=0).sum() if work.size else 0
    return float(work.sum() / denominator) if denominator else 1.0


def plan_statistics(plan: Plan, planning_seconds: float = 0.0) -> dict:
    flags = plan.flags
    compact = sum(len(mb["row_token"]) for mb in plan.microbatches)
    original = int(plan.step["original_tokens"])
    work = slot_work(plan)
    return {
        "trajectories": int(plan.step["num_trajectories"]),
        "original_tokens": original,
        "compact_tokens": compact,
        "compression": original / compact if compact else 0.0,
        # Without L2 windows every consumer runs its whole layout through the decoder.
        "decoder_tokens": compact,
        "replay_tokens": sum(len(mb["replay_rows"]) for mb in plan.microbatches),
        "microbatches": len(plan.microbatches),
        "dp": int(flags["dp"]),
        "slots": int(work.shape[1]),
        "windows": 0,
        "balance": balance(work),
        "max_rounds": max((int(mb["num_rounds"]) for mb in plan.microbatches), default=0),
        "capacity": int(flags["capacity"]),
        "chunk_size": int(flags["chunk_size"]),
        "planning_seconds": float(planning_seconds),
        # Additions beyond the contract's keys: the trie's compression bound.
        "trie_unique_tokens": int(plan.step["trie_unique_tokens"]),
        "compression_bound": original / int(plan.step["trie_unique_tokens"]) if plan.step["trie_unique_tokens"] else 0.0,
    }
