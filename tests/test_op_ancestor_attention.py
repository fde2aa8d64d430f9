"""Tests of full causal attention over compact rows (executor/ops/ancestor_attention).

Run (CPU, well under a minute):

    python -m pytest tests/test_op_ancestor_attention.py -q

Why these tests: a full-attention layer over a rollout tree is exact only if
every compact row reads exactly its ancestors, in causal order, as in its own
trajectory run alone, and if backward sums the gradient of every query that
read a shared prefix row into that row (paper, Section 3.4). So the blockwise
fast path is checked against the expanded-trajectory spec (outputs and the
gradients of q, k and v, float64), against torch's SDPA run per trajectory
(float32), on trees with duplicates, strict prefixes and no sharing, in two
row orders, with block budgets that force every kind of tile boundary; and
what it saves for backward is measured to be O(R), not O(n^2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts.compiler.ir.trajectories import TrajectoryBatch
from harts.compiler.passes.build_trie import build_trie, global_layout
from harts.executor.ops.ancestor_attention import AttentionViews, ancestor_attention, naive_ancestor_attention

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


PLAN_KEYS = ("row_parent", "row_position", "member_own_start", "member_run_offsets", "run_row_start", "run_length")


# ---------------------------------------------------------------- test helpers


def tree_token_lists(kind: str, seed: int = 0) -> list[list[int]]:
    """Token lists of a rollout tree, named by what they exercise."""
    rng = np.random.default_rng(seed)
    if kind == "single_path":
        return [rng.integers(0, 50, 61).tolist()]
    if kind == "no_sharing":
        return [[i + 100] + rng.integers(0, 50, int(rng.integers(2, 12))).tolist() for i in range(4)]
    if kind == "duplicates":
        base = rng.integers(0, 50, 14).tolist()
        return [base, base[:9] + [77, 78], list(base), base[:9] + [77, 78], list(base)]
    if kind == "strict_prefixes":
        base = rng.integers(0, 50, 20).tolist()
        # A prefix listed after its extension, one before, and a branch off a prefix.
        return [base, base[:7], base[:12], base[:12] + [99, 98, 97], base[:2]]
    if kind == "random":
        # Each new trajectory forks an earlier one at a random point; a tiny vocab
        # also creates accidental sharing across forks.
        lists = [rng.integers(0, 3, int(rng.integers(2, 25))).tolist()]
        for _ in range(8):
            parent = lists[int(rng.integers(len(lists)))]
            cut = int(rng.integers(0, len(parent) + 1))
            lists.append(parent[:cut] + rng.integers(0, 3, int(rng.integers(1, 20))).tolist())
        return [t if len(t) >= 2 else t + [0, 1] for t in lists]
    raise KeyError(kind)


def plan_arrays(token_lists, row_order: str = "creation", seed: int = 0) -> dict:
    """Microbatch plan arrays of one tree, plus each member's path for the tests.

    "creation": the trie's creation order (every member's own rows contiguous).
    "depth_major": rows sorted by (depth, random key), a valid order (parents
    first) in which every path breaks into many runs and siblings interleave.
    """
    batch = TrajectoryBatch.from_token_lists(token_lists)
    layout = global_layout(build_trie(batch), batch)
    parent = layout.row_parent.astype(np.int64)
    position = layout.row_depth.astype(np.int64)
    paths = [layout.member_rows(i) for i in range(len(layout.trajectories))]
    if row_order == "depth_major":
        order = np.lexsort((np.random.default_rng(seed).random(len(parent)), position))  # old row at each new slot
        new_of_old = np.empty_like(order)
        new_of_old[order] = np.arange(len(order))
        parent = np.where(parent[order] >= 0, new_of_old[np.maximum(parent[order], 0)], -1)
        position = position[order]
        paths = [new_of_old[p] for p in paths]
    elif row_order != "creation":
        raise KeyError(row_order)
    run_starts, run_lengths, offsets = [], [], [0]
    for path in paths:
        breaks = np.flatnonzero(np.diff(path) != 1) + 1
        for piece in np.split(path, breaks):
            run_starts.append(int(piece[0]))
            run_lengths.append(len(piece))
        offsets.append(len(run_starts))
    return {
        "row_parent": parent.astype(np.int32),
        "row_position": position.astype(np.int32),
        "member_trajectory": layout.trajectories,
        "member_own_start": layout.member_lcp,
        "member_run_offsets": np.asarray(offsets, dtype=np.int64),
        "run_row_start": np.asarray(run_starts, dtype=np.int64),
        "run_length": np.asarray(run_lengths, dtype=np.int64),
        "paths": paths,
    }


def views_of(arrays: dict) -> AttentionViews:
    return AttentionViews.from_plan(**{key: arrays[key] for key in PLAN_KEYS})


def make_qkv(num_rows, heads, kv_heads, key_dim, value_dim, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    return leaf(num_rows, heads, key_dim), leaf(num_rows, kv_heads, key_dim), leaf(num_rows, kv_heads, value_dim)


def outputs_and_grads(fn, q, k, v, seed=1, **kw):
    o = fn(q, k, v, **kw)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(o.dtype)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


# ---------------------------------------------------------------- fast vs spec

KINDS = ["random", "duplicates", "strict_prefixes", "single_path", "no_sharing"]
ORDERS = ["creation", "depth_major"]
HEADS = {"mha": (2, 2, 6, 6), "gqa": (4, 2, 6, 6), "mqa_mla": (3, 1, 7, 5)}  # H, Hkv, Dk, Dv


@pytest.mark.parametrize("block_tokens", [1, 5, 16, 4096], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("heads", list(HEADS), ids=str)
@pytest.mark.parametrize("order", ORDERS, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_blocked_matches_naive_in_float64(kind, order, heads, block_tokens):
    arrays = plan_arrays(tree_token_lists(kind, seed=3), order, seed=3)
    views = views_of(arrays)
    q, k, v = make_qkv(views.num_rows, *HEADS[heads])
    fast = outputs_and_grads(ancestor_attention, q, k, v, views=views, block_tokens=block_tokens)
    spec = outputs_and_grads(naive_ancestor_attention, q, k, v, views=views)
    for name, a, b in zip(("o", "dq", "dk", "dv"), fast, spec):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("block_tokens", [7, 32, 256], ids=lambda b: f"B{b}")
def test_long_single_path_with_tiny_blocks(block_tokens):
    """One 300-token path: many query tiles x key chunks, masks only on diagonal chunks."""
    rng = np.random.default_rng(0)
    views = views_of(plan_arrays([rng.integers(0, 9, 300).tolist()]))
    q, k, v = make_qkv(views.num_rows, 4, 2, 8, 8)
    fast = outputs_and_grads(ancestor_attention, q, k, v, views=views, block_tokens=block_tokens)
    spec = outputs_and_grads(naive_ancestor_attention, q, k, v, views=views)
    for a, b in zip(fast, spec):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("order", ORDERS, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_matches_sdpa_per_trajectory_in_float32(kind, order):
    """Independent of the views: every trajectory (duplicates included) against SDPA on its own path."""
    lists = tree_token_lists(kind, seed=5)
    arrays = plan_arrays(lists, order, seed=5)
    views = views_of(arrays)
    heads, kv_heads, key_dim, value_dim = HEADS["gqa"]
    q, k, v = make_qkv(views.num_rows, heads, kv_heads, key_dim, value_dim, dtype=torch.float32)
    o = ancestor_attention(q, k, v, views, block_tokens=8)
    for member, path in enumerate(arrays["paths"]):
        assert len(path) == len(lists[arrays["member_trajectory"][member]])
        path_t = torch.from_numpy(path)
        q_1HnD, k_1HnD, v_1HnD = (x[path_t].transpose(0, 1)[None] for x in (q, k, v))
        expected = F.scaled_dot_product_attention(q_1HnD, k_1HnD, v_1HnD, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(o[path_t], expected[0].transpose(0, 1), rtol=0, atol=1e-5)


def test_plan_from_the_compiler():
    """Views straight from `hartsc`'s lowered microbatches (memory order, split runs) match SDPA per trajectory."""
    from harts.compiler.pipeline import CompileOptions, compile_batch

    lists = tree_token_lists("random", seed=11) + tree_token_lists("strict_prefixes", seed=2)
    result = compile_batch(TrajectoryBatch.from_token_lists(lists), CompileOptions(capacity=64, chunk_size=4,
                                                                                  verify=True))
    assert len(result.plan.microbatches) >= 2
    for microbatch in result.plan.microbatches:
        views = AttentionViews.from_microbatch(microbatch)
        q, k, v = make_qkv(views.num_rows, 2, 1, 4, 4, dtype=torch.float32, seed=len(microbatch["row_parent"]))
        o = ancestor_attention(q, k, v, views, block_tokens=16)
        offsets = microbatch["member_run_offsets"]
        for i, trajectory in enumerate(microbatch["member_trajectory"]):
            runs = range(offsets[i], offsets[i + 1])
            path = torch.from_numpy(np.concatenate([np.arange(microbatch["run_row_start"][j],
                                                              microbatch["run_row_start"][j]
                                                              + microbatch["run_length"][j]) for j in runs]))
            assert len(path) == len(lists[trajectory])
            q_1HnD, k_1HnD, v_1HnD = (x[path].transpose(0, 1)[None] for x in (q, k, v))
            expected = F.scaled_dot_product_attention(q_1HnD, k_1HnD, v_1HnD, is_causal=True, enable_gqa=True)
            torch.testing.assert_close(o[path], expected[0].transpose(0, 1), rtol=0, atol=1e-5)


