"""The suite's weight buffer type mode: MUL_MAT / MUL_MAT_ID weights in an extra buffer type."""
from __future__ import annotations

import pytest
from extra_buft_device import XorDevice

from ggx import cli, registry
from ggx.backend import BackendReg
from ggx.conformance import FAIL, PASS, SKIP, Suite, golden_cases, op_cases, select
from ggx.conformance.harness import execute
from ggx.errors import GGXError
from ggx.ops import Op

MATMUL = [c for c in select(op_cases() + golden_cases(), ["MUL_MAT", "MUL_MAT_ID"]) if c.expect_error is None]


def test_only_matmul_cases_run_with_f32_weights_in_the_buffer_type():
    suite = Suite(XorDevice(), weight_buft="XOR_TEST")
    items = suite.items()
    assert items == MATMUL  # no other op, no contract checks, nothing refused at build time
    report = suite.run(items)
    assert report.ok, [r.message for r in report.failures][:3]
    passed = [r for r in report.results if r.status == PASS]
    # XOR_TEST takes 2-D F32 weights of MUL_MAT only: every other case is skipped with the reason
    assert len(passed) >= 8 and all(r.id.startswith("MUL_MAT(") for r in passed)
    skipped = [r for r in report.results if r.status == SKIP]
    assert skipped and all(r.message.startswith("not supported: ") for r in skipped)
    assert any("XOR_TEST refuses MUL_MAT_ID" in r.message for r in skipped)
    assert any("is not a whole leaf tensor" in r.message for r in skipped)  # the row_strided weight view
    assert report.summary().startswith("xor-test (reference (numpy, float64)), weights in XOR_TEST: ")


def test_weights_are_in_the_buffer_type_and_its_kernel_is_what_is_checked():
    case = select(op_cases(), ["MUL_MAT"], ["f32"])[0]
    dev = XorDevice()
    b = case.make()
    run = execute(dev, dev.init_backend(), b.out, b.inputs, weight_buft=dev.xor)
    weight = run.graph.nodes[-1].src[0]
    assert weight.buffer is run.placement.weights and weight.buffer.buft.name == "XOR_TEST"
    assert not run.problems  # the write-only weight is not read back; guards are only around the rest

    wrong = Suite(XorDevice(fault="wrong"), weight_buft="XOR_TEST")
    report = wrong.run(wrong.items(types=["f32"]))
    assert report.count(FAIL) >= 8 and all("NMSE" in r.message for r in report.failures)
    # without the mode the same device passes: the weights never reached the faulty kernel
    plain = Suite(XorDevice(fault="wrong"))
    assert plain.run(plain.items(["MUL_MAT"], ["f32"], contracts=False)).ok


def test_unknown_buffer_type_lists_the_devices_extra_buffer_types(capsys):
    with pytest.raises(GGXError, match=r"no extra buffer type 'NOPE' \(its extra buffer types: XOR_TEST\)"):
        Suite(XorDevice(), weight_buft="NOPE")
    dev = XorDevice()
    registry.register(type("R", (BackendReg,), {"name": "xor", "devices": lambda self: [dev]})(), name="xor-test")
    try:
        assert cli.main(["test-ops", "-b", "xor-test", "--buft", "NOPE"]) == 2
        assert "its extra buffer types: XOR_TEST" in capsys.readouterr().err
        assert cli.main(["test-ops", "-b", "xor-test", "--buft", "XOR_TEST", "-t", "f32"]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert out[-1].startswith("xor-test (reference (numpy, float64)), weights in XOR_TEST: ")
        assert out[-2].startswith("xor-test: skipped (not supported): MUL_MAT ")
        assert cli.main(["test-ops", "-b", "xor-test", "--buft", "XOR_TEST", "--mode", "support", "-t", "f32"]) == 0
        assert "MUL_MAT_ID" in capsys.readouterr().out
    finally:
        registry.unregister("xor-test")


def test_a_buffer_type_the_device_cannot_read_is_refused():
    with pytest.raises(GGXError, match="cannot compute from buffer type XOR_TEST"):
        Suite(registry.get_device("ref"), weight_buft=XorDevice().xor)


def test_plain_mode_is_unchanged_by_a_device_with_extra_buffer_types():
    suite = Suite(XorDevice())
    assert len(suite.items(["MUL_MAT"], contracts=False)) == len(select(op_cases() + golden_cases(), ["MUL_MAT"]))
    assert suite.weight_buft is None and all(c.op is Op.MUL_MAT for c in suite.items(["MUL_MAT"], contracts=False))
