"""Plain-text dump of every pass's IR, for golden tests and `hartsc --debug` readers.

The format is line-oriented and stable: one header line per pass, then one
line per object (segment, microbatch, sequence, export) with `key=value`
fields. Arrays print as Python lists. With sharing windows the lowered
records include each consumer's cached rows and decoder-row calls, then every
producer.
"""
from __future__ import annotations

import numpy as np

from harts.compiler.passes.build_trie import global_layout


def _list(values) -> str:
    return str(np.asarray(values).tolist()).replace(" ", "")


def format_compile_result(result, batch) -> str:
    """Every pass of a `CompileResult` compiled from `batch`, in pipeline order (the whole-step trie layout
    is rebuilt from the batch: the pipeline only counts it). Needs `compile_batch(..., keep_ir=True)`."""
    if result.microbatches is None:
        raise ValueError("this CompileResult holds no microbatch IR: compile it with compile_batch(..., keep_ir=True)")
    lines = []
    trie = result.trie
    layout = global_layout(trie, batch)
    lines.append(f"== build-trie: {len(trie.order)} trajectories, {trie.unique_tokens} unique tokens")
    lines.append(f"order={_list(trie.order)} lcp={_list(trie.lcp)} lengths={_list(trie.lengths)}")
    lines += _layout_lines(layout)
    part = result.partition
    lines.append(f"== partition-microbatches: {part.candidate}; j_init={list(part.j_init)}")
    for k, members in enumerate(part.members):
        lines.append(f"microbatch {k}: members={_list(members)} work={int(part.work[k])} "
                     f"replica={int(part.replica[k])} slot={int(part.slot[k])}")
    for k, mb in enumerate(result.microbatches):
        lines.append(f"== microbatch {k} (memory order): build-layout")
        lines += _layout_lines(mb.layout)
        s = mb.schedule
        lines.append(f"-- assign-rounds: {s.num_rounds} rounds")
        for v in range(mb.layout.num_segments):
            lines.append(f"segment {v}: t_pre={int(s.t_pre[v])} t_in={int(s.t_in[v])} round={int(s.segment_round[v])} "
                         f"next={int(s.segment_next[v])} head={bool(s.segment_is_head[v])}")
        r = mb.replay
        lines.append(f"-- plan-replay: {r.replay_tokens} replay tokens, {len(r.export_row)} exports")
        for q in range(len(r.sequence_round)):
            lo, hi = r.sequence_replay_offsets[q], r.sequence_replay_offsets[q + 1]
            lines.append(f"sequence {q}: round={int(r.sequence_round[q])} rows=[{int(r.sequence_row_start[q])},"
                         f"{int(r.sequence_row_start[q] + r.sequence_num_rows[q])}) anchor={int(r.sequence_start_depth[q])} "
                         f"replay={_list(r.replay_rows[lo:hi])} start_state={int(r.sequence_start_state[q])}")
        for e in range(len(r.export_row)):
            lines.append(f"export {e}: after_row={int(r.export_row[e])} sequence={int(r.export_sequence[e])} "
                         f"chunks={int(r.export_chunk[e])}")
    labelled = [(f"microbatch {k}", record) for k, record in enumerate(result.plan.microbatches)]
    labelled += [(f"producer {p}", record) for p, record in enumerate(result.plan.producers or [])]
    for label, record in labelled:
        lines.append(f"== lower: {label}")
        for key, value in record.items():
            shown = _list(value) if isinstance(value, np.ndarray) else str(value)
            lines.append(f"{key}={shown}")
    return "\n".join(lines) + "\n"


def _layout_lines(layout) -> list[str]:
    return [
        f"rows: token={_list(layout.row_token)} depth={_list(layout.row_depth)} parent={_list(layout.row_parent)} "
        f"q={_list(layout.row_multiplicity)}",
        f"segments: row_start={_list(layout.segment_row_start)} parent={_list(layout.segment_parent)}",
        f"paths: run_offsets={_list(layout.run_offsets)} run_row_start={_list(layout.run_row_start)} "
        f"run_length={_list(layout.run_length)}",
    ]
