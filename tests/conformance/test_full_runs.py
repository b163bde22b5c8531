"""The whole suite against the reference backend and the scheduler's test device (async, not
host memory), as CI runs it; and the suite's pytest plugin and command line."""
from __future__ import annotations

import subprocess
import sys

import pytest
from sched_device import TestDevice

from ggx import cli, registry
from ggx.conformance import PASS, Suite, golden_cases, op_cases
from ggx.conformance.contract import CHECKS
from ggx.ops import Op

N_ITEMS = len(op_cases()) + len(golden_cases()) + len(CHECKS)


def _failures(report) -> str:
    return "\n".join(f"{r.id}: {r.message}" for r in report.failures)


def test_reference_passes_everything(ref_device):
    suite = Suite(ref_device)
    report = suite.run(suite.items())
    assert report.ok, _failures(report)
    assert report.count(PASS) == len(report.results) == N_ITEMS


def test_sched_test_device_passes_everything():
    suite = Suite(TestDevice("sched-all"))
    report = suite.run(suite.items())
    assert report.ok, _failures(report)
    assert report.count(PASS) == N_ITEMS


def test_sched_test_device_with_a_few_ops_skips_the_rest():
    suite = Suite(TestDevice("sched-few", ops=[Op.ADD, Op.MUL_MAT, Op.SOFT_MAX]))
    report = suite.run(suite.items(["ADD", "MUL_MAT", "ROPE", "CONTRACT"]))
    assert report.ok, _failures(report)
    assert set(report.skipped_by_op()) == {"ROPE"}
    unsupported = next(r for r in report.results if r.id == "contract:unsupported_refused")
    assert "GGXUnsupported" in unsupported.message and "ROPE" in unsupported.message


@pytest.fixture
def broken_registered():
    from broken_device import BrokenDevice

    from ggx.backend import BackendReg

    class Reg(BackendReg):
        name = "broken"

        def devices(self):
            return [BrokenDevice("noise", fault_ops=(Op.SCALE,))]

    registry.register(Reg(), name="broken-test")
    yield
    registry.unregister("broken-test")


def test_cli_eval_ok_and_failing(capsys, broken_registered):
    assert cli.main(["test-ops", "-b", "ref", "-o", "SCALE,CONTRACT"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"ref (reference (numpy, float64)): {6 + len(CHECKS)} passed, 0 failed, 0 skipped"
    assert cli.main(["test-ops", "-b", "broken", "-o", "SCALE", "-o", "ADD"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL SCALE(") == 6 and out.strip().splitlines()[-1].endswith("6 failed, 0 skipped")


def test_cli_lists_skips_per_op_and_rejects_bad_filters(capsys):
    dev = TestDevice("sched-cli", ops=[Op.ADD])
    registry.register(type("R", (registry.BackendReg,), {"name": "schedcli", "devices": lambda self: [dev]})(),
                      name="sched-cli-test")
    try:
        assert cli.main(["test-ops", "-b", "sched-cli", "-o", "ADD,SCALE"]) == 0
        out = capsys.readouterr().out
        assert "skipped (not supported): SCALE 6" in out
        assert out.strip().splitlines()[-1] == (
            "sched-cli (scheduler test device (reference kernels)): 17 passed, 0 failed, 6 skipped")  # 14 ADD + 3 ggml
        assert cli.main(["test-ops", "-b", "sched-cli", "-o", "NO_SUCH_OP"]) == 2
        assert cli.main(["test-ops", "-b", "sched-cli", "-t", "q9_9"]) == 2
    finally:
        registry.unregister("sched-cli-test")


def test_cli_perf_with_two_backends_and_support(capsys):
    assert cli.main(["test-ops", "--mode", "perf", "-b", "ref", "-b", "ref", "-o", "RMS_NORM",
                     "--min-time", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "GB/s" in out and "ref / ref" in out and "x" in out
    assert cli.main(["test-ops", "--mode", "support", "-b", "ref", "-o", "MUL_MAT_ID"]) == 0
    out = capsys.readouterr().out
    assert "MUL_MAT_ID" in out and "q4_K" in out and "yes" in out


def _pytest(*args, cwd):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_pytest_plugin_runs_cases_with_readable_ids(tmp_path):
    r = _pytest("-p", "ggx.testing", "--ggx-backend", "ref", "--ggx-op", "TOP_K", "--ggx-op", "CONTRACT", "-v",
                cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ggx-conformance[ref]::TOP_K(ne=[37,4],k=5) PASSED" in r.stdout
    assert "ggx-conformance[ref]::TOP_K(ggml=top_k_5_37x4) PASSED" in r.stdout
    assert "ggx-conformance[ref]::contract:round_trip PASSED" in r.stdout
    assert f"{6 + len(CHECKS)} passed" in r.stdout  # 5 TOP_K cases, 1 of ggml, the contract checks


def test_pytest_plugin_is_opt_in(tmp_path):
    r = _pytest("--ggx-backend", "ref", cwd=tmp_path)
    assert r.returncode != 0 and "unrecognized arguments: --ggx-backend" in r.stderr


TEST_DEVICES = '''
import sys
sys.path.insert(0, {here!r})
from broken_device import LowPrecisionDevice
from extra_buft_device import XorDevice
from ggx import registry
from ggx.backend import BackendReg
from ggx.ops import Op
from ggx.types import GType

class Reg(BackendReg):
    name = "testdevs"
    def devices(self):
        return [XorDevice(), LowPrecisionDevice({{Op.ADD}}, {{(Op.ADD, GType.F32): (1e-4, "accumulates in BF16")}})]

registry.register(Reg(), name="testdevs")
'''


def test_pytest_plugin_weight_buft_mode_and_tolerance_overrides(tmp_path):
    from pathlib import Path

    (tmp_path / "conftest.py").write_text(TEST_DEVICES.format(here=str(Path(__file__).parent)))
    r = _pytest("-p", "ggx.testing", "--ggx-backend", "xor-test", "--ggx-buft", "XOR_TEST", "--ggx-type", "f32",
                "-v", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ggx-conformance[xor-test,XOR_TEST]::MUL_MAT(type_a=f32,type_b=f32,m=16,n=1,k=256) PASSED" in r.stdout
    assert "ggx-conformance[xor-test,XOR_TEST]::MUL_MAT_ID(" in r.stdout and "SKIPPED" in r.stdout
    assert "contract:" not in r.stdout and "ADD(" not in r.stdout

    r = _pytest("-p", "ggx.testing", "--ggx-backend", "xor-test", "--ggx-buft", "NOPE", cwd=tmp_path)
    assert r.returncode != 0 and "its extra buffer types: XOR_TEST" in r.stderr

    r = _pytest("-p", "ggx.testing", "--ggx-backend", "lowp", "--ggx-op", "ADD", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ggx conformance: tolerance overrides" in r.stdout
    assert "lowp: ADD f32: 1e-07 -> 0.0001 (accumulates in BF16)" in r.stdout
