"""ggml's AMX weight layout (ggml-cpu/amx/mmq.cpp: `convert_B_packed_format`, `pack_B`), in numpy.

A weight matrix [K, M] (M rows of K values; ggml's mmq calls the rows N) is cut into *tiles*:
16 consecutive rows (TILE_N) x one block of K (32 values for Q4_0 / Q4_1 / Q8_0, a 256-value
super-block for Q4_K / Q6_K). Tiles are stored `[M/16][K/blck][tile]`: the K blocks of rows
0..15 one after the other, then those of rows 16..31, ...; a 3-D (MoE) weight stores its experts
one after the other. Every tile has a fixed size, `TileFormat.tile_bytes`.

Quants are in the VNNI order `tdpbssd` reads a B tile in: for 4 consecutive values of a row
(one *dword*), row n's dword k sits at byte `64 k + 4 n` (an 8 x 64-byte tile of 16 rows x 32
values; int8 values stay whole, ggml's {8, 16, 4}). 4-bit values are nibble-packed: two dwords k
and k + 1 share 64 bytes, k's values in the low nibbles, k + 1's in the high ones. After the
quants come the 16 rows' scales (and mins, ...), row by row. Byte map of one tile (n: row 0..15,
i: value 0..3 of a dword, f16 little-endian IEEE halves; the README draws it too):

  Q4_0 (288 B)  [0, 256)    byte 64p + 4n + i = q[n][8p+i] | q[n][8p+4+i] << 4   (p 0..3; q 0..15, value (q-8) d)
                [256, 288)  d[n] f16
  Q4_1 (320 B)  [0, 256)    as Q4_0 (value q d + m)
                [256, 288)  d[n] f16;  [288, 320) m[n] f16
  Q8_0 (608 B)  [0, 512)    byte 64k + 4n + i = q[n][4k+i]                       (k 0..7; int8)
                [512, 544)  d[n] f16;  [544, 608) comp[n] int32 = 128 * sum_j q[n][j]
  Q4_K (2368 B) [0, 2048)   sub-block s (values 32s..32s+31) at 256 s, packed as Q4_0's 256 B
                [2048, 2176) scale[16 s + n] u8 (6-bit, decoded)
                [2176, 2304) min[32 (s >> 1) + 2 n + (s & 1)] u8 (6-bit, decoded; int16-pair VNNI order)
                [2304, 2336) d[n] f16;  [2336, 2368) dmin[n] f16
  Q6_K (3360 B) [0, 2048)   16-value group g (values 16g..16g+15) at 128 g:
                            byte 128g + 64h + 4n + i = lo4(q[n][16g+8h+i]) | lo4(q[n][16g+8h+4+i]) << 4  (h 0..1)
                [2048, 3072) byte 2048 + 64g + 4n + i = sum_j hi2(q[n][16g+4j+i]) << 2j   (j 0..3)
                [3072, 3328) scale[16 g + n] int8
                [3328, 3360) d[n] f16                                      (q 0..63, value (q-32) d scale)

The Q8_0 compensation sums serve ggml's batch-1 VNNI path (u8 x s8 products of the activation
+ 128: 128 * sum(q) is taken off), as the ggx-amx gemv does. The sizes are ggml's
`get_tile_size` (TILE_N blocks, plus TILE_N int32 for Q8_0 and TILE_N * 4 bytes for Q4_K).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.types import GType

TILE_N = 16  # weight rows per tile (ggml's TILE_N)
TILE_K = 32  # values of one 8 x 64-byte B tile (ggml's TILE_K)
TILE_ROWS_PER_TASK = 32  # a kernel task covers two tiles of rows (ggml's BLOCK_N = 2 * TILE_N)


@dataclass(frozen=True)
class TileFormat:
    """One type's AMX tile: its size and where its sections start (byte offsets in the tile)."""

    gtype: GType
    tile_bytes: int
    scales: int  # the 16 rows' d (f16; Q4_K/Q6_K: the sub-block scales, u8 / int8)
    extra: int  # Q4_1: m; Q8_0: comp; Q4_K: mins; Q6_K: the high bits; else -1
    d: int  # the rows' f16 d
    dmin: int  # Q4_K's f16 dmin, else -1

    @property
    def block_size(self) -> int:
        """Values of K per tile (the type's block)."""
        return self.gtype.block_size

    @property
    def name(self) -> str:
        return self.gtype.name.lower().replace("_k", "_K")

    def packed_nbytes(self, ne: tuple[int, ...]) -> int:
        """Bytes of a weight [K, M, E, 1] in this layout."""
        return ne[1] // TILE_N * (ne[0] // self.block_size) * self.tile_bytes * ne[2] * ne[3]

    def __repr__(self) -> str:
        return f"<TileFormat {self.name} {self.tile_bytes} B>"


