"""One numpy function per op: ggml's semantics, computed exactly (float64) — the oracle.

Each function takes the node `dst` (its sources in `dst.src`, parameters in `dst.params`),
reads its inputs with `codec.decode` (values in numpy order: shape (ne3, ne2, ne1, ne0),
whatever the strides) and writes the result into dst's memory with `codec.store`.

Where ggml's CPU backend rounds for speed the reference does not: mul_mat keeps activations in
float64 (no vec_dot_type quantization), flash attention has no F16 rounding, GELU is computed
(not an F16 table). Where the rounding *is* the op (CPY/SET_ROWS into F16/BF16/quantized types)
the bytes are ggml's.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..errors import GGXShapeError
from ..host import tensor_array
from ..ops import GeluKind, GluKind, Op, RopeMode, SortOrder
from ..tensor import Tensor
from .codec import decode, decode_blocks, encode, store

# --- helpers ---------------------------------------------------------------------------------


def _check_ids(op: str, idx: np.ndarray, limit: int, what: str) -> None:
    """Data-dependent indices cannot be checked at build time: check them before indexing."""
    if idx.size and (idx.min() < 0 or idx.max() >= limit):
        bad = idx[(idx < 0) | (idx >= limit)][0]
        raise GGXShapeError(f"{op}: index {int(bad)} is out of range 0..{limit - 1} ({what})")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _silu(x: np.ndarray) -> np.ndarray:
    return x * _sigmoid(x)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """Exact tanh-GELU, with ggml's clamps: x <= -10 gives 0, x >= 10 gives x."""
    y = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, y))


_erf = np.frompyfunc(math.erf, 1, 1)


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def _gelu_quick(x: np.ndarray) -> np.ndarray:
    return x * _sigmoid(1.702 * x)


