"""The repacked weight layouts and the choice of one per tensor (ggml's repack.cpp, in numpy).

A layout takes the rows of a quantized weight matrix `N` at a time (a *group*) and, for each
block column `b` (32 values; 256 for Q4_K), writes one *group block*:

    [ scales of the N rows (and mins, ...) ][ the N rows' quant bytes, interleaved ]

so one SIMD load gets the bytes of several rows at the same position, and one load gets
their scales. Group g's group blocks are contiguous (b = 0, 1, ...), groups follow each other,
and for a 3-D (MoE) weight the experts follow each other. The layout is named
`<type>_<N>x<B>`, as ggml names its `block_<type>x<N>` instances.

The interleave (ggml's `make_block_q4_0x4` loop, the only index transform of this module):
the N rows' quant bytes of one block, Q[r, j] (r < N, j < L bytes per row), become

    P[i] = Q[(i % (N*B)) // B,  (i // (N*B)) * B + i % B]        for i < N * L

i.e. B bytes of row 0, B bytes of row 1, ..., B bytes of row N-1, then the next B bytes of
row 0, ... Every quant byte is then xor-ed with the layout's `xor_mask`.

Group-block headers (little-endian, scales in row order r = 0..N-1):
  q4_0_NxB  d[N] f16                                              quants 16 B per row
  q4_1_8x8  d[N] f16, m[N] f16                                    quants 16 B per row
  q5_0_8x8  d[N] f16, 8 fifth-bit planes of 4 B (`q5_planes`)     quants 16 B per row
  q8_0_4x4  d[N] f16                                              quants 32 B per row
  q4_K_8x8  d[N] f16, dmin[N] f16, sc[8][N] u8, mn[8][N] u8       quants 128 B per row
  q6_K_8x8  d[N] f16, sc[16][N] i8                                ql 128 B and qh 64 B per row,
                                                                  each interleaved, in Q6_CHUNKS order
The Q4_K header holds the 6-bit sub-block scales and mins already decoded (ggml keeps them
packed): 32 bytes more per group block (+2.8 %), so `get_alloc_size` exceeds nbytes, and the
kernels load the eight rows' scales of a sub-block with one 8-byte load instead of decoding.

The xor mask: ggml turns Q4_0's offset nibbles q (value q - 8) into signed 4-bit numbers with
0x88 because its ARM kernels multiply signed by signed (sdot). x86's byte products (vpdpbusd,
vpmaddubsw) take one *unsigned* operand, which the plain nibble already is: ggx keeps Q4_0 8x8
unmasked and folds the -8 into the accumulator's start value, and keeps ggml's 0x88 in the
NEON-style 4x4 / 4x8 groupings (byte-identical with ggml's block_q4_0x4 there; the x86
kernels undo it with one xor per 32 bytes). For Q8_0 the mask 0x80 saves work on x86: w ^ 0x80
= w + 128 is unsigned, so vpdpbusd takes the weights as they are (no per-load sign fix-up).

Q6_K keeps ggml's two quant arrays apart, each interleaved by 8 bytes: 64 bytes of ql (8 rows x
bytes 8c..8c+7, 16 such chunks) hold the low 4 bits of a row's values 8c'..8c'+7 (low nibbles)
and 64 + 8c'..+7 (high nibbles) of half c // 8 (c' = c % 8); 64 bytes of qh (8 rows x bytes 8h..8h+7,
8 chunks) their two high bits (ggml's value order: qh byte l of a half holds values l, l + 32,
l + 64, l + 96 in bits 0-1, 2-3, 4-5, 6-7). The 24 chunks are stored in the order the kernel
first reads them (`Q6_CHUNKS`: two ql chunks, the two qh chunks they need, ...), so a super-block
is read front to back. Only the AVX-512 VNNI tile kernel reads it (`ISA_ONLY`).
"""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.types import GType

