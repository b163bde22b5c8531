"""SIMD vectors in numba: LLVM vector types, target-independent vector ops, the ISA token.

numba has no vector types, so this module gives it some: `Vec(kind, n)` is a numba type whose
LLVM representation is `<n x kind>` (a value held in a register, carried through loops like
any scalar). The ops below are plain LLVM IR (load, and, shift, convert, fma, reduce) that
every target lowers; the instruction-set specific products (`vpdpbusd`, `vpmaddubsw`) live in
the ISA modules, which declare them by full LLVM name.

`IsaToken` is the compile-time switch: the quantized kernels take an `isa` argument whose
numba *type* names the instruction set, so one kernel source compiles (and caches, the
signature being part of the cache key) once per instruction set, and code for an instruction
set is only ever generated when that set is selected — compiling VNNI intrinsics for a CPU
without VNNI would abort the process.

Byte layout used by the loads: a 32-value quantized block is one `i8x32` vector in value order;
4-bit weights arrive as 16 bytes and `nibbles_i8x32` expands them to [low nibbles | high
nibbles], which is ggml's value order for Q4_0/Q4_1 (value j < 16 is qs[j] & 15, value 16 + j
is qs[j] >> 4). An `i32x8` lane i holds the dot product of the bytes 4i..4i+3.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import NativeValue, intrinsic, models, register_model, typeof_impl, unbox

_ELEM = {"i8": ir.IntType(8), "i16": ir.IntType(16), "i32": ir.IntType(32), "f32": ir.FloatType()}


class Vec(types.Type):
    """A SIMD vector of `n` elements of kind i8/i16/i32/f32, held in registers."""

    def __init__(self, kind: str, n: int):
        self.kind = kind
        self.n = n
        super().__init__(name=f"Vec({kind}x{n})")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(_ELEM[fe_type.kind], fe_type.n))


I8x16 = Vec("i8", 16)
I8x32 = Vec("i8", 32)
I16x16 = Vec("i16", 16)
I32x8 = Vec("i32", 8)
F32x8 = Vec("f32", 8)


def _llty(v: Vec) -> ir.VectorType:
    return ir.VectorType(_ELEM[v.kind], v.n)


# --- tokens: compile-time choices passed as arguments ------------------------------------------
class Token:
    """A Python object naming a compile-time choice; numba types it as `type_class(name)`, so a
    kernel taking it compiles (and caches) one specialization per name, and `@overload`s pick
    implementations by the type: the instruction set (`IsaToken`), a weight type (`KindToken`)."""

    type_class: type = None  # set below for each token class

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class IsaType(types.Type):
    def __init__(self, isa_name: str):
        self.isa_name = isa_name
        super().__init__(name=f"Isa({isa_name})")


class KindType(types.Type):
    def __init__(self, kind_name: str):
        self.kind_name = kind_name
        super().__init__(name=f"Kind({kind_name})")


class IsaToken(Token):
    type_class = IsaType


class KindToken(Token):
    type_class = KindType


@typeof_impl.register(Token)
def _typeof_token(val, c):
    # memoized on the token: building a numba type costs ~2 us
    t = val.__dict__.get("_nb_type")
    if t is None:
        t = val._nb_type = val.type_class(val.name)
    return t


for _tt in (IsaType, KindType):
    register_model(_tt)(models.OpaqueModel)

    @unbox(_tt)
    def _unbox_token(typ, obj, c):
        return NativeValue(c.context.get_dummy_value())


# --- loads ------------------------------------------------------------------------------------
@intrinsic
def prefetch(typingctx, arr, off):
    """Hint the cache to fetch the line holding byte `off` of a byte array (llvm.prefetch, read,
    keep in all levels). A hint never faults, so `off` may lie past the array's end."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.int8, types.uint8) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        # integer address arithmetic, not a GEP: the hint may point past the array
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        addr = builder.add(builder.ptrtoint(ptr, ir.IntType(64)),
                           context.cast(builder, args[1], sig.args[1], types.int64))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        # rw = 0 (read), locality = 3 (keep in every level), cache type = 1 (data)
        builder.call(fn, [builder.inttoptr(addr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, off), codegen


@njit(cache=True, inline="always")
def prefetch_next_quad(w, wo, wrs, step_bytes, i):
    """Prefetch step i of the next row quad (4 rows from byte wo + 4 * wrs, read as one
    sequential stream of `step_bytes` a step) while a gemv works on the quad at wo.

    DRAM serves this one stream far better than the same bytes as four rows apart: a Q4_0
    row quad went from 14.8 to 21.8 GB/s on one core (30.7 on two)."""
    p = wo + 4 * wrs + i * step_bytes
    for k in range(0, step_bytes, 64):
        prefetch(w, p + k)


def _elem_ptr(context, builder, arrty, arr, off):
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.gep(ary.data, [off])


def _make_load(vec: Vec, dtypes):
    @intrinsic
    def load(typingctx, arr, off):
        if not (isinstance(arr, types.Array) and arr.dtype in dtypes and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
            vptr = builder.bitcast(ptr, _llty(vec).as_pointer())
            return builder.load(vptr, align=1)

        return vec(arr, types.intp), codegen

    return load


_BYTES = (types.int8, types.uint8)
load_i8x16 = _make_load(I8x16, _BYTES)
load_i8x16.__doc__ = "16 bytes of a (u)int8 array starting at element `off` (unaligned)."
load_i8x32 = _make_load(I8x32, _BYTES)
load_i8x32.__doc__ = "32 bytes of a (u)int8 array starting at element `off` (unaligned)."
load_i32x8 = _make_load(I32x8, (types.int32,))
load_i32x8.__doc__ = "8 int32 of an int32 array starting at element `off` (unaligned)."


# --- constructors and lane ops ------------------------------------------------------------------
@intrinsic
def zero_f32x8(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_llty(F32x8), None)

    return F32x8(), codegen


@intrinsic
def zero_i32x8(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_llty(I32x8), None)

    return I32x8(), codegen


@intrinsic
def splat_f32x8(typingctx, x):
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        vec = ir.Constant(_llty(F32x8), ir.Undefined)
        vec = builder.insert_element(vec, v, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(ir.IntType(32), 8), None))

    return F32x8(types.float32), codegen


@intrinsic
def nibbles_i8x32(typingctx, v):
    """16 bytes -> 32 values 0..15: [qs & 15 | qs >> 4] (ggml's Q4 value order)."""
    if v != I8x16:
        return None

    def codegen(context, builder, sig, args):
        i8 = ir.IntType(8)
        lo = builder.and_(args[0], ir.Constant(_llty(I8x16), [ir.Constant(i8, 15)] * 16))
        hi = builder.lshr(args[0], ir.Constant(_llty(I8x16), [ir.Constant(i8, 4)] * 16))
        mask = ir.Constant(ir.VectorType(ir.IntType(32), 32), [ir.Constant(ir.IntType(32), i) for i in range(32)])
        return builder.shuffle_vector(lo, hi, mask)

    return I8x32(I8x16), codegen


@intrinsic
def xor80_i8x32(typingctx, v):
    """Flip the sign bit of every byte: a signed byte w becomes the unsigned byte w + 128."""
    if v != I8x32:
        return None

    def codegen(context, builder, sig, args):
        c = ir.Constant(_llty(I8x32), [ir.Constant(ir.IntType(8), 0x80)] * 32)
        return builder.xor(args[0], c)

    return I8x32(I8x32), codegen


@intrinsic
def mul_i32x8(typingctx, v, k):
    """Every lane times the scalar k (LLVM turns constant powers of two into shifts)."""
    if v != I32x8 or not isinstance(k, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        k32 = context.cast(builder, args[1], sig.args[1], types.int32)
        vec = ir.Constant(_llty(I32x8), ir.Undefined)
        vec = builder.insert_element(vec, k32, ir.Constant(ir.IntType(32), 0))
        vec = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(ir.IntType(32), 8), None))
        return builder.mul(args[0], vec)

    return I32x8(I32x8, types.int32), codegen


@intrinsic
def add_i32x8(typingctx, a, b):
    if a != I32x8 or b != I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])

    return I32x8(I32x8, I32x8), codegen


