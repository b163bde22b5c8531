"""The worker: one Ray actor per node, hosting that node's ggx devices (ggml-rpc's server).

Its methods are ggml-rpc's command set, typed: alloc/free buffer, write/read/copy/memset bytes,
write from the content-hash cache, make a stream, compute a graph (sent once, then re-run by id),
device memory. Every argument is plain data checked here before anything is touched: a buffer is
named by an id this worker gave out, a byte range must lie inside its buffer, a graph is rebuilt
with the graph builder's own checks (`ggx.wire.decode_graph`) and every tensor's storage must fit
its buffer. A bad request raises a GGXError back to the caller; the actor keeps serving. The
worker loads no code a request names: ops and types come from ggx's own tables.

`Worker` is a plain class (testable in-process); `ggx_ray.cluster` makes it a Ray actor.
"""
from __future__ import annotations

import functools
import hashlib
import os
import reprlib
import tempfile
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from ggx import wire
from ggx.backend import Backend, Buffer, BufferUsage, Device
from ggx.errors import GGXError, GGXOutOfMemory, GGXShapeError, GGXStateError, GGXUnsupported
from ggx.graph import Graph
from ggx.tensor import Tensor

#: Version of the command set; driver and worker must agree.
PROTOCOL = 1
#: Graphs a worker keeps for re-running by id (the driver forgets the oldest beyond this).
MAX_GRAPHS = 256
#: Results of a graph returned with its call (so the driver reads them without another call):
#: the graph's sink nodes up to this many bytes each.
MAX_EXPORT_BYTES = 16 << 20
#: Writes into a WEIGHTS buffer of at least this many bytes go by content hash (all of them:
#: a second load of a model then sends nothing).
HASH_MIN_BYTES = 1


def digest(data: np.ndarray) -> str:
    """The content hash naming a tensor's bytes in the cache (BLAKE2b, 128 bits)."""
    return hashlib.blake2b(memoryview(np.ascontiguousarray(data)).cast("B"), digest_size=16).hexdigest()


def _cache_dir() -> Path:
    return Path(os.environ.get("GGX_RAY_CACHE") or Path.home() / ".cache" / "ggx" / "ray-tensors")


def _show(v: Any) -> str:
    """A short repr of untrusted data that cannot fail (repr() of an int of over 4300 digits
    raises ValueError) and does not cost the size of a large object."""
    try:
        return reprlib.repr(v)
    except Exception:  # noqa: BLE001
        return "..."


