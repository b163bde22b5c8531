"""MUL_MAT on float weights (F32, F16, BF16): the kernel `float_mm`, called by `ggx_cpu.kernels.matmul`
(which validates, groups columns into tasks and rounds the activations to the weight's type first).

Layouts: `w` is the weight tensor's host buffer as a typed flat view (float32 for F32, uint16 bits
for F16, int16 bits for BF16); group g's matrix starts at element wg[g], row r at wg[g] + r * wrs.
`y` holds the activation rows (K float32 each); tasks, cstart, ycol, ocol and out as in
`ggx_cpu.kernels.matmul`.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..isa.simd import (
    at,
    bits_to_f32,
    f16_bits_to_f32,
    fma_f32x8,
    hsum_f32x8,
    load_bf16x8,
    load_f16x8,
    load_f32x8,
    zero_f32x8,
)

TILE = 4


def _wval(w, i):
    """Weight element i as float32, by the array's dtype: f32, u16 = F16 bits, i16 = BF16 bits."""


@overload(_wval, inline="always")
def _ol_wval(w, i):
    if w.dtype == types.float32:
        return lambda w, i: at(w, i)
    if w.dtype == types.uint16:
        return lambda w, i: f16_bits_to_f32(at(w, i))
    if w.dtype == types.int16:
        return lambda w, i: bits_to_f32(np.uint32(np.uint16(at(w, i))) << np.uint32(16))


def _wvec(w, i):
    """8 weights from element i as float32 lanes, by w's dtype (as _wval)."""


@overload(_wvec, inline="always")
def _ol_wvec(w, i):
    if w.dtype == types.float32:
        return lambda w, i: load_f32x8(w, i)
    if w.dtype == types.uint16:
        return lambda w, i: load_f16x8(w, i)
    if w.dtype == types.int16:
        return lambda w, i: load_bf16x8(w, i)


@njit(cache=True)
def _fdot(w, wo, y, yo, K):
    """Dot of K weights from w[wo] with K float32 from y[yo]: two 8-lane accumulators."""
    acc0 = zero_f32x8()
    acc1 = zero_f32x8()
    k_main = K - K % 16
    for k in range(0, k_main, 16):
        acc0 = fma_f32x8(acc0, _wvec(w, wo + k), load_f32x8(y, yo + k))
        acc1 = fma_f32x8(acc1, _wvec(w, wo + k + 8), load_f32x8(y, yo + k + 8))
    total = np.float32(0.0)
    for k in range(k_main, K):
        total += _wval(w, wo + k) * at(y, yo + k)
    return hsum_f32x8(acc0) + hsum_f32x8(acc1) + total


@njit(cache=True, parallel=True)
def float_mm(w, wg, wrs, M, y, K, cstart, ycol, ocol, out):
    """The float MUL_MAT / MUL_MAT_ID kernel: tasks as in matmul._quant_mm; a task with several
    columns first converts its 4 weight rows to float32 so each is decoded once."""
    n_groups = wg.shape[0]
    n_tiles = (M + TILE - 1) // TILE
    for t in prange(n_groups * n_tiles):
        g = t // n_tiles
        r0 = (t % n_tiles) * TILE
        nr = min(TILE, M - r0)
        wo = wg[g] + r0 * wrs
        c0 = cstart[g]
        ce = cstart[g + 1]
        if ce == c0:
            continue
        if ce - c0 == 1:
            for r in range(nr):
                out[ocol[c0] * M + r0 + r] = _fdot(w, wo + r * wrs, y, ycol[c0] * K, K)
        else:
            rows = np.empty(nr * K, np.float32)
            for r in range(nr):
                for k in range(K):
                    rows[r * K + k] = _wval(w, wo + r * wrs + k)
            for cc in range(c0, ce):
                for r in range(nr):
                    out[ocol[cc] * M + r0 + r] = _fdot(rows, r * K, y, ycol[cc] * K, K)
