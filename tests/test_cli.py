"""The `ggx` command through `main([...])`: --version, `ggx devices` tables and --json, how every failure
ends (one `error:` line and its status), option checks, the compile notice."""
from __future__ import annotations

import io
import json
import sys
import time
import types

import importlib_metadata
import pytest

import ggx
from ggx import cli, progress, registry
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

    def prepare_forward(self, op, n_threads=1):
        return None


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
    assert ep.value == "ggx.cli:console" and ep.load() is cli.console


def test_devices_reads_well_at_80_columns(capsys, monkeypatch):
    """At 80 columns no line is wider, and nothing is cut off: long descriptions, feature values
    and failure reasons wrap; only long feature lists are summarized (--json has them whole)."""
    import io
    import re

    from rich.console import Console

    from ggx.commands import devices

    long_desc = "Vendor Accelerator 9000 with a long marketing name (rev B2, 128 compute units, HBM3e)"
    features = {"driver": "vendor-driver 555.42.06 built 2025-01-01 with every option switched on",
                "isa": [f"feature{i}" for i in range(40)]}
    dev = FakeDevice("taccel_with_a_long_name0", DeviceType.ACCEL)
    dev.description = long_desc
    registry.register(FakeReg("tlongreg", [dev], features=features))
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["devices"]) == 0
    via_cli = capsys.readouterr().out
    buf = io.StringIO()
    devices.render(devices.collect(), False, Console(file=buf, width=80, highlight=False))
    for out in (via_cli, buf.getvalue()):
        lines = out.splitlines()
        assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
        assert "…" not in out
        words = " ".join(re.sub(r"[│┃]", " ", out).split())
        for text in [long_desc, "driver=vendor-driver 555.42.06 built 2025-01-01 with every option switched on",
                     "isa=[40 items]", "taccel_with_a_long_name0", "TAMX, TREPACK", "ISA=avx512_vnni",
                     "tgpu0_pinned (host)", "3.0 / 4.0 GiB free / total", "clibroken", "ggx-t-clibroken",
                     "libbar.so: cannot open"]:
            assert text in words, text
    assert via_cli.index("taccel_with_a_long_name0") < via_cli.index("tcpu0")  # accelerators first


def _command(monkeypatch, func, name: str = "boom") -> None:
    """Install a subcommand `name` running `func(args)`."""
    mod = types.ModuleType(f"ggx.commands.{name}")
    mod.add_parser = lambda sub: sub.add_parser(name).set_defaults(func=func)
    monkeypatch.setitem(sys.modules, f"ggx.commands.{name}", mod)
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, name))


def _raise(exc):
    def func(args):
        raise exc
    return func


