"""The suite itself: catalogue coverage, thresholds, and that it catches broken backends."""
from __future__ import annotations

import numpy as np
import pytest
from broken_device import BrokenDevice

from ggx.conformance import FAIL, PASS, SKIP, Suite, golden_cases, op_cases, perf_cases, select
from ggx.conformance.case import tolerance
from ggx.conformance.harness import compare, nmse
from ggx.graph import Context
from ggx.ops import Op
from ggx.types import GType

# Every op of the catalogue (one Context method each) has cases.
CATALOGUE = {Op.GET_ROWS, Op.SET_ROWS, Op.CPY, Op.DUP, Op.CONT, Op.VIEW, Op.RESHAPE, Op.PERMUTE, Op.TRANSPOSE,
             Op.ADD, Op.MUL, Op.SCALE, Op.SILU, Op.GELU, Op.GLU, Op.RMS_NORM, Op.NORM, Op.MUL_MAT, Op.MUL_MAT_ID,
             Op.ROPE, Op.SOFT_MAX, Op.FLASH_ATTN_EXT, Op.ARGSORT, Op.TOP_K, Op.SUM_ROWS}


def test_catalogue_is_covered_with_unique_names():
    cases = op_cases()
    assert {c.op for c in cases} == CATALOGUE == set(Op) - {Op.NONE}
    names = [c.name for c in cases] + [c.name for c in golden_cases()]
    assert len(names) == len(set(names))
    assert len(cases) + len(golden_cases()) >= 400
    assert len(golden_cases()) == 95


def test_cases_cover_the_shapes_the_issue_asks_for():
    names = "\n".join(c.name for c in op_cases())
    for gqa in (1, 3, 4, 8):
        assert f"gqa={gqa}," in names
    for hs in (64, 128):
        assert f"hs={hs}," in names and f"head_dim={hs}," in names
    assert "mode=normal" in names and "mode=neox" in names
    assert "ids=repeated" in names and "ids=unused" in names
    assert "view=permuted" in names and "view=transposed" in names and "bs=[2,3]" in names
    mm_types = {c.types[0] for c in select(op_cases(), ["MUL_MAT"])}
    assert mm_types == {GType.F32, GType.F16, GType.BF16, GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0, GType.Q4_K,
                        GType.Q5_K, GType.Q6_K}
    refused = [c for c in op_cases() if c.expect_error is not None]
    assert {c.types[0] for c in refused} >= {GType.Q4_0, GType.Q5_0, GType.Q4_K, GType.Q5_K, GType.Q6_K}
    # Q5_0 is in every family Q4_0 is in (ggml's test-backend-ops lists them together)
    for op in ("GET_ROWS", "SET_ROWS", "CPY", "MUL_MAT", "MUL_MAT_ID"):
        assert len(select(op_cases(), [op], ["q5_0"])) > 0, op


def test_each_threshold_has_a_reason():
    for c in op_cases() + golden_cases():
        assert c.tol.reason and c.tol.max_nmse >= 0 and c.tol.kind in ("nmse", "exact", "set")
    assert tolerance(Op.MUL_MAT, GType.Q4_0).max_nmse == 5e-4
    assert tolerance(Op.MUL_MAT, GType.Q5_0) == tolerance(Op.MUL_MAT, GType.Q4_0)
    assert tolerance(Op.CPY, GType.Q5_0) == tolerance(Op.CPY, GType.Q4_0)
    assert "vec_dot_type" in tolerance(Op.MUL_MAT, GType.Q4_K).reason
    assert tolerance(Op.ADD).max_nmse == 1e-7
    assert tolerance(Op.TOP_K).kind == "set"


def test_same_case_builds_the_same_data():
    c = select(op_cases(), ["MUL_MAT"], ["q4_K"])[0]
    a, b = c.make(), c.make()
    assert [np.array_equal(x, y) for x, y in zip(a.inputs.values(), b.inputs.values())] == [True, True]


def test_select_by_op_label_and_type():
    assert {c.op_name for c in select(op_cases(), ["gelu"])} == {"GELU", "GELU_ERF", "GELU_QUICK"}
    assert {c.op_name for c in select(op_cases(), ["GELU_ERF"])} == {"GELU_ERF"}
    assert all(GType.Q6_K in c.types for c in select(op_cases(), None, ["q6_k"]))


