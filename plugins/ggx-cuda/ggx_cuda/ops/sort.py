"""ARGSORT (ASC/DESC) and TOP_K of F32 rows, I32 indices (kernels/sort.cu).

A bitonic sort of each row's indices padded to a power of two, one block per row (ggml-cuda's
argsort), with a total order (NaN last, ties by index) so the result is the reference's stable
argsort exactly. The indices live in shared memory when ncols_pad * 4 bytes fit the device's
per-block shared memory (48 KiB: rows up to 8192), otherwise in global scratch, bounded by
SCRATCH_BYTES: the rows then go in several launches over the same scratch (the stream runs them
in order). TOP_K is the same descending sort keeping the first k (the k largest, descending).
"""
from __future__ import annotations

import numpy as np

from ggx.ops import ArgsortParams, Op, SortOrder, TopKParams
from ggx.tensor import Tensor
from ggx.types import GType

from ..driver import Kernel, KernelLaunch, Launch
from ..kernels import names
from . import PlanContext, register

SOURCE = "sort.cu"
KERNELS = {SortOrder.ASC: "k_argsort_f32_i32<false>", SortOrder.DESC: "k_argsort_f32_i32<true>"}
names(SOURCE, list(KERNELS.values()))

INT32_MAX = 2**31 - 1
MAX_BLOCK = 1024
#: the longest row taken: the global-memory sort costs log2(n)^2 / 2 block barriers over n / 1024
#: elements per thread, one block per row; 2^18 covers vocabularies up to 262144 (TOP_K sampling)
MAX_COLS = 1 << 18
#: scratch of one launch when the indices do not fit shared memory
SCRATCH_BYTES = 64 << 20


def padded(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def supports(node: Tensor) -> bool:
    if len(node.src) != 1:
        return False
    a = node.src[0]
    if a.type is not GType.F32 or node.type is not GType.I32 or node.ne[1:] != a.ne[1:]:
        return False
    if node.op is Op.ARGSORT:
        if not isinstance(node.params, ArgsortParams) or node.ne[0] != a.ne[0]:
            return False
    elif not isinstance(node.params, TopKParams) or not 1 <= node.ne[0] == node.params.k <= a.ne[0]:
        return False
    return 1 <= a.ne[0] <= MAX_COLS and node.nrows <= INT32_MAX


def plan(node: Tensor, ctx: PlanContext) -> list[Launch]:
    a = node.src[0]
    if node.nelements == 0:
        return []
    order = node.params.order if node.op is Op.ARGSORT else SortOrder.DESC
    ncols = a.ne[0]
    pad = padded(ncols)
    block = max(ctx.device.warp_size, min(MAX_BLOCK, pad))
    nrows = node.nrows
    if pad * 4 <= ctx.device.smem_per_block:
        scratch, chunk, shared = 0, nrows, pad * 4
    else:
        chunk = max(1, min(nrows, SCRATCH_BYTES // (pad * 4)))
        scratch, shared = ctx.scratch(chunk * pad * 4), 0
    kernel = Kernel(SOURCE, KERNELS[order])
    launches: list[Launch] = []
    for row0 in range(0, nrows, chunk):
        args = (np.uint64(ctx.ptr(a)), np.uint64(ctx.ptr(node)), np.uint64(scratch), np.int32(ncols),
                np.int32(pad), np.int32(node.ne[0]), np.int32(a.ne[1]), np.int32(a.ne[2]), np.int64(row0),
                *(np.int64(s) for s in a.nb), *(np.int64(s) for s in node.nb))
        launches.append(KernelLaunch(kernel, (min(chunk, nrows - row0), 1, 1), (block, 1, 1), args, shared))
    return launches


register(Op.ARGSORT, supports, plan)
register(Op.TOP_K, supports, plan)
