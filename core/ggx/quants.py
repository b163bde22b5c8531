"""Quantize and dequantize tensor data, bit-exact with ggml / GGUF block layouts.

Layouts (one block, little-endian, see GType.block_dtype):
  Q4_0  f16 d, 16 B nibbles                       value = (q - 8) * d
  Q4_1  f16 d, f16 m, 16 B nibbles                value = q * d + m
  Q5_0  f16 d, u32 qh (5th bits), 16 B nibbles    value = (q - 16) * d, q = nibble | bit << 4
  Q8_0  f16 d, 32 x i8                            value = q * d
  Q8_1  f16 d, f16 s = d * sum(q), 32 x i8        value = q * d
  Q4_K  256 values: f16 d, f16 dmin, 12 B of 6-bit scales/mins, 128 B nibbles
  Q5_K  256 values: Q4_K's header, 32 B qh (bit s of qh[l]: 5th bit of value l of sub-block s), 128 B nibbles
  Q6_K  256 values: 128 B low nibbles, 64 B high 2-bit pairs, 16 x i8 scales, f16 d
  Q8_K  256 values: f32 d, 256 x i8, 16 x i16 bsums (sums of 16-value groups)

Rows run along the last numpy axis (ggml's ne[0]). Where the `gguf` package implements a type
it is the reference and is used directly (Q4_0, Q4_1, Q5_0, Q8_0, BF16 both ways; Q4_K, Q5_K,
Q6_K dequantize). The rest mirrors ggml's reference C code (`quantize_row_*_ref` in ggml-quants.c)
in numpy, in float32, one C operation per numpy operation, and with sums accumulated
sequentially in C's order, so that every byte matches what ggml writes.
"""
from __future__ import annotations

import numpy as np

from .errors import GGXShapeError
from .types import GType

__all__ = ["quantize", "dequantize", "nearest_int", "fp32_to_fp16"]

_f32 = np.float32
QK_K = 256
GROUP_MAX_EPS = _f32(1e-15)  # ggml's "this group is all zero" threshold

# Types the gguf package quantizes bit-exactly with ggml (checked against ggml's own bytes). The
# package is imported at its first use: loading a model quantizes nothing with it.
_GGUF_QUANTIZE = frozenset({GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0, GType.BF16})
_GGUF_DEQUANTIZE = _GGUF_QUANTIZE | {GType.Q4_K, GType.Q5_K, GType.Q6_K}


def _gguf():
    """(the gguf package's quants module, its enum of ggml types)."""
    from gguf import GGMLQuantizationType, quants

    return quants, GGMLQuantizationType


# Blocks quantized per numpy pass by the K-quant code: bounds its temporaries (~50 MB).
_CHUNK_BLOCKS = 1024


# ---------------------------------------------------------------- public API

def quantize(array: np.ndarray, gtype: GType, name: str = "tensor") -> np.ndarray:
    """The GGUF/ggml bytes of `array` stored as `gtype`.

    Rows are along the last axis; its length must be a whole number of blocks. Returns uint8 of
    shape (*array.shape[:-1], bytes per row). Float inputs are first rounded to float32, as
    ggml's from_float functions take float32.
    """
    gtype = GType.parse(gtype)
    arr = np.asarray(array)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    row_bytes = gtype.row_size(arr.shape[-1], what=f"quantize {name!r} to {gtype.name}")
    out_shape = (*arr.shape[:-1], row_bytes)

    if gtype in (GType.I32, GType.I64):
        out = np.ascontiguousarray(arr.astype(gtype.block_dtype))
        return out.view(np.uint8).reshape(out_shape)

    x = np.ascontiguousarray(arr, dtype=_f32)
    if gtype == GType.F32:
        return x.view(np.uint8).reshape(out_shape)
    if gtype == GType.F16:
        return fp32_to_fp16(x).view(np.uint8).reshape(out_shape)
    if gtype in _GGUF_QUANTIZE:
        gguf_quants, ggml_type = _gguf()
        return gguf_quants.quantize(x, ggml_type[gtype.name]).reshape(out_shape)

    blocks = x.reshape(-1, gtype.block_size)
    out = np.empty((blocks.shape[0], gtype.type_size), dtype=np.uint8)
    quantize_blocks = _QUANTIZERS[gtype]
    # C float semantics: inf/NaN propagate silently, division by zero is guarded like ggml does.
    with np.errstate(all="ignore"):
        for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            stop = start + _CHUNK_BLOCKS
            out[start:stop] = quantize_blocks(blocks[start:stop]).view(np.uint8).reshape(-1, gtype.type_size)
    return out.reshape(out_shape)


