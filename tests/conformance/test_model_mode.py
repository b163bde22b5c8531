"""Model mode (ggx.conformance.model): the default model's 2-layer cut through each CPU-side
backend against the reference, node by node, as CI runs it: the asynchronous test device, CPU,
CPU_REPACK and AMX (emulated here); and the command line and the pytest plugin on a tiny llama."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from broken_device import BrokenDevice
from sched_device import TestDevice

from ggx import cli, registry
from ggx.conformance.model import model_check
from ggx.conformance.runner import FAIL, PASS
from ggx.ops import Op

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "models"))
from gguf_synth import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("model-mode") / "tiny-llama.gguf")


def _passes(result, report) -> None:
    assert result.status == PASS, result.message
    assert report.ok and report.nodes and report.first_isolated is None
    assert {n.step for n in report.nodes} == {0, 1}  # the prompt and one decode step
    kinds = {n.op for n in report.nodes}
    assert {"MUL_MAT", "FLASH_ATTN_EXT", "ROPE", "RMS_NORM", "SET_ROWS", "SWIGLU"} <= kinds
    assert all(n.isolated is not None for n in report.nodes), [n.note for n in report.nodes if n.isolated is None]


def test_the_async_test_device_on_the_default_model():
    result, report = model_check(TestDevice("sched-model"))
    _passes(result, report)
    assert result.id == "model:SmolLM2-135M-Instruct.Q4_1.2-layers.gguf"


@pytest.mark.parametrize("buft", [None, "CPU_REPACK"])
def test_cpu_on_the_default_model(buft):
    result, report = model_check("CPU", buft)
    _passes(result, report)
    if buft:
        assert report.weights["b"].startswith("CPU_REPACK"), report.weights


def test_amx_emulated_on_the_default_model():
    from ggx_amx.detect import ENV_EMULATE

    if any(p.distribution == "ggx-amx" and p.status == registry.DISABLED for p in registry.plugins()):
        pytest.skip("ggx-amx is disabled by GGX_DISABLE_PLUGINS: no AMX_EMULATED buffer type to check")

    cpu = registry.get_device("CPU")
    registry.extra_buffer_types(cpu)  # the session's CPU device keeps its own list
    dev = type(cpu)(cpu.reg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_EMULATE, "1")
        assert registry.extra_buffer_types(dev)[0].name == "AMX_EMULATED"
    result, report = model_check(dev, "AMX_EMULATED")
    _passes(result, report)
    assert report.weights["b"].startswith("AMX_EMULATED"), report.weights


def test_a_broken_kernel_fails_model_mode_naming_it(tiny):
    result, report = model_check(BrokenDevice("noise", fault_ops=(Op.GLU,), name="broken-glu"), model=tiny)
    assert result.status == FAIL and report.first_isolated.op == "SWIGLU"
    assert result.message.startswith("first node beyond its tolerance (isolated): step 0 node")


def test_cli_model_mode(tiny, capsys):
    assert cli.main(["test-ops", "-b", "ref", "--model", str(tiny), "--model-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok ref model:tiny-llama.gguf:") and "over 1 steps" in out
    assert cli.main(["test-ops", "-b", "ref", "--buft", "NOPE", "--model", str(tiny)]) == 2


def test_pytest_plugin_model_mode(tiny, tmp_path):
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "ggx.testing",
                        "--ggx-backend", "ref", "--ggx-model", str(tiny), "--ggx-model-steps", "1", "-v"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ggx-conformance[ref]::model PASSED" in r.stdout and "1 passed" in r.stdout
