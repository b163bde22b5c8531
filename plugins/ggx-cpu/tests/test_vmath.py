"""ggx_cpu.isa.vmath: ggml's vectorized expf / SiLU in both float forms, its vec_dot order, and
the F16 vector helpers, against numpy models and float64."""
import math

import numpy as np
import pytest
from numba import njit

from ggx_cpu.isa import vmath
from ggx_cpu.isa.simd import load_f32x8, store_f32x8
from ggx_cpu.isa.vmath import (
    all_neg_inf_half8,
    dot,
    exp_chunk,
    expf,
    float_simd,
    lanes,
    load_half_f32x8,
    round_half_f32x8,
    silu_chunk,
    store_f32x8_half,
    swiglu_chunk,
)

FORMS = [vmath.float_simd_form("avx512"), vmath.float_simd_form("avx2")]
F32 = np.float32


@njit(cache=True)
def _vexp(fs, x, y):
    for i in range(0, x.size, lanes(fs)):
        exp_chunk(fs, y, i, x, i, np.float32(0.0))


@njit(cache=True)
def _vsilu(fs, x, y):
    for i in range(0, x.size, lanes(fs)):
        silu_chunk(fs, y, i, x, i, x, i)


def _apply(kernel, fs, x):
    x = np.ascontiguousarray(x, np.float32)
    pad = np.zeros(-x.size % 16, np.float32)
    xp = np.concatenate([x, pad])
    y = np.empty_like(xp)
    kernel(fs, xp, y)
    return y[: x.size]


def _fma(a, b, c):
    """float32 fma through float64 (the product is exact there; one rounding of the sum)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def ggml_v_expf(x: np.ndarray, form: str) -> np.ndarray:
    """numpy model of ggml's ggml_v_expf (vec.h), AVX2 or AVX-512 form, lane by lane."""
    x = x.astype(np.float32)
    h = float.fromhex
    with np.errstate(all="ignore"):
        z = _fma(x, F32(h("0x1.715476p+0")), F32(h("0x1.8p23")))
        n = (z - F32(h("0x1.8p23"))).astype(np.float32)
        b = _fma(-n, F32(h("0x1.62e4p-1")), x)
        b = _fma(-n, F32(h("0x1.7f7d1cp-20")), b)
        u = (b * b).astype(np.float32)
        poly = _fma(_fma(F32(h("0x1.0e4020p-7")), b, F32(h("0x1.573e2ep-5"))), u,
                    _fma(F32(h("0x1.555e66p-3")), b, F32(h("0x1.fffdb6p-2"))))
        big = np.abs(n) > 192
        if form == "avx512":
            j = _fma(poly, u, _fma(F32(h("0x1.ffffecp-1")), b, F32(1.0)))
            res = np.ldexp(j, np.where(big | np.isnan(n), 0, n).astype(np.int32)).astype(np.float32)
            return np.where(big, np.where(n <= 0, F32(0.0), F32(np.inf)), np.where(np.isnan(n), j, res))
        j = _fma(poly, u, (F32(h("0x1.ffffecp-1")) * b).astype(np.float32))
        e = (z.view(np.uint32) << np.uint32(23)).astype(np.uint32)
        k = (e + np.float32(1.0).view(np.uint32)).astype(np.uint32).view(np.float32)
        c = np.abs(n) > 126
        g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0))
        s1 = (g + np.uint32(0x7F000000)).astype(np.uint32).view(np.float32)
        s2 = (e - g).astype(np.uint32).view(np.float32)
        split = (_fma(s2, j, s2) * s1).astype(np.float32)
        return np.where(big, (s1 * s1).astype(np.float32), np.where(c, split, _fma(k, j, k)))


SPECIALS = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 88.72, 88.73, 89.0, -87.3, -100.0, -103.9, -104.0,
                     -150.0, 1e30, -1e30, 1e-30, 3e38, -3e38], np.float32)


@pytest.mark.parametrize("fs", FORMS, ids=lambda f: f.form)
def test_exp_is_ggmls_formula_bit_for_bit(fs):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-110, 95, 200_000).astype(np.float32),
                        rng.standard_normal(50_000).astype(np.float32), SPECIALS])
    got = _apply(_vexp, fs, x)
    want = ggml_v_expf(x, fs.form)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got[~np.isnan(got)]), np.signbit(want[~np.isnan(want)]))


