"""Filling the registry: in-process registration, entry points, the built-in; validation; failures.

Every plugin goes through pluggy and through one check (`_activate`): it must have been built
against this core's API version (`check_api_version`), its hooks must be known, its
`ggx_backend_reg` must return a BackendReg whose `devices()` is a list of Devices. A plugin that
fails is recorded (`PluginFailure`) and skipped; `register()` raises instead, since its caller is
right there.

Names. Plugin names (compared normalized: "my-dev" is "My_Dev") and device names (compared
case-insensitively, as `get_device` looks them up) are unique. The built-in reference backend is
loaded before anything else, so it always holds "ref"; after it, whoever comes later fails and
its reason names both plugins: entry points load in entry-point name order, an in-process
`register()` when it is called.
"""
from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Any

from .. import hookspecs
from .._version import __version__
from ..backend import API_VERSION, BackendReg, Device, ExtraBufferType
from ..errors import GGXPluginError
from .records import (
    BUILTIN,
    DISABLED,
    ENTRY_POINT,
    FAILED,
    IN_PROCESS,
    LOADED,
    TABLE,
    Entry,
    PluginFailure,
    PluginInfo,
    normalize_name,
)

BUILTIN_NAME = "ref"  # the reference backend's plugin name (its device is "ref" too)


class _RegPlugin:
    """Wraps a BackendReg passed to `register()` directly, so every plugin goes through pluggy."""

    def __init__(self, reg: Any):
        self.reg = reg

    @hookspecs.hookimpl
    def ggx_backend_reg(self):
        return self.reg


class _Failed(Exception):
    """A validation failure inside this package: the reason is the message, no traceback kept."""


def reset() -> None:
    """Forget every plugin, failure and cache; the next use loads again (for tests)."""
    TABLE.reset()


def _env_list(var: str) -> list[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return [normalize_name(x) for x in value.split(",") if x.strip()]


def _autoload_enabled() -> bool:
    return os.environ.get("GGX_PLUGIN_AUTOLOAD", "1").strip().lower() not in ("0", "false", "no", "off")


def _fail(e: Entry, reason: str, tb: str = "") -> None:
    """Plugin `e` failed to load: it keeps no reg and no devices."""
    e.info.reg = None
    e.devices = []
    TABLE.record(e, reason, tb)


def _validate_reg(e: Entry, reg: Any) -> None:
    """Check what ggx_backend_reg returned and the names of its devices; keep them. Raises _Failed."""
    if reg is None:
        return
    if not isinstance(reg, BackendReg):
        raise _Failed(f"ggx_backend_reg() returned {type(reg).__module__}.{type(reg).__qualname__}, "
                      "expected a ggx.backend.BackendReg or None")
    e.reg_name = str(reg.name)
    version = getattr(reg, "api_version", None)
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version != API_VERSION):
        raise _Failed(f"backend {reg.name!r} was built for ggx core API version {version!r}, "
                      f"this core has API version {API_VERSION}")
    devs = reg.devices()
    if not isinstance(devs, list | tuple) or not all(isinstance(d, Device) for d in devs):
        raise _Failed(f"backend {reg.name!r}: devices() returned {devs!r}, expected a list of ggx.backend.Device")
    seen: set[str] = set()
    for d in devs:
        if not isinstance(d.name, str) or not d.name:
            raise _Failed(f"backend {reg.name!r}: a device has no name ({d.name!r})")
        if d.name.lower() in seen:
            raise _Failed(f"backend {reg.name!r} lists device {d.name!r} twice")
        seen.add(d.name.lower())
        held = TABLE.device_holder(d.name)
        if held is not None:
            raise _Failed(f"device name {d.name!r} is already taken by {held[0].info.describe()}")
    e.info.reg = reg
    e.devices = list(devs)


def stated_api_version(obj: Any) -> Any:
    """The core API version plugin object `obj` says it was built against: its `GGX_API_VERSION`
    (a module-level constant of the plugin module), or for a bare BackendReg its `api_version`;
    None when it states none."""
    if isinstance(obj, _RegPlugin):
        return getattr(obj.reg, "api_version", None)
    return getattr(obj, "GGX_API_VERSION", None)


