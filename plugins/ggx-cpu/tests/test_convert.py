"""ggx_cpu.kernels.convert: row (de)quantization bit-exact with ggml (gguf.quants is ggml's Python port)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.types import GType
from ggx_cpu.kernels import convert


def _rows(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: d = 0, id guarded
    x[1, :32] = 7.0  # a constant block
    x[2, 5] = 1e-30  # tiny values next to ordinary ones
    x[3] *= 1e4  # large values
    x[4, :32] = np.linspace(-1, 1, 32)  # exact .5 cases after scaling
    return x


@pytest.mark.parametrize("name", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_quantize_bit_exact(name):
    x = _rows()
    mine = convert.quantize(x, GType[name])
    ref = quants.quantize(x, QT[name]).view(np.uint8).reshape(mine.shape)
    assert np.array_equal(mine, ref)


def test_f16_rounding_specials():
    x = np.array([65520.0, 65519.996, 2.98e-8, 2.99e-8, np.inf, -np.inf, 0.0, -0.0, 6.1e-5, 1.0009766],
                 np.float32)
    mine = convert.quantize(x[None], GType.F16).view(np.uint16)[0]
    with np.errstate(over="ignore"):
        assert np.array_equal(mine, x.astype(np.float16).view(np.uint16))
    nan = convert.quantize(np.array([[np.nan]], np.float32), GType.F16).view(np.float16)
    assert np.isnan(nan[0, 0])


@pytest.mark.parametrize("name", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_dequantize_matches_ggml(name):
    gtype = GType[name]
    rng = np.random.default_rng(1)
    if name in ("Q4_K", "Q6_K"):
        raw = rng.integers(0, 256, size=(4, gtype.type_size), dtype=np.uint8)
        d = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if name == "Q4_K":
            raw[:, 0:2] = d
            raw[:, 2:4] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
        else:
            raw[:, 208:210] = d
        n = 256
    else:
        raw = quants.quantize(_rows(2), QT[name]).view(np.uint8)
        n = 256
    mine = convert.dequantize(raw, gtype, n)
    ref = quants.dequantize(raw.reshape(-1, gtype.row_size(n)), QT[name]).reshape(mine.shape)
    assert np.array_equal(mine, ref)


def test_q5_0_every_fifth_bit_pattern():
    """Random bytes (any qh word, any nibbles) decode as ggml's dequantize_row_q5_0 does, and the
    quantizer's output reads back through gguf's decoder."""
    rng = np.random.default_rng(5)
    blocks = np.frombuffer(rng.bytes(64 * 22), GType.Q5_0.block_dtype).copy()
    blocks["d"] = rng.uniform(-2, 2, 64).astype(np.float16)
    raw = blocks.view(np.uint8).reshape(8, -1)
    ref = quants.dequantize(raw, QT.Q5_0)
    assert np.array_equal(convert.dequantize(raw, GType.Q5_0, 256), ref)
    x = _rows(4)
    assert np.array_equal(convert.dequantize(convert.quantize(x, GType.Q5_0), GType.Q5_0, 256),
                          quants.dequantize(quants.quantize(x, QT.Q5_0), QT.Q5_0))


def test_dequantize_q8_k_and_q8_1():
    rng = np.random.default_rng(3)
    q = rng.integers(-127, 128, size=256).astype(np.int8)
    blk = np.zeros(1, GType.Q8_K.block_dtype)
    blk["d"], blk["qs"] = 0.25, q
    assert np.array_equal(convert.dequantize(blk.view(np.uint8), GType.Q8_K, 256)[0], q * np.float32(0.25))
    b1 = np.zeros(8, GType.Q8_1.block_dtype)
    b1["d"], b1["qs"] = 0.5, q.reshape(8, 32)
    assert np.array_equal(convert.dequantize(b1.view(np.uint8), GType.Q8_1, 256)[0], q * np.float32(0.5))


def test_bad_input_is_refused():
    with pytest.raises(GGXUnsupported):
        convert.quantize(np.zeros((1, 256), np.float32), GType.Q8_K)
    with pytest.raises(GGXShapeError):
        convert.quantize(np.zeros((1, 33), np.float32), GType.Q4_0)
    with pytest.raises(GGXShapeError):
        convert.dequantize(np.zeros(19, np.uint8), GType.Q4_0, 32)