def test_gradcheck_on_a_small_tree():
    views = views_of(plan_arrays(tree_token_lists("duplicates", seed=1)))
    q, k, v = make_qkv(views.num_rows, 2, 1, 3, 2)
    assert torch.autograd.gradcheck(lambda q, k, v: ancestor_attention(q, k, v, views, block_tokens=4), (q, k, v))


def test_bfloat16_inputs_compute_in_float32():
    views = views_of(plan_arrays(tree_token_lists("random", seed=2)))
    q, k, v = make_qkv(views.num_rows, 4, 2, 8, 8, dtype=torch.bfloat16)
    o = ancestor_attention(q, k, v, views, block_tokens=8)
    reference = ancestor_attention(q.float(), k.float(), v.float(), views, block_tokens=8)
    assert o.dtype == torch.bfloat16
    # Only the final rounding to bfloat16 differs.
    torch.testing.assert_close(o, reference.to(torch.bfloat16), rtol=0, atol=0)
    dq, = torch.autograd.grad(o.float().sum(), q)
    q32 = q.detach().float().requires_grad_()
    dq32, = torch.autograd.grad(ancestor_attention(q32, k.float(), v.float(), views, block_tokens=8).sum(), q32)
    assert dq.dtype == torch.bfloat16
    torch.testing.assert_close(dq.float(), dq32, rtol=2e-2, atol=2e-2 * float(dq32.abs().max()))


