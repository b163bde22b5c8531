"""A real backend for scheduler tests: device memory that is not host memory, an async stream.

- `TestBufferType` / `TestBuffer`: private byte storage (is_host False), reachable only through
  set_tensor / get_tensor: nothing can numpy-view it, so every host<->device move is explicit.
  `free()` releases it: any later access (by the host or by queued work) raises GGXUnsupported,
  so a use after free is detected, not silent.
- `TestBackend`: one worker thread runs the queued work in order, so `graph_compute`,
  `set_tensor_async` and `cpy_tensor_async` return before the work is done; `synchronize`
  waits and re-raises a failure of the worker. Events are set by the worker when it reaches
  them. `hold()` stops the stream until released, so tests can keep work in flight.
- `TestDevice(ops=...)`: supports only the given ops; computes each node by copying its inputs
  into host tensors and running the reference backend's per-op code (`ggx.reference.ops`).
  `noop=True` makes every kernel do nothing (for measuring scheduler overhead);
  `fail_on=Op.X` makes the kernel of that op raise (error-path tests);
  `offload=predicate` answers `offload_op`.

Also: `NoopHostDevice` (a host device whose kernels do nothing) and `llama_like`, a graph builder
shaped like a llama decoder (used by the allocator and scheduler tests and the benchmark).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from ggx.backend import Backend, Buffer, BufferType, BufferUsage, Device, DeviceCaps, DeviceType, Event
from ggx.errors import GGXOutOfMemory, GGXShapeError, GGXUnsupported
from ggx.graph import Context, Graph
from ggx.host import HostBuffer, HostBufferType
from ggx.ops import Op
from ggx.tensor import Tensor


class TestBuffer(Buffer):
    """Device memory: private bytes; the only ways in and out are set_tensor / get_tensor."""

    __test__ = False  # not a pytest test class

    def __init__(self, buft: TestBufferType, size: int):
        super().__init__(buft, size)
        self._mem: bytearray | None = bytearray(size)
        self._lock = threading.Lock()

    def free(self) -> None:
        with self._lock:
            self._mem = None
        super().free()

    def _memory(self) -> bytearray:
        mem = self._mem
        if mem is None:
            raise GGXUnsupported(f"{self.buft.name}: this {self.size}-byte buffer was used after it was freed")
        return mem

    def _span(self, t: Tensor, offset: int, size: int) -> int:
        start = t.data_offset + offset
        if offset < 0 or size < 0 or offset + size > t.nbytes or start + size > self.size:
            raise GGXShapeError(f"{t.describe()}: bytes {offset}..{offset + size} outside the tensor or buffer")
        return start

    def write(self, start: int, data: np.ndarray) -> None:
        with self._lock:
            self._memory()[start:start + data.size] = data.tobytes()

    def read(self, start: int, size: int) -> np.ndarray:
        with self._lock:
            return np.frombuffer(bytes(self._memory()[start:start + size]), dtype=np.uint8).copy()

    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.write(self._span(tensor, offset, data.size), data)

    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        size = tensor.nbytes - offset if size is None else size
        return self.read(self._span(tensor, offset, size), size)

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        if not isinstance(src.data_buffer, TestBuffer):
            return False
        self.write(self._span(dst, 0, src.nbytes), src.data_buffer.read(src.data_offset, src.nbytes))
        return True

    def clear(self, value: int = 0) -> None:
        with self._lock:
            self._memory()[:] = bytes([value]) * self.size


class TestBufferType(BufferType):
    def __init__(self, device: TestDevice):
        self._device = device
        self.name = f"{device.name}_mem"

    @property
    def device(self) -> Device:
        return self._device

    @property
    def alignment(self) -> int:
        return 32

    def alloc_buffer(self, size: int) -> TestBuffer:
        if size < 0 or size > self.max_size:
            raise GGXOutOfMemory(f"{self.name}: {size} bytes is more than max_size {self.max_size}")
        return TestBuffer(self, size)


class TestEvent(Event):
    """Completes when the recording stream's worker reaches it. As with CUDA events, a wait
    refers to the most recent `record` at the time of the wait, not to later ones."""

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._recorded = 0  # generation of the latest record
        self._done = 0  # latest generation the stream has reached

    def record(self, backend: Backend) -> None:
        with self._cond:
            self._recorded += 1
            gen = self._recorded
        if isinstance(backend, TestBackend):
            backend.enqueue(lambda: self._reach(gen), essential=True)
        else:
            backend.synchronize()
            self._reach(gen)

    def _reach(self, gen: int) -> None:
        with self._cond:
            self._done = max(self._done, gen)
            self._cond.notify_all()

    def waiter(self) -> Callable[[], None]:
        """A function that blocks until the record current now has completed."""
        with self._cond:
            target = self._recorded

        def wait() -> None:
            with self._cond:
                self._cond.wait_for(lambda: self._done >= target)
        return wait

    def synchronize(self) -> None:
        self.waiter()()


class TestDevice(Device):
    """A non-host device with an async stream, computing a chosen subset of ops."""

    __test__ = False  # not a pytest test class

    type = DeviceType.GPU
    caps = DeviceCaps(async_=True, events=True)

    def __init__(self, name: str = "test", ops: Iterable[Op] | None = None, noop: bool = False,
                 fail_on: Op | None = None, offload: Callable[[Tensor], bool] | None = None):
        from ggx.reference import RefDevice

        self.name = name
        self.description = f"scheduler test device ({'no-op' if noop else 'reference kernels'})"
        self.ops = frozenset(ops) if ops is not None else None  # None: every op the reference has
        self.noop = noop
        self.fail_on = fail_on
        self._offload = offload
        self._ref = RefDevice()
        self._buft = TestBufferType(self)
        self.host_buft = HostBufferType(self, name=f"{name}_staging")  # scratch for kernels

    def memory(self) -> tuple[int, int]:
        return (1 << 30, 1 << 30)

    def init_backend(self, **params) -> TestBackend:
        return TestBackend(self)

    def buffer_type(self) -> BufferType:
        return self._buft

    def supports_buft(self, buft: BufferType) -> bool:
        return buft is self._buft

    def supports_op(self, op: Tensor) -> bool:
        if op.op is Op.NONE or op.op.is_view:
            return True
        if self.ops is not None and op.op not in self.ops:
            return False
        return self._ref.supports_op(op)

    def offload_op(self, op: Tensor) -> bool:
        return self._offload is not None and self._offload(op)

    def event_new(self) -> Event:
        return TestEvent()


class TestBackend(Backend):
    """The stream: a worker thread executing queued jobs in order."""

    __test__ = False  # not a pytest test class

    def __init__(self, device: TestDevice):
        super().__init__(device)
        self.name = device.name
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.n_jobs = 0
        self.bytes_in = 0  # bytes written into device memory by set_tensor_async / cpy_tensor_async
        self._worker = threading.Thread(target=self._loop, name=f"{device.name}-stream", daemon=True)
        self._worker.start()

    # --- the stream -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            fn, essential = self._q.get()
            try:
                if self._error is None or essential:
                    fn()
            except BaseException as e:  # noqa: BLE001 - kept and re-raised by synchronize()
                if self._error is None:
                    self._error = e
            finally:
                self._q.task_done()

    def enqueue(self, fn: Callable[[], None], essential: bool = False) -> None:
        """Queue work; after a failure only `essential` jobs (event signals) still run."""
        self.n_jobs += 1
        self._q.put((fn, essential))

    def hold(self, timeout: float = 30.0) -> threading.Event:
        """Stop the stream here: work queued from now on stays in flight until the returned event is
        set. After `timeout` seconds the stream goes on and fails (a test forgot to release it)."""
        gate = threading.Event()

        def wait() -> None:
            t0 = time.perf_counter()
            if not gate.wait(timeout):
                raise GGXUnsupported(f"{self.name}: stream held for more than {time.perf_counter() - t0:.0f} s")
        self.enqueue(wait, essential=True)
        return gate

    def synchronize(self) -> None:
        self._q.join()
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def event_wait(self, event: Event) -> None:
        wait = event.waiter() if isinstance(event, TestEvent) else event.synchronize
        self.enqueue(wait, essential=True)

    # --- data movement ----------------------------------------------------------------------
    def _device_buffer(self, t: Tensor) -> TestBuffer:
        buf = t.data_buffer
        if not isinstance(buf, TestBuffer) or buf.buft.device is not self.device:
            where = "no storage" if buf is None else buf.buft.name
            raise GGXUnsupported(f"{self.name}: {t.describe()} is in {where}, not in {self.device.name} memory")
        return buf

    def set_tensor_async(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        buf = self._device_buffer(tensor)
        data = np.array(np.ascontiguousarray(data).view(np.uint8).reshape(-1))  # staged now: the caller may reuse it
        start = buf._span(tensor, offset, data.size)
        self.bytes_in += data.size
        self.enqueue(lambda: buf.write(start, data))

    def get_tensor_async(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        self.synchronize()
        return self._device_buffer(tensor).get_tensor(tensor, offset, size)

    def cpy_tensor_async(self, src_backend: Backend, src: Tensor, dst: Tensor) -> bool:
        buf = self._device_buffer(dst)
        sbuf = src.data_buffer
        start = buf._span(dst, 0, src.nbytes)
        if isinstance(sbuf, TestBuffer) and sbuf.buft.device is self.device:
            self.enqueue(lambda: buf.write(start, sbuf.read(src.data_offset, src.nbytes)))
            return True
        if sbuf is not None and sbuf.is_host:
            src_backend.synchronize()  # the source is ready; stage its bytes now (pageable-memory semantics)
            data = sbuf.get_tensor(src, 0, src.nbytes)
            self.bytes_in += data.size
            self.enqueue(lambda: buf.write(start, data))
            return True
        return False

    # --- compute ----------------------------------------------------------------------------
    def graph_compute(self, graph: Graph) -> None:
        work = [n for n in graph.nodes if not n.op.is_view]
        for node in work:
            if not self.device.supports_op(node):
                raise GGXUnsupported(f"{self.name}: {node.op.name} of {node.describe()} is not supported")
            for t in (node, *node.src):
                self._device_buffer(t)
        if self.device.noop:
            return
        # where everything is, as of now: later re-placements must not affect queued work
        jobs = [(n, (n.data_buffer, n.data_offset), [(s, s.data_buffer, s.data_offset) for s in n.src]) for n in work]
        self.enqueue(lambda: self._run(jobs))

    def _run(self, jobs) -> None:
        from ggx.reference.ops import compute_forward

        staging = self.device.host_buft
        for node, (dbuf, doff), srcs in jobs:
            if node.op is self.device.fail_on:
                e = RuntimeError(f"{self.name}: injected failure in {node.op.name}")
                e.node = node
                raise e
            hsrcs = [_stage(staging, s, buf.read(off, s.nbytes)) for s, buf, off in srcs]
            hdst = Tensor(node.type, node.ne, node.nb, op=node.op, params=node.params, src=tuple(hsrcs),
                          name=node.name, ndim=node.ndim)
            _place(staging, hdst, dbuf.read(doff, node.nbytes))
            compute_forward(hdst)
            dbuf.write(doff, hdst.buffer.host_view()[:node.nbytes])


def _place(buft: HostBufferType, t: Tensor, raw: np.ndarray) -> Tensor:
    buf = HostBuffer(buft, max(t.nbytes, 1))
    buf.host_view()[:t.nbytes] = raw
    t.buffer, t.offset = buf, 0
    return t


def _stage(buft: HostBufferType, s: Tensor, raw: np.ndarray) -> Tensor:
    """A host tensor with s's layout holding s's bytes."""
    return _place(buft, Tensor(s.type, s.ne, s.nb, name=s.name, ndim=s.ndim), raw)


# --- a host device whose kernels cost nothing (scheduler overhead measurements) -----------------
class NoopHostDevice(Device):
    name = "noop_host"
    description = "host memory, every op, kernels do nothing"
    type = DeviceType.CPU

    def __init__(self) -> None:
        self._buft = HostBufferType(self, name="noop_host")

    def memory(self) -> tuple[int, int]:
        return (1 << 30, 1 << 30)

    def init_backend(self, **params) -> Backend:
        return NoopHostBackend(self)

    def buffer_type(self) -> BufferType:
        return self._buft

    def supports_op(self, op: Tensor) -> bool:
        return True


class NoopHostBackend(Backend):
    name = "noop_host"

    def graph_compute(self, graph: Graph) -> None:
        pass


# --- weights and graphs -----------------------------------------------------------------------
def alloc_weights(buft: BufferType, tensors: list[Tensor], rng: np.random.Generator | None = None) -> Buffer:
    """Place `tensors` back to back in one WEIGHTS buffer of `buft` and fill them with small values."""
    from ggx.alloc import alloc_tensors
    from ggx.tensor_data import to_raw

    buf = alloc_tensors(buft, tensors, BufferUsage.WEIGHTS)
    if rng is not None:
        for t in tensors:
            buf.set_tensor(t, to_raw(t, rng.uniform(-0.5, 0.5, t.shape).astype(np.float32)))
    return buf


def llama_like(n_layer: int = 4, n_embd: int = 64, n_head: int = 4, n_tokens: int = 4, n_ff: int = 128):
    """A llama-shaped decoder graph (norms, q/k/v, rope, masked attention, swiglu FFN, residuals).

    Returns (graph, weights, inputs): `weights` are the leafs to place (F32), `inputs` a dict
    name -> INPUT leaf (x: F32 [n_embd, T], pos: I32 [T], mask: F32 [T, T]). About 22 nodes a layer.
    """
    from ggx.tensor import TensorFlag

    hd = n_embd // n_head
    ctx = Context()
    weights: list[Tensor] = []

    def w(name: str, ne) -> Tensor:
        t = ctx.tensor("F32", ne, name=name)
        t.set_flag(TensorFlag.PARAM)
        weights.append(t)
        return t

    x = ctx.tensor("F32", (n_embd, n_tokens), name="x").set_flag(TensorFlag.INPUT)
    pos = ctx.tensor("I32", (n_tokens,), name="pos").set_flag(TensorFlag.INPUT)
    mask = ctx.tensor("F32", (n_tokens, n_tokens), name="mask").set_flag(TensorFlag.INPUT)
    cur = x
    for il in range(n_layer):
        h = ctx.mul(ctx.rms_norm(cur, 1e-5), w(f"blk.{il}.attn_norm", (n_embd,)))
        q = ctx.mul_mat(w(f"blk.{il}.wq", (n_embd, n_embd)), h)
        k = ctx.mul_mat(w(f"blk.{il}.wk", (n_embd, n_embd)), h)
        v = ctx.mul_mat(w(f"blk.{il}.wv", (n_embd, n_embd)), h)
        q = ctx.rope(ctx.reshape(q, (hd, n_head, n_tokens)), pos, hd)
        k = ctx.rope(ctx.reshape(k, (hd, n_head, n_tokens)), pos, hd)
        q = ctx.permute(q, 0, 2, 1, 3)  # [hd, T, H]
        k = ctx.permute(k, 0, 2, 1, 3)
        kq = ctx.soft_max(ctx.mul_mat(k, q), mask, scale=hd ** -0.5)  # [T_kv, T, H]
        vt = ctx.cont(ctx.permute(ctx.reshape(v, (hd, n_head, n_tokens)), 1, 2, 0, 3))  # [T, hd, H]
        kqv = ctx.mul_mat(vt, kq)  # [hd, T, H]
        o = ctx.cont(ctx.permute(kqv, 0, 2, 1, 3), (n_embd, n_tokens))
        cur = ctx.add(ctx.mul_mat(w(f"blk.{il}.wo", (n_embd, n_embd)), o), cur)
        h = ctx.mul(ctx.rms_norm(cur, 1e-5), w(f"blk.{il}.ffn_norm", (n_embd,)))
        g = ctx.mul_mat(w(f"blk.{il}.ffn_gate", (n_embd, n_ff)), h)
        u = ctx.mul_mat(w(f"blk.{il}.ffn_up", (n_embd, n_ff)), h)
        f = ctx.mul_mat(w(f"blk.{il}.ffn_down", (n_ff, n_embd)), ctx.swiglu(g, u))
        cur = ctx.add(f, cur)
    out = ctx.mul_mat(w("output", (n_embd, 32)), ctx.rms_norm(cur, 1e-5))
    from ggx.graph import build_graph

    return build_graph(out), weights, {"x": x, "pos": pos, "mask": mask}


def llama_inputs(inputs: dict[str, Tensor], rng: np.random.Generator) -> dict[Tensor, np.ndarray]:
    x, pos, mask = inputs["x"], inputs["pos"], inputs["mask"]
    T = pos.ne[0]
    m = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    return {x: rng.uniform(-1, 1, x.shape).astype(np.float32), pos: np.arange(T, dtype=np.int32), mask: m}
