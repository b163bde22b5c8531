"""Devices that compute like the reference backend and then break the result on purpose."""
from __future__ import annotations

import numpy as np

from ggx.host import tensor_array
from ggx.ops import Op
from ggx.reference import RefBackend, RefDevice
from ggx.types import GType


class BrokenBackend(RefBackend):
    """The reference backend with one fault injected after (or instead of) computing."""

    def graph_compute(self, graph) -> None:
        fault = self.device.fault
        if fault == "raise":
            raise RuntimeError("kernel exploded")
        super().graph_compute(graph)
        for node in graph.nodes:
            if node.op.is_view or node.op not in self.device.fault_ops:
                continue
            out = node.root
            arr = tensor_array(out)
            if fault == "noise":
                arr[...] = arr * np.float32(1.1) + np.float32(0.1)
            elif fault == "nan":
                arr.reshape(-1)[0] = np.nan
            elif fault == "overrun":  # write 4 bytes past the end of the output
                buf = out.data_buffer
                end = out.data_offset + out.nbytes
                buf.host_view()[end: end + 4] = 0
            elif fault == "unwritten":
                buf = out.data_buffer
                buf.host_view()[out.data_offset: out.data_offset + out.nbytes] = 0xFF
            elif fault == "clobber_input":
                src = node.src[0].root
                src.data_buffer.host_view()[src.data_offset] ^= 0xFF


class BrokenDevice(RefDevice):
    """A device that computes like the reference, then breaks `fault_ops` results with `fault`."""

    def __init__(self, fault: str, fault_ops=(Op.MUL_MAT,), unsupported=(), name: str = "broken"):
        super().__init__()
        self.name = name
        self.fault = fault
        self.fault_ops = frozenset(fault_ops)
        self.unsupported = frozenset(unsupported)

    def supports_op(self, op) -> bool:
        return op.op not in self.unsupported and super().supports_op(op)

    def init_backend(self, **params) -> BrokenBackend:
        return BrokenBackend(self)


class LowPrecisionBackend(RefBackend):
    """The reference backend, keeping only BF16's 8 mantissa bits of `round_ops` results (as a
    device accumulating in low precision would)."""

    def graph_compute(self, graph) -> None:
        super().graph_compute(graph)
        for node in graph.nodes:
            if node.op in self.device.round_ops and node.type is GType.F32:
                arr = tensor_array(node)
                arr[...] = (arr.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


class LowPrecisionDevice(RefDevice):
    """A device declaring its own NMSE bounds: `bounds` maps (Op, GType) to the answer of
    max_nmse_err; `asked` records every question."""

    def __init__(self, round_ops=(), bounds=None, name: str = "lowp"):
        super().__init__()
        self.name = name
        self.round_ops = frozenset(round_ops)
        self.bounds = dict(bounds or {})
        self.asked: list[tuple] = []

    def max_nmse_err(self, op, gtype, default):
        self.asked.append((op, gtype, default))
        return self.bounds.get((op, gtype))

    def init_backend(self, **params) -> LowPrecisionBackend:
        return LowPrecisionBackend(self)
