"""Plugin discovery through real entry points, failure isolation, env controls, device order.

Each test writes small plugin modules and their distributions' metadata (`*.dist-info` with
METADATA and entry_points.txt) into tmp_path and puts it on sys.path: importlib-metadata finds
them exactly as it finds an installed package. The built-in reference backend is replaced by a
fake `ggx.reference` module so the tests do not depend on it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from ggx import registry
from ggx.backend import API_VERSION, BackendReg, DeviceType
from ggx.errors import GGXPluginError
from ggx.hookspecs import hookimpl

# Shared by every fake plugin (imported by them as ggx_t_fakes).
FAKES = """
from ggx.backend import API_VERSION, BackendReg, Device, DeviceType, ExtraBufferType
from ggx.host import HostBufferType


class FakeDevice(Device):
    def __init__(self, name, type=DeviceType.CPU):
        self.name = name
        self.type = type
        self.description = "fake " + name
        self._buft = HostBufferType(self, name=name + "_buft")

    def memory(self):
        return (1 << 30, 2 << 30)

    def init_backend(self, **params):
        raise NotImplementedError

    def buffer_type(self):
        return self._buft

    def supports_op(self, op):
        return False


class FakeReg(BackendReg):
    def __init__(self, name, devices, api_version=API_VERSION, features=None):
        self.name = name
        self.version = "9.9"
        self.api_version = api_version
        self._devices = devices
        self._features = features

    def devices(self):
        return self._devices

    def get_proc_address(self, name):
        if name == "get_features" and self._features is not None:
            return lambda: self._features
        return None


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
"""

HEADER = f"from ggx.hookspecs import hookimpl\nfrom ggx_t_fakes import *\nGGX_API_VERSION = {API_VERSION}\n"

# entry-point name: (distribution, version, module source)
PLUGINS = {
    "good": ("ggx-t-good", "1.2.3", HEADER + """
@hookimpl
def ggx_backend_reg():
    return FakeReg("good", [FakeDevice("good_cpu"), FakeDevice("good_gpu", DeviceType.GPU)],
                   features={"ISA": "fake512"})

@hookimpl
def ggx_extra_buffer_types(device):
    return [(20, FakeExtra("REPACK"))] if device.type == DeviceType.CPU else None
"""),
    "tamx": ("ggx-t-amx", "0.3", HEADER + """
@hookimpl
def ggx_extra_buffer_types(device):
    return [(10, FakeExtra("AMX"))] if device.type == DeviceType.CPU else []
"""),
    "broken": ("ggx-t-broken", "0.1", "raise ImportError('libfoo.so: cannot open shared object file')\n"),
    "raises": ("ggx-t-raises", "2.0", HEADER + """
@hookimpl
def ggx_backend_reg():
    raise RuntimeError("probe failed")
"""),
    "wrongtype": ("ggx-t-wrongtype", "0.0.1", HEADER + """
@hookimpl
def ggx_backend_reg():
    return "not a reg"
"""),
    # an extra-buffer-type plugin (no reg) built against the next core
    "newapi": ("ggx-t-newapi", "0.6", HEADER + f"""
GGX_API_VERSION = {API_VERSION + 1}

@hookimpl
def ggx_extra_buffer_types(device):
    return [(5, FakeExtra("NEWER"))]
"""),
    "noapi": ("ggx-t-noapi", "0.7", "from ggx.hookspecs import hookimpl\nfrom ggx_t_fakes import *\n" + """
@hookimpl
def ggx_extra_buffer_types(device):
    return [(5, FakeExtra("UNSTATED"))]
"""),
    "oldapi": ("ggx-t-oldapi", "0.5", HEADER + f"""
@hookimpl
def ggx_backend_reg():
    return FakeReg("OLD", [FakeDevice("OLD0")], api_version={API_VERSION + 41})
