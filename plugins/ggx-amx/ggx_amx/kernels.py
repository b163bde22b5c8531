"""MUL_MAT / MUL_MAT_ID on weights in ggml's AMX layout (layout.py): ggml's amx/mmq.cpp kernels.

A launch is ggx-cpu's activation quantizer (the weight's vec_dot_type: Q8_0, Q8_1 or Q8_K,
`act_launch`), then `amx_mm`, one per (ISA token, engine token, tile format), a split kernel
over tasks (ggx-cpu's `split`: jobs of its worker threads for one token, one parallel region for
a batch). A task is 32 weight rows (two tiles of rows) of one
matrix and up to 32 of its activation columns:

- gemm (a matrix with more than one column): the tiling loop of ggml's `tinygemm_kernel_amx`.
  Per K block, `tile_step` runs the 2-2-4 pattern (two A tiles of 16 activation rows, two B
  tiles of 16 weight rows, four 16 x 16 int32 C tiles, `tdpbssd`); B tiles of 4-bit types are
  first unpacked from nibbles to one int8 per value (`_unpack_*`, ggml's `unpack_B`), Q8_0's are
  loaded from the layout as they are. The int32 tiles are then scaled into float accumulators
  with 8-lane vector code (`_acc_c`, ggml's `acc_C`): C * d_w * d_a (+ m_w * s_a for Q4_1). K-quants
  run one step per sub-block (Q4_K: 32 values; Q6_K: 16, the A tile zero-padded from 16 to 32
  values as in ggml) and scale each step's tiles by the sub-block scales into int32 sums first
  (ggml's `scale_C`); Q4_K's mins come from the activation's Q8_K sums. The engine token decides
  whether `tile_step` is AMX (`tiles.py`) or its software model: the loop is the same.
- gemv (a matrix with one column, decode): ggml's `tinygemm_kernel_vnni`: no tiles, the AMX
  layout read with 8-bit vector products (ggx-cpu's `dot_u8s8` / `dot_s8s8`: vpdpbusd on
  AVX-512 VNNI) where each int32 lane is one weight row, so no horizontal sums: decode is
  bandwidth-bound, and AMX would waste 15 of 16 tile rows.

A tiles are loaded straight from the quantized activations (16 rows K bytes apart) when a
task's 32 columns are 32 consecutive rows of them (MUL_MAT); otherwise (MUL_MAT_ID's columns,
the last columns of a matrix, Q6_K's 16-value groups) their bytes are first gathered into a
zero-padded scratch (ggml's `unpack_A`), so no load reads past the activations.

Inputs (checked by buffer.py before a kernel runs):
  w       uint8: the AMX buffer's bytes; matrix g's tiles start at byte wg[g] (layout.py order).
  qs, yd, ys, s4   the quantized activations (ggx-cpu's `Q8Act`: int8 rows of K values, block
          scales, Q8_1 sums, sums of 4 (or Q8_K's of 16) values); column c of matrix g
          (cstart[g] <= c < cstart[g + 1]) reads row ycol[c] and writes row ocol[c] of `out`
          (rows of M floats); `direct`: ycol is the identity (MUL_MAT).
  cfg     uint8 [64]: tiles.tile_config().

ggml double-buffers the C tiles to overlap the tile instructions with the previous step's
accumulation; this loop runs them one after the other (simpler; the difference is unmeasured).
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from ggx_cpu.extension import (
    TokenType,
    add_i32x8,
    dot_s8s8,
    dot_u8s8,
    fma_f32x8,
    fma_i32x8_f32x8,
    i32x8_to_f32x8,
    load_f32x8,
    load_i8x32,
    load_i32x8,
    make_shuffled_load,
    mul_f32x8,
    mul_i32x8,
    register_token,
    splat_f32x8,
    splat_i32x8,
    split_nibbles_i8x32,
    store_f32x8,
    store_i32x8,
    sub_f32x8,
    sub_i32x8,
    token_constant,
    u8s8_saturates,
    xor80_i8x32,
    zero_f32x8,
    zero_i32x8,
)

from .layout import TileFormat
from .tiles import C_SLOT, state_bytes, tile_begin, tile_end, tile_step
from .vec import load_i32x8_at, load_s8_i32x8, nibbles_minus, q6_pair, store_i8x32

BLOCK = 32  # weight rows and activation columns per task (ggml's 2 * TILE_N, 2 * TILE_M)


# --- the format token ----------------------------------------------------------------------------------
class FormatType(TokenType):
    """numba type of a `TileFormat`: kernels specialize on it (name = the weight type)."""

    def __init__(self, fmt: TileFormat):
        self.family = fmt.name  # "q4_0", "q4_1", "q8_0", "q4_K", "q6_K"
        self.tile_bytes = fmt.tile_bytes
        self.block_size = fmt.block_size
        self.off_d, self.off_scales, self.off_extra, self.off_dmin = fmt.d, fmt.scales, fmt.extra, fmt.dmin
        super().__init__(name=f"AmxFormat({fmt.name})")


register_token(TileFormat, FormatType)


def _field(attr: str, doc: str):
    """A jit-callable constant: `attr` of the format token's type."""
    def value(fmt):
        return getattr(fmt, attr)
    value.__name__, value.__doc__ = f"_{attr}", doc
    return token_constant(value)


