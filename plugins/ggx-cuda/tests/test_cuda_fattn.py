"""Flash attention's kernel choice and the vec / tile / combine kernels (ggx_cuda/ops/fattn.py,
kernels/fattn.cu) without a GPU: ggml_cuda_get_best_fattn_kernel and launch_fattn's
parallel-blocks rule as pure functions (each test names the ggml rule it mirrors), the source
compiles for sm_80 / sm_90, and the kernels compiled for the host run against their numpy models
(fattn_models.py) and the reference backend, on the conformance cases and on shapes the choice
sends to the vec kernel (a KV length that is a multiple of 256, parallel blocks and their combine)."""
from __future__ import annotations

import dataclasses
import math

import cuda_testing as ct
import numpy as np
import pytest

from ggx.conformance.case import Builder
from ggx.conformance.cases import case
from ggx.ops import Op
from ggx.types import GType
from ggx_cuda import arch
from ggx_cuda.kernels import NAME_EXPRESSIONS
from ggx_cuda.ops import attention, fattn
from ggx_cuda.ops.fattn import MMA_F16, NONE, TILE, VEC, FattnShape

F32, F16, BF16, Q8_0, Q4_1 = GType.F32, GType.F16, GType.BF16, GType.Q8_0, GType.Q4_1
CASES = ct.cases_for((Op.FLASH_ATTN_EXT,))


@pytest.mark.parametrize("arch_", ct.ARCHS)
def test_names_compile_and_lower(arch_):
    lowered = ct.check_compiles(fattn.SOURCE, arch_)
    assert set(lowered) == set(NAME_EXPRESSIONS[fattn.SOURCE])


# --- ggml's choice ------------------------------------------------------------------------------------
def shape(head=64, n_q=1, n_head=9, n_head_kv=3, n_kv=512, kv=F16, **kw) -> FattnShape:
    """SmolLM2's decode step by default: head 64, 9 heads over 3 KV heads, a padded cache, a mask."""
    return FattnShape(head, kw.pop("head_v", head), n_q, n_head, kw.pop("n_seq", 1), n_kv, n_head_kv, kv,
                      kw.pop("v_type", kv), kw.pop("mask", True), **kw)


def test_turing_and_later_mirror_ggml():
    """fattn.cu ggml_cuda_get_best_fattn_kernel, turing_mma_available branch: unquantized K/V take the
    vec kernel on Ada Lovelace and later for one query row of one sequence (not with GQA > 4 over
    8192 keys), else only without the GQA optimization; quantized K/V up to 2 rows on Ada, 1 before;
    everything else the MMA kernel. Heads 40 and 72 have no MMA kernel."""
    H100, A100 = arch.HOPPER, arch.AMPERE
    assert fattn.best_fattn_kernel(shape(), H100) == VEC
    assert fattn.best_fattn_kernel(shape(n_q=2), H100) == MMA_F16
    assert fattn.best_fattn_kernel(shape(n_seq=2), H100) == MMA_F16  # gqa_opt applies: not the fallback
    assert fattn.best_fattn_kernel(shape(n_head=8, n_head_kv=1, n_kv=8192), H100) == MMA_F16
    assert fattn.best_fattn_kernel(shape(n_head=8, n_head_kv=1, n_kv=7936), H100) == VEC
    assert fattn.best_fattn_kernel(shape(), A100) == MMA_F16  # gqa_opt: the MMA kernel groups the heads
    assert fattn.best_fattn_kernel(shape(n_head=3), A100) == VEC  # no GQA: gqa_opt does not apply
    assert fattn.best_fattn_kernel(shape(max_bias=8.0), A100) == VEC  # ALiBi turns gqa_opt off
    assert fattn.best_fattn_kernel(shape(aligned16=False), A100) == VEC
    assert fattn.best_fattn_kernel(shape(n_kv=500), H100) == MMA_F16  # vec needs KV % 256 == 0
    assert fattn.best_fattn_kernel(shape(kv=Q8_0, n_q=2), H100) == VEC
    assert fattn.best_fattn_kernel(shape(kv=Q8_0, n_q=2), A100) == MMA_F16
    assert fattn.best_fattn_kernel(shape(kv=Q8_0, n_q=1), A100) == VEC
    assert fattn.best_fattn_kernel(shape(head=40), H100) == TILE  # no MMA instance, no vec instance
    assert fattn.best_fattn_kernel(shape(head=128, n_q=512), H100) == MMA_F16


