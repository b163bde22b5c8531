"""ROPE: kernels compile, planners cover the rows, conformance cases on the kernel model."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_testing import ARCHS, H100, StubCtx, bind, cases_for, check_case, check_compiles, run_launches

from ggx.graph import Context
from ggx.ops import Op, RopeMode, RopeParams
from ggx.reference.ops import rope_cos_sin
from ggx_cuda.ops import rope

CASES = cases_for((Op.ROPE,))


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile(arch):
    lowered = check_compiles(rope.SOURCE, arch)
    assert set(rope.KERNELS.values()) <= set(lowered)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_conformance_case(case):
    check_case(case, rope.supports, rope.plan)


@pytest.mark.parametrize("case", [c for c in CASES if "freq_factors" in dict(c.vars)], ids=lambda c: c.name)
def test_freq_factor_cases_on_host_kernel(case, host_cc):
    """rope.cu itself (built for the host) with frequency factors: the pointer reaches the kernel."""
    check_case(case, rope.supports, rope.plan, host=True)


def test_every_case_supported():
    assert len(CASES) >= 20
    for case in CASES:
        assert rope.supports(case.make().out), case.name


def _node(ne=(128, 4, 5), n_dims=128, mode=RopeMode.NEOX, **kw):
    ctx = Context()
    a = ctx.tensor("f32", ne, "a")
    pos = ctx.tensor("i32", (ne[2],), "pos")
    return ctx, a, pos, ctx.rope(a, pos, n_dims, mode, **kw)


@pytest.mark.parametrize("ne,n_dims,block", [((128, 4, 5), 128, (64, 4, 1)), ((64, 3, 7), 32, (64, 4, 1)),
                                             ((1024, 2, 2), 1024, (256, 1, 1)), ((10, 3, 2), 4, (32, 8, 1))])
def test_plan_geometry(ne, n_dims, block):
    _, a, pos, out = _node(ne, n_dims)
    stub = StubCtx(H100)
    (launch,) = rope.plan(out, stub)
    assert launch.block == block
    assert launch.grid == (-(-out.nrows // block[1]), 1, 1)
    args = bind(launch)
    assert (int(args["x"]), int(args["pos"]), int(args["dst"])) == (stub.ptr(a), stub.ptr(pos), stub.ptr(out))
    assert args["nrows"] == out.nrows and args["n_dims"] == n_dims


def test_constants_match_ggml():
    p = RopeParams(128, RopeMode.NORMAL, 4096, 10000.0, 0.25, 1.0, 1.0, 32.0, 1.0)
    theta_scale, c0, c1 = rope.constants(p)
    assert theta_scale == np.float32(np.float32(10000.0) ** np.float32(-2.0 / 128))
    assert theta_scale.dtype == np.float32 and c0.dtype == np.float32
    # ggml_rope_yarn_corr_dims(128, 4096, 10000, 32, 1) = (20, 46)
    assert (float(c0), float(c1)) == (20.0, 46.0)
    # n_ctx_orig 0: log(0) = -inf, as ggml's logf(0)
    _, c0, c1 = rope.constants(RopeParams(64, n_ctx_orig=0))
    assert float(c0) == 0.0 and float(c1) == -np.inf


@pytest.mark.parametrize("mode", [RopeMode.NORMAL, RopeMode.NEOX])
def test_yarn_and_odd_tail_on_the_model(mode):
    """YaRN with every parameter off its default, n_dims < head size with an odd head size,
    positions including 0 and negatives, a 4-d source: the model of the launch matches."""
    rng = np.random.default_rng(1)
    kw = dict(freq_base=5e5, freq_scale=0.125, n_ctx_orig=2048, ext_factor=0.7, attn_factor=0.9,
              beta_fast=24.0, beta_slow=2.0)
    ctx, a, pos, out = _node((39, 3, 4, 2), 20, mode, **kw)
    stub = StubCtx(H100)
    x = rng.uniform(-1, 1, (2, 4, 3, 39)).astype(np.float32)
    positions = np.array([0, 7, -3, 250], np.int32)
    stub.array(a, np.float32)[...] = x
    stub.array(pos, np.int32)[0, 0, 0] = positions
    assert rope.supports(out)
    run_launches(rope.plan(out, stub), stub)
    cos, sin = rope_cos_sin(positions, out.params)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    i0, i1 = (slice(0, 10), slice(10, 20)) if mode is RopeMode.NEOX else (slice(0, 20, 2), slice(1, 20, 2))
    want = x.astype(np.float64)
    want[..., i0], want[..., i1] = x[..., i0] * cos - x[..., i1] * sin, x[..., i0] * sin + x[..., i1] * cos
    got = stub.array(out, np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert np.array_equal(got[..., 20:], x[..., 20:])


def test_declines():
    ctx, a, pos, out = _node()
    assert rope.supports(out)
    out.params = RopeParams(128, RopeMode(0))
    assert rope.supports(out)
    out.src = (a, ctx.tensor("i64", (5,), "p64"))
    assert not rope.supports(out)
    out.src = (ctx.tensor("f16", (128, 4, 5), "h"), pos)
    assert not rope.supports(out)
    out.src, out.params = (a, pos), RopeParams(130)
    assert not rope.supports(out)
    out.params = RopeParams(128)
    out.src = (a, pos, ctx.tensor("f32", (64,), "ff"))
    assert rope.supports(out)
    for bad in (ctx.tensor("f32", (63,), "short"), ctx.tensor("f16", (64,), "half"),
                ctx.transpose(ctx.tensor("f32", (2, 64), "t"))):
        out.src = (a, pos, bad)
        assert not rope.supports(out), bad.describe()
