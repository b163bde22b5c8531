"""Layouts: each transform against a straightforward per-byte loop (ggml's make_block_* form),
round trips, sizes, and the selection table."""
from __future__ import annotations

import numpy as np
import pytest

from ggx.errors import GGXShapeError
from ggx.quants import quantize
from ggx.types import GType
from ggx_repack.layouts import LAYOUTS, interleave, k4_pack_scales, k4_scales_mins, optimal_layout, repack, unpack


def loop_repack(lay, raw: np.ndarray, K: int, M: int) -> np.ndarray:
    """The layout written the obvious way: one group block at a time, one quant byte at a time."""
    t = lay.gtype
    blocks = raw.view(t.block_dtype).reshape(M, K // t.block_size)
    out = []
    for g in range(M // lay.nrows):
        for b in range(K // t.block_size):
            rows = [blocks[g * lay.nrows + r, b] for r in range(lay.nrows)]
            head = b"".join(r["d"].tobytes() for r in rows)
            if t is GType.Q4_1:
                head += b"".join(r["m"].tobytes() for r in rows)
            if t is GType.Q5_0:  # per quant load k (rows 4 (k % 2)..+3, bytes 8 (k // 2)..+7):
                for k in range(4):  # the fifth bit of each lane's low nibble value, then high
                    for hi in (0, 1):
                        word = 0
                        for i in range(32):
                            r, j = 4 * (k % 2) + i // 8, 8 * (k // 2) + i % 8
                            word |= ((int(rows[r]["qh"]) >> (j + 16 * hi)) & 1) << i
                        head += word.to_bytes(4, "little")
            if t is GType.Q4_K:
                head += b"".join(r["dmin"].tobytes() for r in rows)
                dec = []
                for r in rows:  # ggml's get_scale_min_k4, value by value
                    s = [int(x) for x in r["scales"]]
                    sc, mn = [], []
                    for j in range(8):
                        if j < 4:
                            sc.append(s[j] & 63)
                            mn.append(s[j + 4] & 63)
                        else:
                            sc.append((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4))
                            mn.append((s[j + 4] >> 4) | ((s[j] >> 6) << 4))
                    dec.append((sc, mn))
                head += bytes(dec[r][0][j] for j in range(8) for r in range(lay.nrows))
                head += bytes(dec[r][1][j] for j in range(8) for r in range(lay.nrows))
            if t is GType.Q6_K:  # the sixteen scales, sub-block by sub-block; ql and qh interleaved
                head += bytes(int(rows[r]["scales"][j]) & 0xFF for j in range(16) for r in range(lay.nrows))
                fields = [[bytes(r[f].view(np.uint8)) for r in rows] for f in ("ql", "qh")]
            else:
                fields = [[bytes(r["qs"].view(np.uint8)) for r in rows]]
            n, bl = lay.nrows, lay.interleave
            body = bytearray()
            for qs in fields:
                part = bytearray(n * len(qs[0]))
                for i in range(len(part)):  # ggml: src_id = (i % (n*bl)) / bl, src_offset = (i / (n*bl)) * bl + i % bl
                    part[i] = qs[(i % (n * bl)) // bl][(i // (n * bl)) * bl + i % bl] ^ lay.xor_mask
                body += part
            if t is GType.Q6_K:  # 64-byte chunks in the order the tile kernel first reads them
                chunks = [bytes(body[64 * c: 64 * c + 64]) for c in range(24)]
                order: list[int] = []
                for half in (0, 1):
                    for q in range(4):
                        for c in (8 * half + 2 * q, 8 * half + 2 * q + 1, 16 + 4 * half + (2 * q) % 4,
                                  16 + 4 * half + (2 * q + 1) % 4):
                            if c not in order:
                                order.append(c)
                body = bytearray(b"".join(chunks[c] for c in order))
            out.append(head + bytes(body))
    return np.frombuffer(b"".join(out), np.uint8)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_repack_matches_the_loop_and_round_trips(name):
    lay = LAYOUTS[name]
    K, M = 512, 2 * lay.nrows
    raw = quantize(np.random.default_rng(3).standard_normal((M, K)).astype(np.float32), lay.gtype).reshape(-1)
    packed = repack(lay, raw, (K, M, 1, 1))
    assert np.array_equal(packed, loop_repack(lay, raw, K, M))
    assert packed.size == lay.packed_nbytes((K, M, 1, 1))
    assert np.array_equal(unpack(lay, packed, (K, M, 1, 1)), raw)


def test_q4_0_4x4_is_byte_identical_with_ggml_block_q4_0x4():
    """ggml's make_block_q4_0x4 (blck_size_interleave 4, xor 0x88) on two hand-made blocks rows."""
    lay = LAYOUTS["q4_0_4x4"]
    rows = np.zeros((4, 1), GType.Q4_0.block_dtype)
    rows["d"] = np.arange(4)[:, None]
    rows["qs"] = (np.arange(64, dtype=np.uint8).reshape(4, 1, 16) * 3) & 0xFF
    packed = repack(lay, rows.view(np.uint8).reshape(-1), (32, 4, 1, 1))
    assert np.array_equal(packed[:8].view("<f2"), np.arange(4))
    q = packed[8:]
    assert np.array_equal(q[:4], rows["qs"][0, 0, :4] ^ 0x88)  # row 0 bytes 0-3
    assert np.array_equal(q[4:8], rows["qs"][1, 0, :4] ^ 0x88)  # row 1 bytes 0-3
    assert np.array_equal(q[16:20], rows["qs"][0, 0, 4:8] ^ 0x88)  # row 0 bytes 4-7


def test_interleave_formula_on_indices():
    q = np.arange(8 * 16).reshape(8, 16)
    p = interleave(q, 8)
    assert list(p[:10]) == [0, 1, 2, 3, 4, 5, 6, 7, 16, 17]
    assert p[64] == 8  # after 8 rows x 8 bytes: row 0, byte 8


def test_k4_scale_packing_round_trips():
    s = np.random.default_rng(0).integers(0, 256, (50, 12), dtype=np.uint8)
    sc, mn = k4_scales_mins(s)
    assert sc.max() < 64 and mn.max() < 64
    assert np.array_equal(k4_scales_mins(k4_pack_scales(sc, mn))[0], sc)
    assert np.array_equal(k4_scales_mins(k4_pack_scales(sc, mn))[1], mn)


@pytest.mark.parametrize("gtype, rows, isa, want", [
    (GType.Q4_0, 4096, "avx512_vnni", "q4_0_8x8"),
    (GType.Q4_0, 4096, "avx2", "q4_0_8x8"),
    (GType.Q4_0, 12, "avx2", None),  # rows not a multiple of 8: no repack, plain CPU buffer
    (GType.Q4_0, 12, "neon_dotprod", "q4_0_4x4"),
    (GType.Q4_0, 12, "neon_i8mm", "q4_0_4x8"),
    (GType.Q4_1, 576, "avx512_vnni", "q4_1_8x8"),
    (GType.Q5_0, 1024, "avx2", "q5_0_8x8"),  # Gemma 3 270M's attn_q [640, 1024]
    (GType.Q5_0, 256, "avx512_vnni", "q5_0_8x8"),
    (GType.Q5_0, 12, "portable", None),
    (GType.Q4_K, 1536, "portable", "q4_K_8x8"),
    (GType.Q8_0, 12, "avx2", "q8_0_4x4"),
    (GType.Q8_0, 6, "avx2", None),
    (GType.Q6_K, 4096, "avx512_vnni", "q6_K_8x8"),
    (GType.Q6_K, 4096, "avx2", None),  # only the AVX-512 tile kernel reads q6_K_8x8
    (GType.Q4_1, 4096, "avx512_vnni", "q4_1_8x8"),
    (GType.F16, 4096, "avx512_vnni", None),
])
def test_selection_table(gtype, rows, isa, want):
    lay = optimal_layout(gtype, rows, isa, forced={})
    assert (lay.name if lay else None) == want


def test_forced_layout_needs_an_isa_that_computes_it(monkeypatch):
    monkeypatch.setenv("GGX_REPACK_LAYOUTS", "q6_K_8x8")
    assert optimal_layout(GType.Q6_K, 64, "avx512_vnni").name == "q6_K_8x8"
    assert optimal_layout(GType.Q6_K, 64, "avx2") is None


def test_forced_layout_wins_when_rows_divide(monkeypatch):
    monkeypatch.setenv("GGX_REPACK_LAYOUTS", "q4_0_4x4")
    assert optimal_layout(GType.Q4_0, 12, "avx2").name == "q4_0_4x4"
    assert optimal_layout(GType.Q4_0, 6, "avx2") is None
    assert optimal_layout(GType.Q8_0, 8, "avx2").name == "q8_0_4x4"  # other types: the table


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_repack_into_writes_what_repack_gives_a_few_rows_at_a_time(name, monkeypatch):
    """Repacked in chunks of rows (here 1 to 3 groups: experts and chunk ends fall anywhere
    between groups), the bytes are repack's."""
    from ggx_repack import layouts

    lay = LAYOUTS[name]
    K, M, E = 512, 4 * lay.nrows, 3
    raw = quantize(np.random.default_rng(4).standard_normal((E * M, K)).astype(np.float32), lay.gtype).reshape(-1)
    want = repack(lay, raw, (K, M, E, 1))
    row_bytes = K // lay.gtype.block_size * lay.gtype.type_size
    for groups in (1, 3, 100):
        monkeypatch.setattr(layouts, "REPACK_CHUNK", groups * lay.nrows * row_bytes)
        out = np.full(want.size + 8, 0xAB, np.uint8)
        layouts.repack_into(lay, raw, (K, M, E, 1), out)
        assert np.array_equal(out[:want.size], want) and (out[want.size:] == 0xAB).all()
    # a matrix whose rows do not divide by the group is refused, even where all experts' do
    odd = raw[: 2 * (M - lay.nrows // 2) * row_bytes]
    with pytest.raises(GGXShapeError, match="do not divide"):
        layouts.repack_into(lay, odd, (K, M - lay.nrows // 2, 2, 1), np.empty(want.size, np.uint8))
