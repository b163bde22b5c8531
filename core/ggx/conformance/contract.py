"""Contract checks: what every device, backend and buffer must do, independent of any op.

Each check is a function `(device, backend) -> str` that raises `ContractFailure` (an
AssertionError) naming what is wrong, or returns a short note of what it verified. The op cases
cover "supports_op says yes => compute succeeds and matches"; the checks here cover memory,
copies, streams, events, errors and determinism.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from .. import registry
from ..backend import Backend, BufferType, Device
from ..errors import GGXError, GGXOutOfMemory, GGXUnsupported
from ..graph import Context, build_graph
from ..host import HostBufferType
from ..tensor import Tensor
from ..types import GType
from . import cases as C
from .case import Builder, OpCase
from .harness import check_guards, place, prepare, unsupported_nodes


class ContractFailure(AssertionError):
    """A device, backend or buffer broke the contract."""


def expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ContractFailure(msg)


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _tensors() -> list[Tensor]:
    """Tensors of several types and odd sizes to place in buffers."""
    ctx = Context()
    return [ctx.tensor(GType.F32, (1000,), "f32"), ctx.tensor(GType.F16, (37, 3), "f16"),
            ctx.tensor(GType.BF16, (5, 7), "bf16"), ctx.tensor(GType.Q4_0, (64, 3), "q4_0"),
            ctx.tensor(GType.Q4_K, (256, 2), "q4_K"), ctx.tensor(GType.Q6_K, (256, 1), "q6_K"),
            ctx.tensor(GType.I32, (13,), "i32")]


# ----------------------------------------------------------------------------------------------
def check_identity(device: Device, backend: Backend) -> str:
    buft = device.buffer_type()
    expect(backend.device is device, f"init_backend() gave a backend whose device is {backend.device!r}")
    expect(buft.device is device, f"buffer_type().device is {buft.device!r}, not {device!r}")
    expect(device.supports_buft(buft), f"device {device.name} does not support its own buffer type {buft.name}")
    expect(isinstance(device.name, str) and device.name != "", "device has no name")
    buf = buft.alloc_buffer(4096)
    expect(buf.buft is buft and buf.size >= 4096, f"alloc_buffer(4096) gave {buf!r}")
    expect(buft.alloc_buffer(0).size >= 0, "alloc_buffer(0) must give an empty buffer")
    try:
        buft.alloc_buffer(buft.max_size + 1)
    except GGXOutOfMemory:
        pass
    else:
        raise ContractFailure(f"alloc_buffer(max_size + 1 = {buft.max_size + 1}) did not raise GGXOutOfMemory")
    return f"buffer type {buft.name}, max_size {buft.max_size}"


def check_alignment(device: Device, backend: Backend) -> str:
    buft = device.buffer_type()
    a = buft.alignment
    expect(isinstance(a, int) and a >= 1 and a & (a - 1) == 0, f"alignment {a!r} is not a power of two")
    buf = buft.alloc_buffer(1024)
    if buft.is_host:
        addr = buf.host_view().ctypes.data
        expect(addr % a == 0, f"host buffer memory at {addr:#x} is not {a}-byte aligned")
    return f"alignment {a}"


def _memory_types(device: Device) -> list[BufferType]:
    """The device's own buffer type and its pinned host type (the memory the scheduler places
    tensors in and frees)."""
    bufts = [device.buffer_type()]
    host = device.host_buffer_type()
    if host is not None and host is not bufts[0]:
        bufts.append(host)
    return bufts


def check_host_view(device: Device, backend: Backend) -> str:
    """Every `is_host` buffer type's buffers offer `host_view()`: one writable uint8 array of the
    buffer's `size` bytes, in ggml's layout, that set_tensor and get_tensor agree with (it is
    what CPU kernels read and write)."""
    bufts = [b for b in _memory_types(device) + registry.extra_buffer_types(device) if b.is_host]
    for buft in bufts:
        ts = _tensors()[:4]
        placement = place(buft, ts)
        buf = placement.buffer
        try:
            view = buf.host_view()
        except GGXUnsupported as e:
            raise ContractFailure(f"{buft.name} is host memory (is_host) but its buffer offers no host_view: "
                                  f"{e}") from e
        expect(isinstance(view, np.ndarray) and view.dtype == np.uint8 and view.ndim == 1
               and view.size == buf.size, f"{buft.name}: host_view() is not a 1-D uint8 array of the buffer's "
                                         f"{buf.size} bytes")
        expect(view.flags.writeable, f"{buft.name}: host_view() is read-only")
        for i, t in enumerate(ts):
            data = _bytes(t.nbytes, 20 + i)
            buf.set_tensor(t, data)
            expect(np.array_equal(view[t.data_offset: t.data_offset + t.nbytes], data),
                   f"{buft.name}: host_view() at {t.describe()}'s offset differs from what set_tensor wrote")
        t = ts[0]
        patch = _bytes(32, 30)
        buf.host_view()[t.data_offset + 8: t.data_offset + 40] = patch
        expect(np.array_equal(buf.get_tensor(t, 8, 32), patch), f"{buft.name}: get_tensor does not see a write "
                                                               "through host_view()")
    if not bufts:
        return "no host-memory buffer types"
    return ", ".join(b.name for b in bufts) + ": host_view agrees with set/get_tensor"


def check_free(device: Device, backend: Backend) -> str:
    """Buffer.free() releases the memory: is_freed is True and every later access raises a
    GGXError (not a crash, not stale bytes)."""
    for buft in _memory_types(device):
        ts = _tensors()[:2]
        placement = place(buft, ts)
        buf = placement.buffer
        expect(not buf.is_freed, f"{buft.name}: a new buffer says is_freed")
        buf.free()
        expect(buf.is_freed, f"{buft.name}: is_freed is False after free()")
        t = ts[0]
        accesses = {"set_tensor": partial(buf.set_tensor, t, _bytes(t.nbytes)),
                    "get_tensor": partial(buf.get_tensor, t), "memset_tensor": partial(buf.memset_tensor, t, 0),
                    "clear": partial(buf.clear, 0)}
        if buft.is_host:
            accesses["host_view"] = buf.host_view
        for name, access in accesses.items():
            try:
                access()
            except GGXError:
                continue
            except Exception as e:
                raise ContractFailure(f"{buft.name}: {name} after free() raised {type(e).__name__} instead of a "
                                      f"GGXError: {e}") from e
            raise ContractFailure(f"{buft.name}: {name} after free() did not raise")
    return ", ".join(b.name for b in _memory_types(device)) + ": every access after free() raises"


def check_alloc_size(device: Device, backend: Backend) -> str:
    buft = device.buffer_type()
    ctx = Context()
    ts = _tensors() + [ctx.transpose(ctx.tensor(GType.F32, (7, 5), "t")), ctx.tensor(GType.F32, (0, 4), "empty")]
    for t in ts:
        size = buft.get_alloc_size(t)
        expect(size >= t.nbytes, f"get_alloc_size({t.describe()}) = {size} < nbytes {t.nbytes}")
    return f"{len(ts)} tensors"


def check_round_trip(device: Device, backend: Backend) -> str:
    """set_tensor/get_tensor of whole tensors and of byte ranges at offsets, guards untouched."""
    ts = _tensors()
    placement = place(device.buffer_type(), ts)
    buf = placement.buffer
    data = {t: _bytes(t.nbytes, i) for i, t in enumerate(ts)}
    for t in ts:
        buf.set_tensor(t, data[t], 0)
    for t in ts:
        got = buf.get_tensor(t)
        expect(np.array_equal(got, data[t]), f"get_tensor({t.describe()}) differs from what set_tensor wrote")
    t = ts[0]
    patch = _bytes(40, 99)
    buf.set_tensor(t, patch, 100)
    expect(np.array_equal(buf.get_tensor(t, 100, 40), patch), "get_tensor at offset 100 differs from set_tensor")
    whole = data[t].copy()
    whole[100:140] = patch
    expect(np.array_equal(buf.get_tensor(t), whole), "set_tensor at offset 100 changed bytes outside its range")
    expect(np.array_equal(buf.get_tensor(t, 3, 5), whole[3:8]), "get_tensor(offset=3, size=5) is wrong")
    problems = check_guards(placement)
    expect(not problems, "; ".join(problems))
    return f"{len(ts)} tensors, partial writes at offsets"


def check_memset_clear(device: Device, backend: Backend) -> str:
    ts = _tensors()[:2]
    placement = place(device.buffer_type(), ts)
    buf = placement.buffer
    t = ts[0]
    buf.clear(0x3C)
    expect(bool(np.all(buf.get_tensor(t) == 0x3C)), "clear(0x3C) did not set every byte of a tensor")
    buf.memset_tensor(t, 0x11, 8, 16)
    got = buf.get_tensor(t)
    expect(bool(np.all(got[8:24] == 0x11)), "memset_tensor(0x11, offset 8, size 16) did not set its range")
    expect(bool(np.all(got[:8] == 0x3C) and np.all(got[24:] == 0x3C)), "memset_tensor wrote outside its range")
    expect(bool(np.all(buf.get_tensor(ts[1]) == 0x3C)), "memset_tensor changed another tensor")
    return "clear and memset_tensor"


def check_cpy_tensor(device: Device, backend: Backend) -> str:
    """Buffer.cpy_tensor between two buffers of the device, and from plain host memory: it may
    decline (False), but when it says True the bytes must be there."""
    buft = device.buffer_type()
    ctx = Context()
    src, dst = ctx.tensor(GType.F32, (300,), "src"), ctx.tensor(GType.F32, (300,), "dst")
    place(buft, [src])
    place(buft, [dst])
    data = _bytes(src.nbytes, 7)
    src.buffer.set_tensor(src, data)
    notes = []
    if dst.buffer.cpy_tensor(src, dst):
        expect(np.array_equal(dst.buffer.get_tensor(dst), data), "cpy_tensor returned True but dst differs from src")
        notes.append("device->device copied")
    else:
        notes.append("device->device declined")
    host_src = ctx.tensor(GType.F32, (300,), "host_src")
    place(HostBufferType(device, name="conformance-host"), [host_src])
    host_src.buffer.set_tensor(host_src, data[::-1].copy())
    if dst.buffer.cpy_tensor(host_src, dst):
        expect(np.array_equal(dst.buffer.get_tensor(dst), data[::-1]), "cpy_tensor from host memory returned True "
                                                                       "but dst differs")
        notes.append("host->device copied")
    else:
        notes.append("host->device declined")
    return ", ".join(notes)


def check_async(device: Device, backend: Backend) -> str:
    ts = _tensors()[:3]
    place(device.buffer_type(), ts)
    data = {t: _bytes(t.nbytes, 11 + i) for i, t in enumerate(ts)}
    for t in ts:
        backend.set_tensor_async(t, data[t], 0)
    patch = _bytes(24, 12)
    backend.set_tensor_async(ts[0], patch, 16)
    got = [backend.get_tensor_async(t) for t in ts]
    part = backend.get_tensor_async(ts[0], 16, 24)
    backend.synchronize()
    data[ts[0]][16:40] = patch
    for t, g in zip(ts, got):
        expect(np.array_equal(g, data[t]), f"get_tensor_async({t.describe()}) after synchronize differs from what "
                                           "set_tensor_async wrote")
    expect(np.array_equal(part, patch), "get_tensor_async at offset 16 differs")
    return "set/get_tensor_async + synchronize, whole and at offsets"


def _first_supported(device: Device, candidates: list[OpCase]) -> tuple[OpCase, Builder] | None:
    for c in candidates:
        b = c.make()
        if not unsupported_nodes(device, build_graph(b.out)):
            return c, b
    return None


def _simple_cases() -> list[OpCase]:
    """Small cases of common ops; a check needing "some op" uses the first the device supports."""
    wanted = ("SCALE(ne=[37,5,1,1],s=0.37,b=0.5)", "ADD(ne_a=[16,10,1,1],ne_b=[16,10,1,1])",
              "MUL(ne_a=[16,10,1,1],ne_b=[16,10,1,1])", "CPY(src=f32,dst=f32,ne=[19,4,2])",
              "CONT(type=f32,ne=[23,6,3],view=transposed)")
    by_name = {c.name: c for gen in (C.unary_cases, C.binary_cases, C.cpy_cases, C.dup_cont_cases) for c in gen()}
    return [by_name[n] for n in wanted]


def check_events(device: Device, backend: Backend) -> str:
    """Stream A computes and records an event; stream B waits on it, then reads the result."""
    found = _first_supported(device, _simple_cases())
    if found is None:
        return "no simple op supported: event ordering not exercised"
    c, b = found
    graph, _ = prepare(device, b.out, b.inputs)
    other = device.init_backend()
    ev = device.event_new()
    backend.graph_compute(graph)
    backend.event_record(ev)
    other.event_wait(ev)
    got = other.get_tensor_async(b.out.root)
    other.synchronize()
    ev.synchronize()
    ref = c.make()
    ref_graph, _ = prepare(device, ref.out, ref.inputs)
    backend.graph_compute(ref_graph)
    backend.synchronize()
    expect(np.array_equal(got, ref.out.root.buffer.get_tensor(ref.out.root)),
           f"after event_wait on a second stream, {c.name}'s result differs from a synchronized run")
    return f"record/wait ordering with {c.name}"


def check_extra_buffer_types(device: Device, backend: Backend) -> str:
    """A transforming extra buffer type (repack, AMX: `is_host` False) is write-only (get_tensor
    raises GGXUnsupported) and gives a launch for each op it accepts (no CPU kernel can read
    its layout). Those keeping ggml's layout in host memory are held to `host_view` instead."""
    bufts = [b for b in registry.extra_buffer_types(device) if not b.is_host]
    if not bufts:
        return "no transforming extra buffer types on this device"
    notes = []
    for buft in bufts:
        probed = False
        for t in (GType.Q4_0, GType.Q8_0, GType.Q4_K, GType.F16, GType.F32):
            ctx = Context()
            w = ctx.tensor(t, (256, 16), "w")
            op = ctx.mul_mat(w, ctx.tensor(GType.F32, (256, 4), "b"))
            place(buft, [w])
            if not buft.supports_op(op):
                continue
            w.buffer.set_tensor(w, _bytes(w.nbytes, 5) if t.is_quantized else
                                np.zeros(w.nbytes, np.uint8))
            expect(callable(buft.prepare_forward(op, 1)), f"extra buffer type {buft.name} accepted "
                                                          f"{op.describe()} but prepare_forward gave no launch")
            try:
                w.buffer.get_tensor(w)
            except GGXUnsupported:
                probed = True
                break
            raise ContractFailure(f"extra buffer type {buft.name}: get_tensor of {w.describe()} did not raise "
                                  "GGXUnsupported")
        notes.append(f"{buft.name}: " + ("write-only, launches what it accepts" if probed
                                         else "holds none of the probed weights"))
    return "; ".join(notes)


