"""RMS_NORM and NORM: kernels compile, planners cover the rows, conformance cases on the models."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_testing import ARCHS, H100, StubCtx, bind, cases_for, check_case, check_compiles, run_launches

from ggx.graph import Context
from ggx.ops import Op
from ggx_cuda.ops import norm

CASES = cases_for((Op.RMS_NORM, Op.NORM))


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile(arch):
    lowered = check_compiles(norm.SOURCE, arch)
    assert set(norm.KERNELS.values()) <= set(lowered)
    assert all(lowered.values())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_conformance_case(case):
    check_case(case, norm.supports, norm.plan)


def test_every_case_supported():
    assert len(CASES) >= 16
    for case in CASES:
        b = case.make()
        assert norm.supports(b.out), case.name


@pytest.mark.parametrize("ne,block", [((37, 5), 32), ((1023, 2), 32), ((1024, 2), 1024), ((4096, 3, 2, 2), 1024)])
def test_plan_geometry(ne, block):
    ctx = Context()
    a = ctx.tensor("f32", ne, "a")
    out = ctx.rms_norm(a, 1e-6)
    stub = StubCtx(H100)
    (launch,) = norm.plan(out, stub)
    assert launch.grid == (out.nrows, 1, 1) and launch.block == (block, 1, 1)
    args = bind(launch)
    assert int(args["x"]) == stub.ptr(a) and int(args["dst"]) == stub.ptr(out)
    assert args["ncols"] == ne[0] and args["eps"] == np.float32(1e-6)


def test_many_rows_go_in_grid_x():
    """Rows beyond 65535 (grid y/z limits) stay in grid x."""
    ctx = Context()
    out = ctx.norm(ctx.tensor("f32", (8, 300, 300), "a"), 1e-5)
    (launch,) = norm.plan(out, StubCtx(H100))
    assert launch.grid == (90000, 1, 1)


def test_transposed_input_on_the_model():
    """A transposed (nb0 > nb1) input: the strides travel, the result is the reference's."""
    rng = np.random.default_rng(0)
    ctx = Context()
    leaf = ctx.tensor("f32", (5, 37), "a")
    a = ctx.transpose(leaf)
    out = ctx.norm(a, 1e-5)
    stub = StubCtx(H100)
    x = rng.uniform(-1, 3, (37, 5)).astype(np.float32)
    stub.array(leaf, np.float32)[0, 0] = x
    assert norm.supports(out)
    run_launches(norm.plan(out, stub), stub)
    xt = x.T.astype(np.float64)
    d = xt - xt.mean(axis=1, keepdims=True)
    want = d / np.sqrt((d * d).mean(axis=1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(stub.array(out, np.float32)[0, 0], want, rtol=1e-5, atol=1e-6)


def test_declines():
    ctx = Context()
    a = ctx.tensor("f32", (16, 2), "a")
    out = ctx.rms_norm(a, 1e-5)
    assert norm.supports(out)
    out.src = (ctx.tensor("f16", (16, 2), "h"),)
    assert not norm.supports(out)
    empty = ctx.rms_norm(ctx.tensor("f32", (0, 3), "e"), 1e-5)
    assert norm.plan(empty, StubCtx(H100)) == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_conformance_case_on_host_kernels(case, host_cc):
    """The kernels of norm.cu themselves, compiled for the host (tests/host_cuda_shim.h)."""
    check_case(case, norm.supports, norm.plan, host=True)
