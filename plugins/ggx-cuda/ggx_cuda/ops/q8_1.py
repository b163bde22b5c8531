"""The activation side of the integer products (kernels/quantize.cu): b's F32 columns quantized
into scratch, as q8_1 rows for MMVQ or as block_q8_1_mmq tiles for MMQ (layouts in q8_1.cuh).

Both read b [K, N, B2, B3] by its byte strides (rows contiguous); K is a multiple of 32 (the
weights' rows are whole blocks of 32 or 256 values)."""
from __future__ import annotations

import numpy as np

from ggx.tensor import Tensor

from ..driver import Kernel, KernelLaunch
from ..kernels import names
from . import PlanContext

SOURCE = "quantize.cu"
Q8_1_BLOCK = 256  # quantize.cu's Q8_1_BLOCK
QK8_1 = 32
Q8_1_BYTES = 36  # ggx_block_q8_1
QK8_1_MMQ = 128
Q8_1_MMQ_BYTES = 144  # ggx_block_q8_1_mmq
MMQ_ITER_K = 256  # MMQ consumes K in steps of 256: y is padded to whole steps
MAX_GRID_YZ = 65535

Q8_1_KERNEL = Kernel(SOURCE, "k_quantize_q8_1")


def mmq_kernel(ds4: bool) -> Kernel:
    return Kernel(SOURCE, f"k_quantize_mmq<{'true' if ds4 else 'false'}>")


names(SOURCE, [Q8_1_KERNEL.name, mmq_kernel(False).name, mmq_kernel(True).name])


def columns(b: Tensor) -> int:
    return b.ne[1] * b.ne[2] * b.ne[3]


def q8_1_bytes(b: Tensor) -> int:
    """Scratch bytes of b as q8_1 rows."""
    return columns(b) * (b.ne[0] // QK8_1) * Q8_1_BYTES


def plan_q8_1(b: Tensor, ctx: PlanContext, y: int) -> KernelLaunch:
    """b as q8_1 rows at y: column c = (i3 * B2 + i2) * N + i1 is the K / 32 blocks at
    y + c * (K / 32) * 36."""
    K, N, B2 = b.ne[:3]
    ncols = columns(b)
    grid = ((K + Q8_1_BLOCK - 1) // Q8_1_BLOCK, min(ncols, MAX_GRID_YZ), 1)
    args = (np.uint64(ctx.ptr(b)), np.uint64(y), np.int32(K), np.int32(N), np.int32(B2), np.int64(ncols),
            np.int64(b.nb[1]), np.int64(b.nb[2]), np.int64(b.nb[3]))
    return KernelLaunch(Q8_1_KERNEL, grid, (Q8_1_BLOCK, 1, 1), args)


def mmq_blocks_per_column(K: int) -> int:
    """block_q8_1_mmq per column and channel: K rounded up to whole MMQ iterations."""
    return (K + MMQ_ITER_K - 1) // MMQ_ITER_K * (MMQ_ITER_K // QK8_1_MMQ)


def mmq_bytes(b: Tensor) -> int:
    return columns(b) * mmq_blocks_per_column(b.ne[0]) * Q8_1_MMQ_BYTES


def plan_mmq(b: Tensor, ds4: bool, ctx: PlanContext, y: int, ids: int = 0, ncols: int = 0) -> KernelLaunch:
    """b as block_q8_1_mmq at y: channel z = i3 * B2 + i2, block kb of column i1 at
    y + ((z * nkb + kb) * N + i1) * 144 (N <= 65535 and B2 * B3 <= 65535: the caller checks). With
    `ids` (device int32 [ncols]: MUL_MAT_ID's grouped columns), one channel of `ncols` columns,
    column i1 being b's column ids[i1] = i2 * N + i1'."""
    K, N, B2, B3 = b.ne
    grid = (mmq_blocks_per_column(K), ncols, 1) if ids else (mmq_blocks_per_column(K), N, B2 * B3)
    args = (np.uint64(ctx.ptr(b)), np.uint64(y), np.uint64(ids), np.int32(K), np.int32(N), np.int32(B2),
            np.int64(b.nb[1]), np.int64(b.nb[2]), np.int64(b.nb[3]))
    return KernelLaunch(mmq_kernel(ds4), grid, (QK8_1_MMQ, 1, 1), args)
