"""`ggx new-plugin`: writes a complete third-party plugin package from the templates here.

Each `*.tmpl` (package data) is a `string.Template` with the placeholders of `names()`; `FILES`
maps a template to the path it is written to inside the new package directory.
"""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from string import Template

from ..errors import GGXError

FILES = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "init.py.tmpl": "{package}/__init__.py",
    "plugin.py.tmpl": "{package}/plugin.py",
    "device.py.tmpl": "{package}/device.py",
    "test_conformance.py.tmpl": "tests/test_conformance.py",
}


def names(name: str) -> dict[str, str]:
    """The spellings of a plugin name: "my-dev" (or "ggx-my-dev") gives device "my_dev",
    distribution "ggx-my-dev", package "ggx_my_dev", class prefix "MyDev"."""
    base = re.sub(r"^ggx[-_]", "", name.strip().lower())
    if not re.fullmatch(r"[a-z][a-z0-9]*([-_][a-z0-9]+)*", base):
        raise GGXError(f"plugin name {name!r}: use letters, digits, '-' or '_', starting with a letter")
    snake = base.replace("-", "_")
    from .._version import __version__
    from ..backend import API_VERSION

    return {"device": snake, "dist": "ggx-" + snake.replace("_", "-"), "package": "ggx_" + snake,
            "cls": "".join(p.capitalize() for p in snake.split("_")), "ggx_version": __version__,
            "api_version": str(API_VERSION)}


def taken(subst: dict[str, str]) -> list[str]:
    """Which names of the new plugin `subst` (see `names`) are already someone's: an installed or
    built-in plugin's name or distribution, or a device name of a plugin that loaded (the
    registry would fail the new plugin for any of them)."""
    from .. import registry

    plugin, dist = registry.normalize_name(subst["device"]), registry.normalize_name(subst["dist"])
    found = []
    for p in registry.plugins():
        if registry.normalize_name(p.name) == plugin:
            found.append(f"plugin name {subst['device']!r} is taken by {p.describe()}")
        elif p.distribution and registry.normalize_name(p.distribution) == dist:
            found.append(f"distribution {subst['dist']!r} is installed ({p.describe()})")
    for d in registry.devices():
        if d.name.lower() == subst["device"]:
            owner = registry.device_plugin(d)
            found.append(f"device name {d.name!r} is taken by {owner.describe() if owner else 'a device'}")
    return found


def write_plugin(name: str, directory: Path | str = ".") -> Path:
    """Write the package for plugin `name` into `directory`/<distribution name>; returns that path.

    Refuses (GGXError) a name that collides with an installed or built-in plugin or one of their
    devices (`taken`), and to write into a directory that exists and is not empty.
    """
    subst = names(name)
    collisions = taken(subst)
    if collisions:
        raise GGXError(f"plugin name {name!r} collides: {'; '.join(collisions)}; choose another name")
    root = Path(directory) / subst["dist"]
    if root.exists() and any(root.iterdir()):
        raise GGXError(f"{root} exists and is not empty; choose another --dir or name")
    templates = resources.files(__package__)
    for tmpl, target in FILES.items():
        path = root / target.format(**subst)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(Template(templates.joinpath(tmpl).read_text()).substitute(subst))
    return root
