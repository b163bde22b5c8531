"""Helpers of the ggx-repack tests: run a graph with its repackable weights in CPU_REPACK."""
from __future__ import annotations

import numpy as np

from ggx import registry
from ggx.backend import Buffer, BufferType
from ggx.conformance.harness import place, storage_tensors
from ggx.graph import build_graph
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx_repack.buffer import RepackBufferType


def repack_buft(device) -> RepackBufferType:
    """The registered CPU_REPACK buffer type of `device`."""
    found = [b for b in registry.extra_buffer_types(device) if isinstance(b, RepackBufferType)]
    assert len(found) == 1, registry.extra_buffer_types(device)
    return found[0]


def alloc(buft: BufferType, tensors: list[Tensor]) -> Buffer:
    """One buffer of `buft` holding `tensors` back to back (get_alloc_size bytes each)."""
    offsets, size = [], 0
    for t in tensors:
        size = (size + buft.alignment - 1) // buft.alignment * buft.alignment
        offsets.append(size)
        size += max(buft.get_alloc_size(t), 1)
    buf = buft.alloc_buffer(size)
    for t, off in zip(tensors, offsets):
        t.buffer, t.offset = buf, off
        buf.init_tensor(t)
    return buf


def repackable_weights(graph, buft: RepackBufferType) -> list[Tensor]:
    """Leaf weights of MUL_MAT / MUL_MAT_ID nodes that CPU_REPACK would take (as select_buft does)."""
    found = []
    for n in graph.nodes:
        if n.op in (Op.MUL_MAT, Op.MUL_MAT_ID):
            a = n.src[0]
            if a in graph.leafs and a.view_src is None and buft.layout_for(a) is not None and a not in found:
                if n.op is Op.MUL_MAT_ID or (a.ne[2] == 1 and a.ne[3] == 1):
                    found.append(a)
    return found


def run_repacked(device, backend, buft: RepackBufferType, out: Tensor, inputs: dict) -> tuple[np.ndarray, list]:
    """Compute `out` on `device` with the repackable weights in `buft`, the rest in host memory.
    Returns (values in numpy order, the weights that were repacked)."""
    from ggx.compute import get_tensor_data

    graph = build_graph(out)
    weights = repackable_weights(graph, buft)
    rest = [t for t in storage_tensors(graph) if t not in weights]
    if weights:
        alloc(buft, weights)
    place(device.buffer_type(), rest)
    for leaf, raw in inputs.items():
        leaf.buffer.set_tensor(leaf, raw, 0)
    for n in graph.nodes:
        if not n.op.is_view:
            assert device.supports_op(n), f"{n.describe()} on {[s.data_buffer.buft.name for s in n.src]}"
    backend.graph_compute(graph)
    backend.synchronize()
    return get_tensor_data(out).reshape(tuple(reversed(out.ne))), weights