"""),
}
ALL = ",".join(PLUGINS)


def write_plugins(root: Path, plugins: dict[str, tuple[str, str, str]]) -> None:
    """Write each plugin's module and its distribution's dist-info into `root`."""
    (root / "ggx_t_fakes.py").write_text(FAKES)
    for ep, (dist, version, source) in plugins.items():
        module = f"ggx_t_{ep}"
        (root / f"{module}.py").write_text(source)
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[ggx.plugins]\n{ep} = {module}\n")


def fake_reference() -> types.ModuleType:
    from ggx_t_fakes import FakeDevice, FakeReg

    mod = types.ModuleType("ggx.reference")

    class RefBackendReg(FakeReg):
        def __init__(self):
            super().__init__("ref", [FakeDevice("ref")])

    mod.RefBackendReg = RefBackendReg
    return mod


def drop_test_modules() -> None:
    for name in [m for m in sys.modules if m.startswith("ggx_t_")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def plugin_env(tmp_path, monkeypatch):
    """Test plugins on sys.path, only they allowed (other installed plugins stay unloaded)."""
    write_plugins(tmp_path, PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    for var in ("GGX_PLUGIN_AUTOLOAD", "GGX_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GGX_PLUGINS", ALL)
    drop_test_modules()
    monkeypatch.setitem(sys.modules, "ggx.reference", fake_reference())
    registry.reset()
    yield tmp_path
    registry.reset()
    drop_test_modules()


def by_name(items, name):
    found = [x for x in items if x.name == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def names(devs) -> list[str]:
    return [d.name for d in devs]


# --------------------------------------------------------------------------------------------
def test_good_plugin_loads_through_its_entry_point():
    info = by_name(registry.plugins(), "good")
    assert (info.distribution, info.version, info.status, info.source) == ("ggx-t-good", "1.2.3", "loaded",
                                                                           registry.ENTRY_POINT)
    assert info.reg is not None and info.reg.name == "good"
    assert info.reg in registry.backend_regs()
    dev = registry.get_device("GOOD_CPU")  # case-insensitive
    assert dev.name == "good_cpu" and registry.reg_of(dev) is info.reg
    assert dev.reg is None  # the registry keeps its own mapping: plugin objects are not modified
    amx = by_name(registry.plugins(), "tamx")
    assert amx.status == "loaded" and amx.reg is None  # extra-buffer-type-only plugin


FAILURES = {
    "broken": ["import of 'ggx_t_broken' failed", "ImportError", "libfoo.so: cannot open shared object file"],
    "raises": ["ggx_backend_reg() raised RuntimeError: probe failed"],
    "wrongtype": ["ggx_backend_reg() returned builtins.str", "expected a ggx.backend.BackendReg"],
    "oldapi": [f"API version {API_VERSION + 41}", f"this core has API version {API_VERSION}"],
    "newapi": [f"was built against ggx core API version {API_VERSION + 1}",
               f"this core has API version {API_VERSION}"],
    "noapi": ["states no API version (GGX_API_VERSION", f"this core has API version {API_VERSION}"],
}


@pytest.mark.parametrize("bad", sorted(FAILURES))
def test_each_failure_is_recorded_and_isolated(bad, monkeypatch):
    monkeypatch.setenv("GGX_PLUGINS", f"good,{bad}")
    (failure,) = registry.failures()
    dist, version, _ = PLUGINS[bad]
    assert (failure.name, failure.distribution, failure.version) == (bad, dist, version)
    for part in FAILURES[bad]:
        assert part in failure.reason
    if bad in ("broken", "raises"):
        assert "Traceback" in failure.traceback and f"ggx_t_{bad}.py" in failure.traceback
    info = by_name(registry.plugins(), bad)
    assert info.status == "failed" and info.reason == failure.reason and info.reg is None
    # the good plugin still loaded, and the failed one contributed no device
    assert by_name(registry.plugins(), "good").status == "loaded"
    assert names(registry.devices()) == ["good_gpu", "good_cpu", "ref"]


def test_all_failures_at_once_leave_the_good_plugin_working():
    assert sorted(f.name for f in registry.failures()) == sorted(FAILURES)
    # plugins installed in the environment (ggx-cpu, ...) are listed as disabled by GGX_PLUGINS
    statuses = {p.name: p.status for p in registry.plugins() if p.status != "disabled"}
    assert statuses == {
        "good": "loaded", "tamx": "loaded", "broken": "failed", "raises": "failed", "wrongtype": "failed",
        "oldapi": "failed", "newapi": "failed", "noapi": "failed", "ref": "loaded"}


@pytest.mark.parametrize("asked, expected", [
    ("broken", "libfoo.so"),  # entry-point name
    ("ggx-t-raises", "probe failed"),  # distribution name
    ("wrongtype0", "builtins.str"),  # plugin name + device index
    ("old0", f"API version {API_VERSION + 41}"),  # the failed reg's own device naming
])
def test_get_device_of_a_failed_plugin_raises_its_reason(asked, expected):
    with pytest.raises(GGXPluginError, match="failed to load") as err:
        registry.get_device(asked)
    assert expected in str(err.value)


def test_get_device_unknown_lists_known_devices():
    with pytest.raises(GGXPluginError, match="no device named 'nope'") as err:
        registry.get_device("nope")
    assert "good_gpu, good_cpu, ref" in str(err.value)


def test_autoload_off_loads_no_entry_point(monkeypatch):
    monkeypatch.setenv("GGX_PLUGIN_AUTOLOAD", "0")
    assert names(registry.devices()) == ["ref"]
    assert not [m for m in sys.modules if m.startswith("ggx_t_") and m != "ggx_t_fakes"]
    info = by_name(registry.plugins(), "good")
    assert info.status == "disabled" and "GGX_PLUGIN_AUTOLOAD=0" in info.reason
    assert registry.failures() == []
    with pytest.raises(GGXPluginError, match="is disabled: GGX_PLUGIN_AUTOLOAD=0"):
        registry.get_device("good_cpu")


def test_allow_list_by_distribution_name(monkeypatch):
    monkeypatch.setenv("GGX_PLUGINS", "GGX_T.Good")  # normalized like a distribution name
    assert names(registry.devices()) == ["good_gpu", "good_cpu", "ref"]
    statuses = {p.name: p.status for p in registry.plugins()}
    assert statuses["good"] == "loaded"
    assert all(statuses[n] == "disabled" for n in PLUGINS if n != "good")
    assert "ggx_t_broken" not in sys.modules and "ggx_t_raises" not in sys.modules
    assert by_name(registry.plugins(), "tamx").reason == "not listed in GGX_PLUGINS"


def test_disable_list_and_force_reload(monkeypatch):
    monkeypatch.setenv("GGX_DISABLE_PLUGINS", "ggx-t-good, raises")
    statuses = {p.name: p.status for p in registry.plugins()}
    assert statuses["good"] == "disabled" and statuses["raises"] == "disabled" and statuses["tamx"] == "loaded"
    assert "ggx_t_raises" not in sys.modules
    assert names(registry.devices()) == ["ref"]
    # env vars are read at load time: a forced reload sees the change
    monkeypatch.delenv("GGX_DISABLE_PLUGINS")
    assert names(registry.devices()) == ["ref"]
    registry.load_plugins(force=True)
    assert names(registry.devices()) == ["good_gpu", "good_cpu", "ref"]
    assert sorted(f.name for f in registry.failures()) == sorted(FAILURES)  # not duplicated by the reload


def test_loading_is_lazy_in_process():
    import ggx

    assert "ggx_t_good" not in sys.modules
    assert names(ggx.devices()) == ["good_gpu", "good_cpu", "ref"]
    assert "ggx_t_good" in sys.modules


def test_import_ggx_loads_no_plugin(plugin_env):
    code = textwrap.dedent("""
        import sys
        import ggx
        assert "ggx_t_good" not in sys.modules, "import ggx loaded a plugin"
        from ggx import registry
        assert "ggx_t_good" not in sys.modules, "importing the registry loaded a plugin"
        registry.plugins()
        assert "ggx_t_good" in sys.modules
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_env), *sys.path]), GGX_PLUGINS="good")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def fake_reg(name, *devs, **kw):
    from ggx_t_fakes import FakeDevice, FakeReg

    return FakeReg(name, [FakeDevice(n, t) for n, t in devs], **kw)


