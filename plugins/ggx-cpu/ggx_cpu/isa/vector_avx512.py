"""The Q4_0 / Q4_1 gemv row quads on 512-bit vectors: two consecutive blocks per row in one zmm
(AVX-512 VNNI only; `ggx_cpu.kernels.matmul` uses them instead of `ggx_cpu.isa.vector`'s for
that variant: same signatures and layouts, read that module's docstring).

A row quad (4 weight rows x 1 column) handles blocks b and b + 1 of each row at once: lanes
0..7 belong to block b, lanes 8..15 to block b + 1. Activation values, their 4-sums and scales
of two blocks are contiguous, so they load as one vector; each weight row needs two 16-byte
nibble loads and two f16 scale loads. Half the instructions of the 256-bit row quads.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from . import vector
from .avx512_vnni import I8x64, I32x16, vpdpbusd_512
from .codegen import I8, I32, declare, i32_vector, is_bytes_arg, load_vector
from .simd import Vec, llvm_type, prefetch_next_quad

F32x16 = Vec("f32", 16)


@intrinsic
def _nib2(typingctx, w, o, step):
    """The 16 nibble bytes at byte o and at o + step as [lo(o) | 16 * hi(o) | lo(o + step) |
    16 * hi(o + step)] (ggml's Q4 value order per block): a broadcast and one vpand with
    0x0F / 0xF0, no shift. The high-nibble lanes (4..7, 12..15 of the dot) come out 16x too
    large; `_hi16` scales them back exactly in the float scale."""
    if not (is_bytes_arg(w, o) and isinstance(step, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(I8, 16)
        a = load_vector(context, builder, sig.args[0], args[0], args[1], v16)
        o2 = builder.add(args[1], context.cast(builder, args[2], sig.args[2], types.intp))
        b = load_vector(context, builder, sig.args[0], args[0], o2, v16)
        ab = builder.shuffle_vector(a, b, i32_vector(list(range(16)) * 2 + list(range(16, 32)) * 2))
        mask = ([0x0F] * 16 + [0xF0] * 16) * 2
        return builder.and_(ab, ir.Constant(llvm_type(I8x64), [ir.Constant(I8, m) for m in mask]))

    return I8x64(w, types.intp, types.intp), codegen


@intrinsic
def _hi16(typingctx):
    """1 on the low-nibble lanes, 1/16 on the high-nibble lanes of a `_nib2` dot (exact)."""
    def codegen(context, builder, sig, args):
        return ir.Constant(llvm_type(F32x16), [ir.Constant(ir.FloatType(), f) for f in ([1.0] * 4 + [0.0625] * 4) * 2])

    return F32x16(), codegen


def _make_f16x2(first: int, second: int):
    """An intrinsic (w, o) -> float32 x 16: the f16 at byte o + 2 * first on lanes 0..7 and the
    one at o + 2 * second on lanes 8..15, from one 32-byte load and one vpermw (two scalar
    half loads cost four shuffles). The caller keeps o + 32 inside w."""
    @intrinsic
    def f16x2(typingctx, w, o):
        if not is_bytes_arg(w, o):
            return None

        def codegen(context, builder, sig, args):
            v = load_vector(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.HalfType(), 16))
            pair = builder.shuffle_vector(v, v, i32_vector([first] * 8 + [second] * 8))
            return builder.fpext(pair, llvm_type(F32x16))

        return F32x16(w, types.intp), codegen

    return f16x2


_q4_0_d2 = _make_f16x2(0, 9)  # Q4_0: d at bytes 0 and 18 of two blocks
_q4_1_d2 = _make_f16x2(0, 10)  # Q4_1: d at bytes 0 and 20
_q4_1_m2 = _make_f16x2(1, 11)  # Q4_1: m at bytes 2 and 22


@intrinsic
def _f32x2(typingctx, a, i, k):
    """a[i] * k on lanes 0..7 and a[i + 1] * k on lanes 8..15 (two block scales of a column)."""
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and isinstance(k, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        v2 = ir.VectorType(ir.FloatType(), 2)
        v = load_vector(context, builder, sig.args[0], args[0], args[1], v2)
        kv = context.cast(builder, args[2], sig.args[2], types.float32)
        v = builder.fmul(v, builder.insert_element(builder.insert_element(
            ir.Constant(v2, ir.Undefined), kv, I32(0)), kv, I32(1)))
        return builder.shuffle_vector(v, v, i32_vector([0] * 8 + [1] * 8))

    return F32x16(a, types.intp, types.float32), codegen


def _make_load64(vec, dtypes):
    @intrinsic
    def load(typingctx, arr, off):
        if not (isinstance(arr, types.Array) and arr.dtype in dtypes and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            return load_vector(context, builder, sig.args[0], args[0], args[1], llvm_type(vec))

        return vec(arr, types.intp), codegen

    return load


_load_i8x64 = _make_load64(I8x64, (types.int8, types.uint8))
_load_i32x16 = _make_load64(I32x16, (types.int32,))


@intrinsic
def _neg8(typingctx, v):
    """-8 * v on low-nibble lanes, -8 * 16 * v on high-nibble ones (see `_nib2`): the Q4_0
    offset applied to the activations' 4-sums."""
    if v != I32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.mul(args[0], i32_vector(([-8] * 4 + [-128] * 4) * 2))

    return I32x16(I32x16), codegen


@intrinsic
def _zero16(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(llvm_type(F32x16), None)

    return F32x16(), codegen


@intrinsic
def _zero_i16(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(llvm_type(I32x16), None)

    return I32x16(), codegen


@intrinsic
def _fma16(typingctx, acc, v, scale):
    """acc + v * scale; v int32 lanes (converted) or float32 lanes."""
    if acc != F32x16 or v not in (I32x16, F32x16) or scale != F32x16:
        return None

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[1], llvm_type(F32x16)) if sig.args[1] == I32x16 else args[1]
        fma = declare(builder, "llvm.fma.v16f32", llvm_type(F32x16), [llvm_type(F32x16)] * 3)
        return builder.call(fma, [f, args[2], args[0]])

    return F32x16(F32x16, v, F32x16), codegen


@intrinsic
def _mul16(typingctx, a, b):
    if a != F32x16 or b != F32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])

    return F32x16(F32x16, F32x16), codegen