_tb = _field("tile_bytes", "Bytes of one tile.")
_bs = _field("block_size", "Values of K per tile.")
_od = _field("off_d", "Where a tile's f16 d of the 16 rows start.")
_os = _field("off_scales", "Where a tile's (sub-block) scales start.")
_ox = _field("off_extra", "Where Q4_1's m, Q8_0's comp or Q4_K's mins start.")
_odmin = _field("off_dmin", "Where Q4_K's f16 dmin start.")


@token_constant
def _sgroup(fmt):
    """Values per entry of the activation sums s4 (Q8_K's bsums: 16)."""
    return 16 if fmt.block_size == 256 else 4


# --- loads that spread bytes over lanes ---------------------------------------------------------------
_bcast4 = make_shuffled_load(4, 8, [0, 1, 2, 3] * 8, "i8")  # one dword of activations in every lane
_f16x8 = make_shuffled_load(8, 16, list(range(8)), "f16")  # 8 rows' f16 scales
_u8x8 = make_shuffled_load(8, 8, list(range(8)), "u32")  # 8 rows' u8 scales
_mins_even = make_shuffled_load(16, 8, list(range(0, 16, 2)), "u32")  # Q4_K mins of sub-block 2j, rows 0-7
_mins_odd = make_shuffled_load(16, 8, list(range(1, 16, 2)), "u32")  # ... of sub-block 2j + 1


@njit(cache=True, inline="always")
def _mins(w, o, k):
    """Q4_K's mins of sub-block k for the 8 rows at byte o of the mins section (int32 lanes)."""
    p = o + 32 * (k >> 1)
    return _mins_odd(w, p) if k & 1 else _mins_even(w, p)


# --- activations ----------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _sum32(fmt, s4, col, K, j):
    """The sum of activation values 32 j..32 j + 31 of row col (from the sums of 4, or Q8_K's of 16)."""
    per = 32 // _sgroup(fmt)
    o = (col * K) // _sgroup(fmt) + per * j
    total = np.int32(0)
    for e in range(per):
        total += s4[o + e]
    return total


@njit(cache=True)
def _gather_a(qs, ycol, c0, nv, K, off, nbytes, at):
    """Two A tiles (32 rows x 32 bytes) in `at`: row r = bytes off..off + nbytes of activation row
    ycol[c0 + r] for r < nv, zeros elsewhere (bytes nbytes..31 of a row stay as they are: zero)."""
    for r in range(32):
        if r < nv:
            src = ycol[c0 + r] * K + off
            for j in range(nbytes):
                at[32 * r + j] = qs[src + j]
        else:
            for j in range(nbytes):
                at[32 * r + j] = 0


# --- B tiles: unpacked to one int8 per value ------------------------------------------------------------
@njit(cache=True)
def _unpack_nibbles(w, src, bias, bt, bo):
    """The 256 nibble-packed bytes at w[src:] (layout.py) as an 8 x 64 B tile at bt[bo:]: tile row
    2p from the low nibbles of bytes 64p.., row 2p + 1 from their high nibbles, minus `bias`."""
    for p in range(4):
        for h in range(2):
            lo, hi = nibbles_minus(load_i8x32(w, src + 64 * p + 32 * h), bias)
            store_i8x32(bt, bo + 128 * p + 32 * h, lo)
            store_i8x32(bt, bo + 128 * p + 64 + 32 * h, hi)


