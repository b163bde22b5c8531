"""Host memory: the buffer type every CPU-side device shares (aligned numpy memory)."""
from __future__ import annotations

import numpy as np

from .backend import Buffer, BufferType, BufferUsage, Device
from .errors import GGXOutOfMemory, GGXShapeError, GGXUnsupported
from .tensor import Tensor

HOST_ALIGNMENT = 64


def aligned_empty(size: int, alignment: int = HOST_ALIGNMENT) -> np.ndarray:
    """A uint8 array of `size` bytes whose first byte is `alignment`-aligned."""
    raw = np.empty(size + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start: start + size]


class HostBuffer(Buffer):
    """Host memory in ggml layout: tensors are numpy-viewable (see `tensor_array`)."""

    def __init__(self, buft: BufferType, size: int, usage: BufferUsage = BufferUsage.ANY):
        super().__init__(buft, size, usage)
        try:
            self.data = aligned_empty(max(size, 1), buft.alignment)[:size]
        except MemoryError as e:
            raise GGXOutOfMemory(f"{buft.name}: cannot allocate {size} bytes") from e

    def _span(self, tensor: Tensor, offset: int, size: int) -> tuple[int, int]:
        if offset < 0 or size < 0 or offset + size > tensor.nbytes:
            raise GGXShapeError(f"{tensor.describe()}: bytes {offset}..{offset + size} are outside its "
                                f"{tensor.nbytes} bytes")
        start = tensor.data_offset + offset
        if start + size > self.size:
            raise GGXShapeError(f"{tensor.describe()}: bytes {start}..{start + size} are outside the "
                                f"{self.size}-byte buffer")
        return start, start + size

    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        a, b = self._span(tensor, offset, data.size)
        self.data[a:b] = data

    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        size = tensor.nbytes - offset if size is None else size
        a, b = self._span(tensor, offset, size)
        return self.data[a:b].copy()

    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        size = tensor.nbytes - offset if size is None else size
        a, b = self._span(tensor, offset, size)
        self.data[a:b] = value

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        sbuf = src.data_buffer
        if not isinstance(sbuf, HostBuffer) or src.nbytes != dst.nbytes:
            return False
        a, b = self._span(dst, 0, dst.nbytes)
        s0 = src.data_offset
        self.data[a:b] = sbuf.data[s0: s0 + src.nbytes]
        return True

    def clear(self, value: int = 0) -> None:
        self.data[:] = value


class HostBufferType(BufferType):
    """Plain host memory for a device (each CPU-side device owns one instance)."""

    def __init__(self, device: Device, name: str = "CPU", alignment: int = HOST_ALIGNMENT):
        self.name = name
        self._device = device
        self._alignment = alignment

    @property
    def device(self) -> Device:
        return self._device

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def is_host(self) -> bool:
        return True

    def alloc_buffer(self, size: int) -> HostBuffer:
        if size < 0 or size > self.max_size:
            raise GGXOutOfMemory(f"{self.name}: {size} bytes is more than max_size {self.max_size}")
        return HostBuffer(self, size)


def tensor_array(t: Tensor) -> np.ndarray:
    """A numpy view of a tensor in host memory, numpy shape = reversed ne, strides = reversed nb.

    Element types give elements; quantized types give blocks (structured dtype), with the last
    axis counting blocks. Writes through the view change the tensor.
    """
    buf = t.data_buffer
    if buf is None:
        raise GGXUnsupported(f"{t.describe()} has no storage yet")
    if not isinstance(buf, HostBuffer):
        raise GGXUnsupported(f"{t.describe()} lives in {buf.buft.name}, which is not numpy-viewable host memory")
    dtype = t.type.block_dtype
    shape = (t.ne[3], t.ne[2], t.ne[1], t.ne[0] // t.type.block_size)
    strides = (t.nb[3], t.nb[2], t.nb[1], t.nb[0])
    start = t.data_offset
    if start + t.nbytes > buf.size:
        raise GGXShapeError(f"{t.describe()} at offset {start} overruns its {buf.size}-byte buffer")
    return np.ndarray(shape, dtype, buf.data, start, strides)
