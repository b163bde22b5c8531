"""ROPE (F32, modes NORMAL and NEOX, YaRN) with I32 positions (kernels/rope.cu).

theta_scale = freq_base^(-2/n_dims) is taken in float32 on the host and the kernel computes
pos * powf(theta_scale, i) per pair, as ggml-cuda does; the YaRN correction dims are the
reference's `rope_yarn_corr_dims` (ggml_rope_yarn_corr_dims), rounded to float32 for the kernel.
Frequency factors (the op's optional third source, F32 contiguous) divide each pair's angle;
without them the kernel gets a null pointer and divides by 1.

A block holds `rows` rows side by side (threadIdx.y) and strides each row's work items (the
n_dims/2 pairs, then the ne0 - n_dims copied values) over threadIdx.x; rows go in grid x. Every
operand is passed by its byte strides (the source may be a view of some heads of a fused QKV).
"""
from __future__ import annotations

import math

import numpy as np

from ggx.ops import Op, RopeMode, RopeParams
from ggx.reference.ops import rope_yarn_corr_dims
from ggx.tensor import Tensor
from ggx.types import GType

from ..driver import Kernel, KernelLaunch, Launch
from ..kernels import names
from . import PlanContext, register

SOURCE = "rope.cu"
KERNELS = {RopeMode.NORMAL: "k_rope_f32<false>", RopeMode.NEOX: "k_rope_f32<true>"}
names(SOURCE, list(KERNELS.values()))

INT32_MAX = 2**31 - 1
#: threads per block (ggml-cuda's CUDA_ROPE_BLOCK_SIZE)
BLOCK_THREADS = 256


def supports(node: Tensor) -> bool:
    if len(node.src) not in (2, 3) or not isinstance(node.params, RopeParams):
        return False
    a, pos = node.src[:2]
    p = node.params
    if len(node.src) == 3:
        ff = node.src[2]
        if ff.type is not GType.F32 or not ff.is_contiguous() or ff.ne[0] < p.n_dims // 2:
            return False
    return (a.type is GType.F32 and node.type is GType.F32 and pos.type is GType.I32 and node.ne == a.ne
            and p.mode in KERNELS and 0 < p.n_dims <= a.ne[0] and p.n_dims % 2 == 0
            and pos.nelements == pos.ne[0] and pos.ne[0] >= a.ne[2]
            and a.ne[0] <= INT32_MAX and node.nrows <= INT32_MAX)


def constants(p: RopeParams) -> tuple[np.float32, np.float32, np.float32]:
    """(theta_scale, corr0, corr1) as the kernel takes them."""
    theta_scale = np.float32(np.float32(p.freq_base) ** (np.float32(-2.0) / np.float32(p.n_dims)))
    corr0, corr1 = rope_yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
    with np.errstate(over="ignore"):
        return theta_scale, np.float32(corr0), np.float32(corr1)


def block_shape(n_items: int, warp_size: int) -> tuple[int, int, int]:
    """(threads per row, rows per block, 1): a warp multiple of threads per row, up to 256."""
    per_row = min(BLOCK_THREADS, max(warp_size, math.ceil(n_items / warp_size) * warp_size))
    return per_row, max(1, BLOCK_THREADS // per_row), 1


def plan(node: Tensor, ctx: PlanContext) -> list[Launch]:
    a, pos = node.src[:2]
    ff = np.uint64(ctx.ptr(node.src[2])) if len(node.src) > 2 else np.uint64(0)
    p = node.params
    if node.nelements == 0:
        return []
    n_items = p.n_dims // 2 + (a.ne[0] - p.n_dims)
    block = block_shape(n_items, ctx.device.warp_size)
    grid = (math.ceil(node.nrows / block[1]), 1, 1)
    theta_scale, corr0, corr1 = constants(p)
    args = (np.uint64(ctx.ptr(a)), np.uint64(ctx.ptr(pos)), ff, np.uint64(ctx.ptr(node)),
            np.int32(a.ne[0]), np.int32(p.n_dims), np.int32(a.ne[1]), np.int32(a.ne[2]), np.int64(node.nrows),
            *(np.int64(s) for s in a.nb), np.int64(pos.nb[0]), *(np.int64(s) for s in node.nb),
            theta_scale, np.float32(p.freq_scale), np.float32(p.ext_factor), np.float32(p.attn_factor),
            corr0, corr1)
    return [KernelLaunch(Kernel(SOURCE, KERNELS[p.mode]), grid, block, args)]


register(Op.ROPE, supports, plan)
