"""RAY devices: a ggx device per device a node's worker hosts, its memory in the worker.

- `RayBuffer` is a handle (worker link, buffer id, size); the bytes stay in the worker. Weights
  of a WEIGHTS buffer are sent by content hash first: a node that has the bytes in its cache
  gets no bytes (ggml-rpc's `-c`).
- `RayBackend` is one ordered stream on the worker: `graph_compute` returns at once; the split
  graph is sent once and re-run by id afterwards (ggml-rpc's GRAPH_RECOMPUTE), with the host
  writes queued since the last call (the split's inputs) in the same call, and its sink nodes'
  bytes (the split's results) in the answer, read from there by `get_tensor`: one call per split.
- A copy into a RAY tensor from host memory is queued (`cpy_tensor_async`); from another
  worker's tensor it goes actor to actor, not through the driver.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from ggx import wire
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
from ggx.errors import GGXDeviceError, GGXOutOfMemory, GGXShapeError, GGXUnsupported
from ggx.graph import Graph
from ggx.tensor import Tensor

from . import __version__
from .cluster import Link
from .worker import HASH_MIN_BYTES, digest


class RayBufferType(BufferType):
    def __init__(self, device: RayDevice):
        self._device = device
        self.name = device.name

    @property
    def device(self) -> Device:
        return self._device

    @property
    def alignment(self) -> int:
        return self._device.remote["alignment"]

    @property
    def max_size(self) -> int:
        return self._device.remote["max_size"]

    def alloc_buffer(self, size: int) -> RayBuffer:
        d = self._device
        if not isinstance(size, int) or size < 0:
            raise GGXShapeError(f"{self.name}: buffer size must be a non-negative int, got {size!r}")
        if size > self.max_size:
            raise GGXOutOfMemory(f"{self.name}: {size} bytes is more than max_size {self.max_size}")
        link = d.link
        return RayBuffer(self, size, link, link.call("alloc", d.index, size))


def _release(link: Link, buffer_id: int) -> None:
    """Free a buffer in its worker when the driver drops it (queued, not waited for)."""
    try:
        import ray

        # after ray.shutdown (at exit) a call would start a new local cluster: nothing to release then
        if link.lost is None and ray.is_initialized():
            link.submit("free", buffer_id)
    except Exception:  # noqa: BLE001 - at exit, or the worker is gone: nothing to release
        pass


class RayBuffer(Buffer):
    """A buffer in a worker, reached only through calls: no host view."""

    def __init__(self, buft: RayBufferType, size: int, link: Link, buffer_id: int):
        super().__init__(buft, size)
        self.link = link
        self.id = buffer_id
        self._release = weakref.finalize(self, _release, link, buffer_id)
        self._usage_sent = BufferUsage.ANY

    def free(self) -> None:
        self._release()
        super().free()

    def _alive(self) -> None:
        if self.is_freed:
            raise GGXUnsupported(f"{self.buft.name}: this {self.size}-byte buffer was freed")

    def _check(self, t: Tensor, offset: int, size: int) -> int:
        self._alive()
        if offset < 0 or size < 0 or offset + size > t.nbytes:
            raise GGXShapeError(f"{t.describe()}: bytes {offset}..{offset + size} are outside its {t.nbytes} bytes")
        return t.data_offset + offset

    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        start = self._check(tensor, offset, data.size)
        link = self.link
        if self.usage == BufferUsage.WEIGHTS and data.size >= HASH_MIN_BYTES:
            import ray

            fetched = link.call("write_hashed", self.id, start, data.size, digest(data), [ray.put(data)])
            link.stats.weight_bytes_sent += fetched
            link.stats.bytes_sent += fetched
            return
        link.queue_write(self.id, start, data)
        if self.usage == BufferUsage.WEIGHTS:
            link.stats.weight_bytes_sent += data.size

    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        size = tensor.nbytes - offset if size is None else size
        start = self._check(tensor, offset, size)
        link = self.link
        if link.exports is not None:  # the last graph's results, answered with its call
            out = link.wait(link.exports)
            got = out.get((self.id, tensor.data_offset))
            if got is not None and offset + size <= got.size:
                link.stats.bytes_received += size
                return got[offset:offset + size]
        data = link.call("read", self.id, start, size)
        link.stats.bytes_received += size
        return data

    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        size = tensor.nbytes - offset if size is None else size
        self.link.submit("memset", self.id, self._check(tensor, offset, size), size, int(value), checked=True)

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        return copy_into(self, src, dst)

    def clear(self, value: int = 0) -> None:
        self._alive()
        self.link.submit("memset", self.id, 0, self.size, int(value), checked=True)


def copy_into(dbuf: RayBuffer, src: Tensor, dst: Tensor) -> bool:
    """Queue a copy of src into dst (in `dbuf`): from host memory, from this worker, or from
    another worker (actor to actor). False for memory it cannot reach (the caller copies)."""
    if src.nbytes != dst.nbytes:
        return False
    sbuf = src.data_buffer
    dstart = dbuf._check(dst, 0, dst.nbytes)
    if isinstance(sbuf, RayBuffer):
        sstart = sbuf._check(src, 0, src.nbytes)
        if sbuf.link is dbuf.link:
            dbuf.link.submit("copy", sbuf.id, sstart, dbuf.id, dstart, src.nbytes, checked=True)
        else:
            data = sbuf.link.submit("read", sbuf.id, sstart, src.nbytes)
            dbuf.link.submit("write", dbuf.id, dstart, data, checked=True)  # Ray hands the bytes actor to actor
        return True
    if sbuf is not None and sbuf.is_host:
        view = sbuf.host_view()
        dbuf.link.queue_write(dbuf.id, dstart, view[src.data_offset:src.data_offset + src.nbytes])
        return True
    return False


class RayEvent(Event):
    """The point of a stream's latest call when recorded; waiting is waiting for that call."""

    def __init__(self) -> None:
        self._backend: RayBackend | None = None
        self._ref: Any = None

    def record(self, backend: Backend) -> None:
        if not isinstance(backend, RayBackend):
            backend.synchronize()
            self._backend, self._ref = None, None
            return
        self._backend, self._ref = backend, backend.marker()

    def synchronize(self) -> None:
        if self._backend is not None and self._ref is not None:
            self._backend.wait(self._ref)