@njit(cache=True)
def _unpack_q6(fmt, w, tile, g, bt, bo):
    """Q6_K's 16-value group g of a tile as tile rows 0-3 at bt[bo:] (values - 32); rows 4-7 stay
    zero (the A tile's values 16..31 are zero too, ggml's padding)."""
    for h in range(2):
        hb = load_i8x32(w, tile + _ox(fmt) + 64 * g + 32 * h)
        v0, v1 = q6_pair(load_i8x32(w, tile + 128 * g + 32 * h), hb, 0, 32)
        v2, v3 = q6_pair(load_i8x32(w, tile + 128 * g + 64 + 32 * h), hb, 4, 32)
        store_i8x32(bt, bo + 32 * h, v0)
        store_i8x32(bt, bo + 64 + 32 * h, v1)
        store_i8x32(bt, bo + 128 + 32 * h, v2)
        store_i8x32(bt, bo + 192 + 32 * h, v3)


# --- gemm: one K block of a task ----------------------------------------------------------------------------
@njit(cache=True)
def _acc_c(fmt, w, t0, t1, tiles, acc, ycol, c0, nv, yd, ys, s4, K, i):
    """ggml's acc_C: for the task's columns, acc[column][row] += float(int32 tile) * d_w * d_a plus
    the block's offset terms (`_offsets`, as the gemv's). `tiles`: the four 16 x 16 int32 tiles."""
    nbk = K // _bs(fmt)
    for q in range(4):
        tile = t0 if q < 2 else t1
        d0, d1 = _f16x8(w, tile + _od(fmt)), _f16x8(w, tile + _od(fmt) + 16)
        for m in range(min(16, nv - 16 * (q & 1))):
            am = 16 * (q & 1) + m
            col = ycol[c0 + am]
            dy = splat_f32x8(yd[col * nbk + i])
            a, o = 32 * am + 16 * (q >> 1), C_SLOT * q + 16 * m
            f0 = fma_i32x8_f32x8(load_f32x8(acc, a), load_i32x8(tiles, o), mul_f32x8(d0, dy))
            f1 = fma_i32x8_f32x8(load_f32x8(acc, a + 8), load_i32x8(tiles, o + 8), mul_f32x8(d1, dy))
            f0, f1 = _offsets(fmt, w, tile, ys, s4, col, K, i, dy, f0, f1)
            store_f32x8(acc, a, f0)
            store_f32x8(acc, a + 8, f1)


@njit(cache=True)
def _step(eng, T, qs, ycol, direct, c0, nv, K, off, nbytes, b, b0, b1, at, ct):
    """One tile step: A = 32 activation columns' bytes off..off + nbytes (straight from qs when
    they are 32 consecutive full rows, else gathered into `at`), B tiles at b0, b1 of b."""
    if direct and nv == 32 and nbytes == 32:
        a0 = ycol[c0] * K + off
        tile_step(eng, T, qs, a0, a0 + 16 * K, K, b, b0, b1, 64, ct)
    else:
        _gather_a(qs, ycol, c0, nv, K, off, nbytes, at)
        tile_step(eng, T, at, 0, 512, 32, b, b0, b1, 64, ct)


@njit(cache=True)
def _block_q(eng, fmt, T, w, t0, t1, qs, yd, ys, s4, ycol, direct, c0, nv, K, i, bt, at, ct, si, acc):
    """One 32-value K block (Q4_0, Q4_1, Q8_0) of a 32 x 32 task: one tile step, then acc_C."""
    if fmt_is(fmt, "q8_0"):  # int8 weights: the B tiles are the layout's bytes
        _step(eng, T, qs, ycol, direct, c0, nv, K, 32 * i, 32, w, t0, t1, at, ct)
    else:
        bias = 8 if fmt_is(fmt, "q4_0") else 0
        _unpack_nibbles(w, t0, bias, bt, 0)
        _unpack_nibbles(w, t1, bias, bt, 512)
        _step(eng, T, qs, ycol, direct, c0, nv, K, 32 * i, 32, bt, 0, 512, at, ct)
    _acc_c(fmt, w, t0, t1, ct, acc, ycol, c0, nv, yd, ys, s4, K, i)


