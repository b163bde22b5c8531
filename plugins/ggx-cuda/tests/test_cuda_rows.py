"""GET_ROWS / SET_ROWS (ggx_cuda/ops/rows.py, kernels/rows.cu) without a GPU: NVRTC compiles every
instantiation, the planners' launches match the kernels' signatures and cover the work, the
support predicates take the conformance cases, and the kernels built for the host
(cuda_testing.host_build) give the reference backend's bytes exactly."""
from __future__ import annotations

import cuda_testing as ct
import numpy as np
import pytest

from ggx.conformance.cases import case
from ggx.graph import Context
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType
from ggx_cuda.kernels import NAME_EXPRESSIONS
from ggx_cuda.ops import TABLE, load_all, rows, supports_op

F32, F16, BF16, I32, I64 = GType.F32, GType.F16, GType.BF16, GType.I32, GType.I64
Q4_0, Q4_1, Q5_0, Q8_0 = GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0
Q4_K, Q6_K = GType.Q4_K, GType.Q6_K
OPS = (Op.GET_ROWS, Op.SET_ROWS)
SOURCE = "rows.cu"
#: SET_ROWS into K-quants: their scale search (make_qkx2_quants, make_qx_quants) is not ported
#: to CUDA (ggml-cuda's set_rows does not take them either)
DECLINED = {f"SET_ROWS(type={t},idx=i64,n=256,dst_rows={d},src_rows={s},batch={b})"
            for t in ("q4_K", "q5_K", "q6_K") for d, s, b in ((10, 4, 1), (6, 3, 2))}


def test_registered():
    load_all()
    assert TABLE[Op.GET_ROWS].plan is rows.plan_get_rows and TABLE[Op.SET_ROWS].plan is rows.plan_set_rows
    assert NAME_EXPRESSIONS[SOURCE] == rows.NAMES


@pytest.mark.parametrize("arch", ct.ARCHS)
def test_names_compile(arch):
    lowered = ct.check_compiles(SOURCE, arch)
    assert len(set(lowered.values())) == len(rows.NAMES)


# --------------------------------------------------------------------------------------------- supports
def test_supports_conformance_cases():
    assert ct.declined_cases(OPS) == DECLINED


def test_declines_what_it_cannot_compute():
    ctx = Context()
    ids = ctx.tensor(I32, (3,))
    for t in (Q4_K, Q6_K, GType.Q8_1):
        assert not supports_op(ctx.set_rows(ctx.tensor(t, (256, 8)), ctx.tensor(F32, (256, 3)), ids)), t
    # GET_ROWS of I64 rows / Q8_1 rows (hand-made nodes: the reference has no I64 gather either)
    for t in (I64, GType.Q8_1, GType.Q8_K):
        a = ctx.tensor(t, (256, 4))
        out = F32 if t is not I64 else I64
        assert not supports_op(Tensor(out, (256, 3), op=Op.GET_ROWS, src=(a, ids))), t
    # I64 ids for GET_ROWS
    a = ctx.tensor(F32, (8, 4))
    assert not supports_op(Tensor(F32, (8, 3), op=Op.GET_ROWS, src=(a, ctx.tensor(I64, (3,)))))
    # and takes the rest
    assert supports_op(ctx.get_rows(ctx.tensor(Q6_K, (256, 4, 2)), ctx.tensor(I32, (5, 2))))
    assert supports_op(ctx.set_rows(ctx.tensor(Q4_1, (64, 8, 3)), ctx.tensor(F32, (64, 2, 3)),
                                    ctx.tensor(I64, (2, 1))))


# --------------------------------------------------------------------------------------------- planners
def _one(node, plan):
    ctx = ct.StubCtx()
    launch = ct.one_launch(plan(node, ctx), SOURCE, rows.NAMES)
    ct.covers(launch, int(launch.args[3]))
    return launch, ctx


def test_plan_get_rows():
    ctx0 = Context()
    a = ctx0.tensor(Q4_K, (256, 10, 3))
    ids = ctx0.tensor(I32, (7, 3))
    node = ctx0.get_rows(a, ids)
    launch, ctx = _one(node, rows.plan_get_rows)
    assert launch.kernel.name == "rows_get<rows_q4_k>"
    assert tuple(launch.args[:3]) == (ctx.ptr(a), ctx.ptr(ids), ctx.ptr(node))
    assert [int(x) for x in launch.args[3:]] == [256 * 7 * 3, 256, 7, 3, *a.nb, 10, 3, 1, *ids.nb[:3], *node.nb]


@pytest.mark.parametrize("dst_t, it, kernel", [(F16, I64, "rows_set<long long, rows_f16>"),
                                               (Q8_0, I32, "rows_set_q<int, rows_q8_0>")])
