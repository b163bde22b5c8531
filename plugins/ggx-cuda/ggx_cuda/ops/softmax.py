"""SOFT_MAX (F32) with scale, an optional F32/F16 mask broadcast over dims 2/3 and ALiBi
(kernels/softmax.cu).

One block per row (rows in grid x), ggml-cuda's block size: the smallest power of two >= ne0
from a warp up to 1024. The row is kept in dynamic shared memory when it fits the device's
per-block shared memory (no opt-in), else in the destination row. ALiBi's m0/m1 and
n_head_log2 are ggml's (n_head = ne2), as the reference's `alibi_slopes`.
"""
from __future__ import annotations

import numpy as np

from ggx.ops import Op, SoftMaxParams
from ggx.tensor import Tensor
from ggx.types import GType

from ..driver import Kernel, KernelLaunch, Launch
from ..kernels import names
from . import PlanContext, register

SOURCE = "softmax.cu"
KERNELS = {GType.F32: "k_soft_max_f32<float>", GType.F16: "k_soft_max_f32<__half>"}
names(SOURCE, list(KERNELS.values()))

INT32_MAX = 2**31 - 1
MAX_BLOCK = 1024
WARP = 32  # the kernel's inter-warp buffer: SOFTMAX_WARP floats at the start of shared memory


def supports(node: Tensor) -> bool:
    if not 1 <= len(node.src) <= 2 or not isinstance(node.params, SoftMaxParams):
        return False
    a = node.src[0]
    if a.type is not GType.F32 or node.type is not GType.F32 or node.ne != a.ne:
        return False
    if a.ne[0] > INT32_MAX or node.nrows > INT32_MAX:
        return False
    if len(node.src) == 2:
        m = node.src[1]
        if m.type not in KERNELS or m.ne[0] != a.ne[0] or m.ne[1] < a.ne[1]:
            return False
        if m.ne[2] == 0 or m.ne[3] == 0 or a.ne[2] % m.ne[2] or a.ne[3] % m.ne[3]:
            return False
    return True


def block_size(ncols: int, warp_size: int) -> int:
    nth = warp_size
    while nth < ncols and nth < MAX_BLOCK:
        nth *= 2
    return nth


def shared_bytes(ncols: int, warp_size: int) -> int:
    """Dynamic shared memory holding the row (padded to a warp) after the reduction buffer."""
    return ((ncols + warp_size - 1) // warp_size * warp_size + WARP) * 4


def alibi(n_head: int, max_bias: float) -> tuple[np.float32, np.float32, np.int32]:
    """(m0, m1, n_head_log2) of ggml's ALiBi slopes; unused when max_bias <= 0."""
    if max_bias <= 0.0 or n_head <= 0:
        return np.float32(1.0), np.float32(1.0), np.int32(1)
    n_head_log2 = 1 << (n_head.bit_length() - 1)  # 2^floor(log2(n_head))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-max_bias / 2.0 / n_head_log2)
    return np.float32(m0), np.float32(m1), np.int32(n_head_log2)


def plan(node: Tensor, ctx: PlanContext) -> list[Launch]:
    a = node.src[0]
    mask = node.src[1] if len(node.src) > 1 else None
    p = node.params
    if node.nelements == 0:
        return []
    ncols = a.ne[0]
    block = block_size(ncols, ctx.device.warp_size)
    shared = shared_bytes(ncols, ctx.device.warp_size)
    use_shared = shared <= ctx.device.smem_per_block
    if not use_shared:
        shared = WARP * 4
    if mask is None:
        mask_args = (np.uint64(0), np.int32(1), np.int32(1))
        mask_nb = (np.int64(0),) * 4
        kernel = KERNELS[GType.F32]
    else:
        mask_args = (np.uint64(ctx.ptr(mask)), np.int32(mask.ne[2]), np.int32(mask.ne[3]))
        mask_nb = tuple(np.int64(s) for s in mask.nb)
        kernel = KERNELS[mask.type]
    m0, m1, n_head_log2 = alibi(a.ne[2], p.max_bias)
    args = (np.uint64(ctx.ptr(a)), mask_args[0], np.uint64(ctx.ptr(node)), np.int32(ncols),
            np.int32(a.ne[1]), np.int32(a.ne[2]), mask_args[1], mask_args[2],
            *(np.int64(s) for s in a.nb), *mask_nb, *(np.int64(s) for s in node.nb),
            np.float32(p.scale), np.float32(p.max_bias), m0, m1, n_head_log2, np.int32(use_shared))
    return [KernelLaunch(Kernel(SOURCE, kernel), (node.nrows, 1, 1), (block, 1, 1), args, shared)]


register(Op.SOFT_MAX, supports, plan)
