"""quantize / dequantize: bit-exactness with ggml (golden bytes, reference digests, gguf), error
bounds, block invariants (Q8_1 s, Q8_K bsums), special values and clear errors."""
import hashlib
import importlib.resources
import json

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ggx
from ggx import GGXShapeError, GType
from ggx.quants import dequantize, fp32_to_fp16, nearest_int, quantize

GOLDEN = importlib.resources.files("ggx.conformance").joinpath("golden_ops")
_GAMMA = np.uint64(0x9E3779B97F4A7C15)

# Largest |decoded - x| seen as a fraction of max |x| of the 256-value super-block (for super-blocks
# whose scales are normal f16 numbers). Theory: Q4_0 clamps q=16 to 15 (1/8); Q5_0 clamps q=32 to
# 31 (1/16); Q4_1 half a step of range/15; Q8_x half a step of amax/127 plus f16 rounding of d;
# Q4_K/Q6_K also round their scales.
MAX_REL_ERROR = {
    GType.Q4_0: 0.13, GType.Q5_0: 0.065, GType.Q4_1: 0.07, GType.Q8_0: 0.005, GType.Q8_1: 0.005,
    GType.Q8_K: 0.0041, GType.Q6_K: 0.03, GType.Q4_K: 0.15, GType.Q5_K: 0.08,
}
QUANTIZED = list(MAX_REL_ERROR)


def golden(name: str) -> dict:
    with GOLDEN.joinpath(f"{name}.npz").open("rb") as f:
        z = np.load(f)
        return {k: z[k] for k in z.files}


def golden_index() -> list[dict]:
    return json.loads(GOLDEN.joinpath("index.json").read_text())["cases"]


def splitmix_uniform(seed: int, n: int) -> np.ndarray:
    """n float32 values in [-1, 1) on a 2**-23 grid from a splitmix64 stream: the same on any numpy."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + _GAMMA * np.arange(1, n + 1, dtype=np.uint64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return ((z >> np.uint64(40)).astype(np.float64) * 2.0**-23 - 1.0).astype(np.float32)


def reference_inputs(name: str, n: int = 64 * 256) -> np.ndarray:
    """Deterministic inputs that reach the quantizers' branches (ties, zeros, one sign, spikes)."""
    u = splitmix_uniform(1, n)
    v = splitmix_uniform(2, n)
    if name == "uniform":
        return u
    if name == "cubed":
        return np.float32(3) * u * u * u
    if name == "sparse":
        return np.where(v > np.float32(0.6), u, np.float32(0))
    if name == "halves":  # many exact .5 ties after scaling
        return (np.round(u * np.float32(20)) / np.float32(2)).astype(np.float32)
    if name == "positive":
        return u * np.float32(0.25) + np.float32(1)
    if name == "specials":  # per 256-value block: zero, constant, tiny, spike, half zero, signs, and
        # a tiny first sub-block whose scale is stored as 0 (ggml then keeps its first-pass levels)
        x = u.reshape(-1, 256).copy()
        x[0::8] = 0
        x[1::8] = np.float32(0.75)
        x[2::8] = np.float32(-2)
        x[3::8] *= np.float32(1e-20)
        x[4::8] = 0
        x[4::8, 17] = np.float32(5)
        x[5::8, :128] = 0
        x[6::8, ::2] = -np.abs(x[6::8, ::2])
        x[7::8, :32] *= np.float32(1e-4)
        return x.reshape(-1)
    raise KeyError(name)


