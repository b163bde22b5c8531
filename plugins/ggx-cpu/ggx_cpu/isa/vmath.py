"""Vector float math for the F32 kernels as ggml's CPU backend computes it: its vectorized expf
and SiLU over its row chunks, its vec_dot order, libm's expf inline, and the float vector
helpers softmax and flash attention need (max, F16 rows in and out, F16 rounding).

ggml compiles one float SIMD form per build, so its results depend on the instruction set:
`FloatSimd` is the compile-time token of that choice (`float_simd(ISA variant)`): the AVX-512
form (16 lanes, avx512_vnni) or the AVX2 form (8 lanes, avx2 and portable, whose kernels are
the same compiled code); it also carries the form's GEMM tile (`ggx_cpu.isa.fgemm`). Kernels
written with it reproduce ggml's code path of the variant: vector chunks of `lanes(fs)` values
(`exp_chunk`, `silu_chunk`, `swiglu_chunk`: ggml_vec_soft_max_f32's, ggml_vec_silu_f32's and
ggml_vec_swiglu_f32's steps), ggml's sum grouping within a chunk, ggml_vec_dot_f16 / _f32's
accumulators and reduction (`dot`), and libm's expf where ggml falls back to scalar code
(`expf`: glibc's algorithm inline, the same bits as the call).

The vector exp is ggml's `ggml_v_expf` (vec.h, "adapted from arm limited optimized routine"):
n = round(x * log2(e)) by the 1.5 * 2^23 shift, b = x - n * ln2 in two parts (Cody-Waite), a
degree-5 polynomial, and the scaling by 2^n built in the exponent bits. The AVX2 form takes
j = exp(b) - 1 and returns k + k j (k = 2^n); the AVX-512 form takes j = exp(b) and returns
j * 2^n (vscalefps: exact unless the result is subnormal, rounded once). Where |n| > 126 the
scaling is split in two factors so that subnormal results come out as expf gives them, and
|n| > 192 gives +inf (x > 0) or 0. So exp(-inf) = 0, exp(+inf) = +inf, NaN stays NaN, x above
~88.72 overflows to inf, results underflow to 0 below ~-103.97, as expf; the error is within
~2 ulp (ggml quotes 1.45 ulp + 0.5 for its AVX2 form). As in ggml's AVX2 form, the split
scaling is computed only when some lane needs it (a branch on any lane).

Everything is target-independent LLVM IR (products with additions are `llvm.fmuladd`: one FMA
where the target has one, a multiply and an add where it has not), so each form runs on any
host. A chunk's vector is `lanes(fs)` wide in the IR (16 lanes are two ymm or one zmm, as the
target has them); the helpers on `F32x8` serve the rest.
"""
from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic, overload

from .codegen import I32, declare, elem_ptr, i32_vector
from .simd import F32x8, add_f32x8, fma_f32x8, hsum_f32x8, llvm_type, load_f32x8, zero_f32x8
from .tokens import TokenType, register_token, token_constant


class FloatSimd:
    """Which of ggml's float SIMD forms a kernel reproduces: `form` ("avx512" or "avx2"), its
    vector width `lanes` (ggml's GGML_F32_EPR) and the register tile of its simd_gemm
    (`tile_rows` x `tile_vectors` vectors of `lanes`). A compile-time token."""

    def __init__(self, form: str, lanes: int, tile_rows: int, tile_vectors: int):
        self.form, self.lanes, self.tile_rows, self.tile_vectors = form, lanes, tile_rows, tile_vectors

    def __repr__(self) -> str:
        return f"FloatSimd({self.form!r})"


class FloatSimdType(TokenType):
    """numba type of a `FloatSimd`."""

    def __init__(self, fs: FloatSimd):
        self.form, self.lanes, self.tile_rows, self.tile_vectors = fs.form, fs.lanes, fs.tile_rows, fs.tile_vectors
        super().__init__(name=f"FloatSimd({fs.form})")


register_token(FloatSimd, FloatSimdType)

# AVX-512: 32 vector registers, a 4 x 4-vector GEMM tile; AVX2: 16 registers, 6 x 2 (ggml's
# simd-gemm.h choices). The portable variant is plain IR either way and takes the AVX2 form.
_FORMS = {"avx512": ("avx512", 16, 4, 4), "avx2": ("avx2", 8, 6, 2)}
_FORM_OF_VARIANT = {"avx512_vnni": "avx512", "avx2": "avx2", "portable": "avx2"}


