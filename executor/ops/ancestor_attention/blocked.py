"""The fast path: ancestor attention over compact rows, blockwise, flash-style backward.

Each compact row's query reads the keys and values of its path (itself and
every earlier position), exactly as in its own trajectory run alone, and the
output lands back on the row. Views (members that created rows) are packed in
blocks of consecutive views whose key paths total at most `block_tokens`; a
longer view is a block alone. Within a block, queries go in tiles of at most
`block_tokens` and keys in chunks of at most `block_tokens`, so the largest
temporary is one score tile [H, B, B] plus one gathered chunk [B, Hkv, D].

Keys and values are gathered with `index_select` from the compact tensors and
their gradients are summed back with `index_add_`, so a shared prefix row
receives the gradient of every query that read it. Backward recomputes the
score tiles from the saved log-sum-exp (flash-attention 2), so what is saved
for backward is q, k, v, o and the lse: O(R * H * D), never O(n^2) and never
the trajectory-expanded total.

Legend: R compact rows, H query heads, Hkv key/value heads, G = H / Hkv query
heads per kv head, Dk query/key dim, Dv value dim, B block_tokens, Tq query
tile, Tk key chunk, Nq / Nk queries / keys of one block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from .views import AttentionViews

from harts.executor.ops.dtypes import compute_dtype_for
from harts.executor.ops.transfer import to_device

# On a CPU: 768. Arithmetic dominates there, and the masked half of a diagonal tile is wasted
# arithmetic, so smaller tiles pay as long as each matmul stays large enough to hide the Python
# overhead per tile. `python benchmarks/bench_attention_blocks.py --blocks 768,512,1024 --repeat 7`
# (forward + backward over whole steps): 768 took 0.79x-0.91x the time of 1024 for 2 heads of 24
# and 16 heads of 128 on both workloads, 512 0.82x-0.95x; in a wider run 256 did no better than 768
# and 2048 took 1.03x-1.25x.
CPU_BLOCK_TOKENS = 768
# The smallest B on an accelerator: one float32 score tile of 32 heads at 128 MiB.
ACCELERATOR_MIN_BLOCK_TOKENS = 1024
# On an accelerator a small model's step is bound by kernel launches, not arithmetic (the lent
# H200 ran tiny Kimi Linear at a third of the speed its compression predicts), and each tile and
# key chunk launches some fifteen kernels forward and twenty backward. There tiles grow, in powers
# of two, while one float32 score tile [H, B, B] stays within this budget (backward holds three).
ACCELERATOR_SCORE_TILE_BYTES = 256 * 2**20
ACCELERATOR_MAX_BLOCK_TOKENS = 8192


def default_block_tokens(device: torch.device, num_heads: int) -> int:
    """B for `ancestor_attention` on `device` with `num_heads` query heads: CPU_BLOCK_TOKENS on a
    CPU; on an accelerator the largest power of two up to ACCELERATOR_MAX_BLOCK_TOKENS whose float32
    score tile fits ACCELERATOR_SCORE_TILE_BYTES (never below ACCELERATOR_MIN_BLOCK_TOKENS)."""
    if device.type == "cpu":
        return CPU_BLOCK_TOKENS
    block = ACCELERATOR_MIN_BLOCK_TOKENS
    while 2 * block <= ACCELERATOR_MAX_BLOCK_TOKENS and num_heads * (2 * block) ** 2 * 4 <= ACCELERATOR_SCORE_TILE_BYTES:
        block *= 2
    return block


def check_inputs(q, k, v, views, scale, block_tokens) -> None:
    """Validate the public arguments; raise ValueError saying what was got."""
    if not isinstance(views, AttentionViews):
        raise ValueError(f"views must be an AttentionViews, got {type(views).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got dtype {x.dtype}")
        if x.dim() != 3:
            raise ValueError(f"{name} must be 3-D [R, heads, dim], got shape {tuple(x.shape)}")
        rows = views.num_queries if name == "q" else views.num_rows
        if x.shape[0] != rows:
            what = "queries" if name == "q" else "rows"
            raise ValueError(f"{name} must have {rows} rows (the views' {what}), got shape {tuple(x.shape)}")
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k must have q's head dim Dk={q.shape[2]}, got shape {tuple(k.shape)}")
    if v.shape[1] != num_kv_heads:
        raise ValueError(f"v must have k's Hkv={num_kv_heads} heads, got shape {tuple(v.shape)}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads H={num_heads} must be a positive multiple of kv heads Hkv={num_kv_heads}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise ValueError(f"scale must be None (Dk ** -0.5) or a positive number, got {scale!r}")
    if block_tokens is not None and (isinstance(block_tokens, bool) or not isinstance(block_tokens, int)
                                     or block_tokens < 1):
        raise ValueError(f"block_tokens must be None (the device's default) or a positive int, got {block_tokens!r}")


@dataclass(frozen=True, slots=True)
class _Block:
    """Index tensors of one block of views (on the compute device)."""

    query_rows: torch.Tensor  # [Nq] index into q/o of the rows queried, view by view, positions ascending
    query_pos: torch.Tensor   # [Nq]
    query_view: torch.Tensor  # [Nq] view index local to the block
    key_rows: torch.Tensor    # [Nk] rows of the key paths, view by view, positions 0..n-1
    key_pos: torch.Tensor     # [Nk]
    key_view: torch.Tensor    # [Nk]
    single_view: bool         # one view: key index == key position, no view mask
    first_query_pos: int      # single view only: own_start


@dataclass(frozen=True, slots=True)
class _Tile:
    query: slice               # into the block's query lists
    keys: tuple[tuple[slice, bool], ...]  # key chunks into the block's key lists, and whether a mask is needed


def _positions(lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Concatenate `arange(s, n)` over views: positions of a block's keys or queries."""
    counts = lengths - starts
    base = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(int(counts.sum()), dtype=np.int64) - base + np.repeat(starts, counts)