def test_device_order_gpu_accel_igpu_cpu_ref_last():
    registry.register(fake_reg("mine", ("ip_cpu", DeviceType.CPU), ("ip_igpu", DeviceType.IGPU),
                               ("ip_accel", DeviceType.ACCEL), ("ip_gpu", DeviceType.GPU)))
    assert names(registry.devices()) == ["ip_gpu", "good_gpu", "ip_accel", "ip_igpu", "ip_cpu", "good_cpu", "ref"]
    assert registry.default_device().name == "ip_gpu"
    assert [r.name for r in registry.backend_regs()] == ["mine", "good", "ref"]


def test_reference_backend_is_a_builtin_listed_last(monkeypatch):
    monkeypatch.setenv("GGX_PLUGIN_AUTOLOAD", "0")
    registry.register(fake_reg("cpu2", ("cpu2", DeviceType.CPU)))
    assert names(registry.devices()) == ["cpu2", "ref"]
    ref = by_name(registry.plugins(), "ref")
    assert (ref.distribution, ref.source, ref.status) == ("ggx", registry.BUILTIN, "loaded")


def test_extra_buffer_types_in_priority_order():
    from ggx_t_fakes import FakeExtra

    class Mine:
        @hookimpl
        def ggx_extra_buffer_types(self, device):
            return [(20, FakeExtra("LATE")), (15, FakeExtra("MID"))]

    registry.register(Mine(), name="mine")
    cpu, gpu = registry.get_device("good_cpu"), registry.get_device("good_gpu")
    # ascending priority; ties keep plugin order (in-process before entry points)
    assert names(registry.extra_buffer_types(cpu)) == ["AMX", "MID", "LATE", "REPACK"]
    assert names(registry.extra_buffer_types(gpu)) == ["MID", "LATE"]
    reg = registry.reg_of(cpu)
    assert reg.get_proc_address("get_features")() == {"ISA": "fake512"}
    assert reg.get_proc_address("no_such_thing") is None


