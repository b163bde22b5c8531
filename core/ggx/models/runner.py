"""Where a model's graphs run: its devices, their backends, the scheduler, the weights' buffer types.

Devices default to llama.cpp's choice: every device that is not CPU-type (GPU, IGPU, ACCEL), then
the host CPU device (`placement.host_device()`: the "CPU" device, or the reference backend "ref"
when no CPU plugin is installed). Another plugin's CPU-type device runs only when asked for by
name, so installing one does not change the default run. Devices asked for that include no
device running every op ("CPU" or "ref") get the host CPU device appended: the scheduler's last
backend runs the ops the others cannot, as in ggml (`placement.run_host`). The scheduler
(ggx.sched) splits each graph over the backends; a graph whose key it has seen before reuses
the plan (the decode loop).

The model's layers are split over `split_devices` (llama.cpp's split mode LAYER,
`placement.layer_split`): the devices asked for, in their order (a host device appended as
fallback takes no layers), or by default the devices that are not CPU-type, or the host device
alone when there is none (then every weight sees today's single buffer-type list). The bytes the
scheduler copies between devices are summed over every graph run (`bytes_copied`).
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .. import placement
from ..backend import Backend, BufferType, Device, DeviceType
from ..errors import GGXUnsupported
from ..graph import Graph
from ..sched import Scheduler
from ..tensor import Tensor
from ..tensor_data import get_tensor_data, to_raw
from .moe import MoeExpertUpload


def resolve_devices(devices: Sequence[str | Device] | None) -> list[Device]:
    from .. import registry

    if devices:
        return [d if isinstance(d, Device) else registry.get_device(d) for d in devices]
    found = registry.devices()
    return [d for d in found if d.type != DeviceType.CPU] + [placement.host_device(found)]


def _unique(devices: Sequence[Device]) -> list[Device]:
    """`devices` in order, each once."""
    out: list[Device] = []
    for d in devices:
        if not any(d is u for u in out):
            out.append(d)
    return out


def set_n_threads(backend: Backend, n_threads: int) -> bool:
    """ggml's "set_n_threads" capability f(backend, n), looked up on the backend's reg."""
    reg = getattr(backend.device, "reg", None)
    fn = reg.get_proc_address("set_n_threads") if reg is not None else None
    if fn is None:
        return False
    fn(backend, n_threads)
    return True


class YieldingLock:
    """A reentrant lock that work in the background takes only between the calls of others
    (`begin_step`): a caller waits at most for the one background step under way."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0
        self._last_used = time.monotonic()  # when a caller last took or let go of the lock
        self._stepping: int | None = None  # the thread inside a background step

    def __enter__(self) -> YieldingLock:
        if self._stepping == threading.get_ident():  # a background step's own nested use
            self._lock.acquire()
            return self
        with self._cond:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._cond:
                self._waiting -= 1
                self._last_used = time.monotonic()
                if not self._waiting:
                    self._cond.notify_all()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stepping != threading.get_ident():
            self._last_used = time.monotonic()
        self._lock.release()

    def begin_step(self, quiet_s: float, stop: threading.Event) -> bool:
        """Take the lock for one step of background work, once no caller waits for it and none
        has used it for `quiet_s` seconds (calls in quick succession are not split by a step);
        False, not taken, once `stop` is set (`wake` makes a waiting step look at it)."""
        while True:
            with self._cond:
                while True:
                    if stop.is_set():
                        return False
                    left = self._last_used + quiet_s - time.monotonic()
                    if not self._waiting and left <= 0:
                        break
                    self._cond.wait(None if self._waiting else left)
            self._lock.acquire()
            with self._cond:
                if not self._waiting and time.monotonic() - self._last_used >= quiet_s:
                    break
            self._lock.release()  # a caller came in between, or has just let go: it goes first
        self._stepping = threading.get_ident()
        return True

    def end_step(self) -> None:
        self._stepping = None
        self._lock.release()

    def wake(self) -> None:
        """Make a background step waiting in `begin_step` look at its stop event now."""
        with self._cond:
            self._cond.notify_all()


