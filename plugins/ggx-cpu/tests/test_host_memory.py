"""CPU kernels read host memory through `Buffer.host_view()`, whoever made the buffer: a pinned
host buffer type of another plugin (is_host, not a HostBuffer) holds every tensor of the
conformance cases, and what supports_op accepts computes and matches the reference."""
from __future__ import annotations

import numpy as np
import pytest

import ggx
from ggx.backend import Buffer, BufferType, Device
from ggx.conformance import PASS, Suite
from ggx.errors import GGXOutOfMemory, GGXShapeError, GGXUnsupported
from ggx.tensor import Tensor
from ggx.types import GType
from ggx_cpu.device import CpuDevice

ALIGN = 64


class PinnedBuffer(Buffer):
    """Host memory as another plugin would hand it out (a pinned allocation): its own array,
    reachable through host_view."""

    def __init__(self, buft: PinnedBufferType, size: int):
        super().__init__(buft, size)
        raw = np.zeros(size + ALIGN, np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        self._pinned: np.ndarray | None = raw[start: start + size]

    def host_view(self) -> np.ndarray:
        if self._pinned is None:
            raise GGXUnsupported("PINNED: freed")
        return self._pinned

    def free(self) -> None:
        self._pinned = None
        super().free()

    def _span(self, t: Tensor, offset: int, size: int) -> slice:
        start = t.data_offset + offset
        if offset < 0 or size < 0 or offset + size > t.nbytes or start + size > self.size:
            raise GGXShapeError(f"PINNED: bytes {offset}..{offset + size} of {t.describe()} are outside it")
        return slice(start, start + size)

    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.host_view()[self._span(tensor, offset, data.size)] = data

    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        size = tensor.nbytes - offset if size is None else size
        return self.host_view()[self._span(tensor, offset, size)].copy()

    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        size = tensor.nbytes - offset if size is None else size
        self.host_view()[self._span(tensor, offset, size)] = value

    def clear(self, value: int = 0) -> None:
        self.host_view()[:] = value


class PinnedBufferType(BufferType):
    name = "PINNED"

    def __init__(self, device: Device):
        self._device = device

    @property
    def device(self) -> Device:
        return self._device

    @property
    def is_host(self) -> bool:
        return True

    def alloc_buffer(self, size: int) -> PinnedBuffer:
        if size > self.max_size:
            raise GGXOutOfMemory(f"PINNED: {size} bytes is more than max_size {self.max_size}")
        return PinnedBuffer(self, size)


class PinnedCpuDevice(CpuDevice):
    """The CPU device with its tensors in PINNED memory (as if it were that plugin's host buffer)."""

    name = "CPU-pinned"

    def __init__(self) -> None:
        super().__init__()
        self._pinned = PinnedBufferType(self)

    def buffer_type(self) -> BufferType:
        return self._pinned

    def extra_buffer_types(self) -> list:
        return []


OPS = ["ADD", "MUL", "SCALE", "SILU", "GLU", "RMS_NORM", "ROPE", "SOFT_MAX", "FLASH_ATTN_EXT", "GET_ROWS",
       "SET_ROWS", "CPY", "CONT", "SUM_ROWS", "ARGSORT", "MUL_MAT", "MUL_MAT_ID", "CONTRACT"]


@pytest.fixture(scope="module")
def pinned():
    return PinnedCpuDevice()


def test_cpu_kernels_compute_from_a_foreign_host_buffer_type(pinned):
    suite = Suite(pinned)
    report = suite.run(suite.items(OPS))
    assert report.ok, "\n".join(f"{r.id}: {r.message}" for r in report.failures)
    ran = {r.op for r in report.results if r.status == PASS}  # GLU's cases are GLU_SWIGLU, ...
    missing = [op for op in OPS if not any(name == op or name.startswith(op + "_") for name in ran)]
    assert not missing, missing
    host_view = next(r for r in report.results if r.id == "contract:host_view")
    assert "PINNED" in host_view.message


def test_not_host_memory_is_refused_with_its_name(pinned):
    ctx = ggx.Context()
    a = ctx.tensor(GType.F32, (16,))
    out = ctx.silu(a)
    buf = PinnedBufferType(pinned).alloc_buffer(256)
    buf.buft = type("Device", (PinnedBufferType,), {"name": "DEVMEM", "is_host": False})(pinned)
    a.buffer, a.offset = buf, 0
    out.buffer, out.offset = pinned.buffer_type().alloc_buffer(64), 0
    assert not pinned.supports_op(out)
    with pytest.raises(GGXUnsupported, match="DEVMEM"):
        pinned.init_backend().graph_compute(ggx.build_graph(out))
