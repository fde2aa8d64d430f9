"""Every invariant of a plan, from the plan alone (`check_plan`; `harts check` and `harts run` call it).

This checker reads only the plan's arrays (and, with `--trees`, the input
file); it shares no code with the compiler's passes, so it is an independent
witness that a plan is legal:

* every trajectory is a member of exactly one microbatch; each of its
  positions maps to a row with the right depth, parent chain and (with
  `--trees`) token; multiplicities count the member paths; no row is orphaned;
  every row is created by exactly one member (``member_own_start`` on: the
  query rows of the attention views);
* with ``vocab_size`` among the compile flags, every token lies below it;
* sharing is complete and exact: no two rows have the same (parent, token);
* every microbatch fits the capacity; the microbatches form a D x slots grid;
* sequences tile the rows in memory order, round-major, each a parent chain;
* every sequence starts at an anchor (a multiple of B) and replays fewer than
  B rows, exactly the path rows between the anchor and its first row;
* every non-zero start state is exported at a chunk boundary of its producer,
  by a sequence of an earlier round;
* the node-wise tables tile the rows into parent chains below their parents;
* with L2 windows (plans that carry ``producers``): every microbatch names its
  window; windows are ranges of consecutive slots shared by all replicas; at
  most one producer per (replica, window), each passing the row, capacity,
  sequence and segment checks above and the member-path checks for its
  prefixes (``prefix_trajectory``, ``prefix_length``); every cached row (``row_cached_by``)
  points into its own window's producer on its own replica, at a row with the
  same token and position whose parent is the producer row of the consumer
  row's parent; cached rows are prefix-closed (a cached row's parent is
  cached) and map to distinct producer rows; every producer row is used by at
  least two consumers; each consumer's decoder-row calls (``residual_*``)
  compute every uncached row exactly once and no cached row, as parent chains
  from a chunk-aligned anchor, starting from zero at position 0, an earlier
  export of its own after the row above the anchor, or its producer's export
  after that (cached) row.

`check_step_matches` adds, with the input file: the same trajectory ids and
trees in the same order and the same RL fields (masks, advantages,
log-probabilities). `check_step_counts` (`harts check`) recounts the step's
stored totals: `trie_unique_tokens` exactly, `l1_compact_tokens` within what
L1 and L2 guarantee.
"""
from __future__ import annotations

import numpy as np

from harts.schema.errors import PlanFormatError, VerificationError
from harts.schema.plan import Plan
from harts.schema.runs import expand_runs
from harts.schema.summary import decoder_rows


def fail(microbatch, invariant: str, detail: str):
    """`microbatch` is a microbatch index, or a label such as "producer 3"."""
    where = microbatch if isinstance(microbatch, str) else f"microbatch {microbatch}"
    raise VerificationError(invariant, f"{where}: {detail}")


def check_rows(i: int, mb: dict, capacity: int) -> None:
    C = len(mb["row_token"])
    if C > capacity:
        fail(i, "capacity", f"{C} compact rows > capacity {capacity}")
    parent = mb["row_parent"].astype(np.int64)
    position = mb["row_position"].astype(np.int64)
    rows = np.arange(C)
    roots = parent < 0
    if np.any(parent >= rows):
        fail(i, "parent row precedes its child in memory", f"row {int(np.flatnonzero(parent >= rows)[0])}")
    if np.any(position[roots] != 0) or np.any(position[~roots] != position[parent[~roots]] + 1):
        fail(i, "row position is its parent's plus one", "positions do not follow parents")
    # Only siblings can collide: rows under a parent with two or more children, and roots. Sorting just
    # those keys is what keeps this check cheap on long fork-free chains.
    child_count = np.bincount(parent[~roots], minlength=C)
    siblings = roots | (child_count[np.maximum(parent, 0)] >= 2)
    key = np.sort(parent[siblings] * (1 << 32) + mb["row_token"][siblings].astype(np.int64))
    if np.any(key[1:] == key[:-1]):
        fail(i, "identical prefixes share one row", "two rows have the same parent and token")