@njit(cache=True)
def _block_k(eng, fmt, T, w, t0, t1, qs, yd, ys, s4, ycol, direct, c0, nv, K, i, bt, at, ct, si, acc):
    """One 256-value super-block (Q4_K, Q6_K) of a 32 x 32 task: a tile step per sub-block, its
    tiles times the sub-block scales summed in int32 (scale_C), then acc_C with the mins."""
    si[:] = 0
    q4 = fmt_is(fmt, "q4_K")
    for k in range(8 if q4 else 16):
        if q4:
            _unpack_nibbles(w, t0 + 256 * k, 0, bt, 0)
            _unpack_nibbles(w, t1 + 256 * k, 0, bt, 512)
            _step(eng, T, qs, ycol, direct, c0, nv, K, 256 * i + 32 * k, 32, bt, 0, 512, at, ct)
        else:  # 16 values per row, the A tiles zero-padded to 32
            _unpack_q6(fmt, w, t0, k, bt, 0)
            _unpack_q6(fmt, w, t1, k, bt, 512)
            _step(eng, T, qs, ycol, direct, c0, nv, K, 256 * i + 16 * k, 16, bt, 0, 512, at, ct)
        for q in range(4):
            sc = (t0 if q < 2 else t1) + _os(fmt) + 16 * k
            s0, s1 = _scales8(fmt, w, sc), _scales8(fmt, w, sc + 8)
            for m in range(min(16, nv - 16 * (q & 1))):
                o = C_SLOT * q + 16 * m
                store_i32x8(si, o, add_i32x8(load_i32x8(si, o), mul_i32x8(load_i32x8(ct, o), s0)))
                store_i32x8(si, o + 8, add_i32x8(load_i32x8(si, o + 8), mul_i32x8(load_i32x8(ct, o + 8), s1)))
    _acc_c(fmt, w, t0, t1, si, acc, ycol, c0, nv, yd, ys, s4, K, i)


def _scales8(fmt, w, off):
    """8 rows' sub-block scales at byte off as int32 lanes (Q4_K: unsigned 6-bit; Q6_K: int8)."""


@overload(_scales8, inline="always")
def _ol_scales8(fmt, w, off):
    if fmt.family == "q6_K":
        return lambda fmt, w, off: load_s8_i32x8(w, off)
    return lambda fmt, w, off: _u8x8(w, off)


def fmt_is(fmt, family):
    """Whether the format token is `family` (a compile-time constant)."""


@overload(fmt_is, inline="always")
def _ol_fmt_is(fmt, family):
    want = getattr(family, "literal_value", None)
    if want is None:
        return None
    same = fmt.family == want
    return lambda fmt, family: same


def _block(eng, fmt, T, w, t0, t1, qs, yd, ys, s4, ycol, direct, c0, nv, K, i, bt, at, ct, si, acc):
    """One K block of a gemm task, by the format's family."""


@overload(_block, inline="always")
def _ol_block(eng, fmt, T, w, t0, t1, qs, yd, ys, s4, ycol, direct, c0, nv, K, i, bt, at, ct, si, acc):
    f = _block_k if fmt.block_size == 256 else _block_q
    return lambda eng, fmt, T, w, t0, t1, qs, yd, ys, s4, ycol, direct, c0, nv, K, i, bt, at, ct, si, acc: f(
        eng, fmt, T, w, t0, t1, qs, yd, ys, s4, ycol, direct, c0, nv, K, i, bt, at, ct, si, acc)


