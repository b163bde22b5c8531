"""Row conversion between ggml storage types and float32, bit-exact with ggml's reference code.

Every routine here works on raw bytes (uint8 arrays) in ggml's block layouts (ggml-common.h):

- F16 / BF16: 2 bytes per value, little-endian bits.
- Q4_0 (18 B / 32 values): f16 d, 16 B nibbles; value = (q - 8) * d, low nibbles are values 0..15.
- Q4_1 (20 B): f16 d, f16 m, 16 B nibbles; value = q * d + m.
- Q5_0 (22 B): f16 d, u32 qh (little-endian, bit j = bit 4 of value j), 16 B nibbles as Q4_0;
  value = (q - 16) * d.
- Q8_0 (34 B): f16 d, 32 x i8; value = q * d.   Q8_1 (36 B): f16 d, f16 s, 32 x i8.
- Q4_K (144 B / 256 values): f16 d, f16 dmin, 12 B packed 6-bit scales/mins, 128 B nibbles.
- Q6_K (210 B / 256 values): 128 B low nibbles, 64 B high 2-bit pairs, 16 x i8 scales, f16 d.
- Q8_K (292 B / 256 values): f32 d, 256 x i8, 16 x i16 bsums.

`load_row` dequantizes one row into float32 (ggml's `to_float`), `store_row` converts a float32
row into a storage type (ggml's reference `from_float`: quantize_row_*_ref). Types are passed to
kernels as their ggml type id (`GType.ggml_id`) so one compiled kernel serves every type.
Arithmetic is float32 where ggml's is, so results match ggml bit for bit.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.types import GType

from . import LOAD_TYPES, STORE_TYPES  # noqa: F401  (the types load_row / store_row take)

# ggml type ids (GType.ggml_id), the codes kernels switch on.
F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, Q8_1, Q4_K, Q6_K, Q8_K, I32, I64, BF16 = 0, 1, 2, 3, 6, 8, 9, 12, 14, 15, 26, 27, 30



# --- scalar bit conversions (LLVM half/float casts: F16C instructions on x86) ---------------
@intrinsic
def f16_to_f32(typingctx, h):
    """float32 value of IEEE half bits (uint16); exact, like GGML_FP16_TO_FP32."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """IEEE half bits of a float32, rounded to nearest even (GGML_FP32_TO_FP16 / vcvtps2ph)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def bits_to_f32(typingctx, u):
    """Reinterpret uint32 bits as float32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def f32_to_bits(typingctx, x):
    """Reinterpret float32 as uint32 bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


def as_f32(v):
    """float32 of an element read from a typed array: uint16 means F16 bits (numba-only helper)."""
    raise NotImplementedError("as_f32 is only callable from numba code")


@overload(as_f32, inline="always")
def _as_f32(v):
    if v == types.uint16:
        return lambda v: f16_to_f32(v)
    return lambda v: np.float32(v)


@njit(cache=True, inline="always")
def bf16_to_f32(h):
    return bits_to_f32(np.uint32(h) << np.uint32(16))


@njit(cache=True, inline="always")
def f32_to_bf16(x):
    """ggml_compute_fp32_to_bf16: round to nearest even, NaN kept quiet."""
    u = f32_to_bits(x)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(64))
    return np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))


@njit(cache=True, inline="always")
def rd_u16(buf, o):
    return np.uint16(np.uint16(buf[o]) | (np.uint16(buf[o + 1]) << np.uint16(8)))


@njit(cache=True, inline="always")
def rd_f16(buf, o):
    return f16_to_f32(rd_u16(buf, o))


@njit(cache=True, inline="always")
def wr_u16(buf, o, h):
    buf[o] = np.uint8(h & np.uint16(0xFF))
    buf[o + 1] = np.uint8(h >> np.uint16(8))


