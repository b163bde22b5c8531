"""GType traits: block layouts and ids agree with the gguf package (GGUF's own definitions)."""
import gguf
import numpy as np
import pytest

from ggx import GGXShapeError, GType


@pytest.mark.parametrize("t", list(GType), ids=lambda t: t.name)
def test_traits_match_gguf(t):
    qt = gguf.GGMLQuantizationType[t.name]
    assert t.ggml_id == qt.value
    if t is GType.Q8_1:
        # gguf-py still lists the old 40-byte layout (f32 d, f32 s); ggml-common.h's block_q8_1
        # is 2 x f16 + 32 x i8 and static_asserts 36 bytes. Q8_1 never appears in GGUF files.
        assert (t.block_size, t.type_size) == (32, 36)
    else:
        assert (t.block_size, t.type_size) == gguf.GGML_QUANT_SIZES[qt]
    assert t.block_dtype.itemsize == t.type_size  # the structured dtype has no padding
    assert GType.from_ggml_id(t.ggml_id) is t


@pytest.mark.parametrize("t", [t for t in GType if t.is_quantized], ids=lambda t: t.name)
def test_block_dtype_holds_block_size_values(t):
    # The low bits of every value sit in `qs` (or Q6_K's `ql`): 4 bits each for 4- and 6-bit types.
    fields = t.block_dtype.fields
    low = fields["ql" if "ql" in fields else "qs"][0].itemsize * 8
    low_bits = 8 if t.name.startswith("Q8") else 4
    assert low // low_bits == t.block_size


def test_vec_dot_types_are_ggmls():
    expect = {
        GType.Q4_0: GType.Q8_0, GType.Q5_0: GType.Q8_0, GType.Q8_0: GType.Q8_0, GType.Q4_1: GType.Q8_1,
        GType.Q4_K: GType.Q8_K, GType.Q5_K: GType.Q8_K, GType.Q6_K: GType.Q8_K, GType.F16: GType.F16,
        GType.BF16: GType.BF16, GType.F32: GType.F32, GType.I32: None,
    }
    for t, v in expect.items():
        assert t.vec_dot_type is v, t


def test_kind_predicates():
    assert {t for t in GType if t.is_float} == {GType.F32, GType.F16, GType.BF16}
    assert not GType.I32.is_quantized and GType.Q8_K.is_quantized and not GType.F16.is_quantized


def test_row_size():
    assert GType.Q4_0.row_size(64) == 36
    assert GType.Q5_0.row_size(640) == 440  # Gemma 3 270M's attn_q / ffn_up rows
    assert GType.Q6_K.row_size(512) == 420
    assert GType.F16.row_size(3) == 6
    with pytest.raises(GGXShapeError, match=r"w: 100 values of Q8_0.*32"):
        GType.Q8_0.row_size(100, what="w")


def test_parse():
    assert GType.parse("q4_k") is GType.Q4_K
    assert GType.parse(GType.F32) is GType.F32
    with pytest.raises(ValueError, match="q3_x"):
        GType.parse("q3_x")
    with pytest.raises(KeyError):
        GType.from_ggml_id(999)


def test_block_dtype_field_offsets_follow_ggml_structs():
    # ggml-common.h: block_q6_K is {ql[128], qh[64], scales[16], d}; block_q8_K is {d, qs, bsums}.
    q6 = GType.Q6_K.block_dtype
    assert [q6.fields[f][1] for f in ("ql", "qh", "scales", "d")] == [0, 128, 192, 208]
    # block_q5_0 is {d, qh[4], qs[16]}: qh read as one little-endian uint32 (ggml memcpy's it)
    q5 = GType.Q5_0.block_dtype
    assert [q5.fields[f][1] for f in ("d", "qh", "qs")] == [0, 2, 6]
    assert q5.fields["qh"][0] == np.dtype("<u4") and q5.itemsize == 22
    q8k = GType.Q8_K.block_dtype
    assert [q8k.fields[f][1] for f in ("d", "qs", "bsums")] == [0, 4, 260]
    assert q8k.fields["bsums"][0] == np.dtype(("<i2", (16,)))
