"""The whole device layer of ggx-cpu: CpuBackendReg -> CpuDevice -> CpuBackend (ggml-cpu.cpp).

Nothing here imports numba or compiles anything: kernels are imported on the first
graph_compute that needs them (numba compiles lazily and caches on disk), so listing devices
and answering supports_op stay cheap.

- Memory is the host's (tensors live in the core's HostBufferType, named "CPU").
- supports_op: an op whose src[0] lives in an extra buffer type (repack, AMX) is that buffer
  type's to answer; otherwise every source must be host memory and the op/type pair must be
  one the kernels take.
- graph_compute binds every node's launch (view ops skipped) before running any, and keeps the
  launches of a graph computed again: an op whose src[0] lives in an extra buffer type goes to
  that type's prepare_forward (or compute_forward at run time), else to the dispatch table's
  kernel. Each kernel is one numba call, a parallel region when it runs on n_threads > 1.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import operator
import os
import weakref
from collections.abc import Callable

import numpy as np

from ggx.backend import (
    API_VERSION,
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
from ggx.host import HostBuffer, HostBufferType
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType

from . import __version__
from .kernels import FLOAT_TYPES, LOAD_TYPES, SLOW_STORE_TYPES, STORE_TYPES

#: Op -> (module under ggx_cpu.kernels, function(node, n_threads) -> Launch); imported on first use.
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
    Op.MUL_MAT: ("matmul", "mul_mat"),  # part B: ggx_cpu.kernels.matmul
    Op.MUL_MAT_ID: ("matmul", "mul_mat_id"),
}

#: Weight types the matrix-product kernels take (mul_mat / mul_mat_id src[0]).
MUL_MAT_TYPES = frozenset({GType.F32, GType.F16, GType.BF16, GType.Q4_0, GType.Q4_1, GType.Q8_0,
                           GType.Q4_K, GType.Q6_K})

#: Ops cheaper than a second thread's wake-up (~3-9 us with numba's OpenMP pool on 2 cores)
#: run on one thread when their result has fewer elements than this.
SMALL_OP_ELEMENTS = 16384
#: FLASH_ATTN_EXT runs on one thread below this many (query row, kv slot) pairs. One decode token
#: over 256 slots with 9 heads (2304 pairs, ~20 us of work) gains from two threads now that a
#: launch costs ~1 us: decode 179 -> 188 tokens/s (SmolLM2, 2 threads, alternating runs).
SMALL_FA_PAIRS = 1024
_ALWAYS_THREADED = frozenset({Op.MUL_MAT, Op.MUL_MAT_ID})

# The per-node path keys its sets and caches by id(op): Enum.__hash__ is a Python-level call
# (~0.3 us a lookup, and a decode step runs ~500 nodes).
_ALWAYS_THREADED_IDS = frozenset(id(op) for op in _ALWAYS_THREADED)
_NOTHING_TO_RUN_IDS = frozenset(id(op) for op in Op if op.is_view or op is Op.NONE)
_SET_ROWS_ID = id(Op.SET_ROWS)
_FLASH_ATTN_ID = id(Op.FLASH_ATTN_EXT)

#: Prepared graphs a backend keeps (decode keeps one per KV bucket and scheduler split).
_MAX_PREPARED = 64

_kernel_cache: dict[int, Callable[[Tensor, int], Launch]] = {}


@functools.cache
def _has_module(name: str) -> bool:
    return importlib.util.find_spec(f"ggx_cpu.kernels.{name}") is not None


def kernel_for(op: Op) -> Callable[[Tensor, int], Launch]:
    """The kernel wrapper for `op` (imports its module on first use)."""
    fn = _kernel_cache.get(id(op))
    if fn is None:
        entry = KERNELS.get(op)
        if entry is None or not _has_module(entry[0]):
            raise GGXUnsupported(f"CPU: no kernel for {op.name}")
        fn = _kernel_cache[id(op)] = getattr(importlib.import_module(f"ggx_cpu.kernels.{entry[0]}"), entry[1])
    return fn


def _buft_of(t: Tensor | None) -> BufferType | None:
    if t is None:
        return None
    buf = t.data_buffer
    return buf.buft if buf is not None else None


def extra_buffer_types(device: Device) -> list[ExtraBufferType]:
    """The extra buffer types plugins offer for `device`, in priority order (empty without a registry)."""
    try:
        from ggx import registry

        found = registry.extra_buffer_types(device)
    except (ImportError, AttributeError):
        return []
    return [b[1] if isinstance(b, tuple) else b for b in found]


# --- CPU identity ---------------------------------------------------------------------------
@functools.cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        import llvmlite.binding as ll

        return ll.get_host_cpu_name()
    except Exception:  # noqa: BLE001 - the name is cosmetic
        import platform

        return platform.processor() or platform.machine() or "unknown CPU"


#: The features worth a word in the device description, in this order.
_KEY_FEATURES = ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "avx512bf16",
                 "avxvnni", "amx-tile", "amx-int8", "neon", "sve")


def isa_info() -> tuple[str, list[str]]:
    """(active ISA variant, host features) from ggx_cpu.isa (part B) when it is there."""
    if not _has_module_top("isa"):
        return "none", []
    try:
        isa = importlib.import_module("ggx_cpu.isa")
        return str(isa.active()), list(isa.features())
    except Exception as e:  # noqa: BLE001 - report, do not fail device listing
        return f"unavailable ({e})", []


@functools.cache
def _has_module_top(name: str) -> bool:
    return importlib.util.find_spec(f"ggx_cpu.{name}") is not None


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory."""
    try:
        info = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def default_threads() -> int:
    return os.cpu_count() or 1


