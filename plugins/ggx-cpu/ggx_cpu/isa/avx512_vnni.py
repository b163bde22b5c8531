"""AVX-512 VNNI: the u8 x s8 dot product `vpdpbusd` (ggml's AVX512VNNI path).

numba never emits `vpdpbusd` from a loop, so it is declared here by its full LLVM name
(`llvm.x86.avx512.vpdpbusd.256`, 256-bit form, needs AVX512VL). Only import-safe on any host:
code is generated when a kernel is compiled for this ISA, which `ggx_cpu.isa` allows only on
a CPU that has the features in `REQUIRES`.

Also the gemv row quads `rows4_q4_0` / `rows4_q4_1` on 512-bit vectors (see the section below).

Layout (see `ggx_cpu.isa.simd`): `u` and `s` hold 32 bytes; lane i of the result adds
u[4i..4i+3] . s[4i..4i+3] (u unsigned, s signed) to acc lane i.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import vector
from .simd import (  # noqa: F401
    I8x32,
    I32x8,
    Vec,
    _elem_ptr,
    _llty,
    add_i32x8,
    load_i32x8,
    mul_i32x8,
    prefetch_next_quad,
    xor80_i8x32,
)

NAME = "avx512_vnni"
REQUIRES = ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "f16c")


@intrinsic
def vpdpbusd(typingctx, acc, u, s):
    """acc + the 4-byte u8 x s8 dot products of u and s, lane by lane (one instruction)."""
    if acc != I32x8 or u != I8x32 or s != I8x32:
        return None

    def codegen(context, builder, sig, args):
        v8 = _llty(I32x8)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]),
                                            "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(fn, [args[0], builder.bitcast(args[1], v8), builder.bitcast(args[2], v8)])

    return I32x8(I32x8, I8x32, I8x32), codegen


@njit(cache=True, inline="always")
def dot_u8s8(acc, u, s):
    """Lane-wise acc + u . s for unsigned u (e.g. 4-bit weights 0..15) and signed s."""
    return vpdpbusd(acc, u, s)


@njit(cache=True, inline="always")
def dot_s8s8(acc, w, y, ysum4):
    """Lane-wise acc + w . y for signed w and y; ysum4 holds the lanes' sums of y.

    vpdpbusd needs one unsigned operand: w + 128 = w ^ 0x80 is, and the extra 128 * sum(y)
    is taken off exactly by starting the lanes at -128 * ysum4.
    """
    return vpdpbusd(add_i32x8(acc, mul_i32x8(ysum4, -128)), xor80_i8x32(w), y)


# --- the gemv on 512-bit vectors: two consecutive blocks per row in one zmm ----------------------
# A row quad (4 weight rows x 1 column) handles blocks b and b + 1 of each row at once: lanes
# 0..7 belong to block b, lanes 8..15 to block b + 1. Activation values, their 4-sums and scales
# of two blocks are contiguous, so they load as one vector; each weight row needs two 16-byte
# nibble loads and two f16 scale loads. Half the instructions of the 256-bit row quads in
# `ggx_cpu.isa.vector`, whose functions these replace for this ISA (same signatures, layouts).
I8x64 = Vec("i8", 64)
I32x16 = Vec("i32", 16)
F32x16 = Vec("f32", 16)
_I8, _I32 = ir.IntType(8), ir.IntType(32)


def _ic(values):
    return ir.Constant(ir.VectorType(_I32, len(values)), [ir.Constant(_I32, v) for v in values])


def _bytes_arg(arr, off):
    return isinstance(arr, types.Array) and arr.dtype in (types.int8, types.uint8) and isinstance(off, types.Integer)


def _load(context, builder, arrty, arr, off, llty):
    ptr = _elem_ptr(context, builder, arrty, arr, off)
    return builder.load(builder.bitcast(ptr, llty.as_pointer()), align=1)


@intrinsic
def _nib2(typingctx, w, o, step):
    """The 16 nibble bytes at byte o and at o + step as [lo(o) | 16 * hi(o) | lo(o + step) |
    16 * hi(o + step)] (ggml's Q4 value order per block): a broadcast and one vpand with
    0x0F / 0xF0, no shift. The high-nibble lanes (4..7, 12..15 of the dot) come out 16x too
    large; `_HI16` scales them back exactly in the float scale."""
    if not (_bytes_arg(w, o) and isinstance(step, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I8, 16)
        a = _load(context, builder, sig.args[0], args[0], args[1], v16)
        o2 = builder.add(args[1], context.cast(builder, args[2], sig.args[2], types.intp))
        b = _load(context, builder, sig.args[0], args[0], o2, v16)
        ab = builder.shuffle_vector(a, b, _ic(list(range(16)) * 2 + list(range(16, 32)) * 2))
        mask = ([0x0F] * 16 + [0xF0] * 16) * 2
        return builder.and_(ab, ir.Constant(_llty(I8x64), [ir.Constant(_I8, m) for m in mask]))

    return I8x64(w, types.intp, types.intp), codegen


@intrinsic
def _hi16(typingctx):
    """1 on the low-nibble lanes, 1/16 on the high-nibble lanes of a `_nib2` dot (exact)."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_llty(F32x16), [ir.Constant(ir.FloatType(), f) for f in ([1.0] * 4 + [0.0625] * 4) * 2])

    return F32x16(), codegen


def _make_f16x2(first: int, second: int):
    """An intrinsic (w, o) -> float32 x 16: the f16 at byte o + 2 * first on lanes 0..7 and the
    one at o + 2 * second on lanes 8..15, from one 32-byte load and one vpermw (two scalar
    half loads cost four shuffles). The caller keeps o + 32 inside w."""
    @intrinsic
    def f16x2(typingctx, w, o):
        if not _bytes_arg(w, o):
            return None

        def codegen(context, builder, sig, args):
            v = _load(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.HalfType(), 16))
            return builder.fpext(builder.shuffle_vector(v, v, _ic([first] * 8 + [second] * 8)), _llty(F32x16))

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
        v = _load(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.FloatType(), 2))
        kv = context.cast(builder, args[2], sig.args[2], types.float32)
        v = builder.fmul(v, builder.insert_element(builder.insert_element(
            ir.Constant(ir.VectorType(ir.FloatType(), 2), ir.Undefined), kv, _I32(0)), kv, _I32(1)))
        return builder.shuffle_vector(v, v, _ic([0] * 8 + [1] * 8))

    return F32x16(a, types.intp, types.float32), codegen


