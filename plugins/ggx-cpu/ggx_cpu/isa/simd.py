"""SIMD vectors in numba: LLVM vector types and the target-independent vector ops on them.

numba has no vector types, so this module gives it some: `Vec(kind, n)` is a numba type whose
LLVM representation is `<n x kind>` (a value held in a register, carried through loops like
any scalar). The ops below are plain LLVM IR (load, store, shuffle, and, shift, convert, fma,
reduce) that every target lowers; the instruction-set specific products (`vpdpbusd`,
`vpmaddubsw`) live in the ISA modules, and kernels reach them through `ggx_cpu.isa.dispatch`.

Conventions: loads and stores take an array and an *element* offset (bytes for (u)int8
arrays) and are unaligned unless said otherwise; nothing is bounds-checked (the kernel wrapper
proves its offsets first). A 32-value quantized block is one `i8x32` vector in value order;
4-bit weights arrive as 16 bytes and the nibble helpers expand them to [low nibbles | high
nibbles], which is ggml's value order for Q4_0/Q4_1/Q5_0 (value j < 16 is qs[j] & 15, value
16 + j is qs[j] >> 4; Q5_0's fifth bits come from its qh word, see `q5_at`). An `i32x8` lane i
of an 8-bit product holds the dot product of bytes 4i..4i+3.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic, models, register_model

from .codegen import I8, I32, I64, declare, elem_ptr, i32_vector, is_bytes_arg, load_vector, splat_const, vector_type


class Vec(types.Type):
    """A SIMD vector of `n` elements of kind i8/i16/i32/f32, held in registers (LLVM `<n x kind>`)."""

    def __init__(self, kind: str, n: int):
        self.kind = kind
        self.n = n
        super().__init__(name=f"Vec({kind}x{n})")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, vector_type(fe_type.kind, fe_type.n))


def llvm_type(v: Vec) -> ir.VectorType:
    """The LLVM type of a `Vec` (for intrinsics' codegen)."""
    return vector_type(v.kind, v.n)


I8x16 = Vec("i8", 16)
I8x32 = Vec("i8", 32)
I16x16 = Vec("i16", 16)
I32x8 = Vec("i32", 8)
F32x8 = Vec("f32", 8)
_BYTES = (types.int8, types.uint8)


# --- prefetch ---------------------------------------------------------------------------------------
@intrinsic
def prefetch(typingctx, arr, off):
    """Hint the cache to fetch the line holding byte `off` of a byte array (llvm.prefetch, read,
    keep in all levels). A hint never faults, so `off` may lie past the array's end."""
    if not is_bytes_arg(arr, off):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        i8p = I8.as_pointer()
        # integer address arithmetic, not a GEP: the hint may point past the array
        addr = builder.add(builder.ptrtoint(builder.bitcast(ary.data, i8p), I64),
                           context.cast(builder, args[1], sig.args[1], types.int64))
        fn = declare(builder, "llvm.prefetch.p0", ir.VoidType(), [i8p, I32, I32, I32])
        # rw = 0 (read), locality = 3 (keep in every level), cache type = 1 (data)
        builder.call(fn, [builder.inttoptr(addr, i8p), ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
        return context.get_dummy_value()

    return types.void(arr, off), codegen


@njit(cache=True, inline="always")
def prefetch_next_quad(w, wo, wrs, step_bytes, i):
    """Prefetch step i of the next row quad (4 rows from byte wo + 4 * wrs, read as one
    sequential stream of `step_bytes` a step) while a gemv works on the quad at wo.

    DRAM serves this one stream far better than the same bytes as four rows apart."""
    p = wo + 4 * wrs + i * step_bytes
    for k in range(0, step_bytes, 64):
        prefetch(w, p + k)


# --- loads and stores ---------------------------------------------------------------------------------
def _make_load(vec: Vec, dtypes, align: int = 1):
    @intrinsic
    def load(typingctx, arr, off):
        if not (isinstance(arr, types.Array) and arr.dtype in dtypes and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            return load_vector(context, builder, sig.args[0], args[0], args[1], llvm_type(vec), align)

        return vec(arr, types.intp), codegen

    return load


load_i8x16 = _make_load(I8x16, _BYTES)
load_i8x16.__doc__ = "16 bytes of a (u)int8 array starting at element `off` (unaligned)."
load_i8x32 = _make_load(I8x32, _BYTES)
load_i8x32.__doc__ = "32 bytes of a (u)int8 array starting at element `off` (unaligned)."
load_i16x16 = _make_load(I16x16, (types.int16,))
load_i16x16.__doc__ = "16 int16 of an int16 array starting at element `off` (unaligned), e.g. dot_u8s8_scaled scales."
load_i32x8 = _make_load(I32x8, (types.int32,))
load_i32x8.__doc__ = "8 int32 of an int32 array starting at element `off` (unaligned)."


def _make_store(vec: Vec, dtype):
    @intrinsic
    def store(typingctx, arr, off, v):
        if not (isinstance(arr, types.Array) and arr.dtype == dtype and isinstance(off, types.Integer) and v == vec):
            return None

        def codegen(context, builder, sig, args):
            ptr = elem_ptr(context, builder, sig.args[0], args[0], args[1])
            builder.store(args[2], builder.bitcast(ptr, llvm_type(vec).as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(arr, types.intp, vec), codegen

    return store


store_f32x8 = _make_store(F32x8, types.float32)
store_f32x8.__doc__ = "Store 8 float32 lanes at element `off` of a float32 array (4-byte aligned)."
store_i32x8 = _make_store(I32x8, types.int32)
store_i32x8.__doc__ = "Store 8 int32 lanes at element `off` of an int32 array (4-byte aligned)."


def make_shuffled_load(n_in: int, bits: int, pattern: list[int], out: str):
    """An intrinsic `(arr, off) -> vector`: `n_in` integers of `bits` bits at byte `off` of a
    (u)int8 array, lanes picked by `pattern` (lane i = integer pattern[i]), returned as
    out = "i8" (`I8x32`, 32 lanes of bytes), "u32" (`I32x8`, zero-extended) or "f16" (`F32x8`:
    the integers are IEEE halves, converted exactly; one vcvtph2ps where F16C exists). For
    layouts whose scales or activation bytes must be spread over the lanes of a product."""
    ret, lanes, widths = {"i8": (I8x32, 32, (8,)), "u32": (I32x8, 8, (8, 16)), "f16": (F32x8, 8, (16,))}[out]
    if len(pattern) != lanes or bits not in widths or not all(0 <= i < n_in for i in pattern):
        raise ValueError(f"make_shuffled_load: {lanes} lanes of {out} from {bits}-bit values, pattern {pattern}")

    @intrinsic
    def load(typingctx, arr, off):
        if not is_bytes_arg(arr, off):
            return None

        def codegen(context, builder, sig, args):
            v = load_vector(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(bits), n_in))
            v = builder.shuffle_vector(v, v, i32_vector(pattern))
            if out == "i8":
                return v
            if out == "u32":
                return builder.zext(v, llvm_type(I32x8))
            return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 8)), llvm_type(F32x8))

        return ret(arr, types.intp), codegen

    return load


# --- constants and splats -----------------------------------------------------------------------------
@intrinsic
def zero_f32x8(typingctx):
    """8 float32 zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(llvm_type(F32x8), None)

    return F32x8(), codegen


@intrinsic
def zero_i32x8(typingctx):
    """8 int32 zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(llvm_type(I32x8), None)

    return I32x8(), codegen


def _splat(builder, value, vec: Vec):
    v = builder.insert_element(ir.Constant(llvm_type(vec), ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(llvm_type(vec), ir.Undefined), i32_vector([0] * vec.n))


@intrinsic
def splat_f32x8(typingctx, x):
    """x (converted to float32) in all 8 lanes."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), F32x8)

    return F32x8(types.float32), codegen


@intrinsic
def splat_i32x8(typingctx, x):
    """x (converted to int32) in all 8 lanes."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.int32), I32x8)

    return I32x8(types.int32), codegen


@intrinsic
def splat_f16_at(typingctx, w, o):
    """The IEEE half at byte o of a byte array in all 8 float lanes: vpbroadcastw + vcvtph2ps, no
    scalar round trip (vpinsrw + vcvtph2ps + vbroadcastss)."""
    if not is_bytes_arg(w, o):
        return None

    def codegen(context, builder, sig, args):
        h = load_vector(context, builder, sig.args[0], args[0], args[1], ir.HalfType())
        hv = builder.insert_element(ir.Constant(ir.VectorType(ir.HalfType(), 8), ir.Undefined), h, ir.Constant(I32, 0))
        hv = builder.shuffle_vector(hv, hv, i32_vector([0] * 8))
        return builder.fpext(hv, llvm_type(F32x8))

    return F32x8(w, types.intp), codegen


# --- lane-wise arithmetic -------------------------------------------------------------------------------
def _make_lanewise(vec: Vec, op: str, scalar: type | None):
    """An intrinsic (a, b) -> vec: `builder.<op>` lane by lane; b a vector, or (when `scalar` is
    a numba type class) a scalar of that class used in every lane."""
    elem = types.int32 if vec.kind == "i32" else types.float32

    @intrinsic
    def f(typingctx, a, b):
        if a != vec or not (b == vec or (scalar is not None and isinstance(b, scalar))):
            return None

        def codegen(context, builder, sig, args):
            y = args[1]
            if sig.args[1] != vec:
                y = _splat(builder, context.cast(builder, y, sig.args[1], elem), vec)
            return getattr(builder, op)(args[0], y)

        return vec(vec, b if b == vec else elem), codegen

    return f


add_i32x8 = _make_lanewise(I32x8, "add", None)
add_i32x8.__doc__ = "a + b, int32 lane by lane (wrapping)."
sub_i32x8 = _make_lanewise(I32x8, "sub", None)
sub_i32x8.__doc__ = "a - b, int32 lane by lane (wrapping)."
mul_i32x8 = _make_lanewise(I32x8, "mul", types.Integer)
mul_i32x8.__doc__ = ("a * b, int32 lane by lane; b a vector or a scalar integer (every lane times it; "
                     "LLVM turns constant powers of two into shifts).")
add_f32x8 = _make_lanewise(F32x8, "fadd", None)
add_f32x8.__doc__ = "a + b, float32 lane by lane."
sub_f32x8 = _make_lanewise(F32x8, "fsub", None)
sub_f32x8.__doc__ = "a - b, float32 lane by lane."
mul_f32x8 = _make_lanewise(F32x8, "fmul", None)
mul_f32x8.__doc__ = "a * b, float32 lane by lane."


@intrinsic
def fma_f32x8(typingctx, acc, a, b):
    """acc + a * b, lane by lane, one rounding (llvm.fma)."""
    if acc != F32x8 or a != F32x8 or b != F32x8:
        return None

    def codegen(context, builder, sig, args):
        fma = declare(builder, "llvm.fma.v8f32", llvm_type(F32x8), [llvm_type(F32x8)] * 3)
        return builder.call(fma, [args[1], args[2], args[0]])

    return F32x8(F32x8, F32x8, F32x8), codegen


@intrinsic
def fma_i32x8_f32x8(typingctx, acc, v, scale):
    """acc + float(v) * scale: the per-block int32 lanes scaled into float accumulators."""
    if acc != F32x8 or v != I32x8 or scale != F32x8:
        return None

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[1], llvm_type(F32x8))
        fma = declare(builder, "llvm.fma.v8f32", llvm_type(F32x8), [llvm_type(F32x8)] * 3)
        return builder.call(fma, [f, args[2], args[0]])

    return F32x8(F32x8, I32x8, F32x8), codegen


@intrinsic
def i32x8_to_f32x8(typingctx, v):
    """The 8 int32 lanes converted to float32 (round to nearest)."""
    if v != I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], llvm_type(F32x8))

    return F32x8(I32x8), codegen


