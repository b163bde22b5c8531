"""RMS_NORM and NORM (F32): one block per row, warp-shuffle reductions (kernels/norm.cu).

Rows are flattened into grid x (grid y/z stay 1, so any row count up to 2^31 - 1 fits); every
operand is passed by its byte strides, so strided, permuted and transposed inputs all work.
Block: one warp for rows shorter than 1024, else 1024 threads (ggml-cuda's choice).
"""
from __future__ import annotations

import numpy as np

from ggx.ops import NormParams, Op
from ggx.tensor import Tensor
from ggx.types import GType

from ..driver import Kernel, KernelLaunch, Launch
from ..kernels import names
from . import PlanContext, register

SOURCE = "norm.cu"
KERNELS = {Op.RMS_NORM: "k_norm_f32<true>", Op.NORM: "k_norm_f32<false>"}
names(SOURCE, list(KERNELS.values()))

INT32_MAX = 2**31 - 1
#: ggml-cuda: rows of at least this many values get a 1024-thread block, shorter ones a warp.
WIDE_ROW = 1024
WIDE_BLOCK = 1024


def supports(node: Tensor) -> bool:
    if len(node.src) != 1 or not isinstance(node.params, NormParams):
        return False
    a = node.src[0]
    return (a.type is GType.F32 and node.type is GType.F32 and node.ne == a.ne
            and a.ne[0] <= INT32_MAX and node.nrows <= INT32_MAX)


def block_size(ncols: int, warp_size: int) -> int:
    return warp_size if ncols < WIDE_ROW else WIDE_BLOCK


def plan(node: Tensor, ctx: PlanContext) -> list[Launch]:
    a = node.src[0]
    if node.nelements == 0:
        return []
    block = block_size(a.ne[0], ctx.device.warp_size)
    args = (np.uint64(ctx.ptr(a)), np.uint64(ctx.ptr(node)), np.int32(a.ne[0]), np.int32(a.ne[1]),
            np.int32(a.ne[2]), *(np.int64(s) for s in a.nb), *(np.int64(s) for s in node.nb),
            np.float32(node.params.eps))
    return [KernelLaunch(Kernel(SOURCE, KERNELS[node.op]), (node.nrows, 1, 1), (block, 1, 1), args)]


register(Op.RMS_NORM, supports, plan)
register(Op.NORM, supports, plan)
