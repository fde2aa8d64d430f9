"""L1 of the global planner: partition a step's trajectories into consumer microbatches.

Reads: `lengths` and `lcp` of the step's trajectories in lexicographic token
order (produced by the trie pass), the compact-token capacity T of one
microbatch and the data-parallel degree D.

Adds: an `L1Partition`: the members of every microbatch, its work C(M) (the
size of its complete compact layout), an initial (replica, slot) grid, the
name of the winning candidate, its J_init and a one-line-per-decision log.

Objective. The paper ranks candidates by J_init = (sum w, sum over slots of
max w, max over replicas of total w), lexicographically (Equation 1):
compression first. Replicas run slot j together, so the step's critical path
in compact rows is the middle term, and compression first can leave replicas
idle: a step whose trajectories all share one long prefix fits one microbatch
(K = D at D = 8 then splits off seven singletons), and J_init keeps that one
heavy microbatch beside seven nearly empty ones (one 8,000-token rollout with
1,999 branches, `bench_l1_objective.comb`: critical path 38,639 rows with
38,821 compact rows, the other replicas under 50 each; FFD's critical path
is 13,659). L2 cannot repair it: it never runs
more decoder rows than L1 chose. So by default (`objective="step-time"`) the
middle term is compared first, then the total, then the busiest replica, and
the candidates gain, for each count of Eq. A.4, the contiguous partition
whose heaviest microbatch is lightest (`contiguous_min_max`; not at D = 1,
where the critical path is the total work). The same step then has a
critical path of 9,409 rows, with 75,223 compact rows. On
ten paper-scale steps at D = 8 (many full slots) the two objectives' L1+L2
plans, pooled, differ by under 0.1 points in decoder work and balance and
under 0.2 in P5 (`bench_planners --dp 8 --steps 10 --l1-objective ...`);
single steps can differ either way after L2, though never at L1 (tree-step
seed 0: a 1.7% longer critical path in L2's cost model; `harts gen --kind
treestep --tasks 3` at D = 2: 68,734 rows against 64,966, where L2 improves
the paper's L1 plan more than this one). On steps of at most
`pipeline.SECOND_START_MAX_CONSUMERS` consumers the pipeline therefore also
runs L2 from the compression winner and keeps the better plan; paper-scale
steps have 74-104 consumers, where that would cost too much planning time.
`objective="compression"` is the paper's rule over the paper's candidates.
`benchmarks/bench_l1_objective.py` compares the two end to end.

Invariant afterwards (checked by `verify_partition`): every trajectory lies in
exactly one non-empty microbatch; every microbatch's C(M) <= T; the number of
microbatches K is a multiple of D; the (replica, slot) pairs are exactly the
D x K/D grid; `work[i] == C(members[i])`. Microbatch i sits at slot i // D,
and slots are ordered by decreasing heaviest member (slot 0 is heaviest).

Paper: Section 3.2 and Appendix A.1 ("L1: Prefix compression"). Our copy lost
Equations A.3 and A.4; the choices filling the gaps are:

* A.3 (contiguous exact search): F[k, e] = min over feasible s <= e of
  F[k-1, s-1] + lcp[s], F[0, -1] = 0. For a contiguous partition,
  sum C(M) = G + sum of lcp at the cut points, so F[k, N-1] + G is the least
  total work over all contiguous k-partitions. Feasible starts for an end e
  form a window [lo(e), e] whose both ends only move right, so each row is a
  sliding-window minimum, computed with a per-row sparse table in numpy.
  Ties between equal-work partitions take the leftmost start of the last group.
* A.4 (candidate counts): K_lo = max(K_min, D * ceil(|P_0| / D)), the
  smallest aligned count a contiguous partition can reach (greedy maximal
  filling P_0 has the fewest contiguous groups, so smaller counts are provably
  infeasible), then K_lo, K_lo + D, ..., K_lo + count_span * D, capped at
  D * floor(N / D) (every microbatch must be non-empty).
* The exact search runs when its table, N x K_hi cells (row k is built from
  row k-1, so every count up to the largest candidate K_hi is evaluated), has
  at most `exact_max_cells` cells; otherwise the scalable search runs on at
  most Q_max sampled counts: both endpoints, the lowest Q_max // 2 counts
  densely, and the rest evenly spread over the remaining range.
  The scalable search walks from P_0: splits for larger counts, merges for
  smaller ones. P_0 being count-minimal, merges below |P_0| always fail for
  contiguous groups, so under our A.4 only splits run; `contiguous_evolve`
  still merges when started from a finer partition.
* Greedy: ΔC = |x| - LCP(p,x) - LCP(x,q) + LCP(p,q) equals |x| - max(LCP(p,x),
  LCP(x,q)) (LCP(p,q) is the smaller of the two), i.e. x's longest shared
  prefix with any member. "Eliminate small groups": dissolve the lightest
  microbatch while all its members fit elsewhere, stop at the first that does
  not. Alignment moves the trajectory whose departure costs the fewest shared
  tokens; a plan whose aligned count would exceed N is dropped. The greedy
  candidate joins even when its count is outside A.4 (as the paper says).
  Each insertion scans every microbatch of eight plans, so greedy is left out
  when N x (its microbatch estimate) exceeds `greedy_max_cells` and a
  contiguous candidate exists (thousands of trajectories over hundreds of
  microbatches: seconds of greedy, where contiguous search's plans win).
* Ties: placement picks the lowest microbatch index; candidates tying on
  the objective keep the earlier one (contiguous counts ascending, then the
  min-max contiguous ones, then greedy).

This module runs the search; its pieces live in `harts.compiler.partition`:
`options` (L1Options), `candidate`, `contiguous` (A.3, the scalable search
and the min-max partitions), `greedy`, `assignment` (J_init, A.4's counts, the step-fits check)
and `verify` (verify_partition).

Legend for shape suffixes: P greedy plans, N positions, K microbatches, L sparse-table levels.
"""
from __future__ import annotations

