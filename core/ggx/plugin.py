"""The plugin API: everything a ggx plugin builds against, in one import.

A plugin may import these names from here (``from ggx.plugin import Device, hookimpl``) or from
the module each comes from; both are the same objects. The rest of the core (scheduler,
allocator, registry, placement, models, conformance, commands) is engine code: a plugin does not
call it, and it may change without an API version bump.

- `ggx.backend`, the contracts (ggml's ggml-backend-impl.h) and `API_VERSION`:
  `BufferType`, `ExtraBufferType`, `Buffer`, `BufferUsage`, `Device`, `DeviceType`,
  `DeviceCaps`, `Backend`, `BackendReg`, `Event`, `HostEvent`, and `Launch` (a kernel call with
  its arguments bound, as `ExtraBufferType.prepare_forward` returns it);
- `ggx.hookspecs`, the hooks a plugin implements (`ggx_backend_reg`, `ggx_extra_buffer_types`)
  and their marker `hookimpl`;
- `ggx.host`, host memory: `HostBufferType`, `HostBuffer`, `TransformedBuffer` (the write-only
  host memory of a transforming extra buffer type), `tensor_array` (a numpy view of a
  tensor in host memory), `aligned_empty`, `alloc_host_memory`, `host_memory`, `HOST_ALIGNMENT`;
- `ggx.errors`: `GGXError`, `GGXUnsupported`, `GGXOutOfMemory`, `GGXShapeError`,
  `GGXPluginError`, `GGXFormatError`, `GGXStateError`, `GGXValueError`, `GGXDeviceError`;
- `ggx.progress`: `compiling`, the notice a plugin shows while it compiles kernels;
- `ggx.wire`: graphs as plain data for a device in another process (`encode_graph`,
  `decode_graph`, which rebuilds with the graph builder's checks);
- `ggx.types`: `GType` (element and block types, ggml's);
- `ggx.tensor`: `Tensor`, `TensorFlag`;
- what `graph_compute` and `supports_op` are handed: `Graph` (`ggx.graph`) and `Op`
  (`ggx.ops`, which also holds each op's parameter types).
"""
from .backend import (
    API_VERSION,
    Backend,
    BackendReg,
    Buffer,
    BufferType,
    BufferUsage,
    Device,
    DeviceCaps,
    DeviceType,
    Event,
    ExtraBufferType,
    HostEvent,
    Launch,
)
from .errors import (
    GGXDeviceError,
    GGXError,
    GGXFormatError,
    GGXOutOfMemory,
    GGXPluginError,
    GGXShapeError,
    GGXStateError,
    GGXUnsupported,
    GGXValueError,
)
from .graph import Graph
from .hookspecs import hookimpl
from .host import (
    HOST_ALIGNMENT,
    HostBuffer,
    HostBufferType,
    TransformedBuffer,
    aligned_empty,
    alloc_host_memory,
    host_memory,
    tensor_array,
)
from .ops import Op
from .progress import compiling
from .tensor import Tensor, TensorFlag
from .types import GType
from .wire import decode_graph, encode_graph

__all__ = [
    "API_VERSION", "HOST_ALIGNMENT", "Backend", "BackendReg", "Buffer", "BufferType", "BufferUsage", "Device",
    "DeviceCaps", "DeviceType", "Event", "ExtraBufferType", "GGXDeviceError", "GGXError", "GGXFormatError",
    "GGXOutOfMemory", "GGXPluginError", "GGXShapeError", "GGXStateError", "GGXUnsupported", "GGXValueError",
    "GType", "Graph", "HostBuffer", "HostBufferType", "HostEvent", "Launch", "Op", "Tensor", "TensorFlag",
    "TransformedBuffer",
    "aligned_empty", "alloc_host_memory", "compiling", "decode_graph", "encode_graph", "host_memory",
    "hookimpl", "tensor_array",
]