@pytest.mark.parametrize("fs", FORMS, ids=lambda f: f.form)
def test_exp_accuracy_and_special_values(fs):
    """Within 2.5 ulp of exp over the normal range (ggml quotes 1.45 ulp + 0.5 for its AVX2 form;
    the AVX-512 form reaches 2.2 here), subnormal results within 2 units of the smallest
    subnormal, and expf's answers at the edges."""
    x = np.linspace(-103.9, 88.7, 400_000, dtype=np.float32)
    got = _apply(_vexp, fs, x).astype(np.float64)
    ref = np.exp(x.astype(np.float64))
    normal = ref >= np.finfo(np.float32).tiny
    ulp = np.spacing(ref[normal].astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got[normal] - ref[normal]) / ulp) < 2.5
    assert np.max(np.abs(got[~normal] - ref[~normal])) <= 2 * 2.0**-149
    s = _apply(_vexp, fs, SPECIALS)
    assert s[0] == np.inf and s[1] == 0 and np.isnan(s[2]) and s[3] == 1 and s[4] == 1
    assert np.isfinite(s[5]) and s[6] == np.inf and s[7] == np.inf
    assert s[11] == 0 and s[12] == 0 and s[13] == np.inf and s[14] == 0 and s[15] == 1
    assert s[16] == np.inf and s[17] == 0


@pytest.mark.parametrize("fs", FORMS, ids=lambda f: f.form)
def test_silu(fs):
    x = np.concatenate([np.linspace(-120, 120, 10_001, dtype=np.float32), SPECIALS])
    got = _apply(_vsilu, fs, x)
    with np.errstate(invalid="ignore"):
        want = (x / (F32(1.0) + ggml_v_expf(-x, fs.form))).astype(np.float32)
    assert np.array_equal(got, want, equal_nan=True)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x.astype(np.float64) / (1.0 + np.exp(-x.astype(np.float64)))
    ok = np.isfinite(ref) & (np.abs(ref) > 1e-30)
    assert np.max(np.abs(got[ok] - ref[ok]) / np.abs(ref[ok])) < 5e-7
    assert np.isnan(got[-17])  # silu(-inf) = -inf / inf, as ggml's


@njit(cache=True)
def _dot(fs, a, b, n):
    return dot(fs, a, 0, b, 0, n)


def ggml_vec_dot(a: np.ndarray, b: np.ndarray, lanes: int, half: bool) -> np.float32:
    """numpy model of ggml_vec_dot_f16 / _f32: 4 accumulators of `lanes` over chunks of 4 * lanes
    (one FMA each), GGML_F32_VEC_REDUCE, leftovers one by one."""
    n = a.size
    step = 4 * lanes
    np_ = n - n % step
    acc = np.zeros((4, lanes), np.float32)
    for i in range(0, np_, step):
        acc = _fma(a[i: i + step].reshape(4, lanes), b[i: i + step].reshape(4, lanes), acc)
    x = ((acc[0] + acc[2]).astype(np.float32) + (acc[1] + acc[3]).astype(np.float32)).astype(np.float32)
    if lanes == 16:  # _mm512_reduce_add_ps: halves, then quarters, then pairs
        x = (x[:8] + x[8:]).astype(np.float32)
        t = (x[:4] + x[4:]).astype(np.float32)
        p = (t[:2] + t[2:]).astype(np.float32)
        total = np.float32(p[0] + p[1])
    else:  # AVX2: low + high quarter, then two vhaddps
        t = (x[:4] + x[4:]).astype(np.float32)
        total = np.float32(np.float32(t[0] + t[1]) + np.float32(t[2] + t[3]))
    if half:
        wide = np.float64(total)
        for i in range(np_, n):
            wide += np.float64(np.float32(a[i] * b[i]))
        return np.float32(wide)
    for i in range(np_, n):
        total = np.float32(total + np.float32(a[i] * b[i]))
    return total


@pytest.mark.parametrize("fs", FORMS, ids=lambda f: f.form)
@pytest.mark.parametrize("n", [64, 80, 128, 256, 37])
def test_dot_is_ggmls_vec_dot(fs, n):
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(np.float16).astype(np.float32)  # a query rounded to F16
    b16 = rng.standard_normal(n).astype(np.float16)
    b32 = rng.standard_normal(n).astype(np.float32)
    got16 = _dot(fs, a, b16.view(np.uint16), n)
    got32 = _dot(fs, a, b32, n)
    assert got16 == ggml_vec_dot(a, b16.astype(np.float32), fs.lanes, True)
    assert got32 == ggml_vec_dot(a, b32, fs.lanes, False)
    assert abs(got32 - np.dot(a.astype(np.float64), b32)) < 1e-4


@njit(cache=True)
def _half_round_trip(h, x, y, z):
    for i in range(0, x.size, 8):
        store_f32x8(y, i, load_half_f32x8(h, i))
        store_f32x8_half(h, i, load_f32x8(x, i))
        store_f32x8(z, i, round_half_f32x8(load_f32x8(x, i)))