def test_head_sizes_types_and_masks_mirror_ggml():
    """The head-size switch (192/128 and 320/256 need the GQA optimization and a GQA ratio that is a
    multiple of 8 / 32; 512 and 576/512 need it), K and V of one type, ggml's K/V types (without
    GGML_CUDA_FA_ALL_QUANTS), and one mask plane for all heads."""
    H100 = arch.HOPPER
    assert fattn.best_fattn_kernel(shape(head=48), H100) == NONE
    assert fattn.best_fattn_kernel(shape(head=64, head_v=128), H100) == NONE
    assert fattn.best_fattn_kernel(shape(head=192, head_v=128), H100) == NONE  # gqa 3
    assert fattn.best_fattn_kernel(shape(head=192, head_v=128, n_head=16, n_head_kv=2), H100) == MMA_F16
    assert fattn.best_fattn_kernel(shape(head=320, head_v=256, n_head=16, n_head_kv=2), H100) == NONE
    assert fattn.best_fattn_kernel(shape(head=576, head_v=512, n_head=16, n_head_kv=2), H100) == MMA_F16
    assert fattn.best_fattn_kernel(shape(head=576, head_v=512, n_head=16, n_head_kv=2, mask=False), H100) == NONE
    assert fattn.best_fattn_kernel(shape(v_type=F32), H100) == NONE
    assert fattn.best_fattn_kernel(shape(kv=Q4_1), H100) == NONE
    assert fattn.best_fattn_kernel(shape(kv=BF16), H100) == VEC
    assert fattn.best_fattn_kernel(shape(kv=F32), H100) == VEC
    assert fattn.best_fattn_kernel(shape(mask_heads=9), H100) == NONE


def test_volta_and_older_mirror_ggml():
    """Volta: vec while rows * the effective GQA ratio (a power of 2 up to 8) <= 2, the tile kernel up
    to 16, MMA above; without tensor cores: vec for one row without gqa_opt (quantized: up to 2 rows),
    else the tile kernel."""
    V100, P40 = arch.VOLTA, arch.DP4A
    assert fattn.best_fattn_kernel(shape(n_head=3), V100) == VEC  # gqa 1
    assert fattn.best_fattn_kernel(shape(n_head=6), V100) == VEC  # gqa 2 -> 2
    assert fattn.best_fattn_kernel(shape(), V100) == VEC  # gqa 3 -> effective 1
    assert fattn.best_fattn_kernel(shape(n_head=12), V100) == TILE  # gqa 4
    assert fattn.best_fattn_kernel(shape(n_head=48, n_q=3), V100) == MMA_F16  # gqa 16 -> 8, 24 > 16
    assert fattn.best_fattn_kernel(shape(n_head=3), P40) == VEC
    assert fattn.best_fattn_kernel(shape(), P40) == TILE  # gqa_opt applies
    assert fattn.best_fattn_kernel(shape(kv=Q8_0, n_q=2), P40) == VEC


def test_ggx_runs_its_tile_kernel_where_ggml_runs_mma_and_the_generic_one_where_ggml_has_none():
    H100 = arch.HOPPER
    assert fattn.kernel_for(shape(), H100) == VEC
    assert fattn.kernel_for(shape(n_q=7), H100) == TILE
    assert fattn.kernel_for(shape(head=40), H100) == TILE
    assert fattn.kernel_for(shape(mask_heads=9), H100) == "generic"
    assert fattn.kernel_for(shape(kv=BF16), H100) == "generic"  # ggml's vec, not ggx's types
    assert fattn.kernel_for(shape(kv=F32), H100) == "generic"
    assert fattn.kernel_for(shape(head=192, head_v=128, n_head=16, n_head_kv=2), H100) == "generic"


def test_parallel_blocks_mirror_launch_fattn():
    """fattn-common.cuh launch_fattn (non-stream-K): parallel_blocks starts at the blocks per SM,
    at most ceil(KV / D), and grows while the last wave's efficiency improves (until 95 %)."""
    # decode, 9 heads: 9 tiles on 132 SMs with 4 blocks each; KV 512 / D 64 allows 8 -> 72 blocks
    assert fattn.parallel_blocks(9, 512, 64, 4, 132) == 8
    assert fattn.parallel_blocks(9, 64, 64, 4, 132) == 1  # one KV tile
    # 132 tiles: 4 per tile fill 4 waves... exactly one wave of 528: 100 %
    assert fattn.parallel_blocks(132, 4096, 128, 4, 132) == 4
    # 100 tiles: 4 -> 400 of 528 (75 %); 5 -> 500 (94 %); 6 -> 600 of 1056 (56 %); ... 21 -> 2100 of 2112
    assert fattn.parallel_blocks(100, 8192, 128, 4, 132) == 21
    assert fattn.parallel_blocks(1, 0, 64, 4, 132) == 1


# --- the kernels against the models and the reference ---------------------------------------------
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_generic_kernel_on_the_conformance_cases(c):
    """Part 1's kernel, where ggml's choice has no kernel for ggx (models; tests/test_cuda_attention.py
    runs the host build through `attention.plan`, which the choice now sends to the tile kernel)."""
    ct.check_case(c, attention.supports, attention.plan_generic)


