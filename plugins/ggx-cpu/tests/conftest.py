"""Fixtures shared by the plugin's tests."""
import pytest

from ggx_cpu.isa.vmath import float_simd_form

# the kernel modules that take ggml's float form from the active ISA variant
FLOAT_FORM_MODULES = ("attention", "softmax", "elementwise")


@pytest.fixture
def ggml_avx512_form(monkeypatch):
    """Kernels bound in the test use ggml's AVX-512 float form (the build ggml's recorded outputs
    come from), whatever variant the host selects: the form is target-independent IR, so it runs,
    and must give ggml's bits, on any x86 host with FMA."""
    import importlib

    for name in FLOAT_FORM_MODULES:
        module = importlib.import_module(f"ggx_cpu.kernels.{name}")
        monkeypatch.setattr(module, "float_simd", lambda variant: float_simd_form("avx512"))
    return float_simd_form("avx512")