@functools.cache
def float_simd_form(form: str) -> FloatSimd:
    """The `FloatSimd` token of a form, "avx512" or "avx2" (one object per form)."""
    return FloatSimd(*_FORMS[form])


def float_simd(variant: str) -> FloatSimd:
    """The `FloatSimd` token of an ISA variant (variants of one form share the object)."""
    return float_simd_form(_FORM_OF_VARIANT[variant])


@token_constant
def lanes(fs) -> int:
    """ggml's vector width for the form: rows are processed in chunks of this many floats."""
    return fs.lanes


_F32 = ir.FloatType()


def _const(ty: ir.Type, value) -> ir.Constant:
    """`value` as a constant of the float or int (vector) type `ty`, splat over the lanes."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)
    return ir.Constant(ty, value)


def _ints(ty: ir.Type) -> ir.Type:
    """The i32 type (or vector of i32) with the shape of the float type `ty`."""
    return ir.VectorType(I32, ty.count) if isinstance(ty, ir.VectorType) else I32


def _fmuladd(builder, a, b, c):
    """a * b + c: one fused operation where the target has FMA (llvm.fmuladd)."""
    ty = a.type
    name = f"llvm.fmuladd.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fmuladd.f32"
    return builder.call(declare(builder, name, ty, [ty, ty, ty]), [a, b, c])


def v_expf(builder, x, form: str):
    """IR of ggml_v_expf in its AVX2 or AVX-512 `form` on a float32 value or vector `x` (module
    docstring)."""
    ty = x.type
    ity = _ints(ty)

    def f(v):
        return _const(ty, v) if isinstance(v, float) else _const(ty, float.fromhex(v))

    def bits(v):
        return builder.bitcast(v, ity)

    def flt(v):
        return builder.bitcast(v, ty)

    def fma(a, b, c):
        return _fmuladd(builder, a, b, c)

    shift = f("0x1.8p23")
    z = fma(x, f("0x1.715476p+0"), shift)
    n = builder.fsub(z, shift)  # round(x * log2(e))
    b = fma(builder.fneg(n), f("0x1.7f7d1cp-20"), fma(builder.fneg(n), f("0x1.62e4p-1"), x))  # x - n ln2
    e = builder.shl(bits(z), _const(ity, 23))  # n in the exponent field
    k = flt(builder.add(e, bits(f(1.0))))  # 2^n for |n| <= 126
    abs_n = flt(builder.and_(bits(n), _const(ity, 0x7FFFFFFF)))
    c = builder.fcmp_ordered(">", abs_n, f(126.0))
    u = builder.fmul(b, b)
    poly = fma(fma(f("0x1.0e4020p-7"), b, f("0x1.573e2ep-5")), u, fma(f("0x1.555e66p-3"), b, f("0x1.fffdb6p-2")))
    if form == "avx512":  # j = exp(b), scaled exactly by 2^n (vscalefps)
        j = fma(poly, u, fma(f("0x1.ffffecp-1"), b, f(1.0)))
        common = builder.fmul(j, k)
    else:  # j = exp(b) - 1; k + k j
        j = fma(poly, u, builder.fmul(f("0x1.ffffecp-1"), b))
        common = fma(k, j, k)
    # lanes with |n| > 126 (results near overflow, subnormal, 0 or inf): the rare path, where 2^n
    # is applied as two factors s2 * s1 (one rounding at the end, as vscalefps)
    entry = builder.block
    rare = builder.append_basic_block("expf_rare")
    done = builder.append_basic_block("expf_done")
    any_c = c
    if isinstance(ty, ir.VectorType):
        any_c = builder.call(declare(builder, f"llvm.vector.reduce.or.v{ty.count}i1", ir.IntType(1), [c.type]), [c])
    builder.cbranch(any_c, rare, done)
    builder.position_at_end(rare)
    g = builder.select(builder.fcmp_ordered("<=", n, f(0.0)), _const(ity, 0x82000000 - (1 << 32)), _const(ity, 0))
    s1 = flt(builder.add(g, _const(ity, 0x7F000000)))
    s2 = flt(builder.sub(e, g))
    split = builder.fmul(builder.fmul(j, s2) if form == "avx512" else fma(s2, j, s2), s1)
    d = builder.fcmp_ordered(">", abs_n, f(192.0))  # overflow to inf, or 0
    special = builder.select(d, builder.fmul(s1, s1), builder.select(c, split, common))
    builder.branch(done)
    builder.position_at_end(done)
    out = builder.phi(ty)
    out.add_incoming(common, entry)
    out.add_incoming(special, rare)
    return out


def v_silu(builder, x, form: str):
    """IR of ggml_v_silu: x / (1 + expf(-x)) (so silu(-inf) = -inf / inf = NaN, as ggml's)."""
    return builder.fdiv(x, builder.fadd(_const(x.type, 1.0), v_expf(builder, builder.fneg(x), form)))


def _hsum(builder, x):
    """The lanes of an 8- or 16-lane float vector summed in ggml's order for its form: halves
    added lane-wise down to 8, then ([0..3] + [4..7]), ([0, 1] + [2, 3]), [0] + [1]
    (_mm512_reduce_add_ps; the AVX2 softmax's extract / movehl / movehdup)."""
    n = x.type.count
    while n > 1:
        n //= 2
        x = builder.fadd(builder.shuffle_vector(x, x, i32_vector(range(n))),
                         builder.shuffle_vector(x, x, i32_vector(range(n, 2 * n))))
    return builder.extract_element(x, ir.Constant(I32, 0))


def _chunk_ptr(context, builder, arrty, arr, off, width):
    """Pointer to `width` float32 lanes from element `off` of a float32 array."""
    vector = ir.VectorType(ir.FloatType(), width)
    return builder.bitcast(elem_ptr(context, builder, arrty, arr, off), vector.as_pointer())


@intrinsic
def exp_chunk(typingctx, fs, y, yo, x, xo, m):
    """y[yo:yo+L] = exp(x[xo:xo+L] - m) for one of ggml's chunks (L = lanes(fs): one vector of
    the form's width), returning the chunk's float32 sum in ggml's order: the inner step of
    ggml_vec_soft_max_f32 (float32 arrays, unit stride)."""
    if not (isinstance(fs, FloatSimdType) and all(isinstance(a, types.Array) and a.dtype == types.float32
                                                  for a in (y, x))):
        return None

    def codegen(context, builder, sig, args):
        _, y_, yo_, x_, xo_, m_ = args
        vt = ir.VectorType(ir.FloatType(), fs.lanes)
        v = builder.load(_chunk_ptr(context, builder, sig.args[3], x_, xo_, fs.lanes), align=4)
        mv = builder.shuffle_vector(builder.insert_element(ir.Constant(vt, ir.Undefined), m_, ir.Constant(I32, 0)),
                                    ir.Constant(vt, ir.Undefined), i32_vector([0] * fs.lanes))
        e = v_expf(builder, builder.fsub(v, mv), fs.form)
        builder.store(e, _chunk_ptr(context, builder, sig.args[1], y_, yo_, fs.lanes), align=4)
        return _hsum(builder, e)

    return types.float32(fs, y, types.intp, x, types.intp, types.float32), codegen


def _make_silu_chunk(gated: bool):
    @intrinsic
    def silu_chunk(typingctx, fs, y, yo, x, xo, u, uo):
        if not (isinstance(fs, FloatSimdType) and all(isinstance(a, types.Array) and a.dtype == types.float32
                                                      for a in (y, x, u))):
            return None

        def codegen(context, builder, sig, args):
            _, y_, yo_, x_, xo_, u_, uo_ = args
            w = fs.lanes
            a = v_silu(builder, builder.load(_chunk_ptr(context, builder, sig.args[3], x_, xo_, w), align=4), fs.form)
            if gated:
                a = builder.fmul(a, builder.load(_chunk_ptr(context, builder, sig.args[5], u_, uo_, w), align=4))
            builder.store(a, _chunk_ptr(context, builder, sig.args[1], y_, yo_, w), align=4)
            return context.get_dummy_value()

        return types.void(fs, y, types.intp, x, types.intp, u, types.intp), codegen

    return silu_chunk


silu_chunk = _make_silu_chunk(gated=False)
silu_chunk.__doc__ = ("y[yo:yo+L] = silu(x[xo:xo+L]) for one of ggml's chunks (L = lanes(fs)): ggml_vec_silu_f32's "
                      "step (u, uo unused).")
swiglu_chunk = _make_silu_chunk(gated=True)
swiglu_chunk.__doc__ = "y[yo:yo+L] = silu(x[xo:xo+L]) * u[uo:uo+L]: ggml_vec_swiglu_f32's step."


@intrinsic
def max_f32x8(typingctx, a, b):
    """Lane-wise a > b ? a : b (ggml's MAX; a NaN in a gives b)."""
    if a != F32x8 or b != F32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return F32x8(F32x8, F32x8), codegen


@intrinsic
def hmax_f32x8(typingctx, v):
    """The largest of the 8 lanes (halves compared pairwise, as hsum_f32x8 adds them)."""
    if v != F32x8:
        return None

    def codegen(context, builder, sig, args):
        x = args[0]
        for half in (4, 2, 1):
            lo = builder.shuffle_vector(x, x, i32_vector(range(half)))
            hi = builder.shuffle_vector(x, x, i32_vector(range(half, 2 * half)))
            x = builder.select(builder.fcmp_ordered(">", lo, hi), lo, hi)
        return builder.extract_element(x, ir.Constant(I32, 0))

    return types.float32(F32x8), codegen


_HALF8 = ir.VectorType(ir.HalfType(), 8)


@intrinsic
def load_half_f32x8(typingctx, arr, off):
    """8 IEEE halves (a uint16 array of their bits) from element `off`, converted to float32 by
    LLVM's `fpext` (one vcvtph2ps on F16C hosts); exact."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint16 and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = elem_ptr(context, builder, sig.args[0], args[0], args[1])
        h = builder.load(builder.bitcast(ptr, _HALF8.as_pointer()), align=2)
        return builder.fpext(h, llvm_type(F32x8))

    return F32x8(arr, types.intp), codegen


@intrinsic
def store_f32x8_half(typingctx, arr, off, v):
    """Store 8 float32 lanes as IEEE halves (bits into a uint16 array) at element `off`, rounded to
    nearest even (`fptrunc`: one vcvtps2ph on F16C hosts), as ggml's FP32_TO_FP16."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint16 and isinstance(off, types.Integer)
            and v == F32x8):
        return None

    def codegen(context, builder, sig, args):
        ptr = elem_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(builder.fptrunc(args[2], _HALF8), builder.bitcast(ptr, _HALF8.as_pointer()), align=2)
        return context.get_dummy_value()

    return types.void(arr, types.intp, F32x8), codegen


