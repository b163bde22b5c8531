"""Elementwise ops (kernels/elementwise.cu): ADD, MUL, SCALE, SILU, GELU, GLU, SUM_ROWS.

All F32. Every operand is passed with its four byte strides, so any view (permuted, transposed,
row-strided) is computed in place of a copy; ADD/MUL repeat b over a by index modulo (ggml's
repeat rule: b.ne[i] divides a.ne[i]). One thread per output element (one block per row for
SUM_ROWS), grid-stride loops over a grid of at most MAX_GRID_X blocks.
"""
from __future__ import annotations

import numpy as np

from ggx.ops import GeluKind, GluKind, Op
from ggx.tensor import Tensor
from ggx.types import GType

from ..driver import Kernel, KernelLaunch, Launch
from ..kernels import names
from . import MAX_GRID_X, PlanContext, flat_launch, i64, register

SOURCE = "elementwise.cu"

BINARY = {Op.ADD: 0, Op.MUL: 1}
UNARY_SCALE, UNARY_SILU = 0, 1
GELU = {GeluKind.TANH: 2, GeluKind.ERF: 3, GeluKind.QUICK: 4}
GLU = {GluKind.SWIGLU: 0, GluKind.GEGLU: 1}

NAMES = ([f"ew_binary<{v}>" for v in BINARY.values()]
         + [f"ew_unary<{v}>" for v in (UNARY_SCALE, UNARY_SILU, *GELU.values())]
         + [f"ew_glu<{v}>" for v in GLU.values()]
         + ["ew_sum_rows"])
names(SOURCE, NAMES)


def _ptr(ctx: PlanContext, t: Tensor, offset: int = 0) -> np.uint64:
    return np.uint64(ctx.ptr(t) + offset)


def _f32(*ts: Tensor) -> bool:
    return all(t.type is GType.F32 for t in ts)


# --------------------------------------------------------------------------------------------
def supports_binary(node: Tensor) -> bool:
    if len(node.src) != 2:
        return False
    a, b = node.src
    return (_f32(node, a, b) and node.ne == a.ne
            and all(b.ne[i] > 0 and a.ne[i] % b.ne[i] == 0 for i in range(4)))


def plan_binary(node: Tensor, ctx: PlanContext) -> list[Launch]:
    a, b = node.src
    args = (_ptr(ctx, a), _ptr(ctx, b), _ptr(ctx, node), *i64(node.nelements, *node.ne[:3], *a.nb, *b.ne, *b.nb,
                                                                 *node.nb))
    return flat_launch(SOURCE, f"ew_binary<{BINARY[node.op]}>", node.nelements, ctx, args)


def supports_unary(node: Tensor) -> bool:
    if len(node.src) != 1 or not _f32(node, node.src[0]) or node.ne != node.src[0].ne:
        return False
    return node.op is not Op.GELU or (node.params is not None and node.params.kind in GELU)


def plan_unary(node: Tensor, ctx: PlanContext) -> list[Launch]:
    a = node.src[0]
    s, bias = 0.0, 0.0
    if node.op is Op.SCALE:
        which, s, bias = UNARY_SCALE, node.params.s, node.params.b
    elif node.op is Op.SILU:
        which = UNARY_SILU
    else:
        which = GELU[node.params.kind]
    args = (_ptr(ctx, a), _ptr(ctx, node), *i64(node.nelements, *node.ne[:3], *a.nb, *node.nb),
            np.float32(s), np.float32(bias))
    return flat_launch(SOURCE, f"ew_unary<{which}>", node.nelements, ctx, args)


def supports_glu(node: Tensor) -> bool:
    p = node.params
    if p is None or p.kind not in GLU or not _f32(node, *node.src):
        return False
    a = node.src[0]
    if len(node.src) == 1:
        return a.ne[0] == 2 * node.ne[0] and a.ne[1:] == node.ne[1:]
    return len(node.src) == 2 and a.ne == node.src[1].ne == node.ne


def plan_glu(node: Tensor, ctx: PlanContext) -> list[Launch]:
    p = node.params
    a = node.src[0]
    if len(node.src) == 1:  # fused rows [gate | up] ([up | gate] when swapped)
        half = node.ne[0] * a.nb[0]
        g_off, u_off = (half, 0) if p.swapped else (0, half)
        gate, up = (_ptr(ctx, a, g_off), a.nb), (_ptr(ctx, a, u_off), a.nb)
    else:
        b = node.src[1]
        gate, up = (_ptr(ctx, a), a.nb), (_ptr(ctx, b), b.nb)
    args = (gate[0], up[0], _ptr(ctx, node), *i64(node.nelements, *node.ne[:3], *gate[1], *up[1], *node.nb))
    return flat_launch(SOURCE, f"ew_glu<{GLU[p.kind]}>", node.nelements, ctx, args)


def supports_sum_rows(node: Tensor) -> bool:
    return (len(node.src) == 1 and _f32(node, node.src[0]) and node.ne[0] == 1
            and node.ne[1:] == node.src[0].ne[1:])


def sum_rows_block(ne0: int, warp_size: int) -> int:
    """Threads per row: one warp for short rows, up to 8 warps for long ones."""
    if ne0 <= 256:
        return warp_size
    return warp_size * (4 if ne0 <= 2048 else 8)


def plan_sum_rows(node: Tensor, ctx: PlanContext) -> list[Launch]:
    a = node.src[0]
    nrows = a.nrows
    if nrows == 0:
        return []
    block = sum_rows_block(a.ne[0], ctx.device.warp_size)
    args = (_ptr(ctx, a), _ptr(ctx, node), *i64(nrows, *a.ne[:3], *a.nb, *node.nb[1:]))
    return [KernelLaunch(Kernel(SOURCE, "ew_sum_rows"), (min(MAX_GRID_X, nrows), 1, 1), (block, 1, 1), args)]


register(Op.ADD, supports_binary, plan_binary)
register(Op.MUL, supports_binary, plan_binary)
register(Op.SCALE, supports_unary, plan_unary)
register(Op.SILU, supports_unary, plan_unary)
register(Op.GELU, supports_unary, plan_unary)
register(Op.GLU, supports_glu, plan_glu)
register(Op.SUM_ROWS, supports_sum_rows, plan_sum_rows)