def test_dev_get_extra_bufts_answers_the_engine_s_merge():
    """BackendReg's default get_proc_address answers ggml's "dev_get_extra_bufts" with
    `registry.extra_buffer_types(device)`: the device's own extra buffer types (read every time),
    then the plugins' by priority, each once; the registry does not replace the reg's method."""
    from ggx_t_fakes import FakeDevice, FakeExtra, FakeReg

    own = [FakeExtra("OWN")]
    shared = FakeExtra("SHARED")

    class ExtraDevice(FakeDevice):
        def extra_buffer_types(self):
            return list(own)

    class PlainReg(FakeReg):
        def get_proc_address(self, name):
            return super().get_proc_address(name) or BackendReg.get_proc_address(self, name)

    class Mine:
        @hookimpl
        def ggx_extra_buffer_types(self, device):
            return [(5, FakeExtra("FIRST")), (6, shared)] if device.name == "xdev" else None

    reg = PlainReg("xreg", [ExtraDevice("xdev"), FakeDevice("ydev")])
    own_method = reg.get_proc_address
    registry.register(reg)
    registry.register(Mine(), name="mine")
    xdev, ydev = registry.get_device("xdev"), registry.get_device("ydev")
    assert reg.get_proc_address == own_method and "get_proc_address" not in vars(reg)
    get = reg.get_proc_address("dev_get_extra_bufts")
    assert names(get(xdev)) == ["OWN", "FIRST", "SHARED", "AMX", "REPACK"] == names(registry.extra_buffer_types(xdev))
    assert names(get(ydev)) == ["AMX", "REPACK"]  # no own types (Device's default): the plugins' only
    own.append(shared)  # the device's own list is read every time; a type it shares is listed once
    assert names(get(xdev)) == ["OWN", "SHARED", "FIRST", "AMX", "REPACK"]


@pytest.mark.parametrize("answer, reason", [
    ("raise ValueError('bad device')", "raised ValueError: bad device"),
    ("return 'REPACK'", "returned str"),
    ("return [(1.5, None)]", "expected (int priority, ggx.backend.ExtraBufferType)"),
])
def test_extra_buffer_type_hook_failure_is_recorded(answer, reason, monkeypatch):
    monkeypatch.setenv("GGX_PLUGINS", "good,tamx")
    ns: dict = {}
    exec(f"def ggx_extra_buffer_types(device):\n    {answer}\n", ns)
    mod = types.ModuleType("bad_extra")
    mod.ggx_extra_buffer_types = hookimpl(ns["ggx_extra_buffer_types"])
    registry.register(mod)
    cpu = registry.get_device("good_cpu")
    assert names(registry.extra_buffer_types(cpu)) == ["AMX", "REPACK"]
    (failure,) = registry.failures()
    assert failure.name == "bad_extra" and reason in failure.reason and "good_cpu" in failure.reason
    assert by_name(registry.plugins(), "bad_extra").status == "failed"


def test_register_a_reg_directly_and_unregister():
    info = registry.register(fake_reg("nb", ("nb0", DeviceType.CPU)))
    assert (info.name, info.status, info.source, info.version) == ("nb", "loaded", registry.IN_PROCESS, "9.9")
    assert registry.reg_of(registry.get_device("nb0")).name == "nb"
    with pytest.raises(GGXPluginError, match="the name is already taken by plugin 'nb' \\(in-process\\)"):
        registry.register(fake_reg("nb", ("other", DeviceType.CPU)))
    registry.unregister("nb")
    assert "nb0" not in names(registry.devices())
    with pytest.raises(GGXPluginError, match="no plugin named 'nb'"):
        registry.unregister("nb")


