"""FLASH_ATTN_EXT: fused softmax(scale * Q K^T + slope * mask) V with an online softmax, GQA,
F16 or F32 K/V, optional F16 mask, ALiBi and logit soft-capping, ggml's semantics.

q [D, T, H, B] F32, k [D, KV, Hk, Bk], v [Dv, KV, Hk, Bk], mask F16 [KV, >=T, m2, m3].
The result is permuted: out [Dv, H, T, B] (out[:, h, t, b]). Query head h reads kv head
h // G (G = H / Hk query heads share one kv head). Rows of q, k, v and mask are contiguous.

Two kernels, chosen as ggml's CPU backend chooses (ggml_compute_forward_flash_attn_ext_f16;
`plan`), both computing ggml's float code of the ISA variant's form (`ggx_cpu.isa.vmath`):

- **Tiled** (T >= 64, K and V of one type, Dv a multiple of the form's vector width; ggml's
  `..._tiled`, everything F32): K converted transposed (slots contiguous), S = Q K^T and O += P V
  by the register-tiled GEMM (`ggx_cpu.isa.fgemm`, ggml's simd_gemm order), between them each
  row's online softmax: the tile maximum, a rescale of O and of the row sum when the maximum
  grows, P = exp(S - M) over ggml's chunks.
- **One chunk** (otherwise, decode included; ggml's `..._one_chunk`, with its roundings: Q is
  rounded to F16 when K is F16, the dot is ggml's vec_dot, and the V accumulator is an F16
  buffer, rounded after every update, when V is F16; keys whose mask value is -inf are skipped).
  A row's scores over a KV tile come first, then the key-by-key updates. Decode over a long cache
  (T = 1, B = 1, K and V of one type, KV >= 512, more than one thread) splits the slots into one
  chunk per thread, each chunk keeping (M, S, accumulator) partials merged at the end (ggml's
  split-KV path and ggml_flash_attn_ext_reduce_partials).

One kernel runs both. A task is (batch, kv head, tile of query tokens, kv chunk) and holds the
rows of each of the G query heads of that kv head (GQA), so a K/V tile converted once serves all
of them; KV tiles of 64 slots whose mask is -inf for every row of the task are skipped (causal
and sliding-window masks skip most). Tasks go to threads by an atomic counter, heaviest first
(the last query tiles see the most keys under a causal mask), so threads stay busy whatever the
mask skips; no result depends on which thread ran it.

A row whose every key is masked gives 0 (S == 0), as in every ggml path.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ggx.errors import GGXShapeError
from ggx.tensor import Tensor
from ggx.types import GType

from .. import isa
from ..isa.codegen import elem_ptr
from ..isa.fgemm import gemm, pack_transposed_8x8
from ..isa.simd import (
    add_f32x8,
    fma_f32x8,
    load_f32x8,
    mul_f32x8,
    splat_f32x8,
    store_f32x8,
)
from ..isa.vmath import (
    FloatSimd,
    all_neg_inf_half8,
    dot,
    exp_chunk,
    expf,
    float_simd,
    fmuladd_f32,
    hmax_f32x8,
    lanes,
    load_as_f32x8,
    load_half_f32x8,
    max_f32x8,
    round_half_f32x8,
)
from ..launch import split
from .common import Launch, elems, need_ne, need_rows, need_srcs, need_type
from .convert import as_f32, f16_to_f32, f32_to_f16
from .softmax import alibi_slopes

TILED_MIN_TOKENS = 64  # ggml switches to its F32 tiled kernel from this many query rows
KV_TILE = 64  # key slots per tile (ggml's GGML_FA_TILE_KV)
SPLIT_KV_MIN = 512  # ggml splits one decode token's keys over the threads from this many slots
_NEG_INF_F16 = 0xFC00


# --- tasks handed out to threads --------------------------------------------------------------------
@intrinsic
def _fetch_add(typingctx, arr, i):
    """arr[i] += 1 atomically, returning the old value (an int64 array): the next task."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = elem_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(arr, types.intp), codegen