#: ggx-cpu's x86 ISA variants (every one runs every layout; see kernels.py).
X86 = ("avx512_vnni", "avx2", "portable")
#: Environment variable forcing layouts by name (comma separated), for testing any layout on any CPU.
ENV_FORCE = "GGX_REPACK_LAYOUTS"


@dataclass(frozen=True)
class Layout:
    """One repacked layout: `nrows` rows per group, quants interleaved `interleave` bytes at a time."""

    name: str
    gtype: GType
    nrows: int  # N: rows per group (ggml's number of interleaved blocks)
    interleave: int  # B: bytes taken from one row before the next (ggml's blck_size_interleave)
    xor_mask: int  # xor-ed into every quant byte

    @property
    def quant_bytes(self) -> int:
        """Quant bytes of one row in one block."""
        return {GType.Q4_0: 16, GType.Q4_1: 16, GType.Q5_0: 16, GType.Q8_0: 32, GType.Q4_K: 128,
                GType.Q6_K: 192}[self.gtype]

    @property
    def head_bytes(self) -> int:
        """Header bytes of one group block (scales and the like)."""
        n = self.nrows
        return {GType.Q4_0: 2 * n, GType.Q4_1: 4 * n, GType.Q5_0: 6 * n, GType.Q8_0: 2 * n,
                GType.Q4_K: 4 * n + 16 * n, GType.Q6_K: 2 * n + 16 * n}[self.gtype]

    @functools.cached_property
    def group_bytes(self) -> int:
        """Bytes of one group block (cached: every matmul call asks)."""
        return self.head_bytes + self.nrows * self.quant_bytes

    @functools.cached_property
    def block_size(self) -> int:
        """Values per block of the weight type (cached: every matmul call asks)."""
        return self.gtype.block_size

    def packed_nbytes(self, ne: tuple[int, ...]) -> int:
        """Bytes of a contiguous weight [K, M, E, 1] in this layout."""
        nbk = ne[0] // self.gtype.block_size
        return ne[1] // self.nrows * nbk * self.group_bytes * ne[2] * ne[3]

    def __repr__(self) -> str:
        return f"<Layout {self.name}>"


LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (
    Layout("q4_0_8x8", GType.Q4_0, 8, 8, 0x00),
    Layout("q4_0_4x8", GType.Q4_0, 4, 8, 0x88),
    Layout("q4_0_4x4", GType.Q4_0, 4, 4, 0x88),
    Layout("q4_1_8x8", GType.Q4_1, 8, 8, 0x00),
    Layout("q5_0_8x8", GType.Q5_0, 8, 8, 0x00),
    Layout("q8_0_4x4", GType.Q8_0, 4, 4, 0x80),
    Layout("q4_K_8x8", GType.Q4_K, 8, 8, 0x00),
    Layout("q6_K_8x8", GType.Q6_K, 8, 8, 0x00),
)}

#: layouts only some ISA variants compute (no kernel of `kernels.repack_mm` reads them)
ISA_ONLY: dict[str, tuple[str, ...]] = {"q6_K_8x8": ("avx512_vnni",)}


def runs_on(lay: Layout, isa: str) -> bool:
    """Whether ISA variant `isa` has kernels for layout `lay`."""
    return isa in ISA_ONLY.get(lay.name, (isa,))

#: ggml_repack_get_optimal_repack_type as a table, tried top to bottom:
#: (weight type, ISA variants it applies to, rows must divide by, layout name).
#: The NEON rows name ggml's ARM choices; no x86 host selects them (force them to test them).
SELECTION: tuple[tuple[GType, tuple[str, ...], int, str], ...] = (
    (GType.Q4_0, X86, 8, "q4_0_8x8"),
    (GType.Q4_0, ("neon_i8mm",), 4, "q4_0_4x8"),
    (GType.Q4_0, ("neon_dotprod",), 4, "q4_0_4x4"),
    (GType.Q4_1, X86, 8, "q4_1_8x8"),
    (GType.Q5_0, X86, 8, "q5_0_8x8"),
    (GType.Q4_K, X86, 8, "q4_K_8x8"),
    (GType.Q6_K, ("avx512_vnni",), 8, "q6_K_8x8"),
    (GType.Q8_0, X86 + ("neon_dotprod",), 4, "q8_0_4x4"),
)


