"""The gemm of the AVX-512 VNNI variant on repacked weights: register tiles of C columns.

`tile_mm` computes MUL_MAT / MUL_MAT_ID exactly as `kernels.repack_mm` does (same arguments,
same results up to float rounding), for the layouts with a `step` here (q4_0_8x8, q4_1_8x8,
q5_0_8x8, q8_0_4x4, q4_K_8x8) when the ISA variant is avx512_vnni; buffer.py picks it for
matmuls with more than one column per matrix (repack_mm keeps the one-column gemv and every
other variant).

Why it is fast: a *tile* is C activation columns (16, or 4 for what is left of a matrix's
columns) against one task of 8 weight rows; its C accumulators (16 float32 lanes each, one zmm
register) live in registers for the whole K loop. Per block of 32 values a group block's weights
are loaded and unpacked once and serve all C columns, each with four 512-bit vpdpbusd (8 rows x
32 values), one int -> float conversion and one fma: no accumulator ever goes to memory and no
lane is summed before the end. numba cannot keep an array of vectors in registers, so each
layout's block (`_step`) is LLVM IR generated here for a tuple of C accumulators.

Accumulator lanes (the interleave of layouts.py): 8x8 layouts: lanes 2r and 2r + 1 of a 64-byte
quant chunk hold row r's bytes 0-3 and 4-7, so a zmm dot leaves two partial sums per row, added at
the store. q8_0_4x4 (4 rows per group): a task is two groups (rows 0-3 and 4-7), one accumulator
each per column, row r % 4 on lanes r, r + 4, r + 8, r + 12.

Activation tiles (`_quant_tile` fills them from the F32 rows, in the weight's vec_dot_type with
ggml's rounding, as ggx-cpu's quantizers do): tile i's C columns are block-interleaved so one
offset walks the tile. With QB values per block (32; Q8_K 256) and j = yoff // QB + b * C + t for
block b of column t:
  ya int8 [yoff + (b * C + t) * QB ...]   the QB quantized values
  yd f32  [j]                            the block scale (f16-rounded for Q8_0 / Q8_1)
  yc i32  [j]                            the integer dot's start per lane: q4_0 -4 * sum(q),
                                         q5_0 -8 * sum(q), q8_0 -32 * sum(q) (the offsets -8,
                                         -16 and the +128 of xor-0x80 bytes, spread over the
                                         lanes of a row); q4_K: [4 j .. 4 j + 4) hold the eight
                                         32-value sums as int16 (for the mins)
  ys f32  [j]                            q4_1: Q8_1's s (f16 d * sum(q)) / 2 (two lanes a row)
A padding column (t >= the tile's valid columns) is all zeros and is never stored.

Tiles: int64 [n_tiles, 4] rows (first slot, valid columns, C, yoff); matrix g owns tiles
tstart[g]..tstart[g + 1] of its columns cstart[g]..cstart[g + 1] (slots, as repack_mm's
ycol / ocol).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from ggx_cpu.extension import Vec, declare, elem_ptr, token_constant

from .kernels import LayoutType, lay_rows
from .layouts import Q6_CHUNKS

#: the columns of a full tile per layout family (as many as keep every accumulator and the
#: block's unpacked weights in the 32 zmm registers: q8_0 holds two accumulators a column, q4_K a
#: sub-block pair's eight weight vectors), and of the tiles that take what is left
TILE_BIG = {"q4_0": 16, "q4_1": 16, "q5_0": 16, "q8_0": 8, "q4_K": 8, "q6_K": 8}
TILE_SMALL = 4
#: the layouts with a register-tile step
LAYOUTS = ("q4_0_8x8", "q4_1_8x8", "q5_0_8x8", "q8_0_4x4", "q4_K_8x8", "q6_K_8x8")
#: int32 entries of yc per activation block: q4_K's eight int16 sums (4), q6_K's sixteen
#: -16 * (16-value sum) (16), else the one start value
YC_WIDTH = {"q4_K": 4, "q6_K": 16}

F32x16 = Vec("f32", 16)
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
V16F, V16I, V64B = ir.VectorType(F32, 16), ir.VectorType(I32, 16), ir.VectorType(I8, 64)


def has_tiles(layout_name: str, isa: str, rows: int) -> bool:
    """Whether `tile_mm` computes a weight of `rows` rows (ne[1]) in this layout on this ISA
    variant (q8_0_4x4 takes its 4-row groups two at a time: rows must divide by 8)."""
    return isa == "avx512_vnni" and layout_name in LAYOUTS and rows % 8 == 0



def tile_columns(n: int, family: str) -> list[int]:
    """The tile widths (C) that cover n columns: full tiles, then TILE_SMALL ones (the last one
    padded), or a one-column tile for a single column left over (a gemv)."""
    big, rest = divmod(n, TILE_BIG[family])
    small, left = divmod(rest, TILE_SMALL)
    return [TILE_BIG[family]] * big + [TILE_SMALL] * small + ([1] if left == 1 else [TILE_SMALL] if left else [])


@token_constant
def _big(lay):
    """Columns of a full tile."""
    return TILE_BIG[lay.family]


@token_constant
def _qblock(lay):
    """Values per activation block: Q8_K's 256 for the K-quants, else 32."""
    return 256 if lay.family in ("q4_K", "q6_K") else 32