FORMATS: dict[GType, TileFormat] = {f.gtype: f for f in (
    TileFormat(GType.Q4_0, 288, scales=256, extra=-1, d=256, dmin=-1),
    TileFormat(GType.Q4_1, 320, scales=256, extra=288, d=256, dmin=-1),
    TileFormat(GType.Q8_0, 608, scales=512, extra=544, d=512, dmin=-1),
    TileFormat(GType.Q4_K, 2368, scales=2048, extra=2176, d=2304, dmin=2336),
    TileFormat(GType.Q6_K, 3360, scales=3072, extra=2048, d=3328, dmin=-1),
)}


def tile_format(gtype: GType) -> TileFormat | None:
    """The AMX tile format of a weight type, or None (no AMX kernel for it)."""
    return FORMATS.get(gtype)


# --- the packing -------------------------------------------------------------------------------------
def pack(gtype: GType, raw: np.ndarray, ne: tuple[int, ...]) -> np.ndarray:
    """ggml's AMX layout (uint8) of a weight [K, M, E, 1] given as its GGUF block bytes."""
    fmt = FORMATS.get(gtype)
    if fmt is None:
        raise GGXUnsupported(f"AMX: no tile layout for {gtype.name}")
    K, M, E = ne[0], ne[1], ne[2] * ne[3]
    if K % fmt.block_size or M % TILE_N:
        raise GGXShapeError(f"AMX: a {gtype.name} weight [{K}, {M}] needs K divisible by {fmt.block_size} "
                            f"and rows divisible by {TILE_N}")
    kb = K // fmt.block_size
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1).view(gtype.block_dtype)
    if blocks.size != E * M * kb:
        raise GGXShapeError(f"AMX: {raw.size} bytes given for a {gtype.name} weight {list(ne)}")
    # tiles in storage order: [E][M/16][K/blck], each holding its 16 rows' blocks
    tiles = blocks.reshape(E, M // TILE_N, TILE_N, kb).transpose(0, 1, 3, 2).reshape(-1, TILE_N)
    return _PACKERS[gtype](tiles).reshape(-1)


def q4_values(qs: np.ndarray) -> np.ndarray:
    """The 4-bit values 0..15 of 32-value blocks in value order (ggml's Q4_0/Q4_1: value j < 16
    is qs[j] & 15, value 16 + j is qs[j] >> 4); qs [..., 16] -> [..., 32]."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def vnni_nibbles(q: np.ndarray) -> np.ndarray:
    """32 4-bit values of 16 rows, q [T, 16, 32] -> [T, 256]: the VNNI dwords k (values 4k..4k+3)
    of every row at 64 k + 4 n, dwords 2p and 2p + 1 sharing 64 bytes as low / high nibbles."""
    d = q.reshape(-1, TILE_N, 4, 2, 4)  # [T, n, p, lo/hi, i]
    packed = d[:, :, :, 0, :] | (d[:, :, :, 1, :] << 4)
    return packed.transpose(0, 2, 1, 3).reshape(-1, 256)


def vnni_bytes(q: np.ndarray) -> np.ndarray:
    """32 int8 values of 16 rows, q [T, 16, 32] -> [T, 512]: row n's dword k at 64 k + 4 n."""
    return q.reshape(-1, TILE_N, 8, 4).transpose(0, 2, 1, 3).reshape(-1, 512).view(np.uint8)


def _halves(x: np.ndarray) -> np.ndarray:
    """f16 fields [T, 16] as their 32 bytes per tile."""
    return np.ascontiguousarray(x).view(np.uint8).reshape(-1, 2 * TILE_N)


def _pack_q4_0(t: np.ndarray) -> np.ndarray:
    return np.concatenate([vnni_nibbles(q4_values(t["qs"])), _halves(t["d"])], axis=1)


def _pack_q4_1(t: np.ndarray) -> np.ndarray:
    return np.concatenate([vnni_nibbles(q4_values(t["qs"])), _halves(t["d"]), _halves(t["m"])], axis=1)


def _pack_q8_0(t: np.ndarray) -> np.ndarray:
    q = t["qs"]
    comp = (128 * q.astype(np.int32).sum(axis=-1)).astype("<i4")
    return np.concatenate([vnni_bytes(q), _halves(t["d"]), comp.view(np.uint8).reshape(-1, 4 * TILE_N)], axis=1)


def k4_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 packed bytes [..., 12] -> (scales, mins) [..., 8] of 6 bits (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _pack_q4_K(t: np.ndarray) -> np.ndarray:
    qs = t["qs"].reshape(-1, TILE_N, 4, 32)  # 64-value chunks c: low nibbles values 64c.., high 64c+32..
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(-1, TILE_N, 8, 32)  # [T, n, sub-block, 32]
    quants = vnni_nibbles(q.transpose(0, 2, 1, 3).reshape(-1, TILE_N, 32)).reshape(-1, 8 * 256)
    sc, mn = k4_scales_mins(t["scales"])  # [T, n, 8]
    scales = sc.transpose(0, 2, 1).reshape(-1, 128)
    mins = mn.reshape(-1, TILE_N, 4, 2).transpose(0, 2, 1, 3).reshape(-1, 128)
    return np.concatenate([quants, scales, mins, _halves(t["d"]), _halves(t["dmin"])], axis=1)


def q6_values(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K's unsigned 6-bit values 0..63 in value order (ggml's dequantize_row_q6_K), ql
    [..., 128], qh [..., 64] -> [..., 256]."""
    out = []
    for half in range(2):
        lo, hi = ql[..., 64 * half: 64 * half + 64], qh[..., 32 * half: 32 * half + 32]
        out += [(lo[..., :32] & 15) | ((hi & 3) << 4), (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4),
                (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4), (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)]
    return np.concatenate(out, axis=-1)


def _pack_q6_K(t: np.ndarray) -> np.ndarray:
    q = q6_values(t["ql"], t["qh"]).reshape(-1, TILE_N, 16, 2, 2, 4)  # [T, n, g, h, lo/hi, i]
    lo = (q[:, :, :, :, 0, :] & 15) | ((q[:, :, :, :, 1, :] & 15) << 4)  # [T, n, g, h, i]
    low = lo.transpose(0, 2, 3, 1, 4).reshape(-1, 2048)
    h = (q.reshape(-1, TILE_N, 16, 4, 4) >> 4).astype(np.uint8)  # [T, n, g, j, i]
    hi = h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4) | (h[:, :, :, 3] << 6)  # [T, n, g, i]
    high = hi.transpose(0, 2, 1, 3).reshape(-1, 1024)
    scales = t["scales"].transpose(0, 2, 1).reshape(-1, 256).view(np.uint8)
    return np.concatenate([low, high, scales, _halves(t["d"])], axis=1)


_PACKERS = {GType.Q4_0: _pack_q4_0, GType.Q4_1: _pack_q4_1, GType.Q8_0: _pack_q8_0,
            GType.Q4_K: _pack_q4_K, GType.Q6_K: _pack_q6_K}

