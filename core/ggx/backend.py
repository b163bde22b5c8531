"""The contracts between the core and a plugin: small abstract classes, as ggml-backend-impl.h.

Every optional method has its default here, in one place, so a plugin implements only what
its hardware does differently. Required methods are abstract.
"""
from __future__ import annotations

import enum
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import GGXUnsupported
from .graph import Graph

if TYPE_CHECKING:
    from .ops import Op
    from .tensor import Tensor
    from .types import GType

#: Bumped when a contract changes incompatibly. Each plugin states the version it was built against
#: as a number of its own (`GGX_API_VERSION` in its plugin module); the registry refuses another.
API_VERSION = 1

#: A kernel call with its arguments bound (`ExtraBufferType.prepare_forward`): run it as `launch()`.
Launch = Callable[[], None]


class BufferUsage(enum.IntEnum):
    ANY = 0
    WEIGHTS = 1
    COMPUTE = 2


class DeviceType(enum.IntEnum):
    """Listing order: accelerators first, the CPU last."""

    GPU = 0
    ACCEL = 1
    IGPU = 2
    CPU = 3


@dataclass(frozen=True)
class DeviceCaps:
    async_: bool = False  # set/get_tensor_async and graph_compute may return before the work is done
    host_buffer: bool = False  # has a pinned host buffer type
    buffer_from_host_ptr: bool = False
    events: bool = False


# --------------------------------------------------------------------------------------------
class BufferType(ABC):
    """A kind of memory tensors can live in. Allocates buffers; computes nothing."""

    name: str = "?"
    #: Its kernels model hardware in software (testing only, e.g. AMX_EMULATED): `ggx tune` never
    #: times it, so a measured profile never chooses it.
    emulated: bool = False

    @abstractmethod
    def alloc_buffer(self, size: int) -> Buffer: ...

    @property
    @abstractmethod
    def device(self) -> Device: ...

    @property
    def alignment(self) -> int:
        return 64

    @property
    def max_size(self) -> int:
        return sys.maxsize

    def get_alloc_size(self, tensor: Tensor) -> int:
        """Bytes a tensor needs in this buffer type (may exceed nbytes, e.g. for padding)."""
        return tensor.nbytes

    @property
    def is_host(self) -> bool:
        """True when the memory is host memory in ggml's layout (memcpy-able, numpy-viewable)."""
        return False

    def __repr__(self) -> str:
        return f"<BufferType {self.name}>"


class ExtraBufferType(BufferType):
    """A host-side buffer type whose weights a host backend computes from (ggml's extra buffer
    types: repack, AMX), found through `ggx.registry.extra_buffer_types(device)`.

    A *transforming* type (`is_host` False: repack, AMX) rewrites the whole tensor in `set_tensor`
    (offset 0) into its own layout; its buffers are write-only and no CPU kernel can read them,
    so it must compute every op its `supports_op` accepted. A type that keeps ggml's layout in
    host memory (`is_host` True, `Buffer.host_view()` offered) may decline an op and let the
    host backend's own kernel run it.
    """

    @abstractmethod
    def supports_op(self, op: Tensor) -> bool:
        """Can `op`, whose src[0] is in this buffer type, be computed from it? (A promise: a
        transforming type then returns a launch for it from prepare_forward.)"""

    @abstractmethod
    def prepare_forward(self, op: Tensor, n_threads: int = 1) -> Launch | None:
        """The launch computing `op` on `n_threads` threads, validated and bound now and run as
        `launch()`, possibly many times while the tensors keep their storage (data-dependent
        checks belong inside the launch). None declines: the host backend's own kernel runs the
        op, which is legal only for a type with `is_host` True (the CPU can read its layout)."""


