"""Activation quantization for mul_mat: F32 rows -> Q8_0 / Q8_1 / Q8_K, once per call.

Values are those of ggml's x86 `quantize_row_q8_0` / `quantize_row_q8_1` (AVX2 path: q =
round-half-even(x * 127 / amax), d and s stored as f16) and `quantize_row_q8_K_ref`
(iscale = -127 / max, d = 1 / iscale, f32). The layout is a structure of arrays, not ggml's
interleaved blocks, so that kernels load each part as a vector (see `Q8Act`). `to_blocks`
gives ggml's block bytes for checking.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ggx.errors import GGXShapeError
from ggx.types import GType

from ..launch import split
from .common import Launch, launch, split_parts
from .convert import f16_to_f32, f32_to_f16

# Rows per parallel chunk: below this many values a serial call beats waking the threads.
_PARALLEL_MIN_VALUES = 1 << 16


class Q8Act(NamedTuple):
    """Quantized activations, N rows of K values, all arrays flat and C-contiguous.

    qs: int8[N*K] values. d: float32 scale per block (32 values; 256 for Q8_K), f16-rounded for
    Q8_0/Q8_1. s: float32 per block, Q8_1's f16 d*sum(qs) (Q8_0: the same, unused by kernels).
    s4: int32 sums of 4 consecutive values (Q8_0/Q8_1), or Q8_K's bsums (sums of 16) as int32.
    """

    gtype: GType
    qs: np.ndarray
    d: np.ndarray
    s: np.ndarray
    s4: np.ndarray


@njit(cache=True)
def _q8_rows_unrounded(x, qs, d, s, s4, r0, r1):
    """Q8_0/Q8_1 of rows r0..r1 of x (float32 [N, K]); d and s unrounded (f16 is done after)."""
    K = x.shape[1]
    nb = K // 32
    for r in range(r0, r1):
        for b in range(nb):
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(x[r, b * 32 + j]))
            db = amax / np.float32(127.0)
            idb = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            o = r * K + b * 32
            total = 0
            for j in range(32):
                q = np.int32(np.rint(x[r, b * 32 + j] * idb))
                qs[o + j] = q
                total += q
            for g in range(8):
                s4[o // 4 + g] = np.int32(qs[o + 4 * g]) + qs[o + 4 * g + 1] + qs[o + 4 * g + 2] + qs[o + 4 * g + 3]
            d[o // 32] = db
            s[o // 32] = db * np.float32(total)


@njit(cache=True)
def quantize_rows_q8(x, qs, d, s, s4, r0, r1):
    """Q8_0 and Q8_1 (ggml's x86 quantize_row_q8_0 / _q8_1) of rows r0..r1 of x, float32 [N, K]
    with K a multiple of 32, into the structure of arrays of `Q8Act` (arrays of N * K values,
    row r's block b at index r * K / 32 + b): qs int8 values, d the f16-rounded scale, s the
    f16-rounded Q8_1 d * sum(qs), s4 int32 sums of 4 consecutive values. Callable from
    kernels: rows r0..r1 only, so a parallel kernel can quantize its own chunk."""
    _q8_rows_unrounded(x, qs, d, s, s4, r0, r1)
    nb = x.shape[1] // 32
    for i in range(r0 * nb, r1 * nb):
        d[i] = f16_to_f32(f32_to_f16(d[i]))
        s[i] = f16_to_f32(f32_to_f16(s[i]))


@njit(cache=True)
def q8_part(part, parts, x, qs, d, s, s4):
    """`quantize_rows_q8` as a split kernel: part p quantizes its share of x's rows."""
    n = x.shape[0]
    if 0 <= part < parts:
        quantize_rows_q8(x, qs, d, s, s4, part * n // parts, (part + 1) * n // parts)


@njit(cache=True)
def quantize_rows_q8_K(x, qs, d, bsums, r0, r1):
    """Q8_K (ggml's quantize_row_q8_K_ref: the value of largest |x| maps to -127) of rows r0..r1
    of x, float32 [N, K] with K a multiple of 256, into the arrays of `Q8Act`: qs int8 values,
    d float32 scale per 256 values (row r's block b at r * K / 256 + b), bsums int32 sums of
    16 consecutive values. Callable from kernels, like `quantize_rows_q8`."""
    K = x.shape[1]
    nb = K // 256
    for r in range(r0, r1):
        for b in range(nb):
            o = r * K + b * 256
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for j in range(256):
                v = x[r, b * 256 + j]
                if abs(v) > amax:
                    amax = abs(v)
                    vmax = v
            if amax == 0:
                d[o // 256] = 0.0
                for j in range(256):
                    qs[o + j] = 0
            else:
                iscale = np.float32(-127.0) / vmax
                for j in range(256):
                    qs[o + j] = min(127, np.int32(np.rint(iscale * x[r, b * 256 + j])))
                d[o // 256] = np.float32(1.0) / iscale
            for g in range(16):
                t = 0
                for j in range(16):
                    t += qs[o + 16 * g + j]
                bsums[o // 16 + g] = t


@njit(cache=True)
def q8k_part(part, parts, x, qs, d, bsums):
    """`quantize_rows_q8_K` as a split kernel."""
    n = x.shape[0]
    if 0 <= part < parts:
        quantize_rows_q8_K(x, qs, d, bsums, part * n // parts, (part + 1) * n // parts)


def _rows(x: np.ndarray, block: int, what: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % block:
        raise GGXShapeError(f"{what}: rows of {x.shape[-1]} values are not a multiple of {block}")
    return x


def act_launch(x: np.ndarray, gtype: GType, n_threads: int = 1) -> tuple[Q8Act, Launch]:
    """Arrays for the quantized activations of float32 rows x [N, K] (Q8_0, Q8_1 or Q8_K) and
    the launch that fills them from x's values at the time it runs (so x must be x itself, not
    a copy: C-contiguous float32)."""
    if gtype not in (GType.Q8_0, GType.Q8_1, GType.Q8_K):
        raise GGXShapeError(f"no activation quantizer for {gtype.name}")
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous or x.shape[1] % gtype.block_size:
        raise GGXShapeError(f"{gtype.name}: activations must be C-contiguous float32 rows of a multiple of "
                            f"{gtype.block_size} values, got {x.dtype} {x.shape}")
    n, k = x.shape
    parallel = x.size >= _PARALLEL_MIN_VALUES and n_threads > 1 and n > 1
    qs = np.empty(n * k, np.int8)
    d = np.empty(n * k // gtype.block_size, np.float32)
    if gtype is GType.Q8_K:
        bsums = np.empty(n * k // 16, np.int32)
        act = Q8Act(gtype, qs, d, d, bsums)
        if parallel:
            return act, split(q8k_part, x, qs, d, bsums, parts=split_parts(n_threads, n))
        return act, launch(quantize_rows_q8_K, x, qs, d, bsums, 0, n)
    act = Q8Act(gtype, qs, d, np.empty_like(d), np.empty(n * k // 4, np.int32))
    if parallel:
        return act, split(q8_part, x, qs, d, act.s, act.s4, parts=split_parts(n_threads, n))
    return act, launch(quantize_rows_q8, x, qs, d, act.s, act.s4, 0, n)


def quantize_q8(x: np.ndarray, gtype: GType = GType.Q8_0, n_threads: int = 1) -> Q8Act:
    """Q8_0 or Q8_1 of float32 rows x [N, K] (K a multiple of 32)."""
    if gtype is GType.Q8_K:
        raise GGXShapeError("quantize_q8 makes Q8_0 or Q8_1; Q8_K is quantize_q8_K")
    act, run = act_launch(_rows(x, gtype.block_size, gtype.name), gtype, n_threads)
    run()
    return act


def quantize_q8_0(x: np.ndarray, n_threads: int = 1) -> Q8Act:
    return quantize_q8(x, GType.Q8_0, n_threads)


def quantize_q8_1(x: np.ndarray, n_threads: int = 1) -> Q8Act:
    return quantize_q8(x, GType.Q8_1, n_threads)


def quantize_q8_K(x: np.ndarray, n_threads: int = 1) -> Q8Act:
    """Q8_K of float32 rows x [N, K] (K a multiple of 256); s4 holds the bsums."""
    return quantize_act(x, GType.Q8_K, n_threads)


def quantize_act(x: np.ndarray, gtype: GType, n_threads: int = 1) -> Q8Act:
    """Quantize float32 rows to a weight type's vec_dot_type (Q8_0, Q8_1 or Q8_K)."""
    act, run = act_launch(_rows(x, gtype.block_size, gtype.name), gtype, n_threads)
    run()
    return act


def to_blocks(act: Q8Act) -> np.ndarray:
    """ggml's block bytes (uint8) of quantized activations, for comparison with ggml/gguf."""
    t = act.gtype
    nblk = act.d.size
    out = np.zeros(nblk, t.block_dtype)
    out["qs"] = act.qs.reshape(nblk, -1)
    if t is GType.Q8_K:
        out["d"] = act.d
        out["bsums"] = act.s4.reshape(nblk, 16).astype(np.int16)
    else:
        out["d"] = act.d.astype(np.float16)
        if t is GType.Q8_1:
            out["s"] = act.s.astype(np.float16)
    return out.view(np.uint8)