def test_compare_nmse_nonfinite_and_sets():
    ref = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    assert nmse(ref * 1.001, ref) == pytest.approx(1e-6, rel=1e-3)
    tol = tolerance(Op.ADD)
    assert compare(ref, ref, tol)[0]
    ok, _, msg = compare(np.array([1.0, np.nan, 3.0, 4.0], np.float32), ref, tol)
    assert not ok and "NaN/inf" in msg
    ok, err, msg = compare(ref + 0.1, ref, tol)
    assert not ok and err > 1e-4 and "NMSE" in msg
    inf_ref = np.array([np.inf, 1.0], np.float32)
    assert compare(inf_ref.copy(), inf_ref, tol)[0]
    assert not compare(np.array([1.0, 1.0], np.float32), inf_ref, tol)[0]
    topk = tolerance(Op.TOP_K)
    assert compare(np.array([[3, 1, 2]]), np.array([[1, 2, 3]]), topk)[0]
    assert not compare(np.array([[3, 1, 0]]), np.array([[1, 2, 3]]), topk)[0]
    assert not compare(np.array([[3, 1, 2]]), np.array([[1, 2, 3]]), tolerance(Op.ARGSORT))[0]


def _run(device, ops, types=None):
    suite = Suite(device)
    return suite.run(suite.items(ops, types, golden=False, contracts=False))


@pytest.mark.parametrize("fault, expect", [
    ("noise", "NMSE"), ("nan", "NaN/inf"), ("overrun", "guard bytes"), ("unwritten", "NaN/inf"),
    ("clobber_input", "was modified"), ("raise", "computing raised RuntimeError"),
])
def test_broken_backend_fails(fault, expect):
    ops = ["SOFT_MAX"] if fault == "raise" else ["MUL_MAT"]
    report = _run(BrokenDevice(fault, fault_ops=(Op.MUL_MAT,)), ops, ["q4_0", "f32"])
    assert not report.ok
    assert report.count(PASS) == sum(c.expect_error is not None for c in select(op_cases(), ops, ["q4_0", "f32"]))
    assert all(expect in r.message for r in report.failures), report.failures[0].message


def test_unsupported_is_skipped_and_listed_per_op():
    report = _run(BrokenDevice("none", fault_ops=(), unsupported={Op.ROPE}), ["ROPE", "SCALE"])
    assert report.ok
    assert report.skipped_by_op() == {"ROPE": len(select(op_cases(), ["ROPE"]))}
    assert report.count(PASS) == len(select(op_cases(), ["SCALE"]))
    assert all(r.message.startswith("not supported: ROPE") for r in report.results if r.status == SKIP)
    counts = f"{report.count(PASS)} passed, 0 failed, {report.count(SKIP)} skipped"
    assert report.summary() == f"broken (reference (numpy, float64)): {counts}"  # names the device it tested
    assert report.details() == [f"broken: skipped (not supported): ROPE {report.count(SKIP)}"]


def test_golden_cases_hold_a_backend_to_ggml_not_to_the_reference():
    noisy = BrokenDevice("noise", fault_ops=(Op.MUL_MAT,))
    suite = Suite(noisy)
    golden = select(golden_cases(), ["MUL_MAT"])
    results = [suite.run_case(c) for c in golden]
    assert all(r.status == FAIL and r.source == "ggml" for r in results)


def test_perf_and_support_modes(ref_device):
    suite = Suite(ref_device)
    case = select(perf_cases(), ["ADD"])[0]
    r = suite.perf(case, min_time=0.01)
    assert r.status == PASS and r.runs >= 1 and r.rate[1] == "GB/s" and r.rate[0] > 0
    mm = Context()
    assert mm  # the support table is built from the cases themselves
    table = Suite(BrokenDevice("none", fault_ops=(), unsupported={Op.MUL_MAT})).support(select(op_cases(), ["MUL_MAT",
                                                                                                          "ADD"]))
    assert table["MUL_MAT"]["Q4_0"][0] == 0 and table["ADD"]["F32"][0] == table["ADD"]["F32"][1] > 0