# SHA-256 (first 32 hex digits) of the bytes written by ggml's reference C functions
# (quantize_row_{q8_1,q8_K,q4_K,q6_K}_ref of ggml-quants.c, llama.cpp 0c1e57098, built with gcc -O2
# for x86-64 as ggml-base is: no FMA contraction) for reference_inputs(name).
REFERENCE_DIGESTS = {
    ("Q8_1", "uniform"): "ae676b76cae8b907274b7e4163843f06",
    ("Q8_1", "cubed"): "773406afa92191e9e817bfaf3f962060",
    ("Q8_1", "sparse"): "813909b1fa4a6fcb4487bc594caebfb2",
    ("Q8_1", "halves"): "15da763c398a41834af27bb2c91819e3",
    ("Q8_1", "positive"): "5a4edffd59a8e7b140e613210847379f",
    ("Q8_1", "specials"): "030e7dee7b01f4ca55daa52758f95007",
    ("Q8_K", "uniform"): "7015a165bfc3b29884820c4fe9d94869",
    ("Q8_K", "cubed"): "c37bb4317198d39dd0dc8f127af0d60f",
    ("Q8_K", "sparse"): "926d1e12d1c383888a9ea43d9cb5e07e",
    ("Q8_K", "halves"): "d7e5ac2ddfd733761ef1a93168caa74d",
    ("Q8_K", "positive"): "c0a7917b8c0da8fc1883919228bd17a6",
    ("Q8_K", "specials"): "a5a8672bdbe8f0fd99a101e550be9d01",
    ("Q4_K", "uniform"): "738f4913f85e96562d156e6f1a927ee0",
    ("Q4_K", "cubed"): "04efb05ccf561cde397ce457da679434",
    ("Q4_K", "sparse"): "c2ad28197b22d83b81813641c26adba0",
    ("Q4_K", "halves"): "ad801cd38b9d154e7455c9ae07b67064",
    ("Q4_K", "positive"): "da105fb4c7287c84bb87e3576cd76732",
    ("Q4_K", "specials"): "c678a310987af7264448ad09156e889e",
    ("Q6_K", "uniform"): "78f3b7e9077a9ffbd7f3cbc971d59444",
    ("Q6_K", "cubed"): "01abef21f69eaad13a813d9d8cfbe74a",
    ("Q6_K", "sparse"): "9a95191d255db8a7bad426463ca05253",
    ("Q6_K", "halves"): "2aa19bbca4c3fa0e68e088f64e7bb4a1",
    ("Q6_K", "positive"): "63bfbc63cab49afcab6b1d085ae48369",
    ("Q6_K", "specials"): "1dea946486ef0e379be62a5ae343ece0",
    # quantize_row_q5_K_ref of ggml-quants.c (ggml-org/ggml d99724f2, with make_qkx2_quants,
    # nearest_int, get_scale_min_k4 and ggml's portable GGML_FP32_TO_FP16), compiled alone (gcc 12
    # -O2, x86-64); the same harness reproduces the Q4_K digests above. gguf only dequantizes Q5_K.
    ("Q5_K", "uniform"): "9eb686dea413a5a6c8018b0c3c311349",
    ("Q5_K", "cubed"): "ee646dc993dfa27cbdbdb9595b610636",
    ("Q5_K", "sparse"): "139f4cbdf2e56844fd980d5004fcc48a",
    ("Q5_K", "halves"): "0a96198d15af0b99fb3d3b709cdb05d1",
    ("Q5_K", "positive"): "2556097bcd4bcb3e135b9dfcb2b74553",
    ("Q5_K", "specials"): "a48df41cddb72bceefdd415540037225",
    # ggml has no golden Q5_0 data here: quantize_row_q5_0_ref of ggml-quants.c with ggml's portable
    # GGML_FP32_TO_FP16, compiled alone (gcc 12 -O2, x86-64); gguf's quantizer gives the same bytes
    ("Q5_0", "uniform"): "7a941354dd242f5baf17f72054ecadda",
    ("Q5_0", "cubed"): "a9df9cf9cddb2dd662f7e669e65a0368",
    ("Q5_0", "sparse"): "fac18d86cb75c9799d50f436487d5780",
    ("Q5_0", "halves"): "e082eae5c3b4b3aeca2f10d11c4fafde",
    ("Q5_0", "positive"): "8b9b55dee9b17a5c3e29227d4ec57b8e",
    ("Q5_0", "specials"): "2e1d6c416cbcb0462476540f0e4dff76",
}


# ---------------------------------------------------------------- bit-exactness