def check_members(i: int, mb: dict, step: dict, trees_tokens) -> np.ndarray:
    """A consumer's members: whole trajectories, each exactly once in the plan (counted by the caller)."""
    members = np.asarray(mb["member_trajectory"], dtype=np.int64)
    offsets = step["token_offsets"]
    # Bounds first, so a damaged plan is reported rather than indexed out of range.
    if len(members) and (members.min() < 0 or members.max() >= len(offsets) - 1):
        bad = int(members[(members < 0) | (members >= len(offsets) - 1)][0])
        fail(i, "members are trajectories of the step", f"member_trajectory holds {bad}, the step has "
             f"{len(offsets) - 1} trajectories")
    lengths = offsets[members + 1] - offsets[members]
    coverage = check_member_paths(i, mb, members, lengths, step, trees_tokens)
    if np.any(coverage != mb["row_multiplicity"]):
        fail(i, "multiplicity counts occurrences", "row_multiplicity differs from the member paths")
    return members


def check_producer_prefixes(label: str, producer: dict, step: dict, trees_tokens) -> None:
    """A producer's members: non-empty prefixes of the step's trajectories, as its rows' paths."""
    offsets = step["token_offsets"]
    members = np.asarray(producer["prefix_trajectory"], dtype=np.int64)
    lengths = np.asarray(producer["prefix_length"], dtype=np.int64)
    if len(lengths) != len(members):
        fail(label, "each prefix has a length", f"{len(lengths)} prefix_length for {len(members)} prefixes")
    if len(members) and (members.min() < 0 or members.max() >= len(offsets) - 1):
        fail(label, "prefixes are of trajectories of the step", "prefix_trajectory out of range")
    full = offsets[members + 1] - offsets[members]
    if np.any(lengths < 1) or np.any(lengths > full):
        bad = int(np.flatnonzero((lengths < 1) | (lengths > full))[0])
        fail(label, "a prefix is a non-empty prefix of its trajectory",
             f"prefix {bad} has {int(lengths[bad])} positions, its trajectory {int(full[bad])}")
    check_member_paths(label, producer, members, lengths, step, trees_tokens)


