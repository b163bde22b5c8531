"""MUL_MAT / MUL_MAT_ID (ggx_cuda/ops/matmul.py, kernels/dequant.cu) without a GPU: every name
expression compiles and lowers, launches match the kernel signatures, the planned launches
(run on numpy models of the kernels and of cuBLAS) reproduce the reference on every conformance
case, and the cuBLAS call structure (merged columns, strided batches, per-plane calls) is what the
strides allow."""
from __future__ import annotations

import dataclasses

import cuda_testing as ct
import numpy as np
import pytest

from ggx.graph import Context, build_graph
from ggx.ops import Op
from ggx.quants import dequantize, fp32_to_fp16
from ggx.tensor import Tensor
from ggx.types import GType
from ggx_cuda.driver import GemmLaunch, KernelLaunch
from ggx_cuda.kernels import NAME_EXPRESSIONS
from ggx_cuda.ops import matmul

F32, F16, BF16, I32 = GType.F32, GType.F16, GType.BF16, GType.I32
SOURCE = matmul.SOURCE


# --- (a) the source compiles ---------------------------------------------------------------------
@pytest.mark.parametrize("arch", ct.ARCHS)
def test_names_compile_and_lower(arch):
    lowered = ct.check_compiles(SOURCE, arch)  # and the PTX parameters are the parsed signature's
    assert set(lowered) == set(NAME_EXPRESSIONS[SOURCE])
    for expr, name in lowered.items():
        assert name.startswith("_Z"), (expr, name)


def test_every_planned_kernel_is_declared():
    declared = set(NAME_EXPRESSIONS[SOURCE])
    for t in matmul.WEIGHT_TYPES:
        assert matmul.convert_kernel(t, matmul.GEMM_TYPE[t]).name in declared
        assert matmul.convert_kernel(F32, matmul.GEMM_TYPE[t]).name in declared
        assert matmul.id_kernel(t).name in declared
    assert matmul.convert_kernel(BF16, F32).name in declared  # BF16 before Ampere
    assert matmul.ZERO_KERNEL.name in declared


# --- (c) support over the conformance cases -----------------------------------------------------
def _nodes(case, op):
    return [n for n in build_graph(case.make().out).nodes if n.op is op]


def test_conformance_cases_supported():
    cases = ct.cases_for((Op.MUL_MAT, Op.MUL_MAT_ID))
    assert len(cases) > 100
    declined = [c.name for c in cases for n in _nodes(c, c.op)
                if not (matmul.supports_mul_mat if c.op is Op.MUL_MAT else matmul.supports_mul_mat_id)(n)]
    assert declined == []


@pytest.mark.parametrize("case", ct.cases_for((Op.MUL_MAT,)), ids=lambda c: c.name)
def test_mul_mat_cases_on_models(case):
    ct.check_case(case, matmul.supports_mul_mat, matmul.plan_mul_mat)


@pytest.mark.parametrize("case", [c for c in ct.cases_for((Op.MUL_MAT,)) if dict(c.vars)["type_a"].is_quantized],
                         ids=lambda c: c.name)
def test_quantized_cases_on_the_cublas_fallback(case):
    """Quantized weights dequantized to F16 for cuBLAS, where ggml's rules or a layout leave them."""
    ct.check_case(case, matmul.supports_mul_mat, matmul.plan_cublas)


@pytest.mark.parametrize("case", [c for c in ct.cases_for((Op.MUL_MAT,)) if dict(c.vars)["k"] < 4096],
                         ids=lambda c: c.name)
def test_mul_mat_cases_on_host_kernels(case, host_cc):
    """The dequant.cu kernels themselves (compiled for the host) with the cuBLAS model."""
    ct.check_case(case, matmul.supports_mul_mat, matmul.plan_mul_mat, host=True)


@pytest.mark.parametrize("case", ct.cases_for((Op.MUL_MAT_ID,)), ids=lambda c: c.name)
def test_mul_mat_id_cases_on_host_kernels(case, host_cc):
    ct.check_case(case, matmul.supports_mul_mat_id, matmul.plan_mul_mat_id, host=True)


@pytest.mark.parametrize("case", [c for c in ct.cases_for((Op.MUL_MAT_ID,)) if dict(c.vars)["ids"] == "repeated"],
                         ids=lambda c: c.name)