def test_scale_is_used():
    views = views_of(plan_arrays(tree_token_lists("random", seed=4)))
    q, k, v = make_qkv(views.num_rows, 2, 2, 4, 4)
    fast = ancestor_attention(q, k, v, views, scale=0.3, block_tokens=3)
    torch.testing.assert_close(fast, naive_ancestor_attention(q, k, v, views, scale=0.3), rtol=0, atol=1e-12)
    torch.testing.assert_close(ancestor_attention(q, k, v, views, scale=0.5),
                               ancestor_attention(q, k, v, views), rtol=0, atol=1e-12)  # Dk=4: 4 ** -0.5


# ---------------------------------------------------------------- memory


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while running fn."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_saved_memory_is_linear_in_rows_not_quadratic_in_path():
    """A 2048-token path: the fast path saves q, k, v, o and lse only; the spec saves [H, n, n] matrices."""
    n, heads, dim = 2048, 2, 8
    views = views_of(plan_arrays([np.arange(n).tolist()]))
    q, k, v = make_qkv(n, heads, heads, dim, dim, dtype=torch.float32)
    fast = saved_bytes(lambda: ancestor_attention(q, k, v, views, block_tokens=128))
    linear = 4 * n * heads * (4 * dim + 1)  # float32 q, k, v, o and lse
    assert fast <= linear
    assert fast < n * n * 4 / 20  # far below even one head's float32 [n, n]
    spec = saved_bytes(lambda: naive_ancestor_attention(q, k, v, views))
    assert spec >= heads * n * n * 8  # the spec keeps at least the float64 probabilities


