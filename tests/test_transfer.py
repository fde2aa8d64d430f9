"""Index arrays reach the device in one copy, host-read fields stay on the host, and a round's
chunk layout is built once per microbatch rather than once per layer.

The point of all three is GPU time (a copy of pageable memory, or a read-back, stalls the
device); no GPU runs here, so these check the structure that avoids the stalls: the "meta"
device stands in for an accelerator (tensors with shapes and dtypes, no data).

Run: `python -m pytest tests/test_transfer.py -q`.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from harts.executor.layout import HOST_FIELDS, RoundCall, build_layout
from harts.executor.ops.linear_attention import chunk as chunk_op
from harts.executor.ops.transfer import to_device
from harts.executor.runtime import run_step

from fidelity import boundary_tree, compile_lists, tiny_kimi_linear

META = torch.device("meta")


def test_to_device_keeps_order_dtypes_and_shapes_across_mixed_inputs():
    arrays = [np.arange(6, dtype=np.int64).reshape(2, 3), torch.tensor([1.5, 2.5]), np.zeros(0, dtype=np.int64),
              np.array([True, False]), torch.arange(4, dtype=torch.int32), np.int64(7) * np.ones((1, 1), np.int64)]
    moved = to_device(arrays, META)
    assert [t.device.type for t in moved] == ["meta"] * len(arrays)
    want = [torch.as_tensor(a) for a in arrays]
    assert [(t.dtype, tuple(t.shape)) for t in moved] == [(w.dtype, tuple(w.shape)) for w in want]


def test_to_device_on_the_cpu_wraps_without_copying():
    host = np.arange(5, dtype=np.int64)
    (wrapped,) = to_device([host], torch.device("cpu"))
    assert wrapped.data_ptr() == host.__array_interface__["data"][0]
    np.testing.assert_array_equal(wrapped.numpy(), host)


def _leaves(obj, path="layout"):
    """(path, tensor, kept on the host?) for every tensor in an ExecLayout."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, list):
        for i, x in enumerate(obj):
            yield from _leaves(x, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), f"{path}.{f.name}")


def test_layout_to_device_moves_every_index_but_the_host_read_ones():
    lists = boundary_tree(np.random.default_rng(0))
    plan = compile_lists(lists, capacity=250, levels="l1+l2")
    offsets = np.asarray(plan.step["token_offsets"], dtype=np.int64)
    # Read as host lists by the runner (state bookkeeping) and the linear-attention op (geometry):
    # stated here, not read from HOST_FIELDS, so that dropping one there fails this test.
    host_names = {"cu_seqlens", "export_sequence", "export_chunk", "start_state", "start_external", "export_ids"}
    assert set(HOST_FIELDS) == {RoundCall} and set(HOST_FIELDS[RoundCall]) == host_names
    checked = 0
    for mb in plan.microbatches:
        for mode in ("compact", "nodewise", "expanded"):
            layout = build_layout(mb, offsets, int(plan.flags["chunk_size"]), mode, windows=mode == "compact")
            for path, tensor in _leaves(layout.to(META)):
                host = path.rsplit(".", 1)[-1] in host_names and ".calls.rounds[" in path
                assert tensor.device.type == ("cpu" if host else "meta"), path
                checked += 1
    assert checked > 50


def test_a_rounds_layout_is_built_once_per_geometry_not_per_layer():
    model = tiny_kimi_linear()
    plan = compile_lists(boundary_tree(np.random.default_rng(0)), capacity=250, levels="l1")
    offsets = np.asarray(plan.step["token_offsets"], dtype=np.int64)
    geometries = set()
    for mb in plan.microbatches:
        for call in build_layout(mb, offsets, 64).calls.rounds:
            geometries.add((tuple(call.cu_seqlens.tolist()), tuple(call.export_sequence.tolist()),
                            tuple(call.export_chunk.tolist())))
    linear_layers = sum(t == "linear_attention" for t in model.config.layer_types)
    assert linear_layers >= 2 and len(geometries) >= 2

    built, asked = [], []
    original, cached = chunk_op._RoundLayout.__init__, chunk_op._cached_layout

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    def asking(*args):
        asked.append(1)
        return cached(*args)
    asking.cache_clear = cached.cache_clear

    chunk_op._RoundLayout.__init__, chunk_op._cached_layout = counting, asking
    try:
        run_step(plan, model, mode="compact")
    finally:
        chunk_op._RoundLayout.__init__, chunk_op._cached_layout = original, cached
    # Every linear layer, forward and backward, reads the same rounds: one build per geometry.
    assert len(built) == len(geometries)
    assert len(asked) - len(built) >= (linear_layers - 1) * len(geometries)
    # The step's layouts go with the step: the next step's plan rarely repeats a geometry.
    assert cached.cache_info().currsize == 0