@njit(cache=True, inline="always")
def rd_u32(buf, o):
    return (np.uint32(buf[o]) | (np.uint32(buf[o + 1]) << np.uint32(8)) | (np.uint32(buf[o + 2]) << np.uint32(16))
            | (np.uint32(buf[o + 3]) << np.uint32(24)))


@njit(cache=True, inline="always")
def rd_f32(buf, o):
    return bits_to_f32(rd_u32(buf, o))


@njit(cache=True, inline="always")
def load_elem(buf, o, code):
    """One float element (F32/F16/BF16) at byte offset o, as float32."""
    if code == F32:
        return rd_f32(buf, o)
    if code == F16:
        return rd_f16(buf, o)
    return bf16_to_f32(rd_u16(buf, o))


@njit(cache=True, inline="always")
def _scale_min_k4(j, buf, q):
    """get_scale_min_k4: the 6-bit scale and min j (0..7) of a Q4_K block's 12 packed bytes at q."""
    if j < 4:
        return buf[q + j] & 63, buf[q + j + 4] & 63
    sc = (buf[q + j + 4] & 0xF) | ((buf[q + j - 4] >> 6) << 4)
    m = (buf[q + j + 4] >> 4) | ((buf[q + j] >> 6) << 4)
    return sc, m


@njit(cache=True)
def load_row(buf, off, code, n, out):
    """Dequantize the n values stored from byte `off` of `buf` (a contiguous row) into out[:n]."""
    if code == F32:
        src = buf[off: off + 4 * n].view(np.float32)
        for i in range(n):
            out[i] = src[i]
    elif code == F16:
        for i in range(n):
            out[i] = rd_f16(buf, off + 2 * i)
    elif code == BF16:
        for i in range(n):
            out[i] = bf16_to_f32(rd_u16(buf, off + 2 * i))
    elif code == Q4_0:
        for b in range(n // 32):
            p = off + b * 18
            d = rd_f16(buf, p)
            for j in range(16):
                q = buf[p + 2 + j]
                out[b * 32 + j] = np.float32(np.int32(q & 0xF) - 8) * d
                out[b * 32 + j + 16] = np.float32(np.int32(q >> 4) - 8) * d
    elif code == Q5_0:  # dequantize_row_q5_0
        for b in range(n // 32):
            p = off + b * 22
            d = rd_f16(buf, p)
            qh = rd_u32(buf, p + 2)
            for j in range(16):
                q = np.int32(buf[p + 6 + j])
                h0 = np.int32(((qh >> j) << 4) & 0x10)
                h1 = np.int32((qh >> (j + 12)) & 0x10)
                out[b * 32 + j] = np.float32(((q & 0xF) | h0) - 16) * d
                out[b * 32 + j + 16] = np.float32(((q >> 4) | h1) - 16) * d
    elif code == Q4_1:
        for b in range(n // 32):
            p = off + b * 20
            d = rd_f16(buf, p)
            m = rd_f16(buf, p + 2)
            for j in range(16):
                q = buf[p + 4 + j]
                out[b * 32 + j] = np.float32(q & 0xF) * d + m
                out[b * 32 + j + 16] = np.float32(q >> 4) * d + m
    elif code == Q8_0 or code == Q8_1:
        size = 34 if code == Q8_0 else 36
        head = 2 if code == Q8_0 else 4
        for b in range(n // 32):
            p = off + b * size
            d = rd_f16(buf, p)
            qs = buf[p + head: p + head + 32].view(np.int8)
            for j in range(32):
                out[b * 32 + j] = np.float32(qs[j]) * d
    elif code == Q8_K:
        for b in range(n // 256):
            p = off + b * 292
            d = rd_f32(buf, p)
            qs = buf[p + 4: p + 260].view(np.int8)
            for j in range(256):
                out[b * 256 + j] = np.float32(qs[j]) * d
    elif code == Q4_K:
        for b in range(n // 256):
            p = off + b * 144
            d = rd_f16(buf, p)
            dmin = rd_f16(buf, p + 2)
            q = p + 16
            y = b * 256
            for j in range(4):  # 64 values per step: two (scale, min) pairs
                sc, m = _scale_min_k4(2 * j, buf, p + 4)
                d1 = d * np.float32(sc)
                m1 = dmin * np.float32(m)
                sc, m = _scale_min_k4(2 * j + 1, buf, p + 4)
                d2 = d * np.float32(sc)
                m2 = dmin * np.float32(m)
                for l in range(32):
                    out[y + l] = d1 * np.float32(buf[q + l] & 0xF) - m1
                for l in range(32):
                    out[y + 32 + l] = d2 * np.float32(buf[q + l] >> 4) - m2
                q += 32
                y += 64
    elif code == Q6_K:
        for b in range(n // 256):
            p = off + b * 210
            d = rd_f16(buf, p + 208)
            sc = buf[p + 192: p + 208].view(np.int8)
            y = b * 256
            ql = p
            qh = p + 128
            s = 0
            for _ in range(2):  # 128 values per step
                for l in range(32):
                    is_ = l // 16
                    h = np.int32(buf[qh + l])
                    q1 = np.int32((buf[ql + l] & 0xF) | ((h & 3) << 4)) - 32
                    q2 = np.int32((buf[ql + l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32
                    q3 = np.int32((buf[ql + l] >> 4) | (((h >> 4) & 3) << 4)) - 32
                    q4 = np.int32((buf[ql + l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32
                    out[y + l] = d * np.float32(sc[s + is_]) * np.float32(q1)
                    out[y + l + 32] = d * np.float32(sc[s + is_ + 2]) * np.float32(q2)
                    out[y + l + 64] = d * np.float32(sc[s + is_ + 4]) * np.float32(q3)
                    out[y + l + 96] = d * np.float32(sc[s + is_ + 6]) * np.float32(q4)
                y += 128
                ql += 64
                qh += 32
                s += 8


@njit(cache=True, inline="always")
def _roundf(x):
    """C roundf (half away from zero), done in float64 so x + 0.5 does not round first."""
    a = np.float64(abs(x))
    r = np.floor(a + 0.5)
    return -r if x < 0 else r


@njit(cache=True)
def store_row(x, code, n, buf, off):
    """Convert x[:n] (float32) into type `code` at byte `off` of `buf` (ggml's reference quantizers)."""
    if code == F32:
        dst = buf[off: off + 4 * n].view(np.float32)
        for i in range(n):
            dst[i] = x[i]
    elif code == F16:
        for i in range(n):
            wr_u16(buf, off + 2 * i, f32_to_f16(x[i]))
    elif code == BF16:
        for i in range(n):
            wr_u16(buf, off + 2 * i, f32_to_bf16(x[i]))
    elif code == Q4_0:  # quantize_row_q4_0_ref
        for b in range(n // 32):
            v = x[b * 32: b * 32 + 32]
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for j in range(32):
                if amax < abs(v[j]):
                    amax = abs(v[j])
                    vmax = v[j]
            d = vmax / np.float32(-8.0)
            ident = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            p = off + b * 18
            wr_u16(buf, p, f32_to_f16(d))
            for j in range(16):
                x0 = v[j] * ident
                x1 = v[j + 16] * ident
                xi0 = min(15, np.int32(x0 + np.float32(8.5)))
                xi1 = min(15, np.int32(x1 + np.float32(8.5)))
                buf[p + 2 + j] = np.uint8(xi0 | (xi1 << 4))
    elif code == Q5_0:  # quantize_row_q5_0_ref: Q4_0's rounding on 32 levels, bit 4 into qh
        for b in range(n // 32):
            v = x[b * 32: b * 32 + 32]
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for j in range(32):
                if amax < abs(v[j]):
                    amax = abs(v[j])
                    vmax = v[j]
            d = vmax / np.float32(-16.0)
            ident = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            p = off + b * 22
            wr_u16(buf, p, f32_to_f16(d))
            qh = np.int64(0)
            for j in range(16):
                xi0 = min(31, np.int32(v[j] * ident + np.float32(16.5)))
                xi1 = min(31, np.int32(v[j + 16] * ident + np.float32(16.5)))
                buf[p + 6 + j] = np.uint8((xi0 & 0xF) | ((xi1 & 0xF) << 4))
                qh |= (np.int64(xi0 >> 4) << j) | (np.int64(xi1 >> 4) << (j + 16))
            for k in range(4):
                buf[p + 2 + k] = np.uint8((qh >> (8 * k)) & 0xFF)
    elif code == Q4_1:  # quantize_row_q4_1_ref
        for b in range(n // 32):
            v = x[b * 32: b * 32 + 32]
            vmin = np.float32(np.inf)
            vmax = np.float32(-np.inf)
            for j in range(32):
                if v[j] < vmin:
                    vmin = v[j]
                if v[j] > vmax:
                    vmax = v[j]
            d = (vmax - vmin) / np.float32(15.0)
            ident = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            p = off + b * 20
            wr_u16(buf, p, f32_to_f16(d))
            wr_u16(buf, p + 2, f32_to_f16(vmin))
            for j in range(16):
                x0 = (v[j] - vmin) * ident
                x1 = (v[j + 16] - vmin) * ident
                xi0 = min(15, np.int32(x0 + np.float32(0.5)))
                xi1 = min(15, np.int32(x1 + np.float32(0.5)))
                buf[p + 4 + j] = np.uint8(xi0 | (xi1 << 4))
    elif code == Q8_0:  # quantize_row_q8_0_ref
        for b in range(n // 32):
            v = x[b * 32: b * 32 + 32]
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(v[j]))
            d = amax / np.float32(127.0)
            ident = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            p = off + b * 34
            wr_u16(buf, p, f32_to_f16(d))
            for j in range(32):
                buf[p + 2 + j] = np.uint8(np.int32(_roundf(v[j] * ident)) & 0xFF)


# --- whole-array entry points (tests, other plugins) ----------------------------------------
@njit(cache=True, parallel=True)
def _dequant_rows(src, row_bytes, code, out):
    for r in prange(out.shape[0]):
        load_row(src, r * row_bytes, code, out.shape[1], out[r])


@njit(cache=True, parallel=True)
def _quant_rows(x, code, row_bytes, dst):
    for r in prange(x.shape[0]):
        store_row(x[r], code, x.shape[1], dst, r * row_bytes)


def dequantize(data: np.ndarray, gtype: GType, n_per_row: int) -> np.ndarray:
    """float32 rows [n_rows, n_per_row] of the raw bytes `data` holding whole rows of `gtype`."""
    gtype = GType.parse(gtype)
    if gtype not in LOAD_TYPES:
        raise GGXUnsupported(f"cannot dequantize {gtype.name}")
    row_bytes = gtype.row_size(n_per_row)
    data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if row_bytes == 0 or data.size % row_bytes:
        raise GGXShapeError(f"{data.size} bytes are not whole rows of {n_per_row} {gtype.name} values")
    out = np.empty((data.size // row_bytes, n_per_row), np.float32)
    _dequant_rows(data, row_bytes, gtype.ggml_id, out)
    return out


def quantize(x: np.ndarray, gtype: GType) -> np.ndarray:
    """Raw bytes [n_rows, row_bytes] of float rows x [n_rows, n_per_row] stored as `gtype`."""
    gtype = GType.parse(gtype)
    if gtype not in STORE_TYPES:
        raise GGXUnsupported(f"cannot quantize to {gtype.name}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    x = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    row_bytes = gtype.row_size(x.shape[1])
    dst = np.empty(x.shape[0] * row_bytes, np.uint8)
    _quant_rows(x, gtype.ggml_id, row_bytes, dst)
    return dst.reshape(x.shape[0], row_bytes)