# --- small vector helpers ---------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _h(x):
    """Round a float32 through F16 (what storing into an F16 buffer does)."""
    return f16_to_f32(f32_to_f16(x))


@njit(cache=True, inline="always")
def _scale_to(y, yo, x, xo, n, c, half):
    """y[yo:yo+n] = x[xo:xo+n] * c (float32), rounded to F16 when `half` (ggml_vec_scale_f16 on
    an F16 buffer held as float32 values: the rounding in registers gives a store's bits)."""
    cv = splat_f32x8(c)
    i = 0
    while i + 8 <= n:
        r = mul_f32x8(load_f32x8(x, xo + i), cv)
        store_f32x8(y, yo + i, round_half_f32x8(r) if half else r)
        i += 8
    while i < n:
        y[yo + i] = _h(x[xo + i] * c) if half else x[xo + i] * c
        i += 1


@njit(cache=True, inline="always")
def _mad(y, yo, x, xo, n, c, half):
    """y[yo:yo+n] += x[xo:xo+n] * c (one FMA; y float32, x float32 or F16 bits), rounded to F16
    when `half` (ggml_vec_mad_f16 on an F16 buffer held as float32 values)."""
    cv = splat_f32x8(c)
    i = 0
    while i + 8 <= n:
        r = fma_f32x8(load_f32x8(y, yo + i), load_as_f32x8(x, xo + i), cv)
        store_f32x8(y, yo + i, round_half_f32x8(r) if half else r)
        i += 8
    while i < n:
        y[yo + i] = _h(y[yo + i] + as_f32(x[xo + i]) * c) if half else y[yo + i] + as_f32(x[xo + i]) * c
        i += 1


# --- pieces of a task ----------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _pack_k(kt, k, kb, kstride, D, nk):
    """kt[i * KV_TILE + j] = K(slot j, i) for the nk slots of a tile from row kb on: K
    transposed, so that slots are the vector dimension of S = Q K^T; 8x8 blocks by shuffles."""
    j = 0
    while j + 8 <= nk:
        i = 0
        while i + 8 <= D:
            pack_transposed_8x8(kt, i * KV_TILE + j, KV_TILE, k, kb + j * kstride + i, kstride)
            i += 8
        for i2 in range(i, D):
            for j2 in range(j, j + 8):
                kt[i2 * KV_TILE + j2] = as_f32(k[kb + j2 * kstride + i2])
        j += 8
    for j2 in range(j, nk):
        for i in range(D):
            kt[i * KV_TILE + j2] = as_f32(k[kb + j2 * kstride + i])


@njit(cache=True, inline="always")
def _convert(y, yo, x, xo, n):
    """y[yo:yo+n] = x[xo:xo+n] as float32 (x float32 or F16 bits)."""
    i = 0
    while i + 8 <= n:
        store_f32x8(y, yo + i, load_as_f32x8(x, xo + i))
        i += 8
    while i < n:
        y[yo + i] = as_f32(x[xo + i])
        i += 1


@njit(cache=True, inline="always")
def _tile_masked(m, mrow, r0, r1, ic, nk):
    """Whether mask rows mrow[r0..r1) are -inf over slots ic..ic+nk-1 (F16 bits compared, 8
    slots at a time: a NaN is not -inf, as in ggml's test)."""
    for r in range(r0, r1):
        mb = mrow[r] + ic
        j = 0
        while j + 8 <= nk:
            if not all_neg_inf_half8(m, mb + j):
                return False
            j += 8
        for j2 in range(j, nk):
            if m[mb + j2] != _NEG_INF_F16:
                return False
    return True


