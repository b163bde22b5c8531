"""Row gathers and scatters (kernels/rows.cu): GET_ROWS, SET_ROWS.

GET_ROWS: out[:, i10, i11, i12] = a[:, ids[i10, i11, i12], i11 % a.ne2, i12 % a.ne3] with a of
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K dequantized to F32 exactly as ggml / gguf do, and
I32 copied as I32; ids I32. One thread per output element.

SET_ROWS: dst[:, ids[i1, i2 % ids.ne1, i3 % ids.ne2], i2, i3] = src[:, i1, i2, i3], src F32
into F32, F16, BF16 (one thread per element) or Q8_0, Q4_0, Q4_1, Q5_0 (one thread per block, ggml's
reference quantizers bit for bit); ids I32 or I64. Rows written twice race, as in ggml.
Declined: SET_ROWS into Q4_K / Q5_K / Q6_K (their scale search is not ported) and other types.

Every operand is passed with its byte strides, so views of any layout work.
"""
from __future__ import annotations

import numpy as np

from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType

from ..driver import Launch
from ..kernels import names
from . import PlanContext, flat_launch, i64, register

SOURCE = "rows.cu"

GET = {GType.F32: "rows_f32", GType.F16: "rows_f16", GType.BF16: "rows_bf16", GType.I32: "rows_i32",
       GType.Q4_0: "rows_q4_0", GType.Q4_1: "rows_q4_1", GType.Q5_0: "rows_q5_0", GType.Q8_0: "rows_q8_0",
       GType.Q4_K: "rows_q4_k", GType.Q5_K: "rows_q5_k", GType.Q6_K: "rows_q6_k"}
SET = {GType.F32: "rows_f32", GType.F16: "rows_f16", GType.BF16: "rows_bf16"}
SET_Q = {GType.Q8_0: "rows_q8_0", GType.Q4_0: "rows_q4_0", GType.Q4_1: "rows_q4_1", GType.Q5_0: "rows_q5_0"}
INDEX = {GType.I32: "int", GType.I64: "long long"}

NAMES = ([f"rows_get<{s}>" for s in GET.values()]
         + [f"rows_set<{i}, {d}>" for i in INDEX.values() for d in SET.values()]
         + [f"rows_set_q<{i}, {q}>" for i in INDEX.values() for q in SET_Q.values()])
names(SOURCE, NAMES)


# --------------------------------------------------------------------------------------------
def supports_get_rows(node: Tensor) -> bool:
    if len(node.src) != 2:
        return False
    a, ids = node.src
    out_type = GType.I32 if a.type is GType.I32 else GType.F32
    return (a.type in GET and ids.type is GType.I32 and node.type is out_type
            and node.ne == (a.ne[0], ids.ne[0], ids.ne[1], ids.ne[2]) and ids.ne[3] == 1)


def plan_get_rows(node: Tensor, ctx: PlanContext) -> list[Launch]:
    a, ids = node.src
    n = node.nelements
    args = (np.uint64(ctx.ptr(a)), np.uint64(ctx.ptr(ids)), np.uint64(ctx.ptr(node)),
            *i64(n, *node.ne[:3], *a.nb, *a.ne[1:], *ids.nb[:3], *node.nb))
    return flat_launch(SOURCE, f"rows_get<{GET[a.type]}>", n, ctx, args)


def supports_set_rows(node: Tensor) -> bool:
    if len(node.src) != 3:
        return False
    target, src, ids = node.src
    if src.type is not GType.F32 or ids.type not in INDEX or node.type is not target.type:
        return False
    if node.ne[0] != src.ne[0] or node.ne[2:] != src.ne[2:] or ids.ne[0] != src.ne[1] or ids.ne[3] != 1:
        return False
    if src.ne[2] % ids.ne[1] or src.ne[3] % ids.ne[2]:
        return False
    if node.type in SET:
        return True
    # a quantized destination: blocks of 32 side by side in each row
    return node.type in SET_Q and node.nb[0] == node.type.type_size


def plan_set_rows(node: Tensor, ctx: PlanContext) -> list[Launch]:
    _, src, ids = node.src
    quant = node.type in SET_Q
    ne0 = src.ne[0] // 32 if quant else src.ne[0]
    n = ne0 * src.ne[1] * src.ne[2] * src.ne[3]
    args = (np.uint64(ctx.ptr(src)), np.uint64(ctx.ptr(ids)), np.uint64(ctx.ptr(node)),
            *i64(n, ne0, *src.ne[1:3], *src.nb, *ids.ne[1:3], *ids.nb[:3], node.ne[1], *node.nb))
    if quant:
        return flat_launch(SOURCE, f"rows_set_q<{INDEX[ids.type]}, {SET_Q[node.type]}>", n, ctx, args)
    return flat_launch(SOURCE, f"rows_set<{INDEX[ids.type]}, {SET[node.type]}>", n, ctx, args)


register(Op.GET_ROWS, supports_get_rows, plan_get_rows)
register(Op.SET_ROWS, supports_set_rows, plan_set_rows)