def load_as_f32x8(arr, off):
    """8 values of a float32 array, or of a uint16 array of IEEE half bits (converted exactly),
    from element `off`, as float32 lanes: one kernel source for F32 and F16 rows."""
    raise NotImplementedError("load_as_f32x8 is only callable from compiled code")


@overload(load_as_f32x8, inline="always")
def _ol_load_as_f32x8(arr, off):
    if isinstance(arr, types.Array) and arr.dtype == types.float32:
        return lambda arr, off: load_f32x8(arr, off)
    if isinstance(arr, types.Array) and arr.dtype == types.uint16:
        return lambda arr, off: load_half_f32x8(arr, off)


@intrinsic
def round_half_f32x8(typingctx, v):
    """Each lane rounded to the nearest IEEE half (ties to even) and back: what storing into an
    F16 buffer and loading again gives, without the memory round trip."""
    if v != F32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], _HALF8), llvm_type(F32x8))

    return F32x8(F32x8), codegen


def is_half(arr):
    """Whether `arr` holds IEEE half bits (a uint16 array): a compile-time constant."""
    raise NotImplementedError("is_half is only callable from compiled code")


@overload(is_half, inline="always")
def _ol_is_half(arr):
    value = isinstance(arr, types.Array) and arr.dtype == types.uint16
    return lambda arr: value


