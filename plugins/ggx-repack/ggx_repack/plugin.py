"""The pluggy hook of ggx-repack (entry point `repack` in the group "ggx.plugins").

Registering is all that happens here: no numba import, no compilation. The plugin adds the
CPU_REPACK extra buffer type to ggx-cpu's CPU device (the device of `ggx_cpu.plugin.backend_reg()`,
whose backend runs the buffer type's launches), after AMX and before plain host memory
(`PRIORITY_REPACK`); it registers no device of its own.
"""
from __future__ import annotations

import weakref

from ggx.backend import Device, ExtraBufferType
from ggx.hookspecs import hookimpl
from ggx_cpu.plugin import backend_reg as cpu_backend_reg

#: The ggx core API version this plugin was built against (the registry refuses another).
GGX_API_VERSION = 1

#: Our `ggx_extra_buffer_types` priority (lower is tried first): after an AMX type, which ggml
#: tries before repack.
PRIORITY_REPACK = 20

_bufts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def buffer_type(device: Device) -> ExtraBufferType:
    """The one CPU_REPACK buffer type of `device`."""
    buft = _bufts.get(device)
    if buft is None:
        from .buffer import RepackBufferType

        buft = _bufts[device] = RepackBufferType(device)
    return buft


@hookimpl
def ggx_extra_buffer_types(device: Device) -> list[tuple[int, ExtraBufferType]] | None:
    if device.reg is not cpu_backend_reg():
        return None
    return [(PRIORITY_REPACK, buffer_type(device))]