@njit(cache=True, inline="always")
def _scores_row(sb, sbo, nk, scale, softcap, has_mask, slope, m, mb):
    """One row of a score tile as ggml's tiled kernel: s * scale (then softcap * tanh), plus
    slope * mask (the product rounded first); slots past nk are -inf. Returns the row's maximum."""
    if nk == KV_TILE and softcap == 0:
        mx = splat_f32x8(np.float32(-np.inf))
        sv = splat_f32x8(scale)
        slv = splat_f32x8(slope)
        for j in range(0, KV_TILE, 8):
            x = mul_f32x8(load_f32x8(sb, sbo + j), sv)
            if has_mask:
                x = add_f32x8(x, mul_f32x8(load_half_f32x8(m, mb + j), slv))
            store_f32x8(sb, sbo + j, x)
            mx = max_f32x8(mx, x)
        return hmax_f32x8(mx)
    mx = np.float32(-np.inf)
    for j in range(nk):
        x = sb[sbo + j] * scale
        if softcap != 0:
            x = softcap * np.float32(math.tanh(x))
        if has_mask:
            x += slope * f16_to_f32(m[mb + j])
        sb[sbo + j] = x
        mx = max(mx, x)
    for j in range(nk, KV_TILE):
        sb[sbo + j] = -np.inf
    return mx


@njit(cache=True, inline="always")
def _softmax_row(fs, sb, sbo, mnew):
    """P = exp(s - mnew) in place over one row of a score tile; returns its sum in float64, from
    float32 sums of ggml's chunks (ggml_vec_soft_max_f32)."""
    total = 0.0
    for j in range(0, KV_TILE, lanes(fs)):
        total += np.float64(exp_chunk(fs, sb, sbo + j, sb, sbo + j, mnew))
    return total


@njit(cache=True, inline="always")
def _tile_softmax(fs, geo, sb, ob, mx, sm, tm):
    """The tiled kernel's online softmax over one score tile, given each row's maximum tm[r]
    (-inf for padding rows): a rescale of the output row and of the row sum when the maximum
    grows, then P = exp(S - M) in place."""
    Dv, rp = geo[1], geo[7]
    for r in range(rp):
        sbo = r * KV_TILE
        tmax = tm[r]
        if tmax == -np.inf:  # every slot masked for this row (or a padding row): it adds nothing
            sb[sbo: sbo + KV_TILE] = 0.0
            continue
        mnew = max(mx[r], tmax)
        if mnew > mx[r]:
            c = expf(mx[r] - mnew)
            _scale_to(ob, r * Dv, ob, r * Dv, Dv, c, False)
            sm[r] *= c
        mx[r] = mnew
        sm[r] = np.float32(np.float64(sm[r]) + _softmax_row(fs, sb, sbo, mnew))


@njit(cache=True, inline="always")
def _round_if(x, half):
    return round_half_f32x8(x) if half else x


