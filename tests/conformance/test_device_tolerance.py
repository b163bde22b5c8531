"""A device's own NMSE bounds (Device.max_nmse_err): used for its cases, listed in the report,
never written into the core table."""
from __future__ import annotations

import pytest
from broken_device import LowPrecisionDevice

from ggx import cli, registry
from ggx.backend import BackendReg
from ggx.conformance import FAIL, PASS, Suite, op_cases, select
from ggx.conformance.case import tolerance
from ggx.conformance.runner import ToleranceOverride
from ggx.ops import Op
from ggx.types import GType

BF16_REASON = "accumulates in BF16"


def _run(device, ops, types=None):
    suite = Suite(device)
    return suite.run(suite.items(ops, types, golden=False, contracts=False))


def test_a_looser_bound_makes_failing_cases_pass_and_is_reported():
    plain = _run(LowPrecisionDevice(round_ops={Op.ADD}), ["ADD"])
    assert plain.count(FAIL) == len(plain.results) and "NMSE" in plain.failures[0].message
    assert plain.tolerance_overrides() == []

    dev = LowPrecisionDevice(round_ops={Op.ADD}, bounds={(Op.ADD, GType.F32): (1e-4, BF16_REASON)})
    report = _run(dev, ["ADD"])
    assert report.ok and report.count(PASS) == len(select(op_cases(), ["ADD"]))
    override = ToleranceOverride("ADD", GType.F32, 1e-7, 1e-4, BF16_REASON)
    assert report.tolerance_overrides() == [override]
    assert all(r.override == override for r in report.results)
    assert "lowp: tolerance override ADD f32: 1e-07 -> 0.0001 (accumulates in BF16)" in report.details()
    # the core table and the cases are untouched
    assert tolerance(Op.ADD, GType.F32).max_nmse == 1e-7
    assert {c.tol.max_nmse for c in select(op_cases(), ["ADD"])} == {1e-7}
    assert all(r.status == FAIL for r in _run(LowPrecisionDevice(round_ops={Op.ADD}), ["ADD"]).results)


def test_a_stricter_bound_makes_passing_cases_fail():
    rounding = LowPrecisionDevice(round_ops={Op.MUL_MAT})
    assert _run(rounding, ["MUL_MAT"], ["f16"]).ok  # BF16-rounded results are within 5e-4

    strict = LowPrecisionDevice(round_ops={Op.MUL_MAT}, bounds={(Op.MUL_MAT, GType.F16): (1e-9, "exact kernel")})
    report = _run(strict, ["MUL_MAT"], ["f16"])
    computed = [r for r in report.results if r.override is not None]
    assert computed and all(r.status == FAIL for r in computed)
    assert all("> 1e-09 (lowp: exact kernel)" in r.message for r in computed)
    assert [str(o) for o in report.tolerance_overrides()] == ["MUL_MAT f16: 0.0005 -> 1e-09 (exact kernel)"]


def test_the_same_bound_as_the_table_is_no_override_and_exact_cases_are_not_asked():
    dev = LowPrecisionDevice(bounds={(Op.ADD, GType.F32): (1e-7, "same")})
    assert _run(dev, ["ADD"]).tolerance_overrides() == []
    dev.asked.clear()
    assert _run(dev, ["ARGSORT", "TOP_K"]).ok
    assert dev.asked == []  # index results are compared exactly: no bound to replace


@pytest.mark.parametrize("answer", [1e-5, (float("nan"), "why"), (-1.0, "why"), (1e-5, ""), ("1e-5", "why")])
def test_a_malformed_bound_fails_the_case(answer):
    dev = LowPrecisionDevice(bounds={(Op.SCALE, GType.F32): answer})
    report = _run(dev, ["SCALE"])
    assert report.count(FAIL) == len(report.results) > 0
    assert all("max_nmse_err(SCALE, f32) returned" in r.message for r in report.failures)


def test_cli_prints_the_overrides_and_names_the_device(capsys):
    dev = LowPrecisionDevice(round_ops={Op.ADD}, bounds={(Op.ADD, GType.F32): (1e-4, BF16_REASON)})
    registry.register(type("R", (BackendReg,), {"name": "lowp", "devices": lambda self: [dev]})(),
                      name="lowp-test")
    try:
        assert cli.main(["test-ops", "-b", "lowp", "-o", "ADD"]) == 0
    finally:
        registry.unregister("lowp-test")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2] == "lowp: tolerance override ADD f32: 1e-07 -> 0.0001 (accumulates in BF16)"
    assert lines[-1] == "lowp (reference (numpy, float64)): 17 passed, 0 failed, 0 skipped"  # 14 + 3 of ggml