def check_api_version(obj: Any, source: str) -> None:
    """Raise _Failed unless `obj` was built against this core's API version. An entry-point plugin
    (an installed distribution, built separately) must state it; an in-process registration
    (written in this process, against this core) may leave it unstated."""
    version = stated_api_version(obj)
    if version is None:
        if source == ENTRY_POINT:
            raise _Failed(f"states no API version (GGX_API_VERSION in its plugin module: the ggx core API "
                          f"version it was built against); this core has API version {API_VERSION}")
        return
    if not isinstance(version, int) or isinstance(version, bool) or version != API_VERSION:
        raise _Failed(f"was built against ggx core API version {version!r}, this core has API version "
                      f"{API_VERSION}")


def _activate(e: Entry) -> None:
    """Check e.obj's API version, register it with pluggy and run its ggx_backend_reg; on any
    failure, record it."""
    try:
        check_api_version(e.obj, e.info.source)
        TABLE.pm.register(e.obj, name=e.info.name)
        unknown = [hc.name for hc in TABLE.pm.get_hookcallers(e.obj) or [] if not hc.has_spec()]
        if unknown:
            raise _Failed(f"implements unknown hook(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(n for n in dir(hookspecs) if n.startswith('ggx_')))}")
        try:
            regs = TABLE.call_hook(e, "ggx_backend_reg")
        except Exception as err:
            _fail(e, f"ggx_backend_reg() raised {type(err).__name__}: {err}", traceback.format_exc())
            return
        for reg in regs:
            _validate_reg(e, reg)
    except _Failed as err:
        _fail(e, str(err))
        return
    except Exception as err:  # pluggy validation errors, a reg whose devices() raises, ...
        _fail(e, f"{type(err).__name__}: {err}", traceback.format_exc())
        return
    e.info.status = LOADED


def register(plugin_or_reg: Any, name: str | None = None) -> PluginInfo:
    """Register a plugin in-process: a module/object with hookimpls, or a BackendReg directly.

    Unlike discovery, a failure here (a name already taken included) raises GGXPluginError at
    once: the caller is right there. Loads the built-in reference backend first (so its names
    are taken), but no entry point.
    """
    with TABLE.lock:
        _load_builtin()
        if isinstance(plugin_or_reg, BackendReg):
            obj = _RegPlugin(plugin_or_reg)
            name = name or plugin_or_reg.name
            version = plugin_or_reg.version
        else:
            obj = plugin_or_reg
            name = name or getattr(obj, "__name__", None) or type(obj).__name__
            version = getattr(obj, "__version__", None)
        holder = TABLE.plugin_holder(name)
        if holder is not None:
            raise GGXPluginError(f"cannot register plugin {name!r}: the name is already taken by "
                                 f"{holder.info.describe()}")
        e = TABLE.add(PluginInfo(name, None, version, FAILED, source=IN_PROCESS))
        e.obj = obj
        n_failures = len(TABLE.failures)
        _activate(e)
        if e.info.status == FAILED:
            del TABLE.entries[name]
            failure = TABLE.failures.pop(n_failures)
            raise GGXPluginError(f"cannot register plugin {name!r}: {failure.reason}")
        return dataclasses.replace(e.info)


def unregister(name: str) -> None:
    """Remove a plugin (any source) with its devices and recorded failures."""
    with TABLE.lock:
        e = TABLE.entries.get(name)
        if e is None:
            raise GGXPluginError(f"no plugin named {name!r}; registered: {', '.join(TABLE.entries) or 'none'}")
        TABLE.remove(e)


def refresh_plugin(name: str) -> PluginInfo:
    """Ask a loaded plugin for its devices again: for a plugin whose devices appear at run time
    (ggx-ray after `ggx_ray.connect()`). Devices it listed before and lists again keep their
    place; a name clash fails the refresh with GGXPluginError and leaves the old list."""
    with TABLE.lock:
        load_plugins()
        e = TABLE.entries.get(name) or next(
            (x for x in TABLE.entries.values() if normalize_name(name) in
             {normalize_name(x.info.name), normalize_name(x.info.distribution or "")}), None)
        if e is None or e.info.reg is None:
            raise GGXPluginError(f"no loaded plugin named {name!r}")
        old = e.devices
        e.devices = []
        try:
            _validate_reg(e, e.info.reg)
        except _Failed as err:
            e.devices = old
            raise GGXPluginError(f"cannot refresh plugin {name!r}: {err}") from None
        return dataclasses.replace(e.info)


