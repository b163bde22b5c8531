"""A reference device with a transforming extra buffer type of its own, for the suite's weight
buffer type mode: XOR_TEST stores F32 weights xor-ed byte by byte (write-only, not ggml's layout)
and computes MUL_MAT from them; every other weight type it refuses."""
from __future__ import annotations

import numpy as np

from ggx.backend import Buffer, BufferType, BufferUsage, Device, ExtraBufferType, Launch
from ggx.errors import GGXUnsupported
from ggx.graph import Graph
from ggx.host import tensor_array
from ggx.ops import Op
from ggx.reference import RefBackend, RefDevice
from ggx.types import GType

XOR = 0x5A


class XorBuffer(Buffer):
    def __init__(self, buft: XorBufferType, size: int):
        super().__init__(buft, size, BufferUsage.WEIGHTS)
        self.data = np.zeros(size, np.uint8)

    def set_tensor(self, tensor, data, offset=0) -> None:
        if offset != 0 or data.size != tensor.nbytes:
            raise GGXUnsupported("XOR_TEST: set whole tensors only")
        start = tensor.data_offset
        self.data[start: start + data.size] = np.asarray(data, np.uint8) ^ XOR

    def get_tensor(self, tensor, offset=0, size=None):
        raise GGXUnsupported("XOR_TEST is write-only")

    def memset_tensor(self, tensor, value, offset=0, size=None) -> None:
        size = tensor.nbytes - offset if size is None else size
        self.data[tensor.data_offset + offset: tensor.data_offset + offset + size] = value

    def clear(self, value: int = 0) -> None:
        self.data[:] = value


class XorBufferType(ExtraBufferType):
    """`fault="wrong"`: the kernel forgets to undo the xor (its results are wrong)."""

    name = "XOR_TEST"

    def __init__(self, device: Device, fault: str = ""):
        self._device = device
        self.fault = fault

    @property
    def device(self) -> Device:
        return self._device

    def alloc_buffer(self, size: int) -> XorBuffer:
        return XorBuffer(self, size)

    def supports_op(self, op) -> bool:
        a = op.src[0]
        return (op.op is Op.MUL_MAT and a.type is GType.F32 and a.data_buffer is not None
                and a.data_buffer.buft is self and a.view_src is None and a.ne[2] == a.ne[3] == 1
                and op.src[1].type is GType.F32 and op.src[1].is_contiguous())

    def prepare_forward(self, op, n_threads: int = 1) -> Launch:
        a, b = op.src[0], op.src[1]

        def launch() -> None:
            raw = a.data_buffer.data[a.data_offset: a.data_offset + a.nbytes]
            w = (raw if self.fault == "wrong" else raw ^ XOR).view(np.float32).reshape(a.ne[1], a.ne[0])
            x = tensor_array(b).astype(np.float64)  # [ne3, ne2, n, k]
            tensor_array(op)[...] = (x @ w.astype(np.float64).T).astype(np.float32)

        return launch


class XorBackend(RefBackend):
    """The reference backend, except that nodes whose weight is in XOR_TEST run its launch."""

    def graph_compute(self, graph: Graph) -> None:
        buft = self.device.xor
        for node in graph.nodes:
            if node.op.is_view:
                continue
            if node.src and node.src[0].data_buffer is not None and node.src[0].data_buffer.buft is buft:
                buft.prepare_forward(node)()
            else:
                super().graph_compute(Graph([node], []))


class XorDevice(RefDevice):
    def __init__(self, fault: str = "", name: str = "xor-test"):
        super().__init__()
        self.name = name
        self.xor = XorBufferType(self, fault)

    def extra_buffer_types(self) -> list[ExtraBufferType]:
        return [self.xor]

    def supports_buft(self, buft: BufferType) -> bool:
        return buft is self.xor or super().supports_buft(buft)

    def supports_op(self, op) -> bool:
        a = op.src[0] if op.src else None
        if a is not None and a.data_buffer is not None and a.data_buffer.buft is self.xor:
            return self.xor.supports_op(op)
        return super().supports_op(op)

    def init_backend(self, **params) -> XorBackend:
        return XorBackend(self)