@intrinsic
def fma_i32x8_f32x8(typingctx, acc, v, scale):
    """acc + float(v) * scale: the per-block int32 lanes scaled into float accumulators."""
    if acc != F32x8 or v != I32x8 or scale != F32x8:
        return None

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[1], _llty(F32x8))
        fnty = ir.FunctionType(_llty(F32x8), [_llty(F32x8)] * 3)
        fma = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v8f32")
        return builder.call(fma, [f, args[2], args[0]])

    return F32x8(F32x8, I32x8, F32x8), codegen


@intrinsic
def hsum_f32x8(typingctx, v):
    """The sum of the 8 lanes (done once per output, not per block)."""
    if v != F32x8:
        return None

    def codegen(context, builder, sig, args):
        # pairwise halving: [0..3]+[4..7], then [0,1]+[2,3], then lane 0 + lane 1
        x = args[0]
        idx = ir.IntType(32)
        for half in (4, 2, 1):
            low = ir.Constant(ir.VectorType(idx, half), [ir.Constant(idx, i) for i in range(half)])
            high = ir.Constant(ir.VectorType(idx, half), [ir.Constant(idx, half + i) for i in range(half)])
            x = builder.fadd(builder.shuffle_vector(x, x, low), builder.shuffle_vector(x, x, high))
        return builder.extract_element(x, ir.Constant(ir.IntType(32), 0))

    return types.float32(F32x8), codegen


