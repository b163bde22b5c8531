"""`ggx new-plugin` refuses names that are taken: by the built-in, by an installed plugin (loaded
or not), by a device of a loaded plugin. The round trip (install, discover, suite) is in
tests/conformance/test_new_plugin.py."""
from __future__ import annotations

import pytest

from ggx import cli, registry
from ggx.backend import BackendReg, Device, DeviceType
from ggx.errors import GGXError
from ggx.host import HostBufferType
from ggx.scaffold import write_plugin


class Gadget(Device):
    name = "Gadget"
    type = DeviceType.ACCEL
    description = "a test device"

    def __init__(self):
        self._buft = HostBufferType(self, name="gadget")

    def memory(self):
        return (1, 1)

    def init_backend(self, **params):
        raise NotImplementedError

    def buffer_type(self):
        return self._buft

    def supports_op(self, op):
        return False


class GadgetReg(BackendReg):
    name = "gadgets"

    def devices(self):
        return [Gadget()]


@pytest.fixture(autouse=True)
def only_builtin_and_gadgets(tmp_path, monkeypatch):
    """No entry point loads except one disabled plugin "dormant"; an in-process plugin "gadgets"."""
    info = tmp_path / "ggx_t_dormant-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ggx-t-dormant\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ggx.plugins]\ndormant = ggx_t_dormant\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GGX_PLUGINS", "dormant")
    monkeypatch.setenv("GGX_DISABLE_PLUGINS", "dormant")
    monkeypatch.delenv("GGX_PLUGIN_AUTOLOAD", raising=False)
    registry.reset()
    registry.register(GadgetReg())
    yield
    registry.reset()


@pytest.mark.parametrize("name, reason", [
    ("ref", "plugin name 'ref' is taken by plugin 'ref' (ggx "),  # the built-in reference backend
    ("ggx-ref", "device name 'ref' is taken by plugin 'ref' (ggx "),
    ("Gadgets", "plugin name 'gadgets' is taken by plugin 'gadgets' (in-process)"),
    ("gadget", "device name 'Gadget' is taken by plugin 'gadgets' (in-process)"),
    ("dormant", "plugin name 'dormant' is taken by plugin 'dormant' (ggx-t-dormant 1.0, entry point)"),
    ("t-dormant", "distribution 'ggx-t-dormant' is installed"),
])
def test_a_taken_name_is_refused_before_anything_is_written(name, reason, tmp_path):
    with pytest.raises(GGXError, match="collides") as err:
        write_plugin(name, tmp_path / "out")
    assert reason in str(err.value) and "choose another name" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_free_name_is_written(tmp_path):
    root = write_plugin("gizmo", tmp_path)
    assert root == tmp_path / "ggx-gizmo" and (root / "ggx_gizmo" / "device.py").exists()
    # the plugin states the core API version it was generated against (the registry checks it)
    from ggx.backend import API_VERSION

    assert f"\nGGX_API_VERSION = {API_VERSION}\n" in (root / "ggx_gizmo" / "plugin.py").read_text()


def test_the_command_ends_with_one_error_line(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert cli.main(["new-plugin", "ref", "--dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plugin name 'ref' collides: ")
    assert list(out.iterdir()) == []
