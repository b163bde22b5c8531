"""MMVQ (ggx_cuda/ops/mmvq.py, kernels/mmvq.cu) and the q8_1 activations (ops/q8_1.py,
kernels/quantize.cu) without a GPU: ggml's dispatch rules as pure functions (each test names the
ggml rule it mirrors), the sources compile for sm_80 / sm_90 with every instantiation lowered, and
the kernels compiled for the host run against their numpy models (int_models.py: the quantizer
byte for byte, the products to float32 rounding) and against the reference backend (the
conformance cases, tests/test_cuda_matmul.py, go through MMVQ for quantized weights and <= 8
columns)."""
from __future__ import annotations

import dataclasses

import cuda_testing as ct
import int_models
import numpy as np
import pytest

from ggx.conformance.harness import compare
from ggx.graph import Context
from ggx.ops import Op
from ggx.types import GType
from ggx_cuda import arch
from ggx_cuda.kernels import NAME_EXPRESSIONS
from ggx_cuda.ops import matmul, mmvq, q8_1

F32 = GType.F32
Q4_0, Q4_1, Q5_0, Q8_0 = GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0
Q4_K, Q5_K, Q6_K = GType.Q4_K, GType.Q5_K, GType.Q6_K
TYPES = mmvq.TYPES
ADA = dataclasses.replace(ct.H100, cc=(8, 9))
TURING = dataclasses.replace(ct.H100, cc=(7, 5))


@pytest.mark.parametrize("arch_", ct.ARCHS)
@pytest.mark.parametrize("source", [mmvq.SOURCE, q8_1.SOURCE])
def test_names_compile_and_lower(source, arch_):
    lowered = ct.check_compiles(source, arch_)  # and the PTX parameters are the parsed signature's
    assert set(lowered) == set(NAME_EXPRESSIONS[source])


# --- ggml's rules -------------------------------------------------------------------------------------
def test_should_use_mmvq_mirrors_ggml():
    """mmvq.cu ggml_cuda_should_use_mmvq: quantized types up to MMVQ_MAX_BATCH_SIZE (8) columns; on
    Ada Lovelace (890) Q4_K / Q5_K up to 7, on Blackwell (1200) Q4_K / Q5_K up to 5 and Q6_K up to 7."""
    assert mmvq.MMVQ_MAX_BATCH_SIZE == 8
    for t in TYPES:
        for cc in (arch.TURING, arch.AMPERE, arch.HOPPER, arch.DGX_SPARK):
            assert mmvq.should_use_mmvq(t, cc, 8) and not mmvq.should_use_mmvq(t, cc, 9)
    assert not mmvq.should_use_mmvq(GType.F16, arch.HOPPER, 1) and not mmvq.should_use_mmvq(F32, arch.HOPPER, 1)
    for t, ada, bw in ((Q4_0, 8, 8), (Q8_0, 8, 8), (Q4_K, 7, 5), (Q5_K, 7, 5), (Q6_K, 8, 7)):
        for cc, most in ((arch.ADA_LOVELACE, ada), (arch.BLACKWELL, bw)):
            assert mmvq.should_use_mmvq(t, cc, most) and not mmvq.should_use_mmvq(t, cc, most + 1)


def test_warps_and_rows_per_block_mirror_ggml():
    """mmvq.cu calc_nwarps / calc_rows_per_block, NVIDIA tables: GENERIC 4 warps for 1-4 columns and 2
    for 5-8, 1 row per block for one column and 2 above; TURING (7.5) gives K-quants 2 warps at one
    column."""
    for cc in (arch.AMPERE, arch.HOPPER, arch.PASCAL + 10):
        assert [mmvq.nwarps(Q4_0, n, cc) for n in range(1, 9)] == [4, 4, 4, 4, 2, 2, 2, 2]
        assert [mmvq.nwarps(Q6_K, n, cc) for n in range(1, 9)] == [4, 4, 4, 4, 2, 2, 2, 2]
    assert [mmvq.nwarps(Q4_K, n, arch.TURING) for n in range(1, 9)] == [2, 4, 4, 4, 2, 2, 2, 2]
    assert mmvq.nwarps(Q4_0, 1, arch.TURING) == 4
    assert [mmvq.rows_per_block(n, False, 4) for n in range(1, 9)] == [1, 2, 2, 2, 2, 2, 2, 2]