def test_register_failures_raise_at_once():
    with pytest.raises(GGXPluginError, match=f"API version {API_VERSION + 1}.*API version {API_VERSION}"):
        registry.register(fake_reg("future", ("f0", DeviceType.CPU), api_version=API_VERSION + 1))

    class Stale:  # a plugin object built against an older core: refused before any hook runs
        GGX_API_VERSION = API_VERSION - 1
        called = False

        @hookimpl
        def ggx_extra_buffer_types(self, device):
            Stale.called = True
            return None

    with pytest.raises(GGXPluginError, match=f"built against ggx core API version {API_VERSION - 1}, "
                                             f"this core has API version {API_VERSION}"):
        registry.register(Stale(), name="stale")
    registry.devices()
    assert "stale" not in [p.name for p in registry.plugins()] and not Stale.called

    class Typo:
        @hookimpl
        def ggx_backend_regs(self):  # misspelled hook: would silently do nothing
            return None

    with pytest.raises(GGXPluginError, match="unknown hook.*ggx_backend_regs"):
        registry.register(Typo(), name="typo")
    assert [p.name for p in registry.plugins() if p.source == registry.IN_PROCESS] == []
    assert "typo" not in {f.name for f in registry.failures()}


def test_entry_point_name_taken_in_process_is_a_failure():
    registry.register(fake_reg("x", ("x0", DeviceType.CPU)), name="good")
    failure = by_name(registry.failures(), "good")
    assert failure.distribution == "ggx-t-good" and "already taken" in failure.reason
    assert "good_cpu" not in names(registry.devices())


def test_real_reference_backend_is_always_registered(monkeypatch):
    monkeypatch.delitem(sys.modules, "ggx.reference")
    monkeypatch.setenv("GGX_PLUGIN_AUTOLOAD", "0")
    ref = by_name(registry.plugins(), "ref")
    assert ref.source == registry.BUILTIN and ref.distribution == "ggx"
    if ref.status == "loaded":
        assert registry.devices()[-1].name == "ref"
    else:  # while ggx.reference is not there yet: recorded, with its reason
        assert "reference backend" in by_name(registry.failures(), "ref").reason


# --- names: unique across every path; the built-in keeps its own ------------------------------
def add_dist(root: Path, ep: str, dist: str, module: str, source: str, version: str = "1.0") -> None:
    """One more distribution with one entry point `ep` -> `module` (written with `source`)."""
    (root / f"{module}.py").write_text(HEADER + source)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[ggx.plugins]\n{ep} = {module}\n")


def reg_hook(reg: str, *devices: str) -> str:
    listed = ", ".join(f"FakeDevice({d!r})" for d in devices)
    return f"@hookimpl\ndef ggx_backend_reg():\n    return FakeReg({reg!r}, [{listed}])\n"


def test_a_plugin_named_like_the_builtin_fails_and_the_builtin_stays(plugin_env, monkeypatch):
    # what `ggx new-plugin ref` would have installed: plugin "ref", device "ref"
    add_dist(plugin_env, "ref", "ggx-ref", "ggx_t_scaffold_ref", reg_hook("ref", "ref"))
    monkeypatch.setenv("GGX_PLUGINS", "good,ref")
    ref = by_name(registry.plugins(), "ref")
    assert (ref.source, ref.status, ref.distribution) == (registry.BUILTIN, "loaded", "ggx")
    assert names(registry.devices()) == ["good_gpu", "good_cpu", "ref"]
    assert registry.device_plugin(registry.get_device("ref")).source == registry.BUILTIN
    (failure,) = registry.failures()
    assert (failure.name, failure.distribution, failure.version) == ("ref", "ggx-ref", "1.0")
    assert "plugin name 'ref' is already taken by plugin 'ref' (ggx " in failure.reason
    assert "built-in" in failure.reason


def test_a_device_named_like_the_builtins_fails_its_plugin(plugin_env, monkeypatch):
    add_dist(plugin_env, "myref", "ggx-myref", "ggx_t_myref", reg_hook("myref", "myref0", "REF"))
    monkeypatch.setenv("GGX_PLUGINS", "myref")
    (failure,) = registry.failures()
    assert failure.name == "myref" and failure.distribution == "ggx-myref"
    assert "device name 'REF' is already taken by plugin 'ref' (ggx " in failure.reason
    assert names(registry.devices()) == ["ref"]  # the colliding plugin's other device is gone too
    with pytest.raises(GGXPluginError, match="myref.*failed to load.*'REF' is already taken"):
        registry.get_device("myref0")


