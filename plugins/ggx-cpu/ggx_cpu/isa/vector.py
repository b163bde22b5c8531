"""Q4_0 / Q4_1 / Q5_0 / Q8_0 dot products on SIMD vectors, one source for every vector ISA.

The ISA-specific part is the 8-bit product `dot_u8s8` / `dot_s8s8` of `ggx_cpu.isa.dispatch`,
specialized by the type of the `isa` token: AVX2 (vpmaddubsw + vpmaddwd) or AVX-512 VNNI
(vpdpbusd). Everything else (loads, nibble expansion, int -> float, fma) is plain LLVM IR.

Layouts (shared with `ggx_cpu.isa.portable`, which has the same functions and signatures):

- weights `w`: uint8, ggml block bytes; a row starts at byte `wo` and holds `nb` blocks.
  Q4_0 block: f16 d @0, 16 B nibbles @2 (18 B). Q4_1: f16 d @0, f16 m @2, nibbles @4 (20 B).
  Q5_0: f16 d @0, u32 qh (fifth bits) @2, nibbles @6 (22 B). Q8_0: f16 d @0, 32 x i8 @2 (34 B).
- activations (from `ggx_cpu.kernels.quantize_act`, structure of arrays): `yq` int8 values,
  a column starts at value `yo`; `yd` float32 block scale at `yo // 32 + b`; `ys` float32
  Q8_1 `s` (d * sum q) at `yo // 32 + b`; `ys4` int32 sums of 4 consecutive values at `yo // 4 + i`.
- per-lane accumulators: a row keeps 8 float lanes across all its blocks and sums them once.
- row quads (`rows4_*`, the gemv): 4 weight rows x 1 column, result r to out[oo + r]
  (`ggx_cpu.isa.vector_avx512` has 512-bit ones of Q4_0/Q4_1 for AVX-512 VNNI).
- tiles: 4 weight rows (at wo + r * wrs) x 4 columns (at yo0..yo3) with 16 accumulators;
  result (r, c) goes to out[oo_c + r].
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .dispatch import dot_s8s8, dot_u8s8
from .simd import (
    at,
    f16_at,
    fma_f32x8,
    fma_i32x8_f32x8,
    hsum_f32x8,
    load_i8x16,
    load_i8x32,
    load_i32x8,
    mul_f32x8,
    mul_i32x8,
    nibbles_at,
    nibbles_i8x32,
    prefetch_next_quad,
    q5_at,
    splat_f16_at,
    splat_f32x8,
    zero_f32x8,
    zero_i32x8,
)


@njit(cache=True, inline="always")
def _f16(w, o):
    return f16_at(w, o)


@njit(cache=True, inline="always")
def _q4_0_block(isa, acc, w, o, yq, yd, ys4, y):
    init = mul_i32x8(load_i32x8(ys4, y >> 2), -8)
    lanes = dot_u8s8(isa, init, nibbles_i8x32(load_i8x16(w, o + 2)), load_i8x32(yq, y))
    return fma_i32x8_f32x8(acc, lanes, splat_f32x8(_f16(w, o) * at(yd, y >> 5)))


@njit(cache=True, inline="always")
def _q5_0_block(isa, acc, w, o, yq, yd, ys4, y):
    # q in 0..31 is the unsigned operand (no vpmaddubsw saturation: 2 * 31 * 127 < 32767); the
    # -16 offset of every value starts the lanes at -16 * (sums of y), as Q4_0's -8 does
    init = mul_i32x8(load_i32x8(ys4, y >> 2), -16)
    lanes = dot_u8s8(isa, init, q5_at(w, o + 2), load_i8x32(yq, y))
    return fma_i32x8_f32x8(acc, lanes, splat_f32x8(_f16(w, o) * at(yd, y >> 5)))


@njit(cache=True, inline="always")
def _q4_1_block(isa, acc, w, o, yq, yd, y):
    lanes = dot_u8s8(isa, zero_i32x8(), nibbles_i8x32(load_i8x16(w, o + 4)), load_i8x32(yq, y))
    return fma_i32x8_f32x8(acc, lanes, splat_f32x8(_f16(w, o) * at(yd, y >> 5)))


@njit(cache=True, inline="always")
def _q8_0_block(isa, acc, w, o, yq, yd, ys4, y):
    lanes = dot_s8s8(isa, zero_i32x8(), load_i8x32(w, o + 2), load_i8x32(yq, y), load_i32x8(ys4, y >> 2))
    return fma_i32x8_f32x8(acc, lanes, splat_f32x8(_f16(w, o) * at(yd, y >> 5)))


# Row dots keep two accumulators (even and odd blocks) so consecutive blocks do not wait on
# each other's fma: one dependency chain would cap a core at one block per fma latency.
@njit(cache=True)
def dot_q4_0(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    """sum_b d_w d_y sum_j (q_j - 8) y_j: lanes start at -8 * (sums of y), then += q . y."""
    acc0 = zero_f32x8()
    acc1 = zero_f32x8()
    for b in range(0, nb - 1, 2):
        acc0 = _q4_0_block(isa, acc0, w, wo + b * 18, yq, yd, ys4, yo + b * 32)
        acc1 = _q4_0_block(isa, acc1, w, wo + b * 18 + 18, yq, yd, ys4, yo + b * 32 + 32)
    if nb % 2:
        acc0 = _q4_0_block(isa, acc0, w, wo + (nb - 1) * 18, yq, yd, ys4, yo + (nb - 1) * 32)
    return hsum_f32x8(acc0) + hsum_f32x8(acc1)


@njit(cache=True)
def dot_q5_0(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    """sum_b d_w d_y sum_j (q_j - 16) y_j, q_j the 5-bit values: lanes start at -16 * (sums of y)."""
    acc0 = zero_f32x8()
    acc1 = zero_f32x8()
    for b in range(0, nb - 1, 2):
        acc0 = _q5_0_block(isa, acc0, w, wo + b * 22, yq, yd, ys4, yo + b * 32)
        acc1 = _q5_0_block(isa, acc1, w, wo + b * 22 + 22, yq, yd, ys4, yo + b * 32 + 32)
    if nb % 2:
        acc0 = _q5_0_block(isa, acc0, w, wo + (nb - 1) * 22, yq, yd, ys4, yo + (nb - 1) * 32)
    return hsum_f32x8(acc0) + hsum_f32x8(acc1)


@njit(cache=True)
def dot_q4_1(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    """sum_b d_w d_y (q . y) + m_w s_y (ggml's vec_dot_q4_1_q8_1)."""
    acc0 = zero_f32x8()
    acc1 = zero_f32x8()
    m0 = np.float32(0.0)  # the m * s terms, also on two chains
    m1 = np.float32(0.0)
    yb = yo >> 5
    for b in range(0, nb - 1, 2):
        o = wo + b * 20
        acc0 = _q4_1_block(isa, acc0, w, o, yq, yd, yo + b * 32)
        acc1 = _q4_1_block(isa, acc1, w, o + 20, yq, yd, yo + b * 32 + 32)
        m0 += _f16(w, o + 2) * at(ys, yb + b)
        m1 += _f16(w, o + 22) * at(ys, yb + b + 1)
    if nb % 2:
        o = wo + (nb - 1) * 20
        acc0 = _q4_1_block(isa, acc0, w, o, yq, yd, yo + (nb - 1) * 32)
        m0 += _f16(w, o + 2) * at(ys, yb + nb - 1)
    return hsum_f32x8(acc0) + hsum_f32x8(acc1) + (m0 + m1)


@njit(cache=True)
def dot_q8_0(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    """sum_b d_w d_y (w . y)."""
    acc0 = zero_f32x8()
    acc1 = zero_f32x8()
    for b in range(0, nb - 1, 2):
        acc0 = _q8_0_block(isa, acc0, w, wo + b * 34, yq, yd, ys4, yo + b * 32)
        acc1 = _q8_0_block(isa, acc1, w, wo + b * 34 + 34, yq, yd, ys4, yo + b * 32 + 32)
    if nb % 2:
        acc0 = _q8_0_block(isa, acc0, w, wo + (nb - 1) * 34, yq, yd, ys4, yo + (nb - 1) * 32)
    return hsum_f32x8(acc0) + hsum_f32x8(acc1)


# Row quads (the gemv): 4 weight rows x 1 column, the activation block and its scale loaded
# once for 4 independent accumulator chains; a row dot alone is latency- and overhead-bound.
@njit(cache=True)
def rows4_q4_0(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
    """out[oo + r] = dot_q4_0 of rows wo + r * wrs (r < 4) with the column at yo."""
    a0 = a1 = a2 = a3 = zero_f32x8()
    for b in range(nb):
        o0 = wo + b * 18
        o1 = o0 + wrs
        o2 = o1 + wrs
        o3 = o2 + wrs
        prefetch_next_quad(w, wo, wrs, 72, b)
        y = yo + b * 32
        # shared by the 4 rows: the activation block, its -8 * sums (lane start), its scale
        v, i, e = load_i8x32(yq, y), mul_i32x8(load_i32x8(ys4, y >> 2), -8), splat_f32x8(at(yd, y >> 5))
        a0 = fma_i32x8_f32x8(a0, dot_u8s8(isa, i, nibbles_at(w, o0 + 2), v), mul_f32x8(splat_f16_at(w, o0), e))
        a1 = fma_i32x8_f32x8(a1, dot_u8s8(isa, i, nibbles_at(w, o1 + 2), v), mul_f32x8(splat_f16_at(w, o1), e))
        a2 = fma_i32x8_f32x8(a2, dot_u8s8(isa, i, nibbles_at(w, o2 + 2), v), mul_f32x8(splat_f16_at(w, o2), e))
        a3 = fma_i32x8_f32x8(a3, dot_u8s8(isa, i, nibbles_at(w, o3 + 2), v), mul_f32x8(splat_f16_at(w, o3), e))
    out[oo] = hsum_f32x8(a0)
    out[oo + 1] = hsum_f32x8(a1)
    out[oo + 2] = hsum_f32x8(a2)
    out[oo + 3] = hsum_f32x8(a3)


@njit(cache=True)
def rows4_q5_0(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
    """out[oo + r] = dot_q5_0 of rows wo + r * wrs (r < 4) with the column at yo."""
    a0 = a1 = a2 = a3 = zero_f32x8()
    for b in range(nb):
        o0 = wo + b * 22
        o1 = o0 + wrs
        o2 = o1 + wrs
        o3 = o2 + wrs
        prefetch_next_quad(w, wo, wrs, 88, b)
        y = yo + b * 32
        # shared by the 4 rows: the activation block, its -16 * sums (lane start), its scale
        v, i, e = load_i8x32(yq, y), mul_i32x8(load_i32x8(ys4, y >> 2), -16), splat_f32x8(at(yd, y >> 5))
        a0 = fma_i32x8_f32x8(a0, dot_u8s8(isa, i, q5_at(w, o0 + 2), v), mul_f32x8(splat_f16_at(w, o0), e))
        a1 = fma_i32x8_f32x8(a1, dot_u8s8(isa, i, q5_at(w, o1 + 2), v), mul_f32x8(splat_f16_at(w, o1), e))
        a2 = fma_i32x8_f32x8(a2, dot_u8s8(isa, i, q5_at(w, o2 + 2), v), mul_f32x8(splat_f16_at(w, o2), e))
        a3 = fma_i32x8_f32x8(a3, dot_u8s8(isa, i, q5_at(w, o3 + 2), v), mul_f32x8(splat_f16_at(w, o3), e))
    out[oo] = hsum_f32x8(a0)
    out[oo + 1] = hsum_f32x8(a1)
    out[oo + 2] = hsum_f32x8(a2)
    out[oo + 3] = hsum_f32x8(a3)


@njit(cache=True)
def rows4_q4_1(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
    """out[oo + r] = dot_q4_1 of rows wo + r * wrs (r < 4) with the column at yo.

    The m * s terms go to their own vector accumulators (p*, every lane adds m * s / 8, exact
    scaling by a power of two): one vector fma per block instead of a scalar f16 round trip.
    """
    a0 = a1 = a2 = a3 = zero_f32x8()
    p0 = p1 = p2 = p3 = zero_f32x8()
    z = zero_i32x8()
    for b in range(nb):
        o0 = wo + b * 20
        o1 = o0 + wrs
        o2 = o1 + wrs
        o3 = o2 + wrs
        prefetch_next_quad(w, wo, wrs, 80, b)
        y = yo + b * 32
        v, e, sy = load_i8x32(yq, y), splat_f32x8(at(yd, y >> 5)), splat_f32x8(at(ys, y >> 5) * np.float32(0.125))
        a0 = fma_i32x8_f32x8(a0, dot_u8s8(isa, z, nibbles_at(w, o0 + 4), v), mul_f32x8(splat_f16_at(w, o0), e))
        a1 = fma_i32x8_f32x8(a1, dot_u8s8(isa, z, nibbles_at(w, o1 + 4), v), mul_f32x8(splat_f16_at(w, o1), e))
        a2 = fma_i32x8_f32x8(a2, dot_u8s8(isa, z, nibbles_at(w, o2 + 4), v), mul_f32x8(splat_f16_at(w, o2), e))
        a3 = fma_i32x8_f32x8(a3, dot_u8s8(isa, z, nibbles_at(w, o3 + 4), v), mul_f32x8(splat_f16_at(w, o3), e))
        p0 = fma_f32x8(p0, splat_f16_at(w, o0 + 2), sy)
        p1 = fma_f32x8(p1, splat_f16_at(w, o1 + 2), sy)
        p2 = fma_f32x8(p2, splat_f16_at(w, o2 + 2), sy)
        p3 = fma_f32x8(p3, splat_f16_at(w, o3 + 2), sy)
    out[oo] = hsum_f32x8(a0) + hsum_f32x8(p0)
    out[oo + 1] = hsum_f32x8(a1) + hsum_f32x8(p1)
    out[oo + 2] = hsum_f32x8(a2) + hsum_f32x8(p2)
    out[oo + 3] = hsum_f32x8(a3) + hsum_f32x8(p3)


@njit(cache=True)
def rows4_q8_0(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
    """out[oo + r] = dot_q8_0 of rows wo + r * wrs (r < 4) with the column at yo."""
    a0 = a1 = a2 = a3 = zero_f32x8()
    z = zero_i32x8()
    for b in range(nb):
        o0 = wo + b * 34
        o1 = o0 + wrs
        o2 = o1 + wrs
        o3 = o2 + wrs
        prefetch_next_quad(w, wo, wrs, 136, b)
        y = yo + b * 32
        v, s, e = load_i8x32(yq, y), load_i32x8(ys4, y >> 2), at(yd, y >> 5)
        a0 = fma_i32x8_f32x8(a0, dot_s8s8(isa, z, load_i8x32(w, o0 + 2), v, s), splat_f32x8(_f16(w, o0) * e))
        a1 = fma_i32x8_f32x8(a1, dot_s8s8(isa, z, load_i8x32(w, o1 + 2), v, s), splat_f32x8(_f16(w, o1) * e))
        a2 = fma_i32x8_f32x8(a2, dot_s8s8(isa, z, load_i8x32(w, o2 + 2), v, s), splat_f32x8(_f16(w, o2) * e))
        a3 = fma_i32x8_f32x8(a3, dot_s8s8(isa, z, load_i8x32(w, o3 + 2), v, s), splat_f32x8(_f16(w, o3) * e))
    out[oo] = hsum_f32x8(a0)
    out[oo + 1] = hsum_f32x8(a1)
    out[oo + 2] = hsum_f32x8(a2)
    out[oo + 3] = hsum_f32x8(a3)


@njit(cache=True)
def tile_q4_0(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    """4 rows x 4 columns of dot_q4_0, each weight and activation block loaded once."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = zero_f32x8()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = zero_f32x8()
    for b in range(nb):
        o0 = wo + b * 18
        o1 = o0 + wrs
        o2 = o1 + wrs
        o3 = o2 + wrs
        w0 = nibbles_i8x32(load_i8x16(w, o0 + 2))
        w1 = nibbles_i8x32(load_i8x16(w, o1 + 2))
        w2 = nibbles_i8x32(load_i8x16(w, o2 + 2))
        w3 = nibbles_i8x32(load_i8x16(w, o3 + 2))
        d0, d1, d2, d3 = _f16(w, o0), _f16(w, o1), _f16(w, o2), _f16(w, o3)
        y0, y1, y2, y3 = yo0 + b * 32, yo1 + b * 32, yo2 + b * 32, yo3 + b * 32
        # column c: its activation block, its -8 * sums (lane start), its scale
        v, i, e = load_i8x32(yq, y0), mul_i32x8(load_i32x8(ys4, y0 >> 2), -8), at(yd, y0 >> 5)
        a00 = fma_i32x8_f32x8(a00, dot_u8s8(isa, i, w0, v), splat_f32x8(d0 * e))
        a10 = fma_i32x8_f32x8(a10, dot_u8s8(isa, i, w1, v), splat_f32x8(d1 * e))
        a20 = fma_i32x8_f32x8(a20, dot_u8s8(isa, i, w2, v), splat_f32x8(d2 * e))
        a30 = fma_i32x8_f32x8(a30, dot_u8s8(isa, i, w3, v), splat_f32x8(d3 * e))
        v, i, e = load_i8x32(yq, y1), mul_i32x8(load_i32x8(ys4, y1 >> 2), -8), at(yd, y1 >> 5)
        a01 = fma_i32x8_f32x8(a01, dot_u8s8(isa, i, w0, v), splat_f32x8(d0 * e))
        a11 = fma_i32x8_f32x8(a11, dot_u8s8(isa, i, w1, v), splat_f32x8(d1 * e))
        a21 = fma_i32x8_f32x8(a21, dot_u8s8(isa, i, w2, v), splat_f32x8(d2 * e))
        a31 = fma_i32x8_f32x8(a31, dot_u8s8(isa, i, w3, v), splat_f32x8(d3 * e))
        v, i, e = load_i8x32(yq, y2), mul_i32x8(load_i32x8(ys4, y2 >> 2), -8), at(yd, y2 >> 5)
        a02 = fma_i32x8_f32x8(a02, dot_u8s8(isa, i, w0, v), splat_f32x8(d0 * e))
        a12 = fma_i32x8_f32x8(a12, dot_u8s8(isa, i, w1, v), splat_f32x8(d1 * e))
        a22 = fma_i32x8_f32x8(a22, dot_u8s8(isa, i, w2, v), splat_f32x8(d2 * e))
        a32 = fma_i32x8_f32x8(a32, dot_u8s8(isa, i, w3, v), splat_f32x8(d3 * e))
        v, i, e = load_i8x32(yq, y3), mul_i32x8(load_i32x8(ys4, y3 >> 2), -8), at(yd, y3 >> 5)
        a03 = fma_i32x8_f32x8(a03, dot_u8s8(isa, i, w0, v), splat_f32x8(d0 * e))
        a13 = fma_i32x8_f32x8(a13, dot_u8s8(isa, i, w1, v), splat_f32x8(d1 * e))
        a23 = fma_i32x8_f32x8(a23, dot_u8s8(isa, i, w2, v), splat_f32x8(d2 * e))
        a33 = fma_i32x8_f32x8(a33, dot_u8s8(isa, i, w3, v), splat_f32x8(d3 * e))
    store_tile_4x4(out, oo0, oo1, oo2, oo3, a00, a01, a02, a03, a10, a11, a12, a13,
                   a20, a21, a22, a23, a30, a31, a32, a33)


@njit(cache=True)
def tile_q5_0(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    """4 rows x 4 columns of dot_q5_0, each weight and activation block loaded (and its fifth
    bits spread) once."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = zero_f32x8()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = zero_f32x8()
    for b in range(nb):
        o0 = wo + b * 22
        o1 = o0 + wrs
        o2 = o1 + wrs
        o3 = o2 + wrs
        w0, w1, w2, w3 = q5_at(w, o0 + 2), q5_at(w, o1 + 2), q5_at(w, o2 + 2), q5_at(w, o3 + 2)
        d0, d1, d2, d3 = _f16(w, o0), _f16(w, o1), _f16(w, o2), _f16(w, o3)
        y0, y1, y2, y3 = yo0 + b * 32, yo1 + b * 32, yo2 + b * 32, yo3 + b * 32
        # column c: its activation block, its -16 * sums (lane start), its scale
        v, i, e = load_i8x32(yq, y0), mul_i32x8(load_i32x8(ys4, y0 >> 2), -16), at(yd, y0 >> 5)
        a00 = fma_i32x8_f32x8(a00, dot_u8s8(isa, i, w0, v), splat_f32x8(d0 * e))
        a10 = fma_i32x8_f32x8(a10, dot_u8s8(isa, i, w1, v), splat_f32x8(d1 * e))
        a20 = fma_i32x8_f32x8(a20, dot_u8s8(isa, i, w2, v), splat_f32x8(d2 * e))
        a30 = fma_i32x8_f32x8(a30, dot_u8s8(isa, i, w3, v), splat_f32x8(d3 * e))
        v, i, e = load_i8x32(yq, y1), mul_i32x8(load_i32x8(ys4, y1 >> 2), -16), at(yd, y1 >> 5)
        a01 = fma_i32x8_f32x8(a01, dot_u8s8(isa, i, w0, v), splat_f32x8(d0 * e))
        a11 = fma_i32x8_f32x8(a11, dot_u8s8(isa, i, w1, v), splat_f32x8(d1 * e))
        a21 = fma_i32x8_f32x8(a21, dot_u8s8(isa, i, w2, v), splat_f32x8(d2 * e))
        a31 = fma_i32x8_f32x8(a31, dot_u8s8(isa, i, w3, v), splat_f32x8(d3 * e))
        v, i, e = load_i8x32(yq, y2), mul_i32x8(load_i32x8(ys4, y2 >> 2), -16), at(yd, y2 >> 5)
        a02 = fma_i32x8_f32x8(a02, dot_u8s8(isa, i, w0, v), splat_f32x8(d0 * e))
        a12 = fma_i32x8_f32x8(a12, dot_u8s8(isa, i, w1, v), splat_f32x8(d1 * e))
        a22 = fma_i32x8_f32x8(a22, dot_u8s8(isa, i, w2, v), splat_f32x8(d2 * e))
        a32 = fma_i32x8_f32x8(a32, dot_u8s8(isa, i, w3, v), splat_f32x8(d3 * e))
        v, i, e = load_i8x32(yq, y3), mul_i32x8(load_i32x8(ys4, y3 >> 2), -16), at(yd, y3 >> 5)
        a03 = fma_i32x8_f32x8(a03, dot_u8s8(isa, i, w0, v), splat_f32x8(d0 * e))
        a13 = fma_i32x8_f32x8(a13, dot_u8s8(isa, i, w1, v), splat_f32x8(d1 * e))
        a23 = fma_i32x8_f32x8(a23, dot_u8s8(isa, i, w2, v), splat_f32x8(d2 * e))
        a33 = fma_i32x8_f32x8(a33, dot_u8s8(isa, i, w3, v), splat_f32x8(d3 * e))
    store_tile_4x4(out, oo0, oo1, oo2, oo3, a00, a01, a02, a03, a10, a11, a12, a13,
                   a20, a21, a22, a23, a30, a31, a32, a33)


@njit(cache=True)
def tile_q4_1(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    """4 rows x 4 columns of dot_q4_1; the 16 m * s terms ride along as independent scalar chains."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = zero_f32x8()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = zero_f32x8()
    z = zero_i32x8()
    p00 = p01 = p02 = p03 = p10 = p11 = p12 = p13 = np.float32(0.0)
    p20 = p21 = p22 = p23 = p30 = p31 = p32 = p33 = np.float32(0.0)
    for b in range(nb):
        o0 = wo + b * 20
        o1 = o0 + wrs
        o2 = o1 + wrs
        o3 = o2 + wrs
        w0 = nibbles_i8x32(load_i8x16(w, o0 + 4))
        w1 = nibbles_i8x32(load_i8x16(w, o1 + 4))
        w2 = nibbles_i8x32(load_i8x16(w, o2 + 4))
        w3 = nibbles_i8x32(load_i8x16(w, o3 + 4))
        d0, d1, d2, d3 = _f16(w, o0), _f16(w, o1), _f16(w, o2), _f16(w, o3)
        y0, y1, y2, y3 = yo0 + b * 32, yo1 + b * 32, yo2 + b * 32, yo3 + b * 32
        m0, m1, m2, m3 = _f16(w, o0 + 2), _f16(w, o1 + 2), _f16(w, o2 + 2), _f16(w, o3 + 2)
        s0, s1, s2, s3 = at(ys, y0 >> 5), at(ys, y1 >> 5), at(ys, y2 >> 5), at(ys, y3 >> 5)
        p00, p01, p02, p03 = p00 + m0 * s0, p01 + m0 * s1, p02 + m0 * s2, p03 + m0 * s3
        p10, p11, p12, p13 = p10 + m1 * s0, p11 + m1 * s1, p12 + m1 * s2, p13 + m1 * s3
        p20, p21, p22, p23 = p20 + m2 * s0, p21 + m2 * s1, p22 + m2 * s2, p23 + m2 * s3
        p30, p31, p32, p33 = p30 + m3 * s0, p31 + m3 * s1, p32 + m3 * s2, p33 + m3 * s3
        v, e = load_i8x32(yq, y0), at(yd, y0 >> 5)
        a00 = fma_i32x8_f32x8(a00, dot_u8s8(isa, z, w0, v), splat_f32x8(d0 * e))
        a10 = fma_i32x8_f32x8(a10, dot_u8s8(isa, z, w1, v), splat_f32x8(d1 * e))
        a20 = fma_i32x8_f32x8(a20, dot_u8s8(isa, z, w2, v), splat_f32x8(d2 * e))
        a30 = fma_i32x8_f32x8(a30, dot_u8s8(isa, z, w3, v), splat_f32x8(d3 * e))
        v, e = load_i8x32(yq, y1), at(yd, y1 >> 5)
        a01 = fma_i32x8_f32x8(a01, dot_u8s8(isa, z, w0, v), splat_f32x8(d0 * e))
        a11 = fma_i32x8_f32x8(a11, dot_u8s8(isa, z, w1, v), splat_f32x8(d1 * e))
        a21 = fma_i32x8_f32x8(a21, dot_u8s8(isa, z, w2, v), splat_f32x8(d2 * e))
        a31 = fma_i32x8_f32x8(a31, dot_u8s8(isa, z, w3, v), splat_f32x8(d3 * e))
        v, e = load_i8x32(yq, y2), at(yd, y2 >> 5)
        a02 = fma_i32x8_f32x8(a02, dot_u8s8(isa, z, w0, v), splat_f32x8(d0 * e))
        a12 = fma_i32x8_f32x8(a12, dot_u8s8(isa, z, w1, v), splat_f32x8(d1 * e))
        a22 = fma_i32x8_f32x8(a22, dot_u8s8(isa, z, w2, v), splat_f32x8(d2 * e))
        a32 = fma_i32x8_f32x8(a32, dot_u8s8(isa, z, w3, v), splat_f32x8(d3 * e))
        v, e = load_i8x32(yq, y3), at(yd, y3 >> 5)
        a03 = fma_i32x8_f32x8(a03, dot_u8s8(isa, z, w0, v), splat_f32x8(d0 * e))
        a13 = fma_i32x8_f32x8(a13, dot_u8s8(isa, z, w1, v), splat_f32x8(d1 * e))
        a23 = fma_i32x8_f32x8(a23, dot_u8s8(isa, z, w2, v), splat_f32x8(d2 * e))
        a33 = fma_i32x8_f32x8(a33, dot_u8s8(isa, z, w3, v), splat_f32x8(d3 * e))
    store_tile_4x4(out, oo0, oo1, oo2, oo3, a00, a01, a02, a03, a10, a11, a12, a13,
                   a20, a21, a22, a23, a30, a31, a32, a33)
    out[oo0 + 0] += p00
    out[oo1 + 0] += p01
    out[oo2 + 0] += p02
    out[oo3 + 0] += p03
    out[oo0 + 1] += p10
    out[oo1 + 1] += p11
    out[oo2 + 1] += p12
    out[oo3 + 1] += p13
    out[oo0 + 2] += p20
    out[oo1 + 2] += p21
    out[oo2 + 2] += p22
    out[oo3 + 2] += p23
    out[oo0 + 3] += p30
    out[oo1 + 3] += p31
    out[oo2 + 3] += p32
    out[oo3 + 3] += p33


@njit(cache=True)
def tile_q8_0(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    """4 rows x 4 columns of dot_q8_0."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = zero_f32x8()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = zero_f32x8()
    z = zero_i32x8()
    for b in range(nb):
        o0 = wo + b * 34
        o1 = o0 + wrs
        o2 = o1 + wrs
        o3 = o2 + wrs
        w0, w1, w2, w3 = load_i8x32(w, o0 + 2), load_i8x32(w, o1 + 2), load_i8x32(w, o2 + 2), load_i8x32(w, o3 + 2)
        d0, d1, d2, d3 = _f16(w, o0), _f16(w, o1), _f16(w, o2), _f16(w, o3)
        y0, y1, y2, y3 = yo0 + b * 32, yo1 + b * 32, yo2 + b * 32, yo3 + b * 32
        v, s, e = load_i8x32(yq, y0), load_i32x8(ys4, y0 >> 2), at(yd, y0 >> 5)
        a00 = fma_i32x8_f32x8(a00, dot_s8s8(isa, z, w0, v, s), splat_f32x8(d0 * e))
        a10 = fma_i32x8_f32x8(a10, dot_s8s8(isa, z, w1, v, s), splat_f32x8(d1 * e))
        a20 = fma_i32x8_f32x8(a20, dot_s8s8(isa, z, w2, v, s), splat_f32x8(d2 * e))
        a30 = fma_i32x8_f32x8(a30, dot_s8s8(isa, z, w3, v, s), splat_f32x8(d3 * e))
        v, s, e = load_i8x32(yq, y1), load_i32x8(ys4, y1 >> 2), at(yd, y1 >> 5)
        a01 = fma_i32x8_f32x8(a01, dot_s8s8(isa, z, w0, v, s), splat_f32x8(d0 * e))
        a11 = fma_i32x8_f32x8(a11, dot_s8s8(isa, z, w1, v, s), splat_f32x8(d1 * e))
        a21 = fma_i32x8_f32x8(a21, dot_s8s8(isa, z, w2, v, s), splat_f32x8(d2 * e))
        a31 = fma_i32x8_f32x8(a31, dot_s8s8(isa, z, w3, v, s), splat_f32x8(d3 * e))
        v, s, e = load_i8x32(yq, y2), load_i32x8(ys4, y2 >> 2), at(yd, y2 >> 5)
        a02 = fma_i32x8_f32x8(a02, dot_s8s8(isa, z, w0, v, s), splat_f32x8(d0 * e))
        a12 = fma_i32x8_f32x8(a12, dot_s8s8(isa, z, w1, v, s), splat_f32x8(d1 * e))
        a22 = fma_i32x8_f32x8(a22, dot_s8s8(isa, z, w2, v, s), splat_f32x8(d2 * e))
        a32 = fma_i32x8_f32x8(a32, dot_s8s8(isa, z, w3, v, s), splat_f32x8(d3 * e))
        v, s, e = load_i8x32(yq, y3), load_i32x8(ys4, y3 >> 2), at(yd, y3 >> 5)
        a03 = fma_i32x8_f32x8(a03, dot_s8s8(isa, z, w0, v, s), splat_f32x8(d0 * e))
        a13 = fma_i32x8_f32x8(a13, dot_s8s8(isa, z, w1, v, s), splat_f32x8(d1 * e))
        a23 = fma_i32x8_f32x8(a23, dot_s8s8(isa, z, w2, v, s), splat_f32x8(d2 * e))
        a33 = fma_i32x8_f32x8(a33, dot_s8s8(isa, z, w3, v, s), splat_f32x8(d3 * e))
    store_tile_4x4(out, oo0, oo1, oo2, oo3, a00, a01, a02, a03, a10, a11, a12, a13,
                   a20, a21, a22, a23, a30, a31, a32, a33)


@njit(cache=True, inline="always")
def store_tile_4x4(out, oo0, oo1, oo2, oo3, a00, a01, a02, a03, a10, a11, a12, a13,
                   a20, a21, a22, a23, a30, a31, a32, a33):
    """out[oo_c + r] = the lane sum of accumulator a_rc: a 4 rows x 4 columns tile's results."""
    out[oo0 + 0] = hsum_f32x8(a00)
    out[oo1 + 0] = hsum_f32x8(a01)
    out[oo2 + 0] = hsum_f32x8(a02)
    out[oo3 + 0] = hsum_f32x8(a03)
    out[oo0 + 1] = hsum_f32x8(a10)
    out[oo1 + 1] = hsum_f32x8(a11)
    out[oo2 + 1] = hsum_f32x8(a12)
    out[oo3 + 1] = hsum_f32x8(a13)
    out[oo0 + 2] = hsum_f32x8(a20)
    out[oo1 + 2] = hsum_f32x8(a21)
    out[oo2 + 2] = hsum_f32x8(a22)
    out[oo3 + 2] = hsum_f32x8(a23)
    out[oo0 + 3] = hsum_f32x8(a30)
    out[oo1 + 3] = hsum_f32x8(a31)
    out[oo2 + 3] = hsum_f32x8(a32)
    out[oo3 + 3] = hsum_f32x8(a33)
