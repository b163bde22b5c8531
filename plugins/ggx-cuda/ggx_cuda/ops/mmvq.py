"""MMVQ, quantized weights times up to 8 columns (ggml-cuda's mmvq.cu), kernels in
kernels/quantize.cu (b to q8_1) and kernels/mmvq.cu (k_mul_mat_vec_q).

The rules are ggml's, as pure functions of the weight type, the compute capability (ggml's
integer encoding, ggx_cuda.arch) and the column count:

* `should_use_mmvq` — ggml_cuda_should_use_mmvq: a quantized type and at most
  MMVQ_MAX_BATCH_SIZE columns, fewer for K-quants on Ada Lovelace / Blackwell / DGX Spark.
* `nwarps`, `rows_per_block`, `use_small_k` — calc_nwarps, calc_rows_per_block and the
  should_use_small_k lambda of mul_mat_vec_q_switch_ncols_dst for NVIDIA's two tables (GENERIC;
  TURING for 7.5 <= cc < 8.0). GB10's halve_iters widening is not mirrored (GB10 runs GENERIC).

A planned node is two launches: b quantized into scratch, then one MMVQ launch of
grid (ceil(M / rows_per_block), B2, B3), block (32, nwarps).
"""
from __future__ import annotations

import numpy as np

from ggx.tensor import Tensor
from ggx.types import GType

from .. import arch
from ..driver import Kernel, KernelLaunch, Launch
from ..kernels import names
from . import PlanContext, q8_1

SOURCE = "mmvq.cu"
MMVQ_MAX_BATCH_SIZE = 8  # mmvq.cuh
WARP = 32
MAX_GRID_YZ = 65535
INT_MAX = 2**31 - 1

#: the per-type dot product of mmvq.cu, with ggml's qi (ints of quants per block) and vdr (ints
#: per thread) for each
TRAITS = {GType.Q4_0: ("mmvq_q4_0", 4, 2), GType.Q4_1: ("mmvq_q4_1", 4, 2), GType.Q5_0: ("mmvq_q5_0", 4, 2),
          GType.Q8_0: ("mmvq_q8_0", 8, 2), GType.Q4_K: ("mmvq_q4_K", 32, 2), GType.Q5_K: ("mmvq_q5_K", 32, 2),
          GType.Q6_K: ("mmvq_q6_K", 32, 1)}
TYPES = tuple(TRAITS)
_K_QUANTS = (GType.Q4_K, GType.Q5_K, GType.Q6_K)


# --- ggml's rules ---------------------------------------------------------------------------------
def should_use_mmvq(gtype: GType, cc: int, ne11: int) -> bool:
    """mmvq.cu ggml_cuda_should_use_mmvq (NVIDIA): batch sizes tuned per architecture."""
    if not gtype.is_quantized:
        return False
    if cc == arch.ADA_LOVELACE:  # tuned on RTX 4090
        return ne11 <= {GType.Q4_K: 7, GType.Q5_K: 7}.get(gtype, MMVQ_MAX_BATCH_SIZE)
    if cc == arch.BLACKWELL:  # tuned on RTX 5090
        return ne11 <= {GType.Q4_K: 5, GType.Q5_K: 5, GType.Q6_K: 7}.get(gtype, MMVQ_MAX_BATCH_SIZE)
    return ne11 <= MMVQ_MAX_BATCH_SIZE  # DGX Spark's only exception is Q2_K


#: get_mmvq_mmid_max_batch_pascal_older for ggx's types (Turing and later allow all 8 for them)
_MMID_MAX_PASCAL = {GType.Q4_0: 6, GType.Q4_1: 6, GType.Q5_0: 6, GType.Q8_0: 4, GType.Q4_K: 5, GType.Q5_K: 5,
                    GType.Q6_K: 4}


def mmid_max_batch(gtype: GType, cc: int) -> int:
    """mmvq.cu get_mmvq_mmid_max_batch (NVIDIA): the most tokens MUL_MAT_ID sends to MMVQ."""
    if cc == arch.VOLTA or cc >= arch.TURING:  # Volta, Ada and Blackwell: all; Turing+: not ggx's types
        return MMVQ_MAX_BATCH_SIZE
    return _MMID_MAX_PASCAL.get(gtype, MMVQ_MAX_BATCH_SIZE)


def _turing_table(cc: int) -> bool:
    """get_device_table_id: MMVQ_PARAMETERS_TURING for NVIDIA 7.5 <= cc < 8.0, else GENERIC."""
    return arch.TURING <= cc < arch.AMPERE


