"""FakeDriver: a `ggx_cuda.driver.Driver` without a GPU, for end-to-end tests of the backend.

What it models:

* Device memory: `alloc` hands out synthetic addresses (from 0x7f0000000000, 256-aligned, a
  4 KiB guard gap after each allocation, never reused) backed by numpy uint8 arrays filled with
  0xFF (NaN as F32/F16: memory nobody wrote does not pass for data). Every access is bounds
  checked against one live allocation (`resolve`): an address in a gap, past an end or in freed
  memory raises `FakeMemoryError`. An allocation is freed when its `Allocation` is collected or
  by `FakeDriver.free(alloc)` (a helper of the fake, not part of the Driver ABC).
* Streams: an in-order queue of operations. With `deferred=False` each operation runs when it
  is enqueued; with `deferred=True` it waits until `synchronize`, an `event_synchronize` of a
  later event, or a stream that `wait_event`-ed on it gets run. Copies read and write host memory
  when they *execute*, as an async copy from pinned memory does: reading a d2h destination before
  synchronizing gives stale bytes, refilling an h2d staging buffer too early corrupts the copy.
* Events: `record` enqueues a marker; `wait_event(s, e)` enqueues on s "run e's stream up to the
  marker" (the marker recorded at the time of the call, as in CUDA).
* Kernels: `run` checks each launch (kernel declared in `ggx_cuda.kernels.NAME_EXPRESSIONS`,
  arguments numpy scalars, every non-zero np.uint64 argument an address inside a live allocation
  of the stream's device, grid/block/shared limits, a GemmLaunch's operands inside their
  allocations) and records it in `launched`; what executes is the reference backend's op on
  host twins of the node and its sources whose buffers wrap the fake's arrays (addresses taken
  at enqueue time, like the arguments baked into a CUDA graph). The launches themselves are not
  executed: a kernel's arithmetic is not checked here.
* Capture: `capture_begin` diverts a stream's operations into a `FakeGraph`; host<->device
  copies, `synchronize`, waits on events recorded outside the capture and launching a kernel
  whose source was never loaded (NVRTC would compile inside the capture) raise
  `FakeCaptureError`. `graph_launch` enqueues the recorded operations again.

Not modelled: timing, concurrency between streams beyond the order events impose (a missing
wait between two streams goes unnoticed in eager mode), pageable vs pinned host memory (every
copy behaves as pinned), multi-stream (fork/join) capture, peer access between devices.
"""
from __future__ import annotations

import bisect
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggx.errors import GGXOutOfMemory
from ggx.host import HostBuffer, aligned_empty
from ggx.ops import Op
from ggx.reference import RefDevice
from ggx.reference.ops import compute_forward
from ggx.tensor import Tensor
from ggx_cuda import driver
from ggx_cuda.driver import Allocation, DeviceInfo, GemmLaunch, Kernel, Launch

BASE, ALIGN, GUARD, FILL = 0x7F00_0000_0000, 256, 4096, 0xFF
ARG_TYPES = (np.int32, np.uint32, np.int64, np.uint64, np.float32)
GEMM_ELEMENT = {"f32": 4, "f16": 2, "bf16": 2}


class FakeMemoryError(Exception):
    """An access outside every live allocation: a wrong address, a freed buffer, a bad copy."""


class FakeLaunchError(Exception):
    """A launch the real driver would reject or misread (undeclared kernel, bad argument, grid)."""


class FakeCaptureError(Exception):
    """An operation CUDA / CuPy refuse on a capturing stream."""


@dataclass(eq=False)
class _Block:
    device: int
    base: int
    size: int
    array: np.ndarray | None  # None once freed
    host: HostBuffer | None = None  # the reference backend's view of `array`, made on first use


def _release(block: _Block) -> None:
    block.array = block.host = None


