"""Host memory: the buffer type every CPU-side device shares (aligned numpy memory), the one way
kernels reach host memory (`Buffer.host_view`, as tensors through `tensor_array`), and the
host's RAM figures."""
from __future__ import annotations

import mmap
import os

import numpy as np

from .backend import Buffer, BufferType, BufferUsage, Device
from .errors import GGXOutOfMemory, GGXShapeError, GGXUnsupported
from .tensor import Tensor

HOST_ALIGNMENT = 64


#: allocations from this size up are private anonymous maps of their own (as ggml's, through
#: malloc past its threshold), not numpy's memory: numpy asks for transparent huge pages from 4
#: MiB up, and a huge page's first touch can cost 10x a small page's when the kernel has to
#: assemble or zero 2 MiB at a time (docs/perf-notes.md, "Start-up")
MAPPED_MIN = 4 << 20


def aligned_empty(size: int, alignment: int = HOST_ALIGNMENT) -> np.ndarray:
    """A uint8 array of `size` bytes whose first byte is `alignment`-aligned (a map of its own
    from MAPPED_MIN bytes up, returned to the system when the array goes)."""
    if size + alignment >= MAPPED_MIN and hasattr(mmap, "MAP_ANONYMOUS"):  # not on Windows
        raw = np.frombuffer(mmap.mmap(-1, size + alignment, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
    else:
        raw = np.empty(size + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start: start + size]


def alloc_host_memory(buft: BufferType, size: int) -> np.ndarray:
    """`size` bytes of host memory at `buft`'s alignment; GGXOutOfMemory naming `buft` when the
    host has none to give."""
    try:
        return aligned_empty(max(size, 1), buft.alignment)[:size]
    except MemoryError as e:
        raise GGXOutOfMemory(f"{buft.name}: cannot allocate {size} bytes") from e


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of the host's RAM, from /proc/meminfo where there is one."""
    try:
        fields = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024  # values are in kB
        return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def process_memory() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process: VmRSS and VmHWM of /proc/self/status
    where there is one, else getrusage's peak for both."""
    try:
        fields = {}
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(rest.split()[0]) * 1024
        return fields["VmRSS"], fields["VmHWM"]
    except (OSError, KeyError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
        return peak, peak


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim; nothing elsewhere):
    after building something large and short-lived in many small allocations (a 262k-token
    tokenizer's merges), the freed memory would otherwise stay resident."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def process_seconds() -> float | None:
    """Seconds since this process started (its interpreter's start included: what a user waits
    for), from /proc (10 ms resolution); None where there is no /proc."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        started = int(stat.rpartition(")")[2].split()[19])  # field 22, starttime, in clock ticks
        return uptime - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _OwnedHostMemory(Buffer):
    """A buffer over one uint8 array of host memory that `free` lets go of."""

    def __init__(self, buft: BufferType, size: int, usage: BufferUsage, memory: np.ndarray):
        super().__init__(buft, size, usage)
        self._memory: np.ndarray | None = memory

    def _bytes(self) -> np.ndarray:
        """The array; GGXUnsupported once the buffer was freed."""
        memory = self._memory
        if memory is None:
            raise GGXUnsupported(f"{self.buft.name}: this {self.size}-byte buffer was freed")
        return memory

    def free(self) -> None:
        self._memory = None  # views handed out keep their memory alive; nothing new is handed out
        super().free()


class HostBuffer(_OwnedHostMemory):
    """Host memory in ggml layout: one aligned uint8 array, `host_view()`.

    `memory` wraps an existing uint8 array of `size` bytes instead of allocating (no copy:
    writes to the buffer are writes to that array).
    """

    def __init__(self, buft: BufferType, size: int, usage: BufferUsage = BufferUsage.ANY, *,
                 memory: np.ndarray | None = None):
        if memory is None:
            memory = alloc_host_memory(buft, size)
        elif memory.dtype != np.uint8 or memory.ndim != 1 or memory.size != size:
            raise GGXShapeError(f"{buft.name}: a host buffer of {size} bytes wraps a 1-D uint8 array of as many "
                                f"bytes, not {memory.dtype}{list(memory.shape)}")
        super().__init__(buft, size, usage, memory)

    def host_view(self) -> np.ndarray:
        return self._bytes()

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
        self.host_view()[a:b] = data

    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        size = tensor.nbytes - offset if size is None else size
        a, b = self._span(tensor, offset, size)
        return self.host_view()[a:b].copy()

    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        size = tensor.nbytes - offset if size is None else size
        a, b = self._span(tensor, offset, size)
        self.host_view()[a:b] = value

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        """A memcpy from any host memory (ggml's cpu buffer cpy_tensor); False for other memory."""
        sbuf = src.data_buffer
        if sbuf is None or not sbuf.buft.is_host or src.nbytes != dst.nbytes:
            return False
        a, b = self._span(dst, 0, dst.nbytes)
        s0 = src.data_offset
        self.host_view()[a:b] = sbuf.host_view()[s0: s0 + src.nbytes]
        return True

    def clear(self, value: int = 0) -> None:
        self.host_view()[:] = value


class TransformedBuffer(_OwnedHostMemory):
    """Host memory holding whole weights in a layout of its buffer type's own (ggml's repack and
    AMX buffers): a transforming extra buffer type's kernels read it through `packed_bytes()`.

    ggml's layout is gone once a weight is set, so the buffer is write-only: `set_tensor` takes a
    whole contiguous tensor (offset 0, all of its ggml bytes) and stores `transform(tensor,
    data)` at the tensor's offset; `get_tensor` raises GGXUnsupported; `cpy_tensor` declines;
    `memset_tensor` and `clear` fill raw bytes (as ggml's do, so allocators can clear and guard
    it). Subclasses give `transform` and say in `transformed` what it did ("repacked"); one that
    can write its layout piece by piece overrides `transform_into` too, so that setting a large
    weight holds no whole transformed copy beside the buffer.
    """

    transformed = "transformed"

    def __init__(self, buft: BufferType, size: int, usage: BufferUsage = BufferUsage.WEIGHTS):
        super().__init__(buft, size, usage, alloc_host_memory(buft, size))

    def transform(self, tensor: Tensor, data: np.ndarray) -> np.ndarray:
        """The bytes `tensor` is stored as, from its ggml bytes `data` (uint8); GGXUnsupported
        naming why for a weight this buffer type cannot take."""
        raise NotImplementedError

    def transform_into(self, tensor: Tensor, data: np.ndarray, out: np.ndarray) -> None:
        """Write `transform(tensor, data)` into `out` (the tensor's bytes of this buffer, its
        get_alloc_size long)."""
        packed = self.transform(tensor, data)
        if packed.size > out.size:
            raise GGXShapeError(f"{self.buft.name}: {tensor.describe()} transformed to {packed.size} bytes, more "
                                f"than the {out.size} its buffer type allocates for it")
        out[:packed.size] = packed

    def packed_bytes(self) -> np.ndarray:
        """The buffer's bytes, weights as `transform` left them (what the kernels read)."""
        return self._bytes()

    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        name = self.buft.name
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if offset != 0 or data.size != tensor.nbytes:
            raise GGXUnsupported(f"{name}: {tensor.describe()} must be set whole (offset 0, {tensor.nbytes} "
                                 f"bytes); got offset {offset}, {data.size} bytes")
        if tensor.view_src is not None or not tensor.is_contiguous():
            raise GGXUnsupported(f"{name}: {tensor.describe()} is a view or not contiguous; only whole "
                                 f"contiguous weights are {self.transformed}")
        start, size = tensor.data_offset, self.buft.get_alloc_size(tensor)
        if start + size > self.size:
            raise GGXShapeError(f"{name}: {tensor.describe()} needs bytes {start}..{start + size} of a "
                                f"{self.size}-byte buffer (allocate get_alloc_size bytes)")
        self.transform_into(tensor, data, self.packed_bytes()[start: start + size])

    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        raise GGXUnsupported(f"{self.buft.name} is write-only: {tensor.describe()} was {self.transformed} and "
                             "is no longer in ggml's layout; read the weights from their source instead")

    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        size = tensor.nbytes - offset if size is None else size
        start = tensor.data_offset + offset
        if offset < 0 or size < 0 or start + size > self.size:
            raise GGXShapeError(f"{self.buft.name}: memset of bytes {offset}..{offset + size} of "
                                f"{tensor.describe()} is outside the {self.size}-byte buffer")
        self.packed_bytes()[start: start + size] = value

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        """Declines: a weight gets here only through set_tensor, which transforms it."""
        return False

    def clear(self, value: int = 0) -> None:
        self.packed_bytes()[:] = value


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
    """A numpy view of a tensor in host memory (any `is_host` buffer type's `host_view`), numpy
    shape = reversed ne, strides = reversed nb.

    Element types give elements; quantized types give blocks (structured dtype), with the last
    axis counting blocks. Writes through the view change the tensor.
    """
    buf = t.data_buffer
    if buf is None:
        raise GGXUnsupported(f"{t.describe()} has no storage yet")
    if not buf.buft.is_host:
        raise GGXUnsupported(f"{t.describe()} lives in {buf.buft.name}, which is not host memory")
    memory = buf.host_view()
    dtype = t.type.block_dtype
    shape = (t.ne[3], t.ne[2], t.ne[1], t.ne[0] // t.type.block_size)
    strides = (t.nb[3], t.nb[2], t.nb[1], t.nb[0])
    start = t.data_offset
    if start + t.nbytes > memory.size:
        raise GGXShapeError(f"{t.describe()} at offset {start} overruns its {memory.size}-byte buffer")
    return np.ndarray(shape, dtype, memory, start, strides)