def _fa_case(name, d, kv_t, n_tokens, n_kv, n_head, n_head_kv, batch=1, max_bias=0.0, softcap=0.0,
             masked=True, mask=True, all_masked=False):
    def build(b: Builder):
        q = b.uniform(F32, (d, n_tokens, n_head, batch), "q")
        k = b.uniform(kv_t, (d, n_kv, n_head_kv, batch), "k")
        v = b.uniform(kv_t, (d, n_kv, n_head_kv, batch), "v")
        m = None
        if mask:
            mv = b.rng.uniform(-1, 1, (batch, 1, n_tokens + 1, n_kv)).astype(np.float32)
            mv += np.linspace(0.0, 6.0, n_kv, dtype=np.float32)  # the running max moves on at every chunk
            if masked:
                mv[..., 0, :300] = -np.inf  # the first chunks masked (whole parallel blocks see nothing)
                mv[..., min(1, n_tokens - 1), 7] = np.nan  # a NaN score: a NaN row
            if all_masked or (masked and n_tokens > 2):
                mv[..., n_tokens - 1, :] = -np.inf  # a row with every key masked: zeros
            m = b.leaf(F16, (n_kv, n_tokens + 1, 1, batch), "mask", mv)
        return b.ctx.flash_attn_ext(q, k, v, m, 1 / math.sqrt(d), max_bias, softcap)
    return case(Op.FLASH_ATTN_EXT, build, (kv_t,), name=name)


VEC_CASES = [
    _fa_case("smollm2_decode", 64, F16, 1, 512, 9, 3),
    _fa_case("d128_gqa4", 128, F16, 1, 768, 8, 2, masked=False),
    _fa_case("d256_softcap", 256, F16, 1, 256, 2, 1, softcap=30.0),
    _fa_case("alibi_batches", 64, F16, 1, 512, 4, 4, batch=2, max_bias=8.0),
    _fa_case("no_mask", 128, F16, 1, 256, 2, 2, mask=False),
    _fa_case("all_masked", 64, F16, 1, 512, 2, 1, masked=False, all_masked=True),
]
TILE_CASES = [
    _fa_case("prefill_d64", 64, F16, 37, 512, 9, 3),
    _fa_case("d80", 80, F16, 5, 300, 2, 1, masked=False),
    _fa_case("d256_softcap_two_tiles", 256, F16, 17, 256, 2, 1, softcap=20.0),
    _fa_case("d40_alibi", 40, F16, 3, 100, 4, 2, max_bias=8.0),
]


def _paths(c) -> set:
    return {launch.kernel.name.split("<")[0] for launch in attention.plan(ct.compute_nodes(c)[-1], ct.StubCtx())}


def test_the_cases_reach_the_kernels_they_are_for():
    assert all(_paths(c) in ({"k_fattn_vec", "k_fattn_combine"}, {"k_fattn_vec"}) for c in VEC_CASES)
    assert {"k_fattn_combine"} <= _paths(VEC_CASES[0])  # decode on 132 SMs: parallel blocks
    assert all(_paths(c) == {"k_fattn_tile"} for c in TILE_CASES)


@pytest.mark.parametrize("c", VEC_CASES + TILE_CASES, ids=lambda c: dict(c.vars)["name"])
def test_kernels_against_the_reference(c, host_cc):
    """attention.plan's launches on the models and on the host build, each against the reference."""
    ct.check_case(c, attention.supports, attention.plan)
    ct.check_case(c, attention.supports, attention.plan, host=True)


@pytest.mark.parametrize("c", [_fa_case("two_rows_d64", 64, F16, 3, 512, 4, 2),
                               _fa_case("two_rows_d128", 128, F16, 2, 256, 2, 1, softcap=10.0)],
                         ids=lambda c: dict(c.vars)["name"])
def test_vec_with_two_rows_per_block_and_one_parallel_block(c, host_cc):
    """The vec kernel's 2-row instances (ggml picks them for quantized K/V, which ggx does not
    compute: planned directly here) and a single parallel block (a device with 1 SM)."""
    one_sm = dataclasses.replace(ct.H100, sm_count=1)
    ct.check_case(c, attention.supports, fattn.plan_vec, one_sm, host=True)
    ct.check_case(c, attention.supports, fattn.plan_vec, host=True)


def test_vec_launches():
    node = ct.compute_nodes(VEC_CASES[0])[-1]
    sc = ct.StubCtx()
    vec, comb = attention.plan(node, sc)
    assert vec.kernel == fattn.vec_kernel(64, 1, F16) and vec.grid == (1, 8, 9) and vec.block == (128, 1, 1)
    (parts, nbytes), = sc.scratches
    a = ct.bind(vec)
    assert int(a["parts"]) == parts and int(a["meta"]) == parts + 8 * 9 * 64 * 4 and nbytes == 8 * 9 * (64 + 2) * 4
    assert comb.kernel == fattn.COMBINE_KERNEL and comb.grid == (1, 9, 1)
    assert [int(ct.bind(comb)[x]) for x in ("parts", "meta", "dst", "D", "P")] == [
        parts, parts + 8 * 9 * 64 * 4, sc.ptr(node), 64, 8]


def test_the_padded_decode_conformance_cases_reach_vec_and_combine(host_cc):
    """The suite's own decode cases over 256/512/4096 padded slots (core cases.fa_padded): on
    Ada / Hopper ggml (and ggx) take the vec kernel and merge parallel blocks with the combine."""
    padded = [c for c in ct.cases_for((Op.FLASH_ATTN_EXT,)) if "filled" in dict(c.vars)]
    assert len(padded) == 4
    for c in padded:
        assert _paths(c) == {"k_fattn_vec", "k_fattn_combine"}, c.name
        ct.check_case(c, attention.supports, attention.plan, host=True)