def test_half_conversions_match_numpy():
    """Loads are exact, stores and rounding are round-to-nearest-even, subnormals, inf, NaN included."""
    bits = np.arange(0, 65536, dtype=np.uint16)
    h = bits.copy()
    x = np.concatenate([np.random.default_rng(1).standard_normal(65536 - 8).astype(np.float32) * 1e-3,
                        np.array([7e4, -7e4, 65504, 65520, 1e-8, 3e-5, np.inf, np.nan], np.float32)])
    y, z = np.empty(65536, np.float32), np.empty(65536, np.float32)
    _half_round_trip(h, x, y, z)
    finite = ~np.isnan(bits.view(np.float16))
    assert np.array_equal(y[finite], bits.view(np.float16)[finite].astype(np.float32))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    same = ~np.isnan(want)
    assert np.array_equal(h[same], want.view(np.uint16)[same]) and np.isnan(h.view(np.float16)[~same]).all()
    assert np.array_equal(z[same], want[same].astype(np.float32))


def test_variants_share_a_form():
    assert float_simd("portable") is float_simd("avx2")
    assert float_simd("avx512_vnni").lanes == 16 and float_simd("avx2").lanes == 8
    assert float_simd("avx512_vnni").form == "avx512"


@njit(cache=True)
def _chunk_sums(fs, x, y, m):
    out = np.empty(x.size // lanes(fs), np.float32)
    for c in range(out.size):
        out[c] = exp_chunk(fs, y, c * lanes(fs), x, c * lanes(fs), m)
    return out


@pytest.mark.parametrize("fs", FORMS, ids=lambda f: f.form)
def test_exp_chunk_sums_in_ggmls_order(fs):
    """A chunk's sum is ggml's: (low half + high half) for 16 lanes, then the 8-lane ladder."""
    rng = np.random.default_rng(2)
    x = rng.uniform(-9, 0, 64 * 16).astype(np.float32)
    y = np.empty_like(x)
    got = _chunk_sums(fs, x, y, np.float32(0.5))
    e = ggml_v_expf((x - np.float32(0.5)).astype(np.float32), fs.form).reshape(-1, fs.lanes)
    assert np.array_equal(y, e.reshape(-1))
    if fs.lanes == 16:
        e = (e[:, :8] + e[:, 8:]).astype(np.float32)
    t = (e[:, :4] + e[:, 4:]).astype(np.float32)
    p = (t[:, :2] + t[:, 2:]).astype(np.float32)
    assert np.array_equal(got, (p[:, 0] + p[:, 1]).astype(np.float32))


@njit(cache=True)
def _swiglu(fs, x, u, y):
    for i in range(0, x.size, lanes(fs)):
        swiglu_chunk(fs, y, i, x, i, u, i)


@pytest.mark.parametrize("fs", FORMS, ids=lambda f: f.form)
def test_swiglu_chunk_is_silu_times_up(fs):
    rng = np.random.default_rng(3)
    x, u = (rng.uniform(-20, 20, 256).astype(np.float32) for _ in range(2))
    y, s = np.empty_like(x), np.empty_like(x)
    _swiglu(fs, x, u, y)
    _vsilu(fs, x, s)
    assert np.array_equal(y, (s * u).astype(np.float32))


@njit(cache=True)
def _expf_both(x, got, libm):
    for i in range(x.size):
        got[i] = expf(x[i])
        libm[i] = np.float32(math.exp(x[i]))  # a call to the C library's expf


def test_inline_expf_has_libms_bits():
    """The inline expf against the C library's (glibc's: checked on every float32 in
    [-104, 89] when written; here a sample, the edges and random bit patterns)."""
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([bits, rng.uniform(-110, 95, 300_000).astype(np.float32), SPECIALS,
                        np.array([88.0, -88.0, 88.72283, 88.72284, -103.97207, -103.97208, 1e-45], np.float32)])
    got, libm = np.empty_like(x), np.empty_like(x)
    _expf_both(x, got, libm)
    assert np.array_equal(got, libm, equal_nan=True)


@njit(cache=True)
def _all_neg_inf(h, off):
    return all_neg_inf_half8(h, off)


def test_all_neg_inf_half8_compares_bits():
    h = np.full(16, -np.inf, np.float16).view(np.uint16)
    assert _all_neg_inf(h, 0) and _all_neg_inf(h, 5)
    for value in (np.nan, -65504.0, np.inf, 0.0):
        g = h.copy()
        g[7] = np.float16(value).view(np.uint16)
        assert not _all_neg_inf(g, 0) and _all_neg_inf(g, 8)
