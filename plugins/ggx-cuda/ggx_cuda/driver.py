"""The one module that talks to CUDA (through CuPy): memory, copies, streams, events, kernel
launches by name, cuBLAS products, graph capture. Everything else in ggx-cuda speaks to a
`Driver`; tests put a double in its place (tests/fake_driver.py runs each node through the
reference backend's op), so allocation, copies, events, CUDA-graph warm-up and dispatch run
end to end on a machine without a GPU.

Addresses are plain ints (device pointers); a buffer keeps what `alloc` returned alive. Nothing
here touches the driver at import time: CuPy is imported by `CupyDriver` methods only.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggx.errors import GGXOutOfMemory
from ggx.tensor import Tensor


@dataclass(frozen=True)
class DeviceInfo:
    """What ggml-cuda's ggml_cuda_init records per device."""

    index: int
    name: str
    cc: tuple[int, int]  # compute capability (major, minor)
    sm_count: int
    smem_per_block: int
    smem_per_block_optin: int
    warp_size: int
    total_memory: int


@dataclass(frozen=True)
class Kernel:
    """A kernel by source file (under ggx_cuda/kernels/) and name expression ("k_add<float>")."""

    source: str
    name: str


@dataclass(frozen=True)
class KernelLaunch:
    """One launch: grid and block (x, y, z), dynamic shared memory bytes, and the arguments as
    numpy scalars (np.int32, np.int64, np.float32; pointers as np.uint64 addresses)."""

    kernel: Kernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple
    shared: int = 0


@dataclass(frozen=True)
class GemmLaunch:
    """C = A^T B in cuBLAS terms for ggml's mul_mat on contiguous rows (column-major views):
    A is [k, m] (rows of length k, stride lda elements), B [k, n] (ldb), C [m, n] (ldc), `batch`
    products at the given element strides; dtypes "f32", "f16" or "bf16" for A and B, C is f32."""

    a: int
    b: int
    c: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    a_dtype: str = "f32"
    b_dtype: str = "f32"
    batch: int = 1
    stride_a: int = 0
    stride_b: int = 0
    stride_c: int = 0


Launch = KernelLaunch | GemmLaunch


@dataclass
class Allocation:
    """Device memory: its address and whatever keeps it alive (CuPy's MemoryPointer)."""

    ptr: int
    size: int
    owner: Any = field(default=None, repr=False)