@pytest.mark.parametrize("key", sorted(REFERENCE_DIGESTS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_bytes_match_ggml_reference_c(key):
    t, name = GType[key[0]], key[1]
    q = quantize(reference_inputs(name), t)
    assert q.dtype == np.uint8 and q.shape == (64 * 256 // t.block_size * t.type_size,)
    assert hashlib.sha256(q.tobytes()).hexdigest()[:32] == REFERENCE_DIGESTS[key]


@pytest.mark.parametrize("case,t", [
    ("cpy_f32_q4_0_96x5", GType.Q4_0), ("cpy_f32_q4_1_96x5", GType.Q4_1),
    ("cpy_f32_q8_0_96x5", GType.Q8_0), ("cpy_f32_f16_37x3_specials", GType.F16),
])
def test_quantize_reproduces_ggml_cpy_bytes(case, t):
    z = golden(case)
    q = quantize(z["in0_values"], t, name=case)
    assert q.shape == z["in0_values"].shape[:-1] + (t.row_size(z["in0_values"].shape[-1]),)
    np.testing.assert_array_equal(q.reshape(-1), z["out_raw"])
    # and ggml's dequantized output back
    deq = dequantize(z["out_raw"], t, z["out_values"].size)
    np.testing.assert_array_equal(deq.view(np.uint32), z["out_values"].reshape(-1).view(np.uint32))


def _golden_quantized_inputs():
    for case in golden_index():
        for i, inp in enumerate(case["inputs"]):
            if inp["type"] in ("q4_0", "q4_1", "q8_0", "q4_K", "q6_K", "f16", "bf16") and "view_of" not in inp:
                yield pytest.param(case["name"], i, GType.parse(inp["type"]), id=f"{case['name']}-in{i}")


@pytest.mark.parametrize("case,i,t", list(_golden_quantized_inputs()))
def test_dequantize_matches_ggml_to_float(case, i, t):
    z = golden(case)
    values = z[f"in{i}_values"]
    deq = dequantize(z[f"in{i}_raw"], t, values.size)
    np.testing.assert_array_equal(deq.view(np.uint32), values.reshape(-1).view(np.uint32))
    if t in (GType.Q4_K, GType.Q6_K):  # and gguf's own decoder agrees
        qt = gguf.GGMLQuantizationType[t.name]
        ref = gguf.quants.dequantize(z[f"in{i}_raw"].reshape(1, -1), qt).reshape(-1)
        np.testing.assert_array_equal(deq, ref)


def test_golden_data_covers_k_quants():
    types = {t.values[2] for t in _golden_quantized_inputs()}
    assert {GType.Q4_K, GType.Q6_K, GType.Q4_0, GType.Q4_1, GType.Q8_0, GType.BF16} <= types


@pytest.mark.parametrize("t", [GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0, GType.BF16])
def test_same_bytes_as_gguf(t):
    x = np.float32(3) * splitmix_uniform(7, 4 * 512).reshape(4, 512) ** 3
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType[t.name])
    np.testing.assert_array_equal(quantize(x, t), ref)


# ---------------------------------------------------------------- round trips and error bounds

@pytest.mark.parametrize("t", list(GType), ids=lambda t: t.name)
def test_round_trip_every_type(t):
    shape = (3, 2, 512)
    x = splitmix_uniform(11, 3 * 2 * 512).reshape(shape) * np.float32(4)
    if t in (GType.I32, GType.I64):
        x = (x * 1000).astype(np.int64) * (1 if t is GType.I32 else 2**31)
    q = quantize(x, t)
    assert q.dtype == np.uint8 and q.shape == (3, 2, t.row_size(512))
    y = dequantize(q, t, x.size).reshape(shape)
    assert y.dtype == np.float32
    if t in (GType.F32, GType.I32, GType.I64):
        np.testing.assert_array_equal(y, x.astype(np.float32))
        if t is GType.I64:
            np.testing.assert_array_equal(q.reshape(-1).view("<i8"), x.reshape(-1))
    elif t is GType.F16:
        np.testing.assert_allclose(y, x, rtol=2**-11)
    elif t is GType.BF16:
        np.testing.assert_allclose(y, x, rtol=2**-8)
    else:
        err = np.abs(y - x).reshape(-1, 256).max(axis=1)
        assert (err <= MAX_REL_ERROR[t] * np.abs(x).reshape(-1, 256).max(axis=1)).all()
        assert err.max() > 0  # it is a lossy type: a no-op quantizer would not pass


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=hnp.arrays(np.float32, 256, elements=st.floats(-1000, 1000, width=32)),
    t=st.sampled_from(QUANTIZED),
)
def test_blocks_decode_within_the_types_error(x, t):
    amax = np.abs(x).max()
    assume(amax >= 0.01)  # keeps every f16 scale a normal number
    q = quantize(x, t)
    y = dequantize(q, t, 256)
    assert np.abs(y - x).max() <= MAX_REL_ERROR[t] * amax
    if t in (GType.Q4_K, GType.Q6_K):  # gguf's decoder reads our bytes the same way
        ref = gguf.quants.dequantize(q.reshape(1, -1), gguf.GGMLQuantizationType[t.name]).reshape(-1)
        np.testing.assert_array_equal(y, ref)


@pytest.mark.parametrize("t", [GType.Q4_K, GType.Q6_K])
def test_k_quants_decoded_by_gguf(t):
    x = np.float32(2) * splitmix_uniform(5, 16 * 256).reshape(16, 256) ** 3
    q = quantize(x, t)
    y = gguf.quants.dequantize(q, gguf.GGMLQuantizationType[t.name])
    assert y.shape == x.shape
    rms = np.sqrt(np.mean((y - x) ** 2)) / np.sqrt(np.mean(x**2))
    assert rms < {GType.Q4_K: 0.1, GType.Q6_K: 0.02}[t]


# ---------------------------------------------------------------- block invariants

def test_q8_k_blocks():
    x = reference_inputs("specials").reshape(-1, 256)
    b = quantize(x, GType.Q8_K).reshape(-1).view(GType.Q8_K.block_dtype)
    qs = b["qs"].astype(np.int32)
    np.testing.assert_array_equal(b["bsums"], qs.reshape(-1, 16, 16).sum(axis=2))
    amax = np.abs(x).max(axis=1)
    live = amax > 0
    # d = max / -127 (max: the signed value of largest |x|), so that value quantizes to -127
    np.testing.assert_array_equal(np.abs(qs[live]).max(axis=1), 127)
    np.testing.assert_allclose(np.abs(b["d"][live]), amax[live] / 127, rtol=1e-6)
    assert (b["d"][~live] == 0).all() and (qs[~live] == 0).all() and (b["bsums"][~live] == 0).all()


def test_q8_1_s_is_d_times_sum_of_q():
    x = reference_inputs("cubed").reshape(-1, 32)
    b = quantize(x, GType.Q8_1).reshape(-1).view(GType.Q8_1.block_dtype)
    d32 = np.abs(x).max(axis=1) / np.float32(127)  # the f32 d before it is stored as f16
    sums = b["qs"].astype(np.int32).sum(axis=1)
    np.testing.assert_array_equal(b["d"], d32.astype(np.float16))
    np.testing.assert_array_equal(b["s"], (sums.astype(np.float32) * d32).astype(np.float16))
    np.testing.assert_allclose(b["s"].astype(np.float32), b["d"].astype(np.float32) * sums, rtol=2e-3, atol=1e-6)


def test_q8_1_rounds_half_away_from_zero_like_roundf():
    # amax 127 makes d = 1 exactly, so q = roundf(x)
    x = np.array([127, 0.5, 1.5, 2.5, -0.5, -2.5, 3.49, -126.5] + [0] * 24, dtype=np.float32)
    b = quantize(x, GType.Q8_1).view(GType.Q8_1.block_dtype)[0]
    np.testing.assert_array_equal(b["qs"][:8], [127, 1, 2, 3, -1, -3, 3, -127])


def test_q5_0_blocks_follow_ggml():
    """d = max / -16 (max: the signed value of largest |x|), q = min(31, (int8)(x / d + 16.5)) split
    into low nibbles (values j and 16 + j share qs[j]) and bit 4 of value j at bit j of qh."""
    x = np.zeros((2, 32), np.float32)
    x[0] = np.arange(32) - 16  # max -16 first: d = 1, q = x + 16 exactly, every 5th bit pattern
    x[0, 0] = -16
    x[1, 3] = 2  # one spike: it and its opposite end of the range
    b = quantize(x, GType.Q5_0).reshape(-1).view(GType.Q5_0.block_dtype)
    assert b.dtype.itemsize == 22 and b["d"][0] == 1.0 and b["d"][1] == np.float16(-0.125)
    q = np.arange(32)
    np.testing.assert_array_equal(b["qs"][0], (q[:16] & 15) | ((q[16:] & 15) << 4))
    assert int(b["qh"][0]) == 0xFFFF0000  # values 16..31 have bit 4 set
    np.testing.assert_array_equal(quantize(x, GType.Q5_0).reshape(-1)[2:6], [0, 0, 0xFF, 0xFF])  # little-endian
    # x = 2 with d = -1/8: 2 * -8 + 16.5 = 0.5 -> q = 0; zeros: 16.5 -> 16 (bit 4 set)
    assert b["qs"][1][3] & 15 == 0 and int(b["qh"][1]) == 0xFFFFFFFF & ~(1 << 3)
    np.testing.assert_array_equal(dequantize(quantize(x, GType.Q5_0), GType.Q5_0, 64).reshape(2, 32), x)


def test_nearest_int_rounds_half_to_even():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4999998, 1e6 + 0.5, -4194303], dtype=np.float32)
    np.testing.assert_array_equal(nearest_int(x), [0, 2, 2, 0, -2, -2, 2, 1000000, -4194303])