def forced_layouts() -> dict[GType, Layout]:
    """Layouts forced through $GGX_REPACK_LAYOUTS (e.g. "q4_0_4x4,q8_0_4x4"), by weight type."""
    value = os.environ.get(ENV_FORCE, "").strip()
    out: dict[GType, Layout] = {}
    for name in filter(None, (x.strip() for x in value.split(","))):
        if name not in LAYOUTS:
            raise GGXUnsupported(f"{ENV_FORCE}: unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
        out[LAYOUTS[name].gtype] = LAYOUTS[name]
    return out


def optimal_layout(gtype: GType, nrows: int, isa: str, forced: dict[GType, Layout] | None = None) -> Layout | None:
    """The layout for a weight of `gtype` with `nrows` rows (ne[1]) on ISA variant `isa`, or None.

    A forced layout (argument, else $GGX_REPACK_LAYOUTS) wins when the rows divide by its group.
    """
    forced = forced_layouts() if forced is None else forced
    if gtype in forced:
        lay = forced[gtype]
        return lay if nrows > 0 and nrows % lay.nrows == 0 and runs_on(lay, isa) else None
    for t, isas, multiple, name in SELECTION:
        if t is gtype and isa in isas and nrows > 0 and nrows % multiple == 0:
            return LAYOUTS[name]
    return None


# --- the transform ------------------------------------------------------------------------------
#: q6_K_8x8's 24 chunks of 64 bytes in the order the tile kernel first reads them (chunk i < 16:
#: the interleaved ql's chunk i, 16 + h: qh's chunk h): stored in that order, a super-block is read
#: front to back (ql and qh apart made it jump back and forth by ~1 KB, which cost the one-column
#: kernel ~3x of its speed from memory, docs/perf-notes.md)
Q6_CHUNKS = [0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 6, 7, 8, 9, 20, 21, 10, 11, 22, 23, 12, 13, 14, 15]


def interleave(q: np.ndarray, block: int) -> np.ndarray:
    """(..., N, L) bytes -> (..., N*L): P[i] = Q[(i % (N*B)) // B, (i // (N*B)) * B + i % B]."""
    *lead, n, length = q.shape
    x = q.reshape(*lead, n, length // block, block)
    return np.swapaxes(x, -3, -2).reshape(*lead, n * length)


def deinterleave(p: np.ndarray, n: int, block: int) -> np.ndarray:
    """The inverse of `interleave`: (..., N*L) -> (..., N, L)."""
    *lead, total = p.shape
    x = p.reshape(*lead, total // (n * block), n, block)
    return np.swapaxes(x, -3, -2).reshape(*lead, n, total // n)


def q5_planes(qh: np.ndarray) -> np.ndarray:
    """The 8 rows' qh bytes (..., 8 rows, 4) -> (..., 8 planes, 4) in the order the 8x8 kernels
    take them: plane 2k (k < 4) holds the fifth bits of quant load k's low nibbles, plane 2k + 1
    of its high ones. Load k covers rows 4 * (k % 2) .. + 3 and bytes 8 * (k // 2) .. + 7 of each
    (`interleave`); byte j's low nibble is value j (qh byte j // 8), its high nibble value 16 + j
    (qh byte 2 + j // 8): plane byte m is row 4 * (k % 2) + m's qh byte k // 2 (+ 2 for high)."""
    out = np.empty(qh.shape, np.uint8)
    for k in range(4):
        rows = slice(4 * (k % 2), 4 * (k % 2) + 4)
        out[..., 2 * k, :] = qh[..., rows, k // 2]
        out[..., 2 * k + 1, :] = qh[..., rows, k // 2 + 2]
    return out


def q5_unplanes(planes: np.ndarray) -> np.ndarray:
    """The inverse of `q5_planes`."""
    qh = np.empty(planes.shape, np.uint8)
    for k in range(4):
        rows = slice(4 * (k % 2), 4 * (k % 2) + 4)
        qh[..., rows, k // 2] = planes[..., 2 * k, :]
        qh[..., rows, k // 2 + 2] = planes[..., 2 * k + 1, :]
    return qh


def k4_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 packed bytes (..., 12) -> 6-bit scales and mins (..., 8) (ggml get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def k4_pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The inverse of `k4_scales_mins`: 6-bit scales and mins (..., 8) -> ggml's 12 bytes."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    s = np.empty(sc.shape[:-1] + (12,), np.uint8)
    s[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    s[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return s


def _grouped(lay: Layout, raw: np.ndarray, ne: tuple[int, ...]) -> np.ndarray:
    """ggml blocks as (mats, groups, block column, row in group) structured array."""
    K, M = ne[0], ne[1]
    mats = ne[2] * ne[3]
    nbk = K // lay.gtype.block_size
    if M % lay.nrows:
        raise GGXShapeError(f"{lay.name}: {M} rows do not divide by its group of {lay.nrows}")
    if raw.size != mats * M * nbk * lay.gtype.type_size:
        raise GGXShapeError(f"{lay.name}: {raw.size} bytes given for a {lay.gtype.name} tensor of ne={list(ne)}")
    blocks = np.ascontiguousarray(raw).view(lay.gtype.block_dtype).reshape(mats, M // lay.nrows, lay.nrows, nbk)
    return blocks.transpose(0, 1, 3, 2)


def _bytes(a: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(*lead, -1)


def repack(lay: Layout, raw: np.ndarray, ne: tuple[int, ...]) -> np.ndarray:
    """ggml block bytes of a contiguous weight [K, M, E, 1] -> the bytes of layout `lay`."""
    b = _grouped(lay, np.asarray(raw, dtype=np.uint8).reshape(-1), ne)
    lead = b.shape[:3]
    parts = [_bytes(b["d"], lead)]
    if lay.gtype is GType.Q4_1:
        parts.append(_bytes(b["m"], lead))
    if lay.gtype is GType.Q5_0:
        parts.append(q5_planes(np.ascontiguousarray(b["qh"]).view(np.uint8).reshape(*lead, 8, 4)).reshape(*lead, 32))
    if lay.gtype is GType.Q4_K:
        sc, mn = k4_scales_mins(b["scales"])  # (..., N, 8)
        parts += [_bytes(b["dmin"], lead), _bytes(np.swapaxes(sc, -1, -2), lead), _bytes(np.swapaxes(mn, -1, -2), lead)]
    if lay.gtype is GType.Q6_K:
        parts.append(_bytes(np.swapaxes(b["scales"], -1, -2), lead))
        chunks = np.concatenate([interleave(b[f].view(np.uint8), lay.interleave) for f in ("ql", "qh")], axis=-1)
        parts.append(chunks.reshape(*lead, 24, 64)[..., Q6_CHUNKS, :].reshape(*lead, -1))
    else:
        parts.append(interleave(b["qs"].view(np.uint8), lay.interleave) ^ np.uint8(lay.xor_mask))
    return np.concatenate(parts, axis=-1).reshape(-1)


#: source bytes repacked at a time by `repack_into`
REPACK_CHUNK = 2 << 20
#: chunks repacked at once, at most: each holds a few copies of its bytes while numpy works, so
#: this bounds what a load holds beside the weights whatever the core count
REPACK_WORKERS = 4


def repack_into(lay: Layout, raw: np.ndarray, ne: tuple[int, ...], out: np.ndarray) -> None:
    """`repack(lay, raw, ne)` written into `out` a few MB of rows at a time: groups of rows (of
    every matrix, the experts one after the other) are repacked on their own into bytes that
    follow each other, so no whole repacked copy is held beside `out` (a 262k-token embedding's
    was ~180 MB more at load)."""
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    _grouped(lay, raw, ne)  # repack's checks: every matrix's rows divide by the group, the bytes fit ne
    K, rows = ne[0], ne[1] * ne[2] * ne[3]
    row_bytes = K // lay.gtype.block_size * lay.gtype.type_size
    step = max(lay.nrows, REPACK_CHUNK // row_bytes // lay.nrows * lay.nrows)
    span = lay.packed_nbytes((K, lay.nrows, 1, 1))  # bytes of one group of rows

    def chunk(r: int) -> None:
        n = min(step, rows - r)
        a = r // lay.nrows * span
        out[a: a + n // lay.nrows * span] = repack(lay, raw[r * row_bytes: (r + n) * row_bytes], (K, n, 1, 1))

    starts = range(0, rows, step)
    if len(starts) == 1:
        chunk(0)
        return
    # numpy's copies let go of the GIL: the chunks, each written to bytes of its own, share the cores
    with ThreadPoolExecutor(min(len(starts), REPACK_WORKERS, os.cpu_count() or 1)) as pool:
        for _ in pool.map(chunk, starts):
            pass


def unpack(lay: Layout, packed: np.ndarray, ne: tuple[int, ...]) -> np.ndarray:
    """The inverse of `repack`: the layout's bytes -> ggml block bytes (for tests and debugging)."""
    K, M = ne[0], ne[1]
    mats, n, nbk = ne[2] * ne[3], lay.nrows, K // lay.gtype.block_size
    g = np.asarray(packed, dtype=np.uint8).reshape(mats, M // n, nbk, lay.group_bytes)
    out = np.zeros((mats, M // n, nbk, n), lay.gtype.block_dtype)
    f16 = np.dtype("<f2")
    pos = 0

    def take(nbytes: int) -> np.ndarray:
        nonlocal pos
        pos += nbytes
        return np.ascontiguousarray(g[..., pos - nbytes: pos])

    out["d"] = take(2 * n).view(f16)
    if lay.gtype is GType.Q4_1:
        out["m"] = take(2 * n).view(f16)
    if lay.gtype is GType.Q5_0:
        out["qh"] = q5_unplanes(take(32).reshape(*g.shape[:3], 8, 4)).view("<u4")[..., 0]
    if lay.gtype is GType.Q4_K:
        out["dmin"] = take(2 * n).view(f16)
        sc = np.swapaxes(take(8 * n).reshape(*g.shape[:3], 8, n), -1, -2)
        mn = np.swapaxes(take(8 * n).reshape(*g.shape[:3], 8, n), -1, -2)
        out["scales"] = k4_pack_scales(sc, mn)
    if lay.gtype is GType.Q6_K:
        out["scales"] = np.swapaxes(take(16 * n).view(np.int8).reshape(*g.shape[:3], 16, n), -1, -2)
        chunks = np.empty((*g.shape[:3], 24, 64), np.uint8)
        chunks[..., Q6_CHUNKS, :] = take(192 * n).reshape(*g.shape[:3], 24, 64)
        chunks = chunks.reshape(*g.shape[:3], -1)
        out["ql"] = deinterleave(chunks[..., :128 * n], n, lay.interleave)
        out["qh"] = deinterleave(chunks[..., 128 * n:], n, lay.interleave)
    else:
        q = deinterleave(take(n * lay.quant_bytes) ^ np.uint8(lay.xor_mask), n, lay.interleave)
        out["qs"] = q.view(out["qs"].dtype)
    return np.ascontiguousarray(out.transpose(0, 1, 3, 2)).view(np.uint8).reshape(-1)
