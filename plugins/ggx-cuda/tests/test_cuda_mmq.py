"""MMQ (ggx_cuda/ops/mmq.py, kernels/mmq.cu; MUL_MAT_ID grouped by expert: kernels/mmid.cu)
without a GPU: ggml's rules as pure functions (each test names the ggml rule it mirrors), the
sources compile for sm_80 / sm_90 with every instantiation lowered, and the kernels compiled for
the host run against their numpy models (int_models.py: the stream-K split and the fixup
included) and the reference backend, on both paths: int8 mma.sync (emulated for sm_90 by the
shim's twin of the instruction; the real PTX is compile-checked only) and __dp4a (emulated for
sm_75)."""
from __future__ import annotations

import dataclasses

import cuda_testing as ct
import numpy as np
import pytest
from int_models import run_host_and_model

from ggx.graph import Context
from ggx.ops import Op
from ggx.quants import dequantize
from ggx.types import GType
from ggx_cuda import arch
from ggx_cuda.kernels import NAME_EXPRESSIONS
from ggx_cuda.ops import matmul, mmq, q8_1

F32, F16 = GType.F32, GType.F16
Q4_0, Q4_1, Q5_0, Q8_0 = GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0
Q4_K, Q5_K, Q6_K = GType.Q4_K, GType.Q5_K, GType.Q6_K
TURING = dataclasses.replace(ct.H100, cc=(7, 5), sm_count=40, smem_per_block_optin=64 * 1024)
SMALL = dataclasses.replace(ct.H100, sm_count=3)  # few SMs: tiling and stream-K on small shapes
KB = 1024


@pytest.mark.parametrize("arch_", ct.ARCHS)
def test_names_compile_and_lower(arch_):
    lowered = ct.check_compiles(mmq.SOURCE, arch_)
    assert set(lowered) == set(NAME_EXPRESSIONS[mmq.SOURCE])
    assert len(lowered) == 7 * 4 + 1
    assert set(ct.check_compiles(mmq.GROUP_KERNEL.source, arch_)) == {mmq.GROUP_KERNEL.name}


def test_the_mma_path_is_real_ptx():
    """The sm_80 / sm_90 builds use the int8 tensor-core instruction (the host twin stands in for it)."""
    for arch_ in ct.ARCHS:
        assert "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32" in ct.compile_source(mmq.SOURCE, arch_).ptx


# --- ggml's rules -------------------------------------------------------------------------------------
def test_should_use_mmq_mirrors_ggml():
    """mmq.cu ggml_cuda_should_use_mmq: 48 KiB of shared memory per block at least; from Turing on
    always; with __dp4a and no tensor cores always; with Volta's only below MMQ_DP4A_MAX_BATCH_SIZE
    (64) columns; before __dp4a never."""
    big = 227 * KB
    for t in mmq.TYPES:
        assert mmq.should_use_mmq(t, arch.HOPPER, 4096, 0, big) and mmq.should_use_mmq(t, arch.TURING, 512, 0, big)
    assert mmq.should_use_mmq(Q4_0, arch.VOLTA, 63, 0, big) and not mmq.should_use_mmq(Q4_0, arch.VOLTA, 64, 0, big)
    assert mmq.should_use_mmq(Q4_0, arch.DP4A, 4096, 0, big)
    assert not mmq.should_use_mmq(Q4_0, arch.PASCAL, 16, 0, big)
    assert not mmq.should_use_mmq(Q4_0, arch.HOPPER, 16, 0, 48 * KB - 1)
    assert not mmq.should_use_mmq(F16, arch.HOPPER, 16, 0, big)


def test_config_mirrors_the_ampere_table():
    """mmq-config-ampere.cuh (ggml_cuda_mmq_get_config from Volta on): 256 threads, I = 128, stream-K,
    J = 8..128 by 8, with the row fallback only 8, 16, 32, 64, 128."""
    for t in mmq.TYPES:
        assert [J for J in range(1, 200) if mmq.config(t, J, False, arch.HOPPER)] == list(range(8, 129, 8))
        assert [J for J in range(1, 200) if mmq.config(t, J, True, arch.AMPERE)] == [8, 16, 32, 64, 128]
        assert mmq.config(t, 64, False, arch.VOLTA) == mmq.MmqConfig(256, 128, 64, True)
        assert mmq.config(t, 64, False, arch.DP4A) is None  # ggml's Pascal table: not mirrored
    assert mmq.config(F16, 64, False, arch.HOPPER) is None


