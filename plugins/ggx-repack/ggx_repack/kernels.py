"""gemv / gemm on repacked weights (ggml's gemv_/gemm_<layout>_q8_*), one source per ISA x layout.

Written only with ggx-cpu's extension surface (`ggx_cpu.extension`). The kernels take two
compile-time tokens: ggx-cpu's `isa` token (its numba type names the variant: `avx512_vnni`
vpdpbusd, `avx2` vpmaddubsw + vpmaddwd, `portable` plain LLVM vector IR) and a `Layout`
(typed as `LayoutType`), so one source compiles, and caches, once per (ISA, layout) pair.
Only the 8-bit product differs per ISA; ggx-cpu's `dot_u8s8` picks it.

How a group block is computed (N rows x one block of 32 values; layouts in layouts.py): a
32-byte load of interleaved quants holds 4 bytes of some row in each int32 lane, so the
product of that load with an activation vector built for it (8 or 4 activation bytes
broadcast: `_bcast8`, `_bcast4x2`) leaves in every lane a partial dot product of *one row*.
Lanes are never summed inside the K loop: two int32 accumulators A and B per column (A: the
even loads, B: the odd ones) are scaled per lane by the rows' scales (`_f16_pairs` /
`_f16_quad2` spread the N scales over the lanes) into two float32 accumulators per column, and
only at the end are the lanes of each row added (`lane_rows`: A lanes then B lanes -> row in
the group).

Q5_0 8x8 is Q4_0 8x8 plus one fifth-bit plane per nibble vector (`or_bits16_at`: 16 on the
lanes whose bit is set), so its values 0..31 take the same unsigned products (2 * 31 * 127 stays
below vpmaddubsw's saturation).

Offsets (-8 for Q4_0 nibbles, -16 for Q5_0 values, +128 for the xor-ed Q8_0 bytes, Q4_K mins)
use the activation's block sums: an integer accumulator starts at e.g. -8 * sum(y) / (lanes per
row) instead of 0.

Inputs (validated by buffer.py before a kernel runs):
  w       uint8: the repack buffer's bytes; matrix g's groups start at byte wg[g], group i's
          block j at wg[g] + (i * nbk + j) * gbytes.
  x       float32 [n, K] activation rows (C-contiguous); repack_mm quantizes them itself with
          ggx-cpu's `quantize_rows_q8` / `quantize_rows_q8_K` (the weight's vec_dot_type) into
  yq, yd  int8 values, one row of K per column; float32 scale per block of 32 (256 for Q8_K);
  ysum    int32 sum of the values of each 32-value activation block; ys float32 Q8_1 `s`.
  cstart, ycol, ocol  matrix g multiplies columns cstart[g]..cstart[g+1]: activation row
          ycol[c], output row ocol[c] of `out` (rows of M floats).
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from ggx.types import GType
from ggx_cpu.extension import (
    TokenType,
    add_f32x8,
    add_i32x8,
    dot_s8s8,
    dot_u8s8,
    fma_f32x8,
    fma_i32x8_f32x8,
    i32x8_to_f32x8,
    lane,
    load_f32x8,
    load_i8x32,
    load_i32x8,
    make_shuffled_load,
    mul_f32x8,
    mul_i32x8,
    or_bits16_at,
    quantize_rows_q8,
    quantize_rows_q8_K,
    register_token,
    splat_f32x8,
    splat_i32x8,
    split_nibbles_i8x32,
    store_f32x8,
    store_i32x8,
    sub_f32x8,
    token_constant,
    u8s8_saturates,
    xor80_i8x32,
    zero_f32x8,
    zero_i32x8,
)

from .layouts import Layout

TILE = 8  # columns per gemm tile: each weight load serves this many columns


# --- the layout token -------------------------------------------------------------------------
class LayoutType(TokenType):
    """numba type of a `Layout`: kernels specialize on it (name = the layout's name)."""

    def __init__(self, lay: Layout):
        self.layout_name = lay.name
        self.nrows = lay.nrows
        self.interleave = lay.interleave
        self.xor_mask = lay.xor_mask
        self.family = lay.name[:4]  # "q4_0", "q4_1", "q5_0", "q8_0", "q4_K"
        super().__init__(name=f"Layout({lay.name})")


register_token(Layout, LayoutType)


def lane_rows(lay: Layout) -> np.ndarray:
    """Row (in the group) of each accumulator lane: A lanes 0..7, then B lanes 8..15."""
    if lay.nrows == 8:  # 8x8: A holds rows 0-3, B rows 4-7, two lanes per row
        return np.array([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7], np.int64)
    if lay.interleave == 8:  # 4x8: both hold rows 0-3, two lanes per row
        return np.array([0, 0, 1, 1, 2, 2, 3, 3] * 2, np.int64)
    return np.array([0, 1, 2, 3] * 4, np.int64)  # 4x4: lanes r and r + 4


# --- loads that spread a group block's bytes and scales over the lanes --------------------------
_bcast8 = make_shuffled_load(8, 8, list(range(8)) * 4, "i8")  # 8 activation bytes, 4 times
_bcast4x2 = make_shuffled_load(8, 8, [0, 1, 2, 3] * 4 + [4, 5, 6, 7] * 4, "i8")  # bytes 0-3 x4, 4-7 x4
_f16_pairs = make_shuffled_load(4, 16, [0, 0, 1, 1, 2, 2, 3, 3], "f16")  # 4 scales, each on 2 lanes
_f16_quad2 = make_shuffled_load(4, 16, [0, 1, 2, 3] * 2, "f16")  # 4 scales, twice
_u8_pairs = make_shuffled_load(4, 8, [0, 0, 1, 1, 2, 2, 3, 3], "u32")  # 4 byte scales, each on 2 lanes


# --- the Q8_0 product -----------------------------------------------------------------------------
def _dot_q8(isa, acc, wu, y):
    """acc + wu . y for xor-0x80 Q8_0 weights wu (= w + 128): exact, or w . y where the ISA's
    u8 x s8 product saturates (see _q8_corr)."""


@overload(_dot_q8, inline="always")
def _ol_dot_q8(isa, acc, wu, y):
    if u8s8_saturates.value_of(isa):  # vpmaddubsw saturates 255 * 127 pairs: back to signed, |w| sign(y, w)
        return lambda isa, acc, wu, y: dot_s8s8(isa, acc, xor80_i8x32(wu), y, acc)
    return lambda isa, acc, wu, y: dot_u8s8(isa, acc, wu, y)


@token_constant
def _q8_corr(isa):
    """Per-lane start for Q8_0 4x4 (4 lanes per row): -128 * sum(y) / 4, or 0 where _dot_q8 is signed."""
    return 0 if u8s8_saturates.value_of(isa) else -32


# --- compile-time constants of the layout token ----------------------------------------------------
@token_constant
def _is8(lay):
    return lay.nrows == 8


@token_constant
def _mask(lay):
    return lay.xor_mask


@token_constant
def _is_q4_1(lay):
    return lay.family == "q4_1"


@token_constant
def _is_q5(lay):
    return lay.family == "q5_0"


@token_constant
def _head(lay):
    """Bytes of a Q4 / Q5 group block's header (scales, and Q4_1's mins or Q5_0's fifth-bit planes)."""
    return 2 * lay.nrows * {"q4_1": 2, "q5_0": 3}.get(lay.family, 1)


@token_constant
def _corr(lay):
    """Per-lane start factor of a Q4_0 / Q5_0 group block (offset / lanes per row); 0 for the others."""
    offset = {"q4_0": -8, "q5_0": -16}.get(lay.family, 0)
    return offset // (2 if lay.nrows == 8 else 4)


@njit(cache=True, inline="always")
def _q5_bits(lay, w, o, l0, h0, l1, h1, l2, h2, l3, h3):
    """Q5_0 8x8: the fifth bits (planes after the scales, see layouts.q5_planes) added to the 8
    nibble vectors of a group block; the vectors unchanged for the Q4 layouts."""
    if _is_q5(lay):
        p = o + 2 * lay_rows(lay)
        l0, h0 = or_bits16_at(l0, w, p), or_bits16_at(h0, w, p + 4)
        l1, h1 = or_bits16_at(l1, w, p + 8), or_bits16_at(h1, w, p + 12)
        l2, h2 = or_bits16_at(l2, w, p + 16), or_bits16_at(h2, w, p + 20)
        l3, h3 = or_bits16_at(l3, w, p + 24), or_bits16_at(h3, w, p + 28)
    return l0, h0, l1, h1, l2, h2, l3, h3


@token_constant
def _inv_lpr(lay):
    """1 / lanes per row."""
    return 0.5 if lay.nrows == 8 else 0.25


@token_constant
def lay_rows(lay):
    """Rows per group (N)."""
    return lay.nrows


def _yop(lay, yq, off):
    """The activation operand for one weight load: 8 bytes x 4 (B = 8) or 4 + 4 bytes x 4 (B = 4)."""


@overload(_yop, inline="always")
def _ol_yop(lay, yq, off):
    if lay.interleave == 8:
        return lambda lay, yq, off: _bcast8(yq, off)
    return lambda lay, yq, off: _bcast4x2(yq, off)


def _scales(lay, w, off, half):
    """The N f16 scales at byte `off` spread over the lanes of accumulator A (half 0) or B (1)."""


@overload(_scales, inline="always")
def _ol_scales(lay, w, off, half):
    if lay.nrows == 8:
        return lambda lay, w, off, half: _f16_pairs(w, off + 8 * half)
    if lay.interleave == 8:
        return lambda lay, w, off, half: _f16_pairs(w, off)
    return lambda lay, w, off, half: _f16_quad2(w, off)


# --- group blocks ---------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _fma2(acc, t, ia, ib, sa, sb):
    """Float accumulators of column t += int lanes * per-lane scales."""
    store_f32x8(acc, t * 16, fma_i32x8_f32x8(load_f32x8(acc, t * 16), ia, sa))
    store_f32x8(acc, t * 16 + 8, fma_i32x8_f32x8(load_f32x8(acc, t * 16 + 8), ib, sb))


@njit(cache=True, inline="always")
def _block_q4(isa, lay, w, o, yq, yd, ysum, ys, ycol, c, nt, K, b, acc, iacc):
    """One Q4_0 / Q4_1 / Q5_0 group block (N rows x 32 values) against columns c..c+nt."""
    qo = o + _head(lay)
    l0, h0 = split_nibbles_i8x32(load_i8x32(w, qo), _mask(lay))
    l1, h1 = split_nibbles_i8x32(load_i8x32(w, qo + 32), _mask(lay))
    l2, h2, l3, h3 = l0, h0, l1, h1
    if _is8(lay):
        l2, h2 = split_nibbles_i8x32(load_i8x32(w, qo + 64), _mask(lay))
        l3, h3 = split_nibbles_i8x32(load_i8x32(w, qo + 96), _mask(lay))
    l0, h0, l1, h1, l2, h2, l3, h3 = _q5_bits(lay, w, o, l0, h0, l1, h1, l2, h2, l3, h3)
    sa = _scales(lay, w, o, 0)
    sb = _scales(lay, w, o, 1)
    ma = mb = zero_f32x8()
    if _is_q4_1(lay):
        ma = mul_f32x8(_scales(lay, w, o + 2 * lay_rows(lay), 0), splat_f32x8(_inv_lpr(lay)))
        mb = mul_f32x8(_scales(lay, w, o + 2 * lay_rows(lay), 1), splat_f32x8(_inv_lpr(lay)))
    nbk = K // 32
    for t in range(nt):
        col = ycol[c + t]
        y = col * K + b * 32
        blk = col * nbk + b
        init = splat_i32x8(np.int32(_corr(lay) * ysum[blk]))
        if _is8(lay):
            ia = dot_u8s8(isa, dot_u8s8(isa, init, l0, _yop(lay, yq, y)), h0, _yop(lay, yq, y + 16))
            ia = dot_u8s8(isa, dot_u8s8(isa, ia, l2, _yop(lay, yq, y + 8)), h2, _yop(lay, yq, y + 24))
            ib = dot_u8s8(isa, dot_u8s8(isa, init, l1, _yop(lay, yq, y)), h1, _yop(lay, yq, y + 16))
            ib = dot_u8s8(isa, dot_u8s8(isa, ib, l3, _yop(lay, yq, y + 8)), h3, _yop(lay, yq, y + 24))
        else:
            ia = dot_u8s8(isa, dot_u8s8(isa, init, l0, _yop(lay, yq, y)), h0, _yop(lay, yq, y + 16))
            ib = dot_u8s8(isa, dot_u8s8(isa, init, l1, _yop(lay, yq, y + 8)), h1, _yop(lay, yq, y + 24))
        dy = splat_f32x8(yd[blk])
        if _is_q4_1(lay):
            s = splat_f32x8(ys[blk])
            store_f32x8(acc, t * 16, add_f32x8(load_f32x8(acc, t * 16), mul_f32x8(ma, s)))
            store_f32x8(acc, t * 16 + 8, add_f32x8(load_f32x8(acc, t * 16 + 8), mul_f32x8(mb, s)))
        if _is8(lay):
            _fma2(acc, t, ia, ib, mul_f32x8(sa, dy), mul_f32x8(sb, dy))
        else:  # A and B lanes hold the same rows (sa == sb): one float update
            store_f32x8(acc, t * 16, fma_i32x8_f32x8(load_f32x8(acc, t * 16), add_i32x8(ia, ib),
                                                      mul_f32x8(sa, dy)))



@njit(cache=True, inline="always")
def _block_q8(isa, lay, w, o, yq, yd, ysum, ys, ycol, c, nt, K, b, acc, iacc):
    """One Q8_0 4x4 group block (4 rows x 32 values, bytes xor 0x80) against columns c..c+nt."""
    qo = o + 8
    w0 = load_i8x32(w, qo)
    w1 = load_i8x32(w, qo + 32)
    w2 = load_i8x32(w, qo + 64)
    w3 = load_i8x32(w, qo + 96)
    s = _f16_quad2(w, o)
    nbk = K // 32
    for t in range(nt):
        col = ycol[c + t]
        y = col * K + b * 32
        blk = col * nbk + b
        init = splat_i32x8(np.int32(_q8_corr(isa) * ysum[blk]))
        ia = _dot_q8(isa, _dot_q8(isa, init, w0, _bcast4x2(yq, y)), w2, _bcast4x2(yq, y + 16))
        ib = _dot_q8(isa, _dot_q8(isa, init, w1, _bcast4x2(yq, y + 8)), w3, _bcast4x2(yq, y + 24))
        sd = mul_f32x8(s, splat_f32x8(yd[blk]))
        # A and B lanes hold the same rows here: one float update per column and block
        store_f32x8(acc, t * 16, fma_i32x8_f32x8(load_f32x8(acc, t * 16), add_i32x8(ia, ib), sd))


@njit(cache=True, inline="always")
def _block_q8xg(isa, lay, w, o, span, yq, yd, ysum, ycol, c, nt, K, b, acc):
    """`_pair(lay)` Q8_0 4x4 group blocks of one block column (group k at byte o + k * span)
    against columns c..c+nt: each activation broadcast serves 4 * _pair(lay) rows instead of 4
    (what bounds the one-group gemm). Column t's group k accumulates in
    acc[t * 8 * G + 8 * k: ... + 8]. The weights are loaded per column (L1 hits, folded into the
    products as memory operands) so that AVX2's 16 registers do not spill."""
    G = _pair(lay)
    nbk = K // 32
    for t in range(nt):
        col = ycol[c + t]
        y = col * K + b * 32
        blk = col * nbk + b
        # the 4 loads of a group block share one lane -> row map: one chain of 4 products per
        # group, so each lane starts once (2 lanes per row: -128 * sum(y) / 2)
        init = splat_i32x8(np.int32(2 * _q8_corr(isa) * ysum[blk]))
        y0, y1 = _bcast4x2(yq, y), _bcast4x2(yq, y + 8)
        y2, y3 = _bcast4x2(yq, y + 16), _bcast4x2(yq, y + 24)
        dy = splat_f32x8(yd[blk])
        for k in range(G):
            q = o + k * span + 8
            i = _dot_q8(isa, _dot_q8(isa, init, load_i8x32(w, q), y0), load_i8x32(w, q + 32), y1)
            i = _dot_q8(isa, _dot_q8(isa, i, load_i8x32(w, q + 64), y2), load_i8x32(w, q + 96), y3)
            a = (t * G + k) * 8
            store_f32x8(acc, a, fma_i32x8_f32x8(load_f32x8(acc, a), i, mul_f32x8(_f16_quad2(w, o + k * span), dy)))


def _blockg(isa, lay, w, o, span, yq, yd, ysum, ycol, c, nt, K, b, acc):
    """`_pair(lay)` group blocks at once (Q8_0 4x4 only); a no-op elsewhere."""


@overload(_blockg, inline="always")
def _ol_blockg(isa, lay, w, o, span, yq, yd, ysum, ycol, c, nt, K, b, acc):
    if lay.family == "q8_0":
        return lambda isa, lay, w, o, span, yq, yd, ysum, ycol, c, nt, K, b, acc: _block_q8xg(
            isa, lay, w, o, span, yq, yd, ysum, ycol, c, nt, K, b, acc)
    return lambda isa, lay, w, o, span, yq, yd, ysum, ycol, c, nt, K, b, acc: None


#: Row groups per gemm task (when the matrix's group count divides by it, else one): Q8_0 4x4
#: takes eight, so each activation broadcast serves 32 rows (the 8x8 layouts get 8 rows from
#: one group, and their products also unpack nibbles); the others one.
@token_constant
def _pair(lay):
    return 8 if lay.family == "q8_0" else 1


@njit(cache=True, inline="always")
def _block_q4_K(isa, lay, w, o, yq, yd, ysum, ys, ycol, c, nt, K, b, acc, iacc):
    """One Q4_K 8x8 group super-block (8 rows x 256 values) against columns c..c+nt.

    Per sub-block pair p the int lanes of (low nibbles, sub-block 2p) and (high, 2p+1) are
    scaled by the rows' 6-bit scales into iacc; the mins term sum_j m_j * sum(y_j) follows.
    """
    nbk = K // 256
    for t in range(nt):
        store_i32x8(iacc, t * 16, zero_i32x8())
        store_i32x8(iacc, t * 16 + 8, zero_i32x8())
    for p in range(4):
        q = o + 160 + 256 * p
        la0, ha0 = split_nibbles_i8x32(load_i8x32(w, q), 0)
        lb0, hb0 = split_nibbles_i8x32(load_i8x32(w, q + 32), 0)
        la1, ha1 = split_nibbles_i8x32(load_i8x32(w, q + 64), 0)
        lb1, hb1 = split_nibbles_i8x32(load_i8x32(w, q + 96), 0)
        la2, ha2 = split_nibbles_i8x32(load_i8x32(w, q + 128), 0)
        lb2, hb2 = split_nibbles_i8x32(load_i8x32(w, q + 160), 0)
        la3, ha3 = split_nibbles_i8x32(load_i8x32(w, q + 192), 0)
        lb3, hb3 = split_nibbles_i8x32(load_i8x32(w, q + 224), 0)
        sca_lo = _u8_pairs(w, o + 32 + 16 * p)
        scb_lo = _u8_pairs(w, o + 36 + 16 * p)
        sca_hi = _u8_pairs(w, o + 40 + 16 * p)
        scb_hi = _u8_pairs(w, o + 44 + 16 * p)
        z = zero_i32x8()
        for t in range(nt):
            y = ycol[c + t] * K + b * 256 + 64 * p
            y0, y1, y2, y3 = _bcast8(yq, y), _bcast8(yq, y + 8), _bcast8(yq, y + 16), _bcast8(yq, y + 24)
            ila = dot_u8s8(isa, dot_u8s8(isa, dot_u8s8(isa, dot_u8s8(isa, z, la0, y0), la1, y1), la2, y2), la3, y3)
            ilb = dot_u8s8(isa, dot_u8s8(isa, dot_u8s8(isa, dot_u8s8(isa, z, lb0, y0), lb1, y1), lb2, y2), lb3, y3)
            y0, y1 = _bcast8(yq, y + 32), _bcast8(yq, y + 40)
            y2, y3 = _bcast8(yq, y + 48), _bcast8(yq, y + 56)
            iha = dot_u8s8(isa, dot_u8s8(isa, dot_u8s8(isa, dot_u8s8(isa, z, ha0, y0), ha1, y1), ha2, y2), ha3, y3)
            ihb = dot_u8s8(isa, dot_u8s8(isa, dot_u8s8(isa, dot_u8s8(isa, z, hb0, y0), hb1, y1), hb2, y2), hb3, y3)
            ia = add_i32x8(mul_i32x8(ila, sca_lo), mul_i32x8(iha, sca_hi))
            ib = add_i32x8(mul_i32x8(ilb, scb_lo), mul_i32x8(ihb, scb_hi))
            store_i32x8(iacc, t * 16, add_i32x8(load_i32x8(iacc, t * 16), ia))
            store_i32x8(iacc, t * 16 + 8, add_i32x8(load_i32x8(iacc, t * 16 + 8), ib))
    da = _f16_pairs(w, o)
    db = _f16_pairs(w, o + 8)
    half = splat_f32x8(0.5)  # each row sits on 2 lanes: its mins term once per row
    dma = mul_f32x8(_f16_pairs(w, o + 16), half)
    dmb = mul_f32x8(_f16_pairs(w, o + 24), half)
    for t in range(nt):
        col = ycol[c + t]
        ms = col * (K // 32) + b * 8
        ma = mb = zero_i32x8()
        for j in range(8):
            yj = splat_i32x8(ysum[ms + j])
            ma = add_i32x8(ma, mul_i32x8(_u8_pairs(w, o + 96 + 8 * j), yj))
            mb = add_i32x8(mb, mul_i32x8(_u8_pairs(w, o + 100 + 8 * j), yj))
        dy = splat_f32x8(yd[col * nbk + b])
        fa = sub_f32x8(fma_i32x8_f32x8(load_f32x8(acc, t * 16), load_i32x8(iacc, t * 16), mul_f32x8(da, dy)),
                        mul_f32x8(i32x8_to_f32x8(ma), mul_f32x8(dma, dy)))
        fb = sub_f32x8(fma_i32x8_f32x8(load_f32x8(acc, t * 16 + 8), load_i32x8(iacc, t * 16 + 8),
                                        mul_f32x8(db, dy)),
                        mul_f32x8(i32x8_to_f32x8(mb), mul_f32x8(dmb, dy)))
        store_f32x8(acc, t * 16, fa)
        store_f32x8(acc, t * 16 + 8, fb)


def _block(isa, lay, w, o, yq, yd, ysum, ys, ycol, c, nt, K, b, acc, iacc):
    """One group block of the layout's family."""


@overload(_block, inline="always")
def _ol_block(isa, lay, w, o, yq, yd, ysum, ys, ycol, c, nt, K, b, acc, iacc):
    f = {"q4_0": _block_q4, "q4_1": _block_q4, "q5_0": _block_q4, "q8_0": _block_q8, "q4_K": _block_q4_K}[lay.family]
    return lambda isa, lay, w, o, yq, yd, ysum, ys, ycol, c, nt, K, b, acc, iacc: f(
        isa, lay, w, o, yq, yd, ysum, ys, ycol, c, nt, K, b, acc, iacc)


# --- gemv: one column, accumulators in registers ------------------------------------------------
@njit(cache=True, inline="always")
def _store_rows(out, oo, rows, n, a, b):
    """out[oo + r] = sum of the lanes of accumulators a (lanes 0-7) and b (8-15) that hold row r."""
    for r in range(n):
        out[oo + r] = 0.0
    for i in range(8):
        out[oo + rows[i]] += lane(a, i)
        out[oo + rows[i + 8]] += lane(b, i)


@njit(cache=True, inline="always")
def _gemv_q4(isa, lay, w, base, gbytes, nbk, yq, yd, ysum, ys, col, K, out, oo, rows):
    """One Q4_0 / Q4_1 / Q5_0 row group against one column: the gemv, as _block_q4 with nt = 1 but
    with both float accumulators kept in registers across all K blocks."""
    fa = zero_f32x8()
    fb = zero_f32x8()
    for b in range(nbk):
        o = base + b * gbytes
        qo = o + _head(lay)
        y = col * K + b * 32
        blk = col * nbk + b
        init = splat_i32x8(np.int32(_corr(lay) * ysum[blk]))
        dy = splat_f32x8(yd[blk])
        l0, h0 = split_nibbles_i8x32(load_i8x32(w, qo), _mask(lay))
        l1, h1 = split_nibbles_i8x32(load_i8x32(w, qo + 32), _mask(lay))
        if _is8(lay):
            l2, h2 = split_nibbles_i8x32(load_i8x32(w, qo + 64), _mask(lay))
            l3, h3 = split_nibbles_i8x32(load_i8x32(w, qo + 96), _mask(lay))
            l0, h0, l1, h1, l2, h2, l3, h3 = _q5_bits(lay, w, o, l0, h0, l1, h1, l2, h2, l3, h3)
            ia = dot_u8s8(isa, dot_u8s8(isa, init, l0, _yop(lay, yq, y)), h0, _yop(lay, yq, y + 16))
            ia = dot_u8s8(isa, dot_u8s8(isa, ia, l2, _yop(lay, yq, y + 8)), h2, _yop(lay, yq, y + 24))
            ib = dot_u8s8(isa, dot_u8s8(isa, init, l1, _yop(lay, yq, y)), h1, _yop(lay, yq, y + 16))
            ib = dot_u8s8(isa, dot_u8s8(isa, ib, l3, _yop(lay, yq, y + 8)), h3, _yop(lay, yq, y + 24))
            fa = fma_i32x8_f32x8(fa, ia, mul_f32x8(_scales(lay, w, o, 0), dy))
            fb = fma_i32x8_f32x8(fb, ib, mul_f32x8(_scales(lay, w, o, 1), dy))
        else:  # A and B lanes hold the same rows: one float update
            ia = dot_u8s8(isa, dot_u8s8(isa, init, l0, _yop(lay, yq, y)), h0, _yop(lay, yq, y + 16))
            ib = dot_u8s8(isa, dot_u8s8(isa, init, l1, _yop(lay, yq, y + 8)), h1, _yop(lay, yq, y + 24))
            fa = fma_i32x8_f32x8(fa, add_i32x8(ia, ib), mul_f32x8(_scales(lay, w, o, 0), dy))
        if _is_q4_1(lay):  # m * s, shared by the lanes of a row (inv_lpr: 1 / lanes per row, exact)
            sm = splat_f32x8(ys[blk] * np.float32(_inv_lpr(lay)))
            fa = fma_f32x8(fa, _scales(lay, w, o + 2 * lay_rows(lay), 0), sm)
            if _is8(lay):
                fb = fma_f32x8(fb, _scales(lay, w, o + 2 * lay_rows(lay), 1), sm)
    _store_rows(out, oo, rows, lay_rows(lay), fa, fb)


@njit(cache=True, inline="always")
def _gemv_q8(isa, lay, w, base, gbytes, nbk, yq, yd, ysum, ys, col, K, out, oo, rows):
    """One Q8_0 4x4 row group against one column (see _block_q8), accumulator in registers."""
    fa = zero_f32x8()
    for b in range(nbk):
        o = base + b * gbytes
        qo = o + 8
        y = col * K + b * 32
        blk = col * nbk + b
        init = splat_i32x8(np.int32(_q8_corr(isa) * ysum[blk]))
        ia = _dot_q8(isa, _dot_q8(isa, init, load_i8x32(w, qo), _bcast4x2(yq, y)),
                     load_i8x32(w, qo + 64), _bcast4x2(yq, y + 16))
        ib = _dot_q8(isa, _dot_q8(isa, init, load_i8x32(w, qo + 32), _bcast4x2(yq, y + 8)),
                     load_i8x32(w, qo + 96), _bcast4x2(yq, y + 24))
        fa = fma_i32x8_f32x8(fa, add_i32x8(ia, ib), mul_f32x8(_f16_quad2(w, o), splat_f32x8(yd[blk])))
    _store_rows(out, oo, rows, 4, fa, zero_f32x8())


def _gemv(isa, lay, w, base, gbytes, nbk, yq, yd, ysum, ys, col, K, out, oo, rows):
    """The register gemv of the x86 layouts (q4_0_8x8, q4_1_8x8, q5_0_8x8, q8_0_4x4). The NEON-style
    Q4_0 groupings and Q4_K take the tile path: a gemv per variant costs ~5 s of cold compile."""


def _gemv_kernel(t: LayoutType):
    if t.family == "q8_0":
        return _gemv_q8
    return _gemv_q4 if t.family in ("q4_0", "q4_1", "q5_0") and t.nrows == 8 else None


@overload(_gemv, inline="always")
def _ol_gemv(isa, lay, w, base, gbytes, nbk, yq, yd, ysum, ys, col, K, out, oo, rows):
    f = _gemv_kernel(lay)
    if f is None:
        return lambda isa, lay, w, base, gbytes, nbk, yq, yd, ysum, ys, col, K, out, oo, rows: None
    return lambda isa, lay, w, base, gbytes, nbk, yq, yd, ysum, ys, col, K, out, oo, rows: f(
        isa, lay, w, base, gbytes, nbk, yq, yd, ysum, ys, col, K, out, oo, rows)


def has_register_gemv(lay: Layout) -> bool:
    """Whether `repack_mm` multiplies a single column of this layout with its register gemv (for
    the others, Q4_K among them, its one-column tasks keep their sums in memory)."""
    return _gemv_kernel(LayoutType(lay)) is not None


def runs_in_repack_mm(lay: Layout) -> bool:
    """Whether `repack_mm` has kernels for the layout (q6_K_8x8 has only `tiles.tile_mm`)."""
    return lay.gtype is not GType.Q6_K


@token_constant
def _has_gemv(lay):
    return _gemv_kernel(lay) is not None


# --- activation quantization, inside the kernel ----------------------------------------------------
def _quant(lay, x, qs, yd, ys, s4, ysum, r0, r1):
    """Rows r0..r1 of x to the layout's vec_dot_type (Q8_0/Q8_1 or Q8_K) plus ysum per 32 values."""


@njit(cache=True)
def _ysum(s4, ysum, per, i0, i1):
    """ysum[i] = the sum of s4[per * i: per * (i + 1)] (s4: sums of 4, or Q8_K's sums of 16)."""
    for i in range(i0, i1):
        total = np.int32(0)
        for j in range(per):
            total += s4[per * i + j]
        ysum[i] = total


@overload(_quant, inline="always")
def _ol_quant(lay, x, qs, yd, ys, s4, ysum, r0, r1):
    if lay.family == "q4_K":
        def q8k(lay, x, qs, yd, ys, s4, ysum, r0, r1):
            quantize_rows_q8_K(x, qs, yd, s4, r0, r1)
            _ysum(s4, ysum, 2, r0 * (x.shape[1] // 32), r1 * (x.shape[1] // 32))
        return q8k

    def q8(lay, x, qs, yd, ys, s4, ysum, r0, r1):
        quantize_rows_q8(x, qs, yd, ys, s4, r0, r1)
        _ysum(s4, ysum, 8, r0 * (x.shape[1] // 32), r1 * (x.shape[1] // 32))
    return q8


@token_constant
def _qblock(lay):
    """Values per activation block (Q8_K: 256)."""
    return 256 if lay.family == "q4_K" else 32


@token_constant
def _sgroup(lay):
    """Values per entry of the activation sums s4 (Q8_K's bsums: 16)."""
    return 16 if lay.family == "q4_K" else 4

QUANT_PARALLEL_MIN = 1 << 16  # activation values below which quantizing serially beats a second region


# --- the kernel -------------------------------------------------------------------------------------
@njit(cache=True)
def act_scratch(lay, n, K):
    """The quantized form of n activation rows of K values for the layout's vec_dot_type: qs,
    yd and ys (a scale and a scaled sum per block), s4 (sums of 4, or Q8_K's sums of 16), ysum
    (sums of 32)."""
    return (np.empty(n * K, np.int8), np.empty(n * K // _qblock(lay), np.float32),
            np.empty(n * K // _qblock(lay), np.float32), np.empty(n * K // _sgroup(lay), np.int32),
            np.empty(n * K // 32, np.int32))


@njit(cache=True)
def repack_mm(part, parts, isa, lay, w, wg, gbytes, nbk, K, M, x, cstart, ycol, ocol, rows, out,
              qs, yd, ys, s4, ysum, quantize):
    """MUL_MAT / MUL_MAT_ID on repacked weights, F32 activations x [n, K] in, as a split kernel
    (ggx-cpu's `split`): part -1 quantizes x into the scratch (qs, yd, ys, s4, ysum:
    `act_scratch`) when `quantize` (else `quant_rows` ran before), parts 0..parts-1 run `_chunk`
    over contiguous chunks of the (matrix, row group) tasks."""
    if part < 0:
        if quantize:
            _quant(lay, x, qs, yd, ys, s4, ysum, 0, x.shape[0])
    elif part < parts:
        _chunk(part, parts, isa, lay, w, wg, gbytes, nbk, K, M, cstart, ycol, ocol, rows, out, qs, yd, ys, ysum)


@njit(cache=True)
def quant_rows(part, parts, lay, x, qs, yd, ys, s4, ysum):
    """The activations x [n, K] quantized into `repack_mm`'s scratch, as a split kernel: part p
    quantizes rows p * n // parts up to (p + 1) * n // parts (a batch's, when worth sharing out:
    QUANT_PARALLEL_MIN)."""
    if 0 <= part < parts:
        n = x.shape[0]
        _quant(lay, x, qs, yd, ys, s4, ysum, part * n // parts, (part + 1) * n // parts)


@njit(cache=True)
def _units(lay, M):
    """Tasks per matrix: its row groups, or pairs of them (`_pair`) when the count divides."""
    n_groups = M // lay_rows(lay)
    return n_groups // _pair(lay) if n_groups % _pair(lay) == 0 else n_groups


@njit(cache=True)
def _chunk(ch, nch, isa, lay, w, wg, gbytes, nbk, K, M, cstart, ycol, ocol, rows, out, qs, yd, ys, ysum):
    """Chunk ch of nch of the (matrix, row group) tasks, allocating its scratch once. A task is
    one row group, or `_pair(lay)` consecutive ones (Q8_0) when the group count divides by it. A
    task with a single column runs the register gemv; otherwise columns go TILE at a time (gemm):
    every group block's weights are loaded and unpacked once per tile and serve all its columns."""
    N = lay_rows(lay)
    n_units = _units(lay, M)
    unit = (M // N) // n_units  # row groups per task
    n_tasks = wg.shape[0] * n_units
    span = nbk * gbytes  # bytes of one row group
    acc = np.empty(TILE * 64, np.float32)  # 64: a Q8_0 task's 8 groups
    iacc = np.empty(TILE * 16, np.int32)
    for task in range(ch * n_tasks // nch, (ch + 1) * n_tasks // nch):
        g = task // n_units
        grp = (task % n_units) * unit
        base = wg[g] + grp * span
        c = cstart[g]
        if _has_gemv(lay) and cstart[g + 1] - c == 1:
            for k in range(unit):
                _gemv(isa, lay, w, base + k * span, gbytes, nbk, qs, yd, ysum, ys, ycol[c], K, out,
                      ocol[c] * M + (grp + k) * N, rows)
            continue
        while c < cstart[g + 1]:
            nt = min(TILE, cstart[g + 1] - c)
            acc[:] = 0.0
            for b in range(nbk):
                if unit > 1:
                    _blockg(isa, lay, w, base + b * gbytes, span, qs, yd, ysum, ycol, c, nt, K, b, acc)
                else:
                    _block(isa, lay, w, base + b * gbytes, qs, yd, ysum, ys, ycol, c, nt, K, b, acc, iacc)
            for t in range(nt):
                oo = ocol[c + t] * M + grp * N
                for r in range(N * unit):
                    out[oo + r] = 0.0
                if unit > 1:  # 8 lanes per group (lanes 0-7 of lane_rows: rows 0..N-1), groups in order
                    for lane in range(8 * unit):
                        out[oo + rows[lane % 8] + (lane // 8) * N] += acc[t * 8 * unit + lane]
                else:
                    for lane in range(16):
                        out[oo + rows[lane]] += acc[t * 16 + lane]
            c += nt


__all__ = ["repack_mm", "quant_rows", "act_scratch", "has_register_gemv", "runs_in_repack_mm", "QUANT_PARALLEL_MIN",
           "lane_rows", "LayoutType", "TILE"]