# ---------------------------------------------------------------- validation


def test_views_skip_members_that_created_no_row():
    arrays = plan_arrays(tree_token_lists("duplicates"))
    views = views_of(arrays)
    own = np.array([start < len(path) for start, path in zip(arrays["member_own_start"], arrays["paths"])])
    assert views.view_member.tolist() == np.flatnonzero(own).tolist()
    assert views.num_views < len(arrays["paths"])
    assert sorted(views.query_rows(0, views.num_views).tolist()) == list(range(views.num_rows))


def broken(arrays: dict, **changes) -> dict:
    out = {key: np.array(arrays[key], copy=True) for key in PLAN_KEYS}
    out.update(changes)
    return out


REJECTIONS = {
    "parent_after_row": "must be -1 or < r",
    "wrong_position": "row_position must be",
    "run_not_a_chain": "is not a parent chain",
    "run_skips_a_fork": "does not continue its path",
    "row_created_twice": "own rows must cover every row once",
    "own_start_past_end": "member_own_start must be in",
    "runs_count": "must both have",
}


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_views_reject_inconsistent_plans(case):
    arrays = plan_arrays(tree_token_lists("random", seed=1))
    good = broken(arrays)
    position = good["row_position"].copy()
    position[3] += 1
    longer = good["run_length"].copy()
    longer[0] += 1  # member 0's path now runs into member 1's first row, whose parent is elsewhere
    assert good["row_parent"][good["run_length"][0]] != good["run_length"][0] - 1
    changes = {
        "parent_after_row": {"row_parent": np.where(np.arange(len(good["row_parent"])) == 2, 5, good["row_parent"])},
        "wrong_position": {"row_position": position},
        "run_not_a_chain": {"run_length": longer},
        "run_skips_a_fork": {"run_row_start": good["run_row_start"][::-1].copy(),
                             "run_length": good["run_length"][::-1].copy()},
        "row_created_twice": {"member_own_start": np.zeros_like(good["member_own_start"])},
        "own_start_past_end": {"member_own_start": good["member_own_start"] + 100},
        "runs_count": {"run_length": good["run_length"][:-1]},
    }[case]
    with pytest.raises(ValueError, match=REJECTIONS[case]):
        AttentionViews.from_plan(**broken(arrays, **changes))


@pytest.mark.parametrize("case", ["heads_not_multiple", "wrong_rows", "key_dim", "dtype_mismatch", "int_input",
                                  "block_zero", "block_float", "scale_negative", "not_views"])
