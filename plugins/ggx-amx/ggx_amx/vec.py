"""The few vector operations the AMX kernels need beyond ggx-cpu's SIMD vocabulary.

Written with ggx-cpu's intrinsic helpers (`ggx_cpu.extension`: `Vec` types, `llvm_type`,
`elem_ptr`, `load_vector`), in its conventions: element offsets, unaligned, unchecked (the
buffer type proves every offset before a kernel runs). Plain LLVM vector IR: every target lowers it.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ggx_cpu.extension import I8x32, I32x8, elem_ptr, llvm_type, load_vector

_I8 = ir.IntType(8)


def _splat8(v: int) -> ir.Constant:
    return ir.Constant(llvm_type(I8x32), [ir.Constant(_I8, v & 255)] * 32)


def _is_bytes(arr, off) -> bool:
    return isinstance(arr, types.Array) and arr.dtype in (types.int8, types.uint8) and isinstance(off, types.Integer)


@intrinsic
def store_i8x32(typingctx, arr, off, v):
    """Store the 32 bytes of v at element `off` of an int8 / uint8 array."""
    if not (_is_bytes(arr, off) and v == I8x32):
        return None

    def codegen(context, builder, sig, args):
        ptr = elem_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(ptr, llvm_type(I8x32).as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(arr, types.intp, I8x32), codegen


@intrinsic
def load_i32x8_at(typingctx, arr, off):
    """8 little-endian int32 at byte `off` of a byte array (Q8_0's compensation sums)."""
    if not _is_bytes(arr, off):
        return None

    def codegen(context, builder, sig, args):
        return load_vector(context, builder, sig.args[0], args[0], args[1], llvm_type(I32x8))

    return I32x8(arr, types.intp), codegen


@intrinsic
def load_s8_i32x8(typingctx, arr, off):
    """8 signed bytes at byte `off` of a byte array, sign-extended to int32 lanes (Q6_K's scales)."""
    if not _is_bytes(arr, off):
        return None

    def codegen(context, builder, sig, args):
        v = load_vector(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_I8, 8))
        return builder.sext(v, llvm_type(I32x8))

    return I32x8(arr, types.intp), codegen


def _splat_arg(context, builder, value, ty) -> ir.Value:
    """An integer argument as the same byte in all 32 lanes (folded to a constant when it is one)."""
    b = builder.trunc(context.cast(builder, value, ty, types.int64), _I8)
    vt, i32 = llvm_type(I8x32), ir.IntType(32)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), b, ir.Constant(i32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(i32, 32), [0] * 32))


@intrinsic
def nibbles_minus(typingctx, v, bias):
    """(low nibbles - bias, high nibbles - bias) of the 32 bytes of v, as signed bytes."""
    if v != I8x32 or not isinstance(bias, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        k = _splat_arg(context, builder, args[1], sig.args[1])
        lo = builder.sub(builder.and_(args[0], _splat8(15)), k)
        hi = builder.sub(builder.lshr(args[0], _splat8(4)), k)
        return context.make_tuple(builder, sig.return_type, [lo, hi])

    return types.UniTuple(I8x32, 2)(I8x32, bias), codegen


@intrinsic
def q6_pair(typingctx, low, high, shift, bias):
    """Two dwords of Q6_K values from the AMX layout (layout.py): `low` holds their low 4 bits
    (the first dword's in the low nibbles), bits shift..shift+3 of `high` their top 2 bits (the
    first dword's in shift, shift + 1); the 6-bit values minus `bias`, as signed bytes."""
    if low != I8x32 or high != I8x32 or not all(isinstance(x, types.Integer) for x in (shift, bias)):
        return None

    def codegen(context, builder, sig, args):
        lo, hi = args[0], args[1]
        s = _splat_arg(context, builder, args[2], sig.args[2])
        k = _splat_arg(context, builder, args[3], sig.args[3])
        top0 = builder.shl(builder.and_(builder.lshr(hi, s), _splat8(3)), _splat8(4))
        top1 = builder.shl(builder.and_(builder.lshr(hi, builder.add(s, _splat8(2))), _splat8(3)), _splat8(4))
        v0 = builder.or_(builder.and_(lo, _splat8(15)), top0)
        v1 = builder.or_(builder.lshr(lo, _splat8(4)), top1)
        return context.make_tuple(builder, sig.return_type, [builder.sub(v0, k), builder.sub(v1, k)])

    return types.UniTuple(I8x32, 2)(I8x32, I8x32, shift, bias), codegen
