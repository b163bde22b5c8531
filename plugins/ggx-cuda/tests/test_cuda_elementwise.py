"""ADD, MUL, SCALE, SILU, GELU, GLU, SUM_ROWS (ggx_cuda/ops/elementwise.py, kernels/elementwise.cu)
without a GPU: NVRTC compiles every instantiation, the planners' launches match the kernels'
signatures and cover the work, the support predicates take the conformance cases, and the kernels
built for the host (cuda_testing.host_build) pass the cases against the reference backend (ADD /
MUL bit for bit)."""
from __future__ import annotations

import cuda_testing as ct
import numpy as np
import pytest

from ggx.conformance.cases import SPECIAL_VALUES, case
from ggx.graph import Context
from ggx.ops import GeluKind, GluKind, Op, ScaleParams
from ggx.tensor import Tensor
from ggx.types import GType
from ggx_cuda.kernels import NAME_EXPRESSIONS
from ggx_cuda.ops import TABLE, elementwise, load_all, supports_op

F32, F16 = GType.F32, GType.F16
OPS = (Op.ADD, Op.MUL, Op.SCALE, Op.SILU, Op.GELU, Op.GLU, Op.SUM_ROWS)
SOURCE = "elementwise.cu"
EXACT_OPS = (Op.ADD, Op.MUL)  # one f32 rounding of an exact sum / product: the reference's bytes
#: emulated with one fiber per CUDA thread and a barrier per step (block reductions): slow on the
#: host for a thousand rows, so only the planner and support checks see this case
SLOW_ON_HOST = {"SUM_ROWS(ne=[10,10,10,10])"}


def test_registered():
    load_all()
    for op in OPS:
        assert TABLE[op].plan.__module__ == elementwise.__name__
    assert NAME_EXPRESSIONS[SOURCE] == elementwise.NAMES


@pytest.mark.parametrize("arch", ct.ARCHS)
def test_names_compile(arch):
    lowered = ct.check_compiles(SOURCE, arch)
    assert len(set(lowered.values())) == len(elementwise.NAMES)


# --------------------------------------------------------------------------------------------- supports
def test_supports_conformance_cases():
    assert ct.declined_cases(OPS) == set()


def test_declines_what_it_cannot_compute():
    ctx = Context()
    a32, a16 = ctx.tensor(F32, (8, 4)), ctx.tensor(F16, (8, 4))
    # F16 operands (the graph refuses them; hand-made nodes)
    assert not supports_op(Tensor(F32, (8, 4), op=Op.ADD, src=(a32, a16)))
    assert not supports_op(Tensor(F16, (8, 4), op=Op.SCALE, params=ScaleParams(2.0), src=(a16,)))
    assert not supports_op(Tensor(F32, (1, 4), op=Op.SUM_ROWS, src=(a16,)))
    # b that does not divide a
    assert not supports_op(Tensor(F32, (8, 4), op=Op.MUL, src=(a32, ctx.tensor(F32, (3, 4)))))
    # GLU with a fused row that is not two halves of the output row
    assert not supports_op(Tensor(F32, (3, 4), op=Op.GLU, params=ctx.swiglu(a32).params, src=(a32,)))
    assert supports_op(ctx.glu(a32, None, GluKind.GEGLU, True))


# --------------------------------------------------------------------------------------------- planners
def _one(node):
    ctx = ct.StubCtx()
    launch = ct.one_launch(TABLE[node.op].plan(node, ctx), SOURCE, elementwise.NAMES)
    assert launch.block[0] <= 1024
    return launch, ctx


def test_plan_binary_broadcast_strided():
    ctx0 = Context()
    a = ctx0.permute(ctx0.tensor(F32, (37, 2, 5, 3)), 0, 2, 1, 3)
    b = ctx0.transpose(ctx0.tensor(F32, (1, 37, 2)))
    node = ctx0.add(a, b)
    launch, ctx = _one(node)
    ct.covers(launch, node.nelements)
    assert launch.kernel.name == "ew_binary<0>"
    assert tuple(launch.args[:3]) == (ctx.ptr(a), ctx.ptr(b), ctx.ptr(node))
    assert [int(x) for x in launch.args[3:]] == [node.nelements, *node.ne[:3], *a.nb, *b.ne, *b.nb, *node.nb]
    assert _one(ctx0.mul(a, b))[0].kernel.name == "ew_binary<1>"


@pytest.mark.parametrize("build, name", [
    (lambda c, a: c.scale(a, 0.37, 0.5), "ew_unary<0>"),
    (lambda c, a: c.silu(a), "ew_unary<1>"),
    (lambda c, a: c.gelu(a, GeluKind.TANH), "ew_unary<2>"),
    (lambda c, a: c.gelu(a, GeluKind.ERF), "ew_unary<3>"),
    (lambda c, a: c.gelu(a, GeluKind.QUICK), "ew_unary<4>"),
])
def test_plan_unary(build, name):
    ctx0 = Context()
    a = ctx0.transpose(ctx0.tensor(F32, (5, 37)))
    node = build(ctx0, a)
    launch, ctx = _one(node)
    ct.covers(launch, node.nelements)
    assert launch.kernel.name == name
    assert tuple(launch.args[:2]) == (ctx.ptr(a), ctx.ptr(node))
    assert [int(x) for x in launch.args[2:-2]] == [node.nelements, *node.ne[:3], *a.nb, *node.nb]
    s, b = (np.float32(0.37), np.float32(0.5)) if node.op is Op.SCALE else (0, 0)
    assert launch.args[-2:] == (s, b)