def test_an_unexpected_exception_is_one_error_line_with_a_hint(capsys, monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    _command(monkeypatch, _raise(ZeroDivisionError("division by zero")))
    assert cli.main(["boom"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unexpected ZeroDivisionError: division by zero")
    assert "--debug" in err and cli.DEBUG_ENV in err and "report" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("how", [["--debug", "boom"], ["boom", "--debug"], ["boom"]])
def test_debug_prints_the_traceback_first(capsys, monkeypatch, how):
    if how == ["boom"]:
        monkeypatch.setenv(cli.DEBUG_ENV, "1")
    else:
        monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    _command(monkeypatch, _raise(KeyError("nope")))
    assert cli.main(how) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "KeyError" in err
    assert err.strip().splitlines()[-1].startswith("error: unexpected KeyError")


def test_os_error_interrupt_and_broken_pipe(capsys, monkeypatch):
    _command(monkeypatch, _raise(FileNotFoundError(2, "No such file or directory", "missing/x.dot")))
    assert cli.main(["boom"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == "error: missing/x.dot: No such file or directory\n"

    _command(monkeypatch, _raise(KeyboardInterrupt()), "stop")
    assert cli.main(["stop"]) == cli.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted\n"

    _command(monkeypatch, _raise(BrokenPipeError(32, "Broken pipe")), "pipe")
    assert cli.main(["pipe"]) == cli.EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""


def test_stdout_escapes_what_its_encoding_cannot_take(monkeypatch):
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="latin-1"))
    _command(monkeypatch, lambda args: print("wrote \udcff.dot \u2192 ok"))
    assert cli.main(["boom"]) == 0
    sys.stdout.flush()
    assert raw.getvalue() == b"wrote \\udcff.dot \\u2192 ok\n"


@pytest.mark.parametrize("argv, message", [
    (["run", "--temp", "nan"], "argument --temp: must be a finite number"),
    (["run", "--temp", "inf"], "argument --temp: must be a finite number"),
    (["run", "--temp", "-0.5"], "argument --temp: must be in [0, inf)"),
    (["run", "-t", "0"], "argument -t/--threads: must be at least 1, got 0"),
    (["run", "-t", "-3"], "argument -t/--threads: must be at least 1, got -3"),
    (["run", "-t", "two"], "argument -t/--threads: expected an integer"),
    (["run", "-c", "0"], "argument -c/--ctx-size: must be at least 1, got 0"),
    (["run", "-n", "-5"], "argument -n/--n-predict: must be at least -1 (-1: until the context is full), got -5"),
    (["run", "--top-k", "-1"], "argument --top-k: must be at least 0"),
    (["run", "--top-p", "1.5"], "argument --top-p: must be in [0, 1]"),
    (["run", "--top-p", "nan"], "argument --top-p: must be a finite number"),
    (["run", "--seed", "-1"], "argument --seed: must be at least 0"),
    (["run", "-p", "caf\udcc3("], "argument -p/--prompt: is not valid UTF-8 (byte 0xc3 at byte 3)"),
    (["bench", "-t", "0"], "argument -t/--threads: every value must be at least 1, got 0"),
    (["bench", "-t", "1,x"], "argument -t/--threads: expected comma-separated integers"),
    (["bench", "-p", "-1"], "argument -p/--n-prompt: every value must be at least 0"),
    (["bench", "-r", "0"], "argument -r/--repetitions: must be at least 1"),
    (["compile", "-t", "0"], "argument -t/--threads: every value must be at least 1"),
    (["graph", "--layers", "0"], "argument --layers: must be at least 1"),
    (["graph", "--tokens", "-2"], "argument --tokens: must be at least 1"),
    (["graph", "-o", "missing-dir/x.dot"], "argument -o/--output: directory missing-dir does not exist"),
    (["test-ops", "--min-time", "0"], "argument --min-time: must be in (0, inf)"),
    (["test-ops", "--min-time", "nan"], "argument --min-time: must be a finite number"),
    (["new-plugin", "mydev", "--dir", "missing-dir"], "argument --dir: directory missing-dir does not exist"),
])
def test_bad_option_values_are_usage_errors(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"ggx {argv[0]}: error: {message}" or (err[-1].startswith(f"ggx {argv[0]}: error: {message}"))
    assert not any("Traceback" in line for line in err)


def test_output_into_a_directory_is_refused(capsys, tmp_path):
    assert cli.main(["graph", "-o", str(tmp_path)]) == cli.EXIT_USAGE
    assert "is a directory; give a file name" in capsys.readouterr().err


def test_compile_notice_waits_then_says_it_once():
    out = io.StringIO()
    notice = cli.CompileNotice(out, delay=0.05)
    previous = progress.set_listener(notice)
    try:
        with progress.compiling("CPU kernels for avx2"):
            pass  # a cache load: over before the delay, nothing said
        assert out.getvalue() == ""
        with progress.compiling("CPU kernels for avx2"):
            time.sleep(0.2)
        with progress.compiling("CPU kernels for avx2"):
            time.sleep(0.1)
    finally:
        progress.set_listener(previous)
    assert out.getvalue() == "compiling CPU kernels for avx2, first run only\n"
    assert notice.seconds >= 0.3


def test_main_installs_the_notice_only_while_a_command_runs(monkeypatch):
    seen = []
    _command(monkeypatch, lambda args: seen.append(progress.set_listener(None)))
    before = progress.set_listener(None)
    progress.set_listener(before)
    assert cli.main(["boom"]) == 0
    assert isinstance(seen[0], cli.CompileNotice)
    assert progress.set_listener(before) is before


@pytest.mark.parametrize("argv, status", [(["--version"], 0), (["bench", "--bogus"], 2), (["devices", "--json"], 0)])
def test_the_executable_ends_with_mains_status_and_its_output_flushed(argv, status):
    """`cli.console` (the `ggx` executable) skips the interpreter's teardown: the status is
    main's and what was printed arrives whole through a pipe."""
    import subprocess

    code = "from ggx import cli; cli.console()"
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == status, out.stderr[-2000:]
    if argv == ["devices", "--json"]:
        assert json.loads(out.stdout)["ggx_version"] == ggx.__version__
    elif argv == ["--version"]:
        assert out.stdout.strip() == f"ggx {ggx.__version__}"
    else:
        assert "unrecognized arguments: --bogus" in out.stderr
