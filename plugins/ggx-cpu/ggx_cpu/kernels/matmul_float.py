"""MUL_MAT on float weights (F32, F16, BF16): the kernel `float_mm`, called by `ggx_cpu.kernels.matmul`
(which validates, groups columns into tasks and rounds the activations to the weight's type first).

Layouts: `w` is the weight tensor's host buffer as a typed flat view (float32 for F32, uint16 bits
for F16, int16 bits for BF16); group g's matrix starts at element wg[g], row r at wg[g] + r * wrs.
`y` holds the activation rows (K float32 each); cstart, ycol, ocol and out as in
`ggx_cpu.kernels.matmul` (group g owns columns cstart[g]..cstart[g+1]; column c reads y from
ycol[c] * K and writes out[ocol[c] * M + row]).

The parallel region runs over tasks = (group, block of RB rows); it does not use matmul's 4-row
tasks, because a bigger row block lets each activation chunk loaded into L1 serve RB rows.

- gemv (the group has one column): bandwidth-bound, so the weights are read once, straight from
  `w`, 4 rows at a time against one shared activation load.
- gemm (two columns or more): the task walks K in blocks of KB. For each block it converts its RB
  rows once to float32 into `wb` (RB x KB floats = 16 KiB, stays in L1); then for every quad of
  columns and every quad of rows a 4 x 4 register tile (16 accumulators of 8 float32 lanes)
  runs over the block: per 8 values of K, 4 weight and 4 activation loads feed 16 FMAs.
  Leftover columns (fewer than 4) use a 4 x 1 tile. Block sums are written (first block) or
  added (later blocks) to `out`; rows past M in the last block are zeros in `wb` and never
  written.
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

RB = 16  # rows per task (4 row quads)
KB = 256  # K values per block: RB * KB float32 = 16 KiB of converted weights in L1


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


# --- gemv: one column, weights read once from w ---------------------------------------------------
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


@njit(cache=True)
def _gemv_rows4(w, wo, wrs, y, yo, K, out, oo):
    """out[oo + r] = row r (of 4, from w[wo + r * wrs]) . y[yo:yo + K]: one activation load per
    4 weight loads, 4 independent accumulators."""
    a0 = a1 = a2 = a3 = zero_f32x8()
    k_main = K - K % 8
    for k in range(0, k_main, 8):
        v = load_f32x8(y, yo + k)
        a0 = fma_f32x8(a0, _wvec(w, wo + k), v)
        a1 = fma_f32x8(a1, _wvec(w, wo + wrs + k), v)
        a2 = fma_f32x8(a2, _wvec(w, wo + 2 * wrs + k), v)
        a3 = fma_f32x8(a3, _wvec(w, wo + 3 * wrs + k), v)
    t0 = t1 = t2 = t3 = np.float32(0.0)
    for k in range(k_main, K):
        v = at(y, yo + k)
        t0 += _wval(w, wo + k) * v
        t1 += _wval(w, wo + wrs + k) * v
        t2 += _wval(w, wo + 2 * wrs + k) * v
        t3 += _wval(w, wo + 3 * wrs + k) * v
    out[oo] = hsum_f32x8(a0) + t0
    out[oo + 1] = hsum_f32x8(a1) + t1
    out[oo + 2] = hsum_f32x8(a2) + t2
    out[oo + 3] = hsum_f32x8(a3) + t3


# --- gemm: RB x KB weight blocks converted once, 4 x 4 register tiles ------------------------------
@njit(cache=True)
def _pack(w, wo, wrs, nr, kl, wb):
    """wb[r * KB + k] = float32 weight (row r, K offset k) for r < nr, k < kl; from w[wo + r * wrs + k]."""
    for r in range(nr):
        src = wo + r * wrs
        dst = r * KB
        for k in range(kl):
            wb[dst + k] = _wval(w, src + k)


@njit(cache=True)
def _tile4x4(wb, wq, y, y0, y1, y2, y3, kl, acc):
    """acc[4 * c + r] = sum_{k < kl} wb[wq + r * KB + k] * y[yc + k] for the rows r of one quad
    and the 4 columns yc = y0..y3: 16 accumulators of 8 lanes, one horizontal sum each."""
    a00 = a01 = a02 = a03 = zero_f32x8()
    a10 = a11 = a12 = a13 = zero_f32x8()
    a20 = a21 = a22 = a23 = zero_f32x8()
    a30 = a31 = a32 = a33 = zero_f32x8()
    k_main = kl - kl % 8
    for k in range(0, k_main, 8):
        w0 = load_f32x8(wb, wq + k)
        w1 = load_f32x8(wb, wq + KB + k)
        w2 = load_f32x8(wb, wq + 2 * KB + k)
        w3 = load_f32x8(wb, wq + 3 * KB + k)
        v = load_f32x8(y, y0 + k)
        a00 = fma_f32x8(a00, w0, v)
        a01 = fma_f32x8(a01, w1, v)
        a02 = fma_f32x8(a02, w2, v)
        a03 = fma_f32x8(a03, w3, v)
        v = load_f32x8(y, y1 + k)
        a10 = fma_f32x8(a10, w0, v)
        a11 = fma_f32x8(a11, w1, v)
        a12 = fma_f32x8(a12, w2, v)
        a13 = fma_f32x8(a13, w3, v)
        v = load_f32x8(y, y2 + k)
        a20 = fma_f32x8(a20, w0, v)
        a21 = fma_f32x8(a21, w1, v)
        a22 = fma_f32x8(a22, w2, v)
        a23 = fma_f32x8(a23, w3, v)
        v = load_f32x8(y, y3 + k)
        a30 = fma_f32x8(a30, w0, v)
        a31 = fma_f32x8(a31, w1, v)
        a32 = fma_f32x8(a32, w2, v)
        a33 = fma_f32x8(a33, w3, v)
    acc[0], acc[1], acc[2], acc[3] = hsum_f32x8(a00), hsum_f32x8(a01), hsum_f32x8(a02), hsum_f32x8(a03)
    acc[4], acc[5], acc[6], acc[7] = hsum_f32x8(a10), hsum_f32x8(a11), hsum_f32x8(a12), hsum_f32x8(a13)
    acc[8], acc[9], acc[10], acc[11] = hsum_f32x8(a20), hsum_f32x8(a21), hsum_f32x8(a22), hsum_f32x8(a23)
    acc[12], acc[13], acc[14], acc[15] = hsum_f32x8(a30), hsum_f32x8(a31), hsum_f32x8(a32), hsum_f32x8(a33)
    ys = (y0, y1, y2, y3)
    for k in range(k_main, kl):  # K % 8 tail (last block only)
        for c in range(4):
            v = at(y, ys[c] + k)
            for r in range(4):
                acc[4 * c + r] += at(wb, wq + r * KB + k) * v


@njit(cache=True)
def _tile4x1(wb, wq, y, yo, kl, acc):
    """acc[r] = sum_{k < kl} wb[wq + r * KB + k] * y[yo + k] for the 4 rows of one quad."""
    a0 = a1 = a2 = a3 = zero_f32x8()
    k_main = kl - kl % 8
    for k in range(0, k_main, 8):
        v = load_f32x8(y, yo + k)
        a0 = fma_f32x8(a0, load_f32x8(wb, wq + k), v)
        a1 = fma_f32x8(a1, load_f32x8(wb, wq + KB + k), v)
        a2 = fma_f32x8(a2, load_f32x8(wb, wq + 2 * KB + k), v)
        a3 = fma_f32x8(a3, load_f32x8(wb, wq + 3 * KB + k), v)
    acc[0], acc[1], acc[2], acc[3] = hsum_f32x8(a0), hsum_f32x8(a1), hsum_f32x8(a2), hsum_f32x8(a3)
    for k in range(k_main, kl):
        v = at(y, yo + k)
        for r in range(4):
            acc[r] += at(wb, wq + r * KB + k) * v


@njit(cache=True)
def _put(out, oo, acc, a0, astride, n, first):
    """out[oo + r] (=, or += after the first K block) acc[a0 + r * astride] for r < n."""
    for r in range(n):
        if first:
            out[oo + r] = acc[a0 + r * astride]
        else:
            out[oo + r] += acc[a0 + r * astride]


@njit(cache=True)
def _gemm_task(w, wo, wrs, nr, y, K, c0, ce, ycol, ocol, M, r0, out):
    """Rows r0..r0+nr (weights from w[wo]) times the columns c0..ce of one group."""
    wb = np.zeros(RB * KB, np.float32)  # rows >= nr stay zero
    acc = np.empty(16, np.float32)
    nq = (nr + 3) // 4
    for k0 in range(0, K, KB):
        kl = min(KB, K - k0)
        first = k0 == 0
        _pack(w, wo + k0, wrs, nr, kl, wb)
        c = c0
        while c + 4 <= ce:
            y0, y1, y2, y3 = ycol[c] * K + k0, ycol[c + 1] * K + k0, ycol[c + 2] * K + k0, ycol[c + 3] * K + k0
            for q in range(nq):
                _tile4x4(wb, 4 * q * KB, y, y0, y1, y2, y3, kl, acc)
                n = min(4, nr - 4 * q)
                row = r0 + 4 * q
                for j in range(4):
                    _put(out, ocol[c + j] * M + row, acc, 4 * j, 1, n, first)
            c += 4
        for cc in range(c, ce):  # leftover columns
            for q in range(nq):
                _tile4x1(wb, 4 * q * KB, y, ycol[cc] * K + k0, kl, acc)
                _put(out, ocol[cc] * M + r0 + 4 * q, acc, 0, 1, min(4, nr - 4 * q), first)


@njit(cache=True, parallel=True)
def float_mm(w, wg, wrs, M, y, K, cstart, ycol, ocol, out):
    """The float MUL_MAT / MUL_MAT_ID kernel: one parallel region over (group, RB rows) tasks;
    gemv for a one-column group, converted blocks and 4 x 4 tiles otherwise."""
    n_groups = wg.shape[0]
    n_tiles = (M + RB - 1) // RB
    for t in prange(n_groups * n_tiles):
        g = t // n_tiles
        r0 = (t % n_tiles) * RB
        nr = min(RB, M - r0)
        wo = wg[g] + r0 * wrs
        c0 = cstart[g]
        ce = cstart[g + 1]
        if ce - c0 == 1:
            yo = ycol[c0] * K
            oo = ocol[c0] * M + r0
            r = 0
            while r + 4 <= nr:
                _gemv_rows4(w, wo + r * wrs, wrs, y, yo, K, out, oo + r)
                r += 4
            for rr in range(r, nr):
                out[oo + rr] = _fdot(w, wo + rr * wrs, y, yo, K)
        elif ce - c0 > 1:
            _gemm_task(w, wo, wrs, nr, y, K, c0, ce, ycol, ocol, M, r0, out)
