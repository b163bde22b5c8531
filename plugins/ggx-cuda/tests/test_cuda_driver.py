"""driver.py's rules that need no GPU."""
from __future__ import annotations

import pytest

from ggx_cuda import driver as driver_module
from ggx_cuda.driver import driver_runs, no_driver_library


@pytest.mark.parametrize("driver, runtime, runs", [
    (13000, 13020, True),   # an older minor version of the same major: CUDA's minor version compatibility
    (13020, 13020, True),
    (13000, 12080, True),   # a newer driver runs older runtimes
    (12080, 13000, False),  # an older major version does not
])
def test_driver_runs(driver, runtime, runs):
    assert driver_runs(driver, runtime) is runs


def test_no_driver_library_is_found_without_importing_cupy(monkeypatch):
    """Where libcuda.so.1 cannot be loaded (or CuPy is not there) the probe says why without
    importing CuPy; where it loads, CuPy decides."""
    import ctypes
    import importlib.util

    def no_lib(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(driver_module.sys, "platform", "linux")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    assert no_driver_library() == "no CUDA driver: libcuda.so.1 cannot be loaded"
    assert driver_module.CupyDriver().probe() == ([], "no CUDA driver: libcuda.so.1 cannot be loaded")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())
    assert no_driver_library() == ""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert no_driver_library().startswith("CuPy is not installed")
    monkeypatch.setattr(driver_module.sys, "platform", "win32")
    assert no_driver_library() == ""


# --- CupyDriver over a stand-in for CuPy: what runs with which device current ---------------------
class _FakeCupy:
    """The few CuPy calls CupyDriver makes, recording the current device at each."""

    def __init__(self):
        import types

        self.current, self.log, self._ptr = 0, [], 0x1000
        fake = self

        class Device:
            def __init__(self, i):
                self.i = i

            def __enter__(self):
                self.prev, fake.current = fake.current, self.i

            def __exit__(self, *exc):
                fake.current = self.prev

        class Stream:
            def __init__(self, non_blocking=False):
                fake._ptr += 16
                self.ptr = fake._ptr

        class RawKernel:
            def __init__(self, name):
                self.name = name

            @property
            def max_dynamic_shared_size_bytes(self):
                return 0

            @max_dynamic_shared_size_bytes.setter
            def max_dynamic_shared_size_bytes(self, value):
                fake.log.append(("opt-in", self.name, fake.current, value))

            def __call__(self, grid, block, args, shared_mem=0, stream=None):
                fake.log.append(("launch", self.name, fake.current, stream.ptr))

        class RawModule:
            def __init__(self, code, options, name_expressions):
                fake.log.append(("compile", fake.current))

            def get_function(self, name):
                return RawKernel(name)

        def memcpy(dst, src, size, kind, stream):
            fake.log.append(("copy", fake.current, stream))

        runtime = types.SimpleNamespace(memcpyAsync=memcpy, memcpyHostToDevice=1, memcpyDeviceToHost=2,
                                        memcpyDeviceToDevice=3)
        self.cuda = types.SimpleNamespace(Device=Device, Stream=Stream, runtime=runtime,
                                          device=types.SimpleNamespace(get_cublas_handle=lambda: f"h{fake.current}"))
        self.RawModule = RawModule
        self.cublas = types.SimpleNamespace(
            CUBLAS_OP_T=1, CUBLAS_OP_N=0, CUBLAS_COMPUTE_32F=68, CUBLAS_GEMM_DEFAULT=-1, CUBLAS_POINTER_MODE_HOST=0,
            setStream=lambda h, s: fake.log.append(("cublas stream", h, s)),
            setPointerMode=lambda h, m: fake.log.append(("cublas pointer mode", h, m)),
            gemmStridedBatchedEx=lambda h, *a: fake.log.append(("gemm", h, fake.current)))


def test_cupy_driver_runs_each_stream_on_its_own_device(monkeypatch):
    import cupy_backends.cuda.libs as libs
    import numpy as np

    from ggx_cuda.driver import CupyDriver, GemmLaunch, KernelLaunch
    from ggx_cuda.ops import fattn

    cp = _FakeCupy()
    monkeypatch.setattr(CupyDriver, "_cupy", staticmethod(lambda: cp))
    monkeypatch.setitem(vars(libs), "cublas", cp.cublas)  # not imported: no cuBLAS library here
    drv = CupyDriver()
    s0, s1 = drv.stream(0), drv.stream(1)
    assert (drv.device_of(s0), drv.device_of(s1)) == (0, 1)
    big = KernelLaunch(fattn.COMBINE_KERNEL, (1, 1, 1), (128, 1, 1), (), 60000)  # past the 48 KiB default
    for s in (s0, s1, s1, s0):
        drv.run(s, None, [big])
    launches = [e for e in cp.log if e[0] in ("launch", "opt-in")]
    name = fattn.COMBINE_KERNEL.name
    assert launches == [("opt-in", name, 0, 60000), ("launch", name, 0, s0.ptr),
                        ("opt-in", name, 1, 60000), ("launch", name, 1, s1.ptr),  # the second GPU opts in too
                        ("launch", name, 1, s1.ptr), ("launch", name, 0, s0.ptr)]
    assert sum(e[0] == "compile" for e in cp.log) == 1  # one RawKernel per kernel, not one per launch
    drv.copy_d2d(s1, 0x10, 0x20, 8)
    drv.copy_h2d(s0, 0x10, np.zeros(8, np.uint8))
    assert [e for e in cp.log if e[0] == "copy"] == [("copy", 1, s1.ptr), ("copy", 0, s0.ptr)]
    g = GemmLaunch(a=0x10, b=0x20, c=0x30, m=4, n=4, k=4, lda=4, ldb=4, ldc=4)
    drv.run(s1, None, [g])
    assert cp.log[-3:] == [("cublas stream", "h1", s1.ptr), ("cublas pointer mode", "h1", 0), ("gemm", "h1", 1)]
    assert cp.current == 0  # every device switch was undone


def test_cupys_raw_kernel_takes_the_shared_memory_opt_in():
    """The opt-in goes through RawKernel.max_dynamic_shared_size_bytes (cuFuncSetAttribute on the
    current device's function): the installed CuPy has it as a settable property."""
    import cupy

    assert hasattr(cupy.RawKernel.__dict__["max_dynamic_shared_size_bytes"], "__set__")
