"""The ISA dispatch: the 8-bit products every quantized kernel calls, by the `isa` token's type.

A kernel written with these compiles, from one source, to each variant's instructions:
`VARIANT_MODULES` is the one table from a variant's name to the module defining its products
(`dot_u8s8`, `dot_s8s8`, `dot_u8s8_scaled` and the constant `U8S8_SATURATES`): plain functions
with these stubs' arguments, which the overloads hand to numba as the implementation itself
(no wrapper to inline: every inlined layer costs compile time at each call site). Inputs and
results (layout of `ggx_cpu.isa.simd`): u, s, w, y are `I8x32` (32 bytes), sc is `I16x16`,
acc, ysum4 and the result are `I32x8`, lane i covering bytes 4i..4i+3.
"""
from __future__ import annotations

from numba.extending import overload

from . import avx2, avx512_vnni, portable
from .tokens import IsaType, token_constant

#: variant name -> the module with its products
VARIANT_MODULES = {"avx512_vnni": avx512_vnni, "avx2": avx2, "portable": portable}


def _module(isa):
    return VARIANT_MODULES[isa.isa_name] if isinstance(isa, IsaType) else None


def dot_u8s8(isa, acc, u, s):
    """Lane-wise acc + u . s (u unsigned bytes, s signed bytes) with `isa`'s instruction: exact,
    except that where `u8s8_saturates(isa)` each pair u[2k] s[2k] + u[2k+1] s[2k+1] saturates to
    int16 (fine for u <= 128)."""
    raise NotImplementedError("dot_u8s8 is only callable from compiled code")


def dot_s8s8(isa, acc, w, y, ysum4):
    """Lane-wise acc + w . y (both signed bytes), exact on every ISA; ysum4 must hold the lanes'
    sums of y (some ISAs compute with w + 128 and take 128 * ysum4 off)."""
    raise NotImplementedError("dot_s8s8 is only callable from compiled code")


def dot_u8s8_scaled(isa, acc, u, s, sc):
    """Lane-wise acc + sum over the lane's 4 bytes of u * s * sc (u unsigned, s signed bytes;
    sc int16 per byte pair: lane i's pairs 2i, 2i+1 take sc[2i], sc[2i+1]). The byte-pair sums
    are formed in int16 first (saturating where `u8s8_saturates`), so keep u * s pairs below
    32767 (ggml's K-quant ranges do)."""
    raise NotImplementedError("dot_u8s8_scaled is only callable from compiled code")


@overload(dot_u8s8, inline="always")
def _ol_dot_u8s8(isa, acc, u, s):
    m = _module(isa)
    if m is not None:
        return m.dot_u8s8


@overload(dot_s8s8, inline="always")
def _ol_dot_s8s8(isa, acc, w, y, ysum4):
    m = _module(isa)
    if m is not None:
        return m.dot_s8s8


@overload(dot_u8s8_scaled, inline="always")
def _ol_dot_u8s8_scaled(isa, acc, u, s, sc):
    m = _module(isa)
    if m is not None:
        return m.dot_u8s8_scaled


@token_constant
def u8s8_saturates(isa) -> bool:
    """True where `dot_u8s8` sums byte pairs in saturating int16 (AVX2's vpmaddubsw), so an
    unsigned operand above 128 may be wrong; False where it is exact for every byte (a
    compile-time constant of the isa token)."""
    return VARIANT_MODULES[isa.isa_name].U8S8_SATURATES