def test_plan_set_rows(dst_t, it, kernel):
    ctx0 = Context()
    dst = ctx0.tensor(dst_t, (64, 10, 2, 3))
    src = ctx0.tensor(F32, (64, 4, 2, 3))
    ids = ctx0.tensor(it, (4, 1, 3))
    node = ctx0.set_rows(dst, src, ids)
    launch, ctx = _one(node, rows.plan_set_rows)
    assert launch.kernel.name == kernel
    assert tuple(launch.args[:3]) == (ctx.ptr(src), ctx.ptr(ids), ctx.ptr(dst))
    ne0 = 2 if dst_t is Q8_0 else 64
    assert [int(x) for x in launch.args[3:]] == [ne0 * 4 * 2 * 3, ne0, 4, 2, *src.nb, 1, 3, *ids.nb[:3], 10,
                                                 *dst.nb]


def test_plan_empty():
    ctx0 = Context()
    node = ctx0.get_rows(ctx0.tensor(F32, (8, 4)), ctx0.tensor(I32, (0,)))
    assert rows.plan_get_rows(node, ct.StubCtx()) == []


# --------------------------------------------------------------------------------------------- host build
CASES = [c for c in ct.cases_for(OPS) if c.name not in DECLINED]


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_conformance_case_bytes(c, host_cc):
    ct.check_emulated(c, exact=True)


@pytest.mark.parametrize("t", [Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, GType.Q5_K, Q6_K])
def test_get_rows_random_blocks(t, host_cc):
    def build(b):
        k = 2 * t.block_size
        a = b.raw_leaf(t, (k, 6, 2), "a", ct.random_blocks(b.rng, t, 2 * 6 * 2))
        return b.ctx.get_rows(a, b.indices(I32, (9, 2), "ids", 6))
    ct.check_emulated(case(Op.GET_ROWS, build, (t,), type=t, values="random_blocks"), True)


def test_get_rows_strided_ids_and_nan_payloads(host_cc):
    def build(b):
        x = b.rng.uniform(-1, 1, (2, 5, 11)).astype(np.float32)
        # quiet NaNs keep their payload (the reference's float64 round trip quiets a signalling
        # NaN, which a GPU load/store does not: no signalling NaN here)
        x.view(np.uint32)[0, 1, :3] = (0x7FC00001, 0xFFC12345, 0x80000000)
        a = b.leaf(F32, (11, 5, 2), "a", x)
        leaf = b.ints(I32, (2, 4), "ids", b.rng.integers(0, 5, 8))
        ids = b.ctx.transpose(leaf)  # [4, 2] with ids.nb0 > ids.nb1
        return b.ctx.get_rows(a, ids)
    ct.check_emulated(case(Op.GET_ROWS, build, (F32,), type=F32, ids="transposed"), True)


@pytest.mark.parametrize("dst_t", [F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0])
@pytest.mark.parametrize("it", [I32, I64])
def test_set_rows_broadcast_ids_into_a_view(dst_t, it, host_cc):
    """ids [n, 1, 2] broadcast over src [k, n, 3, 2]; dst a row-strided view of a larger cache."""
    def build(b):
        k = 64
        cache = b.uniform(dst_t, (k + 2 * dst_t.block_size, 9, 3, 2), "cache")
        dst = b.ctx.view(cache, (k, 9, 3, 2), cache.nb[1:], offset=dst_t.row_size(dst_t.block_size))
        x = b.rng.uniform(-3, 3, (2, 3, 4, k)).astype(np.float32)
        if not dst_t.is_quantized:  # quantizing inf / NaN has no defined result (C casts of NaN)
            x[0, 0, 0, :4] = (np.inf, -np.inf, np.nan, -0.0)
        src = b.leaf(F32, (k, 4, 3, 2), "src", x)
        rows_ = np.stack([b.rng.permutation(9)[:4] for _ in range(2)])[:, None, :]
        ids = b.ints(it, (4, 1, 2), "ids", rows_)
        return b.ctx.set_rows(dst, src, ids)
    ct.check_emulated(case(Op.SET_ROWS, build, (dst_t, it), type=dst_t, idx=it, ids="broadcast"), True)


@pytest.mark.parametrize("c", CASES[::5], ids=[c.name for c in CASES[::5]])
def test_grid_stride_loops(c, host_cc):
    ct.check_emulated(c, exact=True, one_block=True)


def test_flat_index_both_widths(host_cc):
    """ggx_coords (rows_get / rows_set / rows_set_q's): the 32-bit path (element counts under 2^32)
    and the 64-bit one agree."""
    ct.check_flat_index(ct.host_build(SOURCE))