def _make_load64(vec, dtypes):
    @intrinsic
    def load(typingctx, arr, off):
        if not (isinstance(arr, types.Array) and arr.dtype in dtypes and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            return _load(context, builder, sig.args[0], args[0], args[1], _llty(vec))

        return vec(arr, types.intp), codegen

    return load


_load_i8x64 = _make_load64(I8x64, (types.int8, types.uint8))
_load_i32x16 = _make_load64(I32x16, (types.int32,))


@intrinsic
def _vpdpbusd512(typingctx, acc, u, s):
    """vpdpbusd on zmm: acc + the 4-byte u8 x s8 dot products, 16 lanes."""
    if acc != I32x16 or u != I8x64 or s != I8x64:
        return None

    def codegen(context, builder, sig, args):
        v16 = _llty(I32x16)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16, v16]),
                                            "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, [args[0], builder.bitcast(args[1], v16), builder.bitcast(args[2], v16)])

    return I32x16(I32x16, I8x64, I8x64), codegen


@intrinsic
def _neg8(typingctx, v):
    """-8 * v on low-nibble lanes, -8 * 16 * v on high-nibble ones (see `_nib2`): the Q4_0
    offset applied to the activations' 4-sums."""
    if v != I32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.mul(args[0], _ic(([-8] * 4 + [-128] * 4) * 2))

    return I32x16(I32x16), codegen


@intrinsic
def _zero16(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_llty(F32x16), None)

    return F32x16(), codegen


@intrinsic
def _zero_i16(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_llty(I32x16), None)

    return I32x16(), codegen


@intrinsic
def _fma16(typingctx, acc, v, scale):
    """acc + v * scale; v int32 lanes (converted) or float32 lanes."""
    if acc != F32x16 or v not in (I32x16, F32x16) or scale != F32x16:
        return None

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[1], _llty(F32x16)) if sig.args[1] == I32x16 else args[1]
        fnty = ir.FunctionType(_llty(F32x16), [_llty(F32x16)] * 3)
        fma = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v16f32")
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
            x = builder.fadd(builder.shuffle_vector(x, x, _ic(list(range(half)))),
                             builder.shuffle_vector(x, x, _ic(list(range(half, 2 * half)))))
        return builder.extract_element(x, _I32(0))

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
        a0 = _fma16(a0, _vpdpbusd512(i, _nib2(w, o0 + 2, 18), v), _mul16(_q4_0_d2(w, o0), e))
        a1 = _fma16(a1, _vpdpbusd512(i, _nib2(w, o1 + 2, 18), v), _mul16(_q4_0_d2(w, o1), e))
        a2 = _fma16(a2, _vpdpbusd512(i, _nib2(w, o2 + 2, 18), v), _mul16(_q4_0_d2(w, o2), e))
        a3 = _fma16(a3, _vpdpbusd512(i, _nib2(w, o3 + 2, 18), v), _mul16(_q4_0_d2(w, o3), e))
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
        a0 = _fma16(a0, _vpdpbusd512(z, _nib2(w, o0 + 4, 20), v), _mul16(_q4_1_d2(w, o0), e))
        a1 = _fma16(a1, _vpdpbusd512(z, _nib2(w, o1 + 4, 20), v), _mul16(_q4_1_d2(w, o1), e))
        a2 = _fma16(a2, _vpdpbusd512(z, _nib2(w, o2 + 4, 20), v), _mul16(_q4_1_d2(w, o2), e))
        a3 = _fma16(a3, _vpdpbusd512(z, _nib2(w, o3 + 4, 20), v), _mul16(_q4_1_d2(w, o3), e))
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
