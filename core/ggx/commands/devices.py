"""`ggx devices`: plugins, devices, their buffer types, and the plugins that failed, with why.

`--json` prints one object for scripts::

    {"ggx_version": "...", "api_version": 1,
     "plugins":  [{"name", "distribution", "version", "status", "source", "backend", "reason"}],
     "devices":  [{"name", "type", "description", "plugin", "backend",
                   "memory": {"free", "total"} (bytes) | null,
                   "buffer_types": [{"name", "alignment", "max_size", "is_host"}],
                   "host_buffer_type": {...} | null,
                   "extra_buffer_types": [{"name", ...}],
                   "features": {"name": "value"} | null,
                   "errors": ["what failed while describing the device"]}],
     "failures": [{"name", "distribution", "version", "reason", "traceback"}],
     "weight_placement": "what a model load orders the host's weights by (`ggx tune`)"}
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

GIB = 1 << 30


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("devices", help="list plugins, devices, buffer types and failed plugins",
                              description="List plugins, devices, buffer types and failed plugins.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("-v", "--verbose", action="store_true", help="also print the traceback of each failure")
    p.set_defaults(func=run)


def _buft(buft: Any) -> dict[str, Any]:
    return {"name": buft.name, "alignment": buft.alignment, "max_size": buft.max_size, "is_host": buft.is_host}


def _short(value: Any, limit: int = 40) -> str:
    """A feature value for the table: long lists are summarized (`--json` keeps them whole);
    other values are shown whole (the table wraps them)."""
    text = str(value)
    if len(text) > limit and isinstance(value, list | tuple | set | frozenset):
        return f"[{len(value)} items]"
    return text


def _features(device: Any, reg: Any) -> dict[str, Any] | None:
    """The "get_features" capability of the device (if it has get_proc_address) or of its reg."""
    for owner in (device, reg):
        lookup = getattr(owner, "get_proc_address", None)
        fn = lookup("get_features") if lookup is not None else None
        if fn is not None:
            feats = fn()
            items = feats.items() if isinstance(feats, dict) else feats
            return {str(k): sorted(map(str, v)) if isinstance(v, list | tuple | set | frozenset) else str(v)
                    for k, v in items}
    return None


def _device(device: Any) -> dict[str, Any]:
    """Describe one device; a plugin method that raises is reported in "errors", not fatal."""
    from .. import registry
    from ..backend import DeviceType

    errors: list[str] = []

    def safe(what: str, fn: Callable[[], Any], default: Any = None) -> Any:
        try:
            return fn()
        except Exception as e:  # a buggy plugin must not hide the other devices
            errors.append(f"{what}: {type(e).__name__}: {e}")
            return default

    plugin = registry.device_plugin(device)
    reg = registry.reg_of(device)
    memory = safe("memory()", device.memory)
    host = safe("host_buffer_type()", device.host_buffer_type)
    return {
        "name": device.name,
        "type": DeviceType(device.type).name,
        "description": device.description,
        "plugin": plugin.name if plugin else None,
        "backend": reg.name if reg is not None else None,
        "memory": {"free": int(memory[0]), "total": int(memory[1])} if memory else None,
        "buffer_types": [b for b in [safe("buffer_type()", lambda: _buft(device.buffer_type()))] if b],
        "host_buffer_type": safe("host_buffer_type()", lambda: _buft(host)) if host is not None else None,
        "extra_buffer_types": safe("extra buffer types",
                                   lambda: [_buft(b) for b in registry.extra_buffer_types(device)], []),
        "features": safe("get_features", lambda: _features(device, reg)),
        "errors": errors,
    }


def collect() -> dict[str, Any]:
    """Everything `ggx devices` shows, as plain data (loads plugins)."""
    from .. import registry
    from .._version import __version__
    from ..backend import API_VERSION

    devs = [_device(d) for d in registry.devices()]
    return {
        "ggx_version": __version__,
        "api_version": API_VERSION,
        "plugins": [{"name": p.name, "distribution": p.distribution, "version": p.version, "status": p.status,
                     "source": p.source, "backend": p.reg.name if p.reg is not None else None,
                     "reason": p.reason or (p.reg.note if p.reg is not None else "")}
                    for p in registry.plugins()],
        "devices": devs,
        "failures": [{"name": f.name, "distribution": f.distribution, "version": f.version, "reason": f.reason,
                      "traceback": f.traceback} for f in registry.failures()],
        "weight_placement": _weight_placement(),
    }


def _weight_placement() -> str:
    """The basis of weight placement on the host device: a measured profile, or the priority order
    and why (no profile, a stale one, turned off)."""
    from .. import tune
    from ..errors import GGXError
    from ..placement import host_device

    try:
        return tune.profile_for(host_device())[1]
    except GGXError as e:  # no host device
        return f"priority order ({e})"


def _gib(memory: dict[str, int] | None) -> str:
    if memory is None:
        return "?"
    return f"{memory['free'] / GIB:.1f} / {memory['total'] / GIB:.1f}"


def render(report: dict[str, Any], verbose: bool, console: Any = None) -> None:
    """Print `report` (from `collect`) as text on `console` (a rich Console; default: stdout,
    as wide as the terminal). Written to read well at 80 columns."""
    from rich.console import Console
    from rich.markup import escape as esc
    from rich.padding import Padding
    from rich.table import Table

    console = console or Console(highlight=False)
    console.print(f"ggx {report['ggx_version']} (core API version {report['api_version']})")

    t = Table(title="Plugins", title_justify="left")
    for col in ("name", "distribution", "version", "source", "status"):
        t.add_column(col, overflow="fold")
    style = {"loaded": "green", "failed": "red", "disabled": "yellow"}
    for p in report["plugins"]:
        status = f"[{style.get(p['status'], '')}]{p['status']}[/]"
        if p["reason"] and p["status"] != "failed":
            status += f" ({esc(p['reason'])})"
        t.add_row(esc(p["name"]), esc(p["distribution"] or "-"), esc(p["version"] or "-"), p["source"], status)
    console.print(t)

    # One block per device (a label column, a value column that wraps) rather than one table
    # row: seven columns cannot fit 80 characters without cutting descriptions and features.
    console.print("Devices (in order of preference)" if report["devices"] else "No devices.", style="italic")
    for i, d in enumerate(report["devices"], 1):
        backend = f", backend {esc(d['backend'])}" if d["backend"] and d["backend"] != d["plugin"] else ""
        console.print(f"{i}. [bold]{esc(d['name'])}[/]  (type {d['type']}, plugin {esc(d['plugin'] or '-')}{backend})")
        rows = Table.grid(padding=(0, 2))
        rows.add_column(no_wrap=True, style="dim")
        rows.add_column(overflow="fold")
        bufts = [b["name"] for b in d["buffer_types"]]
        if d["host_buffer_type"]:
            bufts.append(f"{d['host_buffer_type']['name']} (host)")
        rows.add_row("description", esc(d["description"]))
        rows.add_row("memory", f"{_gib(d['memory'])} GiB free / total")
        rows.add_row("buffer types", esc(", ".join(bufts) or "-"))
        rows.add_row("extra buffer types", esc(", ".join(b["name"] for b in d["extra_buffer_types"]) or "-"))
        for k, (key, value) in enumerate((d["features"] or {}).items()):
            rows.add_row("features" if k == 0 else "", esc(f"{key}={_short(value)}"))
        for error in d["errors"]:
            rows.add_row("[red]error[/]", f"[red]{esc(error)}[/]")
        console.print(Padding(rows, (0, 0, 0, 3), expand=False))

    console.print(f"weight placement: {esc(report['weight_placement'])}")
    if report["failures"]:
        t = Table(title="Failed plugins", title_justify="left")
        for col in ("name", "distribution", "version", "reason"):
            t.add_column(col, overflow="fold")
        for f in report["failures"]:
            t.add_row(esc(f["name"]), esc(f["distribution"] or "-"), esc(f["version"] or "-"), esc(f["reason"]))
        console.print(t)
        if verbose:
            for f in report["failures"]:
                if f["traceback"]:
                    console.print(f"[bold]{esc(f['name'])}[/]")
                    console.print(f["traceback"], markup=False)
        else:
            console.print("(ggx devices -v shows the tracebacks)")


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report, args.verbose)
    return 0
