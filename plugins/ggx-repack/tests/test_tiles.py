"""The AVX-512 register-tile gemm (`tiles.tile_mm`) against `kernels.repack_mm` on the same
repacked weights and activations: every tile layout, full and partial tiles, several matrices
(MUL_MAT_ID's groups), columns in any order. The plan and the kernel choice need no AVX-512."""
from __future__ import annotations

import numpy as np
import pytest

from ggx.quants import quantize
from ggx.types import GType
from ggx_cpu import isa
from ggx_cpu.extension import token
from ggx_repack import tiles
from ggx_repack.kernels import lane_rows, repack_mm
from ggx_repack.layouts import LAYOUTS, repack

needs_vnni = pytest.mark.skipif("avx512_vnni" not in isa.available(),
                                reason="this CPU has no AVX-512 VNNI: the tile kernel cannot run here")


def test_tile_columns_cover_every_column_with_full_tiles_first():
    assert tiles.tile_columns(40, "q4_0") == [16, 16, 4, 4]
    assert tiles.tile_columns(3, "q4_0") == [4]
    assert tiles.tile_columns(17, "q8_0") == [8, 8, 4]
    assert tiles.tile_columns(0, "q4_K") == []


def test_plan_puts_each_matrix_tiles_after_the_last():
    plan, tstart, n_ya, n_sc = tiles.tile_plan(np.array([0, 20, 21, 37]), "q4_0_8x8", 64)
    # matrix 0: 16 + 4 columns, matrix 1: one (padded to 4), matrix 2: 16
    assert plan[:, 0].tolist() == [0, 16, 20, 21]
    assert plan[:, 1].tolist() == [16, 4, 1, 16]
    assert plan[:, 2].tolist() == [16, 4, 4, 16]
    assert tstart.tolist() == [0, 2, 3, 4]
    per_col = 64  # two blocks of 32 bytes
    assert plan[:, 3].tolist() == [0, 16 * per_col, 20 * per_col, 24 * per_col]
    assert n_ya == 40 * per_col and n_sc == n_ya // 32


def test_only_avx512_vnni_and_8_row_multiples_get_tiles():
    assert tiles.has_tiles("q4_0_8x8", "avx512_vnni", 64)
    assert not tiles.has_tiles("q4_0_8x8", "avx2", 64)
    assert not tiles.has_tiles("q8_0_4x4", "avx512_vnni", 36)
    assert not tiles.has_tiles("q4_0_4x4", "avx512_vnni", 64)


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
    out_ref = np.zeros(len(ycol) * M, np.float32)
    repack_mm(token("avx512_vnni"), lay, w, wg, lay.group_bytes, nbk, K, M, x, cs, ycol, ocol, lane_rows(lay),
              out_ref, 2)
    plan, tstart, n_ya, n_sc = tiles.tile_plan(cs, name, K)
    out = np.full(len(ycol) * M, np.nan, np.float32)
    tiles.tile_mm(lay, w, wg, lay.group_bytes, nbk, K, M, x, plan, tstart, n_ya, n_sc, ycol, ocol, out, 2)
    return out, out_ref


@needs_vnni
@pytest.mark.parametrize("name", tiles.LAYOUTS)
@pytest.mark.parametrize("n", [2, 16, 21, 37])
def test_tile_mm_equals_repack_mm(name, n):
    K = 512 if name.startswith("q4_K") else 96
    cols = np.arange(n, dtype=np.int64)
    out, ref = _both(name, K, 24 if name != "q8_0_4x4" else 32, [0, n], cols, cols, 1, n)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@needs_vnni
@pytest.mark.parametrize("name", ["q4_0_8x8", "q8_0_4x4", "q4_K_8x8"])
def test_tile_mm_groups_gather_and_scatter_columns(name):
    """Three matrices (experts) with 5, 1 and 19 columns, read from and written to shuffled rows."""
    K = 256 if name.startswith("q4_K") else 64
    rng = np.random.default_rng(3)
    ycol = rng.integers(0, 7, size=25).astype(np.int64)  # activation rows, repeated
    ocol = rng.permutation(25).astype(np.int64)
    out, ref = _both(name, K, 16, [0, 5, 6, 25], ycol, ocol, 3, 7)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@needs_vnni
def test_activation_tiles_quantize_as_ggml():
    """A tile's Q8_0 values and scales are ggx-cpu's quantize_rows_q8 (ggml's x86 rounding)."""
    from ggx_cpu.extension import quantize_act

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
