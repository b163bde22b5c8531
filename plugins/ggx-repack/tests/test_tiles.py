"""The AVX-512 register-tile gemm (`tiles.tile_mm`) against `kernels.repack_mm` on the same
repacked weights and activations (q6_K_8x8, which repack_mm has no kernel for: against float64
products of the same quantized values): every tile layout, full, partial and one-column tiles,
several matrices (MUL_MAT_ID's groups), columns in any order. The plan and the kernel choice
need no AVX-512."""
from __future__ import annotations

import numpy as np
import pytest

from ggx.quants import dequantize, quantize
from ggx.types import GType
from ggx_cpu import isa
from ggx_cpu.extension import in_order, quantize_act, split, token
from ggx_repack import tiles
from ggx_repack.kernels import act_scratch, lane_rows, repack_mm, runs_in_repack_mm
from ggx_repack.layouts import LAYOUTS, repack

needs_vnni = pytest.mark.skipif("avx512_vnni" not in isa.available(),
                                reason="this CPU has no AVX-512 VNNI: the tile kernel cannot run here")


def test_tile_columns_cover_every_column_with_full_tiles_first():
    assert tiles.tile_columns(40, "q4_0") == [16, 16, 4, 4]
    assert tiles.tile_columns(3, "q4_0") == [4]
    assert tiles.tile_columns(17, "q8_0") == [8, 8, 1]
    assert tiles.tile_columns(19, "q6_K") == [8, 8, 4]
    assert tiles.tile_columns(1, "q4_0") == [1]
    assert tiles.tile_columns(0, "q4_K") == []


def test_plan_puts_each_matrix_tiles_after_the_last():
    plan, tstart, n_ya, n_sc = tiles.tile_plan(np.array([0, 20, 21, 38]), "q4_0_8x8", 64)
    # matrix 0: 16 + 4 columns, matrix 1: one, matrix 2: 16 + 1
    assert plan[:, 0].tolist() == [0, 16, 20, 21, 37]
    assert plan[:, 1].tolist() == [16, 4, 1, 16, 1]
    assert plan[:, 2].tolist() == [16, 4, 1, 16, 1]
    assert tstart.tolist() == [0, 2, 3, 5]
    per_col = 64  # two blocks of 32 bytes
    assert plan[:, 3].tolist() == [0, 16 * per_col, 20 * per_col, 21 * per_col, 37 * per_col]
    assert n_ya == 38 * per_col and n_sc == n_ya // 32


def test_only_avx512_vnni_and_8_row_multiples_get_tiles():
    assert tiles.has_tiles("q4_0_8x8", "avx512_vnni", 64)
    assert not tiles.has_tiles("q4_0_8x8", "avx2", 64)
    assert not tiles.has_tiles("q8_0_4x4", "avx512_vnni", 36)
    assert not tiles.has_tiles("q4_0_4x4", "avx512_vnni", 64)


def _reference(lay, raw: np.ndarray, x: np.ndarray, K: int, M: int, E: int, cstart, ycol, ocol) -> np.ndarray:
    """What repack_mm computes, for a layout it has no kernel for: float64 products of the
    dequantized weights and the activations quantized to the weight's vec_dot_type."""
    act = quantize_act(x, lay.gtype.vec_dot_type)
    qb = lay.gtype.vec_dot_type.block_size
    xq = (act.qs.reshape(len(x), -1, qb).astype(np.float64) * act.d.reshape(len(x), -1, 1)).reshape(len(x), K)
    wf = dequantize(raw, lay.gtype, E * M * K).reshape(E, M, K).astype(np.float64)
    out = np.zeros(len(ycol) * M, np.float32)
    for g in range(len(cstart) - 1):
        for c in range(cstart[g], cstart[g + 1]):
            out[ocol[c] * M: (ocol[c] + 1) * M] = wf[g % E] @ xq[ycol[c]]
    return out