def test_two_plugins_with_one_device_name_the_later_fails_naming_both(plugin_env, monkeypatch):
    add_dist(plugin_env, "acpu", "ggx-t-acpu", "ggx_t_acpu", reg_hook("acpu", "CPU"))
    add_dist(plugin_env, "bcpu", "ggx-t-bcpu", "ggx_t_bcpu", reg_hook("bcpu", "bcpu0", "cpu"))
    monkeypatch.setenv("GGX_PLUGINS", "acpu,bcpu")
    (failure,) = registry.failures()
    assert (failure.name, failure.distribution) == ("bcpu", "ggx-t-bcpu")  # entry points load by name
    assert "device name 'cpu' is already taken by plugin 'acpu' (ggx-t-acpu 1.0, entry point)" in failure.reason
    assert registry.reg_of(registry.get_device("CPU")).name == "acpu"
    assert names(registry.devices()) == ["CPU", "ref"]


def test_two_distributions_with_one_entry_point_name(plugin_env, monkeypatch):
    add_dist(plugin_env, "dup", "ggx-t-dup-a", "ggx_t_dup_a", reg_hook("dupa", "dupa0"))
    add_dist(plugin_env, "Dup", "ggx-t-dup-b", "ggx_t_dup_b", reg_hook("dupb", "dupb0"))
    monkeypatch.setenv("GGX_PLUGINS", "dup")
    (failure,) = registry.failures()
    assert (failure.name, failure.distribution) == ("dup", "ggx-t-dup-a")  # "Dup" sorts first
    assert "plugin name 'dup' is already taken by plugin 'Dup' (ggx-t-dup-b 1.0, entry point)" in failure.reason
    assert names(registry.devices()) == ["dupb0", "ref"]
    registry.load_plugins(force=True)
    assert len(registry.failures()) == 1  # a reload does not record it twice


def test_in_process_names_are_checked_against_the_builtin_and_loaded_plugins():
    with pytest.raises(GGXPluginError, match=r"cannot register plugin 'ref'.*taken by plugin 'ref' \(ggx .*built-in\)"):
        registry.register(fake_reg("ref", ("r0", DeviceType.CPU)))
    with pytest.raises(GGXPluginError, match="device name 'Ref' is already taken by plugin 'ref'"):
        registry.register(fake_reg("mine", ("Ref", DeviceType.CPU)))
    registry.load_plugins()
    with pytest.raises(GGXPluginError, match="device name 'good_gpu' is already taken by plugin 'good' "
                                             r"\(ggx-t-good 1.2.3, entry point\)"):
        registry.register(fake_reg("mine", ("good_gpu", DeviceType.GPU)))
    with pytest.raises(GGXPluginError, match="taken by plugin 'good'"):
        registry.register(fake_reg("x", ("x0", DeviceType.CPU)), name="Good")  # names compare normalized
    with pytest.raises(GGXPluginError, match="lists device 'TWIN' twice"):
        registry.register(fake_reg("twins", ("twin", DeviceType.CPU), ("TWIN", DeviceType.CPU)))
    assert names(registry.devices()) == ["good_gpu", "good_cpu", "ref"]
    assert registry.reg_of(registry.get_device("ref")).name == "ref"


def test_in_process_device_registered_before_loading_keeps_its_name():
    registry.register(fake_reg("early", ("good_cpu", DeviceType.CPU)))
    failure = by_name(registry.failures(), "good")
    assert "device name 'good_cpu' is already taken by plugin 'early' (in-process)" in failure.reason
    assert registry.reg_of(registry.get_device("good_cpu")).name == "early"


def test_registry_loads_once_from_many_threads(monkeypatch):
    """Eight threads asking at once see one load: the same devices, each failure recorded once."""
    import threading

    n = 8
    barrier = threading.Barrier(n)
    seen: list[list] = []

    def ask():
        barrier.wait()
        seen.append(registry.devices())

    threads = [threading.Thread(target=ask) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == n and all([id(d) for d in s] == [id(d) for d in seen[0]] for s in seen)
    assert names(seen[0]) == ["good_gpu", "good_cpu", "ref"]
    assert sorted(f.name for f in registry.failures()) == sorted(FAILURES)
