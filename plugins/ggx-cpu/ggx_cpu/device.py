"""The device layer of ggx-cpu: CpuBackendReg -> CpuDevice -> CpuBackend (ggml-cpu.cpp).

Nothing here imports numba or compiles anything: kernels are imported on the first
graph_compute that needs them (numba compiles lazily and caches on disk), so listing devices
and answering supports_op stay cheap.

- Memory is the host's: tensors live in the core's HostBufferType, named "CPU", or in any
  `is_host` buffer type (the kernels read it through `Buffer.host_view()`).
- Extra buffer types (repack, AMX) are the ones plugins offer for this device (the engine merges
  them: `ggx.registry.extra_buffer_types(device)`); each knows its device, so the device supports
  one by `buft.device is self`, without asking the registry. An op whose src[0] lives in one is
  that type's to compute when it accepts the op; otherwise every source must be host memory and the op/type pair one
  the kernels take (ggml_backend_cpu_device_supports_op).
- graph_compute binds every node's launch (view ops skipped) before running any and keeps the
  launches of a graph computed again (`launches`): an op whose src[0] lives in an extra buffer
  type gets that type's `prepare_forward`, else the kernel table's wrapper. A kernel on one
  thread is one numba call; on n_threads it is a split kernel run by the worker pool
  (`plan_for`).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import numpy as np

from ggx.backend import (
    Backend,
    BackendReg,
    Buffer,
    BufferType,
    Device,
    DeviceCaps,
    DeviceType,
    ExtraBufferType,
    Launch,
)
from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.graph import Graph
from ggx.host import HostBuffer, HostBufferType, host_memory
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType

from . import __version__, sysinfo
from .kernels import FLOAT_TYPES, LOAD_TYPES, SLOW_STORE_TYPES, STORE_TYPES
from .traits import buft_of

#: Op -> (module under ggx_cpu.kernels, function(node, n_threads) -> Launch); imported on first
#: use, so that answering supports_op never loads numba.
KERNELS: dict[Op, tuple[str, str]] = {
    Op.ADD: ("elementwise", "add"),
    Op.MUL: ("elementwise", "mul"),
    Op.SCALE: ("elementwise", "scale"),
    Op.SILU: ("elementwise", "silu_op"),
    Op.GELU: ("elementwise", "gelu"),
    Op.GLU: ("elementwise", "glu"),
    Op.RMS_NORM: ("norm", "rms_norm"),
    Op.NORM: ("norm", "norm"),
    Op.ROPE: ("rope", "rope"),
    Op.SOFT_MAX: ("softmax", "soft_max"),
    Op.FLASH_ATTN_EXT: ("attention", "flash_attn_ext"),
    Op.GET_ROWS: ("rows", "get_rows"),
    Op.SET_ROWS: ("rows", "set_rows"),
    Op.CPY: ("cpy", "cpy"),
    Op.DUP: ("cpy", "cpy"),
    Op.CONT: ("cpy", "cpy"),
    Op.ARGSORT: ("sort", "argsort"),
    Op.TOP_K: ("sort", "top_k"),
    Op.SUM_ROWS: ("reduce", "sum_rows"),
    Op.MUL_MAT: ("matmul", "mul_mat"),
    Op.MUL_MAT_ID: ("matmul", "mul_mat_id"),
}

#: Weight types the matrix-product kernels take (mul_mat / mul_mat_id src[0]).
MUL_MAT_TYPES = frozenset({GType.F32, GType.F16, GType.BF16, GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0,
                           GType.Q4_K, GType.Q6_K})

#: Ops cheaper than waking a second thread of numba's pool run on one thread when their result
#: has fewer elements than this.
SMALL_OP_ELEMENTS = 16384
#: FLASH_ATTN_EXT runs on one thread below this many (query row, kv slot) pairs: one decode
#: token over a few hundred cache slots already gains from a second thread.
SMALL_FA_PAIRS = 1024
_ALWAYS_THREADED = frozenset({Op.MUL_MAT, Op.MUL_MAT_ID})

# The per-node path keys its sets and caches by id(op): Enum.__hash__ is a Python-level call,
# and a decode step binds some hundreds of nodes.
_ALWAYS_THREADED_IDS = frozenset(id(op) for op in _ALWAYS_THREADED)
_NOTHING_TO_RUN_IDS = frozenset(id(op) for op in Op if op.is_view or op is Op.NONE)
_SET_ROWS_ID = id(Op.SET_ROWS)
_FLASH_ATTN_ID = id(Op.FLASH_ATTN_EXT)

_kernel_cache: dict[int, Callable[[Tensor, int], Launch]] = {}


def kernel_for(op: Op) -> Callable[[Tensor, int], Launch]:
    """The kernel wrapper for `op` (imports its module on first use)."""
    fn = _kernel_cache.get(id(op))
    if fn is None:
        entry = KERNELS.get(op)
        if entry is None:
            raise GGXUnsupported(f"CPU: no kernel for {op.name}")
        fn = _kernel_cache[id(op)] = getattr(importlib.import_module(f"ggx_cpu.kernels.{entry[0]}"), entry[1])
    return fn


def _extra_of(buft: BufferType | None, device: Device) -> bool:
    """Is `buft` an extra buffer type of `device` (ggml: the CPU device's extra buffer types)?"""
    return isinstance(buft, ExtraBufferType) and buft.device is device


# --- the contracts ------------------------------------------------------------------------------
class CpuBackend(Backend):
    """One synchronous execution stream on the CPU: graph_compute returns when the work is done."""

    name = "CPU"

    def __init__(self, device: CpuDevice, n_threads: int | None = None):
        from .prepared import PreparedGraphs  # numba loads with the first backend, not at discovery

        super().__init__(device)
        self.n_threads = sysinfo.default_threads()
        self.prepared = PreparedGraphs()
        if n_threads is not None:
            self.set_n_threads(n_threads)

    def set_n_threads(self, n_threads: int) -> None:
        if not isinstance(n_threads, int) or n_threads < 1:
            raise GGXShapeError(f"CPU: n_threads must be a positive integer, got {n_threads!r}")
        self.n_threads = n_threads

    def threads_for(self, node: Tensor) -> int:
        op_id = id(node.op)
        if self.n_threads == 1 or op_id in _ALWAYS_THREADED_IDS:
            return self.n_threads
        if op_id == _FLASH_ATTN_ID:
            q, k = node.src[0], node.src[1]
            return 1 if q.ne[1] * q.ne[2] * q.ne[3] * k.ne[1] < SMALL_FA_PAIRS else self.n_threads
        # SET_ROWS' result is the whole destination (a KV cache): its work is the rows written
        work = node.src[1] if op_id == _SET_ROWS_ID and len(node.src) > 1 else node
        return 1 if work.nelements < SMALL_OP_ELEMENTS else self.n_threads

    def plan_for(self, node: Tensor) -> int:
        """How `node`'s split kernels run (the one place that decides): as jobs of the worker pool
        on n_threads threads (the number returned), or (0, the workers off or one thread) as one
        numba parallel region over their parts. Every node goes to the pool: a region waits at
        every launch for each of its threads, a descheduled one included (one busy process on
        the machine cut a 32-token prompt to 1-3 % of its quiet speed), while a job never waits
        for a worker that has not started a part, and a batch's kernels split in several parts a
        thread (`kernels.common.split_parts`) share out by who is running. A decode step's ~150
        short launches gain most: a region's fork and join costs more than many of them."""
        from . import pool

        return self.n_threads if self.n_threads > 1 and pool.enabled() else 0

    def launch_for(self, node: Tensor) -> Launch | None:
        """Validate `node` and bind its kernel (None for a node with nothing to run): its src[0]'s
        extra buffer type first, else the kernel table. A type that declines keeps ggml's layout
        in host memory (`is_host`), or the op cannot run here. Split kernels are planned here
        (`plan_for`)."""
        from .launch import planned

        if id(node.op) in _NOTHING_TO_RUN_IDS or node.nelements == 0:
            return None
        buft = buft_of(node.src[0] if node.src else None)
        if isinstance(buft, ExtraBufferType):
            f = buft.prepare_forward(node, self.n_threads)
            if f is not None:
                return planned(f, self.plan_for(node))
            if not buft.is_host:
                raise GGXUnsupported(f"CPU: {node.describe()} reads {node.src[0].describe()} from {buft.name}, "
                                     "whose layout the CPU kernels cannot read, and its prepare_forward gave no "
                                     "launch (an extra buffer type must compute every op it accepts)")
        return planned(kernel_for(node.op)(node, self.threads_for(node)), self.plan_for(node))

    def graph_compute(self, graph: Graph) -> None:
        """Run the graph's nodes in order; a graph computed again reuses its launches."""
        self.prepared.get(graph, self.n_threads, self.launch_for).run()

    def graph_prepare(self, graph: Graph) -> None:
        """Validate the graph's nodes and bind their launches now, fused (`prepared`): the next
        compute only calls them. The scheduler prepares the graphs a model keeps."""
        self.prepared.get(graph, self.n_threads, self.launch_for).fuse_now()

    def graph_profile(self, graph: Graph) -> list[tuple[Tensor, float]]:
        """Compute `graph` as graph_compute does (fused when prepared), timing each node."""
        return self.prepared.get(graph, self.n_threads, self.launch_for).profile()

    def get_proc_address(self, name: str) -> Callable | None:
        if name == "set_n_threads":
            return self.set_n_threads
        return self.device.reg.get_proc_address(name) if self.device.reg is not None else None


class CpuDevice(Device):
    """The host CPU: host memory, every op of the catalogue, the extra buffer types plugins offer."""

    name = "CPU"
    type = DeviceType.CPU
    caps = DeviceCaps(async_=False, host_buffer=False, buffer_from_host_ptr=True, events=False)

    def __init__(self, reg: CpuBackendReg | None = None):
        self.reg = reg
        self._buft = HostBufferType(self, name="CPU")

    @functools.cached_property
    def description(self) -> str:  # type: ignore[override]
        return sysinfo.description()

    def memory(self) -> tuple[int, int]:
        return host_memory()

    def init_backend(self, **params) -> CpuBackend:
        unknown = set(params) - {"n_threads"}
        if unknown:
            raise GGXUnsupported(f"CPU: unknown backend parameters {sorted(unknown)}")
        return CpuBackend(self, params.get("n_threads"))

    def buffer_type(self) -> BufferType:
        return self._buft

    def buffer_from_host_ptr(self, array: np.ndarray, max_tensor_size: int) -> Buffer:
        """Wrap existing host memory (C-contiguous, aligned) as a CPU buffer, without copying."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise GGXUnsupported("CPU: buffer_from_host_ptr needs a C-contiguous numpy array")
        if array.ctypes.data % self._buft.alignment:
            raise GGXUnsupported(f"CPU: host memory must be {self._buft.alignment}-byte aligned")
        return HostBuffer(self._buft, array.nbytes, memory=array.reshape(-1).view(np.uint8))

    def supports_buft(self, buft: BufferType) -> bool:
        return buft.is_host or _extra_of(buft, self)

    def supports_op(self, op: Tensor) -> bool:
        buft = buft_of(op.src[0] if op.src else None)
        if _extra_of(buft, self) and buft.supports_op(op):
            return True
        for s in op.src:
            b = buft_of(s)
            if b is not None and not b.is_host:
                return False
        return op_supported(op)


def op_supported(op: Tensor) -> bool:
    """Can the kernels compute `op` (types and layouts), sources in host memory."""
    kind = op.op
    if kind.is_view or kind is Op.NONE:
        return True
    if kind not in KERNELS:
        return False
    src = op.src
    if kind in (Op.MUL_MAT, Op.MUL_MAT_ID):
        return src[0].type in MUL_MAT_TYPES and src[1].type is GType.F32
    if kind is Op.GET_ROWS:
        return (src[0].type in LOAD_TYPES or src[0].type is GType.I32) and src[0].has_contiguous_rows()
    if kind is Op.SET_ROWS:
        return src[0].type in STORE_TYPES | SLOW_STORE_TYPES and src[1].type is GType.F32
    if kind in (Op.CPY, Op.DUP, Op.CONT):
        a, b = src[0], op
        if a.type is b.type:
            return not a.type.is_quantized or (a.has_contiguous_rows() and b.has_contiguous_rows() and (
                a.ne[0] == b.ne[0] or (a.is_contiguous() and b.is_contiguous())))
        return a.type in FLOAT_TYPES and (b.type in STORE_TYPES or (
            b.type in SLOW_STORE_TYPES and b.has_contiguous_rows()))
    if kind is Op.FLASH_ATTN_EXT:
        return (src[0].type is GType.F32 and src[1].type in (GType.F16, GType.F32)
                and src[2].type in (GType.F16, GType.F32) and (len(src) < 4 or src[3].type is GType.F16))
    if kind is Op.SOFT_MAX:
        return src[0].type is GType.F32 and (len(src) < 2 or src[1].type in (GType.F16, GType.F32))
    if kind is Op.ROPE:
        return (src[0].type is GType.F32 and src[1].type is GType.I32
                and (len(src) < 3 or (src[2].type is GType.F32 and src[2].is_contiguous())))
    return all(s.type is GType.F32 for s in src)


class CpuBackendReg(BackendReg):
    """What ggx-cpu registers: one device, "CPU", and its optional capabilities."""

    name = "CPU"
    version = __version__

    def __init__(self) -> None:
        self._device = CpuDevice(self)

    def devices(self) -> list[Device]:
        return [self._device]

    def get_proc_address(self, name: str) -> Callable | None:
        """"set_n_threads" -> f(backend, n); "get_features" -> f() -> dict;
        "dev_get_extra_bufts": BackendReg's (the engine's merged list)."""
        if name == "set_n_threads":
            return set_n_threads
        if name == "get_features":
            return sysinfo.get_features
        return super().get_proc_address(name)


def set_n_threads(backend: Backend, n_threads: int) -> None:
    """ggml_backend_cpu_set_n_threads."""
    if not isinstance(backend, CpuBackend):
        raise GGXUnsupported(f"set_n_threads: {backend!r} is not a CPU backend")
    backend.set_n_threads(n_threads)
