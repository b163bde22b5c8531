"""Q4_K and Q6_K dot products on SIMD vectors (ggml's vec_dot_q4_K_q8_K / vec_dot_q6_K_q8_K),
one source for every vector ISA, as `ggx_cpu.isa.vector` is for Q4_0/Q4_1/Q8_0.

Functions here replace `ggx_cpu.isa.portable`'s of the same name under a vector ISA (see
`ggx_cpu.kernels.matmul._vector_impl`); same signatures and layouts as there:

- weights `w`: uint8 ggml block bytes, a row at byte `wo`, `nb` super-blocks of 256 values.
  Q4_K block (144 B): f16 d @0, f16 dmin @2, 12 B packed 6-bit scales/mins @4, 128 B nibbles
  @16 (bytes 32j..32j+31: low nibbles = values 64j.., high nibbles = values 64j+32..).
  Q6_K block (210 B): 128 B low nibbles @0, 64 B high 2-bit pairs @128, 16 x i8 scales @192,
  f16 d @208 (value order: see `_q6_quants_at`).
- activations Q8_K (`ggx_cpu.kernels.quantize_act`, structure of arrays): `yq` int8 values
  from `yo`, `yd` f32 scale per 256 values at `(yo >> 8) + b`, `ys4` the bsums (int32 sum of
  16 values) at `(yo >> 4) + g`; `ys` unused.

The integer core is ggml's AVX2 one: `vpmaddubsw` multiplies the unsigned weight values
(Q4_K 0..15, Q6_K 0..63) with the signed activations into int16 pair sums (at most
2 * 63 * 127, no saturation), and one more instruction multiplies those by the sub-block
scale broadcast as int16 and adds pairs into int32 lanes: `vpmaddwd` (AVX2) or `vpdpwssd`
(AVX-512 VNNI, which also accumulates). That is `dot_u8s8_scaled`, dispatched on the `isa`
token like `vector.dot_u8s8`; it folds the per-sub-block scale into the pair sum, where
`vector.dot_u8s8` followed by an int32 multiply would cost one more instruction per 32 values.
Q4_K's mins and Q6_K's -32 offset are taken from the bsums per block (ggml does the same):
Q4_K subtracts dmin * sum_j m_j (bsum_2j + bsum_2j+1), Q6_K uses unsigned q = value + 32 and
subtracts 32 * sum_k s_k bsum_k. Integer parts are exact; each block adds its int32 lanes to
per-lane float accumulators (one fma with d, Q4_K one more with dmin); one horizontal sum per
row at the end.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from .simd import (
    I8x32,
    I16x16,
    I32x8,
    IsaType,
    _elem_ptr,
    _llty,
    add_i32x8,
    at,
    f16_at,
    fma_i32x8_f32x8,
    hsum_f32x8,
    load_i8x32,
    splat_f32x8,
    zero_f32x8,
    zero_i32x8,
)

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)


def _ic(values) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(values)), [ir.Constant(_I32, v) for v in values])


def _splat(ty: ir.IntType, n: int, v: int) -> ir.Constant:
    return ir.Constant(ir.VectorType(ty, n), [ir.Constant(ty, v)] * n)


def _bytes_arg(arr, off) -> bool:
    return isinstance(arr, types.Array) and arr.dtype in (types.int8, types.uint8) and isinstance(off, types.Integer)


def _load(context, builder, arrty, arr, off, llty):
    ptr = _elem_ptr(context, builder, arrty, arr, off)
    return builder.load(builder.bitcast(ptr, llty.as_pointer()), align=1)


def _declare(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


# --- the ISA-specific scaled product ------------------------------------------------------------
@intrinsic
def _pmaddubsw(typingctx, u, s):
    """int16 lane i = u[2i] s[2i] + u[2i+1] s[2i+1] (u unsigned, s signed; saturating, which the
    callers' value ranges never reach). An AVX2 instruction: every host of both vector ISAs has it."""
    if u != I8x32 or s != I8x32:
        return None

    def codegen(context, builder, sig, args):
        fn = _declare(builder, "llvm.x86.avx2.pmadd.ub.sw", _llty(I16x16), [_llty(I8x32)] * 2)
        return builder.call(fn, args)

    return I16x16(I8x32, I8x32), codegen


@intrinsic
def _pmaddwd_add(typingctx, acc, p, sc):
    """acc + (int32 lane i = p[2i] sc[2i] + p[2i+1] sc[2i+1]): vpmaddwd + vpaddd (AVX2)."""
    if acc != I32x8 or p != I16x16 or sc != I16x16:
        return None

    def codegen(context, builder, sig, args):
        fn = _declare(builder, "llvm.x86.avx2.pmadd.wd", _llty(I32x8), [_llty(I16x16)] * 2)
        return builder.add(args[0], builder.call(fn, [args[1], args[2]]))

    return I32x8(I32x8, I16x16, I16x16), codegen


@intrinsic
def _vpdpwssd(typingctx, acc, p, sc):
    """The same as `_pmaddwd_add` in one instruction (AVX-512 VNNI, 256-bit form)."""
    if acc != I32x8 or p != I16x16 or sc != I16x16:
        return None

    def codegen(context, builder, sig, args):
        v8 = _llty(I32x8)
        fn = _declare(builder, "llvm.x86.avx512.vpdpwssd.256", v8, [v8, v8, v8])
        return builder.call(fn, [args[0], builder.bitcast(args[1], v8), builder.bitcast(args[2], v8)])

    return I32x8(I32x8, I16x16, I16x16), codegen


@njit(cache=True, inline="always")
def _scaled_avx2(acc, u, s, sc):
    return _pmaddwd_add(acc, _pmaddubsw(u, s), sc)


@njit(cache=True, inline="always")
def _scaled_vnni(acc, u, s, sc):
    return _vpdpwssd(acc, _pmaddubsw(u, s), sc)


def dot_u8s8_scaled(isa, acc, u, s, sc):
    """Lane-wise acc + sum over the lane's 4 bytes of u * s * sc (u unsigned, s signed bytes;
    sc int16 per byte pair: lane i's pairs 2i, 2i+1 take sc[2i], sc[2i+1])."""


@overload(dot_u8s8_scaled, inline="always")
def _ol_dot_u8s8_scaled(isa, acc, u, s, sc):
    if not isinstance(isa, IsaType):
        return None
    if isa.isa_name == "avx512_vnni":
        return lambda isa, acc, u, s, sc: _scaled_vnni(acc, u, s, sc)
    if isa.isa_name == "avx2":
        return lambda isa, acc, u, s, sc: _scaled_avx2(acc, u, s, sc)
    return None


# --- loads and unpacking -------------------------------------------------------------------------
@intrinsic
def _q4_nibbles(typingctx, w, o):
    """The 32 bytes at o as (low nibbles, high nibbles), each 32 values 0..15 in byte order."""
    if not _bytes_arg(w, o):
        return None

    def codegen(context, builder, sig, args):
        v = _load(context, builder, sig.args[0], args[0], args[1], _llty(I8x32))
        m = _splat(_I8, 32, 15)
        lo = builder.and_(v, m)
        hi = builder.lshr(builder.bitcast(v, _llty(I32x8)), _splat(_I32, 8, 4))
        hi = builder.and_(builder.bitcast(hi, _llty(I8x32)), m)
        return context.make_tuple(builder, sig.return_type, [lo, hi])

    return types.UniTuple(I8x32, 2)(w, types.intp), codegen


@intrinsic
def _q4_K_scales(typingctx, w, o):
    """The 6-bit scales and mins of the Q4_K block at byte o: (8 int16 vectors, sub-block j's
    scale in all 16 lanes; int32 x 8 mins). Unpacked on 3 little-endian words as ggml's
    utmp / kmask code does: scales 0..3 = q[0..3] & 63, mins 0..3 = q[4..7] & 63, scale 4+i =
    (q[8+i] & 15) | (q[i] >> 6) << 4, min 4+i = (q[8+i] >> 4) | (q[4+i] >> 6) << 4."""
    if not _bytes_arg(w, o):
        return None

    def codegen(context, builder, sig, args):
        def word(k):
            off = builder.add(context.cast(builder, args[1], sig.args[1], types.intp),
                              ir.Constant(ir.IntType(64), 4 + 4 * k))
            return _load(context, builder, sig.args[0], args[0], off, _I32)

        def c(v):
            return ir.Constant(_I32, v)

        u0, u1, u2 = word(0), word(1), word(2)
        sc_lo = builder.and_(u0, c(0x3F3F3F3F))
        mn_lo = builder.and_(u1, c(0x3F3F3F3F))
        sc_hi = builder.or_(builder.and_(u2, c(0x0F0F0F0F)),
                            builder.shl(builder.and_(builder.lshr(u0, c(6)), c(0x03030303)), c(4)))
        mn_hi = builder.or_(builder.and_(builder.lshr(u2, c(4)), c(0x0F0F0F0F)),
                            builder.shl(builder.and_(builder.lshr(u1, c(6)), c(0x03030303)), c(4)))
        v4 = ir.VectorType(_I32, 4)
        vec = ir.Constant(v4, ir.Undefined)
        for i, x in enumerate((sc_lo, sc_hi, mn_lo, mn_hi)):
            vec = builder.insert_element(vec, x, c(i))
        b16 = builder.bitcast(vec, ir.VectorType(_I8, 16))  # scales 0..7, mins 0..7
        s16 = builder.zext(builder.shuffle_vector(b16, b16, _ic(range(8))), ir.VectorType(_I16, 8))
        splats = [builder.shuffle_vector(s16, s16, _ic([j] * 16)) for j in range(8)]
        mins = builder.zext(builder.shuffle_vector(b16, b16, _ic(range(8, 16))), _llty(I32x8))
        return context.make_tuple(builder, sig.return_type, splats + [mins])

    return types.Tuple([I16x16] * 8 + [I32x8])(w, types.intp), codegen


@intrinsic
def _bsum_pairs(typingctx, ys4, g):
    """int32 lane j = bsum[g + 2j] + bsum[g + 2j + 1]: the sums of the 8 runs of 32 values."""
    if not (isinstance(ys4, types.Array) and ys4.dtype == types.int32 and isinstance(g, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = _load(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I32, 16))
        return builder.add(builder.shuffle_vector(v, v, _ic(range(0, 16, 2))),
                           builder.shuffle_vector(v, v, _ic(range(1, 16, 2))))

    return I32x8(ys4, types.intp), codegen


@intrinsic
def _mul_vv(typingctx, a, b):
    """Lane-wise int32 product."""
    if a != I32x8 or b != I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.mul(args[0], args[1])

    return I32x8(I32x8, I32x8), codegen


@intrinsic
def _sub_vv(typingctx, a, b):
    if a != I32x8 or b != I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sub(args[0], args[1])

    return I32x8(I32x8, I32x8), codegen


@intrinsic
def _q6_quants_at(typingctx, w, ql, qh):
    """Four 32-value runs of a Q6_K block half as unsigned values 0..63 (value + 32): with 32
    bytes l0 at ql, l1 at ql + 32 and h at qh (ggml's dequantize_row_q6_K order):
    run 0 = (l0 & 15) | (h & 3) << 4,       run 1 = (l1 & 15) | (h >> 2 & 3) << 4,
    run 2 = (l0 >> 4) | (h >> 4 & 3) << 4,  run 3 = (l1 >> 4) | (h >> 6) << 4."""
    if not (_bytes_arg(w, ql) and isinstance(qh, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v8 = _llty(I8x32)
        v32 = _llty(I32x8)
        q = context.cast(builder, args[1], sig.args[1], types.intp)
        l0 = _load(context, builder, sig.args[0], args[0], q, v8)
        l1 = _load(context, builder, sig.args[0], args[0], builder.add(q, ir.Constant(ir.IntType(64), 32)), v8)
        h = _load(context, builder, sig.args[0], args[0], context.cast(builder, args[2], sig.args[2], types.intp), v8)
        m4, m30 = _splat(_I8, 32, 15), _splat(_I8, 32, 0x30)

        def shifted(v, n):
            # byte shifts as int32 lanes + a mask (x86 has no byte shifts); the mask drops the
            # bits that crossed from the neighbouring byte
            vi = builder.bitcast(v, v32)
            if n > 0:
                vi = builder.shl(vi, _splat(_I32, 8, n))
            elif n < 0:
                vi = builder.lshr(vi, _splat(_I32, 8, -n))
            return builder.bitcast(vi, v8)

        runs = [
            builder.or_(builder.and_(l0, m4), builder.and_(shifted(h, 4), m30)),
            builder.or_(builder.and_(l1, m4), builder.and_(shifted(h, 2), m30)),
            builder.or_(builder.and_(shifted(l0, -4), m4), builder.and_(h, m30)),
            builder.or_(builder.and_(shifted(l1, -4), m4), builder.and_(shifted(h, -2), m30)),
        ]
        return context.make_tuple(builder, sig.return_type, runs)

    return types.UniTuple(I8x32, 4)(w, types.intp, types.intp), codegen


@intrinsic
def _q6_K_scales(typingctx, w, o, ys4, g):
    """The 16 int8 scales at byte o (a Q6_K block + 192) as 8 int16 vectors (run c: scale 2c
    on lanes 0..7, 2c + 1 on lanes 8..15, matching the 16-value halves of a 32-value run),
    and the int32 x 8 offset correction 32 * (lane i: s_i bsum_i + s_{i+8} bsum_{i+8}) with
    the bsums from ys4[g..g+15]."""
    if not (_bytes_arg(w, o) and isinstance(ys4, types.Array) and ys4.dtype == types.int32
            and isinstance(g, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        b = _load(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I8, 16))
        s16 = builder.sext(b, ir.VectorType(_I16, 16))
        splats = [builder.shuffle_vector(s16, s16, _ic([2 * c] * 8 + [2 * c + 1] * 8)) for c in range(8)]
        bs = _load(context, builder, sig.args[2], args[2], args[3], ir.VectorType(_I32, 16))
        prod = builder.mul(builder.sext(b, ir.VectorType(_I32, 16)), bs)
        half = builder.add(builder.shuffle_vector(prod, prod, _ic(range(8))),
                           builder.shuffle_vector(prod, prod, _ic(range(8, 16))))
        corr = builder.shl(half, _splat(_I32, 8, 5))
        return context.make_tuple(builder, sig.return_type, splats + [corr])

    return types.Tuple([I16x16] * 8 + [I32x8])(w, types.intp, ys4, types.intp), codegen


# --- one super-block: int32 lanes -----------------------------------------------------------------
@njit(cache=True, inline="always")
def _q4_K_lanes(isa, w, o, yq, y, s0, s1, s2, s3, s4, s5, s6, s7):
    """sum_j s_j (q . y)_j of the Q4_K block at o, lane-wise (mins not included); four short
    accumulation chains so consecutive products do not wait on each other."""
    z = zero_i32x8()
    lo, hi = _q4_nibbles(w, o + 16)
    a = dot_u8s8_scaled(isa, dot_u8s8_scaled(isa, z, lo, load_i8x32(yq, y), s0), hi, load_i8x32(yq, y + 32), s1)
    lo, hi = _q4_nibbles(w, o + 48)
    b = dot_u8s8_scaled(isa, dot_u8s8_scaled(isa, z, lo, load_i8x32(yq, y + 64), s2), hi, load_i8x32(yq, y + 96), s3)
    lo, hi = _q4_nibbles(w, o + 80)
    c = dot_u8s8_scaled(isa, dot_u8s8_scaled(isa, z, lo, load_i8x32(yq, y + 128), s4), hi, load_i8x32(yq, y + 160), s5)
    lo, hi = _q4_nibbles(w, o + 112)
    e = dot_u8s8_scaled(isa, dot_u8s8_scaled(isa, z, lo, load_i8x32(yq, y + 192), s6), hi, load_i8x32(yq, y + 224), s7)
    return add_i32x8(add_i32x8(a, b), add_i32x8(c, e))


@njit(cache=True, inline="always")
def _q4_K_block(isa, acc, w, o, yq, yd, ys4, y):
    """acc + the lanes of one Q4_K x Q8_K super-block: d (sum_j s_j q.y) - dmin (sum_j m_j bsum_j)."""
    s0, s1, s2, s3, s4, s5, s6, s7, mins = _q4_K_scales(w, o)
    dy = at(yd, y >> 8)
    lanes = _q4_K_lanes(isa, w, o, yq, y, s0, s1, s2, s3, s4, s5, s6, s7)
    acc = fma_i32x8_f32x8(acc, lanes, splat_f32x8(f16_at(w, o) * dy))
    return fma_i32x8_f32x8(acc, _mul_vv(mins, _bsum_pairs(ys4, y >> 4)), splat_f32x8(-(f16_at(w, o + 2) * dy)))


@njit(cache=True, inline="always")
def _q6_K_lanes(isa, w, o, yq, y, s0, s1, s2, s3, s4, s5, s6, s7, corr):
    """sum_k s_k (q - 32) . y over the Q6_K block at o, lane-wise, exact."""
    z = zero_i32x8()
    r0, r1, r2, r3 = _q6_quants_at(w, o, o + 128)
    a = dot_u8s8_scaled(isa, dot_u8s8_scaled(isa, z, r0, load_i8x32(yq, y), s0), r1, load_i8x32(yq, y + 32), s1)
    b = dot_u8s8_scaled(isa, dot_u8s8_scaled(isa, z, r2, load_i8x32(yq, y + 64), s2), r3, load_i8x32(yq, y + 96), s3)
    r0, r1, r2, r3 = _q6_quants_at(w, o + 64, o + 160)
    c = dot_u8s8_scaled(isa, dot_u8s8_scaled(isa, z, r0, load_i8x32(yq, y + 128), s4), r1, load_i8x32(yq, y + 160), s5)
    e = dot_u8s8_scaled(isa, dot_u8s8_scaled(isa, z, r2, load_i8x32(yq, y + 192), s6), r3, load_i8x32(yq, y + 224), s7)
    return _sub_vv(add_i32x8(add_i32x8(a, b), add_i32x8(c, e)), corr)


@njit(cache=True, inline="always")
def _q6_K_block(isa, acc, w, o, yq, yd, ys4, y):
    """acc + the lanes of one Q6_K x Q8_K super-block: d sum_k s_k (q - 32) . y."""
    s0, s1, s2, s3, s4, s5, s6, s7, corr = _q6_K_scales(w, o + 192, ys4, y >> 4)
    lanes = _q6_K_lanes(isa, w, o, yq, y, s0, s1, s2, s3, s4, s5, s6, s7, corr)
    return fma_i32x8_f32x8(acc, lanes, splat_f32x8(f16_at(w, o + 208) * at(yd, y >> 8)))


# --- row dots ---------------------------------------------------------------------------------------
@njit(cache=True)
def dot_q4_K(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    """ggml's vec_dot_q4_K_q8_K: sum_b d (sum_j s_j q.y) - dmin (sum_j m_j bsum_j)."""
    acc = zero_f32x8()
    for b in range(nb):
        acc = _q4_K_block(isa, acc, w, wo + b * 144, yq, yd, ys4, yo + b * 256)
    return hsum_f32x8(acc)


@njit(cache=True)
def dot_q6_K(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    """ggml's vec_dot_q6_K_q8_K: sum_b d sum_k s_k (q - 32) . y."""
    acc = zero_f32x8()
    for b in range(nb):
        acc = _q6_K_block(isa, acc, w, wo + b * 210, yq, yd, ys4, yo + b * 256)
    return hsum_f32x8(acc)