@intrinsic
def value_f32(typingctx, x):
    """An element of a float32 array, or of a uint16 array of IEEE half bits, as float32 (exact)."""
    if x == types.float32:
        return types.float32(types.float32), lambda context, builder, sig, args: args[0]
    if x == types.uint16:
        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen
    return None


@intrinsic
def hsum_hadd_f32x8(typingctx, v):
    """The sum of the 8 lanes in ggml's AVX2 GGML_F32x8_REDUCE order: t = low half + high half,
    then (t0 + t1) + (t2 + t3) (two vhaddps)."""
    if v != F32x8:
        return None

    def codegen(context, builder, sig, args):
        x = args[0]
        t = builder.fadd(builder.shuffle_vector(x, x, i32_vector(range(4))),
                         builder.shuffle_vector(x, x, i32_vector(range(4, 8))))
        p = builder.fadd(builder.shuffle_vector(t, t, i32_vector([0, 2])),
                         builder.shuffle_vector(t, t, i32_vector([1, 3])))
        return builder.fadd(builder.extract_element(p, ir.Constant(I32, 0)),
                            builder.extract_element(p, ir.Constant(I32, 1)))

    return types.float32(F32x8), codegen


@njit(cache=True, inline="always")
def dot(fs, a, ao, b, bo, n):
    """sum a[ao + i] * b[bo + i] for i < n as ggml_vec_dot_f16 / ggml_vec_dot_f32 compute it for
    the form fs: four accumulators of lanes(fs) floats over chunks of 4 * lanes(fs) (one FMA
    each), reduced as GGML_F32_VEC_REDUCE (pairs, then the lanes), the leftovers added one by one
    (in float64 when b is F16 bits, as vec_dot_f16; in float32 for F32, as vec_dot_f32). a is
    float32 (the F16-rounded query when b is F16), b float32 or F16 bits."""
    half = is_half(b)
    np_ = n - n % (4 * lanes(fs))
    z = zero_f32x8()
    if lanes(fs) == 16:
        s0, s1, s2, s3, s4, s5, s6, s7 = z, z, z, z, z, z, z, z
        for i in range(0, np_, 64):
            s0 = fma_f32x8(s0, load_f32x8(a, ao + i), load_as_f32x8(b, bo + i))
            s1 = fma_f32x8(s1, load_f32x8(a, ao + i + 8), load_as_f32x8(b, bo + i + 8))
            s2 = fma_f32x8(s2, load_f32x8(a, ao + i + 16), load_as_f32x8(b, bo + i + 16))
            s3 = fma_f32x8(s3, load_f32x8(a, ao + i + 24), load_as_f32x8(b, bo + i + 24))
            s4 = fma_f32x8(s4, load_f32x8(a, ao + i + 32), load_as_f32x8(b, bo + i + 32))
            s5 = fma_f32x8(s5, load_f32x8(a, ao + i + 40), load_as_f32x8(b, bo + i + 40))
            s6 = fma_f32x8(s6, load_f32x8(a, ao + i + 48), load_as_f32x8(b, bo + i + 48))
            s7 = fma_f32x8(s7, load_f32x8(a, ao + i + 56), load_as_f32x8(b, bo + i + 56))
        # accumulators j = (s[2j], s[2j+1]): 0 += 2, 1 += 3, 0 += 1, then the 16 lanes
        lo = add_f32x8(add_f32x8(s0, s4), add_f32x8(s2, s6))
        hi = add_f32x8(add_f32x8(s1, s5), add_f32x8(s3, s7))
        reduced = hsum_f32x8(add_f32x8(lo, hi))
    else:
        s0, s1, s2, s3 = z, z, z, z
        for i in range(0, np_, 32):
            s0 = fma_f32x8(s0, load_f32x8(a, ao + i), load_as_f32x8(b, bo + i))
            s1 = fma_f32x8(s1, load_f32x8(a, ao + i + 8), load_as_f32x8(b, bo + i + 8))
            s2 = fma_f32x8(s2, load_f32x8(a, ao + i + 16), load_as_f32x8(b, bo + i + 16))
            s3 = fma_f32x8(s3, load_f32x8(a, ao + i + 24), load_as_f32x8(b, bo + i + 24))
        reduced = hsum_hadd_f32x8(add_f32x8(add_f32x8(s0, s2), add_f32x8(s1, s3)))
    if half:
        wide = np.float64(reduced)
        for i in range(np_, n):
            wide += np.float64(a[ao + i] * value_f32(b[bo + i]))
        return np.float32(wide)
    s = reduced
    for i in range(np_, n):
        s = s + a[ao + i] * value_f32(b[bo + i])
    return s


