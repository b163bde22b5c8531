"""MUL_MAT on float weights (F32, F16, BF16): the kernel `float_mm`, called by `ggx_cpu.kernels.matmul`
(which validates, groups columns into tasks and rounds the activations to the weight's type first).

Layouts: `w` is the weight tensor's host buffer as a typed flat view (float32 for F32, uint16 bits
for F16, int16 bits for BF16); group g's matrix starts at element wg[g], row r at wg[g] + r * wrs.
`y` holds the activation rows (K float32 each); cstart, ycol, ocol and out as in
`ggx_cpu.kernels.matmul` (group g owns columns cstart[g]..cstart[g+1]; column c reads y from
ycol[c] * K and writes out[ocol[c] * M + row]).

One split kernel over tasks = (group, rb rows), rb = `rows_per_task(K)` (16 unless K is
large): bigger than matmul's 4-row tasks so that each activation column, once in cache, serves
16 rows. Inside a task:
- gemv (the group has one column): bandwidth-bound, so every row is dotted straight from `w`
  (two 8-lane accumulators, weights converted in registers) and the weights are read once.
- 2 or 3 columns: 2 x 3 register tiles straight from `w` (each weight vector converted in
  registers feeds 3 FMAs); a conversion pass would cost more than it saves (measured 1.5x slower).
- gemm (4 columns or more): the task's rows are converted once to float32 (`wb`, rb x K,
  <= 256 KiB so it stays in L2), then every quad of columns meets every quad of rows in a 4 x 4
  register tile: 16 accumulators of 8 float32 lanes over all of K, where 4 weight and 4
  activation loads feed 16 FMAs. Leftover columns (1 to 3) are row dots on `wb`. Rows past
  M in a partial last quad are computed on uninitialized `wb` rows and never written out.
Blocking over K (so a chunk of the rows stays in L1) measured slower on Zen 4: the 16 horizontal
sums per tile and K block cost more than reading from L2 does (F16 4096 x 4096 x 512, 1 thread:
~55 GOPS with 256-value blocks, ~88 without blocking).

F16 weights are converted with F16C's vcvtph2ps (LLVM `fpext half`) where the host has F16C,
else with simd's integer conversion (same values for finite halves; only F16C keeps inf/NaN);
F16C made the 1-thread gemv ~15 % faster, the integer conversion being compute-bound there.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .. import isa
from ..isa.simd import (
    F32x8,
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

RB_MAX = 16  # rows per task, at most (4 row quads)
WB_BYTES = 256 << 10  # converted float32 rows per task, at most (see rows_per_task)


# --- weight conversion ----------------------------------------------------------------------------
def _f16c_load(lanes: int):
    """An intrinsic loading `lanes` IEEE halves (uint16 bits) from element `off` as float32 through
    LLVM's `fpext half`: vcvtph2ps. Only used on F16C hosts (elsewhere LLVM would emit a runtime
    call numba cannot link), which numba's cache keys on (it records the host CPU features)."""
    @intrinsic
    def load(typingctx, arr, off):
        if not (isinstance(arr, types.Array) and arr.dtype == types.uint16 and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = builder.gep(ary.data, [args[1]])
            half, f32 = ir.HalfType(), ir.FloatType()
            if lanes > 1:
                half, f32 = ir.VectorType(half, lanes), ir.VectorType(f32, lanes)
            return builder.fpext(builder.load(builder.bitcast(ptr, half.as_pointer()), align=2), f32)

        return (F32x8 if lanes == 8 else types.float32)(arr, types.intp), codegen

    return load


_f16_f16c = _f16c_load(1)
_f16x8_f16c = _f16c_load(8)


def _has_f16c() -> bool:
    return "f16c" in isa.features()


def _wval(w, i):
    """Weight element i as float32, by the array's dtype: f32, u16 = F16 bits, i16 = BF16 bits."""


@overload(_wval, inline="always")
def _ol_wval(w, i):
    if w.dtype == types.float32:
        return lambda w, i: at(w, i)
    if w.dtype == types.uint16:
        if _has_f16c():
            return lambda w, i: _f16_f16c(w, i)
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
        if _has_f16c():
            return lambda w, i: _f16x8_f16c(w, i)
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


# --- gemm: a task's rows converted once, 4 x 4 register tiles ------------------------------------
@njit(cache=True)
def rows_per_task(K: int) -> int:
    """Rows per task: 16, fewer when 16 converted rows of K float32 would pass 256 KiB (about a
    quarter of Zen 4's L2, which also holds the 4 activation columns being tiled); at least 4."""
    return max(4, min(RB_MAX, (WB_BYTES // (4 * max(K, 1))) // 4 * 4))


@njit(cache=True)
def _pack(w, wo, wrs, nr, K, wb):
    """wb[r * K + k] = float32 weight (row r, column k) for r < nr, from w[wo + r * wrs + k]."""
    for r in range(nr):
        src = wo + r * wrs
        dst = r * K
        for k in range(K):
            wb[dst + k] = _wval(w, src + k)


@njit(cache=True)
def _tile4x4(wb, wq, K, y, y0, y1, y2, y3, acc):
    """acc[4 * c + r] = sum_k wb[wq + r * K + k] * y[yc + k] for the 4 rows r of one quad and the
    4 columns yc = y0..y3: 16 accumulators of 8 lanes, one horizontal sum each."""
    a00 = a01 = a02 = a03 = zero_f32x8()
    a10 = a11 = a12 = a13 = zero_f32x8()
    a20 = a21 = a22 = a23 = zero_f32x8()
    a30 = a31 = a32 = a33 = zero_f32x8()
    k_main = K - K % 8
    for k in range(0, k_main, 8):
        w0 = load_f32x8(wb, wq + k)
        w1 = load_f32x8(wb, wq + K + k)
        w2 = load_f32x8(wb, wq + 2 * K + k)
        w3 = load_f32x8(wb, wq + 3 * K + k)
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
    for k in range(k_main, K):  # K % 8 tail
        for c in range(4):
            v = at(y, ys[c] + k)
            for r in range(4):
                acc[4 * c + r] += at(wb, wq + r * K + k) * v


@njit(cache=True)
def _tile2x3(w, wo, wrs, y, y0, y1, y2, K, acc):
    """acc[2 * c + r] = row r (of 2: w[wo], w[wo + wrs]) . column c (of 3: y[y0], y[y1], y[y2]),
    weights converted in registers, each conversion feeding 3 FMAs. A lone last row passes
    wrs = 0 (it is computed twice), 2 columns pass y2 = y1."""
    a00 = a01 = a10 = a11 = a20 = a21 = zero_f32x8()
    k_main = K - K % 8
    for k in range(0, k_main, 8):
        w0 = _wvec(w, wo + k)
        w1 = _wvec(w, wo + wrs + k)
        v = load_f32x8(y, y0 + k)
        a00 = fma_f32x8(a00, w0, v)
        a01 = fma_f32x8(a01, w1, v)
        v = load_f32x8(y, y1 + k)
        a10 = fma_f32x8(a10, w0, v)
        a11 = fma_f32x8(a11, w1, v)
        v = load_f32x8(y, y2 + k)
        a20 = fma_f32x8(a20, w0, v)
        a21 = fma_f32x8(a21, w1, v)
    acc[0], acc[1], acc[2] = hsum_f32x8(a00), hsum_f32x8(a01), hsum_f32x8(a10)
    acc[3], acc[4], acc[5] = hsum_f32x8(a11), hsum_f32x8(a20), hsum_f32x8(a21)
    ys = (y0, y1, y2)
    for k in range(k_main, K):
        for c in range(3):
            v = at(y, ys[c] + k)
            acc[2 * c] += _wval(w, wo + k) * v
            acc[2 * c + 1] += _wval(w, wo + wrs + k) * v


@njit(cache=True)
def _gemm_task(w, wo, wrs, nr, rb, y, K, c0, ce, ycol, ocol, M, r0, out):
    """Rows r0..r0+nr (weights from w[wo], nr <= rb) times the columns c0..ce (>= 2) of one group:
    2 or 3 columns as 2 x 3 tiles straight from w; 4 or more as 4 x 4 tiles on the converted
    rows, then row dots on them for the leftover columns."""
    nq = (nr + 3) // 4
    if ce - c0 < 4:  # 2 or 3 columns: no column quad, so no conversion pass either
        acc = np.empty(6, np.float32)
        nc = ce - c0
        y0, y1, y2 = ycol[c0] * K, ycol[c0 + 1] * K, ycol[c0 + nc - 1] * K
        for r in range(0, nr, 2):
            n = min(2, nr - r)
            _tile2x3(w, wo + r * wrs, wrs * (n - 1), y, y0, y1, y2, K, acc)
            for j in range(nc):
                oo = ocol[c0 + j] * M + r0 + r
                for i in range(n):
                    out[oo + i] = acc[2 * j + i]
        return
    # rows nr..4*nq of a partial last quad stay uninitialized: each tile output depends on its own
    # row only, and those rows' outputs are never written
    wb = np.empty(4 * nq * K, np.float32)
    _pack(w, wo, wrs, nr, K, wb)
    acc = np.empty(16, np.float32)
    c = c0
    while c + 4 <= ce:
        y0, y1, y2, y3 = ycol[c] * K, ycol[c + 1] * K, ycol[c + 2] * K, ycol[c + 3] * K
        for q in range(nq):
            _tile4x4(wb, 4 * q * K, K, y, y0, y1, y2, y3, acc)
            n = min(4, nr - 4 * q)
            for j in range(4):
                oo = ocol[c + j] * M + r0 + 4 * q
                for r in range(n):
                    out[oo + r] = acc[4 * j + r]
        c += 4
    for cc in range(c, ce):  # leftover columns
        yo = ycol[cc] * K
        oo = ocol[cc] * M + r0
        for r in range(nr):
            out[oo + r] = _fdot(wb, r * K, y, yo, K)


@njit(cache=True)
def float_mm(part, parts, w, wg, wrs, M, y, K, cstart, ycol, ocol, out):
    """The float MUL_MAT / MUL_MAT_ID kernel as a split kernel (`ggx_cpu.launch.split`): part p
    runs a contiguous share of the (group, rows_per_task(K) rows) tasks; gemv for a one-column
    group, 2 x 3 or 4 x 4 register tiles otherwise."""
    if part < 0 or part >= parts:
        return
    rb = rows_per_task(K)
    n_groups = wg.shape[0]
    n_tiles = (M + rb - 1) // rb
    n = n_groups * n_tiles
    for t in range(part * n // parts, (part + 1) * n // parts):
        g = t // n_tiles
        r0 = (t % n_tiles) * rb
        nr = min(rb, M - r0)
        wo = wg[g] + r0 * wrs
        c0 = cstart[g]
        ce = cstart[g + 1]
        if ce - c0 == 1:
            yo = ycol[c0] * K
            oo = ocol[c0] * M + r0
            for r in range(nr):
                out[oo + r] = _fdot(w, wo + r * wrs, y, yo, K)
        elif ce - c0 > 1:
            _gemm_task(w, wo, wrs, nr, rb, y, K, c0, ce, ycol, ocol, M, r0, out)
