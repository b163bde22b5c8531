"""GGUF loading and validation: real files load; corrupted files give a clear GGXFormatError."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf_synth import write_tiny_llama

from ggx.errors import GGXError, GGXFormatError
from ggx.models import GGUFFile, Tokenizer, check_header, read_hparams
from ggx.types import GType


def _load_all(path: Path) -> None:
    """Everything load_model reads before touching a device."""
    f = GGUFFile(path)
    read_hparams(f)
    Tokenizer.from_gguf(f)


def _tensor_info_offset(raw: bytes, name: str) -> int:
    """Byte offset of the tensor info of `name` (its name length field) in a GGUF header."""
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = raw.find(key)
    assert pos > 0
    return pos


def test_real_file_loads(smollm2_path):
    f = GGUFFile(smollm2_path)
    _, hp = read_hparams(f)
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_vocab) == (30, 576, 9, 3, 49152)
    assert hp.rope_freq_base == 100000.0 and hp.tied_output
    emb = f.tensor("token_embd.weight")
    assert emb.type is GType.Q8_0 and emb.ne == (576, 49152)
    assert np.shares_memory(emb.data, f.memory) and not emb.data.flags.writeable  # a view of the map, no copy
    assert f.tensor("blk.0.attn_q.weight").type is GType.Q4_1


def test_tiny_file_roundtrip(tiny_llama):
    f = GGUFFile(tiny_llama)
    arch, hp = read_hparams(f)
    assert arch.name == "llama" and hp.n_layer == 2 and hp.head_dim == 16 and hp.n_embd_kv == 32
    assert set(arch.expected_tensors(hp)) <= set(f.tensors)


def test_real_file_truncated_anywhere(smollm2_path):
    """check_header on prefixes of the real file (memory-mapped slices: nothing is copied)."""
    mm = np.memmap(smollm2_path, dtype=np.uint8, mode="r")
    size = len(mm)
    cuts = [0, 3, 4, 7, 8, 15, 23, 24, 100, 1000, 5000, 50_000, 500_000, 1_785_000, 1_785_700,
            size // 3, size // 2, size - 1000, size - 1]
    cuts += list(np.random.default_rng(0).integers(0, size, 20))
    for n in cuts:
        with pytest.raises(GGXFormatError, match="truncated|magic"):
            check_header(mm[:n], "smollm2")
    assert len(check_header(mm, "smollm2")) == 272


def test_tiny_file_truncated_at_every_header_offset(tiny_llama, tmp_path):
    raw = tiny_llama.read_bytes()
    data_start = min(t.offset for t in GGUFFile(tiny_llama).tensors.values())
    cuts = list(range(0, data_start, 7)) + [data_start, data_start + 1, len(raw) // 2, len(raw) - 1]
    p = tmp_path / "cut.gguf"
    for n in cuts:
        p.write_bytes(raw[:n])
        with pytest.raises(GGXFormatError):
            _load_all(p)


def test_flipped_header_bytes_never_crash(tiny_llama, tmp_path):
    """Every flipped header byte either still loads or raises a GGXError naming the problem."""
    raw = bytearray(tiny_llama.read_bytes())
    data_start = min(t.offset for t in GGUFFile(tiny_llama).tensors.values())
    rng = np.random.default_rng(1)
    positions = sorted(set(range(0, 64)) | set(rng.integers(0, data_start, 150).tolist()))
    p = tmp_path / "flip.gguf"
    outcomes = {"ok": 0, "error": 0}
    for pos in positions:
        for mask in (0xFF, 0x80):
            bad = bytearray(raw)
            bad[pos] ^= mask
            p.write_bytes(bytes(bad))
            try:
                _load_all(p)
                outcomes["ok"] += 1
            except GGXError as e:
                assert str(e), "the error must say what is wrong"
                outcomes["error"] += 1
    assert outcomes["error"] > 50  # most header bytes matter


@pytest.mark.parametrize("field,value,match", [
    ("tensor_count", 2**63, "absurd tensor count"),
    ("kv_count", 2**40, "absurd key/value count"),
    ("version", 7, "unsupported GGUF version"),
    ("magic", b"GGML", "bad magic"),
])
def test_absurd_header_counts(tiny_llama, tmp_path, field, value, match):
    raw = bytearray(tiny_llama.read_bytes())
    if field == "magic":
        raw[0:4] = value
    elif field == "version":
        raw[4:8] = struct.pack("<I", value)
    elif field == "tensor_count":
        raw[8:16] = struct.pack("<Q", value)
    else:
        raw[16:24] = struct.pack("<Q", value)
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(raw))
    with pytest.raises(GGXFormatError, match=match):
        GGUFFile(p)


def test_absurd_array_and_string_lengths(tiny_llama, tmp_path):
    raw = tiny_llama.read_bytes()
    key = b"tokenizer.ggml.tokens"
    pos = raw.find(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", raw, pos)[0] == 9  # an array
    count_at = pos + 4 + 4  # value type, element type, then the u64 count
    bad = bytearray(raw)
    bad[count_at:count_at + 8] = struct.pack("<Q", 2**60)
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(bad))
    with pytest.raises(GGXFormatError, match="truncated"):
        GGUFFile(p)
    bad = bytearray(raw)
    first_len_at = count_at + 8
    bad[first_len_at:first_len_at + 8] = struct.pack("<Q", 2**62)  # first token's string length
    p.write_bytes(bytes(bad))
    with pytest.raises(GGXFormatError, match="truncated"):
        GGUFFile(p)


def test_unknown_type_and_bad_dims(tiny_llama, tmp_path):
    raw = tiny_llama.read_bytes()
    name = "blk.0.attn_q.weight"
    at = _tensor_info_offset(raw, name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    type_at = at + 4 + 8 * n_dims
    p = tmp_path / "bad.gguf"
    bad = bytearray(raw)
    bad[type_at:type_at + 4] = struct.pack("<I", 99)
    p.write_bytes(bytes(bad))
    with pytest.raises(GGXFormatError, match="unknown or unsupported ggml type id 99"):
        GGUFFile(p)
    bad = bytearray(raw)
    bad[at:at + 4] = struct.pack("<I", 9)
    p.write_bytes(bytes(bad))
    with pytest.raises(GGXFormatError, match="9 dimensions"):
        GGUFFile(p)
    bad = bytearray(raw)
    bad[at + 4:at + 12] = struct.pack("<Q", 2**50)  # ne0 absurd
    p.write_bytes(bytes(bad))
    with pytest.raises(GGXFormatError, match="absurd dimensions|truncated"):
        GGUFFile(p)


def test_missing_tensor_and_shape_mismatch(tmp_path):
    p = write_tiny_llama(tmp_path / "untied.gguf", tied=False)
    raw = p.read_bytes()
    name = "output.weight"  # rename it: the file then lacks output.weight but is otherwise valid
    bad = bytearray(raw)
    at = _tensor_info_offset(raw, name) + 8
    bad[at:at + len(name)] = b"outpux.weight"
    p2 = tmp_path / "missing.gguf"
    p2.write_bytes(bytes(bad))
    f = GGUFFile(p2)
    _, hp = read_hparams(f)  # no output.weight: the model is read as tied
    assert hp.tied_output
    bad = bytearray(raw)
    name = "blk.1.ffn_up.weight"
    at = _tensor_info_offset(raw, name) + 8
    bad[at:at + len(name)] = b"blk.1.ffn_uq.weight"
    p2.write_bytes(bytes(bad))
    with pytest.raises(GGXFormatError, match="missing tensor 'blk.1.ffn_up.weight'"):
        _load_all(p2)


def test_metadata_disagreeing_with_shapes(tmp_path):
    p = write_tiny_llama(tmp_path / "t.gguf")
    raw = p.read_bytes()
    key = b"llama.feed_forward_length"
    at = raw.find(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4
    bad = bytearray(raw)
    bad[at:at + 4] = struct.pack("<I", 128)  # the tensors say 96
    p.write_bytes(bytes(bad))
    with pytest.raises(GGXFormatError, match=r"ffn_gate.weight' has ne \[64, 96\], the metadata implies \[64, 128\]"):
        _load_all(p)


def test_not_a_file(tmp_path):
    with pytest.raises(GGXFormatError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGXFormatError):
        GGUFFile(empty)


def test_metadata_matches_gguf_reader(tmp_path):
    """read_header gives the values (and Python types) gguf's GGUFReader gives, for every value type."""
    import gguf

    from ggx.models import read_header

    p = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -5)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -300)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -70000)
    w.add_float32("k.f32", 0.1)
    w.add_uint64("k.u64", 2**40)
    w.add_int64("k.i64", -(2**40))
    w.add_float64("k.f64", 1e-300)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo ✓")
    w.add_array("k.ints", [1, -2, 3])
    w.add_array("k.floats", [0.5, 1.25])
    w.add_array("k.strs", ["a", "", "ü€"])
    w.add_array("k.bools", [True, False])
    w.add_tensor("t", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(p), "r")
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    meta, infos = read_header(np.memmap(p, dtype=np.uint8, mode="r"), str(p))
    assert meta.keys() == expected.keys()
    for key, value in expected.items():
        got = meta[key]
        if key in ("k.ints", "k.floats", "k.bools"):  # arrays of numbers: read-only numpy copies
            assert isinstance(got, np.ndarray) and not got.flags.writeable and got.base is None, key
            got = got.tolist()
        assert got == value and type(got) is type(value), key
        if isinstance(value, list):
            assert [type(x) for x in got] == [type(x) for x in value], key
    assert [t.name for t in infos] == ["t"]


