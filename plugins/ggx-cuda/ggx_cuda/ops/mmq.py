"""MMQ, quantized weights times many columns (ggml-cuda's mmq.cu / mmq.cuh), kernels in
kernels/quantize.cu (b to block_q8_1_mmq) and kernels/mmq.cu (k_mul_mat_q, k_mmq_fixup).

ggml's rules, as pure functions:

* `should_use_mmq` — ggml_cuda_should_use_mmq (NVIDIA): ggml's MMQ types, at least 48 KiB of
  shared memory per block, then always from Turing on; with __dp4a but no tensor cores always;
  with Volta's tensor cores only below MMQ_DP4A_MAX_BATCH_SIZE columns.
* `config` — ggml_cuda_mmq_get_config's Ampere table (mmq-config-ampere.cuh), used from Volta
  on: 256 threads, tiles of I = 128 rows and J columns, J = 8..128 in steps of 8 (with
  `fallback`, rows not a multiple of 128: 8, 16, 32, 64, 128), stream-K on.
* `best_j` — mul_mat_q_switch_J: the smallest J giving the fewest column tiles among the J the
  table has and the shared memory holds (the loop stops once one tile takes every column).
* `stream_k_blocks` — launch_mul_mat_q: one block per tile when the tiles fill the SMs' waves to
  >= 90 %, else one block per SM sharing the K slices of all tiles (stream-K), a fixup pass adding
  the partial tiles when the blocks do not split the tiles evenly.

MUL_MAT_ID (`plan_id`) runs the same kernel grouped by expert, as ggml's ggml_cuda_mul_mat_q with
ids: kernels/mmid.cu lists each expert's (token, slot) pairs on the device, the activations are
quantized in that order, and each expert's weights multiply its own columns.

Where ggx differs: its kernel is one generic tile loop (a per-type loader unpacks 32 values to
int8, a scale per 16 and a min per 32), so the shared memory of a J is its own formula
(`shared_bytes`), not ggml's per-type tile sizes; the int8 tensor-core path (MMA) needs
compute capability 8.0 (mma.sync m16n8k16.s8): the kernel compiled for sm_80 and later uses it,
compiled for an older architecture it uses __dp4a (ggml picks its MMA layout the same way); Pascal's
table (I = 64, no stream-K) and Blackwell's are not mirrored (no MMQ before Volta, the Ampere table
from Volta on).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggx.tensor import Tensor
from ggx.types import GType

from .. import arch
from ..driver import Kernel, KernelLaunch, Launch
from ..kernels import names
from . import PlanContext, mmvq, q8_1

SOURCE = "mmq.cu"
MMQ_DP4A_MAX_BATCH_SIZE = 64  # mmq.cuh
MMQ_ITER_K = 256
I = 128  # MMQ_I
NWARPS = 8
WARP = 32
MAX_GRID_YZ = 65535

#: each type's loader in mmq.cu and whether its activations carry sums (ggml's DS4 layout)
TRAITS = {GType.Q4_0: ("mmq_q4_0", True), GType.Q4_1: ("mmq_q4_1", True), GType.Q5_0: ("mmq_q5_0", False),
          GType.Q8_0: ("mmq_q8_0", False), GType.Q4_K: ("mmq_q4_K", True), GType.Q5_K: ("mmq_q5_K", True),
          GType.Q6_K: ("mmq_q6_K", False)}
TYPES = tuple(TRAITS)
J_ALL = tuple(range(8, 129, 8))
J_FALLBACK = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class MmqConfig:
    """ggml_cuda_mmq_config's fields ggx uses."""

    nthreads: int
    I: int  # noqa: E741 - ggml's name
    J: int
    stream_k: bool


def should_use_mmq(gtype: GType, cc: int, ne11: int, n_experts: int, smpbo: int) -> bool:
    """mmq.cu ggml_cuda_should_use_mmq, NVIDIA branches (ggx's types are all MMQ types)."""
    if gtype not in TRAITS:
        return False
    if smpbo < 48 * 1024:  # MMQ tiles need 48 KiB per block
        return False
    if arch.turing_mma_available(cc):
        return True
    if cc < arch.DP4A:
        return False
    return not arch.fp16_mma_hardware_available(cc) or ne11 < MMQ_DP4A_MAX_BATCH_SIZE


def config(gtype: GType, J: int, fallback: bool, cc: int) -> MmqConfig | None:
    """The table's entry for (type, J, fallback) on compute capability cc, or None (no entry)."""
    if gtype not in TRAITS or cc < arch.VOLTA or J not in (J_FALLBACK if fallback else J_ALL):
        return None
    return MmqConfig(NWARPS * WARP, I, J, True)


