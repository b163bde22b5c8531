"""The device registry: plugin discovery (pluggy + entry points), the device list, failures.

Sources of plugins, in listing order:

1. in-process: `register(module_or_object_or_reg)` — tests and notebooks;
2. entry points of the group ``ggx.plugins`` (sorted by entry-point name, for a stable order);
3. the built-in reference backend (`ggx.reference.RefBackendReg`, device "ref"), always last.

Nothing is loaded at `import ggx`: the first call that needs devices (`devices()`,
`get_device()`, ...) runs `load_plugins()`. Environment variables, read at load time:

- ``GGX_PLUGIN_AUTOLOAD=0``: do not load entry points (they are listed as "disabled");
- ``GGX_PLUGINS=a,b``: load only these entry points;
- ``GGX_DISABLE_PLUGINS=x,y``: do not load these entry points.

Plugins are named by distribution name ("ggx-repack", any of - _ . and case) or entry-point
name ("repack"). The variables do not affect in-process registrations or the built-in.

A plugin that fails (import error, hook raising, wrong return type, other API version, devices()
raising) is recorded as a `PluginFailure` and skipped; asking for it by name (`get_device`)
raises `GGXPluginError` with the recorded reason.

Devices are ordered by type (GPU, ACCEL, IGPU, CPU), then by source (in-process, entry point,
built-in: the reference backend never comes before an installed CPU plugin), then by order of
registration.
"""
from __future__ import annotations

import dataclasses
import os
import re
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .backend import API_VERSION, BackendReg, Device, DeviceType, ExtraBufferType
from .errors import GGXPluginError

# Sources, in listing order.
IN_PROCESS = "in-process"
ENTRY_POINT = "entry point"
BUILTIN = "built-in"
_SOURCE_RANK = {IN_PROCESS: 0, ENTRY_POINT: 1, BUILTIN: 2}

LOADED = "loaded"
FAILED = "failed"
DISABLED = "disabled"


@dataclass
class PluginFailure:
    """Why a plugin did not load. `traceback` is the original one ('' when nothing raised)."""

    name: str
    distribution: str | None
    version: str | None
    reason: str
    traceback: str = ""


@dataclass
class PluginInfo:
    """One plugin as `ggx devices` shows it. status: "loaded", "failed" or "disabled"."""

    name: str
    distribution: str | None
    version: str | None
    status: str
    reg: BackendReg | None = None
    source: str = IN_PROCESS
    reason: str = ""


@dataclass
class _Plugin:
    info: PluginInfo
    obj: Any = None  # what was registered with pluggy (None when it never got that far)
    devices: list[Device] = field(default_factory=list)
    order: int = 0
    reg_name: str | None = None  # kept after a failure, so get_device(reg name) finds the reason


class _RegPlugin:
    """Wraps a BackendReg passed to `register()` directly, so every plugin goes through pluggy."""

    def __init__(self, reg: Any):
        self.reg = reg

    @hookspecs.hookimpl
    def ggx_backend_reg(self):
        return self.reg


class _Failed(Exception):
    """A validation failure inside this module: the reason is the message, no traceback kept."""


# --------------------------------------------------------------------------------------------
# State (guarded by _lock). reset() puts it back to the state after import.
_lock = threading.RLock()
_pm: pluggy.PluginManager
_plugins: dict[str, _Plugin] = {}
_failures: list[PluginFailure] = []
_extra_cache: dict[int, tuple[Device, list[ExtraBufferType]]] = {}
_loaded = False
_counter = 0


def _new_pm() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def reset() -> None:
    """Forget every plugin, failure and cache; the next use loads again (for tests)."""
    global _pm, _loaded, _counter
    with _lock:
        _pm = _new_pm()
        _plugins.clear()
        _failures.clear()
        _extra_cache.clear()
        _loaded = False
        _counter = 0


reset()


# --------------------------------------------------------------------------------------------
def _norm(name: str) -> str:
    """Normalize a plugin or distribution name (PEP 503 style) for env-var matching."""
    return re.sub(r"[-_.]+", "-", name).strip().lower()