def test_zero_blocks():
    z = np.zeros((2, 256), np.float32)
    assert not quantize(z, GType.Q6_K).any()  # ggml memsets an all-zero Q6_K block
    for t in QUANTIZED:
        np.testing.assert_array_equal(dequantize(quantize(z, t), t, 512), 0)


def test_q6_k_largest_scale_is_stored_as_minus_128():
    x = np.float32(3) * splitmix_uniform(3, 8 * 256).reshape(8, 256)
    b = quantize(x, GType.Q6_K).reshape(-1).view(GType.Q6_K.block_dtype)
    # iscale = -128 / max_scale, so the sub-block of largest |scale| stores exactly -128
    assert (b["scales"] == -128).sum(axis=1).min() >= 1
    assert (b["d"] != 0).all()


# ---------------------------------------------------------------- float formats

def test_f16_specials_match_ggml():
    bits = [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FC12345, 0x477FF000,
            0x477FEFFF, 0x33800000, 0x33000000, 0x33000001, 0x80000000, 0x38800000]
    x = np.array(bits, dtype=np.uint32).view(np.float32)
    got = quantize(x, GType.F16).view(np.uint16)
    # inf, -inf, NaNs canonical with sign (ggml's portable fp32->fp16), 65520 -> inf,
    # just below 65520 -> 65504, 2**-24 -> smallest subnormal, 2**-25 tie -> 0, just above -> 1
    expect = [0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7E00, 0x7E00, 0x7C00, 0x7BFF, 0x0001, 0x0000, 0x0001,
              0x8000, 0x0400]
    np.testing.assert_array_equal(got, expect)
    assert fp32_to_fp16(x).dtype == np.float16