def dequantize(data: np.ndarray | bytes, gtype: GType, n: int) -> np.ndarray:
    """float32 values of the first `n` values stored in `data` (GGUF/ggml bytes of `gtype`).

    `n` must be a whole number of blocks and `data` must hold at least their bytes.
    """
    gtype = GType.parse(gtype)
    if n < 0:
        raise GGXShapeError(f"dequantize {gtype.name}: negative value count {n}")
    need = gtype.row_size(n, what=f"dequantize {gtype.name}")
    raw = _as_bytes(data)
    if raw.size < need:
        raise GGXShapeError(
            f"dequantize {gtype.name}: {n} values need {need} bytes, data has only {raw.size}")
    raw = raw[:need]

    if gtype == GType.F32:
        return raw.view("<f4").copy()
    if gtype == GType.F16:
        return raw.view("<f2").astype(_f32)
    if gtype in (GType.I32, GType.I64):
        return raw.view(gtype.block_dtype).astype(_f32)
    if n == 0:
        return np.empty(0, dtype=_f32)
    if gtype in _GGUF_DEQUANTIZE:
        gguf_quants, ggml_type = _gguf()
        return gguf_quants.dequantize(raw.reshape(1, need), ggml_type[gtype.name]).reshape(n)
    if gtype in (GType.Q8_1, GType.Q8_K):
        # ggml: y = d * q, float32 (Q8_1's s is only used by dot products)
        blocks = raw.view(gtype.block_dtype)
        d = blocks["d"].astype(_f32)[:, None]
        return (d * blocks["qs"].astype(_f32)).reshape(n)
    raise AssertionError(f"no dequantizer for {gtype.name}")  # every GType is covered above


# ---------------------------------------------------------------- ggml's scalar helpers

def nearest_int(fval: np.ndarray) -> np.ndarray:
    """ggml's `nearest_int`: round float32 to int32 with the magic-number trick.

    Adding 1.5 * 2**23 in float32 leaves the integer in the low mantissa bits, which rounds
    half to even (not half away from zero); valid for |fval| <= 2**22 like ggml's.
    """
    val = np.asarray(fval, dtype=_f32) + _f32(12582912.0)
    return (val.view(np.int32) & 0x007FFFFF) - 0x00400000


def fp32_to_fp16(x: np.ndarray) -> np.ndarray:
    """ggml's GGML_FP32_TO_FP16 as float16: round to nearest even, overflow to inf, subnormals kept.

    NaN becomes the canonical quiet NaN with its sign (0x7E00 / 0xFE00), as ggml's portable
    conversion does; numpy alone would keep the payload bits.
    """
    x = np.asarray(x, dtype=_f32)
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    nan = np.isnan(x)
    if nan.any():
        bits = h.view(np.uint16)
        bits[nan] = np.where(np.signbit(x[nan]), 0xFE00, 0x7E00).astype(np.uint16)
    return h


