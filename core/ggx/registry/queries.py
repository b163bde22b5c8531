"""What the registry answers: plugins and failures, the device list and its order, a device by
name (with the reason when its plugin failed), a device's reg, the extra buffer types per device.

Every query loads the plugins first (once) and holds the registry's lock while it reads.
"""
from __future__ import annotations

import dataclasses

from ..backend import BackendReg, Device, DeviceType, ExtraBufferType
from ..errors import GGXPluginError
from .loading import load_plugins, offered_extra_buffer_types
from .records import FAILED, LOADED, TABLE, Entry, PluginFailure, PluginInfo


def _ordered() -> list[Entry]:
    load_plugins()
    return TABLE.ordered()


def plugins() -> list[PluginInfo]:
    """Every known plugin (loaded, failed or disabled), in plugin order."""
    with TABLE.lock:
        return [dataclasses.replace(e.info) for e in _ordered()]


def failures() -> list[PluginFailure]:
    """Every recorded plugin failure, in the order they happened (loads plugins first)."""
    with TABLE.lock:
        load_plugins()
        return [dataclasses.replace(f) for f in TABLE.failures]


def backend_regs() -> list[BackendReg]:
    """Every loaded BackendReg in plugin order (in-process, entry points, built-in)."""
    with TABLE.lock:
        return [e.info.reg for e in _ordered() if e.info.reg is not None]


def devices() -> list[Device]:
    """Every device of every loaded plugin: GPU, ACCEL, IGPU, CPU; the reference backend last."""
    with TABLE.lock:
        found = [(DeviceType(d.type), i, d) for i, e in enumerate(_ordered()) for d in e.devices]
        return [d for _, _, d in sorted(found, key=lambda x: (x[0], x[1]))]


def default_device() -> Device:
    """The first device in `devices()` order (an accelerator when there is one)."""
    with TABLE.lock:
        devs = devices()
        if not devs:
            raise GGXPluginError("no devices are available" + _failure_summary())
        return devs[0]


def _failure_summary() -> str:
    if not TABLE.failures:
        return ""
    return "; failed plugins: " + "; ".join(f"{f.name}: {f.reason}" for f in TABLE.failures)


def _matches(name: str, e: Entry) -> bool:
    """Could `name` (lowercase) be a device of plugin e, which failed before listing devices?
    Yes when it is the plugin, distribution or reg name, optionally followed by a device index or
    a separated suffix ("cuda0", "cuda:1", "cuda_host" for plugin "cuda")."""
    stems = {e.info.name.lower()}
    if e.info.distribution:
        stems.add(e.info.distribution.lower())
    if e.reg_name:
        stems.add(e.reg_name.lower())
    return any(name == s or (name.startswith(s) and (name[len(s):].isdigit() or name[len(s)] in "-_:. "))
               for s in stems)


def get_device(name: str) -> Device:
    """The device called `name` (case-insensitive).

    Raises GGXPluginError with the recorded reason when `name` belongs to a plugin that failed or
    is disabled, and one listing the known devices when nobody has that name.
    """
    with TABLE.lock:
        devs = devices()
        key = name.lower()
        for d in devs:
            if d.name.lower() == key:
                return d
        for e in _ordered():
            if e.info.status != LOADED and _matches(key, e):
                what = "failed to load" if e.info.status == FAILED else "is disabled"
                dist = f" ({e.info.distribution} {e.info.version})" if e.info.distribution else ""
                raise GGXPluginError(f"device {name!r}: plugin {e.info.name!r}{dist} {what}: {e.info.reason}")
        known = ", ".join(d.name for d in devs) or "none"
        raise GGXPluginError(f"no device named {name!r}; known devices: {known}" + _failure_summary())


def _entry_of(device: Device) -> Entry | None:
    return next((e for e in _ordered() if any(d is device for d in e.devices)), None)


def device_plugin(device: Device) -> PluginInfo | None:
    """The plugin that registered `device` (None for a device the registry does not know)."""
    with TABLE.lock:
        e = _entry_of(device)
        return dataclasses.replace(e.info) if e is not None else None


def reg_of(device: Device) -> BackendReg | None:
    """The BackendReg that listed `device` (None for a device the registry does not know).

    The registry keeps this itself instead of writing `device.reg`: a device's `reg` attribute is
    whatever its plugin set (ggx-cpu and the reference backend set it; it may be None)."""
    with TABLE.lock:
        e = _entry_of(device)
        return e.info.reg if e is not None else None


def extra_buffer_types(device: Device) -> list[ExtraBufferType]:
    """Every extra buffer type of `device`, best first (ggml's dev_get_extra_bufts): the device's
    own (`Device.extra_buffer_types()`), then those the plugins offer through the hook, by
    ascending priority (plugin order breaks ties), each listed once. The one merge placement, the
    scheduler and conformance ask. The plugins are asked once per device (again after plugins are
    loaded, registered or removed); the device's own list is read every time."""
    with TABLE.lock:
        cached = TABLE.extra.get(id(device))
        if cached is not None and cached[0] is device:
            offered = cached[1]
        else:
            found = [(prio, i, buft) for i, e in enumerate(_ordered()) if e.info.status == LOADED
                     and e.obj is not None for prio, buft in offered_extra_buffer_types(e, device)]
            offered = [b for _, _, b in sorted(found, key=lambda x: (x[0], x[1]))]
            TABLE.extra[id(device)] = (device, offered)
        out: list[ExtraBufferType] = []
        for b in [*device.extra_buffer_types(), *offered]:
            if not any(b is o for o in out):
                out.append(b)
        return out