class Runner:
    """Runs graphs for one model on its devices through one scheduler. Its calls hold `lock`
    (a model's preparation in the background takes it between them)."""

    def __init__(self, devices: Sequence[str | Device] | None = None, n_threads: int | None = None,
                 moe: bool = False):
        #: held by every call that uses the scheduler or the backends; the model's background
        #: preparation takes it only while nobody uses or waits for it (`YieldingLock.begin_step`)
        self.lock = YieldingLock()
        self.devices = resolve_devices(devices)
        if not self.devices:
            raise GGXUnsupported("no device to run the model on")
        #: the host CPU device: last backend of the scheduler, plain memory for host-side weights
        self.host = placement.run_host(self.devices)
        #: the devices the layers are split over, in order (see the module docstring)
        self.split_devices: list[Device] = _unique(self.devices) if devices else \
            ([d for d in _unique(self.devices) if d.type != DeviceType.CPU] or [self.host])
        # the scheduler's order (ggml's): the host CPU last, whatever the split's order
        self.devices = [d for d in self.devices if d is not self.host] + [self.host]
        #: every buffer type a weight may go to, best first (ggx.placement.buft_list over the
        #: devices); each weight chooses from its layer's part of it (`layer_bufts`)
        self.weight_bufts: list[BufferType] = placement.buft_list(self.devices)
        self._layer_bufts: dict[int, list[BufferType]] = {}
        #: split inputs and their bytes the scheduler copied between backends, over every run
        self.n_inputs_copied = 0
        self.bytes_copied = 0
        self.backends = [d.init_backend() for d in self.devices]
        self.n_threads = None
        if n_threads:
            self.set_n_threads(n_threads)
        # llama.cpp installs the expert-upload callback for every MoE model: when experts stay in
        # host memory and a MUL_MAT_ID runs elsewhere, only the experts the batch uses travel
        self.copy_callback = MoeExpertUpload() if moe else None
        self.sched = Scheduler(self.backends, copy_callback=self.copy_callback)
        self.last_splits = 1
        self._last_graph: Graph | None = None
        self.timings: dict[str, float] = defaultdict(float)  # seconds, accumulated (`ggx bench --profile`)
        #: called before every graph is computed; one that raises refuses the compute (a model whose
        #: weights are mapped checks that its file is unchanged: reading a truncated map kills the process)
        self.checks: list[Callable[[], None]] = []

    def layer_bufts(self, device: Device) -> list[BufferType]:
        """Buffer types for the weights of a layer on `device`, best first: its own, then the
        host CPU's as the fallback for a weight it refuses (`placement.buft_list([device, host])`)."""
        bufts = self._layer_bufts.get(id(device))
        if bufts is None:
            bufts = self._layer_bufts[id(device)] = placement.buft_list([device, self.host])
        return bufts

    def set_n_threads(self, n_threads: int) -> None:
        with self.lock:
            for be in self.backends:
                set_n_threads(be, n_threads)
            self.n_threads = n_threads

    # --- ahead of time -------------------------------------------------------------------------
    def reserve(self, graph: Graph) -> None:
        """Size the compute buffers for `graph` (the largest the model will run), so that graphs
        prepared after it are not moved by a buffer that grows."""
        with self.lock:
            self.sched.reserve(graph)
            self._last_graph = None

    def prepare(self, graph: Graph) -> None:
        """Plan, place and bind `graph` now, computing nothing: its first `run` starts at once."""
        with self.lock:
            t0 = time.perf_counter()
            self.sched.graph_prepare(graph)
            self._last_graph = None
            self.timings["prepare graphs"] += time.perf_counter() - t0

    # --- running ------------------------------------------------------------------------------
    def run(self, graph: Graph, outputs: Sequence[Tensor], data: Mapping[Tensor, np.ndarray]) -> list[np.ndarray]:
        """Compute `graph` with its input leaves set to `data`; `outputs` as numpy (order = ne reversed).

        The scheduler places the graph (alloc_graph) before the inputs are written, except when
        the very graph it ran last comes back: its tensors are still placed where the reused plan
        puts them, and graph_compute places it again anyway.
        """
        with self.lock:
            return self._run(graph, outputs, data)

    def _run(self, graph: Graph, outputs: Sequence[Tensor], data: Mapping[Tensor, np.ndarray]) -> list[np.ndarray]:
        for check in self.checks:
            check()
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
        st = self.sched.stats  # counts of this graph only: graph_compute resets them
        self.last_splits = st.n_splits
        self.n_inputs_copied += st.n_inputs_copied
        self.bytes_copied += st.bytes_copied
        result = [get_tensor_data(t) for t in outputs]
        t5 = time.perf_counter()
        tm["sched.alloc_graph"] += t2 - t1
        tm["set inputs"] += t3 - t2
        tm["sched.graph_compute"] += t4 - t3
        tm["read outputs"] += t5 - t4
        return result
