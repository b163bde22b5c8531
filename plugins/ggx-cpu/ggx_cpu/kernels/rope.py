"""ROPE (modes NORMAL and NEOX) with ggml's YaRN parameters, F32.

a is [head_dim, n_head, n_tokens, ne3], pos I32 [n_tokens]. For token t, pair i (0 <= 2i < n_dims)
rotates by theta = pos[t] * freq_base^(-2i/n_dims), computed as ggml does: theta_scale =
freq_base^(-2/n_dims) in float32 and theta multiplied by it pair after pair; YaRN mixes the
interpolated (freq_scale * theta) and extrapolated angles with a ramp over the correction dims
when ext_factor != 0. With frequency factors (ff F32, the op's third source, ggml_rope_ext's c)
pair i's angle is theta / ff[i] before YaRN mixes it (ggml_rope_cache_init); without, every
factor is 1 (a division by 1 changes no float). NORMAL rotates (x[2i], x[2i+1]); NEOX rotates
(x[i], x[i + n_dims/2]); values at and past n_dims are copied.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit

from ggx.errors import GGXShapeError
from ggx.ops import RopeMode
from ggx.tensor import Tensor
from ggx.types import GType

from .common import Launch, elems, need_ne, need_rows, need_srcs, need_type, rows_launch


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims (float32 like ggml); only used when ext_factor != 0."""
    f32 = np.float32

    def corr_dim(n_rot: float) -> float:
        with np.errstate(divide="ignore"):
            ratio = f32(n_ctx_orig) / (f32(n_rot) * f32(2 * math.pi))
            return float(f32(n_dims) * np.log(ratio) / (f32(2) * np.log(f32(freq_base))))

    start, end = corr_dim(beta_fast), corr_dim(beta_slow)
    start = math.floor(start) if math.isfinite(start) else start
    end = math.ceil(end) if math.isfinite(end) else end
    return max(0.0, start), min(n_dims - 1.0, end)


@njit(cache=True)
def rope_rows(r0, r1, neox, n_dims, theta_scale, freq_scale, ext_factor, attn_factor, corr0, corr1,
              x, xo, xs, ne, pos, po, ps, ff, fo, y, yo, ys):
    n0, n1, n2 = ne[0], ne[1], ne[2]
    half = n_dims // 2
    # rows of one position (the heads of a token) share their cos/sin (ggml's rope cache)
    cos_k = np.empty(half, np.float32)
    sin_k = np.empty(half, np.float32)
    cached = -1
    for r in range(r0, r1):
        i1, i2, i3 = r % n1, (r // n1) % n2, r // (n1 * n2)
        xb = xo + i1 * xs[1] + i2 * xs[2] + i3 * xs[3]
        yb = yo + i1 * ys[1] + i2 * ys[2] + i3 * ys[3]
        p = pos[po + i2 * ps[0]]
        if cached < 0 or p != pos[po + cached * ps[0]]:
            cached = i2
            theta_base = np.float32(p)
            for k in range(half):  # pair k uses theta_base * theta_scale^k / ff[k]
                theta_extrap = theta_base / ff[fo + k]
                theta_interp = freq_scale * theta_extrap
                theta = theta_interp
                mscale = attn_factor
                if ext_factor != 0:
                    yr = (np.float32(k) - corr0) / max(np.float32(0.001), corr1 - corr0)
                    ramp = (np.float32(1.0) - min(np.float32(1.0), max(np.float32(0.0), yr))) * ext_factor
                    theta = theta_interp * (np.float32(1.0) - ramp) + theta_extrap * ramp
                    mscale *= np.float32(1.0) + np.float32(0.1) * np.float32(math.log(1.0 / freq_scale))
                cos_k[k] = np.float32(math.cos(theta)) * mscale
                sin_k[k] = np.float32(math.sin(theta)) * mscale
                theta_base *= theta_scale
        for k in range(half):
            c = cos_k[k]
            s = sin_k[k]
            if neox:
                j0, j1 = k, k + half
            else:
                j0, j1 = 2 * k, 2 * k + 1
            x0 = x[xb + j0 * xs[0]]
            x1 = x[xb + j1 * xs[0]]
            y[yb + j0 * ys[0]] = x0 * c - x1 * s
            y[yb + j1 * ys[0]] = x0 * s + x1 * c
        for i in range(n_dims, n0):
            y[yb + i * ys[0]] = x[xb + i * xs[0]]


@functools.lru_cache(maxsize=64)
def _rope_constants(n_dims: int, freq_base: float, n_ctx_orig: int, beta_fast: float,
                    beta_slow: float) -> tuple[np.float32, np.float32, np.float32]:
    """(theta_scale, corr0, corr1) in float32: numpy scalar math, worth computing once per model."""
    theta_scale = np.float32(np.float32(freq_base) ** np.float32(-2.0 / n_dims))
    c0, c1 = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    return theta_scale, np.float32(c0), np.float32(c1)


@functools.lru_cache(maxsize=16)
def _unit_factors(half: int) -> np.ndarray:
    """The factors of a ROPE without a third source: all 1, shared (never written; writeable, as
    buffer views are, so that numba compiles one signature for both)."""
    return np.ones(half, np.float32)


def rope(node: Tensor, n_threads: int) -> Launch:
    op = "ROPE"
    need_srcs(node, 2)
    a, pos = node.src[0], node.src[1]
    p = node.params
    need_type(a, "a", op, GType.F32)
    need_type(pos, "pos", op, GType.I32)
    need_type(node, "dst", op, GType.F32)
    need_ne(node, a.ne, "dst", op)
    need_rows(a, "a", op)
    if pos.ne[0] < a.ne[2]:
        raise GGXShapeError(f"ROPE: pos {pos.describe()} has fewer than a.ne2={a.ne[2]} positions")
    if p.n_dims <= 0 or p.n_dims % 2 or p.n_dims > a.ne[0]:
        raise GGXShapeError(f"ROPE: n_dims={p.n_dims} must be even, positive and at most ne0={a.ne[0]}")
    if p.mode not in (RopeMode.NORMAL, RopeMode.NEOX):
        raise GGXShapeError(f"ROPE: mode {p.mode} is not supported")
    x, xo, xs, ne = elems(a, "a", op)
    pp, po, ps, _ = elems(pos, "pos", op)
    y, yo, ys, _ = elems(node, "dst", op)
    if len(node.src) > 2:
        c = node.src[2]
        need_type(c, "freq_factors", op, GType.F32)
        if not c.is_contiguous() or c.ne[0] < p.n_dims // 2:
            raise GGXShapeError(f"ROPE: freq_factors {c.describe()} must be contiguous with at least "
                                f"n_dims/2={p.n_dims // 2} values in ne0")
        ff, fo, _, _ = elems(c, "freq_factors", op)
    else:
        ff, fo = _unit_factors(p.n_dims // 2), 0
    theta_scale, c0, c1 = _rope_constants(p.n_dims, p.freq_base, p.n_ctx_orig, p.beta_fast, p.beta_slow)
    f32 = np.float32
    return rows_launch(rope_rows, n_threads, ne, p.mode == RopeMode.NEOX, p.n_dims, theta_scale,
                       f32(p.freq_scale), f32(p.ext_factor), f32(p.attn_factor), c0, c1, x, xo, xs, ne, pp, po, ps,
                       ff, fo, y, yo, ys)
