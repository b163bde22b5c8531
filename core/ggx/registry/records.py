"""What the registry holds: one record per plugin, the failures, and the lock that guards them."""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

import pluggy

from .. import hookspecs
from ..backend import BackendReg, Device, ExtraBufferType

# Sources, in listing order.
IN_PROCESS = "in-process"
ENTRY_POINT = "entry point"
BUILTIN = "built-in"
SOURCE_RANK = {IN_PROCESS: 0, ENTRY_POINT: 1, BUILTIN: 2}

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
    source: str = IN_PROCESS


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

    def describe(self) -> str:
        """"plugin 'cpu' (ggx-cpu 0.1.0, entry point)": who holds a name, for error messages."""
        origin = f"{self.distribution} {self.version}, " if self.distribution else ""
        return f"plugin {self.name!r} ({origin}{self.source})"


@dataclass
class Entry:
    """The registry's record of one plugin."""

    info: PluginInfo
    obj: Any = None  # what was registered with pluggy (None when it never got that far)
    devices: list[Device] = field(default_factory=list)
    order: int = 0
    reg_name: str | None = None  # kept after a failure, so get_device(reg name) finds the reason


def normalize_name(name: str) -> str:
    """A plugin or distribution name normalized PEP 503 style: "GGX_T.Good" -> "ggx-t-good".
    Plugin names that normalize alike collide (the environment variables could not tell them apart)."""
    return re.sub(r"[-_.]+", "-", name).strip().lower()


class Table:
    """Every plugin record and failure, plus the merged extra buffer types per device.

    One re-entrant lock guards all of it: every public registry function holds it for its whole
    run, so loading from two threads at once loads once, and a plugin hook may call back into the
    registry from the loading thread.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.pm = pluggy.PluginManager(hookspecs.PROJECT)
            self.pm.add_hookspecs(hookspecs)
            self.entries: dict[str, Entry] = {}
            self.failures: list[PluginFailure] = []
            # id(device) -> (device, its bufts): the device is kept, so its id is not reused
            self.extra: dict[int, tuple[Device, list[ExtraBufferType]]] = {}
            self.builtin_loaded = False
            self.entry_points_loaded = False
            self.counter = 0

    def add(self, info: PluginInfo) -> Entry:
        self.counter += 1
        e = Entry(info=info, order=self.counter)
        self.entries[info.name] = e
        self.extra.clear()
        return e

    def remove(self, e: Entry) -> None:
        """Forget plugin `e`, its hooks and its recorded failures."""
        del self.entries[e.info.name]
        self.unhook(e)
        self.failures[:] = [f for f in self.failures if f.name != e.info.name]
        self.extra.clear()

    def unhook(self, e: Entry) -> None:
        if e.obj is not None and self.pm.is_registered(e.obj):
            self.pm.unregister(e.obj)

    def record(self, e: Entry, reason: str, tb: str = "") -> None:
        """Mark `e` failed with `reason` and take its hooks out of pluggy."""
        e.info.status = FAILED
        e.info.reason = reason
        self.unhook(e)
        self.failures.append(PluginFailure(e.info.name, e.info.distribution, e.info.version, reason, tb,
                                           e.info.source))

    def call_hook(self, e: Entry, hook: str, **kwargs: Any) -> list[Any]:
        """Call plugin e's own implementations of `hook` (not the others'), passing the args it takes."""
        return [impl.function(*(kwargs[a] for a in impl.argnames))
                for impl in getattr(self.pm.hook, hook).get_hookimpls() if impl.plugin is e.obj]

    def ordered(self) -> list[Entry]:
        """Plugins in listing order: in-process, entry points, built-in; then by registration."""
        return sorted(self.entries.values(), key=lambda e: (SOURCE_RANK[e.info.source], e.order))

    def plugin_holder(self, name: str) -> Entry | None:
        """The plugin whose name collides with `name` (compared normalized), if any."""
        key = normalize_name(name)
        return next((e for e in self.entries.values() if normalize_name(e.info.name) == key), None)

    def device_holder(self, name: str) -> tuple[Entry, Device] | None:
        """The loaded plugin and device whose name is `name` (case-insensitive), if any."""
        key = name.lower()
        return next(((e, d) for e in self.entries.values() for d in e.devices if d.name.lower() == key), None)


TABLE = Table()