# --- prepared graphs ----------------------------------------------------------------------------
_storage = operator.attrgetter("buffer", "offset")


class PreparedGraph:
    """The launches of one graph: every node validated and its kernel call bound once.

    Valid while the same graph is computed with the same thread count and every tensor it
    touches still has the storage it had (the scheduler re-places tensors when it re-plans).
    Checking that is one C-level pass over the roots, ~40 ns a tensor. The graph is held
    weakly: the backend forgets its launches (and the memory they reference) when it dies.
    """

    def __init__(self, backend: CpuBackend, graph: Graph):
        self.graph = weakref.ref(graph)
        self.n_nodes = len(graph.nodes)
        self.n_threads = backend.n_threads
        roots: dict[int, Tensor] = {}
        for node in graph.nodes:
            for t in (node, *node.src):
                if t is not None:
                    r = t.root
                    roots[id(r)] = r
        self.roots = list(roots.values())
        self.storage = list(map(_storage, self.roots))
        launches = (backend.launch_for(node) for node in graph.nodes)  # validates all before any runs
        self.launches = [f for f in launches if f is not None]

    def still_valid(self, backend: CpuBackend, graph: Graph) -> bool:
        return (self.graph() is graph and len(graph.nodes) == self.n_nodes and self.n_threads == backend.n_threads
                and list(map(_storage, self.roots)) == self.storage)


def _forget(prepared: dict[int, PreparedGraph], key: int, entry: PreparedGraph) -> None:
    """A graph died: drop its launches (unless its id already belongs to a newer graph)."""
    if prepared.get(key) is entry:
        del prepared[key]


# --- the contracts ------------------------------------------------------------------------------
class CpuBackend(Backend):
    """One synchronous execution stream on the CPU: graph_compute returns when the work is done."""

    name = "CPU"

    def __init__(self, device: CpuDevice, n_threads: int | None = None):
        super().__init__(device)
        self.n_threads = default_threads()
        self.prepared: dict[int, PreparedGraph] = {}  # by id(graph); clear it to re-prepare
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

    def launch_for(self, node: Tensor) -> Launch | None:
        """Validate `node` and bind its kernel (None for a node with nothing to run): its src[0]'s
        extra buffer type first, else the kernel table."""
        if id(node.op) in _NOTHING_TO_RUN_IDS or node.nelements == 0:
            return None
        buft = _buft_of(node.src[0] if node.src else None)
        if isinstance(buft, ExtraBufferType):
            f = buft.prepare_forward(node, self.n_threads)
            return f if f is not None else functools.partial(self._forward, buft, node)
        return kernel_for(node.op)(node, self.threads_for(node))

    def _forward(self, buft: ExtraBufferType, node: Tensor) -> None:
        """An extra buffer type without prepared launches: its compute_forward, every run; if
        that declines, the CPU kernel (as ggml's extra buffer types do)."""
        if not buft.compute_forward(node, self.n_threads):
            kernel_for(node.op)(node, self.threads_for(node))()

    def compute_node(self, node: Tensor) -> None:
        """Run one node now."""
        f = self.launch_for(node)
        if f is not None:
            f()

    def graph_compute(self, graph: Graph) -> None:
        """Run the graph's nodes in order; a graph computed again reuses its launches."""
        prepared = self.prepared.get(id(graph))
        if prepared is None or not prepared.still_valid(self, graph):
            if len(self.prepared) >= _MAX_PREPARED:
                self.prepared.clear()
            prepared = self.prepared[id(graph)] = PreparedGraph(self, graph)
            weakref.finalize(graph, _forget, self.prepared, id(graph), prepared)
        for f in prepared.launches:
            f()

    def get_proc_address(self, name: str) -> Callable | None:
        if name == "set_n_threads":
            return self.set_n_threads
        return self.device.reg.get_proc_address(name) if self.device.reg is not None else None