def nwarps(gtype: GType, ncols: int, cc: int) -> int:
    """calc_nwarps (small_k and halve_iters off: they change rows, not warps, here)."""
    if _turing_table(cc) and ncols == 1:
        return 2 if gtype in _K_QUANTS else 4
    return 4 if ncols <= 4 else 2 if ncols <= 8 else 1


def use_small_k(gtype: GType, ncols: int, cc: int, blocks_per_row: int) -> bool:
    """should_use_small_k (one column only): when the block's threads cover a row's blocks in one
    iteration, each warp takes a row of its own (none of ggx's types is on ggml's slow lists)."""
    _, qi, vdr = TRAITS[gtype]
    n = nwarps(gtype, ncols, cc)
    return ncols == 1 and n > 1 and blocks_per_row < n * (vdr * WARP // qi)


def rows_per_block(ncols: int, small_k: bool, n_warps: int) -> int:
    """calc_rows_per_block for NVIDIA's tables."""
    if ncols == 1:
        return n_warps if small_k else 1
    return 2 if ncols <= 8 else 1


def geometry(gtype: GType, ncols: int, cc: int, K: int) -> tuple[int, int]:
    """(nwarps, rows per block) of a launch over rows of K values."""
    n = nwarps(gtype, ncols, cc)
    return n, rows_per_block(ncols, use_small_k(gtype, ncols, cc, K // gtype.block_size), n)


def kernel(gtype: GType, ncols: int, n_warps: int, rpb: int) -> Kernel:
    return Kernel(SOURCE, f"k_mul_mat_vec_q<{TRAITS[gtype][0]}, {ncols}, {n_warps}, {rpb}>")


def instances() -> list[Kernel]:
    """Every kernel the rules can pick on a GPU with __dp4a (both tables, small_k on and off)."""
    out = {}
    for t in TYPES:
        for ncols in range(1, MMVQ_MAX_BATCH_SIZE + 1):
            for cc in (arch.TURING, arch.AMPERE):
                n = nwarps(t, ncols, cc)
                for small in ((False, True) if ncols == 1 else (False,)):
                    k = kernel(t, ncols, n, rows_per_block(ncols, small, n))
                    out[k.name] = k
    return list(out.values())


names(SOURCE, [k.name for k in instances()])


# --- support and plan ------------------------------------------------------------------------------
def block_aligned(t: Tensor) -> bool:
    """Whole blocks at every stride and at the view offset (the kernel reads blocks in place, 32 bits
    at a time)."""
    ts = t.type.type_size
    return t.has_contiguous_rows() and all(nb % ts == 0 for nb in t.nb[1:]) and t.view_offs % ts == 0


def supports(node: Tensor) -> bool:
    """A MUL_MAT node MMVQ computes exactly (its type and layout; the column count is the rule's)."""
    a, b = node.src
    return (a.type in TRAITS and block_aligned(a) and b.ne[0] == a.ne[0] > 0
            and b.ne[2] <= MAX_GRID_YZ and b.ne[3] <= MAX_GRID_YZ and a.ne[1] <= INT_MAX
            and a.ne[0] // a.type.block_size <= INT_MAX)


def plan(node: Tensor, ctx: PlanContext) -> list[Launch]:
    a, b = node.src
    K, M, A2, A3 = a.ne
    N, B2, B3 = b.ne[1:]
    cc = arch.cc_int(ctx.device.cc)
    y = ctx.scratch(q8_1.q8_1_bytes(b))
    n_warps, rpb = geometry(a.type, N, cc, K)
    bpr_y = K // q8_1.QK8_1
    args = (np.uint64(ctx.ptr(a)), np.uint64(y), np.uint64(ctx.ptr(node)),
            np.int32(K // a.type.block_size), np.int32(M), np.int32(a.type.type_size), np.int64(a.nb[1]),
            np.int64(bpr_y), np.int64(node.nb[1] // 4),
            np.int32(B2 // A2), np.int64(a.nb[2]), np.int64(N * bpr_y), np.int64(node.nb[2] // 4),
            np.int32(B3 // A3), np.int64(a.nb[3]), np.int64(B2 * N * bpr_y), np.int64(node.nb[3] // 4))
    grid = ((M + rpb - 1) // rpb, B2, B3)
    return [q8_1.plan_q8_1(b, ctx, y),
            KernelLaunch(kernel(a.type, N, n_warps, rpb), grid, (WARP, n_warps, 1), args)]