@dataclass(eq=False)
class FakeStream:
    device: int
    name: str
    queue: deque = field(default_factory=deque)  # (seq, what, fn), in order
    seq: int = 0  # last operation enqueued
    done: int = 0  # last operation executed
    capture: list | None = None  # (what, fn) recorded while capturing


@dataclass(eq=False)
class FakeEvent:
    device: int
    stream: FakeStream | None = None  # where it was last recorded (None: never: complete)
    seq: int = 0
    captured: bool = False


@dataclass(eq=False)
class FakeGraph:
    device: int
    ops: tuple[tuple[str, Callable[[], None]], ...]
    launches: int = 0


class FakeDriver(driver.Driver):
    def __init__(self, *, devices: int = 1, cc: tuple[int, int] = (8, 9), total_memory: int = 24 << 30,
                 mem: tuple[int, int] | None = None, oom_above: int | None = None, deferred: bool = False,
                 names: Mapping[str, Sequence[str]] | None = None):
        """`mem`: what mem_info answers (default: total_memory less the live allocations);
        `oom_above`: alloc raises GGXOutOfMemory when a device's live bytes would exceed it;
        `names`: the declared kernels per source (default NAME_EXPRESSIONS after load_all())."""
        self.infos = [DeviceInfo(i, f"Fake CUDA {i}", cc, 64, 48 << 10, 99 << 10, 32, total_memory)
                      for i in range(devices)]
        self.mem, self.oom_above, self.deferred, self._names = mem, oom_above, deferred, names
        self._blocks: list[_Block] = []  # by base: addresses only grow
        self._bases: list[int] = []
        self._finalizers: dict[int, weakref.finalize] = {}
        self._next = BASE
        self._streams = 0
        self._buft = RefDevice().buffer_type()
        self.launched: list[tuple[str, tuple[Launch, ...]]] = []  # (op name, launches) per run()
        self.loaded: list[Kernel] = []  # what load() was given
        self.compiled: set[str] = set()  # sources compiled (by load, or lazily by a run)
        self.trace: list[str] = []  # every operation executed, in order
        self.captures = self.graph_launches = self.nodes_computed = 0

    # --- devices and memory -----------------------------------------------------------------
    def probe(self) -> tuple[list[DeviceInfo], str]:
        return list(self.infos), "" if self.infos else "no CUDA device"

    def _device(self, device: int) -> DeviceInfo:
        if not 0 <= device < len(self.infos):
            raise ValueError(f"fake: no device {device} ({len(self.infos)} devices)")
        return self.infos[device]

    def used(self, device: int) -> int:
        return sum(b.size for b in self._blocks if b.device == device and b.array is not None)

    def mem_info(self, device: int) -> tuple[int, int]:
        total = self._device(device).total_memory
        return self.mem if self.mem is not None else (total - self.used(device), total)

    def alloc(self, device: int, size: int) -> Allocation:
        self._device(device)
        used = self.used(device)
        if self.oom_above is not None and used + size > self.oom_above:
            raise GGXOutOfMemory(f"CUDA{device}: cannot allocate {size} bytes ({used} bytes in use, the fake's "
                                 f"oom_above is {self.oom_above})")
        block = _Block(device, self._next, size, np.full(size, FILL, np.uint8))
        self._next = -(-(block.base + size + GUARD) // ALIGN) * ALIGN
        self._blocks.append(block)
        self._bases.append(block.base)
        a = Allocation(block.base, size, block.array)
        self._finalizers[block.base] = weakref.finalize(a, _release, block)
        return a

    def free(self, alloc: Allocation) -> None:
        """Free now (test helper, not in the ABC); a second free raises FakeMemoryError."""
        fin = self._finalizers.pop(alloc.ptr, None)
        if fin is None or not fin.alive:
            raise FakeMemoryError(f"free of {alloc.ptr:#x}: not a live allocation")
        fin()

    def _block(self, address: int, nbytes: int, what: str) -> tuple[_Block, int]:
        i = bisect.bisect_right(self._bases, address) - 1
        if i < 0:
            raise FakeMemoryError(f"{what}: {nbytes} bytes at {address:#x} are below every allocation")
        b = self._blocks[i]
        off = address - b.base
        if nbytes < 0 or off + nbytes > b.size:
            raise FakeMemoryError(f"{what}: {nbytes} bytes at {address:#x} (offset {off}) are outside the "
                                  f"{b.size}-byte allocation at {b.base:#x}")
        if b.array is None:
            raise FakeMemoryError(f"{what}: {address:#x} is in the freed allocation at {b.base:#x}")
        return b, off

    def resolve(self, address: int, nbytes: int) -> tuple[np.ndarray, int]:
        """(backing array, offset) of `nbytes` at a device address; FakeMemoryError outside one."""
        b, off = self._block(address, nbytes, "resolve")
        return b.array, off

    @staticmethod
    def _live(b: _Block, what: str) -> np.ndarray:
        if b.array is None:
            raise FakeMemoryError(f"{what}: the allocation at {b.base:#x} was freed before the work ran")
        return b.array

    def alloc_host(self, size: int) -> np.ndarray:
        return aligned_empty(size, ALIGN)

    # --- streams, copies, events ------------------------------------------------------------
    def stream(self, device: int) -> FakeStream:
        self._device(device)
        self._streams += 1
        return FakeStream(device, f"stream{self._streams}")

    def _enqueue(self, stream: FakeStream, what: str, fn: Callable[[], None]) -> None:
        if stream.capture is not None:
            stream.capture.append((what, fn))
            return
        stream.seq += 1
        stream.queue.append((stream.seq, what, fn))
        if not self.deferred:
            self._drain(stream, stream.seq)

    def _drain(self, stream: FakeStream, upto: int) -> None:
        while stream.queue and stream.queue[0][0] <= upto:
            seq, what, fn = stream.queue.popleft()
            fn()
            stream.done = seq
            self.trace.append(what)

    @staticmethod
    def _no_capture(stream: FakeStream, what: str) -> None:
        if stream.capture is not None:
            raise FakeCaptureError(f"{what} on {stream.name} while it is capturing a graph")

    @staticmethod
    def _bytes(a: np.ndarray, what: str) -> np.ndarray:
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
            raise FakeMemoryError(f"{what}: the driver copies nbytes from ctypes.data, so it needs a C-contiguous "
                                  f"numpy array, not {type(a).__name__}")
        return a.reshape(-1).view(np.uint8)

    def copy_h2d(self, stream: FakeStream, dst: int, src: np.ndarray) -> None:
        self._no_capture(stream, "copy_h2d")
        data = self._bytes(src, "copy_h2d")
        b, off = self._block(dst, data.size, "copy_h2d")

        def op() -> None:
            self._live(b, "copy_h2d")[off: off + data.size] = data  # the host bytes as they are now

        self._enqueue(stream, f"h2d {data.size}B", op)

    def copy_d2h(self, stream: FakeStream, dst: np.ndarray, src: int) -> None:
        self._no_capture(stream, "copy_d2h")
        out = self._bytes(dst, "copy_d2h")
        if not out.flags.writeable:
            raise FakeMemoryError("copy_d2h: the destination array is read-only")
        b, off = self._block(src, out.size, "copy_d2h")

        def op() -> None:
            out[:] = self._live(b, "copy_d2h")[off: off + out.size]

        self._enqueue(stream, f"d2h {out.size}B", op)

    def copy_d2d(self, stream: FakeStream, dst: int, src: int, size: int) -> None:
        (db, doff), (sb, soff) = self._block(dst, size, "copy_d2d dst"), self._block(src, size, "copy_d2d src")
        if db is sb and size and abs(doff - soff) < size:
            raise FakeMemoryError(f"copy_d2d: {size} bytes from {src:#x} to {dst:#x} overlap (memcpy is undefined)")

        def op() -> None:
            self._live(db, "copy_d2d")[doff: doff + size] = self._live(sb, "copy_d2d")[soff: soff + size]

        self._enqueue(stream, f"d2d {size}B", op)

    def memset(self, stream: FakeStream, dst: int, value: int, size: int) -> None:
        b, off = self._block(dst, size, "memset")

        def op() -> None:
            self._live(b, "memset")[off: off + size] = value & 0xFF

        self._enqueue(stream, f"memset {size}B", op)

    def synchronize(self, stream: FakeStream) -> None:
        self._no_capture(stream, "synchronize")
        self._drain(stream, stream.seq)

    def event(self, device: int) -> FakeEvent:
        self._device(device)
        return FakeEvent(device)

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        event.captured = stream.capture is not None
        self._enqueue(stream, f"record on {stream.name}", lambda: None)
        event.stream, event.seq = stream, stream.seq

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        if event.captured:
            if stream.capture is not None and event.stream is stream:
                return  # the capture is in stream order already
            raise FakeCaptureError(f"{stream.name} waits on an event recorded inside a capture (fork/join capture "
                                   "is not modelled)")
        if stream.capture is not None:
            raise FakeCaptureError(f"wait_event on {stream.name} while capturing, on an event recorded outside the "
                                   "capture: wait before capture_begin")
        other, upto = event.stream, event.seq
        if other is not None:
            self._enqueue(stream, f"wait {other.name}@{upto}", lambda: self._drain(other, upto))

    def event_synchronize(self, event: FakeEvent) -> None:
        if event.captured:
            raise FakeCaptureError("event_synchronize on an event recorded inside a capture")
        if event.stream is not None:
            self._drain(event.stream, event.seq)

    # --- kernels ------------------------------------------------------------------------------
    def _declared(self) -> Mapping[str, Sequence[str]]:
        if self._names is None:
            from ggx_cuda.kernels import NAME_EXPRESSIONS
            from ggx_cuda.ops import load_all

            load_all()
            self._names = NAME_EXPRESSIONS
        return self._names

    def _check_name(self, k: Kernel) -> None:
        if k.name not in self._declared().get(k.source, ()):
            raise FakeLaunchError(f"kernel {k.name} is not declared in NAME_EXPRESSIONS[{k.source!r}]")

    def load(self, kernels: Sequence[Kernel]) -> None:
        for k in kernels:
            self._check_name(k)
            self.loaded.append(k)
            self.compiled.add(k.source)

    def _check_launch(self, stream: FakeStream, launch: Launch, what: str) -> None:
        dev = self.infos[stream.device]
        if isinstance(launch, GemmLaunch):
            g = launch
            if min(g.m, g.n, g.k, g.batch) < 1 or g.lda < g.k or g.ldb < g.k or g.ldc < g.m:
                raise FakeLaunchError(f"{what}: bad GEMM dims {g}")
            if g.batch > 1 and g.stride_c < g.ldc * g.n:
                raise FakeLaunchError(f"{what}: GEMM batches overlap in C (stride_c {g.stride_c} < {g.ldc * g.n})")
            for name, ptr, dt, stride, cols, ld, rows in (("A", g.a, g.a_dtype, g.stride_a, g.m, g.lda, g.k),
                                                          ("B", g.b, g.b_dtype, g.stride_b, g.n, g.ldb, g.k),
                                                          ("C", g.c, "f32", g.stride_c, g.n, g.ldc, g.m)):
                if dt not in GEMM_ELEMENT:
                    raise FakeLaunchError(f"{what}: GEMM dtype {dt!r}")
                extent = ((g.batch - 1) * stride + (cols - 1) * ld + rows) * GEMM_ELEMENT[dt]
                b, _ = self._block(int(ptr), extent, f"{what}: GEMM {name}")
                if b.device != stream.device:
                    raise FakeMemoryError(f"{what}: GEMM {name} is on device {b.device}, the stream on {stream.device}")
            return
        k = launch.kernel
        self._check_name(k)
        if stream.capture is not None and k.source not in self.compiled:
            raise FakeCaptureError(f"{k.name}: {k.source} was not loaded before the capture (NVRTC would compile "
                                   "inside it)")
        self.compiled.add(k.source)
        gx, gy, gz = launch.grid
        bx, by, bz = launch.block
        if not (1 <= gx < 2**31 and 1 <= gy <= 65535 and 1 <= gz <= 65535 and min(bx, by, bz) >= 1
                and bz <= 64 and bx * by * bz <= 1024 and 0 <= launch.shared <= dev.smem_per_block_optin):
            raise FakeLaunchError(f"{what}: {k.name} grid {launch.grid} block {launch.block} shared {launch.shared}")
        for i, a in enumerate(launch.args):
            if type(a) not in ARG_TYPES:
                raise FakeLaunchError(f"{what}: {k.name} argument {i} is {type(a).__name__}, not a numpy scalar of "
                                      "int32/uint32/int64/uint64/float32")
            if type(a) is np.uint64 and a != 0:  # 0: a null pointer (an absent operand)
                b, _ = self._block(int(a), 0, f"{what}: {k.name} argument {i}")
                if b.device != stream.device:
                    raise FakeMemoryError(f"{what}: {k.name} argument {i} is on device {b.device}")

    def _twins(self, stream: FakeStream, node: Tensor) -> tuple[Tensor, list[_Block]]:
        """Host tensors over the fake's memory at the node's and its sources' device addresses."""
        blocks: list[_Block] = []

        def twin(t: Tensor, op: Op, src: tuple[Tensor, ...]) -> Tensor:
            buf = t.data_buffer
            if getattr(buf, "ptr", None) is None:
                raise FakeMemoryError(f"{node.op.name}: {t.describe()} has no device storage (buffer {buf!r})")
            b, off = self._block(int(buf.ptr) + t.data_offset, t.nbytes, f"{node.op.name} {t.describe()}")
            if b.device != stream.device:
                raise FakeMemoryError(f"{node.op.name}: {t.describe()} is on device {b.device}")
            if b.host is None:
                b.host = HostBuffer(self._buft, b.size, memory=b.array)
            tw = Tensor(t.type, t.ne, t.nb, op=op, params=t.params, src=src, name=t.name, ndim=t.ndim)
            tw.buffer, tw.offset = b.host, off
            blocks.append(b)
            return tw

        srcs = tuple(twin(s, Op.NONE, ()) for s in node.src)
        return twin(node, node.op, srcs), blocks

    def run(self, stream: FakeStream, node: Tensor, launches: Sequence[Launch]) -> None:
        launches = tuple(launches)
        what = f"{node.op.name} {node.describe()}"
        for launch in launches:
            self._check_launch(stream, launch, what)
        twin, blocks = self._twins(stream, node)
        self.launched.append((node.op.name, launches))

        def op() -> None:
            for b in blocks:
                self._live(b, what)
            compute_forward(twin)
            self.nodes_computed += 1

        self._enqueue(stream, f"run {node.op.name}", op)

    # --- graphs -------------------------------------------------------------------------------
    def capture_begin(self, stream: FakeStream) -> None:
        self._no_capture(stream, "capture_begin")
        stream.capture = []

    def capture_end(self, stream: FakeStream) -> FakeGraph:
        if stream.capture is None:
            raise FakeCaptureError(f"capture_end on {stream.name}, which is not capturing")
        ops, stream.capture = stream.capture, None
        self.captures += 1
        return FakeGraph(stream.device, tuple(ops))

    def graph_launch(self, graph: Any, stream: FakeStream) -> None:
        if not isinstance(graph, FakeGraph) or graph.device != stream.device:
            raise FakeCaptureError(f"graph_launch of {graph!r} on {stream.name}")
        self.graph_launches += 1
        graph.launches += 1
        for what, fn in graph.ops:
            self._enqueue(stream, f"graph {what}", fn)