_GELU = {GeluKind.TANH: _gelu_tanh, GeluKind.ERF: _gelu_erf, GeluKind.QUICK: _gelu_quick}


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ALiBi slope per head (ggml): 1 when max_bias == 0; n_head_log2 = 2^floor(log2(n_head))."""
    if max_bias <= 0.0:
        return np.ones(n_head)
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-max_bias / 2.0 / n_head_log2)
    h = np.arange(n_head)
    return np.where(h < n_head_log2, m0 ** (h + 1), m1 ** (2 * (h - n_head_log2) + 1))


def _softmax_rows(x: np.ndarray) -> np.ndarray:
    """SOFT_MAX over the last axis as ggml computes it: exp(x - max) scaled by 1 / sum. A row that
    is all -inf (-inf - -inf), or holds +inf or NaN, is NaN throughout, as in ggml's
    ggml_compute_forward_soft_max_f32 (no guard there)."""
    m = np.max(x, axis=-1, keepdims=True, initial=-np.inf)
    e = np.exp(x - m)
    return e * (1.0 / np.sum(e, axis=-1, keepdims=True))


def _attention_weights(s: np.ndarray) -> np.ndarray:
    """Flash attention's softmax over the keys: keys at -inf are skipped, and a row with every key
    masked gives zeros (ggml's flash_attn_ext: S == 0 leaves the output 0, in every CPU path)."""
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    e = np.exp(s - np.where(m == -np.inf, 0.0, m))
    total = np.sum(e, axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total != 0)


def _broadcast_planes(x: np.ndarray, ne3: int, ne2: int) -> np.ndarray:
    """Repeat x (numpy (x3, x2, ...)) over dims 3 and 2 by index modulo, as ggml broadcasts."""
    return x[np.arange(ne3) % x.shape[0]][:, np.arange(ne2) % x.shape[1]]


# --- rows and copies ---------------------------------------------------------------------------


def get_rows(dst: Tensor) -> None:
    """out[:, i10, i11, i12] = a[:, ids[i10, i11, i12], i11, i12], converted to dst type."""
    a, ids = dst.src
    idx = decode(ids)[0]  # (ids.ne2, ids.ne1, ids.ne0)
    _check_ids("get_rows", idx, a.ne[1], f"rows of {a.describe()}")
    blocks = tensor_array(a)  # gather raw rows first: only the rows asked for are dequantized
    i12 = np.arange(idx.shape[0])[:, None, None] % a.ne[3]
    i11 = np.arange(idx.shape[1])[None, :, None] % a.ne[2]
    store(dst, decode_blocks(blocks[i12, i11, idx], a.type))


def set_rows(dst: Tensor) -> None:
    """dst[:, ids[i01, i02 % ne11, i03 % ne12], i02, i03] = convert(src[:, i01, i02, i03]); others kept."""
    target, src, ids = dst.src
    idx = decode(ids)[0]  # (ids.ne2, ids.ne1, ids.ne0)
    _check_ids("set_rows", idx, dst.ne[1], f"rows of {target.describe()}")
    rows = encode(decode(src), dst.type)  # (s3, s2, s1, blocks): exactly ggml's from_float bytes
    out = tensor_array(dst)
    s3, s2, s1 = rows.shape[:3]
    for i3 in range(s3):
        for i2 in range(s2):
            plane = idx[i3 % idx.shape[0], i2 % idx.shape[1]]
            for i1 in range(s1):  # in order, so a repeated id keeps the last row, as in ggml
                out[i3, i2, plane[i1]] = rows[i3, i2, i1]


def _copy(src: Tensor, dst: Tensor) -> None:
    """Element i (in ne order) of src becomes element i of dst, converted to dst's type."""
    out = tensor_array(dst)
    if src.type is dst.type:  # same type: move the bytes (exact for quantized blocks too)
        out[...] = np.reshape(tensor_array(src), out.shape)
    else:
        store(dst, decode(src))


def cpy(dst: Tensor) -> None:
    _copy(dst.src[0], dst)


def dup(dst: Tensor) -> None:
    _copy(dst.src[0], dst)


def cont(dst: Tensor) -> None:
    _copy(dst.src[0], dst)


# --- elementwise -------------------------------------------------------------------------------


def _binary(dst: Tensor, fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
    a, b = dst.src
    av, bv = decode(a), decode(b)
    reps = tuple(x // y for x, y in zip(av.shape, bv.shape))  # b.ne[i] divides a.ne[i]
    store(dst, fn(av, np.tile(bv, reps)))


def add(dst: Tensor) -> None:
    _binary(dst, np.add)


def mul(dst: Tensor) -> None:
    _binary(dst, np.multiply)


def scale(dst: Tensor) -> None:
    p = dst.params
    store(dst, decode(dst.src[0]) * p.s + p.b)


def silu(dst: Tensor) -> None:
    store(dst, _silu(decode(dst.src[0])))


def gelu(dst: Tensor) -> None:
    store(dst, _GELU[dst.params.kind](decode(dst.src[0])))


def glu(dst: Tensor) -> None:
    """act(gate) * up; fused rows hold [gate | up] ([up | gate] when swapped)."""
    p = dst.params
    if len(dst.src) == 1:
        av = decode(dst.src[0])
        n = dst.ne[0]
        gate, up = (av[..., n:], av[..., :n]) if p.swapped else (av[..., :n], av[..., n:])
    else:
        gate, up = decode(dst.src[0]), decode(dst.src[1])
    act = _silu if p.kind is GluKind.SWIGLU else _gelu_tanh
    store(dst, act(gate) * up)


def _row_mean(x: np.ndarray) -> np.ndarray:
    """Mean over the last axis as sum / n (an empty row gives NaN without a warning)."""
    return np.sum(x, axis=-1, keepdims=True) / x.shape[-1]


def rms_norm(dst: Tensor) -> None:
    """x * (1 / sqrt(mean(x^2) + eps)) as ggml scales: a zero row with eps 0 is 0 * inf = NaN."""
    x = decode(dst.src[0])
    store(dst, x * (1.0 / np.sqrt(_row_mean(x * x) + dst.params.eps)))


def norm(dst: Tensor) -> None:
    """(x - mean) * (1 / sqrt(var + eps)): a constant row with eps 0 is NaN, as in ggml."""
    x = decode(dst.src[0])
    d = x - _row_mean(x)
    store(dst, d * (1.0 / np.sqrt(_row_mean(d * d) + dst.params.eps)))


def sum_rows(dst: Tensor) -> None:
    store(dst, np.sum(decode(dst.src[0]), axis=-1, keepdims=True))


# --- matrix products ---------------------------------------------------------------------------


def mul_mat(dst: Tensor) -> None:
    """out[m, n, i2, i3] = sum_k a[k, m, i2 / (B2/A2), i3 / (B3/A3)] * b[k, n, i2, i3]."""
    a, b = dst.src
    av, bv = decode(a), decode(b)  # weights dequantized exactly, activations kept as they are
    av = np.repeat(np.repeat(av, b.ne[3] // a.ne[3], axis=0), b.ne[2] // a.ne[2], axis=1)
    store(dst, bv @ np.swapaxes(av, -1, -2))


def mul_mat_id(dst: Tensor) -> None:
    """out[:, e, t] = as[:, :, ids[e, t]]^T @ b[:, e % b.ne1, t]."""
    experts, b, ids = dst.src
    idx = decode(ids)[0, 0]  # (n_tokens, n_used)
    _check_ids("mul_mat_id", idx, experts.ne[2], f"experts of {experts.describe()}")
    bv = decode(b)[0]  # (n_tokens, b.ne1, K)
    bb = bv[:, np.arange(idx.shape[1]) % bv.shape[1]]  # (n_tokens, n_used, K)
    out = np.zeros((idx.shape[0], idx.shape[1], experts.ne[1]))
    weights = tensor_array(experts)[0]
    for e in np.unique(idx):  # dequantize only the experts in use
        sel = idx == e
        out[sel] = bb[sel] @ decode_blocks(weights[e], experts.type).T
    store(dst, out)


# --- positions and attention -------------------------------------------------------------------


def rope_yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                        beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the range of dims where YaRN ramps from extrapolation to interpolation."""
    def corr_dim(n_rot: float) -> float:
        with np.errstate(divide="ignore"):  # n_ctx_orig == 0 gives -inf, as ggml's logf(0) does
            return n_dims * np.log(np.float64(n_ctx_orig) / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))

    start = float(np.floor(corr_dim(beta_fast)))
    end = float(np.ceil(corr_dim(beta_slow)))
    return max(0.0, start), min(n_dims - 1.0, end)


def rope_cos_sin(pos: np.ndarray, p, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (each (n_pos, n_dims/2)) of rope_yarn for pair i: theta = pos * base^(-2i/n_dims)
    / freq_factors[i] (ggml_rope_cache_init; the YaRN ramp still goes by i)."""
    i = np.arange(p.n_dims // 2)
    theta_extrap = pos[:, None].astype(np.float64) * p.freq_base ** (-2.0 * i / p.n_dims)
    if freq_factors is not None:
        theta_extrap = theta_extrap / freq_factors[: p.n_dims // 2].astype(np.float64)
    theta = p.freq_scale * theta_extrap
    mscale = p.attn_factor
    if p.ext_factor != 0.0:
        low, high = rope_yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
        ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)  # ggml's i0/2 is i
        ramp_mix = ramp * p.ext_factor
        theta = theta * (1.0 - ramp_mix) + theta_extrap * ramp_mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / p.freq_scale)
    return np.cos(theta) * mscale, np.sin(theta) * mscale


def rope(dst: Tensor) -> None:
    """Rotate pairs of a [head_dim, n_head, n_tokens, ne3] by pos[token], each pair's angle divided
    by its frequency factor (src[2], when given); dims >= n_dims are copied."""
    a, pos = dst.src[:2]
    p = dst.params
    x = decode(a)
    factors = decode(dst.src[2]).reshape(-1) if len(dst.src) > 2 else None
    cos, sin = rope_cos_sin(decode(pos).reshape(-1), p, factors)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # over (ne3, tokens, heads, pairs)
    nd = p.n_dims
    if p.mode is RopeMode.NEOX:  # pairs (x[i], x[i + n_dims/2])
        i0, i1 = slice(0, nd // 2), slice(nd // 2, nd)
    else:  # NORMAL: pairs (x[2i], x[2i+1])
        i0, i1 = slice(0, nd, 2), slice(1, nd, 2)
    out = x.copy()
    x0, x1 = x[..., i0], x[..., i1]
    out[..., i0] = x0 * cos - x1 * sin
    out[..., i1] = x0 * sin + x1 * cos
    store(dst, out)


def soft_max(dst: Tensor) -> None:
    """softmax over ne0 of a*scale + slope(head)*mask; mask rows beyond ne1 are ignored."""
    a = dst.src[0]
    p = dst.params
    x = decode(a) * p.scale
    if len(dst.src) > 1:
        mask = decode(dst.src[1])[:, :, : a.ne[1]]
        mask = _broadcast_planes(mask, a.ne[3], a.ne[2])
        x = x + alibi_slopes(a.ne[2], p.max_bias)[None, :, None, None] * mask
    store(dst, _softmax_rows(x))


def flash_attn_ext(dst: Tensor) -> None:
    """out[:, h, t, b] = softmax(scale * q[:, t, h, b] . k[:, :, h/r2, b/r3] + slope*mask) @ v^T."""
    q, k, v = dst.src[:3]
    p = dst.params
    qv, kv, vv = decode(q), decode(k), decode(v)  # (B, H, T, D), (Bk, Hkv, KV, D), (Bk, Hkv, KV, Dv)
    nb, nh = q.ne[3], q.ne[2]
    heads = np.arange(nh) // (nh // k.ne[2])
    batch = np.arange(nb) // (nb // k.ne[3])
    kk = kv[batch][:, heads]
    vv = vv[batch][:, heads]
    s = (qv @ np.swapaxes(kk, -1, -2)) * p.scale  # (B, H, T, KV)
    if p.logit_softcap != 0.0:
        s = p.logit_softcap * np.tanh(s / p.logit_softcap)
    if len(dst.src) > 3:
        mask = decode(dst.src[3])[:, :, : q.ne[1]]
        s = s + alibi_slopes(nh, p.max_bias)[None, :, None, None] * _broadcast_planes(mask, nb, nh)
    o = _attention_weights(s) @ vv  # (B, H, T, Dv)
    store(dst, np.swapaxes(o, 1, 2))  # ggml's output is permuted: [Dv, H, T, B]


# --- sorting -----------------------------------------------------------------------------------


def argsort(dst: Tensor) -> None:
    x = decode(dst.src[0])
    key = x if dst.params.order is SortOrder.ASC else -x
    store(dst, np.argsort(key, axis=-1, kind="stable"))


def top_k(dst: Tensor) -> None:
    """Indices of the k largest per row: descending, then the first two swapped, exactly as ggml."""
    k = dst.params.k
    idx = np.argsort(-decode(dst.src[0]), axis=-1, kind="stable")[..., :k]
    if k > 1:
        idx[..., [0, 1]] = idx[..., [1, 0]]
    store(dst, idx)


OPS: dict[Op, Callable[[Tensor], None]] = {
    Op.GET_ROWS: get_rows,
    Op.SET_ROWS: set_rows,
    Op.CPY: cpy,
    Op.DUP: dup,
    Op.CONT: cont,
    Op.ADD: add,
    Op.MUL: mul,
    Op.SCALE: scale,
    Op.SILU: silu,
    Op.GELU: gelu,
    Op.GLU: glu,
    Op.RMS_NORM: rms_norm,
    Op.NORM: norm,
    Op.MUL_MAT: mul_mat,
    Op.MUL_MAT_ID: mul_mat_id,
    Op.ROPE: rope,
    Op.SOFT_MAX: soft_max,
    Op.FLASH_ATTN_EXT: flash_attn_ext,
    Op.ARGSORT: argsort,
    Op.TOP_K: top_k,
    Op.SUM_ROWS: sum_rows,
}
"""Every computing op of the catalogue (view ops never reach a kernel)."""


def compute_forward(dst: Tensor) -> None:
    """Compute one node into its memory. IEEE semantics as in ggml: inf/NaN propagate without warnings."""
    with np.errstate(all="ignore"):
        OPS[dst.op](dst)