import numpy as np

from harts.compiler.ir.partition import L1Partition
from harts.compiler.partition.assignment import candidate_counts, check_step_fits, initial_assignment
from harts.compiler.partition.candidate import Candidate, starts_to_candidate
from harts.compiler.partition.contiguous import (contiguous_evolve, contiguous_exact, contiguous_min_max,
                                                 exact_search_fits_int64, natural_partition, sample_counts)
from harts.compiler.partition.greedy import (GREEDY_ORDERS, align_by_singleton_splits, dense_lcp_table,
                                             eliminate_small_groups, greedy_candidates, greedy_fill,
                                             greedy_microbatch_estimate, greedy_orders)
from harts.compiler.partition.options import L1_OBJECTIVES, L1Options
from harts.compiler.partition.verify import verify_partition
from harts.compiler.prefix_cost import PrefixCostModel
from harts.schema.errors import PassFailedError

# The pieces live in `harts.compiler.partition`; these names stay importable from the pass.
__all__ = ["PASS_NAME", "GREEDY_ORDERS", "L1_OBJECTIVES", "L1Options", "L1Partition", "partition_microbatches",
           "verify_partition", "align_by_singleton_splits", "candidate_counts", "check_step_fits",
           "contiguous_evolve", "contiguous_exact", "contiguous_min_max", "dense_lcp_table",
           "eliminate_small_groups", "greedy_candidates", "greedy_fill", "greedy_orders", "initial_assignment",
           "natural_partition", "sample_counts"]

PASS_NAME = "partition_microbatches"


def _check_arguments(model: PrefixCostModel, capacity: int, dp: int, options: L1Options) -> None:
    if capacity < 1 or dp < 1:
        raise ValueError(f"capacity and dp must be >= 1, got capacity={capacity}, dp={dp}")
    if options.exact_max_cells < 0 or options.max_sampled_counts < 1 or options.count_span < 0:
        raise ValueError(f"L1Options out of range, got {options}")
    if options.objective not in L1_OBJECTIVES:
        raise ValueError(f"unknown L1 objective {options.objective!r}: use one of {', '.join(L1_OBJECTIVES)}")
    check_step_fits(model, capacity, dp, PASS_NAME)


