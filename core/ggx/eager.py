"""`ggx.compute`: compute tensors on one device now — build the graph, place the leaves, run, read back.

Threads. `compute` may be called from any thread, and calls run one at a time: one lock (per
process) is held from placing the inputs to reading the outputs back. Each call therefore sees
only its own inputs and results, also when threads share tensors (a weight passed once and
used by every thread) or compute on different devices. The lock is needed because a call
mutates shared state: the cached per-device stream and scheduler (whose compute buffer holds
every call's intermediate results), and the tensors themselves (their buffers, the leaves'
data). Kernels still use many threads inside one call (the CPU backend's `n_threads`).
Work that must run in parallel from several threads uses its own `Scheduler` (and tensors)
per thread, as ggml's schedulers and backends are used by one thread at a time.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .alloc import alloc_tensors
from .backend import Backend, Device
from .errors import GGXDeviceError, GGXShapeError
from .graph import Graph, build_graph
from .sched import Scheduler
from .tensor import Tensor, TensorFlag
from .tensor_data import get_tensor_data, to_raw


@dataclass
class _DeviceState:
    """What `compute` keeps per device (the device itself too, so its id is not reused)."""

    device: Device
    backend: Backend
    scheduler: Scheduler | None = None


_lock = threading.RLock()
_states: dict[int, _DeviceState] = {}


def resolve_device(device: Device | str | None) -> Device:
    from . import registry

    if device is None:
        return registry.default_device()
    if isinstance(device, Device):
        return device
    return registry.get_device(device)


def _state(device: Device) -> _DeviceState:
    state = _states.get(id(device))
    if state is None:
        state = _states[id(device)] = _DeviceState(device, device.init_backend())
    return state


def _scheduler_for(device: Device) -> Scheduler:
    """The cached scheduler of `compute` calls on `device` (call it holding the lock): one stream
    of the device, plus a host stream when it is not a host device (ops the device does not
    support fall back there)."""
    state = _state(device)
    if state.scheduler is None:
        backends = [state.backend]
        if not device.buffer_type().is_host:
            from .placement import host_device

            backends.append(_state(host_device()).backend)
        state.scheduler = Scheduler(backends)
    return state.scheduler


def compute(outputs: Sequence[Tensor] | Tensor, inputs: Mapping[Tensor, np.ndarray] | None = None,
            device: Device | str | None = None) -> list[np.ndarray]:
    """Compute `outputs` on one device and return them as numpy arrays (numpy order = ne reversed).

    `inputs` maps leaf tensors to float arrays (quantized on the way in) or raw block bytes.
    A leaf keeps its data on that device for later calls until it is set again. Safe to call
    from several threads: calls run one at a time (see the module docstring).
    """
    single = isinstance(outputs, Tensor)
    outs = [outputs] if single else list(outputs)
    inputs = dict(inputs or {})
    dev = resolve_device(device)
    with _lock:
        graph: Graph = build_graph(outs)
        buft = dev.buffer_type()
        for t in inputs:
            if not isinstance(t, Tensor):
                raise GGXShapeError(f"inputs keys must be Tensors, got {type(t).__name__}")
            if t not in graph.leafs and t.root not in graph.leafs:
                what = (f"is computed by this graph ({t.op.name}), only leaves take data" if t in graph.nodes
                        else "is not a leaf of the graph of these outputs")
                raise GGXShapeError(f"input {t.describe()} {what}")
        raw = {t: to_raw(t, value) for t, value in inputs.items()}  # every input checked before any is placed
        fresh = [t for t in graph.leafs
                 if t.buffer is None or t.buffer.buft is not buft or (t in inputs and t.buffer.size < t.nbytes)]
        for t in fresh:
            if t not in inputs:
                where = ("has no data" if t.buffer is None
                         else f"holds its data on {t.buffer.buft.name}, not {buft.name}")
                raise GGXShapeError(f"leaf {t.describe()} {where}: pass it in inputs=")
        for t in fresh:
            alloc_tensors(buft, [t])
        for t, data in raw.items():
            t.flags |= TensorFlag.INPUT
            t.data_buffer.set_tensor(t, data, 0)
        # intermediate tensors are placed by the scheduler's allocator (memory reused across nodes)
        try:
            _scheduler_for(dev).graph_compute(graph)
        except GGXDeviceError:
            _states.pop(id(dev), None)  # a device that was lost: the next call starts a new stream
            raise
        return [get_tensor_data(t) for t in outs]