def check_unsupported_refused(device: Device, backend: Backend) -> str:
    """An op the device says it cannot run must be refused with GGXUnsupported, not computed
    wrongly or crashed on: one graph per op family the device does not support."""
    tried: dict[str, str] = {}
    for c in C.op_cases():
        if c.expect_error or c.op.name in tried:
            continue
        b = c.make()
        graph = build_graph(b.out)
        if not unsupported_nodes(device, graph):
            continue
        graph, _ = prepare(device, b.out, b.inputs)
        try:
            backend.graph_compute(graph)
            backend.synchronize()
        except GGXUnsupported as e:
            tried[c.op.name] = str(e)
            continue
        except Exception as e:
            raise ContractFailure(f"{c.name}: supports_op says no, and graph_compute raised "
                                  f"{type(e).__name__} instead of GGXUnsupported: {e}") from e
        raise ContractFailure(f"{c.name}: supports_op says no, but graph_compute accepted it")
    if not tried:
        return "every op case is supported"
    return f"refused with GGXUnsupported: {', '.join(sorted(tried))}"


def check_memory(device: Device, backend: Backend) -> str:
    free, total = device.memory()
    expect(all(isinstance(x, int | np.integer) for x in (free, total)), f"memory() gave {(free, total)!r}")
    expect(0 < total and 0 <= free <= total, f"memory() = (free {free}, total {total}) is not 0 <= free <= total")
    return f"free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB"