def _env_list(var: str) -> list[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return [_norm(x) for x in value.split(",") if x.strip()]


def _autoload_enabled() -> bool:
    return os.environ.get("GGX_PLUGIN_AUTOLOAD", "1").strip().lower() not in ("0", "false", "no", "off")


def _add(info: PluginInfo) -> _Plugin:
    global _counter
    _counter += 1
    p = _Plugin(info=info, order=_counter)
    _plugins[info.name] = p
    _extra_cache.clear()
    return p


def _fail(p: _Plugin, reason: str, tb: str = "") -> None:
    """Record a failure for plugin `p` and take it out of pluggy."""
    p.info.status = FAILED
    p.info.reason = reason
    p.info.reg = None
    p.devices = []
    if p.obj is not None and _pm.is_registered(p.obj):
        _pm.unregister(p.obj)
    _failures.append(PluginFailure(p.info.name, p.info.distribution, p.info.version, reason, tb))


def _call_impl(p: _Plugin, hook: str, **kwargs) -> list[Any]:
    """Call plugin p's own implementations of `hook` (not the others'), passing the args it takes."""
    results = []
    for impl in getattr(_pm.hook, hook).get_hookimpls():
        if impl.plugin is p.obj:
            results.append(impl.function(*(kwargs[a] for a in impl.argnames)))
    return results


def _where(p: _Plugin) -> str:
    return f"plugin {p.info.name!r}" + (f" ({p.info.distribution} {p.info.version})" if p.info.distribution else "")


def _validate_reg(p: _Plugin, reg: Any) -> None:
    """Check what ggx_backend_reg returned; keep the reg and its devices. Raises _Failed."""
    if reg is None:
        return
    if not isinstance(reg, BackendReg):
        raise _Failed(f"ggx_backend_reg() returned {type(reg).__module__}.{type(reg).__qualname__}, "
                      "expected a ggx.backend.BackendReg or None")
    p.reg_name = str(reg.name)
    version = getattr(reg, "api_version", None)
    if not isinstance(version, int) or isinstance(version, bool) or version != API_VERSION:
        raise _Failed(f"backend {reg.name!r} was built for ggx core API version {version!r}, "
                      f"this core has API version {API_VERSION}")
    devs = reg.devices()
    if not isinstance(devs, list | tuple) or not all(isinstance(d, Device) for d in devs):
        raise _Failed(f"backend {reg.name!r}: devices() returned {devs!r}, expected a list of ggx.backend.Device")
    for d in devs:
        if d.reg is None:
            d.reg = reg  # so a device can find its reg's capabilities (get_features, ...)
    _wrap_proc_address(reg)
    p.info.reg = reg
    p.devices = list(devs)


def _activate(p: _Plugin) -> None:
    """Register p.obj with pluggy and run its ggx_backend_reg; on any failure, record it."""
    try:
        _pm.register(p.obj, name=p.info.name)
        unknown = [hc.name for hc in _pm.get_hookcallers(p.obj) or [] if not hc.has_spec()]
        if unknown:
            raise _Failed(f"implements unknown hook(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(n for n in dir(hookspecs) if n.startswith('ggx_')))}")
        try:
            regs = _call_impl(p, "ggx_backend_reg")
        except Exception as e:
            _fail(p, f"ggx_backend_reg() raised {type(e).__name__}: {e}", traceback.format_exc())
            return
        for reg in regs:
            _validate_reg(p, reg)
    except _Failed as e:
        _fail(p, str(e))
        return
    except Exception as e:  # pluggy validation errors, a reg whose devices() raises, ...
        _fail(p, f"{type(e).__name__}: {e}", traceback.format_exc())
        return
    p.info.status = LOADED


# --------------------------------------------------------------------------------------------
def register(plugin_or_reg: Any, name: str | None = None) -> PluginInfo:
    """Register a plugin in-process: a module/object with hookimpls, or a BackendReg directly.

    Unlike discovery, a failure here raises GGXPluginError at once (the caller is right there).
    Does not trigger loading of entry points.
    """
    with _lock:
        if isinstance(plugin_or_reg, BackendReg):
            obj = _RegPlugin(plugin_or_reg)
            name = name or plugin_or_reg.name
            version = plugin_or_reg.version
        else:
            obj = plugin_or_reg
            name = name or getattr(obj, "__name__", None) or type(obj).__name__
            version = getattr(obj, "__version__", None)
        if name in _plugins:
            raise GGXPluginError(f"a plugin named {name!r} is already registered")
        p = _add(PluginInfo(name, None, version, FAILED, source=IN_PROCESS))
        p.obj = obj
        n_failures = len(_failures)
        _activate(p)
        if p.info.status == FAILED:
            del _plugins[name]
            failure = _failures.pop(n_failures)
            raise GGXPluginError(f"cannot register plugin {name!r}: {failure.reason}")
        return dataclasses.replace(p.info)


def unregister(name: str) -> None:
    """Remove a plugin (any source) with its devices and recorded failures."""
    with _lock:
        p = _plugins.pop(name, None)
        if p is None:
            raise GGXPluginError(f"no plugin named {name!r}; registered: {', '.join(_plugins) or 'none'}")
        if p.obj is not None and _pm.is_registered(p.obj):
            _pm.unregister(p.obj)
        _failures[:] = [f for f in _failures if f.name != name]
        _extra_cache.clear()


def _load_entry_points() -> None:
    import importlib_metadata

    autoload = _autoload_enabled()
    allow = _env_list("GGX_PLUGINS")
    deny = _env_list("GGX_DISABLE_PLUGINS") or []
    eps = sorted(importlib_metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    for ep in eps:
        dist = ep.dist.name if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        info = PluginInfo(ep.name, dist, version, FAILED, source=ENTRY_POINT)
        if ep.name in _plugins:
            other = _plugins[ep.name].info
            _failures.append(PluginFailure(ep.name, dist, version, f"plugin name {ep.name!r} is already taken by "
                                           f"{other.distribution or other.source}"))
            continue
        keys = {_norm(ep.name)} | ({_norm(dist)} if dist else set())
        why = ("GGX_PLUGIN_AUTOLOAD=0" if not autoload
               else "not listed in GGX_PLUGINS" if allow is not None and not keys & set(allow)
               else "listed in GGX_DISABLE_PLUGINS" if keys & set(deny) else None)
        p = _add(info)
        if why:
            info.status, info.reason = DISABLED, why
            continue
        try:
            p.obj = ep.load()
        except BaseException as e:  # SyntaxError, SystemExit in a module body, ...
            if isinstance(e, KeyboardInterrupt):
                raise
            _fail(p, f"import of {ep.value!r} failed: {type(e).__name__}: {e}", traceback.format_exc())
            continue
        _activate(p)


def _load_builtin() -> None:
    import ggx

    p = _add(PluginInfo("ref", "ggx", ggx.__version__, FAILED, source=BUILTIN))
    try:
        from .reference import RefBackendReg

        p.obj = _RegPlugin(RefBackendReg())
    except Exception as e:
        _fail(p, f"cannot create the reference backend: {type(e).__name__}: {e}", traceback.format_exc())
        return
    _activate(p)


def load_plugins(force: bool = False) -> None:
    """Discover and load entry-point plugins and the built-in reference backend (once).

    `force=True` forgets what earlier loads found (in-process registrations stay) and loads again,
    re-reading the environment variables.
    """
    global _loaded
    with _lock:
        if _loaded and not force:
            return
        for name, p in list(_plugins.items()):
            if p.info.source != IN_PROCESS:
                if p.obj is not None and _pm.is_registered(p.obj):
                    _pm.unregister(p.obj)
                del _plugins[name]
                _failures[:] = [f for f in _failures if f.name != name]
        _extra_cache.clear()
        _loaded = True
        _load_entry_points()
        _load_builtin()


# --------------------------------------------------------------------------------------------
def _ordered() -> list[_Plugin]:
    load_plugins()
    return sorted(_plugins.values(), key=lambda p: (_SOURCE_RANK[p.info.source], p.order))


def backend_regs() -> list[BackendReg]:
    """Every loaded BackendReg in plugin order (in-process, entry points, built-in)."""
    with _lock:
        return [p.info.reg for p in _ordered() if p.info.reg is not None]


def devices() -> list[Device]:
    """Every device of every loaded plugin: GPU, ACCEL, IGPU, CPU; the reference backend last."""
    with _lock:
        found = [(DeviceType(d.type), i, d) for i, p in enumerate(_ordered()) for d in p.devices]
        return [d for _, _, d in sorted(found, key=lambda x: (x[0], x[1]))]


def default_device() -> Device:
    """The first device in `devices()` order (an accelerator when there is one)."""
    devs = devices()
    if not devs:
        raise GGXPluginError("no devices are available" + _failure_summary())
    return devs[0]


def _failure_summary() -> str:
    if not _failures:
        return ""
    return "; failed plugins: " + "; ".join(f"{f.name}: {f.reason}" for f in _failures)


def _matches(name: str, p: _Plugin) -> bool:
    """Could `name` (lowercase) be a device of plugin p, which failed before listing devices?
    Yes when it is the plugin, distribution or reg name, optionally followed by a device index or
    a separated suffix ("cuda0", "cuda:1", "cuda_host" for plugin "cuda")."""
    stems = {p.info.name.lower()}
    if p.info.distribution:
        stems.add(p.info.distribution.lower())
    if p.reg_name:
        stems.add(p.reg_name.lower())
    return any(name == s or (name.startswith(s) and (name[len(s):].isdigit() or name[len(s)] in "-_:. "))
               for s in stems)


def get_device(name: str) -> Device:
    """The device called `name` (case-insensitive).

    Raises GGXPluginError with the recorded reason when `name` belongs to a plugin that failed or
    is disabled, and one listing the known devices when nobody has that name.
    """
    with _lock:
        devs = devices()
        key = name.lower()
        for d in devs:
            if d.name.lower() == key:
                return d
        for p in _ordered():
            if p.info.status != LOADED and _matches(key, p):
                what = "failed to load" if p.info.status == FAILED else "is disabled"
                dist = f" ({p.info.distribution} {p.info.version})" if p.info.distribution else ""
                raise GGXPluginError(f"device {name!r}: plugin {p.info.name!r}{dist} {what}: {p.info.reason}")
        known = ", ".join(d.name for d in devs) or "none"
        raise GGXPluginError(f"no device named {name!r}; known devices: {known}" + _failure_summary())


def extra_buffer_types(device: Device) -> list[ExtraBufferType]:
    """Extra buffer types every plugin offers for `device`, by ascending priority (AMX, repack)."""
    with _lock:
        cached = _extra_cache.get(id(device))
        if cached is not None and cached[0] is device:
            return list(cached[1])
        found: list[tuple[int, int, ExtraBufferType]] = []
        for i, p in enumerate(_ordered()):
            if p.info.status != LOADED or p.obj is None:
                continue
            try:
                for answer in _call_impl(p, "ggx_extra_buffer_types", device=device):
                    found.extend((prio, i, buft) for prio, buft in _check_extra(answer))
            except _Failed as e:
                _fail_extra(p, f"ggx_extra_buffer_types({device.name}): {e}")
            except Exception as e:
                _fail_extra(p, f"ggx_extra_buffer_types({device.name}) raised {type(e).__name__}: {e}",
                            traceback.format_exc())
        bufts = [b for _, _, b in sorted(found, key=lambda x: (x[0], x[1]))]
        _extra_cache[id(device)] = (device, bufts)
        return list(bufts)


def _check_extra(answer: Any) -> list[tuple[int, ExtraBufferType]]:
    if answer is None:
        return []
    if not isinstance(answer, list | tuple):
        raise _Failed(f"returned {type(answer).__name__}, expected a list of (priority, ExtraBufferType)")
    out = []
    for item in answer:
        ok = (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)
              and isinstance(item[1], ExtraBufferType))
        if not ok:
            raise _Failed(f"returned an item {item!r}, expected (int priority, ggx.backend.ExtraBufferType)")
        out.append(item)
    return out


def _fail_extra(p: _Plugin, reason: str, tb: str = "") -> None:
    """A plugin's extra-buffer-type hook failed: record it, keep its devices, drop its hooks."""
    p.info.status = FAILED
    p.info.reason = reason
    if p.obj is not None and _pm.is_registered(p.obj):
        _pm.unregister(p.obj)
    _failures.append(PluginFailure(p.info.name, p.info.distribution, p.info.version, reason, tb))


def _wrap_proc_address(reg: BackendReg) -> None:
    """Make reg.get_proc_address("dev_get_extra_bufts") answer with the core's merged list
    when the reg itself has no answer for that name."""
    own = reg.get_proc_address
    if getattr(own, "_ggx_wrapped", False):
        return

    def get_proc_address(name: str) -> Callable | None:
        fn = own(name)
        if fn is None and name == "dev_get_extra_bufts":
            return extra_buffer_types
        return fn

    get_proc_address._ggx_wrapped = True  # type: ignore[attr-defined]
    reg.get_proc_address = get_proc_address  # type: ignore[method-assign]


def failures() -> list[PluginFailure]:
    """Every recorded plugin failure, in the order they happened (loads plugins first)."""
    with _lock:
        load_plugins()
        return [dataclasses.replace(f) for f in _failures]


def plugins() -> list[PluginInfo]:
    """Every known plugin (loaded, failed or disabled), in plugin order."""
    with _lock:
        return [dataclasses.replace(p.info) for p in _ordered()]


def device_plugin(device: Device) -> PluginInfo | None:
    """The plugin that registered `device` (None for a device the registry does not know)."""
    with _lock:
        for p in _ordered():
            if any(d is device for d in p.devices):
                return dataclasses.replace(p.info)
        return None
