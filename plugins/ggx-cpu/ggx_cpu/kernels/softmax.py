"""SOFT_MAX: softmax over ne0 of a*scale + slope_h*mask, F32 (mask F16 or F32), like ggml.

The mask row is mask[:, i1, i2 % mask.ne2, i3 % mask.ne3] (mask.ne1 may exceed a.ne1). ALiBi
(max_bias > 0): head h = i2 has slope m0^(h+1) for h < n_head_log2, else m1^(2(h-n_head_log2)+1),
n_head_log2 = 2^floor(log2(n_head)), m0 = 2^(-max_bias/n_head_log2), m1 = 2^(-max_bias/2/n_head_log2).
exp(x - max) on unit-stride rows is ggml_vec_soft_max_f32 for the ISA variant's float form
(`ggx_cpu.isa.vmath`): ggml's vectorized expf over chunks of 16 (AVX-512) or 8 (AVX2) values,
each chunk summed in float32 and the chunk sums accumulated in float64; libm expf on the tail
and on strided rows.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ggx.errors import GGXShapeError
from ggx.tensor import Tensor
from ggx.types import GType

from .. import isa
from ..isa.simd import fma_f32x8, load_f32x8, mul_f32x8, splat_f32x8, store_f32x8
from ..isa.vmath import exp_chunk, expf, float_simd, hmax_f32x8, lanes, load_as_f32x8, max_f32x8
from .common import Launch, elems, need_ne, need_srcs, need_type, rows_launch
from .convert import as_f32


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """float32 slope per head (all 1 when max_bias == 0), as ggml computes them."""
    if max_bias <= 0:
        return np.ones(max(n_head, 1), np.float32)
    n_head_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0 = np.float32(2.0) ** np.float32(-max_bias / n_head_log2)
    m1 = np.float32(2.0) ** np.float32(-max_bias / 2.0 / n_head_log2)
    h = np.arange(n_head)
    return np.where(h < n_head_log2, m0 ** (h + 1).astype(np.float32),
                    m1 ** (2 * (h - n_head_log2) + 1).astype(np.float32)).astype(np.float32)


@njit(cache=True, inline="always")
def _softmax_row(scale, slope, has_mask, x, m, y):
    """One row given as 1-D slices (any stride), one value at a time."""
    n0 = x.size
    vmax = np.float32(-np.inf)
    for i in range(n0):
        w = x[i] * scale
        if has_mask:
            w += slope * as_f32(m[i])
        y[i] = w
        vmax = max(vmax, w)
    acc = 0.0
    for i in range(n0):
        e = expf(y[i] - vmax)
        y[i] = e
        acc += np.float64(e)
    inv = np.float32(1.0 / acc)
    for i in range(n0):
        y[i] *= inv


@njit(cache=True, inline="always")
def _softmax_row_vec(fs, scale, slope, has_mask, x, xb, m, mb, y, yb, n0):
    """One unit-stride row at x[xb:], mask m[mb:] (F32 or F16), into y[yb:], as ggml's vector
    code for the float form fs (module docstring)."""
    sv, slv = splat_f32x8(scale), splat_f32x8(slope)
    vmax = splat_f32x8(np.float32(-np.inf))
    i = 0
    while i + 8 <= n0:
        w = mul_f32x8(load_f32x8(x, xb + i), sv)
        if has_mask:
            w = fma_f32x8(w, load_as_f32x8(m, mb + i), slv)
        store_f32x8(y, yb + i, w)
        vmax = max_f32x8(vmax, w)
        i += 8
    mx = hmax_f32x8(vmax)
    for j in range(i, n0):
        w = x[xb + j] * scale
        if has_mask:
            w += slope * as_f32(m[mb + j])
        y[yb + j] = w
        mx = max(mx, w)
    acc = 0.0
    i = 0
    while i + lanes(fs) <= n0:
        acc += np.float64(exp_chunk(fs, y, yb + i, y, yb + i, mx))
        i += lanes(fs)
    for j in range(i, n0):
        e = expf(y[yb + j] - mx)
        y[yb + j] = e
        acc += np.float64(e)
    inv = splat_f32x8(np.float32(1.0 / acc))
    i = 0
    while i + 8 <= n0:
        store_f32x8(y, yb + i, mul_f32x8(load_f32x8(y, yb + i), inv))
        i += 8
    for j in range(i, n0):
        y[yb + j] *= np.float32(1.0 / acc)


@njit(cache=True)
def softmax_rows(r0, r1, fs, scale, slopes, has_mask, x, xo, xs, ne, m, mo, ms, mne, y, yo, ys):
    n0, n1, n2 = ne[0], ne[1], ne[2]
    for r in range(r0, r1):
        i1, i2, i3 = r % n1, (r // n1) % n2, r // (n1 * n2)
        xb = xo + i1 * xs[1] + i2 * xs[2] + i3 * xs[3]
        yb = yo + i1 * ys[1] + i2 * ys[2] + i3 * ys[3]
        mb = mo + i1 * ms[1] + (i2 % mne[2]) * ms[2] + (i3 % mne[3]) * ms[3]
        if xs[0] == 1 and ys[0] == 1 and ms[0] == 1:  # unit-stride rows: vectors
            _softmax_row_vec(fs, scale, slopes[i2], has_mask, x, xb, m, mb, y, yb, n0)
        else:
            _softmax_row(scale, slopes[i2], has_mask, x[xb: xb + (n0 - 1) * xs[0] + 1: xs[0]],
                         m[mb: mb + (n0 - 1) * ms[0] + 1: ms[0]], y[yb: yb + (n0 - 1) * ys[0] + 1: ys[0]])


def soft_max(node: Tensor, n_threads: int) -> Launch:
    op = "SOFT_MAX"
    need_srcs(node, 1)
    a = node.src[0]
    mask = node.src[1] if len(node.src) > 1 else None
    p = node.params
    need_type(a, "a", op, GType.F32)
    need_type(node, "dst", op, GType.F32)
    need_ne(node, a.ne, "dst", op)
    x, xo, xs, ne = elems(a, "a", op)
    y, yo, ys, _ = elems(node, "dst", op)
    if mask is not None:
        need_type(mask, "mask", op, GType.F16, GType.F32)
        if mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1] or 0 in mask.ne[2:]:
            raise GGXShapeError(f"SOFT_MAX: mask {mask.describe()} does not fit a {a.describe()}")
        m, mo, ms, mne = elems(mask, "mask", op)
    elif p.max_bias > 0:
        raise GGXShapeError("SOFT_MAX: max_bias (ALiBi) needs a mask")
    else:
        m, mo, ms, mne = x, 0, (1, 0, 0, 0), (1, 1, 1, 1)  # never read
    slopes = alibi_slopes(a.ne[2], p.max_bias)
    return rows_launch(softmax_rows, n_threads, ne, float_simd(isa.active()), np.float32(p.scale),
                       slopes, mask is not None,
                       x, xo, xs, ne, m, mo, ms, mne, y, yo, ys)