def check_deterministic(device: Device, backend: Backend) -> str:
    """Computing the same graph twice over the same inputs gives the same bytes."""
    names = ("MUL_MAT(type_a=q4_0,type_b=f32,m=67,n=33,k=256)", "MUL_MAT(type_a=f32,type_b=f32,m=67,n=33,k=256)",
             "SOFT_MAX(ne=[256,7,8,1],mask=f16,scale=0.125,max_bias=0)", "RMS_NORM(ne=[4096,2],eps=1e-05)",
             "FLASH_ATTN_EXT(hs=128,gqa=4,type_kv=f16,n_head=8,n_tokens=7,n_kv=33)",
             "MUL_MAT_ID(type_a=q4_K,n_expert=4,n_used=2,b_ne1=2,n_tokens=5,m=16,k=256,ids=repeated)")
    by_name = {c.name: c for c in C.op_cases() if c.name in names}
    done = []
    for name in names:
        b = by_name[name].make()
        graph = build_graph(b.out)
        if unsupported_nodes(device, graph):
            continue
        graph, _ = prepare(device, b.out, b.inputs)
        root = b.out.root
        runs = []
        for _ in range(3):
            backend.graph_compute(graph)
            backend.synchronize()
            runs.append(root.buffer.get_tensor(root))
        expect(all(np.array_equal(runs[0], r) for r in runs[1:]), f"{name}: repeated compute gave different bytes")
        done.append(by_name[name].op.name)
    return "3 runs each: " + (", ".join(done) if done else "none of the probe ops is supported")


CHECKS: dict[str, Callable[[Device, Backend], str]] = {
    "identity": check_identity,
    "alignment": check_alignment,
    "host_view": check_host_view,
    "alloc_size": check_alloc_size,
    "round_trip": check_round_trip,
    "memset_clear": check_memset_clear,
    "free": check_free,
    "cpy_tensor": check_cpy_tensor,
    "async_set_get": check_async,
    "events": check_events,
    "extra_buffer_types": check_extra_buffer_types,
    "unsupported_refused": check_unsupported_refused,
    "memory": check_memory,
    "deterministic": check_deterministic,
}
