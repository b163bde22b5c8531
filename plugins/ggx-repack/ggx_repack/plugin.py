"""The pluggy hook of ggx-repack (entry point `repack` in the group "ggx.plugins").

Registering is all that happens here: no numba import, no compilation. The plugin adds the
CPU_REPACK extra buffer type to ggx-cpu's "CPU" device, after AMX and before plain host memory
(`PRIORITY_REPACK`); it registers no device of its own.
"""
from __future__ import annotations

import weakref

from ggx.backend import Device, ExtraBufferType
from ggx.hookspecs import PRIORITY_REPACK, hookimpl

CPU_DEVICE = "CPU"  # the device ggx-cpu registers: its backend runs compute_forward
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
    if device.name != CPU_DEVICE:
        return None
    return [(PRIORITY_REPACK, buffer_type(device))]
