"""CUDA devices (CUDA0, CUDA1, ...): device memory, the pinned host buffer type, one stream per
backend, events, CUDA graphs — ggml-cuda's structure over a `Driver` (ggx_cuda.driver).

- `CudaBufferType` / `CudaBuffer`: device memory from the driver's pool; a tensor's address is
  its buffer's `ptr` plus its data offset. Synchronous set/get go through the device's own
  transfer stream.
- `CudaHostBufferType` ("CUDA_Host"): pinned host memory, host-viewable (CPU kernels read it),
  staging for async copies and a home for host-side weights the GPU reads (ggml's host buft).
- `CudaBackend`: one non-blocking stream. `graph_compute` plans every node once per graph
  (ggx_cuda.ops: launches with addresses bound), then runs them eagerly, or captures and relaunches
  them as a CUDA graph by ggml's rule (ggx_cuda.cuda_graph): after two consecutive calls with
  unchanged node properties, never over a node capture cannot hold (cuBLAS). Scratch for the
  planners (dequantized weights) is grown before anything is captured.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import numpy as np

from ggx.backend import (
    Backend,
    BackendReg,
    Buffer,
    BufferType,
    BufferUsage,
    Device,
    DeviceCaps,
    DeviceType,
    Event,
)
from ggx.errors import GGXOutOfMemory, GGXShapeError, GGXUnsupported
from ggx.graph import Graph
from ggx.host import HostBuffer, HostBufferType
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType

from . import __version__, ops, tolerance
from .cuda_graph import CAPTURE, LAUNCH, CudaGraphCache, node_properties
from .driver import Allocation, DeviceInfo, Driver, GemmLaunch, Launch
from .pool import ScratchPool

#: ggml-cuda's alignment of device allocations.
ALIGNMENT = 128
#: ggml-cuda offloads a matrix product from host-resident weights at this batch size and up.
MIN_OFFLOAD_BATCH = 32


class CudaBufferType(BufferType):
    def __init__(self, device: CudaDevice):
        self._device = device
        self.name = device.name

    @property
    def device(self) -> Device:
        return self._device

    @property
    def alignment(self) -> int:
        return ALIGNMENT

    @property
    def max_size(self) -> int:
        return self._device.info.total_memory

    def alloc_buffer(self, size: int) -> CudaBuffer:
        if not isinstance(size, int) or size < 0:
            raise GGXShapeError(f"{self.name}: buffer size must be a non-negative int, got {size!r}")
        if size > self.max_size:
            raise GGXOutOfMemory(f"{self.name}: {size} bytes is more than the device's {self.max_size}")
        d = self._device
        return CudaBuffer(self, size, d.driver.alloc(d.info.index, size))


class CudaBuffer(Buffer):
    """Device memory: reached through copies only (no host view)."""

    def __init__(self, buft: CudaBufferType, size: int, allocation: Allocation):
        super().__init__(buft, size)
        self.allocation: Allocation | None = allocation
        self.ptr = allocation.ptr

    @property
    def _dev(self) -> CudaDevice:
        return self.buft.device  # type: ignore[return-value]

    def free(self) -> None:
        self.allocation = None  # back to the pool
        super().free()

    def address(self, t: Tensor, offset: int = 0, size: int | None = None) -> int:
        """The device address of byte `offset` of t, checked against the tensor and the buffer."""
        if self.allocation is None:
            raise GGXUnsupported(f"{self.buft.name}: this {self.size}-byte buffer was freed")
        size = t.nbytes - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > t.nbytes or t.data_offset + offset + size > self.size:
            raise GGXShapeError(f"{t.describe()}: bytes {offset}..{offset + size} are outside it or its buffer")
        return self.ptr + t.data_offset + offset

    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        dst = self.address(tensor, offset, data.size)
        d = self._dev
        with d.transfer_lock:
            d.driver.copy_h2d(d.transfer_stream(), dst, data)
            d.driver.synchronize(d.transfer_stream())

    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        size = tensor.nbytes - offset if size is None else size
        src = self.address(tensor, offset, size)
        out = np.empty(size, dtype=np.uint8)
        d = self._dev
        with d.transfer_lock:
            d.driver.copy_d2h(d.transfer_stream(), out, src)
            d.driver.synchronize(d.transfer_stream())
        return out

    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        size = tensor.nbytes - offset if size is None else size
        dst = self.address(tensor, offset, size)
        d = self._dev
        with d.transfer_lock:
            d.driver.memset(d.transfer_stream(), dst, int(value), size)
            d.driver.synchronize(d.transfer_stream())

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        sbuf = src.data_buffer
        if src.nbytes != dst.nbytes:
            return False
        d = self._dev
        if isinstance(sbuf, CudaBuffer) and sbuf.buft is self.buft:
            with d.transfer_lock:
                d.driver.copy_d2d(d.transfer_stream(), self.address(dst), sbuf.address(src), src.nbytes)
                d.driver.synchronize(d.transfer_stream())
            return True
        if sbuf is not None and sbuf.is_host:
            view = sbuf.host_view()
            self.set_tensor(dst, view[src.data_offset:src.data_offset + src.nbytes])
            return True
        return False

    def clear(self, value: int = 0) -> None:
        if self.allocation is None:
            raise GGXUnsupported(f"{self.buft.name}: this {self.size}-byte buffer was freed")
        d = self._dev
        with d.transfer_lock:
            d.driver.memset(d.transfer_stream(), self.ptr, int(value), self.size)
            d.driver.synchronize(d.transfer_stream())


class CudaHostBufferType(HostBufferType):
    """Pinned host memory ("CUDA_Host"): host memory in ggml's layout that copies to and from the
    device run asynchronously from."""

    def __init__(self, device: CudaDevice):
        super().__init__(device, name="CUDA_Host")
        self._cuda = device

    def alloc_buffer(self, size: int) -> HostBuffer:
        if not isinstance(size, int) or size < 0:
            raise GGXShapeError(f"CUDA_Host: buffer size must be a non-negative int, got {size!r}")
        return HostBuffer(self, size, memory=self._cuda.driver.alloc_host(size))


class CudaEvent(Event):
    def __init__(self, device: CudaDevice):
        self._device = device
        self.handle = device.driver.event(device.info.index)

    def record(self, backend: Backend) -> None:
        if isinstance(backend, CudaBackend):
            self._device.driver.record(self.handle, backend.stream)
        else:
            backend.synchronize()
            self._device.driver.record(self.handle, self._device.transfer_stream())

    def synchronize(self) -> None:
        self._device.driver.event_synchronize(self.handle)


class _Plans:
    """One graph's launches with addresses bound, planned once per Graph object and placement."""

    def __init__(self, key: tuple, nodes: list[Tensor], launches: list[list[Launch]], blocker: str | None):
        self.key = key
        self.nodes = nodes
        self.launches = launches
        self.blocker = blocker