def test_invalid_utf8_token_is_a_format_error(tiny_llama, tmp_path):
    raw = tiny_llama.read_bytes()
    key = b"tokenizer.ggml.tokens"
    first_len_at = raw.find(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 4 + 8
    n = struct.unpack_from("<Q", raw, first_len_at)[0]
    bad = bytearray(raw)
    bad[first_len_at + 8: first_len_at + 8 + n] = b"\xff" * n
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(bad))
    with pytest.raises(GGXFormatError, match="element 0 of value of 'tokenizer.ggml.tokens' is not valid UTF-8"):
        GGUFFile(p)


def _patched(src: Path, dst: Path, key: str, fmt: str, value) -> Path:
    """A copy of `src` with the value of metadata `key` (of struct format `fmt`) replaced."""
    raw = bytearray(src.read_bytes())
    k = key.encode()
    at = raw.find(struct.pack("<Q", len(k)) + k)
    assert at > 0, key
    at += 8 + len(k) + 4  # length, key, value type
    raw[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("key, fmt, value, match", [
    ("llama.attention.layer_norm_rms_epsilon", "<f", float("nan"), "epsilon"),
    ("llama.attention.layer_norm_rms_epsilon", "<f", -1e-5, "epsilon"),
    ("llama.attention.layer_norm_rms_epsilon", "<f", float("inf"), "epsilon"),
    ("llama.rope.freq_base", "<f", 0.0, "RoPE base"),
    ("llama.rope.freq_base", "<f", float("nan"), "RoPE base"),
    ("llama.rope.freq_base", "<f", -10000.0, "RoPE base"),
    ("llama.rope.freq_base", "<f", float("inf"), "RoPE base"),
    ("llama.rope.dimension_count", "<I", 0, "at least 1"),
    ("llama.rope.dimension_count", "<I", 7, "even"),
    ("llama.rope.dimension_count", "<I", 32, "head size 16"),
    ("llama.context_length", "<I", 0, "at least 1"),
    ("llama.attention.head_count", "<I", 5, "not a multiple of llama.attention.head_count 5"),
    ("llama.attention.head_count", "<I", 0, "at least 1"),
    ("llama.attention.head_count_kv", "<I", 3, "not a multiple of llama.attention.head_count_kv 3"),
    ("llama.embedding_length", "<I", 0, "at least 1"),
    ("llama.feed_forward_length", "<I", 0, "at least 1"),
])
def test_values_that_would_compute_garbage_are_refused(tiny_llama, tmp_path, key, fmt, value, match):
    p = _patched(tiny_llama, tmp_path / "bad.gguf", key, fmt, value)
    with pytest.raises(GGXFormatError, match=match) as e:
        _load_all(p)
    assert key in str(e.value)


def _with_tensor_field(src: Path, dst: Path, name: str, field: str, value: int) -> Path:
    """A copy of `src` with the type id or the data offset of tensor `name` replaced."""
    raw = bytearray(src.read_bytes())
    at = _tensor_info_offset(bytes(raw), name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    at += 4 + 8 * n_dims + (0 if field == "type" else 4)
    fmt = "<I" if field == "type" else "<Q"
    raw[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    dst.write_bytes(bytes(raw))
    return dst


def _offset_of(path: Path, name: str) -> int:
    f = GGUFFile(path)
    return f.tensor(name).offset - min(t.offset for t in f.tensors.values())


def test_overlapping_tensor_data_is_refused(tiny_llama, tmp_path):
    first = _offset_of(tiny_llama, "blk.0.attn_norm.weight")
    p = _with_tensor_field(tiny_llama, tmp_path / "overlap.gguf", "blk.0.attn_q.weight", "offset", first)
    with pytest.raises(GGXFormatError, match=r"'blk.0.attn_q.weight': data offset \d+, expected \d+ where "
                                             r"'blk.0.attn_norm.weight' \(F32\[64\], 256 bytes\) ends"):
        GGUFFile(p)


def test_a_type_that_does_not_match_the_bytes_is_refused(tiny_llama, tmp_path):
    assert GGUFFile(tiny_llama).tensor("blk.0.attn_q.weight").type is GType.Q4_1
    p = _with_tensor_field(tiny_llama, tmp_path / "q40.gguf", "blk.0.attn_q.weight", "type", GType.Q4_0.ggml_id)
    with pytest.raises(GGXFormatError, match=r"'blk.0.attn_k.weight'.* where 'blk.0.attn_q.weight' \(Q4_0"):
        GGUFFile(p)
    last = list(GGUFFile(tiny_llama).tensors)[-1]
    assert GGUFFile(tiny_llama).tensor(last).type is GType.F32
    p = _with_tensor_field(tiny_llama, tmp_path / "f16.gguf", last, "type", GType.F16.ggml_id)
    with pytest.raises(GGXFormatError, match=rf"128 bytes follow the data of the last tensor, where '{last}' \(F16"):
        GGUFFile(p)