def check_member_paths(i, mb: dict, members: np.ndarray, lengths: np.ndarray, step: dict,
                       trees_tokens) -> np.ndarray:
    """Each member's runs map its positions 0..n-1 to a parent chain of rows with those positions (and, with
    the trees, its tokens); no row is orphaned; and every row is created by exactly one member, member j
    creating the rows of its positions from `member_own_start[j]` on (the query rows of the attention
    views). Returns each row's path count.

    Checked per run, not per position (a paper-scale step's paths hold ~50M positions on ~5M rows): a
    path is valid iff each run is a parent chain of rows, starts at the position where the member's
    previous run ended, and hangs below that run's last row; the first run then starts at a root (`row
    position is its parent's plus one`, checked before). Only the token comparison reads every position.
    `read_plan` has bounded every run within the rows and every offset table."""
    C = len(mb["row_token"])
    runs = np.asarray(mb["member_run_offsets"], dtype=np.int64)
    own_start = np.asarray(mb["member_own_start"], dtype=np.int64)
    k = len(members)
    if len(runs) != k + 1 or len(own_start) != k:
        fail(i, "each member has its run offsets and first own position",
             f"{len(runs)} member_run_offsets, {len(own_start)} member_own_start for {k} members")
    run_start = np.asarray(mb["run_row_start"], dtype=np.int64)   # runs run from 0 to their count
    run_length = np.asarray(mb["run_length"], dtype=np.int64)
    member_of_run = np.repeat(np.arange(k), np.diff(runs))

    def trajectory_of_run(bad: np.ndarray) -> str:
        return f"trajectory {int(members[member_of_run[np.flatnonzero(bad)[0]]])}"

    bad = (run_length < 1) | (run_start < 0) | (run_start + run_length > C)
    if np.any(bad):
        fail(i, "every semantic position maps to one row", f"{trajectory_of_run(bad)} has an empty run or one "
             "outside the rows")
    run_end = np.concatenate(([0], np.cumsum(run_length)))
    mapped = run_end[runs[1:]] - run_end[runs[:-1]]
    if np.any(mapped != lengths):
        j = int(np.flatnonzero(mapped != lengths)[0])
        fail(i, "every semantic position maps to one row",
             f"trajectory {int(members[j])} maps {int(mapped[j])} of {int(lengths[j])} positions")
    run_position = run_end[:-1] - run_end[runs[:-1]][member_of_run]   # position of each run's first row

    parent = np.asarray(mb["row_parent"], dtype=np.int64)
    rows = np.arange(C)
    # Rows r and r + 1 are linked when r + 1's parent is r; a run is a chain when all its links hold.
    linked = np.concatenate(([0], np.cumsum(parent[1:] == rows[1:] - 1)))
    last_row = run_start + run_length - 1
    bad = linked[last_row] - linked[run_start] != run_length - 1
    if np.any(bad):
        fail(i, "a trajectory's rows form a parent chain", trajectory_of_run(bad))
    bad = mb["row_position"][run_start] != run_position
    if np.any(bad):
        fail(i, "a position's row has its depth", trajectory_of_run(bad))
    continues = run_position > 0     # not a member's first run: it hangs below the previous run's last row
    bad = np.zeros(len(run_start), dtype=bool)
    bad[continues] = parent[run_start[continues]] != last_row[np.flatnonzero(continues) - 1]
    if np.any(bad):
        fail(i, "a trajectory's rows form a parent chain", trajectory_of_run(bad))
    if trees_tokens is not None:
        path_row = expand_runs(run_start, run_length)
        member_of = np.repeat(np.arange(k), lengths)
        position = np.arange(len(path_row)) - run_end[runs[:-1]][member_of]
        bad = mb["row_token"][path_row] != trees_tokens[step["token_offsets"][members][member_of] + position]
        if np.any(bad):
            fail(i, "a position's row has its token", f"trajectory {int(members[member_of[np.flatnonzero(bad)[0]]])}")

    def rows_covered(first: np.ndarray, end: np.ndarray) -> np.ndarray:
        """How many of the row ranges [first, end) hold each row (a difference array)."""
        keep = end > first
        delta = np.bincount(first[keep], minlength=C + 1) - np.bincount(end[keep], minlength=C + 1)
        return np.cumsum(delta[:C])

    coverage = rows_covered(run_start, run_start + run_length)
    if np.any(coverage == 0):
        fail(i, "no orphan rows", f"row {int(np.flatnonzero(coverage == 0)[0])} belongs to no trajectory")
    invariant = "each row is created by exactly one member, at its first own position on"
    if np.any((own_start < 0) | (own_start > lengths)):
        j = int(np.flatnonzero((own_start < 0) | (own_start > lengths))[0])
        fail(i, invariant, f"member {j} has member_own_start {int(own_start[j])} of {int(lengths[j])} positions")
    # Member j creates the rows of its runs' positions from own_start[j] on.
    skip = np.clip(own_start[member_of_run] - run_position, 0, run_length)
    created = rows_covered(run_start + skip, run_start + run_length)
    if np.any(created != 1):
        row = int(np.flatnonzero(created != 1)[0])
        fail(i, invariant, f"row {row} is created by {int(created[row])} members")
    return coverage


