"""On a real GPU (skipped with the reason "no CUDA device" elsewhere): the conformance suite on
CUDA0 and the default model's tokens against the CPU's. scripts/gpu-check runs these too."""
from __future__ import annotations

import pytest

from ggx.conformance import Suite
from ggx_cuda.device import CudaBackendReg

_REG = CudaBackendReg()
_DEVICES = _REG.devices()
_WHY = "no CUDA device" + (f" ({_REG.note})" if _REG.note and _REG.note != "no CUDA device" else "")
pytestmark = pytest.mark.skipif(not _DEVICES, reason=_WHY)


def test_the_suite_passes_on_cuda0():
    from ggx import registry

    suite = Suite(registry.get_device("CUDA0"))
    report = suite.run(suite.items())
    assert report.ok, "\n".join(f"{r.id}: {r.message}" for r in report.failures)


def test_the_default_model_gives_the_cpu_tokens():
    from ggx.models import load_model

    prompt = "The capital of France is"
    want = [t.id for t in load_model(devices=["CPU"]).generate(prompt, max_tokens=16)]
    got = [t.id for t in load_model(devices=["CUDA0"]).generate(prompt, max_tokens=16)]
    assert got == want
