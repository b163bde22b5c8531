"""AVX-512 VNNI: the u8 x s8 dot product `vpdpbusd` (ggml's AVX512VNNI path).

numba never emits `vpdpbusd` from a loop, so it is declared here by its full LLVM name
(`llvm.x86.avx512.vpdpbusd.256`, 256-bit form, needs AVX512VL). Only import-safe on any host:
code is generated when a kernel is compiled for this ISA, which `ggx_cpu.isa` allows only on
a CPU that has the features in `REQUIRES`.

Layout (see `ggx_cpu.isa.simd`): `u` and `s` hold 32 bytes; lane i of the result adds
u[4i..4i+3] . s[4i..4i+3] (u unsigned, s signed) to acc lane i.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import I8x32, I32x8, _llty, add_i32x8, load_i32x8, mul_i32x8, xor80_i8x32  # noqa: F401

NAME = "avx512_vnni"
REQUIRES = ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "f16c")


@intrinsic
def vpdpbusd(typingctx, acc, u, s):
    """acc + the 4-byte u8 x s8 dot products of u and s, lane by lane (one instruction)."""
    if acc != I32x8 or u != I8x32 or s != I8x32:
        return None

    def codegen(context, builder, sig, args):
        v8 = _llty(I32x8)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]),
                                            "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(fn, [args[0], builder.bitcast(args[1], v8), builder.bitcast(args[2], v8)])

    return I32x8(I32x8, I8x32, I8x32), codegen


@njit(cache=True, inline="always")
def dot_u8s8(acc, u, s):
    """Lane-wise acc + u . s for unsigned u (e.g. 4-bit weights 0..15) and signed s."""
    return vpdpbusd(acc, u, s)


@njit(cache=True, inline="always")
def dot_s8s8(acc, w, y, ysum4):
    """Lane-wise acc + w . y for signed w and y; ysum4 holds the lanes' sums of y.

    vpdpbusd needs one unsigned operand: w + 128 = w ^ 0x80 is, and the extra 128 * sum(y)
    is taken off exactly by starting the lanes at -128 * ysum4.
    """
    return vpdpbusd(add_i32x8(acc, mul_i32x8(ysum4, -128)), xor80_i8x32(w), y)