def shared_bytes(J: int) -> int:
    """Dynamic shared memory of k_mul_mat_q<.., J, ..>: the weight tile (quants, scales, mins) and
    the activation tile (quants, d, s)."""
    return 4 * (I * (68 + 17 + 9) + J * (68 + 8 + 8))


def best_j(gtype: GType, ncols: int, fallback: bool, cc: int, smpbo: int) -> int:
    """mul_mat_q_switch_J's J_best (0: none fits)."""
    j_best, ntiles_best = 0, 2**31 - 1
    for J in J_ALL:
        if ntiles_best <= 1:
            break
        cfg = config(gtype, J, fallback, cc)
        if cfg is None or shared_bytes(J) > smpbo:
            continue
        ntiles = (ncols + J - 1) // J
        if ntiles < ntiles_best:
            j_best, ntiles_best = J, ntiles
    return j_best


def stream_k_blocks(ntiles: int, nsm: int) -> int:
    """launch_mul_mat_q's grid of a stream-K config on NVIDIA: tiles when tiling fills >= 90 % of
    its waves of nsm blocks, else nsm blocks sharing the work."""
    nwaves = (ntiles + nsm - 1) // nsm
    efficiency = 100 * ntiles // (nsm * nwaves)
    return ntiles if efficiency >= 90 else nsm


J_CLASSES = (16, 32, 64, 128)  # J = 8 runs the 16-wide kernel (its loops stop at J)


def j_class(J: int) -> int:
    """The instantiation of a tile width: the power of two at or above it (J a launch argument)."""
    return next(c for c in J_CLASSES if c >= J)


def kernel(gtype: GType, J: int) -> Kernel:
    """The kernel of a tile width (it takes MMA or __dp4a by the architecture it is compiled for)."""
    return Kernel(SOURCE, f"k_mul_mat_q<{TRAITS[gtype][0]}, {j_class(J)}>")


FIXUP_KERNEL = Kernel(SOURCE, "k_mmq_fixup")
names(SOURCE, [kernel(t, J).name for t in TYPES for J in J_CLASSES] + [FIXUP_KERNEL.name])


def supports(node: Tensor) -> bool:
    """A MUL_MAT node MMQ computes exactly (MMVQ's layouts, the activation grid's limits)."""
    a, b = node.src
    return (mmvq.supports(node) and a.type in TRAITS and b.ne[1] <= MAX_GRID_YZ
            and b.ne[2] * b.ne[3] <= MAX_GRID_YZ)