# --- gemv: one column, AVX-512 VNNI style on the AMX layout --------------------------------------------------
# ggml's tinygemm_kernel_vnni: 16 weight rows (one tile of rows) against one activation row, the
# bytes of one row in each int32 lane (the layout's VNNI order), so there is no horizontal sum:
# per block, `_dots` gives the integer dot of each row (K-quants: already times the sub-block
# scales), `_gemv` scales it by d_w d_a, `_offsets` adds what the block's offset terms leave.
@njit(cache=True)
def _gemv(isa, fmt, w, tb, qs, yd, ys, s4, col, K, out, oo):
    """out[oo..oo + 16] = the 16 rows of the tiles from byte tb . activation row col."""
    f0 = zero_f32x8()
    f1 = zero_f32x8()
    nbk = K // _bs(fmt)
    for i in range(nbk):
        o = tb + i * _tb(fmt)
        i0, i1 = _dots(isa, fmt, w, o, qs, s4, col, K, i)
        dy = splat_f32x8(yd[col * nbk + i])
        f0 = fma_i32x8_f32x8(f0, i0, mul_f32x8(_f16x8(w, o + _od(fmt)), dy))
        f1 = fma_i32x8_f32x8(f1, i1, mul_f32x8(_f16x8(w, o + _od(fmt) + 16), dy))
        f0, f1 = _offsets(fmt, w, o, ys, s4, col, K, i, dy, f0, f1)
    store_f32x8(out, oo, f0)
    store_f32x8(out, oo + 8, f1)


@njit(cache=True)
def _dots_q4(isa, fmt, w, o, qs, s4, col, K, i):
    """Q4_0 / Q4_1: the unsigned nibbles times the activations; Q4_0's (q - 8) . a as q . a - 8 sum(a)."""
    y = col * K + 32 * i
    i0 = splat_i32x8(np.int32(-8 * _sum32(fmt, s4, col, K, i))) if fmt_is(fmt, "q4_0") else zero_i32x8()
    i1 = i0
    for p in range(4):
        ylo, yhi = _bcast4(qs, y + 8 * p), _bcast4(qs, y + 8 * p + 4)
        lo0, hi0 = split_nibbles_i8x32(load_i8x32(w, o + 64 * p), 0)
        lo1, hi1 = split_nibbles_i8x32(load_i8x32(w, o + 64 * p + 32), 0)
        i0 = dot_u8s8(isa, dot_u8s8(isa, i0, lo0, ylo), hi0, yhi)
        i1 = dot_u8s8(isa, dot_u8s8(isa, i1, lo1, ylo), hi1, yhi)
    return i0, i1


def _dot_q8(isa, acc, wq, y, ysum4):
    """acc + wq . y over the lanes (Q8_0 weights and activations, both signed)."""


@overload(_dot_q8, inline="always")
def _ol_dot_q8(isa, acc, wq, y, ysum4):
    if u8s8_saturates.value_of(isa):  # vpmaddubsw would saturate (y + 128) * w pairs: the signed product
        return lambda isa, acc, wq, y, ysum4: dot_s8s8(isa, acc, wq, y, ysum4)
    # ggml's route: (y + 128) unsigned times w signed; the lanes start at -comp (the layout's
    # 128 * sum(w) of the row, `_q8_start`)
    return lambda isa, acc, wq, y, ysum4: dot_u8s8(isa, acc, xor80_i8x32(y), wq)


def _q8_start(isa, w, off):
    """Where a Q8_0 block's lanes start: -comp (the u8 x s8 route) or 0."""


@overload(_q8_start, inline="always")
def _ol_q8_start(isa, w, off):
    if u8s8_saturates.value_of(isa):
        return lambda isa, w, off: zero_i32x8()
    return lambda isa, w, off: sub_i32x8(zero_i32x8(), load_i32x8_at(w, off))


