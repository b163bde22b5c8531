"""FLASH_ATTN_EXT: fused softmax(scale * Q K^T + slope * mask) V with an online softmax, GQA,
F16 or F32 K/V, optional F16 mask, ALiBi and logit soft-capping, ggml's semantics.

q [D, T, H, B] F32, k [D, KV, Hk, Bk], v [Dv, KV, Hk, Bk], mask F16 [KV, >=T, m2, m3].
The result is permuted: out [Dv, H, T, B] (out[:, h, t, b]). Query head h reads kv head
h // (H / Hk). Keys whose mask value is -inf are skipped.

Precision follows ggml's CPU kernel for the shape: with T < 64 ("one_chunk") Q is rounded to F16
when K is F16 (the dot is F16 x F16) and the V accumulator is an F16 buffer when V is F16; with
T >= 64 ("tiled") everything stays F32. One prange over the T*H*B query rows.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ggx.errors import GGXShapeError
from ggx.tensor import Tensor
from ggx.types import GType

from .common import Launch, elems, launch, need_ne, need_rows, need_srcs, need_type
from .convert import as_f32, f16_to_f32, f32_to_f16
from .softmax import alibi_slopes

TILED_MIN_TOKENS = 64  # ggml switches to its F32 tiled kernel from this many query rows


@njit(cache=True, inline="always")
def _h(x):
    """Round a float32 through F16 (what storing into an F16 buffer does)."""
    return f16_to_f32(f32_to_f16(x))


@njit(cache=True, fastmath={"reassoc", "contract"})
def _dot(q, k):
    """sum q[i] * k[i] in float32, reassociated so that LLVM vectorizes it (ggml's dot is SIMD
    ordered too); no nnan/ninf flags, so infinities keep their meaning."""
    s = np.float32(0.0)
    for i in range(q.size):
        s += q[i] * as_f32(k[i])
    return s


@njit(cache=True, parallel=True)
def flash_attn_kernel(scale, softcap, slopes, q_f16, acc_f16,
                      q, qo, qs, qne, k, ko, ks, kne, v, vo, vs_, vne,
                      has_mask, m, mo, ms, mne, d, do, ds):
    """q, k, v rows are contiguous (checked): they are read as unit-stride slices, which vectorize."""
    D, T, H = qne[0], qne[1], qne[2]
    KV, Dv = kne[1], vne[0]
    rk2 = H // kne[2]
    rk3 = qne[3] // kne[3]
    for r in prange(T * H * qne[3]):
        t, h, b = r % T, (r // T) % H, r // (T * H)
        ik2, ik3 = h // rk2, b // rk3
        qb = qo + t * qs[1] + h * qs[2] + b * qs[3]
        qrow = q[qb: qb + D]
        qv = np.empty(D, np.float32)
        for i in range(D):
            qv[i] = _h(qrow[i]) if q_f16 else qrow[i]
        acc = np.zeros(Dv, np.float32)
        mb = mo + t * ms[1] + (h % mne[2]) * ms[2] + (b % mne[3]) * ms[3]
        slope = slopes[h]
        S = np.float32(0.0)
        M = np.float32(-np.inf)
        for ic in range(KV):
            mv = slope * as_f32(m[mb + ic * ms[0]]) if has_mask else np.float32(0.0)
            if mv == -np.inf:
                continue
            kb = ko + ic * ks[1] + ik2 * ks[2] + ik3 * ks[3]
            s = _dot(qv, k[kb: kb + D]) * scale
            if softcap != 0:
                s = softcap * np.float32(math.tanh(s))
            s += mv
            ms_ = np.float32(1.0)
            vs = np.float32(1.0)
            if s > M:
                Mold = M
                M = s
                ms_ = np.float32(math.exp(Mold - M))
                if acc_f16:
                    for i in range(Dv):
                        acc[i] = _h(acc[i] * ms_)
                else:
                    for i in range(Dv):
                        acc[i] *= ms_
            else:
                vs = np.float32(math.exp(s - M))
            vb = vo + ic * vs_[1] + ik2 * vs_[2] + ik3 * vs_[3]
            vrow = v[vb: vb + Dv]
            if acc_f16:
                for i in range(Dv):
                    acc[i] = _h(acc[i] + as_f32(vrow[i]) * vs)
            else:
                for i in range(Dv):
                    acc[i] += as_f32(vrow[i]) * vs
            S = S * ms_ + vs
        inv = np.float32(0.0) if S == 0 else np.float32(1.0) / S
        db = do + h * ds[1] + t * ds[2] + b * ds[3]
        for i in range(Dv):
            d[db + i * ds[0]] = acc[i] * inv


_NO_MASK = np.zeros(1, np.uint16)


def flash_attn_ext(node: Tensor, n_threads: int) -> Launch:
    op = "FLASH_ATTN_EXT"
    need_srcs(node, 3)
    q, k, v = node.src[:3]
    mask = node.src[3] if len(node.src) > 3 else None
    p = node.params
    need_type(q, "q", op, GType.F32)
    need_type(k, "k", op, GType.F16, GType.F32)
    need_type(v, "v", op, GType.F16, GType.F32)
    need_type(node, "dst", op, GType.F32)
    for role, t in (("q", q), ("k", k), ("v", v)):
        need_rows(t, role, op)
    if k.ne[0] != q.ne[0] or k.ne[1] != v.ne[1] or k.ne[2] != v.ne[2] or k.ne[3] != v.ne[3]:
        raise GGXShapeError(f"{op}: q {q.describe()}, k {k.describe()}, v {v.describe()} do not match")
    if 0 in k.ne[2:] or q.ne[2] % k.ne[2] or q.ne[3] % k.ne[3]:
        raise GGXShapeError(f"{op}: kv heads of {k.describe()} do not divide the heads of q {q.describe()}")
    need_ne(node, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), "dst", op)
    qq, qo, qs, qne = elems(q, "q", op)
    kk, ko, ks, kne = elems(k, "k", op)
    vv, vo, vs, vne = elems(v, "v", op)
    dd, do, ds, _ = elems(node, "dst", op)
    if mask is not None:
        need_type(mask, "mask", op, GType.F16)
        if mask.ne[0] != k.ne[1] or mask.ne[1] < q.ne[1] or 0 in mask.ne[2:]:
            raise GGXShapeError(f"{op}: mask {mask.describe()} must be [n_kv={k.ne[1]}, >={q.ne[1]}, ...]")
        m, mo, ms, mne = elems(mask, "mask", op)
    elif p.max_bias > 0:
        raise GGXShapeError(f"{op}: max_bias (ALiBi) needs a mask")
    else:
        m, mo, ms, mne = _NO_MASK, 0, (0, 0, 0, 0), (1, 1, 1, 1)
    one_chunk = q.ne[1] < TILED_MIN_TOKENS
    slopes = alibi_slopes(q.ne[2], p.max_bias)
    scale = np.float32(p.scale)
    if p.logit_softcap != 0:  # ggml: s = softcap * tanh(s * scale / softcap)
        scale = scale / np.float32(p.logit_softcap)
    return launch(flash_attn_kernel, scale, np.float32(p.logit_softcap), slopes,
                      one_chunk and k.type is GType.F16, one_chunk and v.type is GType.F16,
                      qq, qo, qs, qne, kk, ko, ks, kne, vv, vo, vs, vne,
                      mask is not None, m, mo, ms, mne, dd, do, ds, n_threads=n_threads)
