"""Where a model's graphs run: its devices, their backends, the scheduler, weight placement.

Devices default to every device of the loaded plugins except the reference backend ("ref"),
which is used only when nothing else is installed or when asked for by name. The scheduler
(ggx.sched) splits each graph over the backends; a graph whose key it has seen before reuses
the plan (the decode loop).
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from ..backend import Backend, BufferType, Device
from ..compute import get_tensor_data, to_raw
from ..errors import GGXUnsupported
from ..graph import build_graph
from ..tensor import Tensor

REF_DEVICE = "ref"


def resolve_devices(devices: Sequence[str | Device] | None) -> list[Device]:
    from .. import registry

    if devices:
        return [d if isinstance(d, Device) else registry.get_device(d) for d in devices]
    found = registry.devices()
    preferred = [d for d in found if d.name != REF_DEVICE]
    return preferred or found


def set_n_threads(backend: Backend, n_threads: int) -> bool:
    """ggml's "set_n_threads" capability, looked up on the backend, then on its device's reg."""
    fn = backend.get_proc_address("set_n_threads")
    reg = getattr(backend.device, "reg", None)
    if fn is None and reg is not None:
        fn = reg.get_proc_address("set_n_threads")
    if fn is None:
        return False
    fn(backend, n_threads)
    return True


class Runner:
    """Runs graphs for one model on its devices through one scheduler."""

    def __init__(self, devices: Sequence[str | Device] | None = None, n_threads: int | None = None):
        self.devices = resolve_devices(devices)
        if not self.devices:
            raise GGXUnsupported("no device to run the model on")
        self.backends = [d.init_backend() for d in self.devices]
        self.n_threads = None
        if n_threads:
            self.set_n_threads(n_threads)
        self._bufts = self._buft_list()
        self.sched = self._make_scheduler()
        self.last_splits = 1
        self.timings: dict[str, float] = defaultdict(float)  # seconds, accumulated (`ggx bench --profile`)

    def set_n_threads(self, n_threads: int) -> None:
        for be in self.backends:
            set_n_threads(be, n_threads)
        self.n_threads = n_threads

    # --- placement ----------------------------------------------------------------------------
    def _buft_list(self) -> list[BufferType]:
        """Buffer types in priority order for weights: ggx.placement's list for the first device."""
        try:
            from .. import placement
        except ImportError:
            return [self.devices[0].buffer_type()]
        return list(placement.buft_list(self.devices[0]))

    def weight_buffer_type(self, op: Tensor) -> BufferType:
        """The buffer type for weight op.src[0] (ggml's select_buft over the buffer-type list)."""
        try:
            from .. import placement
        except ImportError:
            return self._bufts[0]
        return placement.select_buft(self._bufts, op)

    def compute_buffer_type(self) -> BufferType:
        return self.devices[0].buffer_type()

    @property
    def buffer_types_used(self) -> list[str]:
        return [b.name for b in self._bufts]

    # --- running ------------------------------------------------------------------------------
    def _make_scheduler(self):
        try:
            from ..sched import Scheduler
        except ImportError:
            return None
        return Scheduler(self.backends)

    def run(self, outputs: Sequence[Tensor], data: Mapping[Tensor, np.ndarray]) -> list[np.ndarray]:
        """Compute `outputs` with the input leaves set to `data`; numpy results (order = ne reversed)."""
        tm = self.timings
        t0 = time.perf_counter()
        graph = build_graph(list(outputs))
        t1 = time.perf_counter()
        tm["build_graph"] += t1 - t0
        if self.sched is None:
            from ..compute import compute

            result = compute(outputs, data, self.devices[0])
            tm["compute (no scheduler)"] += time.perf_counter() - t1
            return result
        self.sched.alloc_graph(graph)
        t2 = time.perf_counter()
        for t, value in data.items():
            t.data_buffer.set_tensor(t, to_raw(t, value), 0)
        t3 = time.perf_counter()
        self.sched.graph_compute(graph)
        t4 = time.perf_counter()
        self.last_splits = getattr(self.sched, "n_splits", 1)
        result = [get_tensor_data(t) for t in outputs]
        t5 = time.perf_counter()
        tm["sched.alloc_graph"] += t2 - t1
        tm["set inputs"] += t3 - t2
        tm["sched.graph_compute"] += t4 - t3
        tm["read outputs"] += t5 - t4
        return result