def plan(node: Tensor, ctx: PlanContext) -> list[Launch]:
    a, b = node.src
    K, M, A2, A3 = a.ne
    N, B2, B3 = b.ne[1:]
    dev = ctx.device
    cc = arch.cc_int(dev.cc)
    J = best_j(a.type, N, M % I != 0, cc, dev.smem_per_block_optin)
    nty, ntx, nz = (M + I - 1) // I, (N + J - 1) // J, B2 * B3
    ntiles = nty * ntx * nz
    nblocks = stream_k_blocks(ntiles, dev.sm_count)
    total = ntiles * ((K + MMQ_ITER_K - 1) // MMQ_ITER_K)
    y = ctx.scratch(q8_1.mmq_bytes(b))
    fixup = ctx.scratch(nblocks * I * J * 4) if ntiles % nblocks else 0
    dst_strides = (np.int64(node.nb[1] // 4), np.int64(node.nb[2] // 4), np.int64(node.nb[3] // 4))
    args = (np.uint64(ctx.ptr(a)), np.uint64(y), np.uint64(ctx.ptr(node)), np.uint64(fixup), np.uint64(0),
            np.uint64(0), np.int32(J), np.int32(K), np.int32(M), np.int32(N), np.int64(a.nb[1]), np.int32(nty),
            np.int32(ntx), np.int32(B2), np.int32(B2 // A2), np.int32(B3 // A3), np.int64(a.nb[2]),
            np.int64(a.nb[3]), *dst_strides, np.int64(total))
    launches: list[Launch] = [
        q8_1.plan_mmq(b, TRAITS[a.type][1], ctx, y),
        KernelLaunch(kernel(a.type, J), (nblocks, 1, 1), (WARP, NWARPS, 1), args, shared_bytes(J))]
    if fixup:
        launches.append(KernelLaunch(FIXUP_KERNEL, (nblocks, 1, 1), (NWARPS * WARP, 1, 1),
                                     (np.uint64(fixup), np.uint64(ctx.ptr(node)), np.uint64(0), np.uint64(0),
                                      np.int32(K), np.int32(J), np.int32(M), np.int32(N), np.int32(nty),
                                      np.int32(ntx), np.int32(B2), *dst_strides, np.int64(total))))
    return launches


# --- MUL_MAT_ID: grouped by expert -------------------------------------------------------------------
GROUP_KERNEL = Kernel("mmid.cu", "k_mmid_group")
GROUP_BLOCK = 256  # MMID_BLOCK
names(GROUP_KERNEL.source, [GROUP_KERNEL.name])


def supports_id(node: Tensor) -> bool:
    """A MUL_MAT_ID node MMQ computes grouped by expert: an MMQ type, whole blocks at every stride of
    the experts, a contiguous output (its columns are addressed as t * n_used + s), at most 65535
    (token, slot) pairs."""
    experts, b, ids = node.src
    return (experts.type in TRAITS and mmvq.block_aligned(experts) and node.is_contiguous()
            and b.has_contiguous_rows() and all(nb % 4 == 0 for nb in b.nb[1:])
            and ids.ne[0] * ids.ne[1] <= MAX_GRID_YZ and experts.ne[0] > 0)


def plan_id(node: Tensor, ctx: PlanContext) -> list[Launch]:
    """The grouping (ids to per-expert column lists, on the device), the grouped activations, one
    MMQ launch over (expert, column tile, row tile) tiles and the fixup when stream-K needs it.
    ggml's J choice sees the token count; an expert's tiles cover every pair (ids may repeat an
    expert within a token), the tiles past its columns are empty."""
    experts, b, ids = node.src
    K, M, E = experts.ne[:3]
    n_used, T = ids.ne[:2]
    P = n_used * T
    dev = ctx.device
    cc = arch.cc_int(dev.cc)
    J = best_j(experts.type, T, M % I != 0, cc, dev.smem_per_block_optin)
    nty, ntx = (M + I - 1) // I, (P + J - 1) // J
    ntiles = nty * ntx * E
    nblocks = stream_k_blocks(ntiles, dev.sm_count)
    total = ntiles * ((K + MMQ_ITER_K - 1) // MMQ_ITER_K)
    index = ctx.scratch(4 * (2 * P + E + 1))  # ids_src1 [P], ids_dst [P], bounds [E + 1]
    ids_src1, ids_dst, bounds = index, index + 4 * P, index + 8 * P
    y = ctx.scratch(P * q8_1.mmq_blocks_per_column(K) * q8_1.Q8_1_MMQ_BYTES)
    fixup = ctx.scratch(nblocks * I * J * 4) if ntiles % nblocks else 0
    group = KernelLaunch(GROUP_KERNEL, (1, 1, 1), (GROUP_BLOCK, 1, 1),
                         (np.uint64(ctx.ptr(ids)), np.uint64(ids_src1), np.uint64(ids_dst), np.uint64(bounds),
                          np.uint64(ctx.ptr(node)), np.int32(E), np.int32(n_used), np.int32(T), np.int32(b.ne[1]),
                          np.int32(M), np.int64(ids.nb[0]), np.int64(ids.nb[1]), np.int64(node.nb[1]),
                          np.int64(node.nb[2])))
    col = np.int64(node.nb[1] // 4)
    args = (np.uint64(ctx.ptr(experts)), np.uint64(y), np.uint64(ctx.ptr(node)), np.uint64(fixup),
            np.uint64(ids_dst), np.uint64(bounds), np.int32(J), np.int32(K), np.int32(M), np.int32(P),
            np.int64(experts.nb[1]), np.int32(nty), np.int32(ntx), np.int32(E), np.int32(1), np.int32(1),
            np.int64(experts.nb[2]), np.int64(0), col, np.int64(0), np.int64(0), np.int64(total))
    launches: list[Launch] = [
        group, q8_1.plan_mmq(b, TRAITS[experts.type][1], ctx, y, ids_src1, P),
        KernelLaunch(kernel(experts.type, J), (nblocks, 1, 1), (WARP, NWARPS, 1), args, shared_bytes(J))]
    if fixup:
        launches.append(KernelLaunch(FIXUP_KERNEL, (nblocks, 1, 1), (NWARPS * WARP, 1, 1),
                                     (np.uint64(fixup), np.uint64(ctx.ptr(node)), np.uint64(ids_dst),
                                      np.uint64(bounds), np.int32(K), np.int32(J), np.int32(M), np.int32(P),
                                      np.int32(nty), np.int32(ntx), np.int32(E), col, np.int64(0), np.int64(0),
                                      np.int64(total))))
    return launches