@intrinsic
def hsum_f32x8(typingctx, v):
    """The sum of the 8 lanes, pairwise: ([0..3] + [4..7]), then halves again (once per output)."""
    if v != F32x8:
        return None

    def codegen(context, builder, sig, args):
        x = args[0]
        for half in (4, 2, 1):
            x = builder.fadd(builder.shuffle_vector(x, x, i32_vector(range(half))),
                             builder.shuffle_vector(x, x, i32_vector(range(half, 2 * half))))
        return builder.extract_element(x, ir.Constant(I32, 0))

    return types.float32(F32x8), codegen


@intrinsic
def lane(typingctx, v, i):
    """Lane i of a vector, as a scalar (float32 for F32x8, int32 for I32x8, ...)."""
    if not (isinstance(v, Vec) and isinstance(i, types.Integer)):
        return None
    scalar = {"i8": types.int8, "i16": types.int16, "i32": types.int32, "f32": types.float32}[v.kind]

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], sig.args[1], types.intp))

    return scalar(v, i), codegen


@intrinsic
def xor80_i8x32(typingctx, v):
    """Flip the sign bit of every byte: a signed byte w becomes the unsigned byte w + 128 (and back)."""
    if v != I8x32:
        return None

    def codegen(context, builder, sig, args):
        return builder.xor(args[0], splat_const(I8, 32, 0x80))

    return I8x32(I8x32), codegen