@intrinsic
def fmuladd_f32(typingctx, a, b, c):
    """a * b + c for float32 scalars with one rounding where the target has FMA (llvm.fmuladd):
    what a C compiler contracting `a * b + c` gives (GCC's default for GNU C/C++)."""
    if not all(isinstance(x, types.Float) for x in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
        return _fmuladd(builder, *vals)

    return types.float32(a, b, c), codegen


# --- glibc's expf, inline ---------------------------------------------------------------------------
# ggml's scalar code calls expf (row tails, the flash attention updates). glibc (2.27 and later)
# computes it as ARM's optimized-routines expf: x * 32 / ln2 = k + r, 2^(k/32) from a 32-entry
# table, a cubic for 2^(r/32), all in float64, rounded once to float32. The same operations here
# give libm's bits (`fmuladd` where glibc's FMA build contracts) without a call, whose register
# saves cost more than the formula.
_EXP2F_N = 32
_EXP2F_TAB = np.array([np.float64(2.0 ** (i / _EXP2F_N)).view(np.uint64) - np.uint64((i << 52) // _EXP2F_N)
                       for i in range(_EXP2F_N)], np.uint64)
_EXPF_SHIFT = float.fromhex("0x1.8p+52")
_EXPF_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * _EXP2F_N
_EXPF_C0 = float.fromhex("0x1.c6af84b912394p-5") / _EXP2F_N**3
_EXPF_C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / _EXP2F_N**2
_EXPF_C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / _EXP2F_N
_EXPF_OVERFLOW = np.float32(float.fromhex("0x1.62e42ep6"))  # log(2^128)
_EXPF_UNDERFLOW = np.float32(float.fromhex("-0x1.9fe368p6"))  # log(2^-150)


@intrinsic
def _bitcast(typingctx, x, target):
    """x reinterpreted as `target` (float64 <-> uint64, float32 <-> uint32)."""
    to = target.instance_type if isinstance(target, types.NumberClass) else None
    if to is None or to.bitwidth != x.bitwidth:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(to))

    return to(x, target), codegen


@intrinsic
def _fmuladd_f64(typingctx, a, b, c):
    """a * b + c in float64, fused where the target has FMA (llvm.fmuladd)."""
    if not all(x == types.float64 for x in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        d = ir.DoubleType()
        return builder.call(declare(builder, "llvm.fmuladd.f64", d, [d, d, d]), args)

    return types.float64(types.float64, types.float64, types.float64), codegen


@njit(cache=True, inline="always")
def expf(x):
    """expf(x) for a float32 x with libm's (glibc's) bits: see the comment above."""
    if (_bitcast(x, np.uint32) >> 20) & 0x7FF >= 0x42B:  # |x| >= 88, inf or NaN
        if x == -np.inf or x < _EXPF_UNDERFLOW:
            return np.float32(0.0)
        if not x < np.inf:  # +inf or NaN
            return x + x
        if x > _EXPF_OVERFLOW:
            return np.float32(np.inf)
    xd = np.float64(x)
    kd = _EXPF_INVLN2N * xd + _EXPF_SHIFT
    ki = _bitcast(kd, np.uint64)
    kd -= _EXPF_SHIFT
    r = _fmuladd_f64(_EXPF_INVLN2N, xd, -kd)  # glibc's FMA build contracts z - kd, z = x * 32 / ln2
    s = _bitcast(_EXP2F_TAB[ki % np.uint64(_EXP2F_N)] + (ki << np.uint64(47)), np.float64)
    y = _fmuladd_f64(_fmuladd_f64(_EXPF_C0, r, _EXPF_C1), r * r, _fmuladd_f64(_EXPF_C2, r, 1.0))
    return np.float32(y * s)


@intrinsic
def all_neg_inf_half8(typingctx, arr, off):
    """Whether the 8 IEEE halves (uint16 bits) from element `off` are all -inf (bits 0xFC00):
    the bits compared, so a NaN is not -inf."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint16 and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        i16x8 = ir.VectorType(ir.IntType(16), 8)
        v = builder.load(builder.bitcast(elem_ptr(context, builder, sig.args[0], args[0], args[1]),
                                         i16x8.as_pointer()), align=2)
        eq = builder.icmp_unsigned("==", v, ir.Constant(i16x8, [ir.Constant(ir.IntType(16), 0xFC00)] * 8))
        fn = declare(builder, "llvm.vector.reduce.and.v8i1", ir.IntType(1), [eq.type])
        return builder.call(fn, [eq])

    return types.boolean(arr, types.intp), codegen
