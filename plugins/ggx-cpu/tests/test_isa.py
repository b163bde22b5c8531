"""ISA detection, selection, forcing, and the per-ISA building blocks against a numpy model."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from ggx.errors import GGXUnsupported
from ggx_cpu import isa
from ggx_cpu.isa import portable, simd, vector


def test_features_and_available():
    feats = isa.features()
    assert isinstance(feats, frozenset) and feats
    avail = isa.available()
    assert avail[-1] == "portable"  # portable runs everywhere, and is listed last (worst)
    assert list(avail) == [v for v in isa.VARIANTS if v in avail]
    for v in avail:
        assert isa.missing(v) == ()
    if "avx512vnni" in feats and "avx512vl" in feats:
        assert avail[0] == "avx512_vnni"


def test_default_is_best(monkeypatch):
    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    assert isa.active() == isa.available()[0]


@pytest.mark.parametrize("name", isa.available())
def test_env_forces_variant(monkeypatch, name):
    monkeypatch.setenv(isa.ENV_VAR, name.upper())
    assert isa.active() == name
    assert isa.token().name == name


def test_env_refuses_unknown_and_missing(monkeypatch):
    monkeypatch.setenv(isa.ENV_VAR, "sse9")
    with pytest.raises(GGXUnsupported, match="unknown ISA variant 'sse9'"):
        isa.active()
    monkeypatch.setattr(isa, "features", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setenv(isa.ENV_VAR, "avx512_vnni")
    with pytest.raises(GGXUnsupported, match="lacks avx512f, avx512bw, avx512vl, avx512vnni"):
        isa.active()
    assert isa.available() == ("avx2", "portable")


def test_variant_modules_declare_their_requirements():
    from ggx_cpu.isa import avx2, avx512_vnni

    for mod in (avx2, avx512_vnni, portable):
        assert isa.REQUIRES[mod.NAME] == mod.REQUIRES


@njit(cache=True)
def _u8s8(tok, u, s, acc):
    lanes = vector.dot_u8s8(tok, simd.load_i32x8(acc, 0), simd.load_i8x32(u, 0), simd.load_i8x32(s, 0))
    return simd.hsum_f32x8(simd.fma_i32x8_f32x8(simd.zero_f32x8(), lanes, simd.splat_f32x8(np.float32(1.0))))


@njit(cache=True)
def _s8s8(tok, w, y, ysum4):
    lanes = vector.dot_s8s8(tok, simd.zero_i32x8(), simd.load_i8x32(w, 0), simd.load_i8x32(y, 0),
                            simd.load_i32x8(ysum4, 0))
    return simd.hsum_f32x8(simd.fma_i32x8_f32x8(simd.zero_f32x8(), lanes, simd.splat_f32x8(np.float32(1.0))))


@pytest.mark.parametrize("name", [v for v in isa.available() if v != "portable"])
def test_8bit_products_match_numpy(name):
    """The ISA's integer products equal exact int32 arithmetic, at the extremes too."""
    rng = np.random.default_rng(0)
    tok = isa.token(name)
    for trial in range(20):
        u = rng.integers(0, 16, 32).astype(np.uint8)  # 4-bit weights
        s = rng.integers(-127, 128, 32).astype(np.int8)
        if trial == 0:
            u[:], s[:] = 15, -127
        acc = rng.integers(-1000, 1000, 8).astype(np.int32)
        assert _u8s8(tok, u, s, acc) == int(acc.sum()) + int(np.dot(u.astype(np.int64), s))
        w = rng.integers(-127, 128, 32).astype(np.int8)
        if trial == 1:
            w[:], s[:] = -127, -127
        ysum4 = s.astype(np.int32).reshape(8, 4).sum(axis=1).astype(np.int32)
        assert _s8s8(tok, w, s, ysum4) == int(np.dot(w.astype(np.int64), s))


def test_f16_bits_to_f32_exact():
    @njit
    def conv(h):
        out = np.empty(h.size, np.float32)
        for i in range(h.size):
            out[i] = simd.f16_bits_to_f32(h[i])
        return out

    h = np.arange(0, 1 << 16, dtype=np.uint32)
    finite = (h & 0x7C00) != 0x7C00
    want = h.astype(np.uint16).view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(conv(h)[finite], want[finite])