def test_best_j_mirrors_mul_mat_q_switch_j():
    """mmq.cuh mul_mat_q_switch_J: J from 8 up by 8 while more than one column tile is left, skipping
    J without a table entry or whose shared memory exceeds the block's; the first J with the fewest
    tiles wins."""
    big = 227 * KB
    assert [mmq.best_j(Q4_0, n, False, arch.HOPPER, big) for n in (1, 8, 9, 16, 33, 128)] == [8, 8, 16, 16, 40, 128]
    assert mmq.best_j(Q4_0, 200, False, arch.HOPPER, big) == 104  # 2 tiles: the first J with ceil(200 / J) == 2
    assert mmq.best_j(Q4_0, 512, False, arch.HOPPER, big) == 128
    assert mmq.best_j(Q4_0, 33, True, arch.HOPPER, big) == 64  # the fallback table has no 40
    # shared memory: 48128 + 336 J bytes; 60 KiB holds J <= 32
    assert mmq.shared_bytes(32) <= 60 * KB < mmq.shared_bytes(40)
    assert mmq.best_j(Q4_0, 100, False, arch.HOPPER, 60 * KB) == 32
    assert mmq.best_j(Q4_0, 100, False, arch.HOPPER, mmq.shared_bytes(8) - 1) == 0
    assert mmq.best_j(Q4_0, 100, False, arch.DP4A, big) == 0


def test_stream_k_blocks_mirror_launch_mul_mat_q():
    """mmq.cuh launch_mul_mat_q (NVIDIA, stream-K configs): one block per tile when
    100 * tiles / (SMs * waves) >= 90, else one block per SM; a fixup pass when the blocks do not
    divide the tiles."""
    assert mmq.stream_k_blocks(132, 132) == 132 and mmq.stream_k_blocks(264, 132) == 264
    assert mmq.stream_k_blocks(119, 132) == 119  # 90 %
    assert mmq.stream_k_blocks(118, 132) == 132  # 89 %: stream-K
    assert mmq.stream_k_blocks(9, 132) == 132
    assert mmq.stream_k_blocks(133, 132) == 132  # 2 waves at 50 %


def _node(t, K, M, N, a_planes=(1, 1), b_planes=(1, 1)):
    ctx = Context()
    return ctx.mul_mat(ctx.tensor(t, (K, M, *a_planes)), ctx.tensor(F32, (K, N, *b_planes)))


def test_mul_mat_path_is_ggmls_order():
    """ggml-cuda.cu ggml_cuda_mul_mat: MMVQ first, then MMQ when should_use_mmq, else cuBLAS."""
    assert matmul.mul_mat_path(_node(Q4_0, 256, 64, 9), ct.H100) == "mmq"
    assert matmul.mul_mat_path(_node(Q6_K, 256, 64, 4096), ct.H100) == "mmq"
    volta = dataclasses.replace(ct.H100, cc=(7, 0))
    assert matmul.mul_mat_path(_node(Q4_0, 256, 64, 63), volta) == "mmq"
    assert matmul.mul_mat_path(_node(Q4_0, 256, 64, 64), volta) == "cublas"  # Volta's tensor cores win
    assert matmul.mul_mat_path(_node(Q4_0, 256, 64, 64), dataclasses.replace(ct.H100, cc=(6, 1))) == "cublas"
    assert matmul.mul_mat_path(_node(F16, 256, 64, 64), ct.H100) == "cublas"


# --- launches --------------------------------------------------------------------------------------
def test_launches_tiles_stream_k_and_fixup():
    node = _node(Q4_K, 512, 300, 40, (2, 1), (4, 1))  # 3 row tiles x 1 column tile x 4 channels
    sc = ct.StubCtx()
    quant, mm, fix = mmq.plan(node, sc)
    a, b = node.src
    (y, y_bytes), (fixup, fixup_bytes) = sc.scratches
    assert quant.kernel == q8_1.mmq_kernel(True) and quant.grid == (4, 40, 4) and quant.block == (128, 1, 1)
    assert y_bytes == 4 * 40 * 4 * 144
    J = 64  # 300 rows: the fallback table; 40 columns take one tile of 64
    assert mm.kernel == mmq.kernel(Q4_K, J) and mm.kernel.name.endswith("64>")
    assert mm.grid == (132, 1, 1) and mm.block == (32, 8, 1) and mm.shared == mmq.shared_bytes(J)
    m = ct.bind(mm)
    assert [int(m[k]) for k in ("x", "y", "dst", "fixup")] == [sc.ptr(a), y, sc.ptr(node), fixup]
    assert [int(m[k]) for k in ("J", "K", "nrows", "ncols", "nty", "ntx", "ne12", "channel_ratio")] == [
        J, 512, 300, 40, 3, 1, 4, 2]
    assert int(m["total"]) == 12 * 2 and fixup_bytes == 132 * 128 * J * 4
    assert fix.kernel == mmq.FIXUP_KERNEL and fix.grid == (132, 1, 1)
    # 132 tiles on 132 SMs: tiling, no fixup
    launches = mmq.plan(_node(Q4_0, 256, 128 * 132, 8 * 4), ct.StubCtx())
    assert len(launches) == 2 and launches[1].grid == (132, 1, 1)


