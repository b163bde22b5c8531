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

from .. import placement
from ..backend import Backend, BufferType, Device
from ..compute import get_tensor_data, to_raw
from ..errors import GGXUnsupported
from ..graph import Graph
from ..sched import MoeExpertUpload, Scheduler
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
    """ggml's "set_n_threads" capability f(backend, n), looked up on the backend's reg."""
    reg = getattr(backend.device, "reg", None)
    fn = reg.get_proc_address("set_n_threads") if reg is not None else None
    if fn is None:
        return False
    fn(backend, n_threads)
    return True


class Runner:
    """Runs graphs for one model on its devices through one scheduler."""

    def __init__(self, devices: Sequence[str | Device] | None = None, n_threads: int | None = None,
                 moe: bool = False):
        self.devices = resolve_devices(devices)
        if not self.devices:
            raise GGXUnsupported("no device to run the model on")
        if not self.devices[-1].buffer_type().is_host:
            self.devices.append(placement.host_device())  # the scheduler's last backend runs what nothing else can
        self.backends = [d.init_backend() for d in self.devices]
        self.n_threads = None
        if n_threads:
            self.set_n_threads(n_threads)
        self._bufts = self._buft_list()
        # llama.cpp installs the expert-upload callback for every MoE model: when experts stay in
        # host memory and a MUL_MAT_ID runs elsewhere, only the experts the batch uses travel
        self.copy_callback = MoeExpertUpload() if moe else None
        self.sched = Scheduler(self.backends, copy_callback=self.copy_callback)
        self.last_splits = 1
        self._last_graph: Graph | None = None
        self.timings: dict[str, float] = defaultdict(float)  # seconds, accumulated (`ggx bench --profile`)

    def set_n_threads(self, n_threads: int) -> None:
        for be in self.backends:
            set_n_threads(be, n_threads)
        self.n_threads = n_threads

    # --- placement ----------------------------------------------------------------------------
    def _buft_list(self) -> list[BufferType]:
        """Buffer types in priority order for weights: ggx.placement's list for the first device."""
        return placement.buft_list(self.devices[0], host=self.devices[-1])

    def weight_buffer_type(self, weight: Tensor, op: Tensor) -> BufferType:
        """The buffer type for `weight`, read by `op` (ggml's select_buft over the buffer-type list)."""
        return placement.select_buft(weight, op, self._bufts)

    def compute_buffer_type(self) -> BufferType:
        return self.devices[0].buffer_type()

    def host_buffer_type(self) -> BufferType:
        """Host memory of the last (host) backend: where `host_experts` keeps expert weights."""
        return self.devices[-1].buffer_type()

    # --- running ------------------------------------------------------------------------------
    def run(self, graph: Graph, outputs: Sequence[Tensor], data: Mapping[Tensor, np.ndarray]) -> list[np.ndarray]:
        """Compute `graph` with its input leaves set to `data`; `outputs` as numpy (order = ne reversed).

        The scheduler places the graph (alloc_graph) before the inputs are written, except when
        the very graph it ran last comes back: its tensors are still placed where the reused plan
        puts them, and graph_compute places it again anyway.
        """
        tm = self.timings
        t1 = time.perf_counter()
        if graph is not self._last_graph:
            self.sched.alloc_graph(graph)
            self._last_graph = graph
        t2 = time.perf_counter()
        for t, value in data.items():
            t.data_buffer.set_tensor(t, to_raw(t, value), 0)
        t3 = time.perf_counter()
        self.sched.graph_compute(graph)
        t4 = time.perf_counter()
        self.last_splits = self.sched.stats.n_splits
        result = [get_tensor_data(t) for t in outputs]
        t5 = time.perf_counter()
        tm["sched.alloc_graph"] += t2 - t1
        tm["set inputs"] += t3 - t2
        tm["sched.graph_compute"] += t4 - t3
        tm["read outputs"] += t5 - t4
        return result