def _both(name: str, K: int, M: int, cstart: list[int], ycol: np.ndarray, ocol: np.ndarray, E: int, n_rows: int):
    lay = LAYOUTS[name]
    rng = np.random.default_rng(K + M + len(ycol))
    raw = quantize(rng.standard_normal((E * M, K)).astype(np.float32), lay.gtype).reshape(-1)
    w = repack(lay, raw, (K, M, E, 1))
    x = rng.standard_normal((n_rows, K)).astype(np.float32)
    per = lay.packed_nbytes((K, M, 1, 1))
    wg = np.arange(len(cstart) - 1, dtype=np.int64) % E * per
    cs = np.array(cstart, np.int64)
    nbk = K // lay.block_size
    if runs_in_repack_mm(lay):
        out_ref = np.zeros(len(ycol) * M, np.float32)
        split(repack_mm, token("avx512_vnni"), lay, w, wg, lay.group_bytes, nbk, K, M, x, cs, ycol, ocol,
              lane_rows(lay), out_ref, *act_scratch(lay, n_rows, K), True, parts=2)()
    else:
        out_ref = _reference(lay, raw, x, K, M, E, cstart, ycol, ocol)
    plan, tstart, n_ya, n_sc = tiles.tile_plan(cs, name, K)
    out = np.full(len(ycol) * M, np.nan, np.float32)
    scratch = tiles.tile_scratch(lay, n_ya, n_sc)  # quantized by a split of its own, as a batch's is
    in_order(split(tiles.tile_quant, lay, x, ycol, plan, nbk, *scratch, parts=2),
             split(tiles.tile_mm, lay, w, wg, lay.group_bytes, nbk, K, M, x, plan, tstart, ycol, ocol, out, *scratch,
                   False, parts=2))()
    return out, out_ref


@needs_vnni
@pytest.mark.parametrize("name", tiles.LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 16, 21, 37])
def test_tile_mm_equals_repack_mm(name, n):
    K = 512 if name[3] == "K" else 96
    cols = np.arange(n, dtype=np.int64)
    out, ref = _both(name, K, 24 if name != "q8_0_4x4" else 32, [0, n], cols, cols, 1, n)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@needs_vnni
@pytest.mark.parametrize("name", ["q4_0_8x8", "q8_0_4x4", "q4_K_8x8", "q6_K_8x8"])
def test_tile_mm_groups_gather_and_scatter_columns(name):
    """Three matrices (experts) with 5, 1 and 19 columns, read from and written to shuffled rows."""
    K = 256 if name[3] == "K" else 64
    rng = np.random.default_rng(3)
    ycol = rng.integers(0, 7, size=25).astype(np.int64)  # activation rows, repeated
    ocol = rng.permutation(25).astype(np.int64)
    out, ref = _both(name, K, 16, [0, 5, 6, 25], ycol, ocol, 3, 7)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@needs_vnni
def test_activation_tiles_quantize_as_ggml():
    """A tile's Q8_0 values and scales are ggx-cpu's quantize_rows_q8 (ggml's x86 rounding)."""
    K, n = 96, 5
    x = np.random.default_rng(5).standard_normal((n, K)).astype(np.float32)
    x[2, :32] = 0  # an all-zero block
    plan, tstart, n_ya, n_sc = tiles.tile_plan(np.array([0, n]), "q4_0_8x8", K)
    ya, yd = np.empty(n_ya, np.int8), np.empty(n_sc, np.float32)
    yc, ys = np.empty(n_sc, np.int32), np.empty(n_sc, np.float32)
    tiles.quant_tiles(LAYOUTS["q4_0_8x8"], x, np.arange(n, dtype=np.int64), plan, K // 32, ya, yd, yc, ys)
    act = quantize_act(x, GType.Q8_0)
    C = plan[0, 2]
    for t in range(C):
        for b in range(K // 32):
            j = b * C + t
            if t < n:
                assert np.array_equal(ya[32 * j: 32 * j + 32], act.qs[t * K + 32 * b: t * K + 32 * b + 32])
                assert yd[j] == act.d[t * K // 32 + b]
                assert yc[j] == -4 * int(act.qs[t * K + 32 * b: t * K + 32 * b + 32].astype(np.int32).sum())
            else:
                assert yd[j] == 0 and not ya[32 * j: 32 * j + 32].any()