@njit(cache=True)
def _dots_q8(isa, fmt, w, o, qs, s4, col, K, i):
    """Q8_0: ggml's VNNI route with the layout's compensation sums (or the signed product)."""
    y = col * K + 32 * i
    i0 = _q8_start(isa, w, o + _ox(fmt))
    i1 = _q8_start(isa, w, o + _ox(fmt) + 32)
    for k in range(8):
        ya = _bcast4(qs, y + 4 * k)
        sa = splat_i32x8(s4[y // 4 + k])
        i0 = _dot_q8(isa, i0, load_i8x32(w, o + 64 * k), ya, sa)
        i1 = _dot_q8(isa, i1, load_i8x32(w, o + 64 * k + 32), ya, sa)
    return i0, i1


@njit(cache=True)
def _dots_q4_K(isa, fmt, w, o, qs, s4, col, K, i):
    """Q4_K: each 32-value sub-block's dot times its 6-bit scale, summed in int32."""
    y = col * K + 256 * i
    a0 = zero_i32x8()
    a1 = zero_i32x8()
    for k in range(8):
        s0 = zero_i32x8()
        s1 = zero_i32x8()
        for p in range(4):
            ylo, yhi = _bcast4(qs, y + 32 * k + 8 * p), _bcast4(qs, y + 32 * k + 8 * p + 4)
            lo0, hi0 = split_nibbles_i8x32(load_i8x32(w, o + 256 * k + 64 * p), 0)
            lo1, hi1 = split_nibbles_i8x32(load_i8x32(w, o + 256 * k + 64 * p + 32), 0)
            s0 = dot_u8s8(isa, dot_u8s8(isa, s0, lo0, ylo), hi0, yhi)
            s1 = dot_u8s8(isa, dot_u8s8(isa, s1, lo1, ylo), hi1, yhi)
        a0 = add_i32x8(a0, mul_i32x8(s0, _u8x8(w, o + _os(fmt) + 16 * k)))
        a1 = add_i32x8(a1, mul_i32x8(s1, _u8x8(w, o + _os(fmt) + 16 * k + 8)))
    return a0, a1


@njit(cache=True)
def _dots_q6_K(isa, fmt, w, o, qs, s4, col, K, i):
    """Q6_K: the unsigned 6-bit values, -32 times the 16-value activation sums (Q8_K's bsums),
    each group's dot times its int8 scale, summed in int32."""
    y = col * K + 256 * i
    a0 = zero_i32x8()
    a1 = zero_i32x8()
    for g in range(16):
        ya, yb = _bcast4(qs, y + 16 * g), _bcast4(qs, y + 16 * g + 4)
        yc, ye = _bcast4(qs, y + 16 * g + 8), _bcast4(qs, y + 16 * g + 12)
        start = splat_i32x8(np.int32(-32 * s4[y // 16 + g]))
        for h in range(2):
            hb = load_i8x32(w, o + _ox(fmt) + 64 * g + 32 * h)
            v0, v1 = q6_pair(load_i8x32(w, o + 128 * g + 32 * h), hb, 0, 0)
            v2, v3 = q6_pair(load_i8x32(w, o + 128 * g + 64 + 32 * h), hb, 4, 0)
            s = dot_u8s8(isa, dot_u8s8(isa, dot_u8s8(isa, dot_u8s8(isa, start, v0, ya), v1, yb), v2, yc), v3, ye)
            prod = mul_i32x8(s, load_s8_i32x8(w, o + _os(fmt) + 16 * g + 8 * h))
            if h == 0:
                a0 = add_i32x8(a0, prod)
            else:
                a1 = add_i32x8(a1, prod)
    return a0, a1


def _dots(isa, fmt, w, o, qs, s4, col, K, i):
    """One block's integer dots of the 16 rows (two I32x8), by the format's family."""


@overload(_dots, inline="always")
def _ol_dots(isa, fmt, w, o, qs, s4, col, K, i):
    f = {"q4_0": _dots_q4, "q4_1": _dots_q4, "q8_0": _dots_q8, "q4_K": _dots_q4_K, "q6_K": _dots_q6_K}[fmt.family]
    return lambda isa, fmt, w, o, qs, s4, col, K, i: f(isa, fmt, w, o, qs, s4, col, K, i)


@njit(cache=True)
def _offsets(fmt, w, o, ys, s4, col, K, i, dy, f0, f1):
    """The block's offset terms in float: Q4_1 + m_w s_a (Q8_1's s = d_a sum(q_a)); Q4_K
    - dmin_w d_a sum over sub-blocks k of min_k * (the activations' sum over k); else none."""
    if fmt_is(fmt, "q4_1"):
        s = splat_f32x8(ys[col * (K // 32) + i])
        f0 = fma_f32x8(f0, _f16x8(w, o + _ox(fmt)), s)
        f1 = fma_f32x8(f1, _f16x8(w, o + _ox(fmt) + 16), s)
    elif fmt_is(fmt, "q4_K"):
        m0 = zero_i32x8()
        m1 = zero_i32x8()
        for k in range(8):
            b = splat_i32x8(_sum32(fmt, s4, col, K, 8 * i + k))
            m0 = add_i32x8(m0, mul_i32x8(_mins(w, o + _ox(fmt), k), b))
            m1 = add_i32x8(m1, mul_i32x8(_mins(w, o + _ox(fmt) + 16, k), b))
        f0 = sub_f32x8(f0, mul_f32x8(i32x8_to_f32x8(m0), mul_f32x8(_f16x8(w, o + _odmin(fmt)), dy)))
        f1 = sub_f32x8(f1, mul_f32x8(i32x8_to_f32x8(m1), mul_f32x8(_f16x8(w, o + _odmin(fmt) + 16), dy)))
    return f0, f1


# --- the kernel -----------------------------------------------------------------------------------------------
@njit(cache=True)
def tasks(cstart, n_blocks):
    """(matrix, row block, column block) of every task: one per 32 weight rows and 32 columns."""
    G = cstart.shape[0] - 1
    n = 0
    for g in range(G):
        n += n_blocks * ((cstart[g + 1] - cstart[g] + BLOCK - 1) // BLOCK)
    tg, tn, tm = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    t = 0
    for g in range(G):
        for mb in range((cstart[g + 1] - cstart[g] + BLOCK - 1) // BLOCK):
            for nb in range(n_blocks):
                tg[t], tn[t], tm[t] = g, nb, mb
                t += 1
    return tg, tn, tm


@njit(cache=True)
def _run_tasks(isa, eng, fmt, w, wg, K, M, qs, yd, ys, s4, cstart, ycol, ocol, direct, cfg, out, tg, tn, tm, t0, t1):
    """Tasks t0..t1 on this thread, with its own scratch and tile configuration. A matrix with one
    column runs the gemv, others the tiles."""
    nbk = K // _bs(fmt)
    T = np.zeros(state_bytes(eng), np.uint8)  # the emulated engine's tile registers (none for real AMX)
    bt = np.zeros(1024, np.int8)  # two unpacked B tiles (Q6_K: rows 4-7 stay zero)
    at = np.zeros(1024, np.int8)  # two gathered A tiles
    ct = np.empty(4 * C_SLOT, np.int32)  # the four C tiles of a step
    si = np.empty(4 * C_SLOT, np.int32)  # K-quants: scaled sums over a super-block
    acc = np.empty(BLOCK * BLOCK, np.float32)  # [column][row] of the task
    tile_begin(eng, T, cfg)
    for task in range(t0, t1):
        g, nb, mb = tg[task], tn[task], tm[task]
        c0 = cstart[g] + BLOCK * mb
        nv = min(BLOCK, cstart[g + 1] - c0)
        base = wg[g] + 2 * nb * nbk * _tb(fmt)
        if cstart[g + 1] - cstart[g] == 1:
            oo = ocol[c0] * M + BLOCK * nb
            _gemv(isa, fmt, w, base, qs, yd, ys, s4, ycol[c0], K, out, oo)
            _gemv(isa, fmt, w, base + nbk * _tb(fmt), qs, yd, ys, s4, ycol[c0], K, out, oo + 16)
            continue
        acc[:] = 0.0
        for i in range(nbk):
            b0 = base + i * _tb(fmt)
            _block(eng, fmt, T, w, b0, b0 + nbk * _tb(fmt), qs, yd, ys, s4, ycol, direct, c0, nv, K, i,
                   bt, at, ct, si, acc)
        for m in range(nv):
            oo = ocol[c0 + m] * M + BLOCK * nb
            for r in range(BLOCK):
                out[oo + r] = acc[BLOCK * m + r]
    tile_end(eng, T)


@njit(cache=True)
def amx_mm(part, parts, isa, eng, fmt, w, wg, K, M, qs, yd, ys, s4, cstart, ycol, ocol, direct, cfg, out, tg, tn, tm):
    """MUL_MAT / MUL_MAT_ID on AMX-layout weights and quantized activations (module docstring)
    as a split kernel (ggx-cpu's `split`): part p runs the tasks (tg, tn, tm: `tasks`)
    p * n // parts up to (p + 1) * n // parts; no prologue or epilogue."""
    if 0 <= part < parts:
        n = tg.shape[0]
        _run_tasks(isa, eng, fmt, w, wg, K, M, qs, yd, ys, s4, cstart, ycol, ocol, direct, cfg, out, tg, tn, tm,
                   part * n // parts, (part + 1) * n // parts)


__all__ = ["amx_mm", "tasks", "FormatType", "BLOCK"]