# --- the kernels, compiled for the host, against their models and the reference ---------------------
SHAPES = [  # (type, K, M, N, a planes, b planes, device): stream-K with fixup, tiling, partial K, J classes
    (Q4_0, 352, 150, 9, (1, 1), (1, 1), ct.H100),
    (Q4_1, 512, 128, 40, (2, 1), (4, 1), SMALL),
    (Q5_0, 1024, 200, 17, (1, 1), (1, 1), SMALL),
    (Q8_0, 288, 64, 100, (1, 1), (1, 2), ct.H100),
    (Q4_K, 768, 129, 24, (1, 1), (1, 1), SMALL),
    (Q5_K, 512, 130, 65, (1, 1), (2, 1), ct.H100),
    (Q6_K, 1024, 140, 12, (1, 1), (1, 1), SMALL),
]


def _id(s):
    return f"{s[0].name}-K{s[1]}-M{s[2]}-N{s[3]}-sm{s[6].sm_count}"


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("device", ["mma", "dp4a"])
def test_kernel_matches_model_on_random_blocks(shape, device, host_cc):
    t, K, M, N, ap, bp, dev = shape
    if device == "dp4a":
        dev = dataclasses.replace(TURING, sm_count=dev.sm_count)
    node = _node(t, K, M, N, ap, bp)
    assert matmul.mul_mat_path(node, dev) == "mmq"
    got, want = run_host_and_model(node, dev)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-5 * np.abs(want).max())


@pytest.mark.parametrize("device", [ct.H100, TURING], ids=["mma", "dp4a"])
@pytest.mark.parametrize("case", [c for c in ct.cases_for((Op.MUL_MAT,)) if dict(c.vars)["type_a"].is_quantized
                                  and dict(c.vars)["n"] > 8], ids=lambda c: c.name)
def test_conformance_cases_on_host_kernels(case, device, host_cc):
    assert matmul.mul_mat_path(ct.compute_nodes(case)[0], device) == "mmq"
    ct.check_case(case, matmul.supports_mul_mat, matmul.plan_mul_mat, device, host=True)


# --- MUL_MAT_ID, grouped by expert -------------------------------------------------------------------
def test_mul_mat_id_path_mirrors_ggml():
    """ggml-cuda.cu ggml_cuda_mul_mat_id: up to get_mmvq_mmid_max_batch tokens MMVQ (ggx: its simple
    kernel), then MMQ grouped by expert where should_use_mmq; mmvq.cu get_mmvq_mmid_max_batch:
    8 on Volta and from Turing on (for ggx's types), Pascal's table before."""
    from ggx_cuda.ops import mmvq

    assert [mmvq.mmid_max_batch(t, arch.PASCAL + 10) for t in (Q4_0, Q8_0, Q4_K, Q6_K)] == [6, 4, 5, 4]
    assert all(mmvq.mmid_max_batch(t, cc) == 8 for t in mmq.TYPES for cc in (arch.VOLTA, arch.TURING, arch.HOPPER))

    def node(t, T):
        c = Context()
        return c.mul_mat_id(c.tensor(t, (256, 64, 8)), c.tensor(F32, (256, 2, T)), c.tensor(GType.I32, (2, T)))

    assert matmul.mul_mat_id_path(node(Q4_0, 8), ct.H100) == "simple"
    assert matmul.mul_mat_id_path(node(Q4_0, 9), ct.H100) == "mmq"
    assert matmul.mul_mat_id_path(node(F16, 64), ct.H100) == "simple"
    assert matmul.mul_mat_id_path(node(Q4_0, 64), dataclasses.replace(ct.H100, cc=(6, 1))) == "simple"


