"""LLVM IR helpers for writing numba intrinsics: the one copy every ISA and kernel module uses.

An intrinsic's typing half checks its numba argument types (`is_bytes_arg`); its codegen half
builds IR with these: constants (`i32_vector`, `splat_const`), a pointer to an array element
(`elem_ptr`), an unaligned vector load from it (`load_vector`), and the declaration of an LLVM
intrinsic function by its full name (`declare`, e.g. "llvm.x86.avx2.pmadd.wd").
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types

#: LLVM element type of each vector element kind
ELEMENT = {"i8": ir.IntType(8), "i16": ir.IntType(16), "i32": ir.IntType(32), "f32": ir.FloatType()}
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def vector_type(kind: str, n: int) -> ir.VectorType:
    """`<n x kind>` for kind i8/i16/i32/f32."""
    return ir.VectorType(ELEMENT[kind], n)


def i32_vector(values) -> ir.Constant:
    """A constant `<len x i32>` (shuffle masks, per-lane shift counts and factors)."""
    values = list(values)
    return ir.Constant(ir.VectorType(I32, len(values)), [ir.Constant(I32, v) for v in values])


def splat_const(ty: ir.Type, n: int, value) -> ir.Constant:
    """A constant `<n x ty>` with `value` in every lane."""
    return ir.Constant(ir.VectorType(ty, n), [ir.Constant(ty, value)] * n)


def is_bytes_arg(arr, off) -> bool:
    """Typing check: `arr` is an int8/uint8 array and `off` an integer."""
    return isinstance(arr, types.Array) and arr.dtype in (types.int8, types.uint8) and isinstance(off, types.Integer)


def elem_ptr(context, builder, arrty, arr, off):
    """Pointer to element `off` of the numba array `arr` (of numba type arrty), unchecked."""
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.gep(ary.data, [off])


def load_vector(context, builder, arrty, arr, off, llty: ir.Type, align: int = 1):
    """A value of LLVM type `llty` loaded from element `off` of `arr` (unaligned by default)."""
    return builder.load(builder.bitcast(elem_ptr(context, builder, arrty, arr, off), llty.as_pointer()), align=align)


def declare(builder, name: str, ret: ir.Type, args: list[ir.Type]):
    """The LLVM function `name` (an intrinsic, by its full name) in the module being built."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)
