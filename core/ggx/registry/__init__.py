"""The device registry: plugin discovery (pluggy + entry points), the device list, failures.

Three modules, one job each: `records` (what is held: a record per plugin, the failures, one
lock), `loading` (how it is filled: registration, entry points, environment filters,
validation, failure records) and `queries` (what it answers). Use them through this package:
``ggx.registry.devices()``.

Sources of plugins, in listing order:

1. in-process: `register(module_or_object_or_reg)` — tests and notebooks;
2. entry points of the group ``ggx.plugins`` (sorted by entry-point name, for a stable order);
3. the built-in reference backend (`ggx.reference.RefBackendReg`, device "ref"), listed last.

Nothing is loaded at `import ggx`: the first call that needs devices (`devices()`,
`get_device()`, ...) runs `load_plugins()`. Environment variables, read at load time:

- ``GGX_PLUGIN_AUTOLOAD=0``: do not load entry points (they are listed as "disabled");
- ``GGX_PLUGINS=a,b``: load only these entry points;
- ``GGX_DISABLE_PLUGINS=x,y``: do not load these entry points.

Plugins are named by distribution name ("ggx-repack", any of - _ . and case) or entry-point
name ("repack"). The variables do not affect in-process registrations or the built-in.

A plugin that fails (import error, hook raising, wrong return type, other API version, devices()
raising, a plugin or device name already taken) is recorded as a `PluginFailure` and skipped;
asking for it by name (`get_device`) raises `GGXPluginError` with the recorded reason. Names are
unique: the built-in keeps "ref", and of two plugins (or devices) with one name the later fails,
its reason naming both (see `ggx.registry.loading`).

Devices are ordered by type (GPU, ACCEL, IGPU, CPU), then by source (in-process, entry point,
built-in: the reference backend never comes before an installed CPU plugin), then by order of
registration.

Every function here may be called from any thread: the registry holds one re-entrant lock.
"""
from ..backend import BackendReg
from .loading import load_plugins, refresh_plugin, register, reset, unregister
from .queries import (
    backend_regs,
    default_device,
    device_plugin,
    devices,
    extra_buffer_types,
    failures,
    get_device,
    plugins,
    reg_of,
)
from .records import (
    BUILTIN,
    DISABLED,
    ENTRY_POINT,
    FAILED,
    IN_PROCESS,
    LOADED,
    PluginFailure,
    PluginInfo,
    normalize_name,
)

__all__ = [
    "BUILTIN", "DISABLED", "ENTRY_POINT", "FAILED", "IN_PROCESS", "LOADED", "BackendReg", "PluginFailure",
    "PluginInfo", "backend_regs", "default_device", "device_plugin", "devices", "extra_buffer_types",
    "failures", "get_device", "load_plugins", "normalize_name", "plugins", "refresh_plugin", "reg_of",
    "register", "reset",
    "unregister",
]