def _moe_case(t, n_expert, n_used, n_tokens, b_ne1, m, k, pattern, seed=3):
    from ggx.conformance.case import Builder
    from ggx.conformance.cases import case

    rng = np.random.default_rng(seed)
    if pattern == "repeated":  # an expert twice in a token, another in every token
        ids = np.stack([rng.integers(0, n_expert, n_used) for _ in range(n_tokens)])
        ids[:, 0], ids[::2, 1] = 1, 1
    elif pattern == "skewed":  # two experts get nearly everything, some none
        ids = np.stack([rng.permutation(2 + n_used)[:n_used] % n_expert for _ in range(n_tokens)])
    else:
        ids = np.stack([rng.permutation(n_expert)[:n_used] for _ in range(n_tokens)])

    def build(b: Builder):
        experts = b.uniform(t, (k, m, n_expert), "as")
        act = b.uniform(F32, (k, b_ne1, n_tokens), "b")
        return b.ctx.mul_mat_id(experts, act, b.ints(GType.I32, (n_used, n_tokens), "ids", ids.astype(np.int32)))
    return case(Op.MUL_MAT_ID, build, (t,), type_a=t, n_expert=n_expert, n_used=n_used, b_ne1=b_ne1,
                n_tokens=n_tokens, m=m, k=k, ids=pattern)


MOE = [_moe_case(Q4_0, 8, 2, 24, 1, 160, 256, "distinct"),
       _moe_case(Q4_K, 4, 3, 17, 3, 96, 512, "repeated"),
       _moe_case(Q6_K, 16, 4, 12, 4, 130, 256, "skewed"),
       _moe_case(Q5_0, 6, 2, 40, 2, 64, 352, "distinct")]


@pytest.mark.parametrize("device", [ct.H100, SMALL, TURING], ids=["mma", "mma-3sm", "dp4a"])
@pytest.mark.parametrize("c", MOE, ids=lambda c: c.name)
def test_mul_mat_id_grouped_against_the_reference(c, device, host_cc):
    """Uneven experts (some without tokens, one repeated within a token), stream-K with its fixup on
    3 SMs: the host-built kernels and the models, each against the reference."""
    assert matmul.mul_mat_id_path(ct.compute_nodes(c)[-1], device) == "mmq"
    ct.check_case(c, matmul.supports_mul_mat_id, matmul.plan_mul_mat_id, device, host=True)
    ct.check_case(c, matmul.supports_mul_mat_id, matmul.plan_mul_mat_id, device)


def test_mul_mat_id_launches_and_bad_ids(host_cc):
    """The grouping runs on the device (one block); an id out of range leaves its column NaN and the
    others right."""
    c = Context()
    experts, b, ids = c.tensor(Q8_0, (256, 40, 4)), c.tensor(F32, (256, 1, 12)), c.tensor(GType.I32, (2, 12))
    node = c.mul_mat_id(experts, b, ids)
    sc = ct.StubCtx(SMALL)
    launches = mmq.plan_id(node, sc)
    group, quant, mm = launches[:3]
    assert group.kernel == mmq.GROUP_KERNEL and group.grid == (1, 1, 1)
    assert quant.grid == (2, 24, 1) and int(ct.bind(quant)["ids"]) == sc.scratches[0][0]
    m = ct.bind(mm)
    assert int(m["ids_dst"]) == sc.scratches[0][0] + 4 * 24 and int(m["bounds"]) == sc.scratches[0][0] + 8 * 24
    rng = np.random.default_rng(5)
    raw = ct.random_blocks(rng, Q8_0, 256 * 40 * 4 // 32)
    sc.mem.view(sc.ptr(experts), (raw.size,), (1,), np.uint8)[:] = raw.reshape(-1)
    x = rng.standard_normal((12, 1, 256)).astype(np.float32)
    sc.array(b, np.float32)[:] = x
    idv = rng.integers(0, 4, (12, 2)).astype(np.int32)
    idv[3, 1], idv[7, 0] = 9, -1
    sc.array(ids, np.int32)[:] = idv
    ct.run_launches(launches, sc, host=True)
    out = sc.array(node, np.float32)[0]  # [tokens, slots, M]
    w = dequantize(raw.reshape(-1), Q8_0, 256 * 40 * 4).reshape(4, 40, 256).astype(np.float64)
    for t in range(12):
        for s in range(2):
            if not 0 <= idv[t, s] < 4:
                assert np.isnan(out[t, s]).all()
            else:
                want = w[idv[t, s]] @ x[t, 0]
                assert ((out[t, s] - want) ** 2).sum() / (want**2).sum() < 5e-4, (t, s)
