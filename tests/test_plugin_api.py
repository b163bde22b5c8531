"""`ggx.plugin` is the plugin API: its docstring is the list, its names are the modules' own, the
scaffold builds against nothing else, and the core names no plugin."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from string import Template

import ggx
import ggx.plugin
from ggx import backend

CORE = Path(ggx.__file__).parent
PLUGIN_API_MODULES = {"ggx.backend", "ggx.hookspecs", "ggx.host", "ggx.errors", "ggx.types", "ggx.tensor",
                      "ggx.graph", "ggx.ops"}


def test_every_name_is_listed_in_the_docstring_and_is_its_modules_own():
    doc = ggx.plugin.__doc__
    for name in ggx.plugin.__all__:
        assert f"`{name}`" in doc, f"{name} is exported but not listed in ggx.plugin's docstring"
        obj = getattr(ggx.plugin, name)
        home = getattr(obj, "__module__", None)
        if home in PLUGIN_API_MODULES:  # classes and functions: re-exported, not copied
            assert getattr(importlib.import_module(home), name) is obj


def test_every_contract_class_of_backend_is_exported():
    contracts = {name for name, obj in vars(backend).items()
                 if inspect.isclass(obj) and obj.__module__ == "ggx.backend" and not name.startswith("_")}
    assert contracts and contracts <= set(ggx.plugin.__all__), contracts - set(ggx.plugin.__all__)
    assert ggx.plugin.Launch is backend.Launch and ggx.plugin.API_VERSION == backend.API_VERSION


def _imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_scaffold_builds_only_against_the_plugin_api():
    from ggx.scaffold import names

    for tmpl in ["device.py.tmpl", "plugin.py.tmpl"]:
        source = Template((CORE / "scaffold" / tmpl).read_text()).substitute(names("probe"))
        used = {m for m in _imports(source) if m == "ggx" or m.startswith("ggx.")}
        assert used and used <= PLUGIN_API_MODULES, f"{tmpl}: {used - PLUGIN_API_MODULES}"


def test_the_core_names_no_plugin_priority():
    from ggx import hookspecs

    assert not [n for n in vars(hookspecs) if n.startswith("PRIORITY")]
    offenders = [str(p.relative_to(CORE)) for p in CORE.rglob("*.py") if "PRIORITY_" in p.read_text()]
    assert offenders == []


def test_no_module_of_the_package_takes_the_version_from_its_face():
    """`ggx/__init__` imports the whole package; a module below it reads `ggx._version` instead."""
    offenders = []
    for path in CORE.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == CORE:
            continue
        depth = len(path.relative_to(CORE).parts) - 1  # the level of a relative import of ggx itself
        for node in ast.walk(ast.parse(path.read_text())):
            names = {a.name for a in node.names} if isinstance(node, ast.ImportFrom) else set()
            face = isinstance(node, ast.ImportFrom) and (node.module == "ggx" and node.level == 0
                                                         or node.module is None and node.level == depth + 1)
            if face and "__version__" in names:
                offenders.append(str(path.relative_to(CORE)))
            if isinstance(node, ast.Attribute) and node.attr == "__version__" and \
                    isinstance(node.value, ast.Name) and node.value.id == "ggx":
                offenders.append(str(path.relative_to(CORE)))
    assert offenders == []


def test_the_package_docstring_points_plugin_authors_at_ggx_plugin():
    assert "`ggx.plugin`" in ggx.__doc__
    guide = (CORE.parents[1] / "docs" / "plugin-authoring.md").read_text()
    assert "`ggx.plugin`" in guide