def _iter_blocks(views: AttentionViews, block_tokens: int, device: torch.device):
    """Expand one block's index arrays at a time: host memory O(block), not O(expanded total)."""
    for lo, hi in views.blocks(block_tokens):
        lengths = views.view_length[lo:hi]
        query_start = views.view_query_start[lo:hi]
        local = np.arange(hi - lo, dtype=np.int64)
        arrays = (
            views.query_slots(lo, hi),
            _positions(lengths, query_start),
            np.repeat(local, lengths - query_start),
            views.key_rows(lo, hi),
            _positions(lengths, np.zeros_like(lengths)),
            np.repeat(local, lengths),
        )
        yield _Block(*to_device(arrays, device), single_view=(hi - lo == 1), first_query_pos=int(query_start[0]))


def _tiles(block: _Block, block_tokens: int):
    """Query tiles of at most B rows, each with the key chunks it can see."""
    num_queries = block.query_rows.numel()
    num_keys = block.key_rows.numel()
    for a in range(0, num_queries, block_tokens):
        b = min(a + block_tokens, num_queries)
        if not block.single_view:
            # Multi-view blocks hold <= B keys: one chunk, masked by view and position.
            yield _Tile(slice(a, b), ((slice(0, num_keys), True),))
            continue
        # One view: query positions are first_query_pos + index, keys are positions 0..n-1.
        lo_pos, hi_pos = block.first_query_pos + a, block.first_query_pos + b - 1
        chunks = []
        for c in range(0, hi_pos + 1, block_tokens):
            d = min(c + block_tokens, hi_pos + 1)
            # Bottom-right causal: only a chunk reaching past the tile's first query needs a mask.
            chunks.append((slice(c, d), d - 1 > lo_pos))
        yield _Tile(slice(a, b), tuple(chunks))


def _mask(block: _Block, tile_query: slice, keys: slice) -> torch.Tensor:
    """[Tq, Tk] True where the query may read the key: same view, key position <= query position."""
    allowed = block.key_pos[keys][None, :] <= block.query_pos[tile_query][:, None]
    if not block.single_view:
        allowed &= block.key_view[keys][None, :] == block.query_view[tile_query][:, None]
    return allowed


