"""Helpers to run a graph on the reference backend without the allocator: one buffer per root tensor."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pytest

import ggx
from ggx.host import tensor_array
from ggx.reference import RefBackendReg
from ggx.reference.codec import encode
from ggx.tensor import Tensor

_REG = RefBackendReg()
DEVICE = _REG.devices()[0]
BACKEND = DEVICE.init_backend()


def raw_input(t: Tensor, value: np.ndarray) -> np.ndarray:
    """Bytes for a leaf: uint8 arrays are raw storage bytes, anything else values in numpy order."""
    value = np.asarray(value)
    if value.dtype == np.uint8:
        return value.reshape(-1)
    vals = value.reshape(t.ne[3], t.ne[2], t.ne[1], t.ne[0])
    return np.ascontiguousarray(encode(vals, t.type)).view(np.uint8).reshape(-1)


def _raw_bytes(t: Tensor) -> np.ndarray:
    """A copy of all the bytes of t's root storage."""
    root = t.root
    return root.buffer.host_view()[root.offset: root.offset + root.nbytes].copy()


def _run_on_ref(outputs: Sequence[Tensor] | Tensor, inputs: Mapping[Tensor, np.ndarray]) -> list[np.ndarray]:
    """Allocate each root tensor of the graph in its own host buffer, set inputs, compute on ref.

    Returns a copy of each output's memory as numpy (shape = reversed ne): values for F32, F16 and
    I32 outputs, raw blocks for quantized ones.
    """
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    graph = ggx.build_graph(outs)
    buft = DEVICE.buffer_type()
    for t in graph.leafs + graph.nodes:
        if t.view_src is None and t.buffer is None:
            buf = buft.alloc_buffer(t.nbytes)
            buf.clear(0)
            t.buffer, t.offset = buf, 0
    for t, value in inputs.items():
        t.buffer.set_tensor(t, raw_input(t, value))
    BACKEND.graph_compute(graph)
    return [np.array(tensor_array(t)) for t in outs]


@pytest.fixture
def run_on_ref() -> Callable[..., list[np.ndarray]]:
    """`run_on_ref(outputs, inputs)`: compute a graph on ref, one host buffer per root tensor."""
    return _run_on_ref


@pytest.fixture
def raw_bytes() -> Callable[[Tensor], np.ndarray]:
    """`raw_bytes(t)`: a copy of all the bytes of t's root storage."""
    return _raw_bytes


@pytest.fixture
def ref_device():
    return DEVICE