@intrinsic
def at(typingctx, arr, i):
    """arr[i] without numba's negative-index wraparound (the caller guarantees 0 <= i < len)."""
    if not (isinstance(arr, types.Array) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load(ptr)

    return arr.dtype(arr, types.intp), codegen


@intrinsic
def f16_at(typingctx, arr, off):
    """The IEEE half at byte `off` of a uint8 array, as float32, through LLVM's `fpext half`
    (one vcvtph2ps on F16C hosts; only used by the vector ISAs, which require F16C)."""
    if not (isinstance(arr, types.Array) and arr.dtype in _BYTES and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        h = builder.load(builder.bitcast(ptr, ir.HalfType().as_pointer()), align=1)
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
        i32 = ir.IntType(32)
        x = context.cast(builder, args[0], sig.args[0], types.uint32)
        mag = builder.shl(builder.and_(x, ir.Constant(i32, 0x7FFF)), ir.Constant(i32, 13))
        sign = builder.shl(builder.and_(x, ir.Constant(i32, 0x8000)), ir.Constant(i32, 16))
        f = builder.fmul(builder.bitcast(mag, ir.FloatType()), ir.Constant(ir.FloatType(), 2.0**112))
        return builder.bitcast(builder.or_(builder.bitcast(f, i32), sign), ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def bits_to_f32(typingctx, u):
    """Reinterpret a 32-bit integer as float32 (used for BF16: bits << 16)."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(x, ir.FloatType())

    return types.float32(types.uint32), codegen


# --- float vectors (the F32/F16/BF16 weight paths) ----------------------------------------------
def _float_load(kind: str):
    @intrinsic
    def load(typingctx, arr, off):
        want = {"f32": types.float32, "f16": types.uint16, "bf16": types.int16}[kind]
        if not (isinstance(arr, types.Array) and arr.dtype == want and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
            f8 = _llty(F32x8)
            if kind == "f32":
                return builder.load(builder.bitcast(ptr, f8.as_pointer()), align=4)
            i32x8 = ir.VectorType(ir.IntType(32), 8)
            h = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), 8).as_pointer()), align=2)
            x = builder.zext(h, i32x8)

            def splat(v):
                return ir.Constant(i32x8, [ir.Constant(ir.IntType(32), v)] * 8)

            if kind == "bf16":
                return builder.bitcast(builder.shl(x, splat(16)), f8)
            # IEEE half bits -> float32, exact for finite values (see f16_bits_to_f32)
            mag = builder.shl(builder.and_(x, splat(0x7FFF)), splat(13))
            sign = builder.shl(builder.and_(x, splat(0x8000)), splat(16))
            scale = ir.Constant(f8, [ir.Constant(ir.FloatType(), 2.0**112)] * 8)
            f = builder.fmul(builder.bitcast(mag, f8), scale)
            return builder.bitcast(builder.or_(builder.bitcast(f, i32x8), sign), f8)

        return F32x8(arr, types.intp), codegen

    return load


load_f32x8 = _float_load("f32")
load_f32x8.__doc__ = "8 float32 from element `off` of a float32 array."
load_f16x8 = _float_load("f16")
load_f16x8.__doc__ = "8 IEEE halves (a uint16 array of their bits) from element `off`, as float32."
load_bf16x8 = _float_load("bf16")
load_bf16x8.__doc__ = "8 bfloat16 (an int16 array of their bits) from element `off`, as float32."


@intrinsic
def fma_f32x8(typingctx, acc, a, b):
    """acc + a * b, lane by lane."""
    if acc != F32x8 or a != F32x8 or b != F32x8:
        return None

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_llty(F32x8), [_llty(F32x8)] * 3)
        fma = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v8f32")
        return builder.call(fma, [args[1], args[2], args[0]])

    return F32x8(F32x8, F32x8, F32x8), codegen
