"""dev.sh's install stamp: the hash set-up compares to skip pip when nothing it installs from changed."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _stamp(tree: Path) -> str:
    env = {**os.environ, "GGX_VENV": str(tree / "no-venv")}
    done = subprocess.run(["bash", str(tree / "dev.sh"), "stamp"], capture_output=True, text=True, env=env, check=True)
    return done.stdout.strip()


def test_the_stamp_follows_what_the_install_depends_on(tmp_path):
    shutil.copy(ROOT / "dev.sh", tmp_path / "dev.sh")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "ggx"\n')
    (tmp_path / "plugins" / "ggx-a").mkdir(parents=True)
    (tmp_path / "plugins" / "ggx-a" / "pyproject.toml").write_text('[project]\nname = "ggx-a"\n')
    first = _stamp(tmp_path)
    assert len(first) == 64 and _stamp(tmp_path) == first

    os.utime(tmp_path / "pyproject.toml", (0, 0))  # a new mtime alone changes nothing
    assert _stamp(tmp_path) == first

    plugin = tmp_path / "plugins" / "ggx-a" / "pyproject.toml"
    plugin.write_text('[project]\nname = "ggx-a"\ndependencies = ["numba"]\n')
    edited = _stamp(tmp_path)
    assert edited != first

    (tmp_path / "plugins" / "ggx-b").mkdir()
    (tmp_path / "plugins" / "ggx-b" / "pyproject.toml").write_text('[project]\nname = "ggx-a"\n')
    added = _stamp(tmp_path)
    assert added not in (first, edited)  # a new plugin, even with a copied pyproject

    with open(tmp_path / "dev.sh", "a") as f:
        f.write("# an edit to the script itself\n")
    assert _stamp(tmp_path) not in (first, edited, added)
