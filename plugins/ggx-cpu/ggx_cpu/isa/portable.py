"""The portable variant: plain numba loops written so LLVM vectorizes them anywhere, and 8-bit
products in target-independent LLVM IR.

The kernels: same functions, signatures and layouts as `ggx_cpu.isa.vector` (read its
docstring); the `isa` argument is ignored. Two habits make LLVM vectorize these loops
(docs/perf-notes.md): every integer intermediate is narrowed to int16 (numba would otherwise widen
int8 products to int64), and each row keeps per-lane float accumulators (16 lanes) across its
blocks, summed once at the end.

The K-quant dots (Q4_K, Q6_K with Q8_K activations) are written here for the portable variant:
activation layout `yq` values from `yo`, `yd` f32 per 256 values at `yo // 256 + b`, `ys4`
the Q8_K bsums (int32 per 16 values) at `yo // 16 + g`.
Q4_K block (144 B): f16 d @0, f16 dmin @2, 12 B packed 6-bit scales/mins @4, 128 B nibbles @16.
Q6_K block (210 B): 128 B low nibbles @0, 64 B high 2-bit pairs @128, 16 x i8 scales @192,
f16 d @208. Q5_0 (as `ggx_cpu.isa.vector`): f16 d @0, u32 qh (bit j: bit 4 of value j) @2,
16 B nibbles @6 (22 B).

The products (`dot_u8s8`, `dot_s8s8`, `dot_u8s8_scaled`, for `ggx_cpu.isa.dispatch`) widen the
bytes to int32 and multiply: exact for every input, on any target, so that a kernel written
with `ggx_cpu.isa.dispatch` also runs where no vector ISA is available.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.extending import intrinsic

from .codegen import i32_vector
from .simd import I8x32, I16x16, I32x8, f16_bits_to_f32

#: whether `dot_u8s8` saturates its byte-pair sums (no: every product is exact)
U8S8_SATURATES = False


def _group_sums(builder, p, n: int, group: int):
    """Lane i = p[group * i] + ... + p[group * i + group - 1] of an n-lane vector p."""
    total = None
    for j in range(group):
        part = builder.shuffle_vector(p, p, i32_vector(range(j, n, group)))
        total = part if total is None else builder.add(total, part)
    return total


def _widened_product(builder, u, s, u_signed: bool):
    w32 = ir.VectorType(ir.IntType(32), 32)
    return builder.mul(builder.sext(u, w32) if u_signed else builder.zext(u, w32), builder.sext(s, w32))


def _make_dot_bytes(u_signed: bool):
    """An intrinsic (acc, u, s) -> acc + the 4-byte dot products of u and s (u unsigned, or
    signed when u_signed), in int32."""
    @intrinsic
    def dot(typingctx, acc, u, s):
        if acc != I32x8 or u != I8x32 or s != I8x32:
            return None

        def codegen(context, builder, sig, args):
            p = _widened_product(builder, args[1], args[2], u_signed)
            return builder.add(args[0], _group_sums(builder, p, 32, 4))

        return I32x8(I32x8, I8x32, I8x32), codegen

    return dot


_dot_u8s8 = _make_dot_bytes(False)
_dot_s8s8 = _make_dot_bytes(True)


@intrinsic
def _dot_bytes_scaled(typingctx, acc, u, s, sc):
    """acc + sum over pairs k of lane i of (u[2k] s[2k] + u[2k+1] s[2k+1]) * sc[k], in int32."""
    if acc != I32x8 or u != I8x32 or s != I8x32 or sc != I16x16:
        return None

    def codegen(context, builder, sig, args):
        pairs = _group_sums(builder, _widened_product(builder, args[1], args[2], False), 32, 2)
        scaled = builder.mul(pairs, builder.sext(args[3], ir.VectorType(ir.IntType(32), 16)))
        return builder.add(args[0], _group_sums(builder, scaled, 16, 2))

    return I32x8(I32x8, I8x32, I8x32, I16x16), codegen


def dot_u8s8(isa, acc, u, s):
    """Lane-wise acc + u . s for unsigned u and signed s, exact."""
    return _dot_u8s8(acc, u, s)


def dot_s8s8(isa, acc, w, y, ysum4):
    """Lane-wise acc + w . y for signed w and y, exact (ysum4 unused)."""
    return _dot_s8s8(acc, w, y)


def dot_u8s8_scaled(isa, acc, u, s, sc):
    """acc + the byte-pair sums of u * s times the int16 scales sc, exact (no int16 saturation)."""
    return _dot_bytes_scaled(acc, u, s, sc)


# --- the kernels -------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _f16(w, o):
    return f16_bits_to_f32(w[o] | (w[o + 1] << 8))


@njit(cache=True)
def dot_q4_0(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    acc = np.zeros(16, np.float32)
    for b in range(nb):
        o = wo + b * 18
        y = yo + b * 32
        scale = _f16(w, o) * yd[y // 32]
        for j in range(16):
            v = np.int16(w[o + 2 + j])
            lo = np.int16(np.int16(v & 15) - np.int16(8))
            hi = np.int16(np.int16(v >> 4) - np.int16(8))
            s = np.int16(np.int16(lo * np.int16(yq[y + j])) + np.int16(hi * np.int16(yq[y + 16 + j])))
            acc[j] += np.float32(s) * scale
    return acc.sum()


@njit(cache=True)
def dot_q5_0(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    """ggml's vec_dot_q5_0_q8_0: values (nibble | qh bit << 4) - 16, one f16 scale per block."""
    acc = np.zeros(16, np.float32)
    for b in range(nb):
        o = wo + b * 22
        y = yo + b * 32
        scale = _f16(w, o) * yd[y // 32]
        qh = np.int32(w[o + 2]) | (np.int32(w[o + 3]) << 8) | (np.int32(w[o + 4]) << 16) | (np.int32(w[o + 5]) << 24)
        for j in range(16):
            v = np.int16(w[o + 6 + j])
            lo = np.int16(np.int16((v & 15) | np.int16(((qh >> j) & 1) << 4)) - np.int16(16))
            hi = np.int16(np.int16((v >> 4) | np.int16(((qh >> (j + 16)) & 1) << 4)) - np.int16(16))
            s = np.int16(np.int16(lo * np.int16(yq[y + j])) + np.int16(hi * np.int16(yq[y + 16 + j])))
            acc[j] += np.float32(s) * scale
    return acc.sum()


@njit(cache=True)
def dot_q4_1(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    acc = np.zeros(16, np.float32)
    acc_m = np.float32(0.0)
    for b in range(nb):
        o = wo + b * 20
        y = yo + b * 32
        scale = _f16(w, o) * yd[y // 32]
        acc_m += _f16(w, o + 2) * ys[y // 32]
        for j in range(16):
            v = np.int16(w[o + 4 + j])
            s = np.int16(np.int16(np.int16(v & 15) * np.int16(yq[y + j]))
                         + np.int16(np.int16(v >> 4) * np.int16(yq[y + 16 + j])))
            acc[j] += np.float32(s) * scale
    return acc.sum() + acc_m


@njit(cache=True)
def dot_q8_0(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    acc = np.zeros(16, np.float32)
    for b in range(nb):
        o = wo + b * 34
        y = yo + b * 32
        scale = _f16(w, o) * yd[y // 32]
        for j in range(16):
            # int8 weights read through a uint8 array: subtract 256 from the top half
            a0 = np.int16(w[o + 2 + j])
            a1 = np.int16(w[o + 18 + j])
            a0 = np.int16(a0 - np.int16((a0 >> 7) << 8))
            a1 = np.int16(a1 - np.int16((a1 >> 7) << 8))
            s = np.int16(np.int16(a0 * np.int16(yq[y + j])) + np.int16(a1 * np.int16(yq[y + 16 + j])))
            acc[j] += np.float32(s) * scale
    return acc.sum()


@njit(cache=True)
def dot_q4_K(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    """ggml's vec_dot_q4_K_q8_K: sum_j sc_j (q . y)_j * d - sum_j m_j bsum_j * dmin, per block."""
    total = 0.0
    for b in range(nb):
        o = wo + b * 144
        y = yo + b * 256
        dy = yd[y // 256]
        d = _f16(w, o) * dy
        dmin = _f16(w, o + 2) * dy
        sc = o + 4
        isum = 0
        msum = 0
        for j in range(8):
            if j < 4:
                s_j = np.int32(w[sc + j] & 63)
                m_j = np.int32(w[sc + j + 4] & 63)
            else:
                s_j = np.int32((w[sc + j + 4] & 15) | ((w[sc + j - 4] >> 6) << 4))
                m_j = np.int32((w[sc + j + 4] >> 4) | ((w[sc + j] >> 6) << 4))
            q = o + 16 + (j // 2) * 32
            yy = y + j * 32
            shift = 4 * (j & 1)
            dot = np.int32(0)
            for l in range(32):
                dot += np.int16(np.int16((w[q + l] >> shift) & 15) * np.int16(yq[yy + l]))
            isum += s_j * dot
            msum += m_j * (ys4[y // 16 + 2 * j] + ys4[y // 16 + 2 * j + 1])
        total += d * isum - dmin * msum
    return total


@njit(cache=True)
def dot_q6_K(isa, w, wo, nb, yq, yd, ys, ys4, yo):
    """ggml's vec_dot_q6_K_q8_K: values (6 bits) - 32, int8 scale per 16 values, f16 d."""
    total = 0.0
    for b in range(nb):
        o = wo + b * 210
        y = yo + b * 256
        d = _f16(w, o + 208) * yd[y // 256]
        isum = 0
        for n in range(2):
            for g in range(8):
                quarter = g // 2
                ql = o + 64 * n + 32 * (quarter & 1) + 16 * (g % 2)
                qh = o + 128 + 32 * n + 16 * (g % 2)
                lshift = 4 * (quarter >> 1)
                hshift = 2 * quarter
                yy = y + 128 * n + 16 * g
                dot = np.int32(0)
                for i in range(16):
                    q = np.int16(((w[ql + i] >> lshift) & 15) | (((w[qh + i] >> hshift) & 3) << 4)) - np.int16(32)
                    dot += np.int16(np.int16(q) * np.int16(yq[yy + i]))
                s = np.int32(w[o + 192 + 8 * n + g])
                s = s - 256 if s > 127 else s
                isum += s * dot
        total += d * isum
    return total


# Tiles: the portable variant has no register tiling; a tile is 16 row dots.
@njit(cache=True, inline="always")
def _tile(dot, isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    for r in range(4):
        ro = wo + r * wrs
        out[oo0 + r] = dot(isa, w, ro, nb, yq, yd, ys, ys4, yo0)
        out[oo1 + r] = dot(isa, w, ro, nb, yq, yd, ys, ys4, yo1)
        out[oo2 + r] = dot(isa, w, ro, nb, yq, yd, ys, ys4, yo2)
        out[oo3 + r] = dot(isa, w, ro, nb, yq, yd, ys, ys4, yo3)


@njit(cache=True)
def tile_q4_0(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    _tile(dot_q4_0, isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3)


@njit(cache=True)
def tile_q5_0(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    """4 rows x 4 columns of dot_q5_0 (Q5_0 blocks of 22 B), as 16 row dots."""
    _tile(dot_q5_0, isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3)


@njit(cache=True)
def tile_q4_1(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    _tile(dot_q4_1, isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3)


@njit(cache=True)
def tile_q8_0(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    _tile(dot_q8_0, isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3)


@njit(cache=True)
def tile_q4_K(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    _tile(dot_q4_K, isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3)


@njit(cache=True)
def tile_q6_K(isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3):
    _tile(dot_q6_K, isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo0, yo1, yo2, yo3, out, oo0, oo1, oo2, oo3)
