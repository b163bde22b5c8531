"""The AMX layout against an independent per-tile implementation written the way ggml's pack_B is
(values of 16 rows, a 32-bit transpose, packNibbles), byte by byte in plain Python; tile sizes;
refusals."""
from __future__ import annotations

import numpy as np
import pytest

from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.quants import quantize
from ggx.types import GType
from ggx_amx.layout import FORMATS, pack

TYPES = sorted(FORMATS, key=lambda t: t.name)


# --- the reference: one tile at a time, ggml's steps -------------------------------------------------
def values_q4(block) -> list[int]:
    """ggml's bytes_from_nibbles_32: low nibbles are values 0..15, high nibbles 16..31."""
    qs = [int(x) for x in block["qs"]]
    return [q & 15 for q in qs] + [q >> 4 for q in qs]


def values_q4_K(block) -> list[int]:
    """bytes_from_nibbles_64 per 32-byte chunk: 32 low nibbles, then 32 high nibbles."""
    qs = [int(x) for x in block["qs"]]
    out = []
    for c in range(4):
        out += [q & 15 for q in qs[32 * c: 32 * c + 32]] + [q >> 4 for q in qs[32 * c: 32 * c + 32]]
    return out


def values_q6_K(block) -> list[int]:
    """bytes_from_nibbles_128: (ql low | qh bits) for each 32 values of each 128-value half."""
    ql, qh = [int(x) for x in block["ql"]], [int(x) for x in block["qh"]]
    out = []
    for k in range(2):
        a, b, h = ql[64 * k: 64 * k + 32], ql[64 * k + 32: 64 * k + 64], qh[32 * k: 32 * k + 32]
        out += [(a[l] & 15) | ((h[l] & 3) << 4) for l in range(32)]
        out += [(b[l] & 15) | (((h[l] >> 2) & 3) << 4) for l in range(32)]
        out += [(a[l] >> 4) | (((h[l] >> 4) & 3) << 4) for l in range(32)]
        out += [(b[l] >> 4) | (((h[l] >> 6) & 3) << 4) for l in range(32)]
    return out


def transpose_dwords(rows: list[list[int]], first: int, count: int) -> list[list[int]]:
    """ggml's transpose_{8x8,16x16}_32bit over values first..first+4*count of each row: result
    c holds dword (4 values) c of every row, row after row."""
    return [[rows[n][first + 4 * c + i] for n in range(len(rows)) for i in range(4)] for c in range(count)]


def pack_nibbles(lo: list[int], hi: list[int]) -> list[int]:
    return [(a & 15) | ((b & 15) << 4) for a, b in zip(lo, hi)]


def f16_bytes(blocks, field) -> bytes:
    return b"".join(b[field].tobytes() for b in blocks)


def ref_tile(gtype: GType, blocks) -> bytes:
    """One tile from the 16 rows' blocks of one K block, following mmq.cpp's pack_B."""
    out = bytearray()
    if gtype in (GType.Q4_0, GType.Q4_1):
        vals = [values_q4(b) for b in blocks]
        cols = transpose_dwords(vals, 0, 8)  # tmp[k * 64 + ...]: dword k of rows 0..15
        for p in range(4):
            out += bytes(pack_nibbles(cols[2 * p], cols[2 * p + 1]))
        out += f16_bytes(blocks, "d")
        if gtype is GType.Q4_1:
            out += f16_bytes(blocks, "m")
    elif gtype is GType.Q8_0:
        vals = [[int(x) for x in b["qs"]] for b in blocks]
        for col in transpose_dwords(vals, 0, 8):
            out += bytes(v & 255 for v in col)
        out += f16_bytes(blocks, "d")
        for b in blocks:  # s8s8_compensation: vpdpbusd of 0x80 bytes with the row's int8 values
            out += int(128 * sum(int(x) for x in b["qs"])).to_bytes(4, "little", signed=True)
    elif gtype is GType.Q4_K:
        vals = [values_q4_K(b) for b in blocks]
        for k in range(4):  # 64 values (two sub-blocks) at a time, 16 dwords per row
            cols = transpose_dwords(vals, 64 * k, 16)
            for n in range(0, 16, 2):
                out += bytes(pack_nibbles(cols[n], cols[n + 1]))
        sc, mn = zip(*(unpack_mins_and_scales(b["scales"]) for b in blocks))
        scales, mins = bytearray(128), bytearray(128)
        for n in range(16):
            for k in range(8):
                scales[k * 16 + n] = sc[n][k]
                mins[(k >> 1) * 32 + n * 2 + (k & 1)] = mn[n][k]
        out += scales + mins + f16_bytes(blocks, "d") + f16_bytes(blocks, "dmin")
    elif gtype is GType.Q6_K:
        vals = [values_q6_K(b) for b in blocks]
        low, high = bytearray(), bytearray()
        for k in range(2):  # 128 values at a time: two transposes of 16 dwords
            cols = transpose_dwords(vals, 128 * k, 16) + transpose_dwords(vals, 128 * k + 64, 16)
            for n in range(0, 32, 2):
                low += bytes(pack_nibbles(cols[n], cols[n + 1]))
            for g in range(8):  # hbits: the 2 high bits of 4 dwords in one byte
                high += bytes(sum(((cols[4 * g + j][x] >> 4) & 3) << (2 * j) for j in range(4)) for x in range(64))
        scales = bytes(int(blocks[n]["scales"][k]) & 255 for k in range(16) for n in range(16))
        out += low + high + scales + f16_bytes(blocks, "d")
    return bytes(out)