def _capture_blocker(i: int, node: Tensor, launches: list[Launch]) -> str | None:
    """Why node i keeps its graph out of CUDA graph capture (None: it does not). ggml-cuda's rules:
    cuBLAS cannot run inside a capture, and a batch of more than one token (an ADD whose second
    source has ne1 > 1) is not captured, since batch or context changes move kernels' grids."""
    if any(isinstance(x, GemmLaunch) for x in launches):
        return f"node {i} {node.op.name} uses cuBLAS"
    if node.op is Op.ADD and len(node.src) > 1 and node.src[1].ne[1] > 1:
        return f"node {i} ADD over a batch of {node.src[1].ne[1]} (single-token steps only)"
    return None


class CudaBackend(Backend):
    """One non-blocking stream on a CUDA device."""

    def __init__(self, device: CudaDevice):
        super().__init__(device)
        self.name = device.name
        self.cuda = device
        self.driver = device.driver
        self.stream = device.driver.stream(device.info.index)
        self.scratch = ScratchPool()
        self._scratch_alloc: Allocation | None = None
        self._staging: list[np.ndarray] = []  # pinned copies of host data in flight, kept until sync
        self._plans: weakref.WeakKeyDictionary[Graph, _Plans] = weakref.WeakKeyDictionary()
        self.graphs = CudaGraphCache(enabled=os.environ.get("GGX_CUDA_DISABLE_GRAPHS", "") in ("", "0"))
        self._copy_event: Any = None

    # --- planning -----------------------------------------------------------------------------
    def ptr(self, t: Tensor) -> int:
        buf = t.data_buffer
        if not isinstance(buf, CudaBuffer) or buf.buft is not self.cuda.buffer_type():
            where = "no storage" if buf is None else f"{buf.buft.name} memory"
            raise GGXUnsupported(f"{self.name}: {t.describe()} is in {where}, not this device's")
        return buf.address(t)

    def _plan(self, graph: Graph) -> _Plans:
        nodes = [n for n in graph.nodes if not n.op.is_view]
        key = node_properties(nodes, self.ptr)
        cached = self._plans.get(graph)
        if cached is not None and cached.key == key:
            return cached
        ctx = _PlanContext(self)
        launches, blocker = [], None
        for i, n in enumerate(nodes):
            if not ops.supports_op(n):
                raise GGXUnsupported(f"{self.name} does not support {n.op.name} over "
                                     f"{', '.join(s.describe() for s in n.src)}")
            got = ops.plan(n, ctx)
            ctx.reset()
            if blocker is None:
                blocker = _capture_blocker(i, n, got)
            launches.append(got)
        if ctx.grew:  # scratch moved: plan again with its final address
            return self._plan(graph)
        plans = self._plans[graph] = _Plans(key, nodes, launches, blocker)
        return plans

    def scratch_ptr(self, nbytes: int) -> tuple[int, bool]:
        """The scratch address (grown first when too small) and whether it moved."""
        if self._scratch_alloc is not None and not self.scratch.need(nbytes):
            return self._scratch_alloc.ptr, False
        self.scratch.need(nbytes)
        self.driver.synchronize(self.stream)  # in-flight work may still read the old scratch
        self._scratch_alloc = self.driver.alloc(self.cuda.info.index, self.scratch.size)
        self._plans.clear()
        self.graphs.clear()
        return self._scratch_alloc.ptr, True

    # --- the stream ---------------------------------------------------------------------------
    def graph_compute(self, graph: Graph) -> None:
        plans = self._plan(graph)
        decision = self.graphs.decide(id(graph), plans.key, plans.blocker)
        if decision.action == LAUNCH:
            self.driver.graph_launch(decision.graph, self.stream)
            return
        if decision.action == CAPTURE:
            self.driver.load([x.kernel for launches in plans.launches for x in launches
                              if not isinstance(x, GemmLaunch)])
            captured = self._capture(plans, decision.key)
            if captured is not None:
                self.driver.graph_launch(captured, self.stream)
                return
        self._run(plans)

    def _capture(self, plans: _Plans, key) -> Any:
        """Capture the graph's launches and store the CUDA graph; None when the capture failed:
        the key is then marked failed and runs eagerly from now on (ggml's
        disable_due_to_failed_graph_capture), instead of every later call trying again. The
        capture is always ended, and the first error is the reason recorded."""
        err: Exception | None = None
        self.driver.capture_begin(self.stream)
        try:
            self._run(plans)
        except Exception as e:  # noqa: BLE001 - recorded, then the graph runs eagerly (and raises there if real)
            err = e
        try:
            captured = self.driver.capture_end(self.stream)
        except Exception as e:  # noqa: BLE001 - an invalidated capture
            err, captured = err or e, None
        if err is not None:
            self.graphs.fail(key, f"{type(err).__name__}: {err}")
            return None
        self.graphs.store(key, captured)
        return captured

    def _run(self, plans: _Plans) -> None:
        for node, launches in zip(plans.nodes, plans.launches):
            self.driver.run(self.stream, node, launches)

    def synchronize(self) -> None:
        self.driver.synchronize(self.stream)
        self._staging.clear()

    def _stage(self, data: np.ndarray) -> np.ndarray:
        """A pinned copy of host bytes (the caller may reuse `data` at once)."""
        pinned = self.driver.alloc_host(data.size)
        pinned[:] = data
        self._staging.append(pinned)
        return pinned

    def set_tensor_async(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        buf = tensor.data_buffer
        if not isinstance(buf, CudaBuffer) or buf.buft is not self.cuda.buffer_type():
            super().set_tensor_async(tensor, data, offset)
            return
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.driver.copy_h2d(self.stream, buf.address(tensor, offset, data.size), self._stage(data))

    def get_tensor_async(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        buf = tensor.data_buffer
        if not isinstance(buf, CudaBuffer) or buf.buft is not self.cuda.buffer_type():
            return super().get_tensor_async(tensor, offset, size)
        size = tensor.nbytes - offset if size is None else size
        out = self.driver.alloc_host(size)
        self.driver.copy_d2h(self.stream, out, buf.address(tensor, offset, size))
        self._staging.append(out)  # the DMA writes into it until synchronize, whoever holds it
        return out

    def cpy_tensor_async(self, src_backend: Backend, src: Tensor, dst: Tensor) -> bool:
        dbuf, sbuf = dst.data_buffer, src.data_buffer
        if not isinstance(dbuf, CudaBuffer) or dbuf.buft is not self.cuda.buffer_type() or src.nbytes != dst.nbytes:
            return False
        if isinstance(sbuf, CudaBuffer):
            if isinstance(src_backend, CudaBackend) and src_backend is not self:
                # ggml's order: the copy on the source stream, after its producer and before
                # anything queued there later may overwrite src; this stream waits for the copy
                self.driver.copy_d2d(src_backend.stream, dbuf.address(dst), sbuf.address(src), src.nbytes)
                ev = src_backend.copy_event()
                self.driver.record(ev, src_backend.stream)
                self.driver.wait_event(self.stream, ev)
                return True
            if src_backend is not self:
                src_backend.synchronize()
            self.driver.copy_d2d(self.stream, dbuf.address(dst), sbuf.address(src), src.nbytes)
            return True
        if sbuf is not None and sbuf.is_host:
            src_backend.synchronize()  # the host bytes must be final before they are staged
            view = sbuf.host_view()[src.data_offset:src.data_offset + src.nbytes]
            self.driver.copy_h2d(self.stream, dbuf.address(dst), self._stage(view))
            return True
        return False

    def copy_event(self) -> Any:
        """The event this stream records after a copy another backend waits for (one, reused:
        a wait takes the record made before it)."""
        if self._copy_event is None:
            self._copy_event = self.driver.event(self.cuda.info.index)
        return self._copy_event

    def event_wait(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            self.driver.wait_event(self.stream, event.handle)
        else:
            event.synchronize()


class _PlanContext:
    """What planners see: the device, addresses, scratch (a bump allocator over the backend's
    scratch, reset per node: the stream runs one node's launches before the next node's)."""

    def __init__(self, backend: CudaBackend):
        self.device: DeviceInfo = backend.cuda.info
        self._backend = backend
        self._used = 0
        self.grew = False

    def ptr(self, t: Tensor) -> int:
        return self._backend.ptr(t)

    def scratch(self, nbytes: int) -> int:
        start = (self._used + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        self._used = start + nbytes
        base, moved = self._backend.scratch_ptr(self._used)
        self.grew |= moved
        return base + start

    def reset(self) -> None:
        self._used = 0


class CudaDevice(Device):
    """One GPU as ggml-cuda sees it (ggml_cuda_device_info)."""

    type = DeviceType.GPU
    caps = DeviceCaps(async_=True, host_buffer=True, events=True)

    def __init__(self, info: DeviceInfo, driver: Driver, reg: CudaBackendReg, prefix: str = "CUDA"):
        self.info = info
        self.driver = driver
        self.reg = reg
        self.name = f"{prefix}{info.index}"
        self.description = info.name
        self._buft = CudaBufferType(self)
        self._host_buft: CudaHostBufferType | None = None
        self._transfer: Any = None
        self.transfer_lock = threading.Lock()

    def transfer_stream(self) -> Any:
        """The stream synchronous buffer copies use (made on first use: nothing at import)."""
        if self._transfer is None:
            self._transfer = self.driver.stream(self.info.index)
        return self._transfer

    def memory(self) -> tuple[int, int]:
        return self.driver.mem_info(self.info.index)

    def init_backend(self, **params: Any) -> CudaBackend:
        return CudaBackend(self)

    def buffer_type(self) -> CudaBufferType:
        return self._buft

    def host_buffer_type(self) -> CudaHostBufferType:
        if self._host_buft is None:
            self._host_buft = CudaHostBufferType(self)
        return self._host_buft

    def supports_buft(self, buft: BufferType) -> bool:
        return buft is self._buft

    def supports_op(self, op: Tensor) -> bool:
        return ops.supports_op(op)

    def offload_op(self, op: Tensor) -> bool:
        """ggml-cuda's rule: a product over host-resident weights runs here from batch 32 up."""
        if op.op not in (Op.MUL_MAT, Op.MUL_MAT_ID) or len(op.src) < 2:
            return False
        w = op.src[0].data_buffer
        batch = op.ne[1 if op.op is Op.MUL_MAT else 2]
        return w is not None and w.usage == BufferUsage.WEIGHTS and batch >= MIN_OFFLOAD_BATCH

    def event_new(self) -> Event:
        return CudaEvent(self)

    def max_nmse_err(self, op: Op, gtype: GType | None, default: float) -> tuple[float, str] | None:
        """The kernels' own conformance bounds (ggx_cuda.tolerance)."""
        return tolerance.max_nmse_err(op, gtype, default)

    def get_proc_address(self, name: str) -> Any:
        """"get_features": what ggml-cuda records of the device (`ggx devices` shows it)."""
        if name == "get_features":
            i = self.info
            return lambda: {"compute capability": f"{i.cc[0]}.{i.cc[1]}", "SMs": str(i.sm_count),
                            "shared memory per block": f"{i.smem_per_block} B (opt-in {i.smem_per_block_optin} B)",
                            "warp size": str(i.warp_size)}
        return None


class CudaBackendReg(BackendReg):
    """ggx-cuda's registration: one device per usable GPU; none (with the reason) without one."""

    name = "cuda"
    version = __version__

    def __init__(self, driver: Driver | None = None, prefix: str = "CUDA"):
        """`driver`: the CuPy driver by default (tests pass a double); `prefix` names the devices."""
        from .driver import CupyDriver

        self.driver = driver if driver is not None else CupyDriver()
        self.prefix = prefix
        self._devices: list[CudaDevice] | None = None

    def get_proc_address(self, name: str) -> Any:
        """"set_graphs": f(backend, enabled) turns CUDA-graph capture on or off for one backend
        (`ggx compare --graphs` compares the two)."""
        if name == "set_graphs":
            return set_graphs
        return super().get_proc_address(name)

    def devices(self) -> list[Device]:
        if self._devices is None:
            infos, why = self.driver.probe()
            self._devices = [CudaDevice(i, self.driver, self, self.prefix) for i in infos]
            self.note = why
        return list(self._devices)



def set_graphs(backend: Backend, enabled: bool) -> None:
    """Turn CUDA-graph capture on or off for `backend` from its next graph (off drops its graphs)."""
    if not isinstance(backend, CudaBackend):
        raise GGXUnsupported(f"set_graphs: {backend.name} is not a CUDA backend")
    backend.graphs.set_enabled(enabled)