def test_small_k_mirrors_ggml():
    """mul_mat_vec_q_switch_ncols_dst's should_use_small_k: one column, nwarps > 1, and a row shorter
    than one pass of the block (blocks_per_row < nwarps * vdr * 32 / qi): each warp then takes a row
    (rows_per_block = nwarps)."""
    # Q4_0: qi 4, vdr 2 -> 16 blocks per warp pass, 64 per block: K < 64 * 32 = 2048
    assert mmvq.geometry(Q4_0, 1, arch.HOPPER, 2016) == (4, 4)
    assert mmvq.geometry(Q4_0, 1, arch.HOPPER, 2048) == (4, 1)
    # Q4_K: qi 32, vdr 2 -> 2 super-blocks per warp pass: K < 8 * 256
    assert mmvq.geometry(Q4_K, 1, arch.HOPPER, 1792) == (4, 4)
    assert mmvq.geometry(Q4_K, 1, arch.HOPPER, 2048) == (4, 1)
    # Q6_K: vdr 1 -> 1 per warp pass: K < 4 * 256; on Turing 2 warps: K < 2 * 256
    assert mmvq.geometry(Q6_K, 1, arch.HOPPER, 768) == (4, 4)
    assert mmvq.geometry(Q6_K, 1, arch.HOPPER, 1024) == (4, 1)
    assert mmvq.geometry(Q6_K, 1, arch.TURING, 256) == (2, 2)
    assert mmvq.geometry(Q6_K, 1, arch.TURING, 512) == (2, 1)
    assert mmvq.geometry(Q4_0, 3, arch.HOPPER, 64) == (4, 2)  # more columns: never small_k


def test_every_planned_instance_is_declared():
    declared = set(NAME_EXPRESSIONS[mmvq.SOURCE])
    assert len(declared) == len(mmvq.instances()) == 4 * 9 + 3 * 11
    for t in TYPES:
        for cc in (arch.TURING, arch.AMPERE, arch.HOPPER):
            for ncols in range(1, 9):
                for K in (t.block_size, 8192):
                    assert mmvq.kernel(t, ncols, *mmvq.geometry(t, ncols, cc, K)).name in declared


def _node(t, K, M, N, a_planes=(1, 1), b_planes=(1, 1)):
    ctx = Context()
    a = ctx.tensor(t, (K, M, *a_planes))
    b = ctx.tensor(F32, (K, N, *b_planes))
    return ctx.mul_mat(a, b)


def test_mul_mat_path_is_ggmls_order():
    """ggml-cuda.cu ggml_cuda_mul_mat: MMVQ for quantized weights when should_use_mmvq, else the next
    path; float weights never."""
    assert matmul.mul_mat_path(_node(Q4_0, 256, 16, 8), ct.H100) == "mmvq"
    assert matmul.mul_mat_path(_node(Q4_K, 256, 16, 8), ct.H100) == "mmvq"
    assert matmul.mul_mat_path(_node(Q4_K, 256, 16, 8), ADA) != "mmvq"
    assert matmul.mul_mat_path(_node(Q4_0, 256, 16, 9), ct.H100) != "mmvq"
    assert matmul.mul_mat_path(_node(GType.F16, 256, 16, 1), ct.H100) == "cublas"
    # ggx's kernels use __dp4a (6.1+); ggml's MMVQ has a slow fallback for 6.0 that ggx does not
    assert matmul.mul_mat_path(_node(Q4_0, 256, 16, 1), dataclasses.replace(ct.H100, cc=(6, 0))) == "cublas"
    for c in ct.cases_for((Op.MUL_MAT,)):  # the conformance cases tests/test_cuda_matmul.py runs
        node = ct.compute_nodes(c)[0]
        a, b = node.src
        want = a.type.is_quantized and b.ne[1] <= 8 and a.ne[0] > 0 and mmvq.supports(node)
        assert (matmul.mul_mat_path(node, ct.H100) == "mmvq") == want, c.name


