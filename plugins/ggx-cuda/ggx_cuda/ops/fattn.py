"""Flash attention's kernel choice and its vec / tile launches (ggml-cuda's fattn.cu,
fattn-common.cuh's launch_fattn), kernels in kernels/fattn.cu.

`best_fattn_kernel(shape, cc)` is ggml_cuda_get_best_fattn_kernel as a pure function of the
node's shape (head sizes, GQA ratio, query rows, sequences, KV length, K/V types, mask, ALiBi,
16-byte strides) and the compute capability: "vec", "tile", "mma_f16" or "none". ggx has no
tensor-core attention kernel: where ggml picks MMA_F16, ggx runs its tile kernel; where ggml has
none (NONE: head sizes, per-head masks, K/V of different types, ...) or ggx's vec / tile kernels
do not read the K/V type (they read F16), the generic kernel of part 1 (ops/attention.py)
computes the node. `kernel_for` is that map.

The vec kernel's parallel blocks over the KV length follow launch_fattn (its non-stream-K path):
start from the blocks one SM holds, at most ceil(KV / D), and take more while that raises the
efficiency of the last wave (stop once 95 % is reached and more waves would be needed). ggml asks
the driver for the occupancy (cudaOccupancyMaxActiveBlocksPerMultiprocessor); ggx plans without a
device and assumes VEC_BLOCKS_PER_SM, the occupancy of 128 threads at 128 registers each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggx.tensor import Tensor
from ggx.types import GType

from .. import arch
from ..driver import Kernel, KernelLaunch, Launch
from ..kernels import names
from . import PlanContext

SOURCE = "fattn.cu"
FATTN_KQ_STRIDE = 256  # fattn-common.cuh: ggml pads the KV cache to it
VEC, TILE, MMA_F16, NONE = "vec", "tile", "mma_f16", "none"
VEC_THREADS, TILE_THREADS, TILE_NCOLS = 128, 256, 16  # FA_VEC_THREADS, FA_TILE_THREADS, FA_TILE_NCOLS
VEC_BLOCKS_PER_SM = 4
MAX_GRID_YZ = 65535

#: ggml_cuda_fattn_kv_type_supported without GGML_CUDA_FA_ALL_QUANTS
GGML_KV_TYPES = (GType.F32, GType.F16, GType.Q4_0, GType.Q8_0, GType.BF16)
#: what ggx's vec and tile kernels read (F16, the KV cache's type; F32 K/V run the generic kernel:
#: fewer instantiations to compile)
KV_TYPES = {GType.F16: "__half"}
VEC_HEADS = (64, 128, 256)
TILE_HEADS = (40, 64, 72, 80, 96, 112, 128, 256)


@dataclass(frozen=True)
class FattnShape:
    """What ggml_cuda_get_best_fattn_kernel reads of a FLASH_ATTN_EXT node."""

    head: int  # Q->ne[0] == K->ne[0]
    head_v: int  # V->ne[0]
    n_q: int  # Q->ne[1]: query rows
    n_head: int  # Q->ne[2]
    n_seq: int  # Q->ne[3]
    n_kv: int  # K->ne[1]
    n_head_kv: int  # K->ne[2]
    k_type: GType
    v_type: GType
    mask: bool
    mask_heads: int = 1  # mask->ne[2]
    max_bias: float = 0.0
    aligned16: bool = True  # every nb[1..3] of Q, K, V and the mask a multiple of 16 bytes

    @property
    def gqa_ratio(self) -> int:
        return self.n_head // self.n_head_kv

    @classmethod
    def of(cls, node: Tensor) -> FattnShape:
        q, k, v = node.src[:3]
        mask = node.src[3] if len(node.src) > 3 else None
        operands = [t for t in (q, k, v, mask) if t is not None and not t.type.is_quantized]
        return cls(q.ne[0], v.ne[0], q.ne[1], q.ne[2], q.ne[3], k.ne[1], k.ne[2], k.type, v.type, mask is not None,
                   mask.ne[2] if mask is not None else 1, node.params.max_bias,
                   all(nb % 16 == 0 for t in operands for nb in t.nb[1:]))


def best_fattn_kernel(s: FattnShape, cc: int) -> str:
    """fattn.cu ggml_cuda_get_best_fattn_kernel for NVIDIA (the AMD branches left out)."""
    gqa = s.gqa_ratio
    gqa_opt = gqa >= 2 and s.mask and s.max_bias == 0.0 and s.n_kv % FATTN_KQ_STRIDE == 0 and s.aligned16
    if s.head in (40, 64, 72, 80, 96, 112, 128, 256):
        if s.head_v != s.head:
            return NONE
    elif s.head == 192:
        if s.head_v != 128 or not gqa_opt or gqa % 8 != 0:
            return NONE
    elif s.head == 320:
        if s.head_v != 256 or not gqa_opt or gqa % 32 != 0:
            return NONE
    elif s.head == 512:
        if s.head_v != s.head or not gqa_opt:
            return NONE
    elif s.head == 576:
        if s.head_v != 512 or not gqa_opt:
            return NONE
    else:
        return NONE
    if s.k_type is not s.v_type:  # without GGML_CUDA_FA_ALL_QUANTS
        return NONE
    if s.k_type not in GGML_KV_TYPES or s.v_type not in GGML_KV_TYPES:
        return NONE
    if s.mask and s.mask_heads != 1:
        return NONE
    quantized = s.k_type.is_quantized or s.v_type.is_quantized
    can_use_vec = s.head <= 256 and s.head % 64 == 0 and s.head != 192 and s.n_kv % FATTN_KQ_STRIDE == 0

    if arch.turing_mma_available(cc) and s.head not in (40, 72):
        if can_use_vec:
            if not quantized:
                if cc >= arch.ADA_LOVELACE and s.n_q == 1 and s.n_seq == 1 and not (gqa > 4 and s.n_kv >= 8192):
                    return VEC
            elif s.n_q <= (2 if cc >= arch.ADA_LOVELACE else 1):
                return VEC
            if not gqa_opt and s.n_q == 1:
                return VEC
        return MMA_F16

    ncols2_max = 32 if s.head == 320 else 16 if s.head in (576, 192) else 8
    gqa_eff = 1
    while gqa % (2 * gqa_eff) == 0 and gqa_eff < ncols2_max:
        gqa_eff *= 2
    if arch.volta_mma_available(cc) and s.head not in (40, 72):
        if can_use_vec and s.n_q * gqa_eff <= 2:
            return VEC
        return TILE if s.n_q * gqa_eff <= 16 else MMA_F16  # Volta's tensor cores pay off only for large tiles
    if can_use_vec:
        if not quantized:
            if s.n_q == 1 and not gqa_opt:
                return VEC
        elif s.n_q <= 2:
            return VEC
    return TILE


def kernel_for(s: FattnShape, cc: int) -> str:
    """The ggx kernel computing a node: "vec", "tile" (ggml's TILE and MMA_F16) or "generic"."""
    choice = best_fattn_kernel(s, cc)
    ours = s.k_type in KV_TYPES and s.v_type is s.k_type and s.head == s.head_v
    if choice == VEC and ours and s.head in VEC_HEADS:
        return VEC
    if choice in (TILE, MMA_F16) and ours and s.head in TILE_HEADS:
        return TILE
    return "generic"


def vec_kernel(head: int, ncols: int, kv_type: GType) -> Kernel:
    return Kernel(SOURCE, f"k_fattn_vec<{head}, {ncols}, {KV_TYPES[kv_type]}>")


def tile_kernel(head: int, kv_type: GType) -> Kernel:
    return Kernel(SOURCE, f"k_fattn_tile<{head}, {KV_TYPES[kv_type]}>")


COMBINE_KERNEL = Kernel(SOURCE, "k_fattn_combine")
names(SOURCE, [vec_kernel(d, n, t).name for d in VEC_HEADS for n in (1, 2) for t in KV_TYPES]
      + [tile_kernel(d, t).name for d in TILE_HEADS for t in KV_TYPES] + [COMBINE_KERNEL.name])


def parallel_blocks(ntiles_dst: int, n_kv: int, nbatch_fa: int, blocks_per_sm: int, nsm: int) -> int:
    """launch_fattn's parallel_blocks (the non-stream-K path): KV-split blocks per output tile."""
    ntiles_kv = max(1, (n_kv + nbatch_fa - 1) // nbatch_fa)  # at least one: KV = 0 computes zeros
    best = min(blocks_per_sm, ntiles_kv)
    blocks_per_wave = nsm * blocks_per_sm
    nwaves_best = efficiency_best = 0
    for test in range(best, ntiles_kv + 1):
        total = ntiles_dst * test
        nwaves = (total + blocks_per_wave - 1) // blocks_per_wave
        efficiency = 100 * total // (nwaves * blocks_per_wave)
        if efficiency_best >= 95 and nwaves > nwaves_best:
            break
        if efficiency > efficiency_best:
            nwaves_best, efficiency_best, best = nwaves, efficiency, test
    return best


# --- launches --------------------------------------------------------------------------------------
def usable(node: Tensor) -> bool:
    """The layout the vec and tile kernels need beyond the generic kernel's: an output they write
    as contiguous rows, at most 65535 (head, sequence) pairs."""
    q = node.src[0]
    return node.is_contiguous() and q.ne[2] * q.ne[3] <= MAX_GRID_YZ


def alibi(n_head: int, max_bias: float) -> tuple[float, float, int]:
    """(m0, m1, n_head_log2) of ggml's ALiBi slopes (unused when max_bias <= 0)."""
    if max_bias <= 0.0 or n_head == 0:
        return 1.0, 1.0, 0
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    return 2.0 ** (-max_bias / n_head_log2), 2.0 ** (-max_bias / 2.0 / n_head_log2), n_head_log2


def _args(node: Tensor, ctx: PlanContext, dst: int, parts: int, meta: int) -> tuple:
    q, k, v = node.src[:3]
    mask = node.src[3] if len(node.src) > 3 else None
    p = node.params
    m0, m1, n_head_log2 = alibi(q.ne[2], p.max_bias)
    scale = p.scale / p.logit_softcap if p.logit_softcap != 0.0 else p.scale
    m_ptr, m_ne3, m_nb1, m_nb3 = (0, 1, 0, 0) if mask is None else (ctx.ptr(mask), mask.ne[3], mask.nb[1], mask.nb[3])
    i64 = np.int64
    pointers = (ctx.ptr(q), ctx.ptr(k), ctx.ptr(v), m_ptr, dst) + ((parts, meta) if parts >= 0 else ())
    return (*(np.uint64(x) for x in pointers),
            np.int32(q.ne[1]), np.int32(q.ne[2]), np.int32(k.ne[1]), np.int32(q.ne[2] // k.ne[2]),
            np.int32(q.ne[3] // k.ne[3]), np.int32(m_ne3),
            *(i64(x) for x in q.nb[1:]), *(i64(x) for x in k.nb[1:]), *(i64(x) for x in v.nb[1:]),
            i64(m_nb1), i64(m_nb3), np.float32(scale), np.float32(p.max_bias), np.float32(m0), np.float32(m1),
            np.int32(n_head_log2), np.float32(p.logit_softcap))


def plan_vec(node: Tensor, ctx: PlanContext) -> list[Launch]:
    q, k = node.src[:2]
    D, T, H, B = q.ne
    ncols = 1 if T == 1 else 2  # ggml_cuda_flash_attn_ext_vec_case: cols_per_block
    ntiles = (T + ncols - 1) // ncols
    P = parallel_blocks(ntiles * H * B, k.ne[1], D, VEC_BLOCKS_PER_SM, ctx.device.sm_count)
    parts = meta = 0
    if P > 1:
        rows = T * H * B
        parts = ctx.scratch(P * rows * D * 4 + P * rows * 8)
        meta = parts + P * rows * D * 4
    launches: list[Launch] = [KernelLaunch(vec_kernel(D, ncols, k.type), (ntiles, P, H * B), (VEC_THREADS, 1, 1),
                                           _args(node, ctx, ctx.ptr(node), parts, meta))]
    if P > 1:
        launches.append(KernelLaunch(COMBINE_KERNEL, (T, H, B), (VEC_THREADS, 1, 1),
                                     (np.uint64(parts), np.uint64(meta), np.uint64(ctx.ptr(node)), np.int32(D),
                                      np.int32(P))))
    return launches


def plan_tile(node: Tensor, ctx: PlanContext) -> list[Launch]:
    q, k = node.src[:2]
    D, T, H, B = q.ne
    grid = ((T + TILE_NCOLS - 1) // TILE_NCOLS, H * B, 1)
    return [KernelLaunch(tile_kernel(D, k.type), grid, (TILE_THREADS, 1, 1), _args(node, ctx, ctx.ptr(node), -1, -1))]