def check_sequences(i: int, mb: dict, chunk_size: int) -> None:
    B = chunk_size
    C = len(mb["row_token"])
    parent = mb["row_parent"].astype(np.int64)
    position = mb["row_position"].astype(np.int64)
    start, count = mb["sequence_row_start"], mb["sequence_num_rows"]
    Q = len(start)
    if Q == 0 and C == 0:
        return
    if start[0] != 0 or np.any(count <= 0) or np.any(start[1:] != start[:-1] + count[:-1]) or start[-1] + count[-1] != C:
        fail(i, "sequences tile the rows in memory order", "sequence row ranges overlap or leave gaps")
    rounds = mb["sequence_round"].astype(np.int64)
    if np.any(np.diff(rounds) < 0) or rounds[0] < 1:
        fail(i, "sequences are round-major", "sequence rounds are not ascending from 1")
    if int(mb["num_rounds"]) != int(rounds.max()):
        fail(i, "num_rounds is the last round", f"{mb['num_rounds']} != {int(rounds.max())}")
    expected_offsets = np.searchsorted(rounds, np.arange(1, rounds.max() + 2))
    if not np.array_equal(mb["round_offsets"], expected_offsets):
        fail(i, "round table matches sequence rounds", "round_offsets disagree")
    first = start
    inner = np.ones(C, dtype=bool)
    inner[first] = False
    if np.any(parent[inner] != np.arange(C)[inner] - 1):
        fail(i, "a sequence's output rows form a parent chain", "a continuation row's parent is not the row before it")
    replay_offsets = mb["sequence_replay_offsets"]
    replay = mb["replay_rows"].astype(np.int64)
    anchor = mb["sequence_start_position"].astype(np.int64)
    first_position = position[first]
    if np.any(anchor % B != 0) or np.any(anchor != first_position // B * B):
        fail(i, "a sequence starts at its nearest anchor", "start position is not a(s)")
    replay_len = np.diff(replay_offsets)
    if np.any(replay_len != first_position - anchor) or np.any(replay_len >= B):
        fail(i, "replay covers [a(s), s) and is shorter than a chunk", "replay length is wrong")
    export_row = mb["export_row"].astype(np.int64)
    export_seq = mb["export_sequence"].astype(np.int64)
    export_chunk = mb["export_chunk"].astype(np.int64)
    for e in range(len(export_row)):
        q, r = int(export_seq[e]), int(export_row[e])
        if not start[q] <= r < start[q] + count[q]:
            fail(i, "an export is an output row of its producer", f"export {e}")
        if (replay_len[q] + r - start[q] + 1) != export_chunk[e] * B:
            fail(i, "exports sit on chunk boundaries of their producer", f"export {e}")
    start_state = mb["sequence_start_state"].astype(np.int64)
    for q in range(Q):
        chain = replay[replay_offsets[q]:replay_offsets[q + 1]].tolist() + [int(first[q])]
        for a, b in zip(chain[:-1], chain[1:]):
            if parent[b] != a:
                fail(i, "replay rows are the path before the sequence", f"sequence {q}")
        top = parent[chain[0]]
        if anchor[q] == 0:
            if start_state[q] != -1 or top != -1:
                fail(i, "a sequence at position 0 starts from the zero state", f"sequence {q}")
            continue
        e = int(start_state[q])
        if not 0 <= e < len(export_row) or export_row[e] != top:
            fail(i, "a sequence starts from the state after the row before its anchor", f"sequence {q}")
        if rounds[export_seq[e]] >= rounds[q]:
            fail(i, "a start state is exported in an earlier round", f"sequence {q} (round {rounds[q]}) "
                 f"reads a state of round {rounds[export_seq[e]]}")


def check_segments(i: int, mb: dict) -> None:
    """Node-wise tables: segments tile memory, each a parent chain hanging below its parent segment's last row."""
    C = len(mb["row_token"])
    start = np.asarray(mb["segment_row_start"], dtype=np.int64)
    parent_seg = np.asarray(mb["segment_parent"], dtype=np.int64)
    level = np.asarray(mb["segment_level"], dtype=np.int64)
    if len(start) != len(parent_seg) + 1 or start[0] != 0 or start[-1] != C or np.any(np.diff(start) <= 0):
        fail(i, "segments tile the rows in memory order", "segment_row_start is not a partition")
    parent = mb["row_parent"].astype(np.int64)
    rows = np.arange(C)
    first = np.zeros(C, dtype=bool)
    first[start[:-1]] = True
    if np.any(parent[~first] != rows[~first] - 1):
        fail(i, "a segment is a parent chain", "an inner row's parent is not the row before it")
    roots = parent_seg < 0
    if np.any(parent_seg >= np.arange(len(parent_seg))):
        fail(i, "a parent segment comes earlier in memory", "segment_parent points forward")
    heads = parent[start[:-1]]
    if np.any(heads[roots] != -1) or np.any(heads[~roots] != start[1:][parent_seg[~roots]] - 1):
        fail(i, "a segment hangs below its parent segment's last row", "segment_parent disagrees with row_parent")
    if np.any(level[roots] != 0) or np.any(level[~roots] != level[parent_seg[~roots]] + 1):
        fail(i, "segment level is its depth in the segment tree", "segment_level is wrong")


def check_plan(plan: Plan, trees_tokens: np.ndarray | None = None, trees_offsets: np.ndarray | None = None) -> None:
    flags, step = plan.flags, plan.step
    dp, capacity, chunk_size = int(flags["dp"]), int(flags["capacity"]), int(flags["chunk_size"])
    num_trajectories = int(step["num_trajectories"])
    if len(step["token_offsets"]) != num_trajectories + 1:
        raise VerificationError("token_offsets has one entry per trajectory, plus one",
                                f"{len(step['token_offsets'])} entries for {num_trajectories} trajectories")
    if trees_offsets is not None and not np.array_equal(trees_offsets, step["token_offsets"]):
        raise VerificationError("plan matches --trees", _length_mismatch(step, np.asarray(trees_offsets)))
    K = len(plan.microbatches)
    if K % dp:
        raise VerificationError("microbatch count is a multiple of dp", f"{K} microbatches, dp {dp}")
    grid = {(int(mb["replica"]), int(mb["slot"])) for mb in plan.microbatches}
    if len(grid) != K or grid != {(d, j) for d in range(dp) for j in range(K // dp)}:
        raise VerificationError("microbatches form a replica x slot grid", "a (replica, slot) pair is missing or repeated")
    seen = np.zeros(num_trajectories, dtype=np.int64)
    for i, mb in enumerate(plan.microbatches):
        check_rows(i, mb, capacity)
        members = check_members(i, mb, step, trees_tokens)
        np.add.at(seen, members, 1)
        check_sequences(i, mb, chunk_size)
        check_segments(i, mb)
    if np.any(seen != 1):
        bad = int(np.flatnonzero(seen != 1)[0])
        raise VerificationError("every trajectory is in exactly one microbatch",
                                f"trajectory {step['ids'][bad]!r} appears {int(seen[bad])} times")
    if plan.producers is not None:
        check_windows(plan, dp, capacity, chunk_size, trees_tokens)
    vocab_size = flags.get("vocab_size")
    if vocab_size is not None:
        largest = max((int(r["row_token"].max()) for r in [*plan.microbatches, *(plan.producers or [])]
                       if len(r["row_token"])), default=-1)
        if largest >= int(vocab_size):
            raise VerificationError("tokens lie in the vocabulary the plan was compiled for",
                                    f"token {largest} >= vocab_size {vocab_size}")


def _length_mismatch(step: dict, trees_offsets: np.ndarray) -> str:
    """Where the plan's trajectories and the input file's first differ in count or length."""
    hint = " (was the plan compiled from another file?)"
    planned = np.diff(np.asarray(step["token_offsets"], dtype=np.int64))
    given = np.diff(trees_offsets.astype(np.int64))
    n = min(len(planned), len(given))
    differ = np.flatnonzero(planned[:n] != given[:n])
    if len(differ) == 0:
        return f"the plan has {len(planned)} trajectories, the input file {len(given)}{hint}"
    k = int(differ[0])
    return (f"trajectory {k} (id {step['ids'][k]!r} in the plan) has {int(planned[k])} tokens in the plan, "
            f"{int(given[k])} in the input file{hint}")


def _same_typed(a: list, b: list) -> bool:
    return len(a) == len(b) and all(type(x) is type(y) and x == y for x, y in zip(a, b))


def check_step_matches(step: dict, ids, fields: dict, trees=None) -> None:
    """The plan's step is the input file's: the same trajectory ids in the same order (outputs are keyed by
    them), the same `trees` when given (metadata, but `harts viz --tree` selects by it) and the same per-token
    RL fields, exactly (`fields`: loss_mask, advantages, old/ref_logprobs with NaN where a trajectory gave
    none, has_old/has_ref_logprobs; None for an absent one). Values compare with their types: 7 is not "7"."""
    planned = list(step["ids"])
    for name, plan_values, file_values in (("id", planned, list(ids)),
                                           ("tree", list(step["trees"]), None if trees is None else list(trees))):
        if file_values is None or _same_typed(plan_values, file_values):
            continue
        k = next((k for k, (a, b) in enumerate(zip(plan_values, file_values)) if not _same_typed([a], [b])),
                 min(len(plan_values), len(file_values)))
        raise VerificationError("plan matches --trees",
                                f"trajectory {k} has {name} {plan_values[k] if k < len(plan_values) else None!r} "
                                f"in the plan, {file_values[k] if k < len(file_values) else None!r} in the input file")
    offsets = np.asarray(step["token_offsets"], dtype=np.int64)
    for name, expected in fields.items():
        got = step[name]
        if got is None and expected is None:
            continue
        if got is None or expected is None or np.shape(got) != np.shape(expected):
            raise VerificationError("plan matches --trees", f"{name} is {'absent' if got is None else 'present'} "
                                    f"in the plan, {'absent' if expected is None else 'present'} in the input file")
        got = np.asarray(got)
        same = got == expected
        if got.dtype.kind == "f":   # NaN marks a log-probability a trajectory did not give
            same |= np.isnan(got) & np.isnan(expected)
        differ = np.flatnonzero(~same)
        if len(differ):
            first = int(differ[0])
            if len(got) == len(ids):   # one entry per trajectory (has_*_logprobs)
                where = f"trajectory {planned[first]!r}"
            else:
                k = int(np.searchsorted(offsets, first, side="right") - 1)
                where = f"trajectory {planned[k]!r} position {first - int(offsets[k])}"
            raise VerificationError("plan matches --trees", f"{name} differs from the input file at {where}")


def check_windows(plan: Plan, dp: int, capacity: int, chunk_size: int, trees_tokens=None) -> None:
    """L2: windows tile the slots, producers are legal, and every cached row is exactly its producer's row."""
    microbatches = plan.microbatches
    window_of_slot: dict[int, int] = {}
    for i, mb in enumerate(microbatches):
        if "window" not in mb or "row_cached_by" not in mb:
            fail(i, "a consumer names its window and cached rows", "window or row_cached_by is missing")
        if len(mb["row_cached_by"]) != len(mb["row_token"]):
            fail(i, "row_cached_by has one entry per row", f"{len(mb['row_cached_by'])} entries, "
                 f"{len(mb['row_token'])} rows")
        slot, window = int(mb["slot"]), int(mb["window"])
        if window_of_slot.setdefault(slot, window) != window:
            fail(i, "all replicas share window boundaries", f"slot {slot} is in windows {window_of_slot[slot]} and {window}")
    ordered = [window_of_slot[j] for j in sorted(window_of_slot)]
    if ordered and (ordered[0] != 0 or any(b - a not in (0, 1) for a, b in zip(ordered, ordered[1:]))):
        raise VerificationError("windows tile the slots", f"windows by slot are {ordered}")
    windows = 1 + max(ordered, default=-1)

    producer_at: dict[tuple[int, int], int] = {}
    for p, producer in enumerate(plan.producers):
        label = f"producer {p}"
        key = (int(producer["replica"]), int(producer["window"]))
        if not (0 <= key[0] < dp and 0 <= key[1] < windows):
            fail(label, "a producer belongs to a replica and window", f"replica {key[0]}, window {key[1]}")
        if key in producer_at:
            fail(label, "one producer per (replica, window)", f"replica {key[0]}, window {key[1]} repeats")
        producer_at[key] = p
        check_rows(label, producer, capacity)
        check_producer_prefixes(label, producer, plan.step, trees_tokens)
        check_sequences(label, producer, chunk_size)
        check_segments(label, producer)

    users = [np.zeros(len(pr["row_token"]), dtype=np.int64) for pr in plan.producers]
    for i, mb in enumerate(microbatches):
        cached_by = np.asarray(mb["row_cached_by"], dtype=np.int64)
        cached = cached_by >= 0
        if not cached.any():
            continue
        p = producer_at.get((int(mb["replica"]), int(mb["window"])))
        if p is None:
            fail(i, "every cached row is produced in its window on its replica", "no producer there")
        producer = plan.producers[p]
        rows = len(producer["row_token"])
        target = cached_by[cached]
        if target.max() >= rows:
            fail(i, "a cached row points at a producer row", f"row index {int(target.max())} >= {rows}")
        if np.bincount(target, minlength=rows).max() > 1:
            fail(i, "cached rows map to distinct producer rows", "two rows share a producer row")
        if np.any(producer["row_token"][target] != mb["row_token"][cached]) or \
                np.any(producer["row_position"][target] != mb["row_position"][cached]):
            fail(i, "a cached row's producer row has its token and position", "token or position differs")
        parent = np.asarray(mb["row_parent"], dtype=np.int64)[cached]
        producer_parent = np.asarray(producer["row_parent"], dtype=np.int64)[target]
        roots = parent < 0
        if np.any(producer_parent[roots] != -1):
            fail(i, "a cached row's producer parent is its parent's producer row", "a root maps below a parent")
        inner = parent[~roots]
        if np.any(cached_by[inner] < 0):
            fail(i, "cached rows are prefix-closed", "a cached row's parent is computed by the consumer")
        if np.any(producer_parent[~roots] != cached_by[inner]):
            fail(i, "a cached row's producer parent is its parent's producer row", "parents disagree")
        users[p][target] += 1
    for p, count in enumerate(users):
        if np.any(count < 2):
            fail(f"producer {p}", "every producer row is used by at least two consumers",
                 f"row {int(np.flatnonzero(count < 2)[0])} is used by {int(count.min())}")
    for i, mb in enumerate(microbatches):
        if np.any(np.asarray(mb["row_cached_by"]) >= 0):
            p = producer_at.get((int(mb["replica"]), int(mb["window"])))
            check_residual(i, mb, plan.producers[p] if p is not None else None, chunk_size)


def check_residual(i: int, mb: dict, producer: dict | None, chunk_size: int) -> None:
    """A consumer's decoder-row calls compute every uncached row once, on its trajectory's chunk grid,
    from a zero state at position 0, an earlier export of its own, or its producer's state at the anchor."""
    keys = ("residual_sequence_round", "residual_sequence_token_offsets", "residual_token_rows",
            "residual_sequence_replay", "residual_sequence_start_position", "residual_sequence_start_state",
            "residual_sequence_producer_state", "residual_export_sequence", "residual_export_chunk")
    present = [key in mb for key in keys]
    if not any(present):
        return   # a plan from an older hartsc: consumers run their complete layouts, nothing to check
    if not all(present):
        fail(i, "a consumer has all of its decoder-row calls", "some residual_* tables are missing")
    B = chunk_size
    cached_by = np.asarray(mb["row_cached_by"], dtype=np.int64)
    parent = np.asarray(mb["row_parent"], dtype=np.int64)
    position = np.asarray(mb["row_position"], dtype=np.int64)
    offsets = np.asarray(mb["residual_sequence_token_offsets"], dtype=np.int64)
    tokens = np.asarray(mb["residual_token_rows"], dtype=np.int64)
    replay = np.asarray(mb["residual_sequence_replay"], dtype=np.int64)
    rounds = np.asarray(mb["residual_sequence_round"], dtype=np.int64)
    anchor = np.asarray(mb["residual_sequence_start_position"], dtype=np.int64)
    own_state = np.asarray(mb["residual_sequence_start_state"], dtype=np.int64)
    producer_state = np.asarray(mb["residual_sequence_producer_state"], dtype=np.int64)
    export_sequence = np.asarray(mb["residual_export_sequence"], dtype=np.int64)
    export_chunk = np.asarray(mb["residual_export_chunk"], dtype=np.int64)
    Q = len(rounds)
    if len(offsets) != Q + 1 or offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 1):
        fail(i, "residual sequences tile their token list", "offsets do not")
    lengths = np.diff(offsets)
    if np.any(replay < 0) or np.any(replay > lengths):
        fail(i, "a residual sequence replays part of its tokens", "replay count out of range")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= len(cached_by)):
        fail(i, "residual token rows are consumer rows", "row index out of range")
    outputs = expand_runs(offsets[:-1] + replay, lengths - replay)
    produced = np.bincount(tokens[outputs], minlength=len(cached_by))
    if np.any(produced != (cached_by < 0)):
        row = int(np.flatnonzero(produced != (cached_by < 0))[0])
        fail(i, "every uncached row is computed exactly once, no cached row is", f"row {row} is output "
             f"{int(produced[row])} times (cached: {bool(cached_by[row] >= 0)})")
    first = tokens[offsets[:-1]]
    inner = np.ones(len(tokens), dtype=bool)
    inner[offsets[:-1]] = False
    if np.any(parent[tokens[inner]] != tokens[np.flatnonzero(inner) - 1]):
        fail(i, "a residual sequence is a parent chain", "a token row's parent is not the token before it")
    if np.any(anchor % B != 0) or np.any(position[first] != anchor):
        fail(i, "a residual sequence starts at its chunk-aligned anchor", "first row off the anchor")
    if np.any((own_state >= 0) & (producer_state >= 0)):
        fail(i, "a residual sequence has one start state", "both its own and a producer state")
    zero = (own_state < 0) & (producer_state < 0)
    if np.any(anchor[zero] != 0):
        fail(i, "only a sequence at position 0 starts from zero", "a sequence above 0 has no state")
    key_row = parent[first]   # the state a sequence starts from is the one after the row above its anchor
    has_own = np.flatnonzero(own_state >= 0)
    if len(has_own):
        e = own_state[has_own]
        if e.max() >= len(export_sequence):
            fail(i, "a residual start state is an export", "index out of range")
        source = export_sequence[e]
        if np.any(rounds[source] >= rounds[has_own]):
            fail(i, "a residual state is exported in an earlier round", "same or later round")
        end = offsets[source] + export_chunk[e] * B - 1
        if np.any(export_chunk[e] < 1) or np.any(end >= offsets[source + 1]) or np.any(tokens[end] != key_row[has_own]):
            fail(i, "a residual state is exported after the row above the anchor", "export at the wrong row")
    has_producer = np.flatnonzero(producer_state >= 0)
    if len(has_producer):
        if producer is None:
            fail(i, "a producer state comes from the window's producer", "no producer for this window")
        export_row = np.asarray(producer["export_row"], dtype=np.int64)
        if producer_state[has_producer].max() >= len(export_row):
            fail(i, "a producer state is one of its exports", "index out of range")
        above = key_row[has_producer]
        if np.any(above < 0) or np.any(cached_by[above] < 0) or np.any(
                export_row[producer_state[has_producer]] != cached_by[above]):
            fail(i, "a producer state is taken after the cached row above the anchor", "export at the wrong row")


def require_valid_plan(path: str, plan: Plan) -> None:
    """`check_plan` for a tool about to use a plan read from `path`: a violation is one line naming the file
    and the fix (a `PlanFormatError`), as for a plan that cannot be decoded."""
    try:
        check_plan(plan)
    except VerificationError as err:
        raise PlanFormatError(f"{path}: {err}; fix: recompile the plan with hartsc "
                              f"(`harts check {path}` reports the same)") from None


def check_step_counts(plan: Plan) -> None:
    """The step's stored totals agree with its trajectories (call after `check_plan`, which bounds the tables).

    `trie_unique_tokens`, the distinct non-empty prefixes of the step's
    trajectories (what `harts stats`' `compression_bound` divides by), is
    recounted from the trajectories' tokens as the rows hold them along each
    member's path. `l1_compact_tokens`, L1's complete-layout total, cannot be
    recounted once L2 has regrouped the consumers, so it is held to what L1
    and L2 guarantee: at least the distinct prefixes and the decoder rows the
    plan runs (L2 never runs more), at most the original tokens.
    """
    step = plan.step
    tokens, offsets = _trajectory_tokens(plan)
    unique = _distinct_prefixes(tokens, offsets)
    if int(step["trie_unique_tokens"]) != unique:
        raise VerificationError("trie_unique_tokens counts the distinct prefixes of the step's trajectories",
                                f"the plan stores {int(step['trie_unique_tokens'])}, its trajectories have {unique}")
    if "l1_compact_tokens" not in step:
        return
    l1 = int(step["l1_compact_tokens"])
    decoder = sum(decoder_rows(mb) for mb in plan.microbatches) + sum(
        len(producer["row_token"]) for producer in plan.producers or [])
    original = int(offsets[-1])
    if not max(unique, decoder) <= l1 <= original:
        raise VerificationError("l1_compact_tokens lies between the plan's decoder rows (and distinct prefixes) "
                                "and its original tokens", f"{l1} outside [{max(unique, decoder)}, {original}]")


def _trajectory_tokens(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """Every trajectory's tokens, read from its consumer's rows along its member path; (tokens, offsets)."""
    offsets = np.asarray(plan.step["token_offsets"], dtype=np.int64)
    tokens = np.zeros(int(offsets[-1]), dtype=np.int64)
    for mb in plan.microbatches:
        members = np.asarray(mb["member_trajectory"], dtype=np.int64)
        path_row = expand_runs(np.asarray(mb["run_row_start"], dtype=np.int64),
                               np.asarray(mb["run_length"], dtype=np.int64))
        # Runs are stored member by member, each member's in position order (`check_member_paths`).
        tokens[expand_runs(offsets[members], offsets[members + 1] - offsets[members])] = \
            np.asarray(mb["row_token"])[path_row]
    return tokens, offsets


def _distinct_prefixes(tokens: np.ndarray, offsets: np.ndarray) -> int:
    """Distinct non-empty prefixes of the sequences: sum of lengths less the longest common prefix of each
    sequence with the one before it in lexicographic order (big-endian bytes of non-negative ids sort so)."""
    sequences = [tokens[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    order = sorted(range(len(sequences)), key=lambda t: sequences[t].astype(">u8").tobytes())
    shared = 0
    for previous, current in zip(order, order[1:]):
        a, b = sequences[previous], sequences[current]
        n = min(len(a), len(b))
        differ = np.flatnonzero(a[:n] != b[:n])
        shared += int(differ[0]) if len(differ) else n
    return int(offsets[-1]) - shared