# --- nibbles (4-bit weights) ----------------------------------------------------------------------------
@intrinsic
def nibbles_i8x32(typingctx, v):
    """16 bytes -> 32 values 0..15: [qs & 15 | qs >> 4] (ggml's Q4 value order)."""
    if v != I8x16:
        return None

    def codegen(context, builder, sig, args):
        lo = builder.and_(args[0], splat_const(I8, 16, 15))
        hi = builder.lshr(args[0], splat_const(I8, 16, 4))
        return builder.shuffle_vector(lo, hi, i32_vector(range(32)))

    return I8x32(I8x16), codegen


@intrinsic
def nibbles_at(typingctx, w, o):
    """The 16 bytes of nibbles at byte o of w as 32 values 0..15, [low nibbles | high nibbles]
    (the values of `nibbles_i8x32(load_i8x16(w, o))` in fewer operations).

    The 16 bytes are loaded into both halves (vbroadcasti128, a pure load), the high half
    shifted right by 4 as int32 lanes (vpsrlvd) and every byte masked to 0..15: two ALU
    operations where and + shift + insert take three (a gemv is bound by them).
    """
    if not is_bytes_arg(w, o):
        return None

    def codegen(context, builder, sig, args):
        v16 = load_vector(context, builder, sig.args[0], args[0], args[1], ir.VectorType(I8, 16))
        v32 = builder.shuffle_vector(v16, v16, i32_vector(list(range(16)) * 2))
        d = builder.lshr(builder.bitcast(v32, llvm_type(I32x8)), i32_vector([0] * 4 + [4] * 4))
        return builder.and_(builder.bitcast(d, llvm_type(I8x32)), splat_const(I8, 32, 15))

    return I8x32(w, types.intp), codegen


