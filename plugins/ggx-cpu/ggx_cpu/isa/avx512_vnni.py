"""AVX-512 VNNI: the u8 x s8 dot product `vpdpbusd` and the s16 x s16 one `vpdpwssd` (ggml's
AVX512VNNI path).

numba never emits them from a loop, so they are declared here by full LLVM name
(`llvm.x86.avx512.vpdpbusd.256` / `.512`, `llvm.x86.avx512.vpdpwssd.256`; the 256-bit forms
need AVX512VL). This variant's products for `ggx_cpu.isa.dispatch` are `dot_u8s8`, `dot_s8s8`
and `dot_u8s8_scaled`; it builds on AVX2 (`vpmaddubsw`), which every AVX-512 host has.

Layout (see `ggx_cpu.isa.simd`): `u` and `s` hold 32 bytes (64 for the 512-bit form); lane i of
the result adds u[4i..4i+3] . s[4i..4i+3] (u unsigned, s signed) to acc lane i, exactly (no
saturation).

Import-safe on any host: code is generated only when a kernel is compiled for this variant,
which `ggx_cpu.isa` allows only where the host can run it.
"""
from __future__ import annotations

from numba.extending import intrinsic

from .avx2 import vpmaddubsw
from .codegen import declare
from .simd import I8x32, I16x16, I32x8, Vec, add_i32x8, llvm_type, mul_i32x8, xor80_i8x32

#: whether `dot_u8s8` saturates its byte-pair sums (vpdpbusd does not: it is exact)
U8S8_SATURATES = False

I8x64 = Vec("i8", 64)
I32x16 = Vec("i32", 16)


def _make_dp(name: str, acc_vec: Vec, in_vec: Vec, doc: str):
    @intrinsic
    def dp(typingctx, acc, u, s):
        if acc != acc_vec or u != in_vec or s != in_vec:
            return None

        def codegen(context, builder, sig, args):
            v = llvm_type(acc_vec)
            fn = declare(builder, name, v, [v, v, v])
            return builder.call(fn, [args[0], builder.bitcast(args[1], v), builder.bitcast(args[2], v)])

        return acc_vec(acc_vec, in_vec, in_vec), codegen

    dp.__doc__ = doc
    return dp


vpdpbusd = _make_dp("llvm.x86.avx512.vpdpbusd.256", I32x8, I8x32,
                    "acc + the 4-byte u8 x s8 dot products of u and s, 8 int32 lanes (one instruction).")
vpdpbusd_512 = _make_dp("llvm.x86.avx512.vpdpbusd.512", I32x16, I8x64,
                        "vpdpbusd on zmm: acc + the 4-byte u8 x s8 dot products, 16 int32 lanes.")
vpdpwssd = _make_dp("llvm.x86.avx512.vpdpwssd.256", I32x8, I16x16,
                    "acc + (int32 lane i = p[2i] sc[2i] + p[2i+1] sc[2i+1]), int16 inputs, one instruction.")


# --- this variant's products: the bodies `ggx_cpu.isa.dispatch` compiles for its token -----------
def dot_u8s8(isa, acc, u, s):
    """Lane-wise acc + u . s for unsigned u (any byte 0..255) and signed s."""
    return vpdpbusd(acc, u, s)


def dot_s8s8(isa, acc, w, y, ysum4):
    """Lane-wise acc + w . y for signed w and y; ysum4 holds the lanes' sums of y.

    vpdpbusd needs one unsigned operand: w + 128 = w ^ 0x80 is, and the extra 128 * sum(y)
    is taken off exactly by starting the lanes at -128 * ysum4.
    """
    return vpdpbusd(add_i32x8(acc, mul_i32x8(ysum4, -128)), xor80_i8x32(w), y)


def dot_u8s8_scaled(isa, acc, u, s, sc):
    """acc + the byte-pair sums of u * s times the int16 scales sc: vpmaddubsw, then vpdpwssd
    (which multiplies, adds the pairs and accumulates in one instruction)."""
    return vpdpwssd(acc, vpmaddubsw(u, s), sc)
