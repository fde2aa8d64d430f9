"""The compiler pipeline: trajectories -> verified, lowered plan.

    build-trie -> partition-microbatches (L1) -> per microbatch:
        build-layout -> assign-rounds -> plan-replay -> lower

With `CompileOptions.verify` every pass's result is checked by its `verify`
function right after it runs (tests and `hartsc --debug`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from harts.compiler.ir.layout import CompactLayout, build_layout, verify_layout
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.ir.trie import TrieIR
from harts.compiler.passes.assign_rounds import RoundSchedule, assign_rounds, verify_rounds
from harts.compiler.passes.build_trie import build_trie, verify_trie
from harts.compiler.passes.lower_plan import lower_microbatch, lower_step
from harts.compiler.passes.partition_microbatches import (L1Options, L1Partition, partition_microbatches,
                                                          verify_partition)
from harts.compiler.passes.plan_replay import ReplayPlan, plan_replay
from harts.schema.errors import PassFailedError
from harts.schema.plan import FORMAT, SCHEMA_VERSION, Plan

COMPILER_NAME = "hartsc 0.1.0"
PLANNERS = ("harts", "ffd")
LEVELS = ("l1", "l1+l2")


@dataclass(frozen=True, slots=True)
class CompileOptions:
    dp: int = 1                # data-parallel degree D
    capacity: int = 65536      # compact-token capacity T of one microbatch
    chunk_size: int = 64       # linear-attention chunk length B (must match the model backend)
    planner: str = "harts"     # "harts" (two-level) or "ffd" (OR-Tools+FFD comparison)
    levels: str = "l1"         # "l1" stops after L1; "l1+l2" adds sharing windows
    seed: int = 0              # seed of any randomised search (the current passes are deterministic)
    vocab_size: int | None = None  # reject tokens >= vocab_size when given
    verify: bool = False       # verify the IR after every pass

    def flags(self) -> dict:
        """The flags recorded in the plan header (everything that changes the plan)."""
        return {"dp": self.dp, "capacity": self.capacity, "chunk_size": self.chunk_size,
                "planner": self.planner, "levels": self.levels, "seed": self.seed,
                "vocab_size": self.vocab_size}


@dataclass(frozen=True, slots=True)
class MicrobatchIR:
    layout: CompactLayout
    schedule: RoundSchedule
    replay: ReplayPlan


@dataclass(slots=True)
class CompileResult:
    plan: Plan
    trie: TrieIR
    partition: L1Partition
    microbatches: list[MicrobatchIR]
    pass_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def planning_seconds(self) -> float:
        return sum(self.pass_seconds.values())

    def decisions(self) -> list[str]:
        """One line per pass explaining what it decided (for `hartsc -v`)."""
        mb = self.microbatches
        rounds = [m.schedule.num_rounds for m in mb]
        replay = sum(m.replay.replay_tokens for m in mb)
        secs = self.pass_seconds
        return [
            f"build-trie: {len(self.trie.order)} trajectories, {int(self.trie.lengths.sum())} tokens, "
            f"{self.trie.unique_tokens} unique trie tokens, {self.trie.layout.num_segments} segments "
            f"({secs.get('build-trie', 0):.3f}s)",
            f"partition-microbatches: {self.partition.candidate}; {len(mb)} microbatches, "
            f"J_init={self.partition.j_init} ({secs.get('partition-microbatches', 0):.3f}s)",
            f"assign-rounds: max {max(rounds, default=0)} rounds, mean {np.mean(rounds) if rounds else 0:.2f} "
            f"({secs.get('assign-rounds', 0):.3f}s)",
            f"plan-replay: {replay} replay tokens, {sum(len(m.replay.export_row) for m in mb)} exported states "
            f"({secs.get('plan-replay', 0):.3f}s)",
            f"lower: {sum(m.layout.num_rows for m in mb)} compact rows ({secs.get('lower', 0):.3f}s)",
        ]


def member_lcps(trie: TrieIR, members: np.ndarray) -> np.ndarray:
    """LCP of consecutive members (sorted positions): min of the neighbour LCPs between them."""
    members = np.asarray(members, dtype=np.int64)
    out = np.zeros(len(members), dtype=np.int64)
    if len(members) > 1:
        # reduceat over [members[i-1] + 1, members[i] + 1) gives min(lcp[members[i-1]+1 .. members[i]]);
        # the closing index members[-1] + 1 is only needed when it lies inside the array.
        bounds = members + 1
        if bounds[-1] >= len(trie.lcp):
            bounds = bounds[:-1]
        out[1:] = np.minimum.reduceat(trie.lcp, bounds)[:len(members) - 1]
    return out


def check_options(options: CompileOptions) -> None:
    if options.planner not in PLANNERS:
        raise PassFailedError("options", f"unknown planner '{options.planner}'", f"use one of {', '.join(PLANNERS)}")
    if options.levels not in LEVELS:
        raise PassFailedError("options", f"unknown levels '{options.levels}'", f"use one of {', '.join(LEVELS)}")
    if options.planner == "ffd" or options.levels == "l1+l2":
        raise PassFailedError("options", f"planner '{options.planner}' with levels '{options.levels}' is not "
                              "implemented yet (L2 windows and the FFD planner arrive with issue #4)",
                              "use --planner harts --levels l1")
    for name in ("dp", "capacity", "chunk_size"):
        if getattr(options, name) < 1:
            raise PassFailedError("options", f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}",
                                  "pass a positive integer")


def compile_batch(batch: TrajectoryBatch, options: CompileOptions, progress=None) -> CompileResult:
    """Run every pass. `progress`, if given, wraps the per-microbatch loop (e.g. a tqdm bar)."""
    check_options(options)
    seconds: dict[str, float] = {}

    def timed(name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
        return out

    trie = timed("build-trie", build_trie, batch)
    if options.verify:
        verify_trie(trie, batch)
    partition = timed("partition-microbatches", partition_microbatches, trie.lengths, trie.lcp,
                      capacity=options.capacity, dp=options.dp, options=L1Options())
    if options.verify:
        verify_partition(trie.lengths, trie.lcp, partition, options.capacity, options.dp)

    microbatches: list[MicrobatchIR] = []
    records: list[dict] = []
    # Memory order of microbatches: by slot, then replica, as the executor runs them.
    run_order = np.lexsort((partition.replica, partition.slot))
    ordered = run_order.tolist()
    for k in (progress(ordered, "lowering microbatches") if progress else ordered):
        members = partition.members[k]
        layout = timed("build-layout", build_layout, batch.token_offsets, batch.tokens,
                       trie.order[members], member_lcps(trie, members))
        schedule = timed("assign-rounds", assign_rounds, layout, options.chunk_size)
        replay = timed("plan-replay", plan_replay, layout, schedule)
        if options.verify:
            verify_layout(layout, batch.token_offsets, batch.tokens)
            verify_rounds(layout, schedule)
        records.append(timed("lower", lower_microbatch, layout, schedule, replay,
                             replica=int(partition.replica[k]), slot=int(partition.slot[k])))
        microbatches.append(MicrobatchIR(layout, schedule, replay))

    header = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "flags": options.flags(),
              "compiler": COMPILER_NAME}
    plan = Plan(header=header, step=lower_step(batch, trie), microbatches=records)
    return CompileResult(plan=plan, trie=trie, partition=partition, microbatches=microbatches,
                         pass_seconds=seconds)
