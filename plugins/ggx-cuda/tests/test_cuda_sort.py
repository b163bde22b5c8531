"""ARGSORT and TOP_K: kernels compile, planners cover the rows, conformance cases on the model
of the bitonic network (which must give numpy's stable argsort exactly, ties and NaN included)."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_testing import ARCHS, H100, StubCtx, bind, cases_for, check_case, check_compiles, run_launches

from ggx.graph import Context
from ggx.ops import Op, SortOrder
from ggx_cuda.ops import sort

CASES = cases_for((Op.ARGSORT, Op.TOP_K))


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile(arch):
    lowered = check_compiles(sort.SOURCE, arch)
    assert set(sort.KERNELS.values()) <= set(lowered)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_conformance_case(case):
    check_case(case, sort.supports, sort.plan)


def test_every_case_supported():
    assert len(CASES) >= 15
    for case in CASES:
        b = case.make()
        node = b.out if b.out.op in (Op.ARGSORT, Op.TOP_K) else b.out.src[0]  # ARGSORT_TOP_K: a view
        assert sort.supports(node), case.name


def _run(values: np.ndarray, op: Op, arg, device=H100) -> tuple[np.ndarray, list]:
    ctx = Context()
    a = ctx.tensor("f32", tuple(reversed(values.shape)), "a")
    out = ctx.argsort(a, arg) if op is Op.ARGSORT else ctx.top_k(a, arg)
    stub = StubCtx(device)
    stub.array(a, np.float32)[...] = values.reshape(stub.array(a, np.float32).shape)
    assert sort.supports(out)
    launches = sort.plan(out, stub)
    run_launches(launches, stub)
    return stub.array(out, np.int32).reshape(values.shape[:-1] + (out.ne[0],)), launches


@pytest.mark.parametrize("order", [SortOrder.ASC, SortOrder.DESC])
@pytest.mark.parametrize("n", [1, 2, 5, 33, 100])
def test_ties_nan_inf_are_the_reference_order(order, n):
    rng = np.random.default_rng(n)
    x = rng.integers(-3, 4, (4, n)).astype(np.float32)  # many ties
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], np.float32)
    x[1:, : min(n, 5)] = specials[: min(n, 5)]
    x[3] = np.nan
    got, _ = _run(x, Op.ARGSORT, order)
    key = x if order is SortOrder.ASC else -x
    assert np.array_equal(got, np.argsort(key, axis=-1, kind="stable"))


def test_long_rows_sort_in_global_scratch_in_chunks(monkeypatch):
    """Rows whose padded indices pass 48 KiB go to scratch, a bounded number of rows per launch."""
    monkeypatch.setattr(sort, "SCRATCH_BYTES", 2 * 16384 * 4)
    rng = np.random.default_rng(3)
    x = rng.integers(-50, 50, (5, 9000)).astype(np.float32)
    got, launches = _run(x, Op.ARGSORT, SortOrder.DESC)
    assert [launch.grid[0] for launch in launches] == [2, 2, 1]
    assert [int(bind(launch)["row0"]) for launch in launches] == [0, 2, 4]
    assert all(launch.shared == 0 and int(bind(launch)["scratch"]) for launch in launches)
    assert np.array_equal(got, np.argsort(-x, axis=-1, kind="stable"))


def test_rows_that_fit_use_shared_memory():
    ctx = Context()
    out = ctx.argsort(ctx.tensor("f32", (8192, 300), "a"))
    (launch,) = sort.plan(out, StubCtx(H100))
    assert launch.shared == 8192 * 4 and launch.block == (1024, 1, 1) and launch.grid == (300, 1, 1)
    assert int(bind(launch)["scratch"]) == 0
    ctx = Context()
    out = ctx.argsort(ctx.tensor("f32", (3, 2), "a"))
    (launch,) = sort.plan(out, StubCtx(H100))
    assert launch.block == (32, 1, 1) and launch.shared == 16


@pytest.mark.parametrize("k", [1, 2, 7, 64])
def test_top_k_is_the_k_largest(k):
    rng = np.random.default_rng(k)
    x = rng.standard_normal((3, 2, 64)).astype(np.float32)
    got, _ = _run(x, Op.TOP_K, k)
    want = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    assert np.array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1))


def test_declines():
    ctx = Context()
    assert sort.supports(ctx.argsort(ctx.tensor("f32", (sort.MAX_COLS, 2), "a")))
    assert not sort.supports(ctx.argsort(ctx.tensor("f32", (sort.MAX_COLS + 1, 2), "b")))
    node = ctx.top_k(ctx.tensor("f32", (40, 2), "c"), 5)
    assert sort.supports(node)
    node.src = (ctx.tensor("f16", (40, 2), "h"),)
    assert not sort.supports(node)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_conformance_case_on_host_kernels(case, host_cc):
    """The kernels of sort.cu themselves, compiled for the host (tests/host_cuda_shim.h)."""
    check_case(case, sort.supports, sort.plan, host=True)