def test_mul_mat_id_cases_on_models(case):
    ct.check_case(case, matmul.supports_mul_mat_id, matmul.plan_mul_mat_id)


#: byte offsets of the f16 scales in each block (random bytes there could be inf / NaN)
_SCALES = {GType.Q4_0: (0,), GType.Q4_1: (0, 2), GType.Q5_0: (0,), GType.Q8_0: (0,), GType.Q4_K: (0, 2),
           GType.Q5_K: (0, 2), GType.Q6_K: (208,)}


def _random_blocks(gtype, nvalues, rng):
    """Random bytes for nvalues of gtype (finite f16 scales, finite half values)."""
    if gtype is BF16:
        return ct.to_bf16_bits(rng.uniform(-4, 4, nvalues).astype(np.float32)).view(np.uint8).reshape(-1, 2)
    if gtype is F16:
        return rng.uniform(-4, 4, nvalues).astype(np.float16).view(np.uint8).reshape(-1, 2)
    blocks = rng.integers(0, 256, (nvalues // gtype.block_size, gtype.type_size), dtype=np.uint8)
    for off in _SCALES[gtype]:
        blocks[:, off: off + 2] = rng.uniform(-2, 2, blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks


@pytest.mark.parametrize("gtype", matmul.QUANT_TYPES + (F16, BF16), ids=lambda t: t.name)
def test_dequant_kernels_match_gguf_on_random_blocks(gtype, host_cc):
    """Random block bytes (every bit of the packed scales and quants) through the dequant.cu code
    compiled for the host, against ggx.quants.dequantize (the GGUF reference): k_mm_convert to
    F16 / BF16 (what cuBLAS gets) must round the exact values, k_mm_id's float path must match them."""
    rng = np.random.default_rng(7)
    K, M = 2 * gtype.block_size if gtype.is_quantized else 37, 3
    ctx = Context()
    experts = ctx.tensor(gtype, (K, M, 1))
    b, ids = ctx.tensor(F32, (K, 1, 1)), ctx.tensor(I32, (1, 1))
    node = ctx.mul_mat_id(experts, b, ids)
    blocks = _random_blocks(gtype, K * M, rng)
    want = dequantize(blocks, gtype, K * M)
    sc = ct.StubCtx()
    sc.mem.view(sc.ptr(experts), (blocks.size,), (1,), np.uint8)[:] = blocks.reshape(-1)
    out = sc.scratch(K * M * 2)
    half = matmul.GEMM_TYPE[gtype]  # F16, or BF16 for BF16 (a copy when strides need one)
    ct.run_launches([matmul._convert(experts, half, sc.ptr(experts), out)], sc, host=True)
    got = sc.mem.view(out, (K * M,), (2,), np.uint16)
    assert np.array_equal(got, ct.to_bf16_bits(want) if half is BF16 else fp32_to_fp16(want).view(np.uint16))
    bv = rng.uniform(-1, 1, K).astype(np.float32)
    sc.array(b, np.float32)[:] = bv
    sc.array(ids, np.int32)[:] = 0
    ct.run_launches(matmul.plan_mul_mat_id(node, sc), sc, host=True)
    ref = want.reshape(M, K).astype(np.float64) @ bv.astype(np.float64)
    np.testing.assert_allclose(sc.array(node, np.float32).reshape(M), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_declines():
    ctx = Context()
    b = ctx.tensor(F32, (64, 3))
    # types the graph refuses but a hand-made node could carry
    for t in (GType.Q8_1, GType.Q8_K, GType.I32):
        a = Tensor(t, (256, 4))
        node = Tensor(F32, (4, 3), op=Op.MUL_MAT, src=(a, ctx.tensor(F32, (256, 3))))
        assert not matmul.supports_mul_mat(node)
    # a non-F32 destination
    a = ctx.tensor(F16, (64, 4))
    node = Tensor(F16, (4, 3), op=Op.MUL_MAT, src=(a, b))
    assert not matmul.supports_mul_mat(node)
    # a float view whose offset is not a whole element (no aligned loads, no cuBLAS pointer)
    leaf = ctx.tensor(F32, (65, 4))
    odd = ctx.view(leaf, (64, 4), (leaf.nb[1],), offset=2)
    assert not matmul.supports_mul_mat(ctx.mul_mat(odd, b))
    assert matmul.supports_mul_mat(ctx.mul_mat(ctx.view(leaf, (64, 4), (leaf.nb[1],), offset=4), b))


# --- (b) planner structure ------------------------------------------------------------------------
def _plan(node):
    ctx = ct.StubCtx()
    launches = matmul.plan_mul_mat(node, ctx)
    return ctx, launches


def _gemms(launches):
    return [x for x in launches if isinstance(x, GemmLaunch)]


def test_f32_batched_in_place():
    ctx = Context()
    a, b = ctx.tensor(F32, (64, 16, 2, 3)), ctx.tensor(F32, (64, 8, 2, 3))
    node = ctx.mul_mat(a, b)
    sc, launches = _plan(node)
    assert launches == [GemmLaunch(sc.ptr(a), sc.ptr(b), sc.ptr(node), 16, 8, 64, 64, 64, 16, "f32", "f32",
                                   6, 64 * 16, 64 * 8, 16 * 8)]
    assert sc.scratches == []


def test_f16_broadcast_joins_columns():
    ctx = Context()
    a, b = ctx.tensor(F16, (64, 16, 2)), ctx.tensor(F32, (64, 5, 6))  # r2 = 3
    node = ctx.mul_mat(a, b)
    sc, launches = _plan(node)
    cvt, g = launches
    args = ct.bind(cvt)
    assert cvt.kernel == matmul.convert_kernel(F32, F16)
    assert int(args["src"]) == sc.ptr(b) and int(args["dst"]) == sc.scratches[0][0]
    assert sc.scratches[0][1] >= b.nelements * 2
    # the 3 b planes of each a plane are 15 columns of one product, batched over the 2 a planes
    assert g == GemmLaunch(sc.ptr(a), sc.scratches[0][0], sc.ptr(node), 16, 15, 64, 64, 64, 16, "f16", "f16",
                           2, 64 * 16, 3 * 5 * 64, 3 * 5 * 16)


def test_permuted_b_f32_strided_batch():
    ctx = Context()
    a = ctx.tensor(F32, (64, 16, 3))
    leaf = ctx.tensor(F32, (64, 3, 4))
    b = ctx.permute(leaf, 0, 2, 1, 3)  # [64, 4, 3]: rows 3 * 64 apart, planes 64 apart
    node = ctx.mul_mat(a, b)
    sc, launches = _plan(node)
    assert launches == [GemmLaunch(sc.ptr(a), sc.ptr(b), sc.ptr(node), 16, 4, 64, 64, 192, 16, "f32", "f32",
                                   3, 64 * 16, 64, 64)]


def test_permuted_b_with_broadcast_batches_with_stride_0():
    ctx = Context()
    a = ctx.tensor(F32, (64, 16, 2))
    b = ctx.permute(ctx.tensor(F32, (64, 6, 4)), 0, 2, 1, 3)  # [64, 4, 6], r2 = 3
    node = ctx.mul_mat(a, b)
    sc, launches = _plan(node)
    gemms = _gemms(launches)
    assert len(gemms) == 2 and all(g.batch == 3 and g.stride_a == 0 for g in gemms)
    assert [g.a for g in gemms] == [sc.ptr(a), sc.ptr(a) + 64 * 16 * 4]
    run_check(node, sc, launches)


def test_quantized_dequantizes_to_f16():
    """The fallback of quantized weights (layouts and devices the integer kernels do not take)."""
    ctx = Context()
    a, b = ctx.tensor(GType.Q4_K, (512, 8)), ctx.tensor(F32, (512, 3))
    node = ctx.mul_mat(a, b)
    sc = ct.StubCtx()
    launches = matmul.plan_cublas(node, sc)
    deq, cvt, g = launches
    assert deq.kernel == matmul.convert_kernel(GType.Q4_K, F16)
    assert cvt.kernel == matmul.convert_kernel(F32, F16)
    (base, size), = sc.scratches
    da, db = ct.bind(deq), ct.bind(cvt)
    assert int(da["src"]) == sc.ptr(a) and int(da["dst"]) == base
    assert int(db["dst"]) >= base + a.nelements * 2 and int(db["dst"]) + b.nelements * 2 <= base + size
    assert (g.a, g.b, g.c, g.a_dtype, g.lda) == (base, int(db["dst"]), sc.ptr(node), "f16", 512)


def test_decode_broadcast_uses_plane_strides_as_leading_dimension():
    ctx = Context()
    a = ctx.tensor(F32, (64, 16, 1, 1))
    b = ctx.permute(ctx.tensor(F32, (64, 4, 1)), 0, 2, 1, 3)  # [64, 1, 4]: one column per plane
    node = ctx.mul_mat(a, b)
    sc, launches = _plan(node)
    assert len(launches) == 1 and launches[0].n == 4 and launches[0].batch == 1
    run_check(node, sc, launches)


def test_k_zero_fills_zeros():
    ctx = Context()
    a, b = ctx.tensor(F32, (0, 5)), ctx.tensor(F32, (0, 3))
    node = Tensor(F32, (5, 3), op=Op.MUL_MAT, src=(a, b))  # the graph refuses it (nb1 = 0 < nb0)
    assert matmul.supports_mul_mat(node)
    sc = ct.StubCtx()
    launches = matmul.plan_mul_mat(node, sc)
    assert [x.kernel for x in launches] == [matmul.ZERO_KERNEL]
    assert int(ct.bind(launches[0])["n"]) == 15
    ct.run_launches(launches, sc)
    assert np.all(sc.array(node, np.float32) == 0)


def test_empty_output_plans_nothing():
    ctx = Context()
    node = ctx.mul_mat(ctx.tensor(F32, (64, 0)), ctx.tensor(F32, (64, 3)))
    assert matmul.plan_mul_mat(node, ct.StubCtx()) == []


def run_check(node, sc, launches):
    """Fill the sources with random values, run the launches on the models, compare with numpy."""
    rng = np.random.default_rng(0)
    a, b = node.src
    av = rng.uniform(-1, 1, tuple(reversed(a.ne))).astype(np.float32)
    bv = rng.uniform(-1, 1, tuple(reversed(b.ne))).astype(np.float32)
    sc.array(a, np.float32)[:] = av
    sc.array(b, np.float32)[:] = bv
    av, bv = sc.array(a, np.float32).copy(), sc.array(b, np.float32).copy()  # overlapping views
    ct.run_launches(launches, sc)
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    want = bv @ np.swapaxes(np.repeat(np.repeat(av, r3, axis=0), r2, axis=1), -1, -2)
    np.testing.assert_allclose(sc.array(node, np.float32), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a_ne,b_ne,perm", [
    ((32, 8, 2, 3), (32, 5, 2, 3), False), ((32, 8, 1, 2), (32, 5, 4, 6), False),
    ((32, 8, 2, 1), (32, 1, 6, 2), False), ((32, 8, 3, 2), (32, 4, 3, 4), True),
    ((32, 1, 2, 1), (32, 3, 4, 1), False), ((32, 8, 1, 1), (32, 1, 1, 1), False),
])
def test_planes_f32(a_ne, b_ne, perm):
    ctx = Context()
    a = ctx.tensor(F32, a_ne)
    if perm:
        b = ctx.permute(ctx.tensor(F32, (b_ne[0], b_ne[2], b_ne[1], b_ne[3])), 0, 2, 1, 3)
    else:
        b = ctx.tensor(F32, b_ne)
    node = ctx.mul_mat(a, b)
    sc, launches = _plan(node)
    run_check(node, sc, launches)


def test_a_permuted_planes():
    ctx = Context()
    a = ctx.permute(ctx.tensor(F32, (32, 8, 3, 2)), 0, 1, 3, 2)  # [32, 8, 2, 3], dims 2/3 swapped
    b = ctx.tensor(F32, (32, 5, 4, 3))
    node = ctx.mul_mat(a, b)
    sc, launches = _plan(node)
    assert all(isinstance(x, GemmLaunch) for x in launches)
    run_check(node, sc, launches)


def test_overlapping_rows_are_copied_first():
    """b rows closer than the row length (a view cuBLAS cannot take as ldb): copied contiguously."""
    ctx = Context()
    a = ctx.tensor(F32, (32, 8))
    leaf = ctx.tensor(F32, (64,))
    b = ctx.view(leaf, (32, 3), (16 * 4,))  # rows overlap
    node = ctx.mul_mat(a, b)
    sc, launches = _plan(node)
    assert isinstance(launches[0], KernelLaunch) and launches[0].kernel == matmul.convert_kernel(F32, F32)
    g = launches[1]
    assert g.b == sc.scratches[0][0] and g.ldb == 32
    run_check(node, sc, launches)


# --- MUL_MAT_ID -------------------------------------------------------------------------------------
def test_mul_mat_id_launch():
    ctx = Context()
    experts = ctx.tensor(GType.Q8_0, (64, 10, 4))
    b = ctx.tensor(F32, (64, 1, 5))
    ids = ctx.tensor(I32, (2, 5))
    node = ctx.mul_mat_id(experts, b, ids)
    sc = ct.StubCtx()
    launch, = matmul.plan_mul_mat_id(node, sc)
    assert launch.kernel == matmul.id_kernel(GType.Q8_0)
    assert launch.grid == (3, 2, 5) and launch.block == (128, 1, 1)
    args = ct.bind(launch)
    assert [int(args[x]) for x in ("as", "b", "ids", "dst")] == [sc.ptr(t) for t in (experts, b, ids, node)]
    assert [int(args[x]) for x in ("K", "M", "n_expert", "n_used", "n_tokens", "b_ne1")] == [64, 10, 4, 2, 5, 1]


def test_mul_mat_id_bad_id_gives_nan():
    ctx = Context()
    experts, b, ids = ctx.tensor(F32, (32, 4, 3)), ctx.tensor(F32, (32, 2, 2)), ctx.tensor(I32, (2, 2))
    node = ctx.mul_mat_id(experts, b, ids)
    sc = ct.StubCtx()
    sc.array(experts, np.float32)[:] = 1
    sc.array(b, np.float32)[:] = 1
    sc.array(ids, np.int32)[:] = [[0, 7], [2, -1]]
    ct.run_launches(matmul.plan_mul_mat_id(node, sc), sc)
    out = sc.array(node, np.float32)[0]  # (tokens, slots, M)
    assert np.all(out[0, 0] == 32) and np.all(np.isnan(out[0, 1]))
    assert np.all(out[1, 0] == 32) and np.all(np.isnan(out[1, 1]))


def test_mul_mat_id_many_tokens_fold_into_grid_limits():
    ctx = Context()
    node = ctx.mul_mat_id(ctx.tensor(F16, (32, 4, 8)), ctx.tensor(F32, (32, 1, 70000)), ctx.tensor(I32, (2, 70000)))
    launch, = matmul.plan_mul_mat_id(node, ct.StubCtx())
    assert launch.grid == (1, 2, 65535)


def test_bf16_before_ampere_goes_as_f32():
    ctx = Context()
    a, b = ctx.tensor(BF16, (64, 8, 2)), ctx.tensor(F32, (64, 3, 2))
    node = ctx.mul_mat(a, b)
    turing = ct.StubCtx(dataclasses.replace(ct.H100, cc=(7, 5)))
    launches = matmul.plan_mul_mat(node, turing)
    cvt, g = launches
    assert cvt.kernel == matmul.convert_kernel(BF16, F32)
    assert (g.a, g.b, g.a_dtype, g.b_dtype) == (turing.scratches[0][0], turing.ptr(b), "f32", "f32")
    assert _gemms(_plan(node)[1])[0].a_dtype == "bf16"  # sm_90: BF16 cuBLAS
    rng = np.random.default_rng(1)
    av = rng.uniform(-1, 1, tuple(reversed(a.ne))).astype(np.float32)
    turing.mem.view(turing.ptr(a), (a.nelements,), (2,), np.uint16)[:] = ct.to_bf16_bits(av).reshape(-1)
    turing.array(b, np.float32)[:] = rng.uniform(-1, 1, tuple(reversed(b.ne)))
    ct.run_launches(launches, turing, host=ct.host_build(SOURCE) is not None)
    want = turing.array(b, np.float32).astype(np.float64) @ np.swapaxes(ct.bf16_to_f32(ct.to_bf16_bits(av)), -1, -2)
    np.testing.assert_allclose(turing.array(node, np.float32), want, rtol=1e-5, atol=1e-5)
