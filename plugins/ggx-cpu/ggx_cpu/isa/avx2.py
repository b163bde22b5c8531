"""AVX2: u8 x s8 dot products with `vpmaddubsw` + `vpmaddwd` (ggml's AVX2 mul_sum_i8_pairs).

Declared by full LLVM name (`llvm.x86.avx2.pmadd.ub.sw`, `llvm.x86.avx2.pmadd.wd`,
`llvm.x86.avx2.psign.b`). Layout as in `ggx_cpu.isa.simd`: 32 bytes in, lane i of the int32x8
result adds the dot product of bytes 4i..4i+3.

`vpmaddubsw` saturates its int16 pair sums: fine for 4-bit weights (2 * 15 * 127 < 32767);
signed 8-bit weights use |w| and sign(y, w) so the pair sums stay below 2 * 127 * 127.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import I8x32, I16x16, I32x8, _llty

NAME = "avx2"
REQUIRES = ("avx2", "fma", "f16c")


def _declare(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


@intrinsic
def vpmaddubsw(typingctx, u, s):
    """int16 lane i = u[2i] * s[2i] + u[2i+1] * s[2i+1] (u unsigned, s signed, saturating)."""
    if u != I8x32 or s != I8x32:
        return None

    def codegen(context, builder, sig, args):
        fn = _declare(builder, "llvm.x86.avx2.pmadd.ub.sw", _llty(I16x16), [_llty(I8x32)] * 2)
        return builder.call(fn, [args[0], args[1]])

    return I16x16(I8x32, I8x32), codegen


@intrinsic
def vpmaddwd_ones(typingctx, v):
    """int32 lane i = v[2i] + v[2i+1] (vpmaddwd with a vector of ones, as ggml does)."""
    if v != I16x16:
        return None

    def codegen(context, builder, sig, args):
        fn = _declare(builder, "llvm.x86.avx2.pmadd.wd", _llty(I32x8), [_llty(I16x16)] * 2)
        ones = ir.Constant(_llty(I16x16), [ir.Constant(ir.IntType(16), 1)] * 16)
        return builder.call(fn, [args[0], ones])

    return I32x8(I16x16), codegen


@intrinsic
def abs_sign_i8x32(typingctx, w, y):
    """(|w|, sign(y, w)): moves w's sign onto y so that |w| can be the unsigned operand."""
    if w != I8x32 or y != I8x32:
        return None
    from numba.core import types

    def codegen(context, builder, sig, args):
        v = _llty(I8x32)
        absf = _declare(builder, "llvm.abs.v32i8", v, [v, ir.IntType(1)])
        signf = _declare(builder, "llvm.x86.avx2.psign.b", v, [v, v])
        a = builder.call(absf, [args[0], ir.Constant(ir.IntType(1), 0)])
        s = builder.call(signf, [args[1], args[0]])
        return context.make_tuple(builder, sig.return_type, [a, s])

    return types.UniTuple(I8x32, 2)(I8x32, I8x32), codegen


@intrinsic
def _add(typingctx, a, b):
    if a != I32x8 or b != I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])

    return I32x8(I32x8, I32x8), codegen


@njit(cache=True, inline="always")
def dot_u8s8(acc, u, s):
    """Lane-wise acc + u . s for unsigned u (e.g. 4-bit weights 0..15) and signed s."""
    return _add(acc, vpmaddwd_ones(vpmaddubsw(u, s)))


@njit(cache=True, inline="always")
def dot_s8s8(acc, w, y, ysum4):
    """Lane-wise acc + w . y for signed w and y (ysum4 unused: the abs/sign trick is exact)."""
    a, s = abs_sign_i8x32(w, y)
    return _add(acc, vpmaddwd_ones(vpmaddubsw(a, s)))