def test_bf16_matches_ggml_compute_fp32_to_bf16():
    bits = [0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x7F800001, 0xFF812345, 0x7F7FFFFF,
            0xFF800000, 0x00000001]
    x = np.array(bits, dtype=np.uint32).view(np.float32)
    got = quantize(x, GType.BF16).view(np.uint16)
    # round to nearest even; NaN kept and forced quiet ((bits >> 16) | 64); max float -> inf
    np.testing.assert_array_equal(got, [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x0000])
    np.testing.assert_array_equal(dequantize(got, GType.BF16, 3), [1.0, 1.0, 1.015625])


# ---------------------------------------------------------------- errors and API

def test_wrong_row_length_names_the_tensor():
    with pytest.raises(GGXShapeError, match=r"blk\.0\.attn_q.*100.*Q4_K.*256"):
        quantize(np.zeros((2, 100), np.float32), GType.Q4_K, name="blk.0.attn_q")
    with pytest.raises(GGXShapeError, match=r"'tensor'.*33.*32"):
        quantize(np.zeros(33, np.float32), GType.Q8_0)


def test_dequantize_checks_count_and_bytes():
    data = np.zeros(34 * 2, np.uint8)
    with pytest.raises(GGXShapeError, match=r"40 values of Q8_0.*32"):
        dequantize(data, GType.Q8_0, 40)
    with pytest.raises(GGXShapeError, match=r"96 values need 102 bytes.*68"):
        dequantize(data, GType.Q8_0, 96)
    with pytest.raises(GGXShapeError, match="negative"):
        dequantize(data, GType.Q8_0, -32)
    assert dequantize(data, GType.Q8_0, 32).shape == (32,)  # extra bytes are allowed
    assert dequantize(b"\x00\x00\x80\x3f", "f32", 1)[0] == 1.0  # bytes and type names work too
    assert dequantize(data, GType.Q4_K, 0).shape == (0,)


def test_package_exports():
    x = splitmix_uniform(4, 64)
    np.testing.assert_array_equal(ggx.quantize(x, "q8_0", name="x"), quantize(x, GType.Q8_0))
    np.testing.assert_array_equal(ggx.dequantize(quantize(x, GType.Q8_0), "Q8_0", 64),
                                  dequantize(quantize(x, GType.Q8_0), GType.Q8_0, 64))


def test_large_input_is_chunked_consistently():
    # more blocks than one numpy pass takes: the chunks must join without a seam
    x = reference_inputs("uniform", n=1300 * 256)
    whole = quantize(x, GType.Q8_K)
    parts = np.concatenate([quantize(x[: 700 * 256], GType.Q8_K), quantize(x[700 * 256:], GType.Q8_K)])
    np.testing.assert_array_equal(whole, parts)
