"""ISA detection (CPU flags and OS-enabled register state), selection, forcing, AMX detection, and
the per-ISA products against a numpy model."""
from __future__ import annotations

import platform

import numpy as np
import pytest
from numba import njit

from ggx.errors import GGXUnsupported
from ggx_cpu import isa
from ggx_cpu.isa import dispatch, host, simd

ALL_FEATURES = frozenset(f for v in isa.VARIANTS for f in isa.REQUIRES[v])


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
    assert isa.available()[-1] == "portable" and "avx512_vnni" not in isa.available()


# --- OS enablement: XCR0 ---------------------------------------------------------------------------
def test_xcr0_masks_gate_the_variants():
    """A variant needs its register state enabled in XCR0 as well as its CPU flags: a pure
    function of the bits, checked here for every combination that matters."""
    full = 0b1110_0111  # x87, SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
    assert [v for v in isa.VARIANTS if not isa.missing(v, ALL_FEATURES, full)] == list(isa.VARIANTS)
    avx_only = 0b111  # an OS that saves YMM but not the AVX-512 state
    assert isa.missing("avx512_vnni", ALL_FEATURES, avx_only) == ("OS state: opmask, ZMM_Hi256, Hi16_ZMM",)
    assert isa.missing("avx2", ALL_FEATURES, avx_only) == ()
    no_ymm = 0b1110_0011  # AVX-512 bits without AVX's: neither vector variant may run
    assert isa.missing("avx2", ALL_FEATURES, no_ymm) == ("OS state: AVX (YMM)",)
    assert isa.missing("avx512_vnni", ALL_FEATURES, no_ymm) == ("OS state: AVX (YMM)",)
    assert isa.missing("portable", frozenset(), 0) == ()
    assert isa._select("", ALL_FEATURES, avx_only) == "avx2"
    assert isa._select("", ALL_FEATURES, 0) == "portable"  # XCR0 unreadable: the safe fallback
    assert host.missing_state(host.XCR0_AVX512, full) == 0
    assert host.missing_state(host.XCR0_AVX512, avx_only) == 0b1110_0000


def test_forcing_a_variant_without_os_state_names_it(monkeypatch):
    monkeypatch.setattr(isa, "features", lambda: ALL_FEATURES)
    monkeypatch.setattr(isa, "xcr0", lambda: 0b111)
    monkeypatch.setenv(isa.ENV_VAR, "avx512_vnni")
    with pytest.raises(GGXUnsupported, match="lacks OS state: opmask, ZMM_Hi256, Hi16_ZMM; it can run avx2, portable"):
        isa.active()
    assert isa.available() == ("avx2", "portable")


def test_xcr0_of_this_host_agrees_with_its_flags():
    """The XGETBV read works here (x87 state, bit 0, is always set) and enables what LLVM reports."""
    bits = host.xcr0()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        assert bits == 0
        return
    assert bits & 1
    feats = isa.features()
    if "avx2" in feats:
        assert host.missing_state(host.XCR0_AVX, bits) == 0
    if "avx512f" in feats:
        assert host.missing_state(host.XCR0_AVX512, bits) == 0


# --- AMX ---------------------------------------------------------------------------------------------
AMX_FLAGS = frozenset(host.AMX_FEATURES)
TILE_STATE = host.XCR0_AMX | 0b111


def test_amx_status_paths():
    asked = []

    def grant():
        asked.append(1)

    ok, why = host.amx_status(frozenset({"avx512f"}), TILE_STATE, grant)
    assert not ok and why == "this CPU lacks amx-tile, amx-int8, amx-bf16" and not asked
    ok, why = host.amx_status(AMX_FLAGS, 0b111, grant)
    assert not ok and "XTILECFG, XTILEDATA off in XCR0" in why and not asked
    ok, why = host.amx_status(AMX_FLAGS, TILE_STATE, lambda: "arch_prctl(...) failed: Invalid argument")
    assert (ok, why) == (False, "arch_prctl(...) failed: Invalid argument")
    ok, _ = host.amx_status(AMX_FLAGS, TILE_STATE, grant)
    assert ok and asked == [1]


def test_amx_support_of_this_host():
    """This host's answer, with a reason; a CPU without the AMX flags is refused before any
    permission request."""
    ok, why = isa.amx_support()
    assert isinstance(ok, bool) and why
    lack = [f for f in host.AMX_FEATURES if f not in isa.features()]
    if lack:
        assert not ok and why == f"this CPU lacks {', '.join(lack)}"
    assert isa.amx_support() == (ok, why)  # asked once, remembered


# --- the products, per variant ------------------------------------------------------------------------
def test_dispatch_covers_every_variant():
    assert set(dispatch.VARIANT_MODULES) == set(isa.VARIANTS)
    for m in dispatch.VARIANT_MODULES.values():
        assert isinstance(m.U8S8_SATURATES, bool)
        for name in ("dot_u8s8", "dot_s8s8", "dot_u8s8_scaled"):
            assert callable(getattr(m, name))


@njit(cache=True)
def _products(tok, u, s, w, ysum4, sc, acc):
    lanes = dispatch.dot_u8s8(tok, simd.load_i32x8(acc, 0), simd.load_i8x32(u, 0), simd.load_i8x32(s, 0))
    signed = dispatch.dot_s8s8(tok, simd.zero_i32x8(), simd.load_i8x32(w, 0), simd.load_i8x32(s, 0),
                               simd.load_i32x8(ysum4, 0))
    scaled = dispatch.dot_u8s8_scaled(tok, simd.zero_i32x8(), simd.load_i8x32(u, 0), simd.load_i8x32(s, 0),
                                      simd.load_i16x16(sc, 0))
    out = np.empty(24, np.int32)
    simd.store_i32x8(out, 0, lanes)
    simd.store_i32x8(out, 8, signed)
    simd.store_i32x8(out, 16, scaled)
    return out, dispatch.u8s8_saturates(tok)


@pytest.mark.parametrize("name", isa.available())
def test_8bit_products_match_numpy(name):
    """Every variant's integer products equal exact int32 arithmetic, at the extremes too."""
    rng = np.random.default_rng(0)
    tok = isa.token(name)
    for trial in range(20):
        u = rng.integers(0, 64, 32).astype(np.uint8)  # 4- and 6-bit weights: no vpmaddubsw saturation
        s = rng.integers(-127, 128, 32).astype(np.int8)
        w = rng.integers(-127, 128, 32).astype(np.int8)
        sc = rng.integers(-64, 64, 16).astype(np.int16)
        if trial == 0:
            u[:], s[:], sc[:] = 63, -127, 63
        if trial == 1:
            w[:], s[:] = -127, -127
        acc = rng.integers(-1000, 1000, 8).astype(np.int32)
        ysum4 = s.astype(np.int32).reshape(8, 4).sum(axis=1).astype(np.int32)
        got, saturates = _products(tok, u, s, w, ysum4, sc, acc)
        u64, s64 = u.astype(np.int64), s.astype(np.int64)
        assert (got[:8] == acc + (u64 * s64).reshape(8, 4).sum(axis=1)).all()
        assert (got[8:16] == (w.astype(np.int64) * s64).reshape(8, 4).sum(axis=1)).all()
        pairs = (u64 * s64).reshape(16, 2).sum(axis=1)
        assert (got[16:] == (pairs * sc).reshape(8, 2).sum(axis=1)).all()
        assert saturates == (name == "avx2")


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