# --- launches --------------------------------------------------------------------------------------
def test_launches():
    node = _node(Q6_K, 512, 70, 3, (2, 1), (4, 3))  # channel ratio 2, sample ratio 3
    sc = ct.StubCtx()
    quant, mv = mmvq.plan(node, sc)
    a, b = node.src
    (y, y_bytes), = sc.scratches
    assert y_bytes == 3 * 4 * 3 * (512 // 32) * 36
    qa = ct.bind(quant)
    assert quant.kernel == q8_1.Q8_1_KERNEL and quant.grid == (2, 36, 1) and quant.block == (256, 1, 1)
    assert (int(qa["x"]), int(qa["y"]), int(qa["K"]), int(qa["ncols"])) == (sc.ptr(b), y, 512, 36)
    ma = ct.bind(mv)
    assert mv.kernel == mmvq.kernel(Q6_K, 3, 4, 2)
    assert mv.grid == (35, 4, 3) and mv.block == (32, 4, 1) and mv.shared == 0
    assert [int(ma[k]) for k in ("x", "y", "dst")] == [sc.ptr(a), y, sc.ptr(node)]
    assert [int(ma[k]) for k in ("blocks_per_row", "nrows", "block_bytes", "stride_row_x")] == [2, 70, 210, 420]
    assert [int(ma[k]) for k in ("channel_ratio", "sample_ratio", "stride_col_y", "stride_channel_y",
                                 "stride_sample_y")] == [2, 3, 16, 48, 192]
    assert [int(ma[k]) for k in ("stride_col_dst", "stride_channel_dst", "stride_sample_dst")] == [70, 210, 840]


# --- the kernels, compiled for the host, against their models -----------------------------------
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("N,K", [(1, 1024), (1, 4096), (3, 512), (8, 256)])
def test_kernel_matches_model_on_random_blocks(t, N, K, host_cc):
    """Random bytes in every block field: the packed-quant arithmetic of each type (nibbles, fifth
    bits, 6-bit scales, Q6_K's -32) against dequantize. K = 1024 takes the small_k rows per warp."""
    node = _node(t, K, 37, N, (1, 1), (2, 1) if N == 3 else (1, 1))
    got, want = int_models.run_host_and_model(node)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("t", [Q4_K, Q6_K], ids=lambda t: t.name)
def test_turing_table_matches_model(t, host_cc):
    """The two-warp instances of the Turing table (one column, K-quants), small_k on and off."""
    for K in (256, 2048):
        got, want = int_models.run_host_and_model(_node(t, K, 5, 1), TURING)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_quantize_q8_1_model_is_ggmls_recipe():
    """The model itself: d = amax / 127, q = roundf(x / d) (halves away from zero), s = d * sum(q)
    (ggml-cpu's quantize_row_q8_1_ref; ggml-cuda's float sum of x would give 63.5 here)."""
    x = np.array([[127.0, -63.5, 0.5, -0.5] + [0.0] * 28], np.float32)
    q, d, s = int_models.q8_1_groups(x)
    assert d[0] == np.float32(1.0) and list(q[0, :4]) == [127, -64, 1, -1] and s[0] == np.float32(63.0)
    x = np.random.default_rng(1).uniform(0.0, 2.0, (1, 32)).astype(np.float32)  # not zero-mean
    q, d, s = int_models.q8_1_groups(x)
    assert s[0] == np.float32(d[0] * np.float32(q.sum())) and s[0] != np.float32(x.sum())
    q, d, s = int_models.q8_1_groups(np.zeros((1, 32), np.float32))
    assert d[0] == 0 and not q.any()


@pytest.mark.parametrize("t", [Q4_0, Q5_0], ids=lambda t: t.name)
def test_d_times_the_quants_sum_is_more_accurate_than_the_float_sum(t, monkeypatch):
    """The deliberate deviation from ggml-cuda (s = d * sum(q), ggml-cpu's recipe): on the
    conformance case with model-like activations (uniform in [0, 2], x30 outlier channels) the
    products' NMSE against the reference is well below what ggml-cuda's float sum of x gives."""
    (case,) = [c for c in ct.cases_for((Op.MUL_MAT,)) if f"type_a={t.name.lower()}," in c.name
               and "u02_outliers" in c.name and ",n=8," in c.name]
    ours = ct.check_case(case, matmul.supports_mul_mat, matmul.plan_mul_mat)
    groups = int_models.q8_1_groups

    def float_sum(x, mmq=False):
        q, d, _ = groups(x, mmq)
        return q, d, int_models.warp_sum(x.astype(np.float32))

    monkeypatch.setattr(int_models, "q8_1_groups", float_sum)
    _, theirs, _ = compare(ct.emulate(case, matmul.supports_mul_mat, matmul.plan_mul_mat), ct.oracle(case), case.tol)
    assert ours < theirs / 2, (ours, theirs)