def _bits16(context, builder, arrty, arr, off):
    """Codegen: byte j of the result is 16 where bit j of the 4 little-endian bytes at `off` is set,
    else 0. Byte j // 8 is shuffled to byte j, masked with 1 << (j % 8) and compared with that mask
    (ggml's bytes_from_bits_32): no shift per bit."""
    qh = load_vector(context, builder, arrty, arr, off, ir.VectorType(I8, 4))
    spread = builder.shuffle_vector(qh, qh, i32_vector([j // 8 for j in range(32)]))
    bit = ir.Constant(llvm_type(I8x32), [ir.Constant(I8, 1 << (j % 8)) for j in range(32)])
    is_set = builder.icmp_unsigned("==", builder.and_(spread, bit), bit)
    return builder.select(is_set, splat_const(I8, 32, 16), ir.Constant(llvm_type(I8x32), None))


@intrinsic
def q5_at(typingctx, w, o):
    """The 32 five-bit values 0..31 of a Q5_0 block body at byte o of w: the 4 bytes at o are qh
    (little-endian; bit j is bit 4 of value j), the 16 bytes at o + 4 the nibbles, in ggml's
    value order as `nibbles_at` (value j < 16 in qs[j] & 15, value 16 + j in qs[j] >> 4)."""
    if not is_bytes_arg(w, o):
        return None

    def codegen(context, builder, sig, args):
        v16 = load_vector(context, builder, sig.args[0], args[0], builder.add(args[1], ir.Constant(args[1].type, 4)),
                          ir.VectorType(I8, 16))
        v32 = builder.shuffle_vector(v16, v16, i32_vector(list(range(16)) * 2))
        d = builder.lshr(builder.bitcast(v32, llvm_type(I32x8)), i32_vector([0] * 4 + [4] * 4))
        low = builder.and_(builder.bitcast(d, llvm_type(I8x32)), splat_const(I8, 32, 15))
        return builder.or_(low, _bits16(context, builder, sig.args[0], args[0], args[1]))

    return I8x32(w, types.intp), codegen


@intrinsic
def or_bits16_at(typingctx, v, w, o):
    """v | 16 on byte j where bit j of the 4 little-endian bytes at byte o of w is set: a fifth
    bit plane (Q5_0's qh, or a repacked layout's reordering of it) added to 32 nibble values."""
    if v != I8x32 or not is_bytes_arg(w, o):
        return None

    def codegen(context, builder, sig, args):
        return builder.or_(args[0], _bits16(context, builder, sig.args[1], args[1], args[2]))

    return I8x32(I8x32, w, types.intp), codegen


@intrinsic
def split_nibbles_i8x32(typingctx, v, mask):
    """(low, high) nibbles of the 32 bytes of v after xor with the byte `mask` (e.g. a layout's
    0x88): two I8x32 of values 0..15, byte i's low nibble in lane i of the first."""
    if v != I8x32 or not isinstance(mask, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        vt = llvm_type(I8x32)
        m = builder.trunc(args[1], I8) if args[1].type.width > 8 else args[1]
        x = builder.xor(args[0], builder.shuffle_vector(
            builder.insert_element(ir.Constant(vt, ir.Undefined), m, ir.Constant(I32, 0)),
            ir.Constant(vt, ir.Undefined), i32_vector([0] * 32)))
        return context.make_tuple(builder, sig.return_type,
                                  [builder.and_(x, splat_const(I8, 32, 15)), builder.lshr(x, splat_const(I8, 32, 4))])

    return types.UniTuple(I8x32, 2)(I8x32, mask), codegen


# --- scalars ------------------------------------------------------------------------------------------
@intrinsic
def at(typingctx, arr, i):
    """arr[i] without numba's negative-index wraparound (the caller guarantees 0 <= i < len)."""
    if not (isinstance(arr, types.Array) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(elem_ptr(context, builder, sig.args[0], args[0], args[1]))

    return arr.dtype(arr, types.intp), codegen


@intrinsic
def f16_at(typingctx, arr, off):
    """The IEEE half at byte `off` of a uint8 array, as float32, through LLVM's `fpext half`
    (one vcvtph2ps on F16C hosts; only used by the vector ISAs, which require F16C)."""
    if not is_bytes_arg(arr, off):
        return None

    def codegen(context, builder, sig, args):
        h = load_vector(context, builder, sig.args[0], args[0], args[1], ir.HalfType())
        return builder.fpext(h, ir.FloatType())

    return types.float32(arr, types.intp), codegen


@intrinsic
def f16_bits_to_f32(typingctx, h):
    """An IEEE half (given as its integer bits) as float32, exact for every finite value.

    (h & 0x7fff) << 13 puts exponent and mantissa where float32 keeps them; multiplying by
    2**112 rebases the exponent, which also handles zeros and subnormals. Plain integer and
    float IR: it vectorizes on every target, no F16C needed.
    """
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.uint32)
        mag = builder.shl(builder.and_(x, ir.Constant(I32, 0x7FFF)), ir.Constant(I32, 13))
        sign = builder.shl(builder.and_(x, ir.Constant(I32, 0x8000)), ir.Constant(I32, 16))
        f = builder.fmul(builder.bitcast(mag, ir.FloatType()), ir.Constant(ir.FloatType(), 2.0**112))
        return builder.bitcast(builder.or_(builder.bitcast(f, I32), sign), ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def bits_to_f32(typingctx, u):
    """Reinterpret a 32-bit integer as float32 (used for BF16: bits << 16)."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint32), ir.FloatType())

    return types.float32(types.uint32), codegen


# --- float vectors (the F32/F16/BF16 weight paths) ----------------------------------------------------
def _float_load(kind: str):
    @intrinsic
    def load(typingctx, arr, off):
        want = {"f32": types.float32, "f16": types.uint16, "bf16": types.int16}[kind]
        if not (isinstance(arr, types.Array) and arr.dtype == want and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            ptr = elem_ptr(context, builder, sig.args[0], args[0], args[1])
            f8 = llvm_type(F32x8)
            if kind == "f32":
                return builder.load(builder.bitcast(ptr, f8.as_pointer()), align=4)
            i32x8 = llvm_type(I32x8)
            h = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), 8).as_pointer()), align=2)
            x = builder.zext(h, i32x8)
            if kind == "bf16":
                return builder.bitcast(builder.shl(x, splat_const(I32, 8, 16)), f8)
            # IEEE half bits -> float32, exact for finite values (see f16_bits_to_f32)
            mag = builder.shl(builder.and_(x, splat_const(I32, 8, 0x7FFF)), splat_const(I32, 8, 13))
            sign = builder.shl(builder.and_(x, splat_const(I32, 8, 0x8000)), splat_const(I32, 8, 16))
            f = builder.fmul(builder.bitcast(mag, f8), splat_const(ir.FloatType(), 8, 2.0**112))
            return builder.bitcast(builder.or_(builder.bitcast(f, i32x8), sign), f8)

        return F32x8(arr, types.intp), codegen

    return load


load_f32x8 = _float_load("f32")
load_f32x8.__doc__ = "8 float32 from element `off` of a float32 array (4-byte aligned)."
load_f16x8 = _float_load("f16")
load_f16x8.__doc__ = "8 IEEE halves (a uint16 array of their bits) from element `off`, as float32."
load_bf16x8 = _float_load("bf16")
load_bf16x8.__doc__ = "8 bfloat16 (an int16 array of their bits) from element `off`, as float32."