@pytest.mark.parametrize("swapped", [False, True])
def test_plan_glu_fused_halves(swapped):
    ctx0 = Context()
    a = ctx0.tensor(F32, (2 * 37, 5))
    node = ctx0.glu(a, None, GluKind.SWIGLU, swapped)
    launch, ctx = _one(node)
    ct.covers(launch, node.nelements)
    gate, up = (ctx.ptr(a) + 37 * 4, ctx.ptr(a)) if swapped else (ctx.ptr(a), ctx.ptr(a) + 37 * 4)
    assert tuple(launch.args[:3]) == (gate, up, ctx.ptr(node))
    assert [int(x) for x in launch.args[3:]] == [node.nelements, *node.ne[:3], *a.nb, *a.nb, *node.nb]


def test_plan_glu_split():
    ctx0 = Context()
    a, b = ctx0.tensor(F32, (576, 3)), ctx0.tensor(F32, (576, 3))
    node = ctx0.glu(a, b, GluKind.GEGLU, True)  # swapped means nothing with two sources
    launch, ctx = _one(node)
    assert launch.kernel.name == "ew_glu<1>"
    assert tuple(launch.args[:3]) == (ctx.ptr(a), ctx.ptr(b), ctx.ptr(node))


@pytest.mark.parametrize("ne0, block", [(1, 32), (256, 32), (576, 128), (4096, 256)])
def test_plan_sum_rows(ne0, block):
    ctx0 = Context()
    a = ctx0.tensor(F32, (ne0, 7, 3))
    node = ctx0.sum_rows(a)
    launch, ctx = _one(node)
    assert launch.kernel.name == "ew_sum_rows"
    assert launch.grid == (21, 1, 1) and launch.block == (block, 1, 1)
    assert tuple(launch.args[:2]) == (ctx.ptr(a), ctx.ptr(node))
    assert [int(x) for x in launch.args[2:]] == [21, ne0, 7, 3, *a.nb, *node.nb[1:]]


def test_plan_empty():
    ctx0 = Context()
    assert elementwise.plan_unary(ctx0.silu(ctx0.tensor(F32, (0, 3))), ct.StubCtx()) == []
    assert elementwise.plan_sum_rows(ctx0.sum_rows(ctx0.tensor(F32, (5, 0))), ct.StubCtx()) == []


# --------------------------------------------------------------------------------------------- host build
CASES = [c for c in ct.cases_for(OPS) if c.name not in SLOW_ON_HOST]


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_conformance_case(c, host_cc):
    ct.check_emulated(c, exact=c.op in EXACT_OPS)


@pytest.mark.parametrize("how", ["add_both_strided", "glu_fused_view", "glu_swapped_view", "sum_rows_transposed",
                                 "scale_permuted", "geglu_special"])
def test_strided_operands(how, host_cc):
    def build(b):
        ctx = b.ctx
        if how == "add_both_strided":
            a = b.permuted(F32, (16, 6, 4, 2), (0, 2, 1, 3), "a")
            return ctx.add(a, b.transposed(F32, (16, 3, 1, 2), "b"))
        if how in ("glu_fused_view", "glu_swapped_view"):
            a = b.permuted(F32, (2 * 19, 4, 3), (0, 2, 1, 3), "a")
            return ctx.glu(a, None, GluKind.GEGLU if how == "glu_fused_view" else GluKind.SWIGLU,
                           how == "glu_swapped_view")
        if how == "sum_rows_transposed":
            return ctx.sum_rows(b.transposed(F32, (45, 6, 2), "a"))
        if how == "scale_permuted":
            return ctx.scale(b.permuted(F32, (7, 5, 3), (2, 0, 1, 3), "a"), -1.25, 0.75)
        x = b.rng.uniform(-6, 6, (3, 2 * 37)).astype(np.float32)
        x[0, : len(SPECIAL_VALUES)] = SPECIAL_VALUES
        x[1, 37: 37 + len(SPECIAL_VALUES)] = SPECIAL_VALUES
        return ctx.glu(b.leaf(F32, (2 * 37, 3), "a", x), None, GluKind.GEGLU)
    op = {"add": Op.ADD, "glu": Op.GLU, "sum": Op.SUM_ROWS, "sca": Op.SCALE, "geg": Op.GLU}[how[:3]]
    label = "GLU_GEGLU" if how in ("glu_fused_view", "geglu_special") else ""
    c = case(op, build, (F32,), label=label, layout=how)
    ct.check_emulated(c, exact=op is Op.ADD)


@pytest.mark.parametrize("c", CASES[::6], ids=[c.name for c in CASES[::6]])
def test_grid_stride_loops(c, host_cc):
    ct.check_emulated(c, exact=c.op in EXACT_OPS, one_block=True)


def test_flat_index_both_widths(host_cc):
    """ggx_coords (ew_binary / ew_unary / ew_glu's): the 32-bit path (element counts under 2^32)
    and the 64-bit one agree."""
    ct.check_flat_index(ct.host_build(SOURCE))
