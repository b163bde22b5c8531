"""ggx_cpu.extension, the surface other plugins build kernels from: every public name is there and
documented, and a kernel written only with it (a custom token, in-kernel activation quantization,
the ISA-generic products, shuffled loads, stores) compiles and runs under every ISA variant this
host has, agreeing with numpy."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit

from ggx.types import GType
from ggx_cpu import extension as ext

# --- a kernel written only with the surface -------------------------------------------------------------


class Scale:
    """A compile-time token of this test: a power-of-two factor applied to every result."""

    def __init__(self, name: str, factor: float):
        self.name = name
        self.factor = factor


class ScaleType(ext.TokenType):
    def __init__(self, tok: Scale):
        self.factor = tok.factor
        super().__init__(name=f"Scale({tok.name})")


ext.register_token(Scale, ScaleType)


@ext.token_constant
def factor(t):
    return t.factor


_spread = ext.make_shuffled_load(4, 8, [0, 0, 1, 1, 2, 2, 3, 3], "u32")  # 4 bytes, each on 2 lanes


@njit(cache=True)
def surface_kernel(isa, tok, w, x, out, ints):
    """Rows of 4-bit weights w (16 bytes per 32 values, ggml's Q4 order) dotted with x quantized
    to Q8_0 in the kernel: out[r, c] = factor * sum_b d_cb * (q_rb . y_cb); ints gets the integer
    dots of the first block of each (r, c), and, per row, the spread of its first 4 bytes."""
    n, K = x.shape
    rows = w.shape[0] // (K // 2)
    nb = K // 32
    qs = np.empty(n * K, np.int8)
    d = np.empty(n * nb, np.float32)
    s = np.empty(n * nb, np.float32)
    s4 = np.empty(n * K // 4, np.int32)
    ext.quantize_rows_q8(x, qs, d, s, s4, 0, n)
    for r in range(rows):
        for c in range(n):
            acc = ext.zero_f32x8()
            for b in range(nb):
                lanes = ext.dot_u8s8(isa, ext.zero_i32x8(), ext.nibbles_at(w, r * K // 2 + b * 16),
                                     ext.load_i8x32(qs, c * K + b * 32))
                if b == 0:
                    ext.store_i32x8(ints, (r * n + c) * 8, lanes)
                acc = ext.fma_i32x8_f32x8(acc, lanes, ext.splat_f32x8(ext.at(d, c * nb + b)))
            out[r * n + c] = ext.hsum_f32x8(ext.mul_f32x8(acc, ext.splat_f32x8(factor(tok))))
        spread = ext.i32x8_to_f32x8(_spread(w, r * K // 2))
        tmp = np.empty(8, np.float32)
        ext.store_f32x8(tmp, 0, spread)
        ints[(rows * n + r) * 8] = np.int32(ext.lane(ext.load_f32x8(tmp, 0), 7))


def nibble_values(w: np.ndarray, K: int) -> np.ndarray:
    """[rows, K] values 0..15 of 4-bit weights in ggml's Q4 order (per 16 bytes: low nibbles, then high)."""
    b = w.reshape(-1, K // 32, 16).astype(np.int64)
    return np.concatenate([b & 15, b >> 4], axis=2).reshape(-1, K)


def test_every_public_name_is_there_and_documented():
    assert len(set(ext.__all__)) == len(ext.__all__)
    for name in ext.__all__:
        obj = getattr(ext, name)
        assert obj is not None, name
        if callable(obj) and not isinstance(obj, type):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
    assert ext.VARIANTS[-1] == "portable" and set(ext.available()) <= set(ext.VARIANTS)


@pytest.mark.parametrize("variant", ext.available())
def test_surface_kernel_matches_numpy(variant):
    rng = np.random.default_rng(3)
    K, rows, n = 96, 3, 2
    w = rng.integers(0, 256, rows * K // 2).astype(np.uint8)
    x = rng.standard_normal((n, K)).astype(np.float32)
    out = np.full(rows * n, np.nan, np.float32)
    ints = np.zeros((rows * n + rows) * 8, np.int32)
    ext.launch(surface_kernel, ext.token(variant), Scale("x2", 2.0), w, x, out, ints)()

    act = ext.quantize_act(x, GType.Q8_0)
    y = act.qs.reshape(n, K).astype(np.int64)
    q = nibble_values(w, K)
    block = (q.reshape(rows, 1, K // 32, 32) * y.reshape(1, n, K // 32, 32)).sum(axis=3)  # [r, c, b]
    lanes = (q[:, None, :32] * y[None, :, :32]).reshape(rows, n, 8, 4).sum(axis=3)
    assert (ints[: rows * n * 8].reshape(rows, n, 8) == lanes).all()  # the ISA's product, exactly
    terms = block * act.d.reshape(1, n, K // 32)
    want, size = 2.0 * terms.sum(axis=2), 2.0 * np.abs(terms).sum(axis=2)
    assert (np.abs(out.reshape(rows, n) - want) <= 1e-6 * size).all()  # float32 rounding of a few sums
    assert (ints[rows * n * 8::8] == w.reshape(rows, -1)[:, 3]).all()  # lane 7 of the spread = byte 3


def test_token_types_are_per_token():
    """Kernels specialize per token type: two tokens give two compiled variants, one type each."""
    a, b = Scale("a", 1.0), Scale("b", 4.0)

    @njit
    def k(tok):
        return factor(tok)

    assert (k(a), k(b), k(a)) == (1.0, 4.0, 1.0)
    assert len(k.signatures) == 2
    assert isinstance(numba.typeof(ext.token("portable")), ext.IsaType)


def test_make_shuffled_load_refuses_bad_patterns():
    with pytest.raises(ValueError, match="8 lanes of u32"):
        ext.make_shuffled_load(4, 8, [0, 1, 2, 3], "u32")
    with pytest.raises(ValueError, match="pattern"):
        ext.make_shuffled_load(4, 8, [0, 0, 1, 1, 2, 2, 3, 4], "u32")
