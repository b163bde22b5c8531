"""The hooks a ggx plugin implements (pluggy project "ggx"). This module is their documentation.

A plugin is a module (or any object) whose functions carry the `hookimpl` marker and are named
after the hooks below. The core finds it through the entry-point group ``ggx.plugins``::

    # the plugin's pyproject.toml
    [project.entry-points."ggx.plugins"]
    cpu = "ggx_cpu.plugin"

    # ggx_cpu/plugin.py
    from ggx.hookspecs import hookimpl

    @hookimpl
    def ggx_backend_reg():
        from .device import CpuBackendReg
        return CpuBackendReg()

or it is registered in-process with `ggx.registry.register(module_or_object)` (tests,
notebooks). The entry-point name ("cpu") is the plugin's name; `GGX_PLUGINS` and
`GGX_DISABLE_PLUGINS` accept it or the distribution name ("ggx-cpu").

Rules every hook follows:

- Hooks only register: they build small objects and return them. Compiling kernels, allocating
  memory or probing hardware in depth belongs to first use, not to discovery.
- The core calls each plugin's hook on its own. A plugin whose module fails to import, whose hook
  raises, returns the wrong type, or whose BackendReg declares another core API version is
  recorded as failed (name, distribution, version, reason, traceback) and skipped; the other
  plugins still load. `ggx devices` lists such failures with their reason.
- Plugin names and device names are unique. The built-in reference backend always holds "ref";
  otherwise a plugin whose name (or one of whose device names) is already taken fails, and its
  reason names the plugin holding it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .backend import BackendReg, Device, ExtraBufferType

#: pluggy project name: the markers below only match hooks of this project.
PROJECT = "ggx"
#: The entry-point group plugins declare themselves in.
ENTRY_POINT_GROUP = "ggx.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def ggx_backend_reg() -> BackendReg | None:
    """Return this plugin's backend registration, or None when it registers no devices.

    The plugin module states the core API version it was built against, `GGX_API_VERSION = 1`
    (a number of its own); the registry refuses one that states another (or, installed, none),
    naming both numbers, before any hook runs. The result must be a `ggx.backend.BackendReg`
    (whose `api_version`, when not None, is checked the same way). Its `devices()` is called
    once, at load time, and must return a list of `ggx.backend.Device`. A plugin that only adds
    extra buffer types (repack, AMX) returns None here and implements `ggx_extra_buffer_types`.

    Capabilities beyond the contract are looked up by name through
    `BackendReg.get_proc_address(name)`; the default answers "dev_get_extra_bufts" with a
    callable `(device) -> ggx.registry.extra_buffer_types(device)` (ggml's name). By convention
    "get_features" gives a callable `() -> dict[str, str]` (or a list of `(name, value)` pairs)
    describing the build, e.g. the selected ISA variant; `ggx devices` shows it.
    """


@hookspec
def ggx_extra_buffer_types(device: Device) -> list[tuple[int, ExtraBufferType]] | None:
    """Return the extra buffer types this plugin offers for `device`, as `(priority, buft)` pairs.

    Extra buffer types (ggml's "extra bufts": repacked or AMX weight layouts) are host memory that
    a device's backend can compute from. The plugin decides which devices it serves: return None
    or an empty list for a device it does not extend (e.g. anything but the CPU device).

    `priority` is an int; the core merges every plugin's answer and sorts by ascending priority,
    lower first (stable, plugin order breaking ties): e.g. an AMX type before a repack type, as
    ggml tries AMX before repack. Each plugin defines its own value. `buft` must be a
    `ggx.backend.ExtraBufferType` instance.

    Called lazily, once per device, the first time that device's extra buffer types are asked
    for (`ggx.registry.extra_buffer_types(device)`, which merges them after the device's own).
    A plugin whose hook raises or returns anything else is recorded as failed and contributes no
    extra buffer types; devices it registered stay available.
    """
