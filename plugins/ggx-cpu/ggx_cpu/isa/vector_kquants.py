"""Q4_K and Q6_K dot products on SIMD vectors (ggml's vec_dot_q4_K_q8_K / vec_dot_q6_K_q8_K),
one source for every vector ISA, as `ggx_cpu.isa.vector` is for Q4_0/Q4_1/Q8_0.

Functions here replace `ggx_cpu.isa.portable`'s of the same name under a vector ISA (see
`ggx_cpu.kernels.matmul`); same signatures and layouts as there:

- weights `w`: uint8 ggml block bytes, a row at byte `wo`, `nb` super-blocks of 256 values.
  Q4_K block (144 B): f16 d @0, f16 dmin @2, 12 B packed 6-bit scales/mins @4, 128 B nibbles
  @16 (bytes 32j..32j+31: low nibbles = values 64j.., high nibbles = values 64j+32..).
  Q6_K block (210 B): 128 B low nibbles @0, 64 B high 2-bit pairs @128, 16 x i8 scales @192,
  f16 d @208 (value order: see `_q6_K_quants`).
- activations Q8_K (`ggx_cpu.kernels.quantize_act`, structure of arrays): `yq` int8 values
  from `yo`, `yd` f32 scale per 256 values at `(yo >> 8) + b`, `ys4` the bsums (int32 sum of
  16 values) at `(yo >> 4) + g`; `ys` unused.

The integer core is ggml's AVX2 one: `vpmaddubsw` multiplies the unsigned weight values
(Q4_K 0..15, Q6_K 0..63) with the signed activations into int16 pair sums (at most
2 * 63 * 127, no saturation), and one more instruction multiplies those by the sub-block
scale broadcast as int16 and adds pairs into int32 lanes: `vpmaddwd` (AVX2) or `vpdpwssd`
(AVX-512 VNNI, which also accumulates). That is `dot_u8s8_scaled`, dispatched on the `isa`
token (`ggx_cpu.isa.dispatch`); it folds the per-sub-block scale into the pair sum, where
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
from numba.core import types
from numba.extending import intrinsic

from .avx2 import pshufb
from .codegen import I8, I16, I32, I64, i32_vector, is_bytes_arg, load_vector, splat_const
from .dispatch import dot_u8s8_scaled
from .simd import (
    I8x32,
    I16x16,
    I32x8,
    add_i32x8,
    at,
    f16_at,
    fma_i32x8_f32x8,
    hsum_f32x8,
    llvm_type,
    load_i8x32,
    mul_i32x8,
    splat_f32x8,
    sub_i32x8,
    zero_f32x8,
    zero_i32x8,
)
from .vector import store_tile_4x4

# --- loads and unpacking -------------------------------------------------------------------------
# Every unpacking intrinsic returns a super-block as 8 runs of 32 values (run c = values 32c..
# 32c+31, matching the activation bytes at y + 32c) and the run's scales as int16 vectors laid
# out for `dot_u8s8_scaled`.
_QUANTS = types.UniTuple(I8x32, 8)
_SCALES = types.UniTuple(I16x16, 8)


@intrinsic
def _q4_K_quants(typingctx, w, o):
    """The 256 values of the Q4_K block at byte o, 0..15: run 2j = low nibbles of bytes
    16 + 32j .. 16 + 32j + 31, run 2j + 1 = their high nibbles."""
    if not is_bytes_arg(w, o):
        return None

    def codegen(context, builder, sig, args):
        m = splat_const(I8, 32, 15)
        o0 = context.cast(builder, args[1], sig.args[1], types.intp)
        runs = []
        for j in range(4):
            off = builder.add(o0, ir.Constant(I64, 16 + 32 * j))
            v = load_vector(context, builder, sig.args[0], args[0], off, llvm_type(I8x32))
            # the high nibbles by an int32 shift (x86 has no byte shift), the mask drops what
            # crossed over from the neighbouring byte
            hi = builder.lshr(builder.bitcast(v, llvm_type(I32x8)), splat_const(I32, 8, 4))
            hi = builder.bitcast(hi, llvm_type(I8x32))
            runs += [builder.and_(v, m), builder.and_(hi, m)]
        return context.make_tuple(builder, sig.return_type, runs)

    return _QUANTS(w, types.intp), codegen


@intrinsic
def _q4_K_scales(typingctx, w, o):
    """The 6-bit scales and mins of the Q4_K block at byte o: (run j's scale in all 16 int16
    lanes of splat j; int32 lane j = min j). ggml's utmp / kmask unpacking on the 3 words
    u0, u1, u2 at o + 4, done as one vector of 4 words [scales 0..3, scales 4..7, mins 0..3,
    mins 4..7]: scale j < 4 = q[j] & 63, min j < 4 = q[4 + j] & 63, scale 4 + i =
    (q[8 + i] & 15) | (q[i] >> 6) << 4, min 4 + i = (q[8 + i] >> 4) | (q[4 + i] >> 6) << 4.
    (The 16-byte load reads 4 bytes of the nibbles after the scales; they are dropped.)"""
    if not is_bytes_arg(w, o):
        return None

    def codegen(context, builder, sig, args):
        v4 = ir.VectorType(I32, 4)
        off = builder.add(context.cast(builder, args[1], sig.args[1], types.intp), ir.Constant(I64, 4))
        u = load_vector(context, builder, sig.args[0], args[0], off, v4)  # [u0, u1, u2, -]
        low = builder.shuffle_vector(u, u, i32_vector([0, 2, 1, 2]))
        top = builder.shuffle_vector(u, ir.Constant(v4, None), i32_vector([4, 0, 4, 1]))  # 2-bit tops; 0 for words 0, 2

        def c4(*v):
            return i32_vector(v)

        low = builder.and_(builder.lshr(low, c4(0, 0, 0, 4)), c4(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F))
        top = builder.shl(builder.and_(builder.lshr(top, c4(6, 6, 6, 6)), c4(*[0x03030303] * 4)), c4(4, 4, 4, 4))
        b16 = builder.bitcast(builder.or_(low, top), ir.VectorType(I8, 16))  # scales 0..7, mins 0..7
        both = builder.shuffle_vector(b16, b16, i32_vector(list(range(16)) * 2))
        splats = [builder.bitcast(pshufb(builder, both, [j, 0x80] * 16), llvm_type(I16x16)) for j in range(8)]
        mins = builder.zext(builder.shuffle_vector(b16, b16, i32_vector(range(8, 16))), llvm_type(I32x8))
        return context.make_tuple(builder, sig.return_type,
                                  [context.make_tuple(builder, _SCALES, splats), mins])

    return types.Tuple([_SCALES, I32x8])(w, types.intp), codegen


@intrinsic
def _bsum_pairs(typingctx, ys4, g):
    """int32 lane j = bsum[g + 2j] + bsum[g + 2j + 1]: the activation sums of the 8 runs."""
    if not (isinstance(ys4, types.Array) and ys4.dtype == types.int32 and isinstance(g, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = load_vector(context, builder, sig.args[0], args[0], args[1], ir.VectorType(I32, 16))
        return builder.add(builder.shuffle_vector(v, v, i32_vector(range(0, 16, 2))),
                           builder.shuffle_vector(v, v, i32_vector(range(1, 16, 2))))

    return I32x8(ys4, types.intp), codegen


@intrinsic
def _q6_K_quants(typingctx, w, o):
    """The 256 values of the Q6_K block at byte o as unsigned 0..63 (value + 32), ggml's
    dequantize_row_q6_K order: half n (runs 4n..4n+3) has l0 = 32 bytes at o + 64n, l1 at
    o + 64n + 32, h at o + 128 + 32n, and
    run 4n = (l0 & 15) | (h & 3) << 4,       run 4n+1 = (l1 & 15) | (h >> 2 & 3) << 4,
    run 4n+2 = (l0 >> 4) | (h >> 4 & 3) << 4, run 4n+3 = (l1 >> 4) | (h >> 6) << 4."""
    if not is_bytes_arg(w, o):
        return None

    def codegen(context, builder, sig, args):
        v8, v32 = llvm_type(I8x32), llvm_type(I32x8)
        o0 = context.cast(builder, args[1], sig.args[1], types.intp)
        m4, m30 = splat_const(I8, 32, 15), splat_const(I8, 32, 0x30)

        def load(off):
            return load_vector(context, builder, sig.args[0], args[0], builder.add(o0, ir.Constant(I64, off)), v8)

        def shifted(v, n):
            # byte shifts as int32 lanes; the callers' masks drop bits from the neighbouring byte
            vi = builder.bitcast(v, v32)
            vi = builder.shl(vi, splat_const(I32, 8, n)) if n > 0 else builder.lshr(vi, splat_const(I32, 8, -n))
            return builder.bitcast(vi, v8)

        runs = []
        for n in range(2):
            l0, l1, h = load(64 * n), load(64 * n + 32), load(128 + 32 * n)
            runs += [
                builder.or_(builder.and_(l0, m4), builder.and_(shifted(h, 4), m30)),
                builder.or_(builder.and_(l1, m4), builder.and_(shifted(h, 2), m30)),
                builder.or_(builder.and_(shifted(l0, -4), m4), builder.and_(h, m30)),
                builder.or_(builder.and_(shifted(l1, -4), m4), builder.and_(shifted(h, -2), m30)),
            ]
        return context.make_tuple(builder, sig.return_type, runs)

    return _QUANTS(w, types.intp), codegen


@intrinsic
def _q6_K_scales(typingctx, w, o):
    """The 16 int8 scales of the Q6_K block at byte o (at o + 192), one per 16 values: run c
    gets scale 2c on int16 lanes 0..7 (its first 16 values) and 2c + 1 on lanes 8..15.
    Sign-extended once; each splat is one vpshufb of the half holding its two scales."""
    if not is_bytes_arg(w, o):
        return None

    def codegen(context, builder, sig, args):
        off = builder.add(context.cast(builder, args[1], sig.args[1], types.intp), ir.Constant(I64, 192))
        b = load_vector(context, builder, sig.args[0], args[0], off, ir.VectorType(I8, 16))
        s16 = builder.bitcast(builder.sext(b, ir.VectorType(I16, 16)), llvm_type(I8x32))
        halves = [builder.shuffle_vector(s16, s16, i32_vector(list(range(16 * h, 16 * h + 16)) * 2)) for h in range(2)]
        splats = []
        for c in range(8):
            k = 2 * (2 * c % 8)  # byte offset of word 2c within its half (scales 0..7 | 8..15)
            mask = [k, k + 1] * 8 + [k + 2, k + 3] * 8
            splats.append(builder.bitcast(pshufb(builder, halves[c // 4], mask), llvm_type(I16x16)))
        return context.make_tuple(builder, sig.return_type, splats)

    return _SCALES(w, types.intp), codegen


@intrinsic
def _q6_K_offset(typingctx, w, o, ys4, g):
    """What the +32 in `_q6_K_quants` adds, to take off: int32 lane i = 32 (s_i bsum_i +
    s_{i+8} bsum_{i+8}), s the Q6_K block's scales (at o + 192), bsums at ys4[g..g+15]."""
    if not (is_bytes_arg(w, o) and isinstance(ys4, types.Array) and ys4.dtype == types.int32
            and isinstance(g, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        off = builder.add(context.cast(builder, args[1], sig.args[1], types.intp), ir.Constant(I64, 192))
        b = load_vector(context, builder, sig.args[0], args[0], off, ir.VectorType(I8, 16))
        bs = load_vector(context, builder, sig.args[2], args[2], args[3], ir.VectorType(I32, 16))
        prod = builder.mul(builder.sext(b, ir.VectorType(I32, 16)), bs)
        half = builder.add(builder.shuffle_vector(prod, prod, i32_vector(range(8))),
                           builder.shuffle_vector(prod, prod, i32_vector(range(8, 16))))
        return builder.shl(half, splat_const(I32, 8, 5))

    return I32x8(w, types.intp, ys4, types.intp), codegen


# --- one super-block x one column: int32 lanes ----------------------------------------------------
# These helpers are separate numba functions that LLVM inlines; numba-level inlining
# (inline="always") of all of them made each 4x4 tile take ~7 s to compile instead of ~1 s, for
# no speed: only the per-row part of the tiles is inlined by numba (LLVM declines that one).
@njit(cache=True)
def _run2(isa, acc, q0, q1, s0, s1, yq, y):
    """acc + two consecutive runs (64 values at y), scaled."""
    return dot_u8s8_scaled(isa, dot_u8s8_scaled(isa, acc, q0, load_i8x32(yq, y), s0), q1, load_i8x32(yq, y + 32), s1)


@njit(cache=True)
def _lanes(isa, q, s, yq, y):
    """sum_c s_c (q_c . y_c) over the 8 runs, lane-wise and exact (|sum| < 2^31: at most
    8 runs x 4 values x 63 x 127 x 128). Four short chains, so products do not wait on each other."""
    z = zero_i32x8()
    a = _run2(isa, z, q[0], q[1], s[0], s[1], yq, y)
    b = _run2(isa, z, q[2], q[3], s[2], s[3], yq, y + 64)
    c = _run2(isa, z, q[4], q[5], s[4], s[5], yq, y + 128)
    e = _run2(isa, z, q[6], q[7], s[6], s[7], yq, y + 192)
    return add_i32x8(add_i32x8(a, b), add_i32x8(c, e))


@njit(cache=True)
def _q4_K_col(isa, acc, q, s, mins, d, dmin, yq, yd, ys4, y):
    """acc + one Q4_K block (unpacked: q, s, mins, f16 d and dmin) x the Q8_K block at y:
    d dy (sum_j s_j q_j . y_j) - dmin dy (sum_j m_j bsum_j), lane-wise."""
    dy = at(yd, y >> 8)
    acc = fma_i32x8_f32x8(acc, _lanes(isa, q, s, yq, y), splat_f32x8(d * dy))
    return fma_i32x8_f32x8(acc, mul_i32x8(mins, _bsum_pairs(ys4, y >> 4)), splat_f32x8(-(dmin * dy)))


@njit(cache=True)
def _q4_K_block(isa, acc, w, o, yq, yd, ys4, y):
    s, mins = _q4_K_scales(w, o)
    return _q4_K_col(isa, acc, _q4_K_quants(w, o), s, mins, f16_at(w, o), f16_at(w, o + 2), yq, yd, ys4, y)


@njit(cache=True)
def _q6_K_col(isa, acc, q, s, d, w, o, yq, yd, ys4, y):
    """acc + one Q6_K block at o (unpacked: q, s, f16 d) x the Q8_K block at y:
    d dy sum_k s_k (q_k - 32) . y_k, lane-wise."""
    lanes = sub_i32x8(_lanes(isa, q, s, yq, y), _q6_K_offset(w, o, ys4, y >> 4))
    return fma_i32x8_f32x8(acc, lanes, splat_f32x8(d * at(yd, y >> 8)))


@njit(cache=True)
def _q6_K_block(isa, acc, w, o, yq, yd, ys4, y):
    return _q6_K_col(isa, acc, _q6_K_quants(w, o), _q6_K_scales(w, o), f16_at(w, o + 208), w, o, yq, yd, ys4, y)


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


# --- row quads (the gemv): 4 rows x 1 column, four independent accumulator chains ---------------
@njit(cache=True)
def rows4_q4_K(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
    """out[oo + r] = dot_q4_K of rows wo + r * wrs (r < 4) with the column at yo."""
    a0 = a1 = a2 = a3 = zero_f32x8()
    for b in range(nb):
        o0 = wo + b * 144
        y = yo + b * 256
        a0 = _q4_K_block(isa, a0, w, o0, yq, yd, ys4, y)
        a1 = _q4_K_block(isa, a1, w, o0 + wrs, yq, yd, ys4, y)
        a2 = _q4_K_block(isa, a2, w, o0 + 2 * wrs, yq, yd, ys4, y)
        a3 = _q4_K_block(isa, a3, w, o0 + 3 * wrs, yq, yd, ys4, y)
    out[oo] = hsum_f32x8(a0)
    out[oo + 1] = hsum_f32x8(a1)
    out[oo + 2] = hsum_f32x8(a2)
    out[oo + 3] = hsum_f32x8(a3)


@njit(cache=True)
def rows4_q6_K(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
    """out[oo + r] = dot_q6_K of rows wo + r * wrs (r < 4) with the column at yo."""
    a0 = a1 = a2 = a3 = zero_f32x8()
    for b in range(nb):
        o0 = wo + b * 210
        y = yo + b * 256
        a0 = _q6_K_block(isa, a0, w, o0, yq, yd, ys4, y)
        a1 = _q6_K_block(isa, a1, w, o0 + wrs, yq, yd, ys4, y)
        a2 = _q6_K_block(isa, a2, w, o0 + 2 * wrs, yq, yd, ys4, y)
        a3 = _q6_K_block(isa, a3, w, o0 + 3 * wrs, yq, yd, ys4, y)
    out[oo] = hsum_f32x8(a0)
    out[oo + 1] = hsum_f32x8(a1)
    out[oo + 2] = hsum_f32x8(a2)
    out[oo + 3] = hsum_f32x8(a3)


# --- tiles (the gemm): 4 rows x 4 columns, each weight block unpacked once for 4 columns --------
@njit(cache=True, inline="always")
def _q4_K_row4(isa, a0, a1, a2, a3, w, o, yq, yd, ys4, y0, y1, y2, y3):
    q = _q4_K_quants(w, o)
    s, mins = _q4_K_scales(w, o)
    d, dmin = f16_at(w, o), f16_at(w, o + 2)
    a0 = _q4_K_col(isa, a0, q, s, mins, d, dmin, yq, yd, ys4, y0)
    a1 = _q4_K_col(isa, a1, q, s, mins, d, dmin, yq, yd, ys4, y1)
    a2 = _q4_K_col(isa, a2, q, s, mins, d, dmin, yq, yd, ys4, y2)
    a3 = _q4_K_col(isa, a3, q, s, mins, d, dmin, yq, yd, ys4, y3)
    return a0, a1, a2, a3


@njit(cache=True, inline="always")
def _q6_K_row4(isa, a0, a1, a2, a3, w, o, yq, yd, ys4, y0, y1, y2, y3):
    q = _q6_K_quants(w, o)
    s = _q6_K_scales(w, o)
    d = f16_at(w, o + 208)
    a0 = _q6_K_col(isa, a0, q, s, d, w, o, yq, yd, ys4, y0)
    a1 = _q6_K_col(isa, a1, q, s, d, w, o, yq, yd, ys4, y1)
    a2 = _q6_K_col(isa, a2, q, s, d, w, o, yq, yd, ys4, y2)
    a3 = _q6_K_col(isa, a3, q, s, d, w, o, yq, yd, ys4, y3)
    return a0, a1, a2, a3


@njit(cache=True)
def tile_q4_K(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    """4 rows x 4 columns of dot_q4_K; result (r, c) to out[oo_c + r]."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = zero_f32x8()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = zero_f32x8()
    for b in range(nb):
        o = wo + b * 144
        y0, y1, y2, y3 = yo0 + b * 256, yo1 + b * 256, yo2 + b * 256, yo3 + b * 256
        a00, a01, a02, a03 = _q4_K_row4(isa, a00, a01, a02, a03, w, o, yq, yd, ys4, y0, y1, y2, y3)
        a10, a11, a12, a13 = _q4_K_row4(isa, a10, a11, a12, a13, w, o + wrs, yq, yd, ys4, y0, y1, y2, y3)
        a20, a21, a22, a23 = _q4_K_row4(isa, a20, a21, a22, a23, w, o + 2 * wrs, yq, yd, ys4, y0, y1, y2, y3)
        a30, a31, a32, a33 = _q4_K_row4(isa, a30, a31, a32, a33, w, o + 3 * wrs, yq, yd, ys4, y0, y1, y2, y3)
    store_tile_4x4(out, oo0, oo1, oo2, oo3, a00, a01, a02, a03, a10, a11, a12, a13,
                   a20, a21, a22, a23, a30, a31, a32, a33)


@njit(cache=True)
def tile_q6_K(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    """4 rows x 4 columns of dot_q6_K; result (r, c) to out[oo_c + r]."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = zero_f32x8()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = zero_f32x8()
    for b in range(nb):
        o = wo + b * 210
        y0, y1, y2, y3 = yo0 + b * 256, yo1 + b * 256, yo2 + b * 256, yo3 + b * 256
        a00, a01, a02, a03 = _q6_K_row4(isa, a00, a01, a02, a03, w, o, yq, yd, ys4, y0, y1, y2, y3)
        a10, a11, a12, a13 = _q6_K_row4(isa, a10, a11, a12, a13, w, o + wrs, yq, yd, ys4, y0, y1, y2, y3)
        a20, a21, a22, a23 = _q6_K_row4(isa, a20, a21, a22, a23, w, o + 2 * wrs, yq, yd, ys4, y0, y1, y2, y3)
        a30, a31, a32, a33 = _q6_K_row4(isa, a30, a31, a32, a33, w, o + 3 * wrs, yq, yd, ys4, y0, y1, y2, y3)
    store_tile_4x4(out, oo0, oo1, oo2, oo3, a00, a01, a02, a03, a10, a11, a12, a13,
                   a20, a21, a22, a23, a30, a31, a32, a33)