def unpack_mins_and_scales(scales) -> tuple[list[int], list[int]]:
    """ggml's unpack_mins_and_scales on the 12 bytes (three little-endian uint32 and masks)."""
    u = [int.from_bytes(bytes(scales[4 * i: 4 * i + 4]), "little") for i in range(3)] + [0]
    m1, m2, m3 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4)
    uaux = u[1] & m1
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4)
    u[2] = uaux
    u[0] &= m1
    b = b"".join(x.to_bytes(4, "little") for x in u)
    return list(b[:8]), list(b[8:])


def ref_pack(gtype: GType, raw: np.ndarray, K: int, M: int, E: int = 1) -> bytes:
    """convert_B_packed_format: tiles (n, k) at (n * KB + k) * tile_size, experts one after another."""
    kb = K // gtype.block_size
    blocks = raw.view(gtype.block_dtype).reshape(E, M, kb)
    return b"".join(ref_tile(gtype, [blocks[e, 16 * n + r, k] for r in range(16)])
                    for e in range(E) for n in range(M // 16) for k in range(kb))


def weights(gtype: GType, K: int, M: int, E: int = 1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal((E * M, K)).astype(np.float32), gtype).reshape(-1)


# --- tests -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_pack_matches_the_per_tile_reference(gtype):
    K = 2 * gtype.block_size if gtype.block_size == 256 else 96
    M, E = 32, 2
    raw = weights(gtype, K, M, E)
    got = pack(gtype, raw, (K, M, E, 1))
    want = np.frombuffer(ref_pack(gtype, raw, K, M, E), np.uint8)
    assert got.dtype == np.uint8 and got.size == FORMATS[gtype].packed_nbytes((K, M, E, 1)) == want.size
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:4]} (tile {bad[0] // FORMATS[gtype].tile_bytes})"


def test_tile_sizes_are_ggml_get_tile_size():
    """TILE_N blocks, plus TILE_N int32 compensation sums (Q8_0) or TILE_N * 4 bytes (Q4_K)."""
    sizes = {t.name: f.tile_bytes for t, f in FORMATS.items()}
    assert sizes == {"Q4_0": 288, "Q4_1": 320, "Q8_0": 608, "Q4_K": 2368, "Q6_K": 3360}
    for t, f in FORMATS.items():
        extra = {GType.Q8_0: 64, GType.Q4_K: 64}.get(t, 0)
        assert f.tile_bytes == 16 * t.block_dtype.itemsize + extra


def test_every_byte_of_a_tile_depends_on_its_own_rows():
    """A changed row changes bytes only in the tiles of its 16-row group and its K block."""
    gtype, K, M = GType.Q4_0, 64, 32
    raw = weights(gtype, K, M)
    blocks = raw.view(gtype.block_dtype).copy()
    blocks[17 * 2 + 1]["qs"] ^= 0x11  # row 17, K block 1: tile (n=1, k=1)
    a, b = pack(gtype, raw, (K, M, 1, 1)), pack(gtype, blocks.view(np.uint8), (K, M, 1, 1))
    tiles = np.flatnonzero(a != b) // 288
    assert set(tiles) == {1 * 2 + 1}


def test_refusals():
    with pytest.raises(GGXUnsupported, match="no tile layout for Q5_0"):
        pack(GType.Q5_0, np.zeros(22 * 16, np.uint8), (32, 16, 1, 1))
    with pytest.raises(GGXShapeError, match="rows divisible by 16"):
        pack(GType.Q4_0, np.zeros(18 * 8, np.uint8), (32, 8, 1, 1))
    with pytest.raises(GGXShapeError, match="bytes given"):
        pack(GType.Q4_0, np.zeros(18 * 15, np.uint8), (32, 16, 1, 1))