@njit(cache=True, inline="always")
def _value_block(ob, oo, v, vb, vstride, wt, live, lo, nk, half):
    """ggml's updates of 64 accumulator values ob[oo:oo+64] over keys 0..nk, held in eight
    registers across the keys: for a live key j, wt[j] >= 0 first rescales them by wt[j] (the
    maximum grew), then they gain wt[KV_TILE + j] times the value row (v from element vb + j *
    vstride); an F16 accumulator is rounded after each of those steps, as ggml stores it."""
    a0, a1 = load_f32x8(ob, oo), load_f32x8(ob, oo + 8)
    a2, a3 = load_f32x8(ob, oo + 16), load_f32x8(ob, oo + 24)
    a4, a5 = load_f32x8(ob, oo + 32), load_f32x8(ob, oo + 40)
    a6, a7 = load_f32x8(ob, oo + 48), load_f32x8(ob, oo + 56)
    for j in range(nk):
        if not live[lo + j]:
            continue
        if wt[j] >= 0:
            c = splat_f32x8(wt[j])
            a0, a1 = _round_if(mul_f32x8(a0, c), half), _round_if(mul_f32x8(a1, c), half)
            a2, a3 = _round_if(mul_f32x8(a2, c), half), _round_if(mul_f32x8(a3, c), half)
            a4, a5 = _round_if(mul_f32x8(a4, c), half), _round_if(mul_f32x8(a5, c), half)
            a6, a7 = _round_if(mul_f32x8(a6, c), half), _round_if(mul_f32x8(a7, c), half)
        c = splat_f32x8(wt[KV_TILE + j])
        x = vb + j * vstride
        a0 = _round_if(fma_f32x8(a0, load_as_f32x8(v, x), c), half)
        a1 = _round_if(fma_f32x8(a1, load_as_f32x8(v, x + 8), c), half)
        a2 = _round_if(fma_f32x8(a2, load_as_f32x8(v, x + 16), c), half)
        a3 = _round_if(fma_f32x8(a3, load_as_f32x8(v, x + 24), c), half)
        a4 = _round_if(fma_f32x8(a4, load_as_f32x8(v, x + 32), c), half)
        a5 = _round_if(fma_f32x8(a5, load_as_f32x8(v, x + 40), c), half)
        a6 = _round_if(fma_f32x8(a6, load_as_f32x8(v, x + 48), c), half)
        a7 = _round_if(fma_f32x8(a7, load_as_f32x8(v, x + 56), c), half)
    store_f32x8(ob, oo, a0)
    store_f32x8(ob, oo + 8, a1)
    store_f32x8(ob, oo + 16, a2)
    store_f32x8(ob, oo + 24, a3)
    store_f32x8(ob, oo + 32, a4)
    store_f32x8(ob, oo + 40, a5)
    store_f32x8(ob, oo + 48, a6)
    store_f32x8(ob, oo + 56, a7)


@njit(cache=True, inline="always")
def _key_updates(fs, geo, params, acc_f16, qb, sb, live, ob, wt, mx, sm, rs, mrow, k, kb0, kstride, m, has_mask,
                 v, vb0, vstride, ic, nk):
    """ggml's one_chunk over the nk slots from ic. A key whose mask is -inf is skipped; the others
    score s = (q . k, ggml's vec_dot) * scale (softcap * tanh), + slope * mask, all of a row's
    first (no dependence between them). Then each row's updates, key by key as ggml's: a larger s
    rescales the accumulator by exp(M_old - s), any other adds exp(s - M) times the value row,
    and an F16 accumulator is rounded after each update. The scalar recurrence (M, S and each
    key's two factors, into wt) runs first; the accumulator then stays in registers across the
    keys, 64 values at a time (the vector chains of one key do not wait on each other)."""
    D, Dv, rows = geo[0], geo[1], geo[5] * geo[6]
    scale, softcap = params
    for r in range(rows):
        if mrow[r] < 0:
            continue
        lo = r * KV_TILE
        for j in range(nk):
            mv = rs[r] * f16_to_f32(m[mrow[r] + ic + j]) if has_mask else np.float32(0.0)
            live[lo + j] = mv != -np.inf
            if mv != -np.inf:
                s = dot(fs, qb, r * D, k, kb0 + (ic + j) * kstride, D) * scale
                if softcap != 0:
                    s = softcap * np.float32(math.tanh(s))
                sb[lo + j] = s + mv
        m_r, s_r = mx[r], sm[r]  # in registers: the scratch arrays may alias, so LLVM keeps them in memory
        for j in range(nk):
            if not live[lo + j]:
                continue
            s = sb[lo + j]
            ms_ = np.float32(1.0)
            vs = np.float32(1.0)
            wt[j] = np.float32(-1.0)  # no rescale
            if s > m_r:
                ms_ = expf(m_r - s)
                m_r = s
                wt[j] = ms_
            else:
                vs = expf(s - m_r)
            wt[KV_TILE + j] = vs
            s_r = fmuladd_f32(s_r, ms_, vs)
        mx[r], sm[r] = m_r, s_r
        i = 0
        while i + 64 <= Dv:
            _value_block(ob, r * Dv + i, v, vb0 + ic * vstride + i, vstride, wt, live, lo, nk, acc_f16)
            i += 64
        for j in range(nk):  # the last Dv % 64 values, key by key
            if live[lo + j]:
                if wt[j] >= 0:
                    _scale_to(ob, r * Dv + i, ob, r * Dv + i, Dv - i, wt[j], acc_f16)
                _mad(ob, r * Dv + i, v, vb0 + (ic + j) * vstride + i, Dv - i, wt[KV_TILE + j], acc_f16)