class CpuDevice(Device):
    """The host CPU: host memory, every op of the catalogue."""

    name = "CPU"
    type = DeviceType.CPU
    caps = DeviceCaps(async_=False, host_buffer=False, buffer_from_host_ptr=True, events=False)

    def __init__(self, reg: CpuBackendReg | None = None):
        self.reg = reg
        self._buft = HostBufferType(self, name="CPU")

    @functools.cached_property
    def description(self) -> str:  # type: ignore[override]
        active, feats = isa_info()
        shown = " ".join(f.upper() for f in _KEY_FEATURES if f in feats)
        return f"{cpu_model()} ({active}{': ' + shown if shown else ''})"

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
        buf = HostBuffer.__new__(HostBuffer)
        Buffer.__init__(buf, self._buft, array.nbytes)
        buf.data = array.reshape(-1).view(np.uint8)
        return buf

    def supports_buft(self, buft: BufferType) -> bool:
        return buft.is_host or any(buft is b for b in extra_buffer_types(self))

    def supports_op(self, op: Tensor) -> bool:
        buft = _buft_of(op.src[0] if op.src else None)
        if isinstance(buft, ExtraBufferType):
            return any(buft is b for b in extra_buffer_types(self)) and bool(buft.supports_op(op))
        for s in op.src:
            b = _buft_of(s)
            if b is not None and not b.is_host:
                return False
        return op_supported(op)

    def get_extra_buffer_types(self) -> list[ExtraBufferType]:
        return extra_buffer_types(self)


def op_supported(op: Tensor) -> bool:
    """Can the kernels compute `op` (types and layouts), sources in host memory."""
    kind = op.op
    if kind.is_view or kind is Op.NONE:
        return True
    entry = KERNELS.get(kind)
    if entry is None or not _has_module(entry[0]):
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
        return src[0].type is GType.F32 and src[1].type is GType.I32
    return all(s.type is GType.F32 for s in src)


class CpuBackendReg(BackendReg):
    """What ggx-cpu registers: one device, "CPU", and its optional capabilities."""

    name = "CPU"
    version = __version__
    api_version = API_VERSION

    def __init__(self) -> None:
        self._device = CpuDevice(self)

    def devices(self) -> list[Device]:
        return [self._device]

    def get_proc_address(self, name: str) -> Callable | None:
        """"set_n_threads" -> f(backend, n); "get_features" -> f() -> dict;
        "dev_get_extra_bufts" -> f(device) -> list of extra buffer types."""
        if name == "set_n_threads":
            return set_n_threads
        if name == "get_features":
            return get_features
        if name == "dev_get_extra_bufts":
            return extra_buffer_types
        return None


def set_n_threads(backend: Backend, n_threads: int) -> None:
    """ggml_backend_cpu_set_n_threads."""
    if not isinstance(backend, CpuBackend):
        raise GGXUnsupported(f"set_n_threads: {backend!r} is not a CPU backend")
    backend.set_n_threads(n_threads)


def get_features() -> dict:
    """The CPU's identity and what the kernels use on it."""
    active, feats = isa_info()
    return {"cpu": cpu_model(), "isa": active, "features": feats, "n_threads_default": default_threads(),
            "threading_layer": os.environ.get("NUMBA_THREADING_LAYER", "default")}
