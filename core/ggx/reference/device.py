"""The reference device layer: RefDevice, RefBackend, RefBackendReg (built into the core).

Memory is plain host memory (`ggx.host.HostBufferType` named "ref"); every op of the catalogue
is computed by `ggx.reference.ops` in float64 numpy. Slow and exact: the oracle the other
backends are checked against.
"""
from __future__ import annotations

from ..backend import Backend, BackendReg, BufferType, Device, DeviceType
from ..errors import GGXUnsupported
from ..graph import Graph
from ..host import HostBufferType, host_memory
from ..ops import Op
from ..tensor import Tensor
from .codec import can_decode, can_encode
from .ops import OPS, compute_forward

# Ops whose result is written with a type conversion (the others produce F32 or I32).
_CONVERTING = frozenset({Op.CPY, Op.DUP, Op.CONT, Op.SET_ROWS, Op.GET_ROWS})


class RefDevice(Device):
    """The reference device: CPU type, host memory, every op (numpy, float64)."""

    name = "ref"
    description = "reference (numpy, float64)"
    type = DeviceType.CPU

    def __init__(self, reg: BackendReg | None = None):
        self.reg = reg
        self._buft = HostBufferType(self, name="ref")

    def memory(self) -> tuple[int, int]:
        return host_memory()

    def init_backend(self, **params) -> RefBackend:
        if params:
            raise GGXUnsupported(f"ref backend takes no parameters, got {', '.join(sorted(params))}")
        return RefBackend(self)

    def buffer_type(self) -> BufferType:
        return self._buft

    def supports_op(self, op: Tensor) -> bool:
        """True for every op of the catalogue over the types the reference can read and write."""
        if op.op is Op.NONE or op.op.is_view:
            return True
        if op.op not in OPS:
            return False
        if op.op in (Op.CPY, Op.DUP, Op.CONT) and op.src[0].type is op.type:
            return True  # a same-type copy moves bytes: no codec needed
        if not all(can_decode(s.type) for s in op.src):
            return False
        return op.op not in _CONVERTING or can_encode(op.type)


class RefBackend(Backend):
    """One (synchronous) execution stream on the reference device."""

    name = "ref"

    def graph_compute(self, graph: Graph) -> None:
        """Compute every non-view node in order, after checking the whole graph can be computed."""
        work = [t for t in graph.nodes if not t.op.is_view]
        for node in work:
            if not self.device.supports_op(node):
                srcs = ", ".join(s.describe() for s in node.src)
                raise GGXUnsupported(f"ref: {node.op.name} of {srcs} into {node.type.name} is not supported")
            for t in (node, *node.src):
                buf = t.data_buffer
                if buf is None or not buf.buft.is_host:
                    where = "has no storage" if buf is None else f"lives in {buf.buft.name}"
                    raise GGXUnsupported(f"ref: {t.describe()} {where}; the ref backend needs host memory")
        for node in work:
            compute_forward(node)


class RefBackendReg(BackendReg):
    """The registration of the reference backend: one device."""

    name = "ref"

    def __init__(self) -> None:
        from .._version import __version__

        self.version = __version__
        self._devices = [RefDevice(self)]

    def devices(self) -> list[Device]:
        return list(self._devices)
