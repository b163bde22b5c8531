"""`ggx new-plugin` round trip: generate a plugin, pip-install it, find it, pass the suite with it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ggx import cli
from ggx.errors import GGXError
from ggx.scaffold import names, write_plugin

NAME = "toyconf"  # an unusual name, so it cannot clash with a real plugin in the environment


def _run(*args, cwd=None):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture
def installed(tmp_path):
    assert cli.main(["new-plugin", NAME, "--dir", str(tmp_path)]) == 0
    root = tmp_path / "ggx-toyconf"
    # With build isolation, as dev.sh installs the core: the build backend comes from the index,
    # so the test does not depend on setuptools/wheel versions of this environment.
    r = _run("-m", "pip", "install", "--no-deps", "-q", "-e", str(root))
    assert r.returncode == 0, r.stdout + r.stderr
    yield root
    _run("-m", "pip", "uninstall", "-y", "-q", "ggx-toyconf")


def test_generated_plugin_is_discovered_and_passes_the_suite(installed):
    assert sorted(p.name for p in installed.rglob("*") if p.is_file() and "egg-info" not in str(p)) == [
        "README.md", "__init__.py", "device.py", "plugin.py", "pyproject.toml", "test_conformance.py"]
    assert '[project.entry-points."ggx.plugins"]' in (installed / "pyproject.toml").read_text()

    r = _run("-m", "ggx.cli", "devices", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    plugin = next(p for p in report["plugins"] if p["name"] == NAME)
    assert plugin["distribution"] == "ggx-toyconf" and plugin["status"] == "loaded"
    assert NAME in [d["name"] for d in report["devices"]]

    r = _run("-m", "pytest", "-p", "no:cacheprovider", "-p", "ggx.testing", "--ggx-backend", NAME, "-q", "-rN",
             cwd=installed)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and " skipped" in summary and "failed" not in summary
    assert "ggx conformance: skipped (not supported)" in r.stdout  # listed per op
    assert f"{NAME}: FLASH_ATTN_EXT" in r.stdout


def test_names_and_refusals(tmp_path):
    assert names("ggx-My-Dev") == {**names("my_dev"), "device": "my_dev"}
    assert names("my-dev")["dist"] == "ggx-my-dev" and names("my-dev")["cls"] == "MyDev"
    with pytest.raises(GGXError, match="plugin name"):
        names("9lives")
    write_plugin("again", tmp_path)
    with pytest.raises(GGXError, match="not empty"):
        write_plugin("again", tmp_path)