def _heads_first(x_THD: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[T, H, D] -> [Hkv, G * T, D]: query head h = kv_head * G + g reads kv head h // G."""
    tokens, heads, dim = x_THD.shape
    group = heads // num_kv_heads
    return x_THD.view(tokens, num_kv_heads, group, dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * tokens, dim)


def _tokens_first(x_HGTD: torch.Tensor, tokens: int) -> torch.Tensor:
    """Inverse of `_heads_first`: [Hkv, G * T, D] -> [T, H, D]."""
    num_kv_heads, _, dim = x_HGTD.shape
    return x_HGTD.view(num_kv_heads, -1, tokens, dim).permute(2, 0, 1, 3).reshape(tokens, -1, dim)


def _masked_scores(qs_HQD, k_NHD, keys, needs_mask, block, tile_query, num_kv_heads, tokens):
    """Scaled scores [Hkv, G * Tq, Tk] of one tile against one gathered key chunk, masked to -inf."""
    k_HDK = k_NHD.permute(1, 2, 0)
    s_HQK = torch.bmm(qs_HQD, k_HDK)
    if needs_mask:
        allowed_TK = _mask(block, tile_query, keys)
        s_HQK.view(num_kv_heads, -1, tokens, s_HQK.shape[-1]).masked_fill_(~allowed_TK, float("-inf"))
    return s_HQK


def _forward(q_RHD, k_RHD, v_RHD, views, block_tokens, scale):
    num_queries, num_heads, _ = q_RHD.shape
    num_kv_heads, value_dim = v_RHD.shape[1], v_RHD.shape[2]
    o_RHD = q_RHD.new_empty(num_queries, num_heads, value_dim)
    lse_RH = q_RHD.new_empty(num_queries, num_heads)
    for block in _iter_blocks(views, block_tokens, q_RHD.device):
        for tile in _tiles(block, block_tokens):
            rows_T = block.query_rows[tile.query]
            tokens = rows_T.numel()
            qs_HQD = _heads_first(q_RHD.index_select(0, rows_T), num_kv_heads) * scale
            # Online softmax over key chunks. The first chunk holds key position 0 of every query's view
            # (a single view's chunks start at 0; a multi-view tile has one chunk), which every query
            # reads: its max is finite, so it starts the running max, sum and accumulator with nothing
            # to rescale, and no later max can be -inf. A one-chunk tile (every multi-view tile, every
            # short view) is then a plain softmax.
            for index, (keys, needs_mask) in enumerate(tile.keys):
                rows_K = block.key_rows[keys]
                s_HQK = _masked_scores(qs_HQD, k_RHD.index_select(0, rows_K), keys, needs_mask, block,
                                       tile.query, num_kv_heads, tokens)
                v_HKD = v_RHD.index_select(0, rows_K).permute(1, 0, 2)
                if index == 0:
                    max_HQ = s_HQK.amax(dim=-1)
                    p_HQK = s_HQK.sub_(max_HQ[..., None]).exp_()
                    sum_HQ = p_HQK.sum(dim=-1)
                    acc_HQD = torch.bmm(p_HQK, v_HKD)
                    continue
                new_max_HQ = torch.maximum(max_HQ, s_HQK.amax(dim=-1))
                p_HQK = s_HQK.sub_(new_max_HQ[..., None]).exp_()   # a fully masked row: exp(-inf) = 0
                rescale_HQ = torch.exp(max_HQ - new_max_HQ)
                sum_HQ = sum_HQ * rescale_HQ + p_HQK.sum(dim=-1)
                acc_HQD = torch.baddbmm(acc_HQD * rescale_HQ[..., None], p_HQK, v_HKD)
                max_HQ = new_max_HQ
            # Every query reads at least itself, so sum_HQ > 0 here.
            o_RHD.index_copy_(0, rows_T, _tokens_first(acc_HQD / sum_HQ[..., None], tokens))
            lse_RH.index_copy_(0, rows_T, _tokens_first((max_HQ + sum_HQ.log())[..., None], tokens)[..., 0])
    return o_RHD, lse_RH


def _backward(do_RHD, q_RHD, k_RHD, v_RHD, o_RHD, lse_RH, views, block_tokens, scale):
    num_kv_heads = k_RHD.shape[1]
    dq_RHD = torch.zeros_like(q_RHD)
    dk_RHD = torch.zeros_like(k_RHD)
    dv_RHD = torch.zeros_like(v_RHD)
    for block in _iter_blocks(views, block_tokens, q_RHD.device):
        for tile in _tiles(block, block_tokens):
            rows_T = block.query_rows[tile.query]
            tokens = rows_T.numel()
            qs_HQD = _heads_first(q_RHD.index_select(0, rows_T), num_kv_heads) * scale
            do_HQD = _heads_first(do_RHD.index_select(0, rows_T), num_kv_heads)
            o_HQD = _heads_first(o_RHD.index_select(0, rows_T), num_kv_heads)
            lse_HQ = _heads_first(lse_RH.index_select(0, rows_T)[..., None], num_kv_heads)[..., 0]
            delta_HQ = (do_HQD * o_HQD).sum(dim=-1)  # rowsum(dO * O) = rowsum(P * dP)
            dq_HQD = torch.zeros_like(qs_HQD)
            for keys, needs_mask in tile.keys:
                rows_K = block.key_rows[keys]
                k_KHD = k_RHD.index_select(0, rows_K)
                s_HQK = _masked_scores(qs_HQD, k_KHD, keys, needs_mask, block, tile.query, num_kv_heads, tokens)
                p_HQK = s_HQK.sub_(lse_HQ[..., None]).exp_()  # masked entries: exp(-inf) = 0
                v_HKD = v_RHD.index_select(0, rows_K).permute(1, 0, 2)
                # Summing over the G * Tq axis also sums the query heads sharing a kv head.
                dv_RHD.index_add_(0, rows_K, torch.bmm(p_HQK.transpose(1, 2), do_HQD).permute(1, 0, 2))
                dp_HQK = torch.bmm(do_HQD, v_HKD.transpose(1, 2))
                ds_HQK = p_HQK.mul_(dp_HQK.sub_(delta_HQ[..., None]))
                dq_HQD.baddbmm_(ds_HQK, k_KHD.permute(1, 0, 2))
                dk_RHD.index_add_(0, rows_K, torch.bmm(ds_HQK.transpose(1, 2), qs_HQD).permute(1, 0, 2))
            dq_RHD.index_copy_(0, rows_T, _tokens_first(dq_HQD * scale, tokens))
    return dq_RHD, dk_RHD, dv_RHD


class _AncestorAttention(torch.autograd.Function):
    """Saves q, k, v, o, lse only; backward recomputes every score tile."""

    @staticmethod
    def forward(ctx, q_RHD, k_RHD, v_RHD, views, block_tokens, scale):
        o_RHD, lse_RH = _forward(q_RHD, k_RHD, v_RHD, views, block_tokens, scale)
        ctx.save_for_backward(q_RHD, k_RHD, v_RHD, o_RHD, lse_RH)
        ctx.views, ctx.block_tokens, ctx.scale = views, block_tokens, scale
        return o_RHD

    @staticmethod
    @once_differentiable
    def backward(ctx, do_RHD):
        q_RHD, k_RHD, v_RHD, o_RHD, lse_RH = ctx.saved_tensors
        grads = _backward(do_RHD.to(o_RHD.dtype).contiguous(), q_RHD, k_RHD, v_RHD, o_RHD, lse_RH,
                          ctx.views, ctx.block_tokens, ctx.scale)
        return (*grads, None, None, None)


def ancestor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    views: AttentionViews,
    scale: float | None = None,
    block_tokens: int | None = None,
) -> torch.Tensor:
    """Causal softmax attention of every compact row over its ancestors; returns o [R, H, Dv].

    Args:
        q: [R, H, Dk] queries of the compact rows ([views.num_queries, H, Dk] for views
            made by `AttentionViews.with_queries`; the output then has those rows too).
        k: [R, Hkv, Dk] keys; H must be a multiple of Hkv (query head h reads kv head h // (H / Hkv)).
        v: [R, Hkv, Dv] values; Dv may differ from Dk (MLA).
        views: the microbatch's `AttentionViews` (same R).
        scale: score scale, default Dk ** -0.5.
        block_tokens: B, the most keys gathered per block and per chunk and the
            most queries per tile; peak temporary memory is O(H * B^2). None:
            `default_block_tokens` for q's device and heads.

    Row r's output equals the output at its position of plain causal attention
    over any trajectory that contains it. float64 computes in float64, other
    float dtypes in float32; the result has q's dtype.
    """
    check_inputs(q, k, v, views, scale, block_tokens)
    if block_tokens is None:
        block_tokens = default_block_tokens(q.device, q.shape[1])
    dtype = compute_dtype_for(q.dtype)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if views.num_queries == 0:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    q_RHD, k_RHD, v_RHD = (x.to(dtype).contiguous() for x in (q, k, v))
    o_RHD = _AncestorAttention.apply(q_RHD, k_RHD, v_RHD, views, block_tokens, scale)
    return o_RHD.to(q.dtype)