# --- one task ---------------------------------------------------------------------------------------
@njit(cache=True)
def _task(fs, task, geo, params, flags, slopes, tens, part, qb, kt, vt, sb, live, ob, mx, sm, tm, rs, mrow):
    """Query rows r = g*QT + tq (g < gt heads of one kv head, tq < QT tokens; padded to rp rows)
    of one batch, over the kv slots of one chunk, KV tile by KV tile (tiles the mask hides from
    every row skipped): either ggml's tiled kernel (S = Q K^T by the register-tiled GEMM, the
    online softmax, O += P V by the GEMM) or, when flags[0] (`exact`), ggml's one_chunk updates
    key by key. Writes the rows' outputs, or (M, S, acc) partials."""
    q, qo, qs, k, ko, ks, v, vo, vs_, has_mask, m, mo, ms, mne, d, do, ds = tens
    D, Dv, T, H, G, gt, QT, rp, n_kv, chunk, n_chunks, B, rk3 = geo
    exact, q_f16, acc_f16 = flags
    scale, softcap = params
    hk_n, n_hs = H // G, G // gt
    n_qt = (T + QT - 1) // QT
    c = task % n_chunks
    rest = task // n_chunks
    per_qt = B * hk_n * n_hs
    qt = n_qt - 1 - rest // per_qt  # heaviest (last) query tiles first
    rest %= per_qt
    hs = rest % n_hs
    rest //= n_hs
    hk = rest % hk_n
    b = rest // hk_n
    t0 = qt * QT
    nt = min(QT, T - t0)
    h0 = hk * G + hs * gt
    rows = gt * QT
    for r in range(rp):
        g, tq = r // QT, r % QT
        valid = r < rows and tq < nt
        qrow = qo + (t0 + tq) * qs[1] + (h0 + g) * qs[2] + b * qs[3]
        if not valid:
            qb[r * D: (r + 1) * D] = 0.0
        elif q_f16:  # ggml's q_to_vec_dot: the query rounded to F16 for an F16 x F16 dot
            _scale_to(qb, r * D, q, qrow, D, np.float32(1.0), True)
        else:
            _convert(qb, r * D, q, qrow, D)
        ob[r * Dv: (r + 1) * Dv] = 0.0
        mx[r] = -np.inf
        sm[r] = 0.0
        mrow[r] = mo + (t0 + tq) * ms[1] + ((h0 + g) % mne[2]) * ms[2] + (b % mne[3]) * ms[3] if valid else -1
        rs[r] = slopes[h0 + g] if valid else np.float32(0.0)
    # rows the skip test reads: the tokens of every head, or of one when all share a mask plane
    heads_checked = 1 if mne[2] == 1 else gt
    kb0 = ko + hk * ks[2] + (b // rk3) * ks[3]
    vb0 = vo + hk * vs_[2] + (b // rk3) * vs_[3]
    ic1 = min(n_kv, (c + 1) * chunk)
    for ic in range(c * chunk, ic1, KV_TILE):
        nk = min(KV_TILE, ic1 - ic)
        if has_mask:
            masked = True
            for g in range(heads_checked):
                masked = masked and _tile_masked(m, mrow, g * QT, g * QT + nt, ic, nk)
            if masked:
                continue
        if exact:
            _key_updates(fs, geo, params, acc_f16, qb, sb, live, ob, kt, mx, sm, rs, mrow, k, kb0, ks[1], m, has_mask,
                         v, vb0, vs_[1], ic, nk)
            continue
        _pack_k(kt, k, kb0 + ic * ks[1], ks[1], D, nk)
        sb[:] = 0.0
        gemm(fs, sb, 0, KV_TILE, qb, 0, D, kt, 0, KV_TILE, rp, KV_TILE, D)
        for r in range(rp):
            tm[r] = -np.inf
            if mrow[r] >= 0:
                tm[r] = _scores_row(sb, r * KV_TILE, nk, scale, softcap, has_mask, rs[r], m, mrow[r] + ic)
        _tile_softmax(fs, geo, sb, ob, mx, sm, tm)
        for j in range(nk):
            _convert(vt, j * Dv, v, vb0 + (ic + j) * vs_[1], Dv)
        gemm(fs, ob, 0, Dv, sb, 0, KV_TILE, vt, 0, Dv, rp, Dv, nk)
    for r in range(rows):
        if mrow[r] < 0:
            continue
        g, tq = r // QT, r % QT
        h = h0 + g
        if part.size:  # split keys: T = B = 1, so row r is head h0 + r
            pb = (h * n_chunks + c) * (2 + Dv)
            part[pb] = mx[r]
            part[pb + 1] = sm[r]
            part[pb + 2: pb + 2 + Dv] = ob[r * Dv: (r + 1) * Dv]
        else:
            inv = np.float32(0.0) if sm[r] == 0 else np.float32(1.0) / sm[r]
            db = do + h * ds[1] + (t0 + tq) * ds[2] + b * ds[3]
            if ds[0] == 1:
                _scale_to(d, db, ob, r * Dv, Dv, inv, False)
            else:
                for i in range(Dv):
                    d[db + i * ds[0]] = ob[r * Dv + i] * inv


@njit(cache=True)
def _merge_partials(geo, part, d, do, ds):
    """Each head's output from its chunks' (M, S, acc) partials (ggml_flash_attn_ext_reduce_partials)."""
    Dv, H, n_chunks = geo[1], geo[3], geo[10]
    out = np.empty(Dv, np.float32)
    for h in range(H):
        m_fin = np.float32(-np.inf)
        s_fin = np.float32(0.0)
        out[:] = 0.0
        for c in range(n_chunks):
            pb = (h * n_chunks + c) * (2 + Dv)
            m_c, s_c = part[pb], part[pb + 1]
            if s_c == 0:
                continue
            m_new = max(m_fin, m_c)
            old = expf(m_fin - m_new)
            new = expf(m_c - m_new)
            for i in range(Dv):
                out[i] = out[i] * old + part[pb + 2 + i] * new
            s_fin = s_fin * old + s_c * new
            m_fin = m_new
        inv = np.float32(1.0) / s_fin if s_fin != 0 else np.float32(1.0)
        for i in range(Dv):
            d[do + h * ds[1] + i * ds[0]] = out[i] * inv


@njit(cache=True)
def scratch_floats(D: int, Dv: int, rp: int) -> int:
    """float32 scratch of one worker (Q rows, K tile or one_chunk's two factors per key, V tile,
    scores, outputs, 4 values per row), rounded up to whole 64-byte lines so that two workers
    never write one line."""
    return -(-(rp * (D + KV_TILE + Dv + 4) + KV_TILE * (max(D, 2) + Dv)) // 16) * 16


@njit(cache=True)
def scratch_rows(rp: int) -> int:
    """int64 row offsets of one worker, in whole 64-byte lines."""
    return -(-rp // 8) * 8


@njit(cache=True)
def _worker(fs, w, sf, si, sl, counter, n_tasks, geo, params, flags, slopes, part,
            q, qo, qs, k, ko, ks, v, vo, vs_, has_mask, m, mo, ms, mne, d, do, ds):
    """Run tasks until the counter passes n_tasks, in worker w's share of the scratch arrays
    (float32 sf, int64 si, bool sl: bound with the launch, so a call allocates nothing)."""
    D, Dv, rp = geo[0], geo[1], geo[7]
    tens = (q, qo, qs, k, ko, ks, v, vo, vs_, has_mask, m, mo, ms, mne, d, do, ds)
    f = sf[w * scratch_floats(D, Dv, rp): (w + 1) * scratch_floats(D, Dv, rp)]
    qb, f = f[: rp * D], f[rp * D:]
    kt, f = f[: max(D, 2) * KV_TILE], f[max(D, 2) * KV_TILE:]
    vt, f = f[: KV_TILE * Dv], f[KV_TILE * Dv:]
    sb, f = f[: rp * KV_TILE], f[rp * KV_TILE:]
    ob, f = f[: rp * Dv], f[rp * Dv:]
    mx, sm, tm, rs = f[:rp], f[rp: 2 * rp], f[2 * rp: 3 * rp], f[3 * rp: 4 * rp]
    mrow = si[w * scratch_rows(rp): w * scratch_rows(rp) + rp]
    live = sl[w * rp * KV_TILE: (w + 1) * rp * KV_TILE]
    task = _fetch_add(counter, 0)
    while task < n_tasks:
        _task(fs, task, geo, params, flags, slopes, tens, part, qb, kt, vt, sb, live, ob, mx, sm, tm, rs, mrow)
        task = _fetch_add(counter, 0)


@njit(cache=True)
def flash_attn(p, parts, fs, sf, si, sl, counter, n_tasks, geo, params, flags, slopes, part,
               q, qo, qs, k, ko, ks, v, vo, vs_, has_mask, m, mo, ms, mne, d, do, ds):
    """FLASH_ATTN_EXT as a split kernel (`ggx_cpu.launch.split`): part -1 resets the task
    counter, parts 0..parts-1 are its workers, each taking tasks from the counter in its own
    share of the scratch, part `parts` merges split keys' partials.

    fs: ggml's float SIMD form (`ggx_cpu.isa.vmath.FloatSimd`: GEMM tile, expf); sf, si, sl:
    each worker's scratch (`scratch_floats` float32, `scratch_rows` int64, rp * 64 bool); geo = (D, Dv,
    T, H, G, heads per task gt, tokens per task QT, rows padded rp, KV, kv chunk, n_chunks, B,
    rk3); params = (scale, softcap); flags = (exact: ggml's one_chunk, Q rounded to F16, F16
    accumulator); part: (M, S, acc) per head and chunk when keys are split, else empty; then the
    tensors in the plugin's convention (mask: has_mask, m, mo, ms, mne)."""
    if p < 0:
        counter[0] = 0
    elif p < parts:
        _worker(fs, p, sf, si, sl, counter, n_tasks, geo, params, flags, slopes, part,
                q, qo, qs, k, ko, ks, v, vo, vs_, has_mask, m, mo, ms, mne, d, do, ds)
    elif part.size:
        _merge_partials(geo, part, d, do, ds)


# --- the wrapper ------------------------------------------------------------------------------------
_NO_MASK = np.zeros(1, np.uint16)
_NO_PARTIALS = np.zeros(0, np.float32)


def _lines(n: int, dtype: type) -> np.ndarray:
    """n elements starting on a 64-byte line (workers' shares are whole lines: no false sharing)."""
    size = np.dtype(dtype).itemsize
    buf = np.empty(n + 64 // size, dtype)
    start = (-buf.ctypes.data % 64) // size
    return buf[start: start + n]


def query_tile(G: int) -> int:
    """Tokens per task of the tiled kernel: 96 rows or more over the G heads of a kv head, in
    multiples of 16 tokens, at most ggml's 64 (SmolLM2's 3 heads x 32 and Gemma 3's 4 x 32
    measured best among 16..64 tokens: more rows share each converted K/V tile, fewer tiles sit
    on a causal mask's diagonal)."""
    return min(64, -(-96 // G // 16) * 16)


class FlashPlan(NamedTuple):
    """How one FLASH_ATTN_EXT node runs: the kernel (tiled, or ggml's one_chunk rows), the kv
    chunks of a split decode token, and the tasks: gt heads x qt tokens (rp rows padded)."""

    tiled: bool
    n_chunks: int
    gt: int
    qt: int
    rp: int
    n_tasks: int


def plan(qne: tuple[int, int, int, int], n_kv: int, Hk: int, Dv: int, same_types: bool, fs: FloatSimd,
         n_threads: int) -> FlashPlan:
    """ggml's choices (ggml_compute_forward_flash_attn_ext_f16): the tiled kernel from 64 query
    rows when K and V have one type and Dv is a multiple of the vector width; split keys for one
    decode token over >= 512 slots on more than one thread (one chunk per thread); then this
    plugin's task shapes."""
    T, H, B = qne[1], qne[2], qne[3]
    G = H // Hk
    tiled = T >= TILED_MIN_TOKENS and same_types and Dv % fs.lanes == 0
    split = not tiled and T == 1 and B == 1 and same_types and n_kv >= SPLIT_KV_MIN and n_threads > 1
    n_chunks = n_threads if split else 1
    if tiled:
        gt, qt = G, query_tile(G)
    else:
        # whole groups of heads share each K/V row; single heads when the groups would leave
        # threads idle or unevenly loaded (3 groups on 2 threads)
        grouped = B * T * Hk * n_chunks
        gt = G if n_threads <= 1 or grouped % n_threads == 0 or grouped >= 4 * n_threads else 1
        groups = B * Hk * (G // gt) * n_chunks
        n_qt = max(-(-T // TILED_MIN_TOKENS), min(T, -(-2 * n_threads // groups)) if n_threads > 1 else 1)
        qt = -(-T // n_qt)
    rp = -(-(gt * qt) // fs.tile_rows) * fs.tile_rows  # rows per task, padded to the GEMM's tile
    return FlashPlan(tiled, n_chunks, gt, qt, rp, B * Hk * (G // gt) * -(-T // qt) * n_chunks)


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
        need_rows(mask, "mask", op)
        if mask.ne[0] != k.ne[1] or mask.ne[1] < q.ne[1] or 0 in mask.ne[2:]:
            raise GGXShapeError(f"{op}: mask {mask.describe()} must be [n_kv={k.ne[1]}, >={q.ne[1]}, ...]")
        m, mo, ms, mne = elems(mask, "mask", op)
    elif p.max_bias > 0:
        raise GGXShapeError(f"{op}: max_bias (ALiBi) needs a mask")
    else:
        m, mo, ms, mne = _NO_MASK, 0, (0, 0, 0, 0), (1, 1, 1, 1)
    D, T, H, B = qne
    n_kv, Dv = kne[1], vne[0]
    fs = float_simd(isa.active())
    pl = plan(qne, n_kv, kne[2], Dv, k.type is v.type, fs, n_threads)
    geo = (D, Dv, T, H, H // kne[2], pl.gt, pl.qt, pl.rp, n_kv, -(-n_kv // pl.n_chunks), pl.n_chunks, B, B // kne[3])
    scale = np.float32(p.scale)
    if p.logit_softcap != 0:  # ggml: s = softcap * tanh(s * scale / softcap)
        scale = scale / np.float32(p.logit_softcap)
    params = (scale, np.float32(p.logit_softcap))
    exact = not pl.tiled
    flags = (exact, exact and k.type is GType.F16, exact and v.type is GType.F16)
    part = np.empty(H * pl.n_chunks * (2 + Dv), np.float32) if pl.n_chunks > 1 else _NO_PARTIALS
    args = (np.zeros(1, np.int64), pl.n_tasks, geo, params, flags, alibi_slopes(H, p.max_bias), part,
            qq, qo, qs, kk, ko, ks, vv, vo, vs, mask is not None, m, mo, ms, mne, dd, do, ds)
    n_workers = max(1, min(n_threads, pl.n_tasks))
    scratch = (_lines(n_workers * scratch_floats(D, Dv, pl.rp), np.float32),
               _lines(n_workers * scratch_rows(pl.rp), np.int64), _lines(n_workers * pl.rp * KV_TILE, np.bool_))
    return split(flash_attn, fs, *scratch, *args, parts=n_workers)
