"""`ggx.compute`: the small public entry point: build, place, run, read back."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .alloc import alloc_tensors
from .backend import Backend, Device
from .errors import GGXShapeError, GGXUnsupported
from .graph import Graph, build_graph
from .sched import Scheduler
from .tensor import Tensor, TensorFlag
from .types import GType

_backends: dict[int, Backend] = {}
_schedulers: dict[int, Scheduler] = {}


def resolve_device(device: Device | str | None) -> Device:
    from . import registry

    if device is None:
        return registry.default_device()
    if isinstance(device, Device):
        return device
    return registry.get_device(device)


def backend_for(device: Device) -> Backend:
    """One cached execution stream per device for `compute` calls."""
    be = _backends.get(id(device))
    if be is None:
        be = _backends[id(device)] = device.init_backend()
    return be


def scheduler_for(device: Device) -> Scheduler:
    """One cached scheduler per device: its stream, plus a host stream when it is not a host device
    (ops the device does not support fall back there)."""
    sched = _schedulers.get(id(device))
    if sched is None:
        backends = [backend_for(device)]
        if not device.buffer_type().is_host:
            from .placement import host_device

            backends.append(backend_for(host_device()))
        sched = _schedulers[id(device)] = Scheduler(backends)
    return sched


def to_raw(t: Tensor, value: np.ndarray) -> np.ndarray:
    """Bytes for tensor `t` in ggml layout: raw uint8 block bytes pass through, numbers are converted."""
    from .quants import quantize

    value = np.asarray(value)
    if value.dtype == np.uint8 and t.type is not GType.F32:
        if value.size != t.nbytes:
            raise GGXShapeError(f"{t.describe()}: {value.size} raw bytes given, it holds {t.nbytes}")
        return value.reshape(-1)
    if value.size != t.nelements:
        raise GGXShapeError(f"{t.describe()}: got an array of shape {value.shape} ({value.size} values), "
                            f"the tensor has {t.nelements} (numpy shape {t.shape})")
    rows = value.reshape(-1, t.ne[0])
    if t.type in (GType.I32, GType.I64):
        return np.ascontiguousarray(rows, dtype=t.type.block_dtype).view(np.uint8).reshape(-1)
    return quantize(rows.astype(np.float32, copy=False), t.type, name=t.name or "input").reshape(-1)


def from_raw(t: Tensor, raw: np.ndarray, base_offset: int) -> np.ndarray:
    """Values of `t` from the bytes of its memory starting `base_offset` bytes before its data."""
    from .quants import dequantize

    if t.type.is_quantized:
        if not t.is_contiguous():
            raise GGXUnsupported(f"{t.describe()}: reading a strided quantized tensor is not supported")
        data = raw[base_offset: base_offset + t.nbytes]
        return dequantize(data, t.type, t.nelements).reshape(t.shape)
    dt = t.type.block_dtype
    shape = (t.ne[3], t.ne[2], t.ne[1], t.ne[0])
    strides = (t.nb[3], t.nb[2], t.nb[1], t.nb[0])
    arr = np.ndarray(shape, dt, raw, base_offset, strides)
    if t.type is GType.BF16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    elif t.type is GType.F16:
        arr = arr.astype(np.float32)
    return np.array(arr).reshape(t.shape)


def _fresh_values(t: Tensor, raw: np.ndarray) -> np.ndarray:
    """from_raw for bytes nobody else holds (just read back): a plain contiguous F32/int tensor
    is returned as a view of them instead of a second copy (decode reads 200 KB of logits a step)."""
    if raw.flags.owndata and t.type in (GType.F32, GType.I32, GType.I64) and t.is_contiguous() \
            and raw.size == t.nbytes:  # owndata: a copy, not a view of the buffer's memory
        return raw.view(t.type.block_dtype).reshape(t.shape)
    return from_raw(t, raw, 0)


def set_tensor_data(t: Tensor, value: np.ndarray) -> None:
    """Write `value` (numbers or raw block bytes) into the tensor's memory."""
    t.data_buffer.set_tensor(t, to_raw(t, value), 0)


def get_tensor_data(t: Tensor) -> np.ndarray:
    """Read a tensor back as numpy: float32 for float/quantized types, int for index types."""
    first = t.data_offset
    span = t.nbytes
    root = t.root
    raw = root.data_buffer.get_tensor(root, first - root.offset, span) if t.is_view else \
        t.data_buffer.get_tensor(t, 0, span)
    return _fresh_values(t, raw)


def compute(outputs: Sequence[Tensor] | Tensor, inputs: Mapping[Tensor, np.ndarray] | None = None,
            device: Device | str | None = None) -> list[np.ndarray]:
    """Compute `outputs` on one device and return them as numpy arrays (numpy order = ne reversed).

    `inputs` maps leaf tensors to float arrays (quantized on the way in) or raw block bytes.
    A leaf keeps its data on that device for later calls until it is set again.
    """
    single = isinstance(outputs, Tensor)
    outs = [outputs] if single else list(outputs)
    inputs = dict(inputs or {})
    dev = resolve_device(device)
    graph: Graph = build_graph(outs)
    buft = dev.buffer_type()
    for t in inputs:
        if not isinstance(t, Tensor):
            raise GGXShapeError(f"inputs keys must be Tensors, got {type(t).__name__}")
        if t not in graph.leafs and t.root not in graph.leafs:
            raise GGXShapeError(f"input {t.describe()} is not a leaf of the graph of these outputs")
    fresh = [t for t in graph.leafs
             if t.buffer is None or t.buffer.buft is not buft or (t in inputs and t.buffer.size < t.nbytes)]
    for t in fresh:
        if t not in inputs:
            where = "has no data" if t.buffer is None else f"holds its data on {t.buffer.buft.name}, not {buft.name}"
            raise GGXShapeError(f"leaf {t.describe()} {where}: pass it in inputs=")
    if fresh:
        for t in fresh:
            alloc_tensors(buft, [t])
    for t, value in inputs.items():
        t.flags |= TensorFlag.INPUT
        set_tensor_data(t, value)
    # intermediate tensors are placed by the scheduler's allocator (memory reused across nodes)
    scheduler_for(dev).graph_compute(graph)
    return [get_tensor_data(t) for t in outs]