@token_constant
def _yc_width(lay):
    return YC_WIDTH.get(lay.family, 1)


@token_constant
def _unit(lay):
    """Layout groups per task (8 weight rows): two of q8_0_4x4's 4-row groups, else one."""
    return 2 if lay.family == "q8_0" else 1


@token_constant
def _corr(lay):
    """The per-lane start of the integer dot, per unit of the activation block's sum."""
    return {"q4_0": -4, "q5_0": -8, "q8_0": -32}.get(lay.family, 0)


# --- IR helpers -------------------------------------------------------------------------------------
class _IR:
    """An IR builder with the few things the steps need, over the intrinsic's numba arguments."""

    def __init__(self, context, builder, sig, args):
        self.c, self.b = context, builder
        self.ty = dict(zip(("w", "ya", "yd", "yc", "ys"), (sig.args[i] for i in (2, 5, 7, 8, 9))))
        self.arr = dict(zip(("w", "ya", "yd", "yc", "ys"), (args[i] for i in (2, 5, 7, 8, 9))))

    def i64(self, v: int) -> ir.Constant:
        return ir.Constant(I64, v)

    def add(self, off, k: int):
        return self.b.add(off, self.i64(k)) if k else off

    def load(self, name: str, off, llty: ir.Type):
        """A value of type llty at element `off` of argument `name` (unaligned)."""
        p = elem_ptr(self.c, self.b, self.ty[name], self.arr[name], off)
        return self.b.load(self.b.bitcast(p, llty.as_pointer()), align=1)

    def splat(self, x, n: int):
        return _splat(self.b, x, n)

    def shuffle(self, v, pattern):
        return _shuffle(self.b, v, pattern)

    def bytes_const(self, value: int):
        return ir.Constant(V64B, [ir.Constant(I8, value)] * 64)

    def call(self, name: str, ret: ir.Type, *args):
        return self.b.call(declare(self.b, name, ret, [a.type for a in args]), list(args))

    def dpbusd(self, acc, u, s):
        """acc + the 4-byte u8 x s8 dot products of u and s (vpdpbusd zmm)."""
        return self.call("llvm.x86.avx512.vpdpbusd.512", V16I, acc, self.b.bitcast(u, V16I), self.b.bitcast(s, V16I))

    def dpwssd(self, acc, a, b):
        """acc + the 2-int16 dot products of a and b (vpdpwssd zmm)."""
        return self.call("llvm.x86.avx512.vpdpwssd.512", V16I, acc, self.b.bitcast(a, V16I), self.b.bitcast(b, V16I))

    def fma(self, a, b, c):
        return self.call("llvm.fma.v16f32", V16F, a, b, c)

    def to_f32(self, v):
        return self.b.sitofp(v, V16F)

    def halves(self, off, n: int, pattern):
        """n IEEE halves at byte `off` of w, as float32 lanes picked by `pattern`."""
        h = self.load("w", off, ir.VectorType(ir.HalfType(), n))
        return self.b.fpext(self.shuffle(h, pattern), ir.VectorType(F32, len(pattern)))

    def bcast8(self, off):
        """The 8 activation bytes at `off` of ya in every qword (vpbroadcastq)."""
        return self.shuffle(self.load("ya", off, ir.VectorType(I8, 8)), list(range(8)) * 8)

    def scalar(self, name: str, j, n: int):
        """Element j of yd / yc / ys in all n lanes."""
        return self.splat(self.load(name, j, self.c.get_value_type(self.ty[name].dtype)), n)


def _idx(values) -> ir.Constant:
    values = list(values)
    return ir.Constant(ir.VectorType(I32, len(values)), [ir.Constant(I32, v) for v in values])