class Buffer(ABC):
    """One allocation of a buffer type. Offsets are bytes from the buffer's start."""

    def __init__(self, buft: BufferType, size: int, usage: BufferUsage = BufferUsage.ANY):
        self.buft = buft
        self.size = size
        self.usage = usage

    @property
    def is_host(self) -> bool:
        return self.buft.is_host

    def host_view(self) -> np.ndarray:
        """The buffer's memory as one writable uint8 array of `size` bytes in ggml's layout (ggml's
        get_base): what CPU kernels and the host backend read and write. Every buffer of an
        `is_host` buffer type offers it; the default (device memory) raises GGXUnsupported."""
        raise GGXUnsupported(f"{self.buft.name} memory is not host memory: it has no host view")

    @property
    def is_freed(self) -> bool:
        return getattr(self, "_freed", False)

    def free(self) -> None:
        """Release the memory now (ggml_backend_buffer_free) instead of when the buffer is collected.
        Whoever frees it must first synchronize every stream that may still use it (the scheduler
        does). Afterwards every access raises GGXError. Overrides release their memory and call
        this."""
        self._freed = True

    def init_tensor(self, tensor: Tensor) -> None:
        """Called once a tensor is placed in this buffer (default: nothing to do)."""

    @abstractmethod
    def set_tensor(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        """Write `data` (uint8) at byte `offset` of the tensor's memory."""

    @abstractmethod
    def get_tensor(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        """Read `size` bytes (default: to the end) from byte `offset` of the tensor's memory."""

    def memset_tensor(self, tensor: Tensor, value: int, offset: int = 0, size: int | None = None) -> None:
        size = tensor.nbytes - offset if size is None else size
        self.set_tensor(tensor, np.full(size, value, dtype=np.uint8), offset)

    def cpy_tensor(self, src: Tensor, dst: Tensor) -> bool:
        """Copy src (in any buffer) into dst (in this buffer) directly; False when it cannot."""
        return False

    @abstractmethod
    def clear(self, value: int = 0) -> None: ...

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.buft.name} {self.size} B>"


# --------------------------------------------------------------------------------------------
class Event(ABC):
    """A point in a backend's stream that other streams (or the host) can wait for."""

    @abstractmethod
    def record(self, backend: Backend) -> None: ...

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the recorded work has finished."""


class HostEvent(Event):
    """An event for backends that finish their work before returning: always complete."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()

    def record(self, backend: Backend) -> None:
        backend.synchronize()
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait()


class Device(ABC):
    """A piece of hardware: capabilities, memory, the buffer types it reads, streams to run on."""

    name: str = "?"
    description: str = ""
    type: DeviceType = DeviceType.CPU
    caps: DeviceCaps = DeviceCaps()
    reg: BackendReg | None = None

    @abstractmethod
    def memory(self) -> tuple[int, int]:
        """(free, total) bytes."""

    @abstractmethod
    def init_backend(self, **params) -> Backend: ...

    @abstractmethod
    def buffer_type(self) -> BufferType: ...

    @abstractmethod
    def supports_op(self, op: Tensor) -> bool: ...

    def host_buffer_type(self) -> BufferType | None:
        """Pinned host memory the device reads fast (None when it has none)."""
        return None

    def buffer_from_host_ptr(self, array: np.ndarray, max_tensor_size: int) -> Buffer:
        raise GGXUnsupported(f"device {self.name} cannot wrap host memory")

    def extra_buffer_types(self) -> list[ExtraBufferType]:
        """The extra buffer types of this device's own, best first. Plugins add theirs through the
        `ggx_extra_buffer_types` hook; `ggx.registry.extra_buffer_types(device)` merges both (ggml's
        dev_get_extra_bufts), and placement, the scheduler and conformance ask that. Default: none."""
        return []

    def supports_buft(self, buft: BufferType) -> bool:
        """Can this device's streams read tensors in `buft` directly? Default: its own type or host."""
        return buft is self.buffer_type() or (buft.is_host and self.type == DeviceType.CPU)

    def offload_op(self, op: Tensor) -> bool:
        """Should op run here even though its weight lives in host memory? Default: no."""
        return False

    def event_new(self) -> Event:
        return HostEvent()

    def max_nmse_err(self, op: Op, gtype: GType | None, default: float) -> tuple[float, str] | None:
        """The conformance suite's bound on the normalized mean squared error of `op` (cases judged
        by NMSE only) whose characteristic type is `gtype` (a product's weight, a copy's destination,
        attention's K/V), where `default` is the core table's bound (ggml's max_nmse_err(backend)).
        A device whose kernels accumulate in F16/TF32 returns (bound, reason); the suite prints every
        bound that differs from the table's in its report. Default: None, the core table holds."""
        return None

    def __repr__(self) -> str:
        return f"<Device {self.name}>"


class Backend(ABC):
    """One execution stream on a device. May run work asynchronously; `synchronize` waits."""

    name: str = "?"

    def __init__(self, device: Device):
        self.device = device

    @abstractmethod
    def graph_compute(self, graph: Graph) -> None:
        """Compute every node of `graph` (skip view ops). May return before the work is done."""

    def set_tensor_async(self, tensor: Tensor, data: np.ndarray, offset: int = 0) -> None:
        """Write into a tensor in order with this stream's work (default: wait for the stream, then
        write synchronously, as ggml's fallback does). The caller may reuse `data` at once."""
        self.synchronize()
        tensor.data_buffer.set_tensor(tensor, data, offset)

    def get_tensor_async(self, tensor: Tensor, offset: int = 0, size: int | None = None) -> np.ndarray:
        """Read a tensor in order with this stream's work; the bytes are valid after
        `synchronize()` (default: wait for the stream, then read synchronously)."""
        self.synchronize()
        return tensor.data_buffer.get_tensor(tensor, offset, size)

    def cpy_tensor_async(self, src_backend: Backend, src: Tensor, dst: Tensor) -> bool:
        """Copy between two backends' memories without blocking the host; False if not possible."""
        return False

    def synchronize(self) -> None:
        """Wait for all work queued on this stream (default: work is already done)."""

    def event_record(self, event: Event) -> None:
        event.record(self)

    def event_wait(self, event: Event) -> None:
        """Make this stream wait for `event` (default: the host waits)."""
        event.synchronize()

    def graph_optimize(self, graph: Graph) -> Graph:
        """A chance to reorder or fuse nodes, called by the scheduler once per split graph when it
        builds the split (as ggml does); the scheduler then computes the graph returned, which must
        compute the same nodes' results (default: unchanged)."""
        return graph

    def graph_prepare(self, graph: Graph) -> None:
        """Do now what the first `graph_compute(graph)` would do before its first kernel (validate
        the nodes, bind the kernels), computing nothing, so that computing it later starts at once:
        the scheduler calls it for graphs placed ahead of time (a model's prompt buckets, at load).
        Default: nothing (a backend that binds nothing ahead)."""

    def graph_profile(self, graph: Graph) -> list[tuple[Tensor, float]]:
        """Compute `graph` and return (node, seconds) for each node that ran: the per-node timing
        hook (`ggx bench --profile`). Default: one node at a time, synchronizing after each."""
        times: list[tuple[Tensor, float]] = []
        for node in graph.nodes:
            if node.op.is_view:
                continue
            t0 = time.perf_counter()
            self.graph_compute(Graph([node], []))
            self.synchronize()
            times.append((node, time.perf_counter() - t0))
        return times

    def get_proc_address(self, name: str) -> Callable | None:
        return None

    def __repr__(self) -> str:
        return f"<Backend {self.name} on {self.device.name}>"


class BackendReg(ABC):
    """What a plugin registers: its devices and optional capabilities looked up by name."""

    name: str = "?"
    version: str = "0"
    #: The core API version this reg was built against (ggml's api_version), or None: as its plugin
    #: module states (`GGX_API_VERSION`). A number here is checked like the plugin's.
    api_version: int | None = None
    #: A line for `ggx devices` about the plugin's state, e.g. why it lists no device right now.
    note: str = ""

    @abstractmethod
    def devices(self) -> list[Device]: ...

    def get_proc_address(self, name: str) -> Callable | None:
        """An optional capability by name ("set_n_threads", "get_features", ...), or None.
        Default: "dev_get_extra_bufts" -> f(device) -> `ggx.registry.extra_buffer_types(device)`
        (the device's own merged with the plugins'), answered here for every reg."""
        if name == "dev_get_extra_bufts":
            from . import registry

            return registry.extra_buffer_types
        return None

    def __repr__(self) -> str:
        return f"<BackendReg {self.name} {self.version}>"
