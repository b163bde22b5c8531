"""AVX2: the u8 x s8 products `vpmaddubsw` + `vpmaddwd` (ggml's AVX2 mul_sum_i8_pairs) and the
byte shuffle `vpshufb`, declared by full LLVM name (`llvm.x86.avx2.pmadd.ub.sw`,
`llvm.x86.avx2.pmadd.wd`, `llvm.x86.avx2.psign.b`, `llvm.x86.avx2.pshuf.b`).

This variant's products for `ggx_cpu.isa.dispatch` are `dot_u8s8`, `dot_s8s8` and
`dot_u8s8_scaled`. Layout as in `ggx_cpu.isa.simd`: 32 bytes in, lane i of the int32x8 result
adds the dot product of bytes 4i..4i+3.

`vpmaddubsw` saturates its int16 pair sums (`U8S8_SATURATES`): fine for 4-bit weights
(2 * 15 * 127 < 32767) and 6-bit K-quant values (2 * 63 * 127); signed 8-bit weights use |w|
and sign(y, w) so the pair sums stay below 2 * 127 * 127.

Import-safe on any host: code is generated only when a kernel is compiled for this variant,
which `ggx_cpu.isa` allows only where the host can run it.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .codegen import I8, declare, splat_const
from .simd import I8x32, I16x16, I32x8, add_i32x8, llvm_type

#: whether `dot_u8s8` saturates its byte-pair sums to int16 (so u * s pairs must stay below 32767)
U8S8_SATURATES = True


@intrinsic
def vpmaddubsw(typingctx, u, s):
    """int16 lane i = u[2i] * s[2i] + u[2i+1] * s[2i+1] (u unsigned, s signed, saturating)."""
    if u != I8x32 or s != I8x32:
        return None

    def codegen(context, builder, sig, args):
        fn = declare(builder, "llvm.x86.avx2.pmadd.ub.sw", llvm_type(I16x16), [llvm_type(I8x32)] * 2)
        return builder.call(fn, [args[0], args[1]])

    return I16x16(I8x32, I8x32), codegen


@intrinsic
def vpmaddwd(typingctx, p, sc):
    """int32 lane i = p[2i] * sc[2i] + p[2i+1] * sc[2i+1] (int16 inputs)."""
    if p != I16x16 or sc != I16x16:
        return None

    def codegen(context, builder, sig, args):
        fn = declare(builder, "llvm.x86.avx2.pmadd.wd", llvm_type(I32x8), [llvm_type(I16x16)] * 2)
        return builder.call(fn, [args[0], args[1]])

    return I32x8(I16x16, I16x16), codegen


@intrinsic
def vpmaddwd_ones(typingctx, v):
    """int32 lane i = v[2i] + v[2i+1] (vpmaddwd with a vector of ones, as ggml does)."""
    if v != I16x16:
        return None

    def codegen(context, builder, sig, args):
        fn = declare(builder, "llvm.x86.avx2.pmadd.wd", llvm_type(I32x8), [llvm_type(I16x16)] * 2)
        return builder.call(fn, [args[0], splat_const(ir.IntType(16), 16, 1)])

    return I32x8(I16x16), codegen


@intrinsic
def abs_sign_i8x32(typingctx, w, y):
    """(|w|, sign(y, w)): moves w's sign onto y so that |w| can be the unsigned operand."""
    if w != I8x32 or y != I8x32:
        return None

    def codegen(context, builder, sig, args):
        v = llvm_type(I8x32)
        i1 = ir.IntType(1)
        a = builder.call(declare(builder, "llvm.abs.v32i8", v, [v, i1]), [args[0], ir.Constant(i1, 0)])
        s = builder.call(declare(builder, "llvm.x86.avx2.psign.b", v, [v, v]), [args[1], args[0]])
        return context.make_tuple(builder, sig.return_type, [a, s])

    return types.UniTuple(I8x32, 2)(I8x32, I8x32), codegen


def pshufb(builder, v, mask: list[int]):
    """Codegen: vpshufb of 32 bytes with a constant mask (an index >= 128 gives 0): byte i takes
    byte mask[i] of its own 16-byte half. For other modules' intrinsics (the K-quant scale
    unpacking); every host of both vector ISAs has it."""
    v8 = llvm_type(I8x32)
    return builder.call(declare(builder, "llvm.x86.avx2.pshuf.b", v8, [v8, v8]),
                        [v, ir.Constant(v8, [ir.Constant(I8, m) for m in mask])])



# --- this variant's products: the bodies `ggx_cpu.isa.dispatch` compiles for its token -----------
def dot_u8s8(isa, acc, u, s):
    """Lane-wise acc + u . s for unsigned u (e.g. 4-bit weights 0..15) and signed s."""
    return add_i32x8(acc, vpmaddwd_ones(vpmaddubsw(u, s)))


def dot_s8s8(isa, acc, w, y, ysum4):
    """Lane-wise acc + w . y for signed w and y (ysum4 unused: the abs/sign trick is exact)."""
    a, s = abs_sign_i8x32(w, y)
    return add_i32x8(acc, vpmaddwd_ones(vpmaddubsw(a, s)))


def dot_u8s8_scaled(isa, acc, u, s, sc):
    """acc + the byte-pair sums of u * s times the int16 scales sc: vpmaddubsw, vpmaddwd, vpaddd."""
    return add_i32x8(acc, vpmaddwd(vpmaddubsw(u, s), sc))