def _splat(b, x, n: int):
    """x in all n lanes."""
    v = b.insert_element(ir.Constant(ir.VectorType(x.type, n), ir.Undefined), x, ir.Constant(I32, 0))
    return _shuffle(b, v, [0] * n)


def _shuffle(b, v, pattern):
    """The lanes of v picked by `pattern` (as many lanes as the pattern)."""
    return b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _idx(pattern))


def _lanes(b, name: str, ret: ir.Type, v):
    """A one-vector LLVM intrinsic (llvm.<name>.<v's type suffix>): fabs, rint, reductions."""
    suffix = f"v{v.type.count}{'f32' if isinstance(v.type.element, ir.FloatType) else 'i' + str(v.type.element.width)}"
    return b.call(declare(b, f"llvm.{name}.{suffix}", ret, [v.type]), [v])


PAIRS = [i // 2 for i in range(16)]  # 8 row values -> lanes 2r, 2r + 1


# --- the steps: one block (super-block for Q4_K) of one task against the C columns of a tile -----
def _nibble_step(x: _IR, family: str, accs: list, o, yo, yi) -> list:
    """q4_0 / q4_1 / q5_0 8x8: group block = scales (+ mins / fifth-bit planes) + 128 quant bytes."""
    head = {"q4_0": 16, "q4_1": 32, "q5_0": 48}[family]
    b = x.b
    q0, q1 = x.load("w", x.add(o, head), V64B), x.load("w", x.add(o, head + 64), V64B)
    low, four = x.bytes_const(15), x.bytes_const(4)
    nib = [b.and_(q0, low), b.lshr(q0, four), b.and_(q1, low), b.lshr(q1, four)]  # values 0-7, 16-23, 8-15, 24-31
    if family == "q5_0":  # fifth bits: planes (layouts.q5_planes) of the two 32-byte halves of each chunk
        sixteen = x.bytes_const(16)
        for k, (p0, p1) in enumerate(((16, 24), (20, 28), (32, 40), (36, 44))):
            lo, hi = (b.zext(x.load("w", x.add(o, p), I32), I64) for p in (p0, p1))
            mask = b.bitcast(b.or_(lo, b.shl(hi, x.i64(32))), ir.VectorType(ir.IntType(1), 64))
            nib[k] = b.select(mask, b.or_(nib[k], sixteen), nib[k])
    dw = x.halves(o, 8, PAIRS)
    mw = x.halves(x.add(o, 16), 8, PAIRS) if family == "q4_1" else None
    yoffs = (0, 16, 8, 24)  # the activation bytes of each nibble vector's values
    out = []
    for t, acc in enumerate(accs):
        y = x.add(yo, 32 * t)
        j = x.add(yi, t)
        dot = x.scalar("yc", j, 16) if family != "q4_1" else ir.Constant(V16I, None)
        for v, k in zip(nib, yoffs):
            dot = x.dpbusd(dot, v, x.bcast8(x.add(y, k)))
        acc = x.fma(x.to_f32(dot), b.fmul(dw, x.scalar("yd", j, 16)), acc)
        if mw is not None:  # + m * s, half on each lane of the row
            acc = x.fma(mw, x.scalar("ys", j, 16), acc)
        out.append(acc)
    return out


def _q8_0_step(x: _IR, accs: list, o, o2, yo, yi) -> list:
    """q8_0_4x4, two groups (at o and o2): scales d[4] + 128 bytes (xor 0x80) each."""
    b = x.b
    C = len(accs) // 2
    quads = [0, 1, 2, 3] * 4
    groups = []
    for g in (o, o2):
        groups.append(([x.load("w", x.add(g, 8 + 64 * h), V64B) for h in (0, 1)], x.halves(g, 4, quads)))
    spread = [i // 4 for i in range(16)]  # dword k of 16 activation bytes on lanes 4k..4k+3
    out = [None] * (2 * C)
    for t in range(C):
        y = x.add(yo, 32 * t)
        j = x.add(yi, t)
        ys = [b.bitcast(x.shuffle(x.load("ya", x.add(y, 16 * h), ir.VectorType(I32, 4)), spread), V64B) for h in (0, 1)]
        init = x.scalar("yc", j, 16)
        dy = x.scalar("yd", j, 16)
        for gi, (quants, d) in enumerate(groups):
            dot = x.dpbusd(x.dpbusd(init, quants[0], ys[0]), quants[1], ys[1])
            k = gi * C + t
            out[k] = x.fma(x.to_f32(dot), b.fmul(d, dy), accs[k])
    return out


def _q4_K_step(x: _IR, accs: list, o, yo, yi) -> list:
    """q4_K_8x8 super-block: d[8], dmin[8] f16, sc[8][8], mn[8][8] u8 (sub-block, row), then 16
    quant chunks of 64 bytes: chunk 4p + j holds sub-blocks 2p (low nibbles) and 2p + 1 (high),
    values 8j..8j+7 of rows 0-7. Per sub-block the float accumulators add its dot times
    d * sc[s] * dy; the mins add -dmin * dy * sum_s mn[s] * bsum[s] once (vpdpwssd on int16)."""
    b = x.b
    dw = x.halves(o, 8, list(range(8)))
    v8f = ir.VectorType(F32, 8)
    mins = x.load("w", x.add(o, 96), V64B)
    # int16 pairs per lane: lane 2r = (mn[0|4][r], mn[1|5][r]), lane 2r + 1 = (mn[2|6][r], mn[3|7][r])
    mpairs = []
    for base in (0, 4):
        pattern = [8 * (base + 2 * (lane % 2) + e) + lane // 2 for lane in range(16) for e in (0, 1)]
        mpairs.append(b.zext(x.shuffle(mins, pattern), ir.VectorType(I16, 32)))
    negdmin = b.fneg(x.halves(x.add(o, 16), 8, PAIRS))
    low, four = x.bytes_const(15), x.bytes_const(4)
    out = list(accs)
    for p in range(4):
        chunks = [x.load("w", x.add(o, 160 + 64 * (4 * p + k)), V64B) for k in range(4)]
        nib_lo = [b.and_(c, low) for c in chunks]
        nib_hi = [b.lshr(c, four) for c in chunks]
        scales = []
        for s in (2 * p, 2 * p + 1):
            sc = b.uitofp(x.load("w", x.add(o, 32 + 8 * s), ir.VectorType(I8, 8)), v8f)
            scales.append(x.shuffle(b.fmul(sc, dw), PAIRS))
        for t in range(len(out)):
            y = x.add(yo, 256 * t + 64 * p)
            dy = x.scalar("yd", x.add(yi, t), 16)
            for half, nibs in enumerate((nib_lo, nib_hi)):
                dot = ir.Constant(V16I, None)
                for k in range(4):
                    dot = x.dpbusd(dot, nibs[k], x.bcast8(x.add(y, 32 * half + 8 * k)))
                out[t] = x.fma(x.to_f32(dot), b.fmul(scales[half], dy), out[t])
    for t in range(len(out)):
        j = x.add(yi, t)
        sums = [x.shuffle(x.load("yc", x.add(b.mul(j, x.i64(4)), 2 * h), ir.VectorType(I32, 2)), [0, 1] * 8)
                for h in (0, 1)]
        msum = x.dpwssd(x.dpwssd(ir.Constant(V16I, None), mpairs[0], sums[0]), mpairs[1], sums[1])
        out[t] = x.fma(x.to_f32(msum), b.fmul(negdmin, x.scalar("yd", j, 16)), out[t])
    return out


def _q6_K_step(x: _IR, accs: list, o, yo, yi) -> list:
    """q6_K_8x8 super-block: d[8] f16, sc[16][8] i8 (sub-block of 16, row), 16 ql chunks, 8 qh
    chunks (layouts.py). A pass (half n, q) builds four vectors of 6-bit values 0..63: values
    16q..16q+15 (sub-block 8n + q) and 64 + 16q.. (8n + 4 + q) of half n; their dots start at
    -16 * (the 16 activations' sum) per lane (the -32 offset) and add d * sc * dot in float, the
    super-block's sum times the activation scale at the end."""
    b = x.b
    at = {c: 144 + 64 * i for i, c in enumerate(Q6_CHUNKS)}  # chunk -> its byte offset in the block
    dw = x.halves(o, 8, list(range(8)))
    v8f = ir.VectorType(F32, 8)
    low, sixty4 = x.bytes_const(15), x.bytes_const(0x30)

    def high_bits(qh, field: int):
        """Bits 2 field .. 2 field + 1 of each qh byte, moved to bits 4-5."""
        shift = 4 - 2 * field
        moved = b.shl(qh, x.bytes_const(shift)) if shift > 0 else b.lshr(qh, x.bytes_const(-shift)) if shift else qh
        return b.and_(moved, sixty4)

    sums = [ir.Constant(V16F, None)] * len(accs)
    for n in (0, 1):
        for q in range(4):
            ql = [x.load("w", x.add(o, at[8 * n + 2 * q + k]), V64B) for k in (0, 1)]
            qh = [x.load("w", x.add(o, at[16 + 4 * n + (2 * q + k) % 4]), V64B) for k in (0, 1)]
            lo = [b.or_(b.and_(ql[k], low), high_bits(qh[k], q // 2)) for k in (0, 1)]
            hi = [b.or_(b.lshr(ql[k], x.bytes_const(4)), high_bits(qh[k], 2 + q // 2)) for k in (0, 1)]
            scales = []
            for sb in (8 * n + q, 8 * n + 4 + q):
                sc = b.sitofp(x.load("w", x.add(o, 16 + 8 * sb), ir.VectorType(I8, 8)), v8f)
                scales.append((sb, x.shuffle(b.fmul(sc, dw), PAIRS)))
            for t in range(len(sums)):
                y = x.add(yo, 256 * t + 128 * n + 16 * q)
                j16 = b.mul(x.add(yi, t), x.i64(16))
                for (sb, scale), vecs, yoff in zip(scales, (lo, hi), (0, 64)):
                    dot = x.dpbusd(x.scalar("yc", x.add(j16, sb), 16), vecs[0], x.bcast8(x.add(y, yoff)))
                    dot = x.dpbusd(dot, vecs[1], x.bcast8(x.add(y, yoff + 8)))
                    sums[t] = x.fma(x.to_f32(dot), scale, sums[t])
    return [x.fma(sums[t], x.scalar("yd", x.add(yi, t), 16), acc) for t, acc in enumerate(accs)]


@intrinsic
def _step(typingctx, lay, accs, w, o, o2, ya, yo, yd, yc, ys, yi):
    """accs + one block of the task at byte o of w (q8_0: and its second group at o2) against
    the tile's columns, whose block starts at byte yo of ya and element yi of yd / yc / ys."""
    if not (isinstance(lay, LayoutType) and isinstance(accs, types.UniTuple) and accs.dtype == F32x16):
        return None
    sig = accs(lay, accs, w, types.intp, types.intp, ya, types.intp, yd, yc, ys, types.intp)
    family = lay.family

    def codegen(context, builder, sig, args):
        x = _IR(context, builder, sig, args)
        acc_in = [builder.extract_value(args[1], i) for i in range(sig.args[1].count)]
        o, o2, yo, yi = args[3], args[4], args[6], args[10]
        if family == "q8_0":
            acc_out = _q8_0_step(x, acc_in, o, o2, yo, yi)
        elif family == "q4_K":
            acc_out = _q4_K_step(x, acc_in, o, yo, yi)
        elif family == "q6_K":
            acc_out = _q6_K_step(x, acc_in, o, yo, yi)
        else:
            acc_out = _nibble_step(x, family, acc_in, o, yo, yi)
        tup = ir.Constant(context.get_value_type(sig.return_type), ir.Undefined)
        for i, a in enumerate(acc_out):
            tup = builder.insert_value(tup, a, i)
        return tup

    return sig, codegen


@intrinsic
def _store(typingctx, lay, accs, out, ocol, s0, n, M, row0):
    """out[ocol[s0 + t] * M + row0 + r] = row r of column t's accumulators (t < n, r < 8)."""
    if not (isinstance(lay, LayoutType) and isinstance(accs, types.UniTuple)):
        return None
    sig = types.void(lay, accs, out, ocol, types.intp, types.intp, types.intp, types.intp)
    family = lay.family

    def codegen(context, builder, sig, args):
        accs, out, ocol, s0, n, M, row0 = args[1:]
        C = sig.args[1].count // (2 if family == "q8_0" else 1)
        v8f = ir.VectorType(F32, 8)
        for t in range(C):
            if family == "q8_0":  # two groups, row r % 4 on lanes r, r + 4, r + 8, r + 12
                rows = []
                for a in (builder.extract_value(accs, t), builder.extract_value(accs, C + t)):
                    h = builder.fadd(_shuffle(builder, a, range(8)), _shuffle(builder, a, range(8, 16)))
                    rows.append(builder.fadd(_shuffle(builder, h, range(4)), _shuffle(builder, h, range(4, 8))))
                vals = builder.shuffle_vector(rows[0], rows[1], _idx(range(8)))
            else:  # row r on lanes 2r, 2r + 1
                a = builder.extract_value(accs, t)
                vals = builder.fadd(_shuffle(builder, a, range(0, 16, 2)), _shuffle(builder, a, range(1, 16, 2)))
            valid = builder.icmp_signed("<", ir.Constant(I64, t), n)
            with builder.if_then(valid):
                col = builder.load(elem_ptr(context, builder, sig.args[3], ocol, builder.add(s0, ir.Constant(I64, t))))
                p = elem_ptr(context, builder, sig.args[2], out, builder.add(builder.mul(col, M), row0))
                builder.store(vals, builder.bitcast(p, v8f.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


# --- activation tiles ---------------------------------------------------------------------------------
def _vec(n: int, t: ir.Type = F32) -> ir.VectorType:
    return ir.VectorType(t, n)


@intrinsic
def _quant_q8(typingctx, x, xo, q, qo):
    """Q8_0 / Q8_1 of the 32 floats at element xo of x into the int8 at qo of q, as ggml's x86
    quantize_row_q8_0/1: q = round-half-even(x * 127 / amax). Returns (d, s, sum(q)): d = amax / 127
    and s = d * sum(q), both rounded through f16."""
    sig = types.Tuple((types.float32, types.float32, types.int32))(x, types.intp, q, types.intp)

    def codegen(context, builder, sig, args):
        b = builder
        xv = b.load(b.bitcast(elem_ptr(context, b, sig.args[0], args[0], args[1]), _vec(32).as_pointer()), align=4)
        amax = _lanes(b, "vector.reduce.fmax", F32, _lanes(b, "fabs", _vec(32), xv))
        zero = ir.Constant(F32, 0.0)
        inv = b.select(b.fcmp_ordered("!=", amax, zero), b.fdiv(ir.Constant(F32, 127.0), amax), zero)
        qi = b.fptosi(_lanes(b, "rint", _vec(32), b.fmul(xv, _splat(b, inv, 32))), _vec(32, I32))
        qp = elem_ptr(context, b, sig.args[2], args[2], args[3])
        b.store(b.trunc(qi, _vec(32, I8)), b.bitcast(qp, _vec(32, I8).as_pointer()), align=1)
        total = _lanes(b, "vector.reduce.add", I32, qi)
        d = b.fdiv(amax, ir.Constant(F32, 127.0))
        half = ir.HalfType()
        d16 = b.fpext(b.fptrunc(d, half), F32)
        s16 = b.fpext(b.fptrunc(b.fmul(d, b.sitofp(total, F32)), half), F32)
        return context.make_tuple(b, sig.return_type, [d16, s16, total])

    return sig, codegen


@intrinsic
def _quant_q8_K(typingctx, x, xo, q, qo, sums, so, group):
    """Q8_K (ggml's quantize_row_q8_K_ref) of the 256 floats at element xo of x into the int8 at qo
    of q: the value of largest |x| (the first) maps to -127, q = min(127, rint(x * -127 / max)).
    At element so of sums (int32): group 32, the eight 32-value sums of q as int16 pairs (4 int32,
    q4_K's mins); group 16, -16 times each of the sixteen 16-value sums (q6_K's offset).
    Returns d = 1 / iscale (0 for an all-zero block)."""
    if not isinstance(group, types.IntegerLiteral) or group.literal_value not in (16, 32):
        return None
    per = group.literal_value
    sig = types.float32(x, types.intp, q, types.intp, sums, types.intp, group)

    def codegen(context, builder, sig, args):
        b = builder
        n = 256
        xv = b.load(b.bitcast(elem_ptr(context, b, sig.args[0], args[0], args[1]), _vec(n).as_pointer()), align=4)
        fabs = _lanes(b, "fabs", _vec(n), xv)
        amax = _lanes(b, "vector.reduce.fmax", F32, fabs)
        bits = b.bitcast(b.fcmp_ordered("==", fabs, _splat(b, amax, n)), ir.IntType(n))
        first = b.call(declare(b, f"llvm.cttz.i{n}", ir.IntType(n), [ir.IntType(n), ir.IntType(1)]),
                       [bits, ir.Constant(ir.IntType(1), 0)])
        vmax = b.extract_element(xv, b.trunc(first, I32))
        nonzero = b.fcmp_ordered("!=", amax, ir.Constant(F32, 0.0))
        iscale = b.select(nonzero, b.fdiv(ir.Constant(F32, -127.0), vmax), ir.Constant(F32, 0.0))
        qi = b.fptosi(_lanes(b, "rint", _vec(n), b.fmul(xv, _splat(b, iscale, n))), _vec(n, I32))
        top = _splat(b, ir.Constant(I32, 127), n)
        qi = b.select(b.icmp_signed(">", qi, top), top, qi)
        qp = elem_ptr(context, b, sig.args[2], args[2], args[3])
        b.store(b.trunc(qi, _vec(n, I8)), b.bitcast(qp, _vec(n, I8).as_pointer()), align=1)
        et = I16 if per == 32 else I32
        sums = ir.Constant(_vec(n // per, et), ir.Undefined)
        for k in range(n // per):
            part = _lanes(b, "vector.reduce.add", I32, _shuffle(b, qi, range(per * k, per * k + per)))
            part = b.trunc(part, I16) if per == 32 else b.mul(part, ir.Constant(I32, -16))
            sums = b.insert_element(sums, part, ir.Constant(I32, k))
        sp = elem_ptr(context, b, sig.args[4], args[4], args[5])
        b.store(sums, b.bitcast(sp, sums.type.as_pointer()), align=4)
        return b.select(nonzero, b.fdiv(ir.Constant(F32, 1.0), iscale), ir.Constant(F32, 0.0))

    return sig, codegen


def _quant_block(lay, x, xo, ya, qo, yd, yc, ys, j):
    """Block j of a tile from the floats at xo of x (see the module docstring)."""


@overload(_quant_block, inline="always")
def _ol_quant_block(lay, x, xo, ya, qo, yd, yc, ys, j):
    if lay.family == "q4_K":
        def q8k_sums32(lay, x, xo, ya, qo, yd, yc, ys, j):
            yd[j] = _quant_q8_K(x, xo, ya, qo, yc, 4 * j, 32)
        return q8k_sums32
    if lay.family == "q6_K":
        def q8k_sums16(lay, x, xo, ya, qo, yd, yc, ys, j):
            yd[j] = _quant_q8_K(x, xo, ya, qo, yc, 16 * j, 16)
        return q8k_sums16
    corr = _corr.value_of(lay)
    q4_1 = lay.family == "q4_1"

    def q8(lay, x, xo, ya, qo, yd, yc, ys, j):
        d, s, total = _quant_q8(x, xo, ya, qo)
        yd[j] = d
        yc[j] = corr * total
        if q4_1:
            ys[j] = s * np.float32(0.5)
    return q8


@njit(cache=True)
def quant_tiles(lay, x, ycol, tiles, nbk, ya, yd, yc, ys):
    """Fill the activation tiles `tiles` (rows of a `tile_plan`) from the F32 rows x [n, K]."""
    for i in range(tiles.shape[0]):
        _quant_tile(lay, x, ycol, tiles[i], nbk, ya, yd, yc, ys)


@njit(cache=True, inline="always")
def _quant_tile(lay, x, ycol, tile, nbk, ya, yd, yc, ys):
    s0, n, C, yoff = tile[0], tile[1], tile[2], tile[3]
    QB = _qblock(lay)
    K = x.shape[1]
    xf = x.reshape(-1)
    j0 = yoff // QB
    for t in range(C):
        if t < n:
            xo = ycol[s0 + t] * K
            for b in range(nbk):
                j = j0 + b * C + t
                _quant_block(lay, xf, xo + b * QB, ya, yoff + j * QB - j0 * QB, yd, yc, ys, j)
        else:
            for b in range(nbk):
                j = j0 + b * C + t
                ya[yoff + (j - j0) * QB: yoff + (j - j0 + 1) * QB] = 0
                yd[j] = 0.0
                ys[j] = 0.0
                yc[_yc_width(lay) * j: _yc_width(lay) * (j + 1)] = 0


@intrinsic
def _zeros(typingctx, lay, cols):
    """Zero accumulators of a tile of `cols` columns (a literal; -1: a full tile): a tuple of
    C x (groups per task)."""
    if not (isinstance(lay, LayoutType) and isinstance(cols, types.IntegerLiteral)):
        return None
    c = TILE_BIG[lay.family] if cols.literal_value < 0 else cols.literal_value
    t = types.UniTuple(F32x16, c * (2 if lay.family == "q8_0" else 1))

    def codegen(context, builder, sig, args):
        return ir.Constant(context.get_value_type(t), [ir.Constant(V16F, None)] * t.count)

    return t(lay, cols), codegen


# --- the kernel -----------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _tile_task(lay, zeros, w, base, span, gbytes, nbk, ya, yd, yc, ys, tile, out, ocol, M, row0):
    """One task (8 weight rows from byte base) against one tile, C = the size of `zeros`."""
    QB = _qblock(lay)
    C = tile[2]
    yoff = tile[3]
    j0 = yoff // QB
    accs = zeros
    for b in range(nbk):
        o = base + b * gbytes
        accs = _step(lay, accs, w, o, o + span, ya, yoff + b * C * QB, yd, yc, ys, j0 + b * C)
    _store(lay, accs, out, ocol, tile[0], tile[1], M, row0)


@njit(cache=True)
def tile_scratch(lay, n_ya, n_sc):
    """The quantized activation tiles' arrays: ya (n_ya bytes), yd, yc, ys (n_sc scalars)."""
    return (np.empty(n_ya, np.int8), np.empty(n_sc, np.float32), np.empty(n_sc * _yc_width(lay), np.int32),
            np.empty(n_sc, np.float32))


@njit(cache=True)
def tile_mm(part, parts, lay, w, wg, gbytes, nbk, K, M, x, tiles, tstart, ycol, ocol, out, ya, yd, yc, ys, quantize):
    """MUL_MAT / MUL_MAT_ID on repacked weights (see the module docstring; `kernels.repack_mm`'s
    w, wg, gbytes, nbk, K, M, x, ycol, ocol, out) as a split kernel (ggx-cpu's `split`): part -1
    quantizes the activations into the tiles' scratch (`tile_scratch`: ya, yd, yc, ys, laid out
    by `tile_plan`) when `quantize` (else `tile_quant` ran before), parts 0..parts-1 run
    `_tile_chunk` over contiguous chunks of the (matrix, task) pairs."""
    if part < 0:
        if quantize:
            quant_tiles(lay, x, ycol, tiles, nbk, ya, yd, yc, ys)
    elif part < parts:
        _tile_chunk(part, parts, lay, w, wg, gbytes, nbk, M, tiles, tstart, ocol, out, ya, yd, yc, ys)


@njit(cache=True)
def tile_quant(part, parts, lay, x, ycol, tiles, nbk, ya, yd, yc, ys):
    """The activation tiles quantized into `tile_mm`'s scratch, as a split kernel: part p takes
    tiles p * n // parts up to (p + 1) * n // parts (a batch's)."""
    if 0 <= part < parts:
        n = tiles.shape[0]
        quant_tiles(lay, x, ycol, tiles[part * n // parts: (part + 1) * n // parts], nbk, ya, yd, yc, ys)


@njit(cache=True)
def _tile_chunk(ch, nch, lay, w, wg, gbytes, nbk, M, tiles, tstart, ocol, out, ya, yd, yc, ys):
    """Chunk ch of nch of the (matrix, task) pairs, each task running every tile of its matrix."""
    unit = _unit(lay)
    rows = lay_rows(lay) * unit  # weight rows per task: 8
    n_units = M // rows
    n_tasks = wg.shape[0] * n_units
    span = nbk * gbytes  # bytes of one layout group's rows
    z_big = _zeros(lay, -1)
    z_small = _zeros(lay, TILE_SMALL)
    z_one = _zeros(lay, 1)
    for task in range(ch * n_tasks // nch, (ch + 1) * n_tasks // nch):
        g = task // n_units
        u = task % n_units
        base = wg[g] + u * unit * span
        for i in range(tstart[g], tstart[g + 1]):
            C = tiles[i, 2]
            if C == _big(lay):
                _tile_task(lay, z_big, w, base, span, gbytes, nbk, ya, yd, yc, ys, tiles[i], out, ocol, M, u * rows)
            elif C == TILE_SMALL:
                _tile_task(lay, z_small, w, base, span, gbytes, nbk, ya, yd, yc, ys, tiles[i], out, ocol, M, u * rows)
            else:
                _tile_task(lay, z_one, w, base, span, gbytes, nbk, ya, yd, yc, ys, tiles[i], out, ocol, M, u * rows)


def tile_plan(cstart: np.ndarray, lay_name: str, K: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(tiles, tstart, ya bytes, scalar count) for matrices owning columns cstart[g]..cstart[g+1]."""
    qb = 256 if lay_name[:4] in YC_WIDTH else 32
    nbk = K // qb
    rows, tstart, off = [], [0], 0
    for g in range(len(cstart) - 1):
        s = int(cstart[g])
        left = int(cstart[g + 1]) - s
        for c in tile_columns(left, lay_name[:4]):
            rows.append((s, min(c, left), c, off))
            s += c
            left -= min(c, left)
            off += nbk * c * qb
        tstart.append(len(rows))
    tiles = np.array(rows, np.int64).reshape(-1, 4)
    return tiles, np.array(tstart, np.int64), off, off // qb


__all__ = ["tile_mm", "tile_quant", "tile_scratch", "tile_plan", "quant_tiles", "has_tiles", "tile_columns",
           "LAYOUTS", "TILE_BIG", "TILE_SMALL"]