def _as_bytes(data: np.ndarray | bytes) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def _seq_sum(terms: np.ndarray, start_zero: bool = True) -> np.ndarray:
    """Sum over the last axis one term after another, as a C `for` loop does in float32.

    numpy's own sum is pairwise, which rounds differently. `start_zero` mirrors `float s = 0;`;
    without it the sum starts from the first term (ggml's `float s = x[0];` loops).
    """
    acc = terms[..., 0].copy()
    if start_zero:
        acc += _f32(0.0)  # 0.0f + -0.0f is +0.0f in C too
    for i in range(1, terms.shape[-1]):
        acc += terms[..., i]
    return acc


def _first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(amax, max): the largest |x| along the last axis and the signed value where it first occurs.

    Mirrors ggml's `if (ax > amax) { amax = ax; max = x[i]; }` scan (first occurrence wins).
    """
    ax = np.abs(x)
    idx = ax.argmax(axis=-1)[..., None]
    return np.take_along_axis(ax, idx, -1)[..., 0], np.take_along_axis(x, idx, -1)[..., 0]


# ---------------------------------------------------------------- Q8_1, Q8_K

def _quantize_q8_1(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_1_ref: d = amax/127, q = roundf(x/d) (half away from zero), s = sum(q)*d."""
    amax = np.abs(x).max(axis=1)
    d = amax / _f32(127)
    inv_d = np.where(d != 0, _f32(1) / d, _f32(0))
    v = (x * inv_d[:, None]).astype(np.float64)  # exact; float64 makes roundf's +0.5 exact too
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)
    out = np.empty(x.shape[0], dtype=GType.Q8_1.block_dtype)
    out["d"] = fp32_to_fp16(d)
    out["s"] = fp32_to_fp16(q.sum(axis=1, dtype=np.int32).astype(_f32) * d)
    out["qs"] = q
    return out


def _quantize_q8_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref: iscale = -127/max (max = signed value of largest |x|)."""
    amax, vmax = _first_absmax(x)
    zero = amax == 0
    iscale = _f32(-127) / np.where(zero, _f32(1), vmax)
    q = np.minimum(127, nearest_int(iscale[:, None] * x)).astype(np.int8)
    q[zero] = 0
    out = np.empty(x.shape[0], dtype=GType.Q8_K.block_dtype)
    out["d"] = np.where(zero, _f32(0), _f32(1) / iscale)
    out["qs"] = q
    # ggml leaves bsums of an all-zero block unwritten; here they are the (zero) sums.
    out["bsums"] = q.reshape(-1, QK_K // 16, 16).sum(axis=2, dtype=np.int32).astype(np.int16)
    return out


# ---------------------------------------------------------------- Q4_K

def _make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                      nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants (use_mad=false) for each row of x: (L uint8, scale, the_min).

    Fits x ~ scale * L - the_min with L in [0, nmax] under weights w, trying nstep+1 scales.
    The trials run one after another, as in C: an accepted trial moves `min`, which the later
    trials start from.
    """
    xmax = x.max(axis=1)
    vmin = x.min(axis=1)
    vmin = np.where(vmin > 0, _f32(0), vmin)  # `if (min > 0) min = 0;`
    flat = xmax == vmin  # C returns early: L = 0, scale 0
    sum_w = _seq_sum(w, start_zero=False)
    sum_x = _seq_sum(w * x, start_zero=False)

    iscale = _f32(nmax) / (xmax - vmin)
    scale = _f32(1) / iscale
    L = np.clip(nearest_int(iscale[:, None] * (x - vmin[:, None])), 0, nmax)
    diff = scale[:, None] * L.astype(_f32) + vmin[:, None] - x
    best_error = _seq_sum(w * (diff * diff))

    for step in range(nstep + 1):
        iscale = (_f32(rmin) + _f32(rdelta) * _f32(step) + _f32(nmax)) / (xmax - vmin)
        laux = np.clip(nearest_int(iscale[:, None] * (x - vmin[:, None])), 0, nmax)
        la = laux.astype(_f32)
        wl = w * la
        sum_l = _seq_sum(wl)
        sum_l2 = _seq_sum(wl * la)
        sum_xl = _seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        clamp = this_min > 0
        this_min = np.where(clamp, _f32(0), this_min)
        this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
        diff = this_scale[:, None] * la + this_min[:, None] - x
        cur_error = _seq_sum(w * (diff * diff))
        better = (D > 0) & (cur_error < best_error) & ~flat
        L[better] = laux[better]
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale)
        vmin = np.where(better, this_min, vmin)
    L[flat] = 0
    return L.astype(np.uint8), np.where(flat, _f32(0), scale), -vmin