def test_inputs_are_validated(case):
    views = views_of(plan_arrays(tree_token_lists("random")))
    q, k, v = make_qkv(views.num_rows, 4, 2, 6, 6)
    args = dict(q=q, k=k, v=v, views=views)
    args.update({
        "heads_not_multiple": dict(k=k[:, :1].expand(-1, 3, -1), v=v[:, :1].expand(-1, 3, -1)),
        "wrong_rows": dict(q=q[1:]),
        "key_dim": dict(k=k[..., :5]),
        "dtype_mismatch": dict(v=v.float()),
        "int_input": dict(q=q.long()),
        "block_zero": dict(block_tokens=0),
        "block_float": dict(block_tokens=8.0),
        "scale_negative": dict(scale=-1.0),
        "not_views": dict(views=None),
    }[case])
    with pytest.raises(ValueError):
        ancestor_attention(**args)


@pytest.mark.parametrize("threshold", [0, 5, 12], ids=lambda t: f"from{t}")
@pytest.mark.parametrize("kind", ["random", "duplicates", "strict_prefixes"], ids=str)
def test_a_query_subset_reads_every_row_as_keys(kind, threshold):
    """A window consumer queries only its uncached rows (a suffix of each view's own rows) and reads
    the rest as keys: outputs and gradients equal the full op's on those rows, and the spec's."""
    arrays = plan_arrays(tree_token_lists(kind, seed=5), seed=5)
    views = views_of(arrays)
    is_query = np.asarray(arrays["row_position"]) >= threshold
    subset = views.with_queries(is_query)
    assert subset.num_queries == int(is_query.sum())
    q, k, v = make_qkv(views.num_rows, *HEADS["gqa"])
    rows = torch.from_numpy(np.flatnonzero(is_query))
    q_sub = q.detach()[rows].requires_grad_()
    do = torch.randn(subset.num_queries, 4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    full = ancestor_attention(q, k, v, views, block_tokens=5)
    want = torch.autograd.grad(full[rows], (q, k, v), do)
    for op in (lambda *x: ancestor_attention(*x, block_tokens=5), naive_ancestor_attention):
        o = op(q_sub, k, v, subset)
        torch.testing.assert_close(o, full.detach()[rows], rtol=0, atol=1e-10)
        dq, dk, dv = torch.autograd.grad(o, (q_sub, k, v), do)
        torch.testing.assert_close(dq, want[0][rows], rtol=0, atol=1e-10)
        torch.testing.assert_close(dk, want[1], rtol=0, atol=1e-10)
        torch.testing.assert_close(dv, want[2], rtol=0, atol=1e-10)


def test_a_query_subset_must_leave_out_a_prefix_of_each_view():
    arrays = plan_arrays(tree_token_lists("random", seed=5), seed=5)
    views = views_of(arrays)
    is_query = np.asarray(arrays["row_position"]) < 4      # leaves out a suffix: not what a cache produces
    with pytest.raises(ValueError, match="prefix of its own rows"):
        views.with_queries(is_query)


def test_default_block_tokens_grows_tiles_on_an_accelerator_within_the_score_budget():
    from harts.executor.ops.ancestor_attention import CPU_BLOCK_TOKENS, default_block_tokens
    from harts.executor.ops.ancestor_attention.blocked import (ACCELERATOR_MIN_BLOCK_TOKENS,
                                                               ACCELERATOR_SCORE_TILE_BYTES)

    # On a CPU arithmetic dominates and the masked half of a larger diagonal tile would cost time.
    assert default_block_tokens(torch.device("cpu"), 1) == default_block_tokens(torch.device("cpu"), 128) == CPU_BLOCK_TOKENS
    accelerator = torch.device("cuda")   # a device object only
    picked = {heads: default_block_tokens(accelerator, heads) for heads in (1, 4, 8, 32, 128)}
    assert picked == {1: 8192, 4: 4096, 8: 2048, 32: 1024, 128: 1024}
    for heads, block in picked.items():   # the largest power of two in budget, never below the floor
        assert block == ACCELERATOR_MIN_BLOCK_TOKENS or heads * block ** 2 * 4 <= ACCELERATOR_SCORE_TILE_BYTES
        assert block == 8192 or heads * (2 * block) ** 2 * 4 > ACCELERATOR_SCORE_TILE_BYTES
