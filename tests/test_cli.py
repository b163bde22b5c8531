"""The `ggx` command through `main([...])`: --version, `ggx devices` tables and --json, errors."""
from __future__ import annotations

import json
import sys
import types

import importlib_metadata
import pytest

import ggx
from ggx import cli, registry
from ggx.backend import BackendReg, Device, DeviceType, ExtraBufferType
from ggx.errors import GGXPluginError
from ggx.hookspecs import hookimpl
from ggx.host import HostBufferType

GIB = 1 << 30


class FakeDevice(Device):
    def __init__(self, name: str, type: DeviceType, memory=(3 * GIB, 4 * GIB), host: bool = False):
        self.name = name
        self.type = type
        self.description = f"fake {name} [v2]"  # brackets: must not be taken for rich markup
        self._memory = memory
        self._buft = HostBufferType(self, name=f"{name}_buf")
        self._host = HostBufferType(self, name=f"{name}_pinned") if host else None

    def memory(self):
        if self._memory is None:
            raise RuntimeError("driver went away")
        return self._memory

    def init_backend(self, **params):
        raise NotImplementedError

    def buffer_type(self):
        return self._buft

    def host_buffer_type(self):
        return self._host

    def supports_op(self, op):
        return False


class FakeReg(BackendReg):
    version = "4.5"

    def __init__(self, name, devices, features=None):
        self.name = name
        self._devices = devices
        self._features = features

    def devices(self):
        return self._devices

    def get_proc_address(self, name):
        return (lambda: self._features) if name == "get_features" and self._features else None


class FakeExtra(ExtraBufferType):
    def __init__(self, name):
        self.name = name

    @property
    def device(self):
        return None

    def alloc_buffer(self, size):
        raise NotImplementedError

    def supports_op(self, op):
        return False

    def compute_forward(self, op, n_threads=1):
        return False


class ExtraPlugin:
    @hookimpl
    def ggx_extra_buffer_types(self, device):
        return [(20, FakeExtra("TREPACK")), (10, FakeExtra("TAMX"))] if device.type == DeviceType.CPU else None


@pytest.fixture(autouse=True)
def setup(tmp_path, monkeypatch):
    """In-process plugins plus one real entry point (a distribution whose module fails to import)."""
    (tmp_path / "ggx_t_clibroken.py").write_text("raise ImportError('libbar.so: cannot open')\n")
    info = tmp_path / "ggx_t_clibroken-0.7.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ggx-t-clibroken\nVersion: 0.7\n")
    (info / "entry_points.txt").write_text("[ggx.plugins]\nclibroken = ggx_t_clibroken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GGX_PLUGINS", "clibroken")
    monkeypatch.delenv("GGX_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("GGX_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setenv("COLUMNS", "250")  # wide rich tables, so cells are not folded
    registry.reset()
    registry.register(FakeReg("tcpu", [FakeDevice("tcpu0", DeviceType.CPU)], features={"ISA": "avx512_vnni"}))
    registry.register(FakeReg("tgpu", [FakeDevice("tgpu0", DeviceType.GPU, host=True)]))
    registry.register(ExtraPlugin(), name="textra")
    yield
    registry.reset()
    sys.modules.pop("ggx_t_clibroken", None)


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ggx {ggx.__version__}"


def test_devices_table(capsys):
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    for text in ["tgpu0", "GPU", "tcpu0", "CPU", "fake tgpu0 [v2]", "3.0 / 4.0", "tgpu0_buf", "tgpu0_pinned (host)",
                 "TAMX, TREPACK", "ISA=avx512_vnni", "textra", "loaded",
                 "Failed plugins", "clibroken", "ggx-t-clibroken", "0.7", "libbar.so: cannot open"]:
        assert text in out, text
    # devices in order of preference: the GPU row comes before the CPU row
    assert out.index("tgpu0_buf") < out.index("tcpu0_buf")
    assert "Traceback" not in out


def test_devices_verbose_prints_tracebacks(capsys):
    assert cli.main(["devices", "-v"]) == 0
    out = capsys.readouterr().out
    assert "Traceback" in out and "ggx_t_clibroken.py" in out


def test_devices_json(capsys):
    assert cli.main(["devices", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"plugins", "devices", "failures"}
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["tcpu"]["status"] == "loaded" and plugins["tcpu"]["backend"] == "tcpu"
    assert plugins["clibroken"]["status"] == "failed"
    assert (plugins["clibroken"]["distribution"], plugins["clibroken"]["version"]) == ("ggx-t-clibroken", "0.7")

    devs = report["devices"]
    assert [d["name"] for d in devs][:2] == ["tgpu0", "tcpu0"]
    gpu, cpu = devs[0], devs[1]
    assert gpu["type"] == "GPU" and gpu["memory"] == {"free": 3 * GIB, "total": 4 * GIB}
    assert gpu["buffer_types"][0]["name"] == "tgpu0_buf" and gpu["buffer_types"][0]["is_host"] is True
    assert gpu["host_buffer_type"]["name"] == "tgpu0_pinned"
    assert gpu["extra_buffer_types"] == [] and gpu["features"] is None
    assert [b["name"] for b in cpu["extra_buffer_types"]] == ["TAMX", "TREPACK"]
    assert cpu["features"] == {"ISA": "avx512_vnni"} and cpu["plugin"] == "tcpu" and cpu["errors"] == []

    (failure,) = report["failures"]
    assert failure["name"] == "clibroken" and "libbar.so" in failure["reason"]
    assert "Traceback" in failure["traceback"]


def test_a_device_that_raises_is_reported_not_fatal(capsys):
    registry.register(FakeReg("flaky", [FakeDevice("flaky0", DeviceType.IGPU, memory=None)]))
    assert cli.main(["devices", "--json"]) == 0
    flaky = next(d for d in json.loads(capsys.readouterr().out)["devices"] if d["name"] == "flaky0")
    assert flaky["memory"] is None and flaky["errors"] == ["memory(): RuntimeError: driver went away"]


def test_ggx_error_prints_message_and_exits_2(capsys, monkeypatch):
    def boom(args):
        raise GGXPluginError("the flux capacitor plugin failed")

    mod = types.ModuleType("ggx.commands.boom")
    mod.add_parser = lambda sub: sub.add_parser("boom").set_defaults(func=boom)
    monkeypatch.setitem(sys.modules, "ggx.commands.boom", mod)
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, "boom"))
    assert cli.main(["boom"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == "error: the flux capacitor plugin failed"
    assert "Traceback" not in captured.err


def test_usage_errors_exit_2(capsys):
    assert cli.main([]) == 2
    assert "devices" in capsys.readouterr().out
    assert cli.main(["no-such-command"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_console_script_is_declared():
    (ep,) = importlib_metadata.entry_points(group="console_scripts", name="ggx")
    assert ep.value == "ggx.cli:main" and ep.load() is cli.main