def _no_aligned_partition(model: PrefixCostModel, capacity: int, dp: int, options: L1Options,
                          natural_count: int) -> PassFailedError:
    """The refusal when no candidate has a multiple of dp microbatches, with the dps that would work.

    The fewest microbatches known is the natural partition's or, fewer where
    it finds one, a greedy plan's (trajectories out of sorted order). Every
    count from there up to N is reachable by splitting groups (a part of a
    group fits whenever the group does), so the dps with a multiple in that
    range work.
    """
    n = model.num_trajectories
    fewest = natural_count
    if options.greedy and n:    # with dp 1 every greedy plan is aligned: their counts before alignment
        fewest = min([fewest, *(len(plan.work) for plan in greedy_candidates(model, capacity, 1))])
    working = [d for d in range(1, n + 1) if -(-fewest // d) * d <= n]
    nearest = sorted(sorted(working, key=lambda d: (abs(d - dp), d))[:4])
    return PassFailedError(PASS_NAME, f"no partition of {n} trajectories into a multiple of {dp} non-empty "
                                      f"microbatches fits capacity {capacity} (the fewest found is {fewest}, "
                                      f"and at most {n} can be non-empty)",
                           f"raise the capacity, or use a dp with a multiple between {fewest} and {n}, "
                           f"e.g. {' or '.join(map(str, nearest))}")


def _objective_rank(j_init: tuple[int, int, int], objective: str) -> tuple[int, int, int]:
    """The key candidates are ranked by (least first): J_init itself, or its critical path term first."""
    total, critical_path, busiest_replica = j_init
    if objective == "compression":
        return j_init
    return critical_path, total, busiest_replica


def partition_microbatches(lengths, lcp, *, capacity: int, dp: int, options: L1Options = L1Options()) -> L1Partition:
    """Run L1: pick the candidate partition ranked first by `options.objective` and place it on the grid.

    lengths: int[N] trajectory lengths in lexicographic order; lcp: int[N],
    lcp[0] = 0, lcp[i] = LCP(trajectory i-1, trajectory i). Deterministic.
    """
    model = PrefixCostModel.build(lengths, lcp)
    _check_arguments(model, capacity, dp, options)
    n = model.num_trajectories
    decisions = []
    total = model.total_unique_tokens
    k_min = dp * max(1, -(-total // (capacity * dp)))
    decisions.append(f"G={total} unique tokens, T={capacity}, D={dp}: K_min={k_min}")

    natural = natural_partition(model, capacity)
    counts = candidate_counts(model, capacity, dp, options, len(natural))
    if counts:
        decisions.append(f"natural partition P_0 has {len(natural)} groups; Eq. A.4 counts {counts[0]}..{counts[-1]} "
                         f"step {dp} ({len(counts)} counts)")
    else:
        decisions.append(f"natural partition P_0 has {len(natural)} groups: no multiple of {dp} between "
                         f"{len(natural)} and N={n}, no contiguous candidate")

    candidates: list[Candidate] = []
    if counts:
        if n * counts[-1] <= options.exact_max_cells and exact_search_fits_int64(n, capacity):
            found = contiguous_exact(model, capacity, counts)
            decisions.append(f"contiguous exact search over k<={counts[-1]} ({n * counts[-1]} cells): "
                             f"{len(found)} feasible counts")
            candidates += [starts_to_candidate(model, f"contiguous-exact k={k}", found[k]) for k in sorted(found)]
        else:
            sampled = sample_counts(counts, options.max_sampled_counts)
            found = contiguous_evolve(model, capacity, natural, sampled)
            decisions.append(f"contiguous scalable search ({n * counts[-1]} cells > {options.exact_max_cells}): "
                             f"{len(found)} of {len(sampled)} sampled counts reached")
            candidates += [starts_to_candidate(model, f"contiguous-scalable k={k}", found[k]) for k in sorted(found)]

    # At D = 1 the critical path is the total work: the exact search already holds the least of it.
    if counts and options.objective == "step-time" and dp > 1:
        found = contiguous_min_max(model, capacity, counts)
        decisions.append(f"contiguous min-max search: {len(found)} feasible counts")
        candidates += [starts_to_candidate(model, f"contiguous-min-max k={k}", found[k]) for k in sorted(found)]

    greedy_cells = n * greedy_microbatch_estimate(model, capacity, dp)
    skip_greedy = bool(candidates) and greedy_cells > options.greedy_max_cells
    if skip_greedy and options.greedy:
        decisions.append(f"greedy skipped: {greedy_cells} cells (trajectories x microbatches) > "
                         f"{options.greedy_max_cells}, and contiguous candidates exist")
    if options.greedy and n and not skip_greedy:
        plans = greedy_candidates(model, capacity, dp)
        if plans:
            best = min(range(len(plans)), key=lambda i: (len(plans[i].work), int(plans[i].work.sum()), i))
            decisions.append(f"greedy preselected '{plans[best].name}': K={len(plans[best].work)}, "
                             f"work={int(plans[best].work.sum())} (of {len(plans)} aligned plans)")
            candidates.append(plans[best])
        else:
            decisions.append("greedy: no plan could be aligned to a multiple of dp")

    if not candidates:
        raise _no_aligned_partition(model, capacity, dp, options, len(natural))

    best = None
    for index, candidate in enumerate(candidates):
        replica, slot, j_init = initial_assignment(candidate.work, dp)
        decisions.append(f"candidate {candidate.name}: K={len(candidate.work)} J_init={j_init}")
        rank = _objective_rank(j_init, options.objective)
        if best is None or rank < best[0]:
            best = (rank, j_init, index, replica, slot)
    _, j_init, index, replica, slot = best
    winner = candidates[index]
    decisions.append(f"selected {winner.name} with J_init={j_init} ({options.objective} first)")

    # Renumber microbatches to grid order: microbatch i sits at slot i // D, replica i % D.
    grid_order = np.lexsort((replica, slot))
    new_id = np.empty_like(grid_order)
    new_id[grid_order] = np.arange(len(grid_order))
    microbatch_of = new_id[winner.microbatch_of]
    by_microbatch = np.argsort(microbatch_of, kind="stable").astype(np.int64)
    bounds = np.cumsum(np.bincount(microbatch_of, minlength=len(grid_order)))[:-1]
    members = tuple(np.split(by_microbatch, bounds))
    return L1Partition(members=members, work=winner.work[grid_order].astype(np.int64),
                       replica=replica[grid_order], slot=slot[grid_order], candidate=winner.name,
                       j_init=j_init, decisions=tuple(decisions))
