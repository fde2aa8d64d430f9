"""The compiler pipeline: trajectories -> verified, lowered plan.

    build-trie -> partition-microbatches (L1) -> per microbatch:
        build-layout -> assign-rounds -> plan-replay -> lower

With `--levels l1+l2` (the default of the harts planner), place-windows (L2)
runs after L1: it fixes the final consumers, their (replica, slot), the
sharing windows and one producer per (window, replica); each producer is then
laid out and scheduled like a microbatch, every consumer records which of its
rows a producer computes, plan-residual schedules the linear attention of the
rows the consumer still computes, and each producer is lowered exporting, on
top of its own handoffs, every anchor state its consumers start from.
On small steps (at most `SECOND_START_MAX_CONSUMERS` consumers) with the
default `--l1-objective step-time`, L2 also runs from the paper's
(`compression`) L1 partition and the plan with the smaller L2 key is kept.

With `CompileOptions.verify` every pass's result is checked by its `verify`
function right after it runs (tests and `hartsc --debug`).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time
from dataclasses import dataclass, field

import numpy as np

from harts.compiler.ir.layout import CompactLayout, build_layout, verify_layout
from harts.compiler.ir.partition import L1Partition
from harts.compiler.ir.placement import L2Placement
from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.ir.trie import TrieIR
from harts.compiler.passes.assign_rounds import RoundSchedule, assign_rounds, verify_rounds
from harts.compiler.passes.build_trie import build_trie, verify_trie
from harts.compiler.passes.lower_plan import (lower_cached_rows, lower_microbatch, lower_producer, lower_residual,
                                              lower_step)
from harts.compiler.passes.partition_ffd import SHARD_UNITS, partition_ffd
from harts.compiler.passes.partition_microbatches import (L1_OBJECTIVES, L1Options, partition_microbatches,
                                                          verify_partition)
from harts.compiler.passes.place_windows import L2Options, place_windows, verify_placement
from harts.compiler.passes.plan_replay import ReplayPlan, plan_replay, with_exports
from harts.compiler.passes.plan_residual import ResidualPlan, plan_residual, verify_residual
from harts.schema.cost_model import DEFAULT_PAIRS_PER_TOKEN
from harts.schema.errors import PassFailedError
from harts.schema.plan import FORMAT, SCHEMA_VERSION, Plan
from harts.schema.plan_structure import MAX_CAPACITY, MAX_CHUNK_SIZE, MAX_PAIRS_PER_TOKEN

COMPILER_NAME = "hartsc 0.1.0"
PLANNERS = ("harts", "ffd")
LEVELS = ("l1", "l1+l2")


@dataclass(frozen=True, slots=True)
class CompileOptions:
    dp: int = 1                # data-parallel degree D
    capacity: int = 65536      # compact-token capacity T of one microbatch
    chunk_size: int = 64       # linear-attention chunk length B (must match the model backend)
    planner: str = "harts"     # "harts" (two-level) or "ffd" (OR-Tools+FFD comparison)
    levels: str | None = None  # "l1" stops after L1; "l1+l2" adds sharing windows; None: the planner's default
    seed: int = 0              # seed of any randomised search (the current passes are deterministic)
    vocab_size: int | None = None  # reject tokens >= vocab_size when given
    verify: bool = False       # verify the IR after every pass
    ffd_time_budget: float = 10.0   # --planner ffd: CP-SAT budget per replica, in deterministic seconds
    ffd_first_feasible: bool = False  # --planner ffd: stop each replica's search at its first solution
    ffd_shard: str = "subtree"      # --planner ffd: FFD shard unit, "subtree" (whole rollout subtrees) or "trajectory"
    # L2's cost model: one computed row's linear-layer work in full-attention
    # query-key pairs (2 x active parameters / per-pair attention FLOPs of all
    # full-attention layers); 0 counts rows only. The default fits the paper's models.
    pairs_per_token: int = DEFAULT_PAIRS_PER_TOKEN
    # L2: longest sharing window in slots (0: no limit). A producer's graph and
    # cached interfaces stay alive until its window's last consumer, so this
    # bounds that memory at the price of sharing less.
    max_window_slots: int = 0
    # L1's ranking of its candidates: "step-time" (critical path first) or "compression" (the paper's
    # Equation 1); `partition_microbatches` explains the difference. Read by the harts planner only.
    l1_objective: str = "step-time"

    @property
    def effective_levels(self) -> str:
        """Two levels for the harts planner (the contract's default); L1 only for ffd, which has no windows."""
        if self.levels is not None:
            return self.levels
        return "l1" if self.planner == "ffd" else "l1+l2"

    def flags(self) -> dict:
        """The flags recorded in the plan header (everything that changes the plan)."""
        return {"dp": self.dp, "capacity": self.capacity, "chunk_size": self.chunk_size,
                "planner": self.planner, "levels": self.effective_levels, "seed": self.seed,
                "vocab_size": self.vocab_size, "ffd_time_budget": self.ffd_time_budget,
                "ffd_first_feasible": self.ffd_first_feasible, "ffd_shard": self.ffd_shard,
                "pairs_per_token": self.pairs_per_token, "max_window_slots": self.max_window_slots,
                "l1_objective": self.l1_objective}


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
    # Every microbatch's IR in memory order, only with `compile_batch(keep_ir=True)` (the IR printer's input);
    # else None: the plan's records hold what every later reader needs.
    microbatches: list[MicrobatchIR] | None
    pass_seconds: dict[str, float] = field(default_factory=dict)
    placement: L2Placement | None = None        # L2's result (`--levels l1+l2`)
    producers: list[MicrobatchIR] = field(default_factory=list)  # in plan order (window, then replica)

    @property
    def planning_seconds(self) -> float:
        return sum(self.pass_seconds.values())

    def decisions(self) -> list[str]:
        """One line per pass explaining what it decided (for `hartsc -v`)."""
        mb = self.plan.microbatches
        rounds = [int(m["num_rounds"]) for m in mb]
        replay = sum(len(m["replay_rows"]) for m in mb)
        secs = self.pass_seconds
        return [
            f"build-trie: {len(self.trie.order)} trajectories, {int(self.trie.lengths.sum())} tokens, "
            f"{self.trie.unique_tokens} unique trie tokens, {self.trie.num_segments} segments "
            f"({secs.get('build-trie', 0):.3f}s)",
            f"partition-microbatches: {self.partition.candidate}; {len(mb)} microbatches, "
            f"J_init={self.partition.j_init} ({secs.get('partition-microbatches', 0):.3f}s)",
            # The comparison planner's sharding and each replica's CP-SAT outcome (budget cut, model too large).
            *(f"partition-microbatches:   {line}" for line in self.partition.decisions
              if self.plan.flags["planner"] == "ffd"),
            f"assign-rounds: max {max(rounds, default=0)} rounds, mean {np.mean(rounds) if rounds else 0:.2f} "
            f"({secs.get('assign-rounds', 0):.3f}s)",
            f"plan-replay: {replay} replay tokens, {sum(len(m['export_row']) for m in mb)} exported states "
            f"({secs.get('plan-replay', 0):.3f}s)",
            f"lower: {sum(len(m['row_token']) for m in mb)} compact rows ({secs.get('lower', 0):.3f}s)",
        ] + ([] if self.placement is None else [
            f"place-windows: {self.placement.candidate}; {self.placement.num_windows} windows, "
            f"{self.placement.decoder_tokens} decoder tokens ({int(self.placement.producer_tokens.sum())} in "
            f"{len(self.producers)} producers), Phi {self.placement.key[0]:.4e}, imbalance {self.placement.key[2]:.2%} "
            f"({secs.get('place-windows', 0):.3f}s)",
            # The search after choosing a candidate: depth adjustments, refinement, exchanges.
            *(f"place-windows:   {line}" for line in self.placement.decisions
              if not line.startswith(("K=", "candidate "))),
            self._residual_line()])

    def _residual_line(self) -> str:
        readers = [mb for mb in self.plan.microbatches if "residual_token_rows" in mb]
        sequences = sum(len(mb["residual_sequence_round"]) for mb in readers)
        replay = sum(int(np.sum(mb["residual_sequence_replay"])) for mb in readers)
        handed = sum(int(np.count_nonzero(mb["residual_sequence_producer_state"] >= 0)) for mb in readers)
        return (f"plan-residual: {len(readers)} consumers read a producer; {sequences} sequences, "
                f"{replay} replay tokens, {handed} start from a producer state "
                f"({self.pass_seconds.get('plan-residual', 0):.3f}s)")


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


# Integer options: (lowest, highest, fix). The plan's limits (schema.plan_structure)
# bound what readers accept; the seed is recorded in the plan header, whose
# msgpack integers hold at most 64 bits (signed, to be safe for any reader).
_INT32_MAX = 2**31 - 1
_INTEGER_OPTIONS = {
    "dp": (1, _INT32_MAX, "pass the number of data-parallel replicas, e.g. --dp 8"),
    "capacity": (2, MAX_CAPACITY, "pass the compact tokens one microbatch holds (at least 2, at most 2**31 - 1), "
                                  "e.g. --capacity 65536"),
    "chunk_size": (1, MAX_CHUNK_SIZE, "pass the model kernel's chunk length, e.g. --chunk-size 64"),
    "seed": (0, 2**63 - 1, "pass a seed in [0, 2**63), e.g. --seed 0"),
    "vocab_size": (1, 2**31, "pass the model's vocabulary size (token ids are int32), or leave it out"),
    "pairs_per_token": (0, MAX_PAIRS_PER_TOKEN,
                        f"pass 0 to balance rows only, or the model's ratio (default {DEFAULT_PAIRS_PER_TOKEN})"),
    "max_window_slots": (0, _INT32_MAX, "pass 0 for no limit, or the most slots one producer may serve"),
}


def _option_error(name: str, problem: str, fix: str) -> PassFailedError:
    return PassFailedError("options", f"--{name.replace('_', '-')} {problem}", fix)


def check_integer_options(options: CompileOptions) -> None:
    """Every integer option is an int within its `_INTEGER_OPTIONS` range (vocab_size may be None).

    A chunk longer than the capacity stays legal: it must match the model's
    kernel, whatever the capacity (tiny test steps use the default 64).
    """
    for name, (lowest, highest, fix) in _INTEGER_OPTIONS.items():
        value = getattr(options, name)
        if value is None and name == "vocab_size":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise _option_error(name, f"must be an integer, got {value!r}", fix)
        if value < lowest:
            raise _option_error(name, f"must be >= {lowest}, got {value}", fix)
        if value > highest:
            raise _option_error(name, f"must be <= {highest}, got {value}", fix)


def _positive_finite(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:   # an int too large for a double
        return False


def check_options(options: CompileOptions) -> None:
    """Every option is legal, or one `PassFailedError` line naming the flag and the fix.

    Cheap and independent of the input, so front ends run it before reading
    anything (`hartsc` does; `compile_batch` runs it again for API callers).
    """
    if options.planner not in PLANNERS:
        raise PassFailedError("options", f"unknown planner '{options.planner}'", f"use one of {', '.join(PLANNERS)}")
    if options.effective_levels not in LEVELS:
        raise PassFailedError("options", f"unknown levels '{options.levels}'", f"use one of {', '.join(LEVELS)}")
    if options.effective_levels == "l1+l2" and options.planner == "ffd":
        raise PassFailedError("options", "planner 'ffd' with levels 'l1+l2' is not implemented: the OR-Tools+FFD "
                              "comparison planner has no sharing windows",
                              "use --planner harts --levels l1+l2, or --planner ffd --levels l1")
    check_integer_options(options)
    if options.l1_objective not in L1_OBJECTIVES:
        raise PassFailedError("options", f"unknown --l1-objective '{options.l1_objective}'",
                              f"use one of {', '.join(L1_OBJECTIVES)}")
    # Recorded in the plan header whichever planner runs, so checked for both.
    budget = options.ffd_time_budget
    if not _positive_finite(budget):
        raise PassFailedError("options", f"--ffd-time-budget must be a positive number of seconds, "
                              f"got {budget}", "pass e.g. --ffd-time-budget 10")
    if options.planner == "ffd" and options.ffd_shard not in SHARD_UNITS:
        raise PassFailedError("options", f"unknown --ffd-shard '{options.ffd_shard}'",
                              f"use one of {', '.join(SHARD_UNITS)}")


def compile_batch(batch: TrajectoryBatch, options: CompileOptions, progress=None,
                  keep_ir: bool = False) -> CompileResult:
    """Run every pass. `progress`, if given, wraps the per-microbatch loop (e.g. a tqdm bar).

    `keep_ir` keeps every microbatch's layout, schedule and replay in `CompileResult.microbatches` (the IR
    printer reads them). Off, each is dropped once lowered into the plan: they are as large as the plan's
    own records, and on a GRPO-preset step keeping them made compiling 2x slower (fresh pages for every
    consumer: 526k page faults against 219k) and its peak 1.1 GB higher.
    """
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
    if options.planner == "ffd":
        partition = timed("partition-microbatches", partition_ffd, trie.lengths, trie.lcp,
                          capacity=options.capacity, dp=options.dp, time_budget_s=options.ffd_time_budget,
                          seed=options.seed, first_feasible=options.ffd_first_feasible, shard=options.ffd_shard)
    else:
        partition = timed("partition-microbatches", partition_microbatches, trie.lengths, trie.lcp,
                          capacity=options.capacity, dp=options.dp,
                          options=L1Options(objective=options.l1_objective))
    if options.verify:
        verify_partition(trie.lengths, trie.lcp, partition, options.capacity, options.dp)

    placement = None
    if options.effective_levels == "l1+l2":
        l2_options = L2Options.for_pairs_per_token(options.pairs_per_token, seed=options.seed,
                                                   max_window_slots=options.max_window_slots)
        placement = timed("place-windows", place_windows, trie, partition, capacity=options.capacity,
                          dp=options.dp, options=l2_options)
        if _second_start_applies(options, partition):
            partition, placement = _second_start(trie, options, l2_options, partition, placement, timed)
        if options.verify:
            verify_placement(trie.lengths, trie.lcp, placement, options.capacity, options.dp)
    members_of = placement.members if placement is not None else partition.members
    replica_of = placement.replica if placement is not None else partition.replica
    slot_of = placement.slot if placement is not None else partition.slot

    producers: list[MicrobatchIR] = []
    producer_cells: list[int] = []
    producer_of_cell: dict[int, int] = {}
    if placement is not None:
        for cell, (positions, lengths) in enumerate(zip(placement.producer_positions, placement.producer_lengths)):
            if not len(positions):
                continue
            layout = timed("build-layout", build_producer_layout, batch, trie, positions, lengths)
            schedule = timed("assign-rounds", assign_rounds, layout, options.chunk_size)
            replay = timed("plan-replay", plan_replay, layout, schedule)
            if options.verify:
                verify_rounds(layout, schedule)
            producer_of_cell[cell] = len(producers)
            producer_cells.append(cell)
            producers.append(MicrobatchIR(layout, schedule, replay))

    microbatches: list[MicrobatchIR] | None = [] if keep_ir else None
    records: list[dict] = []
    residuals: list[tuple[dict, int, ResidualPlan]] = []   # (consumer with cached rows, its producer, its calls)
    # Memory order of microbatches: by slot, then replica, as the executor runs them.
    run_order = np.lexsort((replica_of, slot_of))
    ordered = run_order.tolist()
    for k in (progress(ordered, "lowering microbatches") if progress else ordered):
        members = members_of[k]
        layout = timed("build-layout", build_layout, batch.token_offsets, batch.tokens,
                       trie.order[members], member_lcps(trie, members))
        schedule = timed("assign-rounds", assign_rounds, layout, options.chunk_size)
        replay = timed("plan-replay", plan_replay, layout, schedule)
        if options.verify:
            verify_layout(layout, batch.token_offsets, batch.tokens)
            verify_rounds(layout, schedule)
        record = timed("lower", lower_microbatch, layout, schedule, replay,
                       replica=int(replica_of[k]), slot=int(slot_of[k]))
        if placement is not None:
            window = int(placement.window[k])
            cell = window * options.dp + int(replica_of[k])
            source = producer_of_cell.get(cell)
            producer = producers[source] if source is not None else None
            entries = placement.producer_positions[cell]
            # The prefix serving a member: the last producer prefix at or before it in sorted order.
            serving = np.maximum(np.searchsorted(entries, members, side="right") - 1, 0)
            record["window"] = window
            record["row_cached_by"] = timed(
                "lower", lower_cached_rows, layout, replay, placement.cached_prefix[k],
                producer.layout if producer else None, producer.replay if producer else None, serving)
            if np.any(record["row_cached_by"] >= 0):   # else it runs its complete layout's own calls
                residual = timed("plan-residual", plan_residual, layout, replay, record["row_cached_by"],
                                 options.chunk_size)
                if options.verify:
                    verify_residual(residual, record["row_cached_by"], record["row_parent"],
                                    record["row_position"], options.chunk_size)
                residuals.append((record, source, residual))
        records.append(record)
        if microbatches is not None:
            microbatches.append(MicrobatchIR(layout, schedule, replay))

    # Producers export, besides their own handoffs, every anchor state a consumer starts from.
    requested: list[list[np.ndarray]] = [[] for _ in producers]
    for record, source, residual in residuals:
        external = residual.sequence_external_row[residual.sequence_external_row >= 0]
        if len(external):
            requested[source].append(np.asarray(record["row_cached_by"], dtype=np.int64)[external])
    producer_records: list[dict] = []
    for p, (ir, cell) in enumerate(zip(producers, producer_cells)):
        rows = np.unique(np.concatenate(requested[p])) if requested[p] else np.zeros(0, np.int64)
        replay, _ = with_exports(ir.replay, rows, options.chunk_size)
        producers[p] = MicrobatchIR(ir.layout, ir.schedule, replay)
        positions = placement.producer_positions[cell]
        producer_records.append(timed("lower", lower_producer, ir.layout, ir.schedule, replay,
                                      replica=cell % options.dp, window=cell // options.dp,
                                      prefix_trajectory=trie.order[positions],
                                      prefix_length=placement.producer_lengths[cell]))
    for record, source, residual in residuals:
        record.update(lower_residual(residual, record["row_cached_by"], producers[source].replay.export_row))

    header = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "flags": options.flags(),
              "compiler": COMPILER_NAME}
    step = lower_step(batch, trie)
    if placement is not None:
        step["l1_compact_tokens"] = int(partition.work.sum())
    plan = Plan(header=header, step=step, microbatches=records,
                producers=producer_records if placement is not None else None)
    return CompileResult(plan=plan, trie=trie, partition=partition, microbatches=microbatches,
                         pass_seconds=seconds, placement=placement, producers=producers)


# L2 is also run from the paper's L1 partition on steps of at most this many consumers (both starts). L2 then
# costs tens of milliseconds, and its local search can end far apart from two starts: over 90 small generated
# steps (`bench_l1_objective.py --sweep`, 1-8 consumers) step-time's start alone was >1% longer in 3, by up to
# 6.8%. Paper-scale steps have 74-104 consumers, where a second L2 would cost ~0.6 s of the 1.5 s budget.
SECOND_START_MAX_CONSUMERS = 32


def _second_start_applies(options: CompileOptions, partition: L1Partition) -> bool:
    return (options.planner == "harts" and options.l1_objective == "step-time" and options.dp > 1
            and partition.num_microbatches <= SECOND_START_MAX_CONSUMERS)


def _second_start(trie: TrieIR, options: CompileOptions, l2_options: L2Options, partition: L1Partition,
                  placement: L2Placement, timed) -> tuple[L1Partition, L2Placement]:
    """Run L2 again from the compression objective's L1 partition; keep the pair whose L2 key is smaller.

    Ties keep step-time's. Deterministic: both runs are.
    """
    other = timed("partition-microbatches", partition_microbatches, trie.lengths, trie.lcp,
                  capacity=options.capacity, dp=options.dp, options=L1Options(objective="compression"))
    if other.num_microbatches > SECOND_START_MAX_CONSUMERS or _same_microbatches(other, partition):
        return partition, placement
    if options.verify:
        verify_partition(trie.lengths, trie.lcp, other, options.capacity, options.dp)
    other_placement = timed("place-windows", place_windows, trie, other, capacity=options.capacity,
                            dp=options.dp, options=l2_options)
    keep_other = other_placement.key < placement.key
    line = (f"second start: L2 from compression's L1 partition ({other.candidate}) reached Phi "
            f"{other_placement.key[0]:.4e} against {placement.key[0]:.4e}; kept "
            f"{'compression' if keep_other else 'step-time'}'s")
    partition, placement = (other, other_placement) if keep_other else (partition, placement)
    return partition, dataclasses.replace(placement, decisions=placement.decisions + (line,))


def _same_microbatches(a: L1Partition, b: L1Partition) -> bool:
    """Whether two partitions group the trajectories alike (grid positions aside)."""
    return sorted(m.tobytes() for m in a.members) == sorted(m.tobytes() for m in b.members)


def build_producer_layout(batch: TrajectoryBatch, trie: TrieIR, positions: np.ndarray,
                          lengths: np.ndarray) -> CompactLayout:
    """The compact layout of a producer: the given prefixes of the trajectories at sorted `positions`.

    The prefix-truncated token arrays are views: offsets [start, start + length)
    per prefix into the step's token buffer, so nothing per-token is copied.
    Consecutive prefixes share min(LCP, both lengths) positions.
    """
    start = batch.token_offsets[trie.order[positions]]
    offsets = np.empty(2 * len(positions), dtype=np.int64)
    offsets[0::2] = start
    offsets[1::2] = start + lengths
    shared = member_lcps(trie, positions)
    shared[1:] = np.minimum(shared[1:], np.minimum(lengths[:-1], lengths[1:]))
    return build_layout(offsets, batch.tokens, np.arange(0, 2 * len(positions), 2, dtype=np.int64), shared)
