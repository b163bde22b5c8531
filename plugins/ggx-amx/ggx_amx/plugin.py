"""The pluggy hooks of ggx-amx (entry point `amx` in the group "ggx.plugins").

Registering is all that happens here: no numba import, no compilation. Where AMX is usable
(`detect.amx_mode`), the plugin adds the extra buffer type `AMX` to ggx-cpu's CPU device at
`PRIORITY_AMX`, before CPU_REPACK, as ggml tries AMX first; with `GGX_AMX_EMULATE=1` it adds
`AMX_EMULATED` (the same layout and tiling loop, tile instructions modeled in software; testing
only). Elsewhere it adds nothing. Its BackendReg lists no device; it exists so that `ggx
devices` shows the plugin's state (`note`): "AMX not available: <reason>", or the mode in use.
"""
from __future__ import annotations

import functools
import weakref

from ggx.backend import BackendReg, Device, ExtraBufferType
from ggx.hookspecs import hookimpl
from ggx_cpu.plugin import backend_reg as cpu_backend_reg

from . import __version__
from .detect import amx_mode

#: The ggx core API version this plugin was built against (the registry refuses another).
GGX_API_VERSION = 1

#: Our `ggx_extra_buffer_types` priority (lower is tried first): before CPU_REPACK's 20, as ggml
#: tries its AMX buffer type before the repack one.
PRIORITY_AMX = 10

_bufts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class AmxReg(BackendReg):
    """ggx-amx's registration: no devices (the AMX type belongs to ggx-cpu's CPU device); its note
    says whether AMX is in use, emulated, or why not."""

    name = "amx"
    version = __version__

    def devices(self) -> list[Device]:
        return []

    @property
    def note(self) -> str:  # type: ignore[override]
        return amx_mode().note


@functools.cache
def backend_reg() -> AmxReg:
    return AmxReg()


def buffer_type(device: Device, engine: str) -> ExtraBufferType:
    """The AMX buffer type of `device` running `engine` ("amx" or "emulated"), one per pair."""
    kept = _bufts.setdefault(device, {})
    buft = kept.get(engine)
    if buft is None:
        from .buffer import AmxBufferType

        buft = kept[engine] = AmxBufferType(device, engine)
    return buft


@hookimpl
def ggx_backend_reg() -> BackendReg:
    return backend_reg()


@hookimpl
def ggx_extra_buffer_types(device: Device) -> list[tuple[int, ExtraBufferType]] | None:
    if device.reg is not cpu_backend_reg():
        return None
    mode = amx_mode()
    if mode.engine is None:
        return None
    return [(PRIORITY_AMX, buffer_type(device, mode.engine))]
