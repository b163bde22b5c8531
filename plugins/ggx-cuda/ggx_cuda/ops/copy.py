"""Copies (kernels/copy.cu): CPY, DUP, CONT.

Element i (ne order) of the source becomes element i of the destination, whatever the two
shapes and strides. Three kinds of launch:

- same type (any type, quantized included): `cpy_raw`, whole blocks moved bit for bit in units
  of 8, 4, 2 or 1 bytes (the widest unit that divides the block size, every stride and both
  addresses); both sides contiguous collapse to one flat run;
- F32 / F16 / BF16 to F32 / F16 / BF16: `cpy_convert`, one thread per element, ggml's rounding;
- F32 / F16 / BF16 to Q8_0 / Q4_0 / Q4_1 / Q5_0 (contiguous destination, as ggml_cpy requires):
  `cpy_to_q`, one thread per block, ggml's reference quantizers bit for bit.

Declined: other conversions (to Q4_K / Q5_K / Q6_K, whose scale search is not ported; to Q8_1 / Q8_K;
between index and float types), and a quantized destination that is not contiguous.
"""
from __future__ import annotations

import numpy as np

from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType

from ..driver import Launch
from ..kernels import names
from . import PlanContext, flat_launch, i64, register

SOURCE = "copy.cu"

FLOAT = {GType.F32: "cpy_f32", GType.F16: "cpy_f16", GType.BF16: "cpy_bf16"}
QUANT = {GType.Q8_0: "cpy_q8_0", GType.Q4_0: "cpy_q4_0", GType.Q4_1: "cpy_q4_1", GType.Q5_0: "cpy_q5_0"}
UNITS = {8: "unsigned long long", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}

NAMES = ([f"cpy_raw<{u}>" for u in UNITS.values()]
         + [f"cpy_convert<{s}, {d}>" for s in FLOAT.values() for d in FLOAT.values()]
         + [f"cpy_to_q<{s}, {q}>" for s in FLOAT.values() for q in QUANT.values()])
names(SOURCE, NAMES)


def _source_dest(node: Tensor) -> tuple[Tensor, Tensor]:
    """(source, destination): CPY writes into its node, a view of src[1]; DUP and CONT into theirs."""
    return node.src[0], node


def _block_layout(t: Tensor, flat: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ne in blocks, nb) of a tensor (an element type has blocks of one value); `flat` makes a
    contiguous tensor one run of blocks."""
    bs = t.type.block_size
    if flat:
        nblocks = t.nelements // bs
        return (nblocks, 1, 1, 1), (t.type.type_size, t.type.type_size * nblocks, t.type.type_size * nblocks,
                                    t.type.type_size * nblocks)
    return (t.ne[0] // bs, *t.ne[1:]), t.nb


# --------------------------------------------------------------------------------------------
def supports_copy(node: Tensor) -> bool:
    if not node.src:
        return False
    src, dst = _source_dest(node)
    if src.nelements != dst.nelements:
        return False
    if src.type is dst.type:
        return True
    if src.type in FLOAT and dst.type in FLOAT:
        return True
    return src.type in FLOAT and dst.type in QUANT and dst.is_contiguous()


def _unit(src: Tensor, dst: Tensor, ctx: PlanContext) -> int:
    """The widest unit (bytes) dividing the block size, every stride used and both addresses."""
    used = [src.nb[i] for i in range(4) if src.ne[i] > 1] + [dst.nb[i] for i in range(4) if dst.ne[i] > 1]
    for u in (8, 4, 2, 1):
        if src.type.type_size % u == 0 and all(x % u == 0 for x in used) \
                and ctx.ptr(src) % u == 0 and ctx.ptr(dst) % u == 0:
            return u
    return 1


def plan_copy(node: Tensor, ctx: PlanContext) -> list[Launch]:
    src, dst = _source_dest(node)
    flat = src.is_contiguous() and dst.is_contiguous()
    ps, pd = np.uint64(ctx.ptr(src)), np.uint64(ctx.ptr(dst))
    if src.type is dst.type:
        u = _unit(src, dst, ctx)
        upb = src.type.type_size // u
        (sne, snb), (dne, dnb) = _block_layout(src, flat), _block_layout(dst, flat)
        n = src.nelements // src.type.block_size * upb
        args = (ps, pd, *i64(n, upb, *sne[:3], *snb, *dne[:3], *dnb))
        return flat_launch(SOURCE, f"cpy_raw<{UNITS[u]}>", n, ctx, args)
    if dst.type in FLOAT:
        (sne, snb), (dne, dnb) = _block_layout(src, flat), _block_layout(dst, flat)
        args = (ps, pd, *i64(src.nelements, *sne[:3], *snb, *dne[:3], *dnb))
        return flat_launch(SOURCE, f"cpy_convert<{FLOAT[src.type]}, {FLOAT[dst.type]}>", src.nelements, ctx, args)
    (sne, snb) = _block_layout(src, src.is_contiguous())
    nblocks = dst.nelements // dst.type.block_size
    args = (ps, pd, *i64(nblocks, *sne[:3], *snb))
    return flat_launch(SOURCE, f"cpy_to_q<{FLOAT[src.type]}, {QUANT[dst.type]}>", nblocks, ctx, args)


register(Op.CPY, supports_copy, plan_copy)
register(Op.DUP, supports_copy, plan_copy)
register(Op.CONT, supports_copy, plan_copy)