class RayBackend(Backend):
    """One stream on a worker's device: calls run in order there; `synchronize` waits."""

    def __init__(self, device: RayDevice, n_threads: int | None = None):
        super().__init__(device)
        self.name = device.name
        self.link = device.link
        self.stream = self.link.call("stream", device.index, n_threads)
        self.last: Any = None  # the reference of the latest call this stream waits for
        self._calls_at_last = 0  # the link's call count when `last` was submitted
        self._graphs: weakref.WeakKeyDictionary[Graph, tuple[tuple, int]] = weakref.WeakKeyDictionary()
        self._forget: list[int] = []
        self._next = 0

    def _buffer_id(self, buf: Any) -> int:
        if buf is None:
            raise GGXUnsupported(f"{self.name}: a tensor of the graph has no storage")
        if not isinstance(buf, RayBuffer) or buf.link is not self.link:
            raise GGXUnsupported(f"{self.name} cannot read {buf.buft.name} memory: not its worker's")
        if buf.is_freed:
            raise GGXUnsupported(f"{self.name}: a graph tensor is in a freed buffer")
        return buf.id

    @staticmethod
    def _storage_key(graph: Graph) -> tuple:
        """Where the graph's tensors live: a graph re-planned into other memory is sent again."""
        key = []
        for n in graph.nodes:
            for t in (n, *n.src):
                r = t.root
                key.append((id(r.buffer), r.offset))
        return tuple(key)

    def _graph_message(self, graph: Graph) -> tuple[int, Any]:
        """The graph's id on the worker, and its message when the worker does not have it yet
        (a Graph object is sent once per placement of its tensors; its id is forgotten there
        when the Graph is collected)."""
        key = self._storage_key(graph)
        known = self._graphs.get(graph)
        if known is not None and known[0] == key:
            return known[1], None
        msg = wire.encode_graph(graph, self._buffer_id)
        gid = self._next = self._next + 1
        if known is not None:
            self._forget.append(known[1])
        self._graphs[graph] = (key, gid)
        weakref.finalize(graph, self._forget.append, gid)
        return gid, msg

    def graph_compute(self, graph: Graph) -> None:
        gid, msg = self._graph_message(graph)
        link = self.link
        forget, self._forget = self._forget, []
        self.last = link.submit("compute", self.stream, gid, msg, link.take_writes(), forget)
        self._calls_at_last = link.stats.n_calls
        link.exports = self.last

    def wait(self, ref: Any) -> None:
        try:
            self.link.wait(ref)
        except GGXDeviceError:
            raise
        except Exception:
            self._graphs.clear()  # the worker may have dropped what failed: send graphs again
            raise

    def marker(self) -> Any:
        """A reference that completes when everything queued on the worker so far has: the
        last compute, or a ping behind writes and copies queued after it."""
        if self.last is None or self.link.pending or self.link.stats.n_calls != self._calls_at_last:
            self.last = self.link.submit("ping")
            self._calls_at_last = self.link.stats.n_calls
        return self.last

    def synchronize(self) -> None:
        if self.last is not None:
            ref, self.last = self.last, None
            self.wait(ref)
        if self.link.pending or self.link.unchecked:  # writes and copies queued since: wait for them too
            self.wait(self.link.submit("ping"))

    def set_tensor_async(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        buf = tensor.data_buffer
        if not isinstance(buf, RayBuffer) or buf.link is not self.link:
            super().set_tensor_async(tensor, data, offset)
            return
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.link.queue_write(buf.id, buf._check(tensor, offset, data.size), data)

    def cpy_tensor_async(self, src_backend: Backend, src: Tensor, dst: Tensor) -> bool:
        dbuf = dst.data_buffer
        if not isinstance(dbuf, RayBuffer) or dbuf.link is not self.link:
            return False
        sbuf = src.data_buffer
        if not isinstance(sbuf, RayBuffer) or sbuf.link is not src_backend.device.link:
            src_backend.synchronize()  # host memory: its producer must be done before the bytes are taken
        return copy_into(dbuf, src, dst)

    def get_proc_address(self, name: str) -> Any:
        return None


class RayDevice(Device):
    """A device a worker hosts, seen from the driver."""

    type = DeviceType.GPU  # memory of its own, like ggml-rpc's devices: the default run uses it
    caps = DeviceCaps(async_=True, events=True)

    def __init__(self, name: str, link: Link, index: int, reg: RayBackendReg):
        self.name = name
        self.reg = reg
        self.attach(link, index)
        self._buft = RayBufferType(self)

    def attach(self, link: Link, index: int) -> None:
        """Point this device at a (new) worker's device `index`."""
        self.link = link
        self.index = index
        self.remote: dict = link.info["devices"][index]
        self.description = f"{self.remote['name']} on {link.name.removeprefix('ggx worker on ')}"
        self._supports: dict[tuple, bool] = {}

    def memory(self) -> tuple[int, int]:
        return tuple(self.link.call("memory", self.index))  # type: ignore[return-value]

    def init_backend(self, **params: Any) -> RayBackend:
        return RayBackend(self, params.get("n_threads"))

    def buffer_type(self) -> RayBufferType:
        return self._buft

    def supports_buft(self, buft: BufferType) -> bool:
        return buft is self._buft

    def event_new(self) -> Event:
        return RayEvent()

    def supports_op(self, op: Tensor) -> bool:
        """Asked of the worker once per kind of node: op, parameters, types, layout and row
        lengths (what a CPU-side device's answer depends on)."""
        key = (op.op, op.params, op.type, op.ne[0]) + tuple(
            (s.type, s.ne[0], s.is_contiguous(), s.has_contiguous_rows(), s.is_view) for s in op.src)
        ok = self._supports.get(key)
        if ok is None:
            ok = self._supports[key] = bool(self.link.call("supports", self.index, self._probe(op)))
        return ok

    @staticmethod
    def _probe(op: Tensor) -> Any:
        """`op` as a one-node graph message, every tensor in buffer 0 at offset 0 (the worker
        puts them in an empty buffer of its memory: plans ask before tensors have storage)."""
        return wire.encode_graph(Graph([op], []), lambda buf: 0)


class RayBackendReg(BackendReg):
    """The ggx-ray plugin's registration: one device per device of every node's worker."""

    name = "ray"
    version = __version__

    def __init__(self) -> None:
        self._devices: list[RayDevice] = []
        self._lock = threading.Lock()
        self.note = ""

    def devices(self) -> list[Device]:
        from .cluster import connect_if_configured

        if not self._devices:
            self.note = connect_if_configured(self)
        return list(self._devices)

    def adopt(self, links: list[Link]) -> list[RayDevice]:
        """Devices for the workers' devices: one already known (same node, same index) is
        re-attached to its new worker and keeps its name; a new one gets the next RAY number."""
        with self._lock:
            known = {(d.link.node_id, d.index): d for d in self._devices}
            for link in links:
                for i in range(len(link.info["devices"])):
                    d = known.get((link.node_id, i))
                    if d is None:
                        d = RayDevice(f"RAY{len(self._devices)}", link, i, self)
                        self._devices.append(d)
                    else:
                        d.attach(link, i)
            return list(self._devices)
