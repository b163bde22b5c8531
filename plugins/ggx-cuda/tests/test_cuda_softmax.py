"""SOFT_MAX: kernels compile, planners cover the rows, conformance cases on the kernel model."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cuda_testing import ARCHS, H100, StubCtx, bind, cases_for, check_case, check_compiles, run_launches

from ggx.graph import Context
from ggx.ops import Op
from ggx.reference.ops import alibi_slopes
from ggx_cuda.ops import softmax

CASES = cases_for((Op.SOFT_MAX,))
#: a device whose shared memory holds no row: the values go through the destination row
SMALL_SMEM = dataclasses.replace(H100, smem_per_block=256)


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile(arch):
    lowered = check_compiles(softmax.SOURCE, arch)
    assert set(softmax.KERNELS.values()) <= set(lowered)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_conformance_case(case):
    check_case(case, softmax.supports, softmax.plan)


@pytest.mark.parametrize("case", CASES[::4], ids=lambda c: c.name)
def test_conformance_case_without_shared_rows(case):
    check_case(case, softmax.supports, softmax.plan, SMALL_SMEM)


def test_every_case_supported():
    assert len(CASES) >= 20
    for case in CASES:
        assert softmax.supports(case.make().out), case.name


@pytest.mark.parametrize("ncols,block", [(16, 32), (37, 64), (256, 256), (1024, 1024), (4096, 1024)])
def test_plan_geometry(ncols, block):
    ctx = Context()
    a = ctx.tensor("f32", (ncols, 3, 4), "a")
    mask = ctx.tensor("f16", (ncols, 5), "mask")
    out = ctx.soft_max(a, mask, 0.125, 8.0)
    stub = StubCtx(H100)
    (launch,) = softmax.plan(out, stub)
    assert launch.grid == (12, 1, 1) and launch.block == (block, 1, 1)
    assert launch.kernel.name == "k_soft_max_f32<__half>"
    assert launch.shared == (-(-ncols // 32) * 32 + 32) * 4
    args = bind(launch)
    assert (int(args["x"]), int(args["mask"]), int(args["dst"])) == (stub.ptr(a), stub.ptr(mask), stub.ptr(out))
    assert args["use_shared"] == 1 and (args["ne12"], args["ne13"]) == (1, 1)


def test_long_rows_fall_back_to_the_destination():
    ctx = Context()
    out = ctx.soft_max(ctx.tensor("f32", (20000, 2), "a"))
    (launch,) = softmax.plan(out, StubCtx(H100))
    args = bind(launch)
    assert args["use_shared"] == 0 and launch.shared == 128 and int(args["mask"]) == 0


@pytest.mark.parametrize("n_head", [1, 3, 4, 6, 8, 12, 32])
def test_alibi_slopes_match_the_reference(n_head):
    m0, m1, nl2 = softmax.alibi(n_head, 8.0)
    h = np.arange(n_head)
    slopes = np.where(h < nl2, np.float32(m0) ** (h + 1.0), np.float32(m1) ** (2.0 * (h - nl2) + 1))
    np.testing.assert_allclose(slopes, alibi_slopes(n_head, 8.0), rtol=1e-6)


def test_broadcast_mask_on_the_model():
    """A mask over 2 of 6 heads and 1 of 2 batches, more mask rows than a's, ALiBi, F32 mask."""
    rng = np.random.default_rng(2)
    ctx = Context()
    a = ctx.tensor("f32", (33, 4, 6, 2), "a")
    mask = ctx.tensor("f32", (33, 7, 2, 1), "mask")
    out = ctx.soft_max(a, mask, 0.3, 4.0)
    stub = StubCtx(H100)
    x = rng.uniform(-3, 3, (2, 6, 4, 33)).astype(np.float32)
    m = rng.uniform(-1, 1, (1, 2, 7, 33)).astype(np.float32)
    stub.array(a, np.float32)[...] = x
    stub.array(mask, np.float32)[...] = m
    run_launches(softmax.plan(out, stub), stub)
    v = x * 0.3 + alibi_slopes(6, 4.0)[None, :, None, None] * m[:, np.arange(6) % 2][:, :, :4]
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(stub.array(out, np.float32), e / e.sum(axis=-1, keepdims=True), rtol=1e-5)


def test_declines():
    ctx = Context()
    a = ctx.tensor("f32", (16, 4, 2), "a")
    out = ctx.soft_max(a, ctx.tensor("f32", (16, 4), "m"))
    assert softmax.supports(out)
    out.src = (a, ctx.tensor("bf16", (16, 4), "mb"))
    assert not softmax.supports(out)
    out.src = (a, ctx.tensor("f32", (16, 4, 3), "m3"))  # 3 does not divide 2
    assert not softmax.supports(out)
    out.src = (ctx.tensor("f16", (16, 4, 2), "h"),)
    assert not softmax.supports(out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_conformance_case_on_host_kernels(case, host_cc):
    """The kernels of softmax.cu themselves, compiled for the host (tests/host_cuda_shim.h)."""
    check_case(case, softmax.supports, softmax.plan, host=True)