def _load_entry_points() -> None:
    import importlib_metadata

    autoload = _autoload_enabled()
    allow = _env_list("GGX_PLUGINS")
    deny = _env_list("GGX_DISABLE_PLUGINS") or []
    eps = sorted(importlib_metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    for ep in eps:
        dist = ep.dist.name if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        holder = TABLE.plugin_holder(ep.name)
        if holder is not None:
            TABLE.failures.append(PluginFailure(
                ep.name, dist, version, f"plugin name {ep.name!r} is already taken by {holder.info.describe()}",
                source=ENTRY_POINT))
            continue
        keys = {normalize_name(ep.name)} | ({normalize_name(dist)} if dist else set())
        why = ("GGX_PLUGIN_AUTOLOAD=0" if not autoload
               else "not listed in GGX_PLUGINS" if allow is not None and not keys & set(allow)
               else "listed in GGX_DISABLE_PLUGINS" if keys & set(deny) else None)
        e = TABLE.add(PluginInfo(ep.name, dist, version, FAILED, source=ENTRY_POINT))
        if why:
            e.info.status, e.info.reason = DISABLED, why
            continue
        try:
            e.obj = ep.load()
        except BaseException as err:  # SyntaxError, SystemExit in a module body, ...
            if isinstance(err, KeyboardInterrupt):
                raise
            _fail(e, f"import of {ep.value!r} failed: {type(err).__name__}: {err}", traceback.format_exc())
            continue
        _activate(e)


def _load_builtin() -> None:
    """Load the reference backend once (per reset), before any other plugin can take its names."""
    if TABLE.builtin_loaded:
        return
    TABLE.builtin_loaded = True
    e = TABLE.add(PluginInfo(BUILTIN_NAME, "ggx", __version__, FAILED, source=BUILTIN))
    try:
        from ..reference import RefBackendReg

        e.obj = _RegPlugin(RefBackendReg())
    except Exception as err:
        _fail(e, f"cannot create the reference backend: {type(err).__name__}: {err}", traceback.format_exc())
        return
    _activate(e)


def load_plugins(force: bool = False) -> None:
    """Load the built-in reference backend, then discover and load entry-point plugins (once).

    `force=True` forgets what earlier loads found through entry points (in-process registrations
    and the built-in stay) and loads them again, re-reading the environment variables.
    """
    with TABLE.lock:
        _load_builtin()
        if TABLE.entry_points_loaded and not force:
            return
        for e in [e for e in TABLE.entries.values() if e.info.source == ENTRY_POINT]:
            TABLE.remove(e)
        TABLE.failures[:] = [f for f in TABLE.failures if f.source != ENTRY_POINT]
        TABLE.entry_points_loaded = True
        _load_entry_points()


def offered_extra_buffer_types(e: Entry, device: Device) -> list[tuple[int, ExtraBufferType]]:
    """Plugin e's answer to `ggx_extra_buffer_types(device)`, checked. A hook that raises or
    answers wrong is recorded as failed (its devices stay) and offers nothing."""
    try:
        return [item for answer in TABLE.call_hook(e, "ggx_extra_buffer_types", device=device)
                for item in _check_extra(answer)]
    except _Failed as err:
        TABLE.record(e, f"ggx_extra_buffer_types({device.name}): {err}")
    except Exception as err:
        TABLE.record(e, f"ggx_extra_buffer_types({device.name}) raised {type(err).__name__}: {err}",
                     traceback.format_exc())
    return []


def _check_extra(answer: Any) -> list[tuple[int, ExtraBufferType]]:
    if answer is None:
        return []
    if not isinstance(answer, list | tuple):
        raise _Failed(f"returned {type(answer).__name__}, expected a list of (priority, ExtraBufferType)")
    for item in answer:
        ok = (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)
              and isinstance(item[1], ExtraBufferType))
        if not ok:
            raise _Failed(f"returned an item {item!r}, expected (int priority, ggx.backend.ExtraBufferType)")
    return list(answer)