def _k_scales_mins(x: np.ndarray, nmax: int, rmin: float, rdelta: float,
                   nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The common part of quantize_row_q4_K_ref / quantize_row_q5_K_ref: 8 sub-blocks of 32, each
    fitted with make_qkx2_quants (levels 0..nmax), their scales and mins as 6-bit values under an
    f16 super-block d / dmin. Returns (d16, dmin16, packed 12 scale bytes, levels [nb, 8, 32])."""
    nb = x.shape[0]
    xs = x.reshape(nb * 8, 32)
    av_x = np.sqrt(_seq_sum(xs * xs) / _f32(32))
    weights = av_x[:, None] + np.abs(xs)
    L, scales, mins = _make_qkx2_quants(xs, weights, nmax=nmax, rmin=rmin, rdelta=rdelta, nstep=nstep)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)

    max_scale = np.maximum(scales.max(axis=1), _f32(0))
    max_min = np.maximum(mins.max(axis=1), _f32(0))
    inv_scale = np.where(max_scale > 0, _f32(63) / max_scale, _f32(0))
    inv_min = np.where(max_min > 0, _f32(63) / max_min, _f32(0))
    # `uint8_t ls = nearest_int(...)` wraps modulo 256 before MIN(63, ls)
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)

    packed = np.empty((nb, 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)

    d16 = fp32_to_fp16(max_scale / _f32(63))
    dmin16 = fp32_to_fp16(max_min / _f32(63))
    # Requantize with the scales as stored; a sub-block whose scale is 0 keeps its first L.
    d = d16.astype(_f32)[:, None] * ls.astype(_f32)
    dm = dmin16.astype(_f32)[:, None] * lm.astype(_f32)
    xb = x.reshape(nb, 8, 32)
    safe_d = np.where(d != 0, d, _f32(1))
    lq = np.clip(nearest_int((xb + dm[:, :, None]) / safe_d[:, :, None]), 0, nmax).astype(np.uint8)
    L = np.where((d != 0)[:, :, None], lq, L.reshape(nb, 8, 32))
    return d16, dmin16, packed, L


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: 8 sub-blocks of 32, each with a 6-bit scale and min."""
    nb = x.shape[0]
    d16, dmin16, packed, L = _k_scales_mins(x, nmax=15, rmin=-1.0, rdelta=0.1, nstep=20)
    L = L.reshape(nb, 4, 2, 32)  # 64-value groups: the first 32 in low nibbles, next 32 high
    out = np.empty(nb, dtype=GType.Q4_K.block_dtype)
    out["d"] = d16
    out["dmin"] = dmin16
    out["scales"] = packed
    out["qs"] = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(nb, 128)
    return out


# ---------------------------------------------------------------- Q5_K

def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref: Q4_K's scales and mins with 5-bit levels (0..31); the low nibbles
    packed as Q4_K's, the fifth bit of value l of sub-block s in bit s of qh[l]."""
    nb = x.shape[0]
    d16, dmin16, packed, L = _k_scales_mins(x, nmax=31, rmin=-0.5, rdelta=0.1, nstep=15)
    lo = (L & 0xF).reshape(nb, 4, 2, 32)
    hi = (L >> 4).astype(np.uint8)  # [nb, 8, 32]
    out = np.empty(nb, dtype=GType.Q5_K.block_dtype)
    out["d"] = d16
    out["dmin"] = dmin16
    out["scales"] = packed
    out["qh"] = np.bitwise_or.reduce(hi << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    out["qs"] = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)
    return out


# ---------------------------------------------------------------- Q6_K

def _make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL) per row: (L in [0, 2*nmax), scale).

    Symmetric fit x ~ scale * (L - nmax) weighted by x^2, trying 18 scales around -nmax/max.
    """
    amax, vmax = _first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    vmax = np.where(zero, _f32(1), vmax)
    w = (x * x)[:, None, :]
    wx = w * x[:, None, :]

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Levels, sum(w*x*l) and sum(w*l*l) for each trial inverse scale iscale[row, trial]."""
        lvl = np.clip(nearest_int(iscale[:, :, None] * x[:, None, :]), -nmax, nmax - 1)
        lf = lvl.astype(_f32)
        return lvl, _seq_sum(wx * lf), _seq_sum(w * lf * lf)

    lvl, sumlx, suml2 = fit((_f32(-nmax) / vmax)[:, None])
    L, sumlx, suml2 = lvl[:, 0] + nmax, sumlx[:, 0], suml2[:, 0]
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, _f32(1)), _f32(0))
    best = scale * sumlx

    steps = np.array([s for s in range(-9, 10) if s != 0], dtype=_f32)
    lvls, sumlxs, suml2s = fit(-(_f32(nmax) + _f32(0.1) * steps)[None, :] / vmax[:, None])
    for k in range(len(steps)):  # accepted in order: each must beat the best so far
        slx, sl2 = sumlxs[:, k], suml2s[:, k]
        better = (sl2 > 0) & (slx * slx > best * sl2)
        L[better] = lvls[better, k] + nmax
        scale = np.where(better, slx / np.where(better, sl2, _f32(1)), scale)
        best = np.where(better, scale * slx, best)
    L[zero] = 0
    return L, np.where(zero, _f32(0), scale)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: 16 sub-blocks of 16 values, 8-bit scales, 6-bit quants."""
    nb = x.shape[0]
    L, scales = _make_qx_quants_rmse1(x.reshape(nb * 16, 16), nmax=32)
    L = L.reshape(nb, 16, 16)
    scales = scales.reshape(nb, 16)

    max_abs_scale, max_scale = _first_absmax(scales)
    zero = max_abs_scale < GROUP_MAX_EPS
    iscale = _f32(-128) / np.where(zero, _f32(1), max_scale)
    d16 = fp32_to_fp16(_f32(1) / iscale)
    sc = np.minimum(127, nearest_int(iscale[:, None] * scales)).astype(np.int8)

    # Requantize with the scales as stored; a sub-block whose scale is 0 keeps its first L.
    d = d16.astype(_f32)[:, None] * sc.astype(_f32)
    xb = x.reshape(nb, 16, 16)
    safe_d = np.where(d != 0, d, _f32(1))
    lq = np.clip(nearest_int(xb / safe_d[:, :, None]), -32, 31) + 32
    L = np.where((d != 0)[:, :, None], lq, L).astype(np.uint8)

    # 128-value halves; in each, 4 groups of 32 values: q1..q4 in ggml's dequantize_row_q6_K.
    q = L.reshape(nb, 2, 4, 32)
    lo, hi = q & 0xF, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)

    out = np.zeros(nb, dtype=GType.Q6_K.block_dtype)
    keep = ~zero  # an all-zero block is all zero bytes
    out["ql"][keep] = ql.reshape(nb, 128)[keep]
    out["qh"][keep] = qh.reshape(nb, 64)[keep]
    out["scales"][keep] = sc[keep]
    out["d"][keep] = d16[keep]
    return out


_QUANTIZERS = {
    GType.Q8_1: _quantize_q8_1,
    GType.Q8_K: _quantize_q8_k,
    GType.Q4_K: _quantize_q4_k,
    GType.Q5_K: _quantize_q5_k,
    GType.Q6_K: _quantize_q6_k,
}