def _int(what: str, v: Any, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise GGXShapeError(f"{what} must be an int in {lo}..{hi}, got {type(v).__name__} {_show(v)}"[:200])
    return v


def _bytes(what: str, data: Any) -> np.ndarray:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        return data
    raise GGXShapeError(f"{what} must be bytes or a 1-D uint8 array, got {type(data).__name__}")


def command(method: Any) -> Any:
    """Marks a worker command: every failure that is not a GGXError becomes one, so the driver
    gets a typed error whatever a malformed request trips over, and the actor keeps serving."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except GGXError:
            raise
        except Exception as e:  # noqa: BLE001 - nothing about a request is assumed
            why = f"worker: {method.__name__} refused the request: {type(e).__name__}: {e}"
            raise GGXShapeError(why[:500]) from None

    return call


def _default_devices() -> list[Device]:
    """The node's ggx devices, as its registry finds them, without the reference backend (unless
    it is all there is) and without ggx-ray itself (a worker does not nest workers)."""
    deny = os.environ.get("GGX_DISABLE_PLUGINS", "")
    os.environ["GGX_DISABLE_PLUGINS"] = ",".join(x for x in (deny, "ray") if x)
    from ggx import registry

    found = registry.devices()
    usable = [d for d in found if d.name != "ref" and d.buffer_type().is_host]
    return usable or [d for d in found if d.name == "ref"]


class Worker:
    """The state of one node's worker: its devices, the buffers and streams it gave out, graphs."""

    def __init__(self, devices: list[Device] | None = None) -> None:
        self.session = uuid.uuid4().hex
        self.devices = devices if devices is not None else _default_devices()
        self.buffers: dict[int, Buffer] = {}
        self.streams: dict[int, Backend] = {}
        # by (stream id, graph id): each stream (a driver-side backend) numbers its own graphs
        self.graphs: OrderedDict[tuple[int, int], tuple[Graph, list[tuple[int, int, Tensor]], set[int]]] = \
            OrderedDict()
        self._next_id = 1

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # --- lookups ---------------------------------------------------------------------------
    def _device(self, index: Any) -> Device:
        i = _int("device index", index, 0, len(self.devices) - 1) if self.devices else None
        if i is None:
            raise GGXUnsupported("this worker hosts no device")
        return self.devices[i]

    def _buffer(self, buffer_id: Any) -> Buffer:
        buf = self.buffers.get(_int("buffer id", buffer_id))
        if buf is None:
            raise GGXStateError(f"worker {self.session[:8]}: no buffer {buffer_id} (freed, or given out by a "
                                "worker session that ended)")
        return buf

    def _span(self, buffer_id: Any, offset: Any, size: Any) -> tuple[np.ndarray, int, int]:
        buf = self._buffer(buffer_id)
        offset, size = _int("offset", offset), _int("size", size)
        if offset + size > buf.size:
            raise GGXShapeError(f"bytes {offset}..{offset + size} are outside the {buf.size}-byte buffer {buffer_id}")
        return buf.host_view(), offset, size

    # --- the command set ---------------------------------------------------------------------
    @command
    def hello(self) -> dict:
        """Who this worker is and what it hosts."""
        import socket

        out = []
        for d in self.devices:
            free, total = d.memory()
            buft = d.buffer_type()
            out.append({"name": d.name, "description": d.description, "type": int(d.type), "free": free,
                        "total": total, "alignment": buft.alignment, "max_size": min(buft.max_size, 1 << 62)})
        return {"protocol": PROTOCOL, "session": self.session, "host": socket.gethostname(), "pid": os.getpid(),
                "devices": out}

    @command
    def memory(self, device: Any) -> tuple[int, int]:
        return self._device(device).memory()

    @command
    def alloc(self, device: Any, size: Any) -> int:
        """A new buffer of `size` bytes; refused before allocating when it exceeds the device."""
        d = self._device(device)
        buft = d.buffer_type()
        size = _int("size", size)
        free, _ = d.memory()
        if size > buft.max_size or size > free:
            raise GGXOutOfMemory(f"{d.name}: cannot allocate {size} bytes (max_size {buft.max_size}, {free} free)")
        buf = buft.alloc_buffer(size)
        bid = self._new_id()
        self.buffers[bid] = buf
        return bid

    @command
    def free(self, buffer_id: Any) -> None:
        buf = self._buffer(buffer_id)
        del self.buffers[buffer_id]
        for gid in [g for g, (_, _, used) in self.graphs.items() if buffer_id in used]:
            del self.graphs[gid]
        buf.free()

    @command
    def usage(self, buffer_id: Any, usage: Any) -> None:
        self._buffer(buffer_id).usage = BufferUsage(_int("usage", usage, 0, max(BufferUsage)))

    @command
    def write(self, buffer_id: Any, offset: Any, data: Any) -> None:
        data = _bytes("data", data)
        mem, off, size = self._span(buffer_id, offset, data.size)
        mem[off:off + size] = data

    @command
    def write_many(self, writes: Any) -> None:
        """Several writes in order: [(buffer_id, offset, data), ...]."""
        if not isinstance(writes, (list, tuple)):
            raise GGXShapeError("writes must be a list of (buffer_id, offset, data)")
        for w in writes:
            if not isinstance(w, (list, tuple)) or len(w) != 3:
                raise GGXShapeError("each write is (buffer_id, offset, data)")
            self.write(*w)

    @command
    def write_hashed(self, buffer_id: Any, offset: Any, size: Any, hash_: Any, data: Any) -> int:
        """Write bytes named by their content hash: from this node's cache when it holds them
        (ggml-rpc's SET_TENSOR_HASH), else from `data` (a list holding one object reference, fetched
        only then), which is checked against the hash and kept in the cache. Returns the bytes fetched."""
        mem, off, size = self._span(buffer_id, offset, size)
        if not isinstance(hash_, str) or len(hash_) != 32 or any(c not in "0123456789abcdef" for c in hash_):
            raise GGXShapeError("hash must be 32 hex digits")
        path = _cache_dir() / hash_
        if path.is_file() and path.stat().st_size == size:
            cached = np.fromfile(path, dtype=np.uint8)
            if cached.size == size:
                mem[off:off + size] = cached
                return 0
        if not isinstance(data, (list, tuple)) or len(data) != 1:
            raise GGXShapeError("data must be a list of one object reference")
        import ray

        raw = _bytes("data", ray.get(data[0]))
        if raw.size != size or digest(raw) != hash_:
            raise GGXShapeError(f"the {raw.size} bytes sent do not have the hash {hash_}")
        mem[off:off + size] = raw
        self._keep(path, raw)
        return size

    @staticmethod
    def _keep(path: Path, raw: np.ndarray) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
                f.write(memoryview(raw))
            os.replace(f.name, path)
        except OSError:
            pass  # a cache that cannot be written only costs the next load its bytes

    @command
    def read(self, buffer_id: Any, offset: Any, size: Any) -> np.ndarray:
        mem, off, size = self._span(buffer_id, offset, size)
        return mem[off:off + size].copy()

    @command
    def memset(self, buffer_id: Any, offset: Any, size: Any, value: Any) -> None:
        mem, off, size = self._span(buffer_id, offset, size)
        mem[off:off + size] = _int("value", value, 0, 255)

    @command
    def copy(self, src_id: Any, src_offset: Any, dst_id: Any, dst_offset: Any, size: Any) -> None:
        smem, soff, size = self._span(src_id, src_offset, size)
        dmem, doff, _ = self._span(dst_id, dst_offset, size)
        dmem[doff:doff + size] = smem[soff:soff + size]

    @command
    def stream(self, device: Any, n_threads: Any = None) -> int:
        """A new execution stream (backend) on a device."""
        be = self._device(device).init_backend()
        if n_threads is not None:
            fn = be.device.reg.get_proc_address("set_n_threads") if be.device.reg is not None else None
            if fn is not None:
                fn(be, _int("n_threads", n_threads, 1, 4096))
        sid = self._new_id()
        self.streams[sid] = be
        return sid

    @command
    def supports(self, device: Any, graph: Any) -> bool:
        """Does the device run the last node of `graph` (a one-node graph whose tensors sit in
        an empty buffer of the device's memory: only types and layout are asked about)?"""
        d = self._device(device)
        probe = d.buffer_type().alloc_buffer(0)

        def place(t: Tensor, buffer_id: int, offset: int) -> None:
            t.buffer, t.offset = probe, 0

        g = wire.decode_graph(graph, place)
        return bool(g.nodes) and bool(d.supports_op(g.nodes[-1]))

    @command
    def compute(self, stream: Any, graph_id: Any, graph: Any, writes: Any, forget: Any) -> dict:
        """Apply `writes`, forget graphs, then run graph `graph_id` on `stream` (rebuilding it
        from `graph` when given) and wait for it. Returns its sink nodes' bytes by (buffer id,
        offset), so the driver reads them without another call."""
        sid = _int("stream id", stream)
        be = self.streams.get(sid)
        if be is None:
            raise GGXStateError(f"worker {self.session[:8]}: no stream {stream}")
        self.write_many(writes)
        if not isinstance(forget, (list, tuple)):
            raise GGXShapeError("forget must be a list of graph ids")
        for gid in forget:
            self.graphs.pop((sid, _int("graph id", gid)), None)
        gid = _int("graph id", graph_id)
        if graph is not None:
            self.graphs[sid, gid] = self._rebuild(be, graph)
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        entry = self.graphs.get((sid, gid))
        if entry is None:
            raise GGXStateError(f"worker {self.session[:8]}: no graph {gid} on stream {sid} (send it again)")
        g, exports, _ = entry
        be.graph_compute(g)
        be.synchronize()
        out = {}
        for bid, off, t in exports:
            out[(bid, off)] = t.data_buffer.get_tensor(t, 0, t.nbytes)
        return out

    def _rebuild(self, be: Backend, graph: Any) -> tuple[Graph, list[tuple[int, int, Tensor]], set[int]]:
        used: set[int] = set()
        where: dict[int, int] = {}

        def place(t: Tensor, buffer_id: int, offset: int) -> None:
            buf = self._buffer(buffer_id)
            if not be.device.supports_buft(buf.buft):
                raise GGXUnsupported(f"{be.device.name} cannot read buffer {buffer_id} ({buf.buft.name})")
            end = offset + buf.buft.get_alloc_size(t)
            if end > buf.size:
                raise GGXShapeError(f"{t.describe()} at offset {offset} ends at byte {end}, past the "
                                    f"{buf.size}-byte buffer {buffer_id}")
            t.buffer, t.offset = buf, offset
            buf.init_tensor(t)
            used.add(buffer_id)
            where[id(t)] = buffer_id

        g = wire.decode_graph(graph, place)
        for n in g.nodes:
            if not be.device.supports_op(n):
                raise GGXUnsupported(f"{be.device.name} does not run {n.op.name} over "
                                     f"{', '.join(s.describe() for s in n.src)}")
        read = {id(s) for n in g.nodes for s in n.src}
        exports = [(where[id(n)], n.offset, n) for n in g.nodes
                   if id(n) not in read and not n.is_view and n.nbytes <= MAX_EXPORT_BYTES]
        return g, exports, used

    @command
    def ping(self) -> str:
        return self.session
