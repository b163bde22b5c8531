"""CPY / DUP / CONT (ggx_cuda/ops/copy.py, kernels/copy.cu) without a GPU: NVRTC compiles every
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
from ggx_cuda.ops import TABLE, copy, load_all, supports_op

F32, F16, BF16, I32, I64 = GType.F32, GType.F16, GType.BF16, GType.I32, GType.I64
Q4_0, Q4_1, Q5_0, Q8_0 = GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0
Q4_K, Q6_K = GType.Q4_K, GType.Q6_K
OPS = (Op.CPY, Op.DUP, Op.CONT)
SOURCE = "copy.cu"
#: conversions the backend declines: the K-quant scale search (make_qkx2_quants, make_qx_quants)
#: is not ported to CUDA (ggml-cuda does not copy into K-quants either)
DECLINED = {f"CPY(src=f32,dst={t},ne=[256,5,3])" for t in ("q4_K", "q5_K", "q6_K")}


def test_registered():
    load_all()
    for op in OPS:
        assert TABLE[op].supports is copy.supports_copy and TABLE[op].plan is copy.plan_copy
    assert NAME_EXPRESSIONS[SOURCE] == copy.NAMES


@pytest.mark.parametrize("arch", ct.ARCHS)
def test_names_compile(arch):
    lowered = ct.check_compiles(SOURCE, arch)
    assert len(set(lowered.values())) == len(copy.NAMES)


# --------------------------------------------------------------------------------------------- supports
def test_supports_conformance_cases():
    assert ct.declined_cases(OPS) == DECLINED


def test_declines_what_it_cannot_compute():
    ctx = Context()
    a = ctx.tensor(F32, (256, 4))
    for t in (Q4_K, Q6_K, GType.Q8_1, GType.Q8_K, I32):
        assert not supports_op(ctx.cpy(a, ctx.tensor(t, (256, 4)))), t
    # a quantized destination that is not contiguous (the graph refuses it; a hand-made node too)
    b = ctx.tensor(Q8_0, (64, 4))
    view = Tensor(Q8_0, (32, 4), (34, 68, 272, 272), op=Op.CPY, src=(ctx.tensor(F32, (32, 4)), b), view_src=b)
    assert not supports_op(view)
    # element counts that differ
    bad = Tensor(F32, (8, 2), op=Op.CPY, src=(ctx.tensor(F32, (4, 2)), ctx.tensor(F32, (8, 2))))
    assert not supports_op(bad)
    # quantized to anything else: the graph refuses it, the predicate too
    q = ctx.tensor(Q4_0, (64, 2))
    assert not supports_op(Tensor(F32, (64, 2), op=Op.CPY, src=(q, ctx.tensor(F32, (64, 2)))))
    # and takes the rest
    assert supports_op(ctx.cpy(ctx.tensor(F16, (7, 3)), ctx.tensor(BF16, (21,))))
    assert supports_op(ctx.cpy(ctx.tensor(BF16, (64, 3)), ctx.tensor(Q4_1, (64, 3))))
    assert supports_op(ctx.cont(ctx.transpose(ctx.tensor(I64, (3, 5)))))
    assert supports_op(ctx.dup(ctx.tensor(Q6_K, (256, 2))))


# --------------------------------------------------------------------------------------------- planners
def _one(node, ctx=None):
    ctx = ctx or ct.StubCtx()
    launch = ct.one_launch(copy.plan_copy(node, ctx), SOURCE, copy.NAMES)
    ct.covers(launch, int(launch.args[2]))
    return launch, ctx


def test_plan_convert_strided():
    ctx0 = Context()
    a = ctx0.transpose(ctx0.tensor(F32, (5, 64, 3)))
    b = ctx0.tensor(F16, (64, 5, 3))
    node = ctx0.cpy(a, b)
    launch, ctx = _one(node)
    assert launch.kernel.name == "cpy_convert<cpy_f32, cpy_f16>"
    assert launch.args[0] == ctx.ptr(a) and launch.args[1] == ctx.ptr(node) == ctx.ptr(b)
    assert [int(x) for x in launch.args[2:]] == [a.nelements, *a.ne[:3], *a.nb, *node.ne[:3], *node.nb]


def test_plan_raw_units():
    ctx0 = Context()
    # contiguous same-type copies collapse to one run of the widest unit
    launch, _ = _one(ctx0.dup(ctx0.tensor(F32, (37, 5))))
    assert launch.kernel.name == "cpy_raw<unsigned int>"  # 4-byte elements
    assert [int(x) for x in launch.args[2:5]] == [185, 1, 185]
    launch, _ = _one(ctx0.dup(ctx0.tensor(Q4_0, (64, 3))))  # 18-byte blocks: 9 units of 2
    assert launch.kernel.name == "cpy_raw<unsigned short>"
    assert [int(x) for x in launch.args[2:4]] == [6 * 9, 9]
    launch, _ = _one(ctx0.dup(ctx0.tensor(Q4_K, (256, 3))))  # 144-byte blocks: 18 units of 8
    assert launch.kernel.name == "cpy_raw<unsigned long long>"
    assert [int(x) for x in launch.args[2:4]] == [3 * 18, 18]
    launch, _ = _one(ctx0.cont(ctx0.transpose(ctx0.tensor(F16, (3, 5)))))  # strided: not collapsed
    assert launch.kernel.name == "cpy_raw<unsigned short>"
    assert [int(x) for x in launch.args[4:7]] == [5, 3, 1]


def test_plan_raw_unit_follows_alignment():
    ctx0 = Context()
    node = ctx0.dup(ctx0.tensor(I64, (4, 2)))

    class Odd(ct.StubCtx):
        def ptr(self, t):
            return super().ptr(t) + (2 if t is node.src[0] else 0)
    launch, _ = _one(node, Odd())
    assert launch.kernel.name == "cpy_raw<unsigned short>"
    assert [int(x) for x in launch.args[2:4]] == [8 * 4, 4]


def test_plan_to_quant():
    ctx0 = Context()
    a = ctx0.permute(ctx0.tensor(F32, (64, 3, 5)), 0, 2, 1, 3)
    b = ctx0.tensor(Q4_1, (64, 5, 3))
    launch, ctx = _one(ctx0.cpy(a, b))
    assert launch.kernel.name == "cpy_to_q<cpy_f32, cpy_q4_1>"
    assert launch.args[0] == ctx.ptr(a) and launch.args[1] == ctx.ptr(b)
    assert [int(x) for x in launch.args[2:]] == [2 * 5 * 3, *a.ne[:3], *a.nb]


def test_plan_empty():
    ctx0 = Context()
    assert copy.plan_copy(ctx0.dup(ctx0.tensor(F32, (0, 4))), ct.StubCtx()) == []


# --------------------------------------------------------------------------------------------- host build
CASES = [c for c in ct.cases_for(OPS) if c.name not in DECLINED]


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_conformance_case_bytes(c, host_cc):
    ct.check_emulated(c, exact=True)


def _f32_bits(*bits: int) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


#: values where the conversions round or special-case: NaN (quiet, signalling, negative, with
#: payload), infinities, signed zeros, F16 overflow and subnormals, ties to even, BF16 overflow
SPECIAL = np.concatenate([
    _f32_bits(0x7FC00000, 0x7F800001, 0xFFC00001, 0x7F810000, 0x7F800000, 0xFF800000, 0x80000000),
    np.array([0.0, 65504.0, 65519.99, 65520.0, -70000.0, 1e-8, 6e-8, -3e-5, 2.0**-24, 2.0**-25,
              1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 3.4e38,
              3.3961776e38, -3.4028235e38, 1e-40, -1e-45, 0.1, 1 / 3], dtype=np.float32),
])


def _special_rows(rng: np.random.Generator, ne0: int, nrows: int) -> np.ndarray:
    x = rng.uniform(-2, 2, (nrows, ne0)).astype(np.float32)
    flat = x.reshape(-1)
    flat[: SPECIAL.size] = SPECIAL
    return x


@pytest.mark.parametrize("dst_t", [F16, BF16, F32])
def test_special_values_bytes(dst_t, host_cc):
    def build(b):
        a = b.leaf(F32, (37, 3), "a", _special_rows(b.rng, 37, 3))
        return b.ctx.cpy(a, b.leaf(dst_t, (37, 3), "b"))
    ct.check_emulated(case(Op.CPY, build, (dst_t, F32), src=F32, dst=dst_t, values="special"), True)


def _quant_blocks(rng: np.random.Generator, nblocks: int) -> np.ndarray:
    """Blocks of 32 that stress the quantizers: zeros, constants, ties of roundf and of the
    +8.5 / +0.5 truncations, a negative extreme, values whose scale underflows or overflows F16."""
    blocks = [np.zeros(32), np.full(32, 0.75), np.full(32, -3.0)]
    ties = np.linspace(-127, 127, 32)
    ties[:8] = [127.0, 2.5, -2.5, 0.5, -0.5, 3.5, -126.5, 1.5]  # amax 127: d = 1, x * id = x
    blocks.append(ties)
    q40 = np.arange(32) % 16 - 7.5
    q40[0] = -8.0  # max of magnitude -8: d = 1, x + 8.5 lands on integers and halves
    blocks.append(q40)
    blocks.append(np.arange(32) / 2.0)  # Q4_1: min 0, d = 15.5 / 15
    blocks.append(rng.uniform(-1, 1, 32) * 1e-30)  # d underflows F16 to 0
    blocks.append(rng.uniform(-1, 1, 32) * 1e6)  # d overflows F16 to inf
    blocks.append(-np.abs(rng.uniform(-1, 1, 32)))
    blocks.append(np.where(np.arange(32) == 5, -9.0, rng.uniform(-9, 9, 32)))  # first extreme wins
    # products x * id just below a half-integer that round onto it: a fused multiply-add would
    # truncate one step lower (found by search; Q4_0's x * id + 8.5, Q4_1's (x - min) * id + 0.5)
    blocks.append(np.array([-0.6308060884475708, -0.19712692499160767, 0.1971268504858017,
                            0.27597761154174805, 0.43367913365364075] + [0.0] * 27))
    blocks.append(np.array([-0.14868438243865967, 0.43235766887664795, -0.1293163150548935] + [0.0] * 29))
    while len(blocks) < nblocks:
        blocks.append(rng.uniform(-1, 1, 32) * rng.choice([1.0, 1e-3, 100.0]))
    return np.stack(blocks[:nblocks]).astype(np.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # reading back blocks whose F16 scale is inf
@pytest.mark.parametrize("dst_t", [Q8_0, Q4_0, Q4_1, Q5_0])
def test_quantizer_edge_blocks_bytes(dst_t, host_cc):
    def build(b):
        a = b.leaf(F32, (64, 8), "a", _quant_blocks(b.rng, 16).reshape(8, 64))
        return b.ctx.cpy(a, b.leaf(dst_t, (64, 8), "b"))
    ct.check_emulated(case(Op.CPY, build, (dst_t, F32), src=F32, dst=dst_t, values="edges"), True)


@pytest.mark.parametrize("src_t", [F16, BF16])
@pytest.mark.parametrize("dst_t", [Q8_0, Q4_0, Q5_0])
def test_half_sources_to_quant(src_t, dst_t, host_cc):
    def build(b):
        return b.ctx.cpy(b.transposed(src_t, (64, 6), "a"), b.leaf(dst_t, (64, 6), "b"))
    ct.check_emulated(case(Op.CPY, build, (dst_t, src_t), src=src_t, dst=dst_t), True)


def test_reshaping_copy_into_quant(host_cc):
    # a transposed source of another shape: blocks of the destination span source rows
    def build(b):
        return b.ctx.cpy(b.transposed(F32, (24, 8), "a"), b.leaf(Q8_0, (64, 3), "b"))
    ct.check_emulated(case(Op.CPY, build, (Q8_0, F32), src=F32, dst=Q8_0, ne=(24, 8)), True)


@pytest.mark.parametrize("how", ["i64_transposed", "q4_0_permuted", "q6_k", "bf16_row_strided", "f16_to_bf16"])
def test_other_layouts(how, host_cc):
    def build(b):
        if how == "i64_transposed":
            leaf = b.ints(I64, (5, 7, 2), "a", b.rng.integers(-2**40, 2**40, 70))
            return b.ctx.cont(b.ctx.transpose(leaf))
        if how == "q4_0_permuted":
            return b.ctx.cont(b.permuted(Q4_0, (64, 3, 4), (0, 2, 1, 3), "a"))
        if how == "q6_k":
            return b.ctx.cpy(b.uniform(Q6_K, (256, 3), "a"), b.leaf(Q6_K, (256, 3), "b"))
        if how == "bf16_row_strided":
            return b.ctx.dup(b.row_strided(BF16, (19, 4, 2), "a"))
        return b.ctx.cpy(b.permuted(F16, (19, 4, 3), (0, 2, 1, 3), "a"), b.leaf(BF16, (19, 4, 3), "b"))
    ct.check_emulated(case(Op.CONT, build, (F32,), layout=how), True)


@pytest.mark.parametrize("c", CASES[::7], ids=[c.name for c in CASES[::7]])
def test_grid_stride_loops(c, host_cc):
    ct.check_emulated(c, exact=True, one_block=True)


def test_flat_index_both_widths(host_cc):
    """ggx_coords (cpy_raw / cpy_convert / cpy_to_q's): the 32-bit path (element counts under 2^32)
    and the 64-bit one agree."""
    ct.check_flat_index(ct.host_build(SOURCE))