@intrinsic
def _hsum16(typingctx, v):
    """The sum of the 16 lanes (pairwise halving, once per output)."""
    if v != F32x16:
        return None

    def codegen(context, builder, sig, args):
        x = args[0]
        for half in (8, 4, 2, 1):
            x = builder.fadd(builder.shuffle_vector(x, x, i32_vector(range(half))),
                             builder.shuffle_vector(x, x, i32_vector(range(half, 2 * half))))
        return builder.extract_element(x, I32(0))

    return types.float32(F32x16), codegen


@njit(cache=True)
def rows4_q4_0(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
    """out[oo + r] = dot_q4_0 of rows wo + r * wrs (r < 4) with the column at yo (nb even, or
    the odd last block added by `ggx_cpu.isa.vector.dot_q4_0`)."""
    a0 = a1 = a2 = a3 = _zero16()
    hi = _hi16()
    for b in range(0, nb - 1, 2):
        o0 = wo + b * 18
        o1 = o0 + wrs
        o2 = o1 + wrs
        o3 = o2 + wrs
        prefetch_next_quad(w, wo, wrs, 144, b >> 1)
        y = yo + b * 32
        # shared by the 4 rows: 2 activation blocks, their -8 * 4-sums (lane start), scales
        v, i, e = _load_i8x64(yq, y), _neg8(_load_i32x16(ys4, y >> 2)), _mul16(_f32x2(yd, y >> 5, np.float32(1.0)), hi)
        a0 = _fma16(a0, vpdpbusd_512(i, _nib2(w, o0 + 2, 18), v), _mul16(_q4_0_d2(w, o0), e))
        a1 = _fma16(a1, vpdpbusd_512(i, _nib2(w, o1 + 2, 18), v), _mul16(_q4_0_d2(w, o1), e))
        a2 = _fma16(a2, vpdpbusd_512(i, _nib2(w, o2 + 2, 18), v), _mul16(_q4_0_d2(w, o2), e))
        a3 = _fma16(a3, vpdpbusd_512(i, _nib2(w, o3 + 2, 18), v), _mul16(_q4_0_d2(w, o3), e))
    t0 = t1 = t2 = t3 = np.float32(0.0)
    if nb % 2:
        o = wo + (nb - 1) * 18
        y = yo + (nb - 1) * 32
        t0 = vector.dot_q4_0(isa, w, o, 1, yq, yd, ys, ys4, y)
        t1 = vector.dot_q4_0(isa, w, o + wrs, 1, yq, yd, ys, ys4, y)
        t2 = vector.dot_q4_0(isa, w, o + 2 * wrs, 1, yq, yd, ys, ys4, y)
        t3 = vector.dot_q4_0(isa, w, o + 3 * wrs, 1, yq, yd, ys, ys4, y)
    out[oo] = _hsum16(a0) + t0
    out[oo + 1] = _hsum16(a1) + t1
    out[oo + 2] = _hsum16(a2) + t2
    out[oo + 3] = _hsum16(a3) + t3


@njit(cache=True)
def rows4_q4_1(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
    """out[oo + r] = dot_q4_1 of rows wo + r * wrs (r < 4) with the column at yo; the m * s terms
    in their own accumulators (each of a block's 8 lanes adds m * s / 8: exact power-of-2 scale)."""
    a0 = a1 = a2 = a3 = _zero16()
    p0 = p1 = p2 = p3 = _zero16()
    z = _zero_i16()
    hi = _hi16()
    for b in range(0, nb - 1, 2):
        o0 = wo + b * 20
        o1 = o0 + wrs
        o2 = o1 + wrs
        o3 = o2 + wrs
        prefetch_next_quad(w, wo, wrs, 160, b >> 1)
        y = yo + b * 32
        v, e = _load_i8x64(yq, y), _mul16(_f32x2(yd, y >> 5, np.float32(1.0)), hi)
        s = _f32x2(ys, y >> 5, np.float32(0.125))
        a0 = _fma16(a0, vpdpbusd_512(z, _nib2(w, o0 + 4, 20), v), _mul16(_q4_1_d2(w, o0), e))
        a1 = _fma16(a1, vpdpbusd_512(z, _nib2(w, o1 + 4, 20), v), _mul16(_q4_1_d2(w, o1), e))
        a2 = _fma16(a2, vpdpbusd_512(z, _nib2(w, o2 + 4, 20), v), _mul16(_q4_1_d2(w, o2), e))
        a3 = _fma16(a3, vpdpbusd_512(z, _nib2(w, o3 + 4, 20), v), _mul16(_q4_1_d2(w, o3), e))
        p0 = _fma16(p0, _q4_1_m2(w, o0), s)
        p1 = _fma16(p1, _q4_1_m2(w, o1), s)
        p2 = _fma16(p2, _q4_1_m2(w, o2), s)
        p3 = _fma16(p3, _q4_1_m2(w, o3), s)
    t0 = t1 = t2 = t3 = np.float32(0.0)
    if nb % 2:
        o = wo + (nb - 1) * 20
        y = yo + (nb - 1) * 32
        t0 = vector.dot_q4_1(isa, w, o, 1, yq, yd, ys, ys4, y)
        t1 = vector.dot_q4_1(isa, w, o + wrs, 1, yq, yd, ys, ys4, y)
        t2 = vector.dot_q4_1(isa, w, o + 2 * wrs, 1, yq, yd, ys, ys4, y)
        t3 = vector.dot_q4_1(isa, w, o + 3 * wrs, 1, yq, yd, ys, ys4, y)
    out[oo] = _hsum16(a0) + _hsum16(p0) + t0
    out[oo + 1] = _hsum16(a1) + _hsum16(p1) + t1
    out[oo + 2] = _hsum16(a2) + _hsum16(p2) + t2
    out[oo + 3] = _hsum16(a3) + _hsum16(p3) + t3