class Driver(ABC):
    """What the backend needs of CUDA. Streams, events and graphs are opaque handles."""

    @abstractmethod
    def probe(self) -> tuple[list[DeviceInfo], str]:
        """The usable devices, and when there are none, why ("no CUDA device", ...)."""

    @abstractmethod
    def mem_info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of a device."""

    @abstractmethod
    def alloc(self, device: int, size: int) -> Allocation: ...

    @abstractmethod
    def alloc_host(self, size: int) -> np.ndarray:
        """`size` bytes of pinned host memory as a uint8 array (page-locked: async copies)."""

    @abstractmethod
    def stream(self, device: int) -> Any:
        """A new non-blocking stream."""

    @abstractmethod
    def copy_h2d(self, stream: Any, dst: int, src: np.ndarray) -> None: ...

    @abstractmethod
    def copy_d2h(self, stream: Any, dst: np.ndarray, src: int) -> None: ...

    @abstractmethod
    def copy_d2d(self, stream: Any, dst: int, src: int, size: int) -> None: ...

    @abstractmethod
    def memset(self, stream: Any, dst: int, value: int, size: int) -> None: ...

    @abstractmethod
    def synchronize(self, stream: Any) -> None: ...

    @abstractmethod
    def event(self, device: int) -> Any:
        """A new event without timing."""

    @abstractmethod
    def record(self, event: Any, stream: Any) -> None: ...

    @abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None: ...

    @abstractmethod
    def event_synchronize(self, event: Any) -> None: ...

    @abstractmethod
    def run(self, stream: Any, node: Tensor, launches: Sequence[Launch]) -> None:
        """Queue the launches computing `node` (the node is what a double computes instead)."""

    @abstractmethod
    def load(self, kernels: Sequence[Kernel]) -> None:
        """Compile and load these kernels now (before a capture: nothing compiles inside one)."""

    @abstractmethod
    def capture_begin(self, stream: Any) -> None: ...

    @abstractmethod
    def capture_end(self, stream: Any) -> Any:
        """The captured graph, instantiated."""

    @abstractmethod
    def graph_launch(self, graph: Any, stream: Any) -> None: ...


# --------------------------------------------------------------------------------------------
KERNEL_DIR = os.path.join(os.path.dirname(__file__), "kernels")
#: dynamic shared memory a launch may take without opting in (per block)
STATIC_SMEM_LIMIT = 48 * 1024
#: NVRTC options of every kernel source (the tests compile with them too): the sources include
#: their shared header (kernels/common.cuh) from the kernels folder
NVRTC_OPTIONS = ("-std=c++17", "-I" + KERNEL_DIR)


def driver_runs(driver: int, runtime: int) -> bool:
    """Whether a CUDA driver runs a CUDA runtime, both versions as CUDA reports them (1000 * major
    + 10 * minor): a driver of the runtime's major version or newer does, an older minor version
    too (CUDA's minor version compatibility; CuPy has NVRTC emit the GPU's machine code, not PTX
    that only a newer driver could compile). Seen: driver 13000 with runtime 13020."""
    return driver // 1000 >= runtime // 1000


def source_text(name: str) -> str:
    with open(os.path.join(KERNEL_DIR, name), encoding="utf-8") as f:
        return f.read()


def headers_digest() -> str:
    """A digest of the kernels folder's headers (*.cuh). CuPy's kernel cache keys a module by its
    code and options only, not by the headers it includes: the digest goes into the code (a
    comment), so a changed header compiles anew instead of loading a stale binary."""
    h = hashlib.sha256()
    for name in sorted(n for n in os.listdir(KERNEL_DIR) if n.endswith(".cuh")):
        h.update(name.encode() + b"\0" + source_text(name).encode() + b"\0")
    return h.hexdigest()[:16]


def no_driver_library() -> str:
    """Why this machine has no CUDA driver to load ("" when it may have one), found without
    importing CuPy: on a machine without a GPU its import alone costs ~0.1 s and ~20 MB of the
    start of every process that discovers the plugins. Linux only (elsewhere: "", CuPy decides)."""
    if not sys.platform.startswith("linux"):
        return ""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed: pip install 'ggx-cuda[cuda12]' or 'ggx-cuda[cuda13]' (your CUDA)"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver: libcuda.so.1 cannot be loaded"
    return ""


class CupyDriver(Driver):
    """The real driver (CuPy). Run once on an H200 (see the README for what was verified there)."""

    def __init__(self) -> None:
        self._modules: dict[str, Any] = {}
        self._names: dict[str, set[str]] = {}
        self._functions: dict[Kernel, Any] = {}  # RawKernel per kernel (it resolves per current device)
        self._stream_device: dict[int, int] = {}  # stream handle -> its device (a CuPy Stream does not say)
        self._dynamic_smem: dict[tuple[Kernel, int], int] = {}  # the opt-in set per (function, device)

    @staticmethod
    @functools.cache
    def _cupy() -> Any:
        import cupy

        return cupy

    def probe(self) -> tuple[list[DeviceInfo], str]:
        missing = no_driver_library()
        if missing:
            return [], missing
        try:
            cp = self._cupy()
        except ModuleNotFoundError as e:
            if e.name != "cupy":
                return [], f"CuPy is not usable: {type(e).__name__}: {e}"[:300]
            return [], "CuPy is not installed: pip install 'ggx-cuda[cuda12]' or 'ggx-cuda[cuda13]' (your CUDA)"
        except Exception as e:  # noqa: BLE001 - a CuPy without its CUDA libraries, ...
            return [], f"CuPy is not usable: {type(e).__name__}: {e}"[:300]
        try:
            if not cp.cuda.is_available():
                return [], "no CUDA device"
            n = cp.cuda.runtime.getDeviceCount()
            driver = cp.cuda.runtime.driverGetVersion()
            runtime = cp.cuda.runtime.runtimeGetVersion()
        except Exception as e:  # noqa: BLE001 - cudaErrorInsufficientDriver and friends
            return [], f"CUDA is not usable: {type(e).__name__}: {e}"[:300]
        if not driver_runs(driver, runtime):
            return [], f"driver too old: CUDA driver {driver} cannot run CuPy's runtime {runtime}"
        out = []
        for i in range(n):
            p = cp.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
            out.append(DeviceInfo(i, name, (p["major"], p["minor"]), p["multiProcessorCount"],
                                  p["sharedMemPerBlock"], p.get("sharedMemPerBlockOptin", p["sharedMemPerBlock"]),
                                  p["warpSize"], p["totalGlobalMem"]))
        return out, "" if out else "no CUDA device"

    def mem_info(self, device: int) -> tuple[int, int]:
        cp = self._cupy()
        with cp.cuda.Device(device):
            return cp.cuda.runtime.memGetInfo()

    def alloc(self, device: int, size: int) -> Allocation:
        cp = self._cupy()
        try:
            with cp.cuda.Device(device):
                mp = cp.cuda.alloc(max(size, 1))  # the default pool (per-stream arenas)
        except cp.cuda.memory.OutOfMemoryError as e:
            free, total = self.mem_info(device)
            raise GGXOutOfMemory(f"CUDA{device}: cannot allocate {size} bytes ({free} of {total} free)") from e
        return Allocation(mp.ptr, size, mp)

    def alloc_host(self, size: int) -> np.ndarray:
        cp = self._cupy()
        try:
            mem = cp.cuda.alloc_pinned_memory(max(size, 1))
        except Exception as e:  # noqa: BLE001 - cudaErrorMemoryAllocation
            raise GGXOutOfMemory(f"CUDA_Host: cannot allocate {size} pinned bytes: {e}") from e
        return np.frombuffer(mem, dtype=np.uint8, count=max(size, 1))[:size]

    def stream(self, device: int) -> Any:
        cp = self._cupy()
        with cp.cuda.Device(device):
            s = cp.cuda.Stream(non_blocking=True)
        self._stream_device[s.ptr] = device
        return s

    def device_of(self, stream: Any) -> int:
        return self._stream_device.get(stream.ptr, 0)

    def _on(self, stream: Any) -> Any:
        """The stream's device as the current one (a context manager): launches, copies, cuBLAS
        and captures run inside it, as ggml's ggml_cuda_set_device before each, so a second GPU
        gets its own functions, cuBLAS handle and shared-memory opt-in."""
        return self._cupy().cuda.Device(self.device_of(stream))

    def copy_h2d(self, stream: Any, dst: int, src: np.ndarray) -> None:
        cp = self._cupy()
        with self._on(stream):
            cp.cuda.runtime.memcpyAsync(dst, src.ctypes.data, src.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                        stream.ptr)

    def copy_d2h(self, stream: Any, dst: np.ndarray, src: int) -> None:
        cp = self._cupy()
        with self._on(stream):
            cp.cuda.runtime.memcpyAsync(dst.ctypes.data, src, dst.nbytes, cp.cuda.runtime.memcpyDeviceToHost,
                                        stream.ptr)

    def copy_d2d(self, stream: Any, dst: int, src: int, size: int) -> None:
        cp = self._cupy()
        with self._on(stream):
            cp.cuda.runtime.memcpyAsync(dst, src, size, cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)

    def memset(self, stream: Any, dst: int, value: int, size: int) -> None:
        with self._on(stream):
            self._cupy().cuda.runtime.memsetAsync(dst, value, size, stream.ptr)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def event(self, device: int) -> Any:
        cp = self._cupy()
        with cp.cuda.Device(device):
            return cp.cuda.Event(disable_timing=True)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def event_synchronize(self, event: Any) -> None:
        event.synchronize()

    def _function(self, kernel: Kernel) -> Any:
        f = self._functions.get(kernel)
        if f is None:
            f = self._functions[kernel] = self._module_function(kernel)
        return f

    def _module_function(self, kernel: Kernel) -> Any:
        mod = self._modules.get(kernel.source)
        if mod is None or kernel.name not in self._names[kernel.source]:
            from .kernels import NAME_EXPRESSIONS

            names = set(NAME_EXPRESSIONS[kernel.source]) | {kernel.name}
            cp = self._cupy()
            code = f"{source_text(kernel.source)}\n// kernels/*.cuh {headers_digest()}\n"
            mod = cp.RawModule(code=code, options=NVRTC_OPTIONS, name_expressions=sorted(names))
            self._modules[kernel.source], self._names[kernel.source] = mod, names
        return mod.get_function(kernel.name)

    def load(self, kernels: Sequence[Kernel]) -> None:
        for k in kernels:
            self._function(k)

    def run(self, stream: Any, node: Tensor, launches: Sequence[Launch]) -> None:
        with self._on(stream):
            for launch in launches:
                if isinstance(launch, GemmLaunch):
                    self._gemm(stream, launch)
                else:
                    f = self._function(launch.kernel)
                    device = self.device_of(stream)
                    if launch.shared > self._dynamic_smem.get((launch.kernel, device), STATIC_SMEM_LIMIT):
                        self._opt_in_smem(f, launch, device)
                    f(launch.grid, launch.block, launch.args, shared_mem=launch.shared, stream=stream)

    def _opt_in_smem(self, f: Any, launch: KernelLaunch, device: int) -> None:
        """Dynamic shared memory past 48 KiB (MMQ's tiles) must be opted into per function and
        device (ggml's CUDA_SET_SHARED_MEMORY_LIMIT); a CuPy RawKernel sets it through this
        property, on the function of the current device."""
        f.max_dynamic_shared_size_bytes = launch.shared
        self._dynamic_smem[(launch.kernel, device)] = launch.shared

    def _gemm(self, stream: Any, g: GemmLaunch) -> None:
        """cublasGemmStridedBatchedEx with F32 accumulation (CUBLAS_COMPUTE_32F), on the current
        device's handle with its stream and the host pointer mode set for this call (CuPy's own
        BLAS calls switch the shared handle's mode)."""
        cp = self._cupy()
        from cupy_backends.cuda.libs import cublas

        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, stream.ptr)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        types = {"f32": 0, "f16": 2, "bf16": 14}  # CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF
        one, zero = np.array(1.0, dtype=np.float32), np.array(0.0, dtype=np.float32)
        cublas.gemmStridedBatchedEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, g.m, g.n, g.k,
                                    one.ctypes.data, g.a, types[g.a_dtype], g.lda, g.stride_a,
                                    g.b, types[g.b_dtype], g.ldb, g.stride_b,
                                    zero.ctypes.data, g.c, 0, g.ldc, g.stride_c, g.batch,
                                    cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)

    def capture_begin(self, stream: Any) -> None:
        with self._on(stream):
            stream.begin_capture()

    def capture_end(self, stream: Any) -> Any:
        with self._on(stream):
            return stream.end_capture()

    def graph_launch(self, graph: Any, stream: Any) -> None:
        with self._on(stream):
            graph.launch(stream)
