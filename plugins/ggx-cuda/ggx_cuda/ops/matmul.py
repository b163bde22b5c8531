"""MUL_MAT and MUL_MAT_ID (ggml-cuda's ggml_cuda_mul_mat dispatch, its cuBLAS fallback and a
simple MUL_MAT_ID), kernels in kernels/dequant.cu.

`mul_mat_path` is ggml_cuda_mul_mat's order: MMVQ (ops/mmvq.py) for quantized weights when
ggml_cuda_should_use_mmvq says so, else MMQ (ops/mmq.py) when ggml_cuda_should_use_mmq does, else
the cuBLAS path below.

MUL_MAT out[m, n, i2, i3] = sum_k a[k, m, i2 / r2, i3 / r3] * b[k, n, i2, i3] (r2 = B2 / A2,
r3 = B3 / A3) goes to cuBLAS as C = A^T B per plane, A = a's rows (column-major [k, m], lda =
a.nb1 / element size), B = b's rows ([k, n], ldb), C = out's rows ([m, n], ldc = M):

* a F32: a and b in place, cublasSgemm-like (F32 in, F32 compute).
* a F16 / BF16: a in place; b converted to a's half type in scratch (k_mm_convert), as ggml-cuda
  does (to_fp16 / to_bf16 of src1), F32 accumulation (CUBLAS_COMPUTE_32F, where ggml-cuda's
  F16 path uses F16 compute: this is at least as precise). Before compute capability 8.0
  (no BF16 cuBLAS) a BF16 a is converted to F32 instead and b stays F32.
* a quantized (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K): a dequantized to F16 in scratch (ggml-cuda's
  to_fp16 fallback), then as F16.

A float operand whose strides cuBLAS cannot take (a leading dimension shorter than the row, a
stride that is not a whole number of elements) is first copied contiguously into scratch.

The planes (i2, i3) become as few cuBLAS calls as the strides allow: the r2 (r3) b planes that
share one a plane join the columns of one product when they follow each other in memory (b and
out contiguous there), else they are a batch with A's stride 0; dims that follow each other with
consistent strides fold into one strided batch; what is left is one GemmLaunch per plane group.

MUL_MAT_ID reads the expert ids on the device (no host sync): above ggml's MMVQ token count, MMQ
grouped by expert (ops/mmq.py, `mul_mat_id_path`); else k_mm_id computes out[:, e, t] directly,
one warp per output row and per (slot e, token t), the expert's row dequantized on the fly, in
float (correct, not fast). An id outside 0..n_expert-1 (which the reference refuses) gives NaN.
"""
from __future__ import annotations

import numpy as np

from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType

from .. import arch
from ..driver import DeviceInfo, GemmLaunch, Kernel, KernelLaunch, Launch
from ..kernels import names
from . import PlanContext, mmq, mmvq, register

SOURCE = "dequant.cu"

#: the traits struct of each storage type in dequant.cu
TRAITS = {
    GType.F32: "mm_f32", GType.F16: "mm_f16", GType.BF16: "mm_bf16",
    GType.Q4_0: "mm_q4_0", GType.Q4_1: "mm_q4_1", GType.Q5_0: "mm_q5_0", GType.Q8_0: "mm_q8_0",
    GType.Q4_K: "mm_q4_K", GType.Q5_K: "mm_q5_K", GType.Q6_K: "mm_q6_K",
}
WEIGHT_TYPES = tuple(TRAITS)
FLOAT_TYPES = (GType.F32, GType.F16, GType.BF16)
QUANT_TYPES = tuple(t for t in WEIGHT_TYPES if t.is_quantized)

#: the type cuBLAS reads a's values in: quantized weights are dequantized to F16 (ggml-cuda's
#: fallback on hardware with fast F16)
GEMM_TYPE = {**{t: t for t in FLOAT_TYPES}, **{t: GType.F16 for t in QUANT_TYPES}}
BF16_GEMM_CC = (8, 0)  # cuBLAS's BF16 products need Ampere; before it BF16 weights go as F32
_CUBLAS = {GType.F32: "f32", GType.F16: "f16", GType.BF16: "bf16"}
_CTYPE = {GType.F32: "float", GType.F16: "__half", GType.BF16: "__nv_bfloat16"}

CVT_BLOCK = 256  # MM_CVT_BLOCK
ID_WARPS = 4  # MM_ID_WARPS
WARP = 32
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
INT_MAX = 2**31 - 1
ALIGN = 256  # scratch sub-buffer alignment


def gemm_type(a_type: GType, cc: tuple[int, int]) -> GType:
    """The type cuBLAS reads a (and b) in on a device of compute capability cc."""
    if a_type is GType.BF16 and tuple(cc) < BF16_GEMM_CC:
        return GType.F32
    return GEMM_TYPE[a_type]


def convert_kernel(src: GType, dst: GType) -> Kernel:
    return Kernel(SOURCE, f"k_mm_convert<{TRAITS[src]}, {_CTYPE[dst]}>")


def id_kernel(t: GType) -> Kernel:
    return Kernel(SOURCE, f"k_mm_id<{TRAITS[t]}>")


ZERO_KERNEL = Kernel(SOURCE, "k_mm_zero")

#: every (source, destination) pair the planners convert: weights to their gemm type (a copy for
#: floats with odd strides), activations to each gemm type
CONVERSIONS = sorted({(t, GEMM_TYPE[t]) for t in WEIGHT_TYPES} | {(GType.F32, g) for g in FLOAT_TYPES}
                     | {(GType.BF16, GType.F32)},
                     key=lambda p: (p[0].name, p[1].name))
names(SOURCE, [convert_kernel(s, d).name for s, d in CONVERSIONS] + [ZERO_KERNEL.name]
      + [id_kernel(t).name for t in WEIGHT_TYPES])


# --- support -----------------------------------------------------------------------------------
def _aligned(t: Tensor, size: int) -> bool:
    """Every stride and the view offset are whole elements of `size` bytes (aligned loads)."""
    return all(nb % size == 0 for nb in t.nb[1:]) and t.view_offs % size == 0


def _rows_ok(t: Tensor) -> bool:
    return t.has_contiguous_rows() and _aligned(t, 2 if t.type.is_quantized else t.type.type_size)


def supports_mul_mat(node: Tensor) -> bool:
    a, b = node.src
    return (a.type in WEIGHT_TYPES and b.type is GType.F32 and node.type is GType.F32
            and node.is_contiguous() and _rows_ok(a) and _rows_ok(b)
            and a.ne[0] == b.ne[0] and a.ne[2] > 0 and a.ne[3] > 0
            and b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0
            and max(a.ne + b.ne) <= INT_MAX)


def supports_mul_mat_id(node: Tensor) -> bool:
    experts, b, ids = node.src
    return (experts.type in WEIGHT_TYPES and b.type is GType.F32 and ids.type is GType.I32
            and node.type is GType.F32 and node.nb[0] == 4 and _aligned(node, 4)
            and _rows_ok(experts) and _rows_ok(b) and _aligned(ids, 4) and ids.view_offs % 4 == 0
            and experts.ne[0] == b.ne[0] and experts.ne[3] == b.ne[3] == 1
            and ids.ne[1] == b.ne[2] and b.ne[1] >= 1
            and max(experts.ne[0], experts.ne[1], experts.ne[2], ids.ne[0], ids.ne[1]) <= INT_MAX)


# --- MUL_MAT -----------------------------------------------------------------------------------
def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _convert(src: Tensor, dst_type: GType, src_ptr: int, dst_ptr: int) -> KernelLaunch:
    """src (any strides, contiguous rows) -> contiguous dst_type values at dst_ptr."""
    ne0, ne1, ne2, ne3 = src.ne
    nrows = ne1 * ne2 * ne3
    nblocks = nrows * ((ne0 + CVT_BLOCK - 1) // CVT_BLOCK)
    return KernelLaunch(convert_kernel(src.type, dst_type), (max(1, min(nblocks, MAX_GRID_X)), 1, 1),
                        (CVT_BLOCK, 1, 1),
                        (np.uint64(src_ptr), np.uint64(dst_ptr), np.int32(ne0), np.int32(ne1), np.int32(ne2),
                         np.int64(nrows), np.int64(src.nb[1]), np.int64(src.nb[2]), np.int64(src.nb[3])))


def _in_place(t: Tensor, gemm_type: GType) -> bool:
    """Can cuBLAS read t's values where they are (t already of the gemm type, strides it takes)?"""
    if t.type is not gemm_type:
        return False
    es = t.type.type_size
    if not _aligned(t, es):
        return False
    ld = t.nb[1] // es
    return (ld >= t.ne[0] or t.ne[1] == 1) and ld <= INT_MAX


def gemm_launches(a: int, b: int, c: int, m: int, n: int, k: int, lda: int, ldb: int, ldc: int,
                  planes: tuple[tuple[int, int, int, int, int], ...], a_dtype: str, b_dtype: str) -> list[GemmLaunch]:
    """The cuBLAS calls computing every plane of C = A^T B. `planes` are dims 2 and 3, each as
    (count of a planes, broadcast ratio r, A stride, B stride, C stride), strides in elements of
    each operand; b plane i uses a plane i // r."""
    if m == 1:  # a single row of A^T (column of A): its leading dimension is free (at least k)
        lda = max(lda, k)
    if n == 1:  # a single column: the leading dimensions are free (at least k / m)
        ldb, ldc = max(ldb, k), max(ldc, m)
    # batch axes, inner to outer: [count, sa, sb, sc]; a broadcast dim splits into the r b planes
    # sharing an a plane (A stride 0) and the a planes
    axes = []
    for count, r, sa, sb, sc in planes:
        axes += [[r, 0, sb, sc], [count, sa, r * sb, r * sc]]
    axes = [x for x in axes if x[0] > 1]
    # b planes that share their a plane and follow each other in b and C join the columns
    i = 0
    while i < len(axes):
        cnt, sa, sb, sc = axes[i]
        if sa != 0 or n * cnt > INT_MAX:
            i += 1
            continue
        if n == 1 and k <= sb <= INT_MAX and m <= sc <= INT_MAX:
            ldb, ldc = sb, sc
        elif not (sb == n * ldb and sc == n * ldc):
            i += 1
            continue
        n *= cnt
        del axes[i]
    # consecutive axes with consistent strides fold into one
    i = 0
    while i + 1 < len(axes):
        inner, outer = axes[i], axes[i + 1]
        if all(outer[s] == inner[0] * inner[s] for s in (1, 2, 3)):
            axes[i] = [inner[0] * outer[0]] + inner[1:]
            del axes[i + 1]
        else:
            i += 1
    batch = max(axes, key=lambda x: x[0]) if axes else [1, 0, 0, 0]
    loops = [x for x in axes if x is not batch]
    offsets = [(0, 0, 0)]
    for cnt, sa, sb, sc in loops:
        offsets = [(oa + j * sa, ob + j * sb, oc + j * sc) for oa, ob, oc in offsets for j in range(cnt)]
    a_es, b_es = (4 if d == "f32" else 2 for d in (a_dtype, b_dtype))
    return [GemmLaunch(a + oa * a_es, b + ob * b_es, c + oc * 4, m, n, k, lda, ldb, ldc, a_dtype, b_dtype,
                       batch[0], batch[1], batch[2], batch[3]) for oa, ob, oc in offsets]


def mul_mat_path(node: Tensor, device: DeviceInfo) -> str:
    """ggml_cuda_mul_mat's choice for a supported node: "mmvq" (quantized weights, few columns),
    "mmq" (quantized weights, more columns), or "cublas", the fallback for what the integer
    kernels do not take."""
    a, b = node.src
    if node.nelements == 0 or a.ne[0] == 0:
        return "cublas"
    cc = arch.cc_int(device.cc)
    if cc < arch.DP4A:  # ggx's integer kernels use __dp4a (ggml's has a slow fallback before 6.1)
        return "cublas"
    if mmvq.supports(node) and mmvq.should_use_mmvq(a.type, cc, b.ne[1]):
        return "mmvq"
    if (mmq.supports(node) and mmq.should_use_mmq(a.type, cc, b.ne[1], 0, device.smem_per_block_optin)
            and mmq.best_j(a.type, b.ne[1], a.ne[1] % mmq.I != 0, cc, device.smem_per_block_optin)):
        return "mmq"
    return "cublas"


def plan_mul_mat(node: Tensor, ctx: PlanContext) -> list[Launch]:
    path = mul_mat_path(node, ctx.device)
    if path == "mmvq":
        return mmvq.plan(node, ctx)
    if path == "mmq":
        return mmq.plan(node, ctx)
    return plan_cublas(node, ctx)


def plan_cublas(node: Tensor, ctx: PlanContext) -> list[Launch]:
    """Weights (converted to their gemm type where needed) and activations through cuBLAS."""
    a, b = node.src
    K, M, A2, A3 = a.ne
    N, B2, B3 = b.ne[1:]
    if node.nelements == 0:
        return []
    c = ctx.ptr(node)
    if K == 0:  # an empty sum
        n = node.nelements
        return [KernelLaunch(ZERO_KERNEL, (min((n + CVT_BLOCK - 1) // CVT_BLOCK, MAX_GRID_X), 1, 1),
                             (CVT_BLOCK, 1, 1), (np.uint64(c), np.int64(n)))]
    gt = gemm_type(a.type, ctx.device.cc)
    es = gt.type_size
    launches: list[Launch] = []
    a_copy, b_copy = not _in_place(a, gt), not _in_place(b, gt)
    a_bytes = _round_up(a.nelements * es, ALIGN) if a_copy else 0
    b_bytes = b.nelements * es if b_copy else 0
    scratch = ctx.scratch(a_bytes + b_bytes) if a_copy or b_copy else 0
    if a_copy:
        a_ptr = scratch
        launches.append(_convert(a, gt, ctx.ptr(a), a_ptr))
        sa = (K, K * M, K * M * A2)
    else:
        a_ptr = ctx.ptr(a)
        sa = tuple(nb // es for nb in a.nb[1:])
    if b_copy:
        b_ptr = scratch + a_bytes
        launches.append(_convert(b, gt, ctx.ptr(b), b_ptr))
        sb = (K, K * N, K * N * B2)
    else:
        b_ptr = ctx.ptr(b)
        sb = tuple(nb // es for nb in b.nb[1:])
    sc = tuple(nb // 4 for nb in node.nb[1:])
    planes = ((A2, B2 // A2, sa[1], sb[1], sc[1]), (A3, B3 // A3, sa[2], sb[2], sc[2]))
    dt = _CUBLAS[gt]
    launches += gemm_launches(a_ptr, b_ptr, c, M, N, K, sa[0], sb[0], sc[0], planes, dt, dt)
    return launches


# --- MUL_MAT_ID --------------------------------------------------------------------------------
def mul_mat_id_path(node: Tensor, device: DeviceInfo) -> str:
    """ggml_cuda_mul_mat_id's choice: up to get_mmvq_mmid_max_batch tokens ggml runs MMVQ with ids,
    ggx its simple kernel ("simple"); above, MMQ grouped by expert where should_use_mmq ("mmq");
    else ggml sorts on the host (a sync), ggx runs the simple kernel."""
    experts, b, ids = node.src
    cc = arch.cc_int(device.cc)
    T = ids.ne[1]
    if node.nelements == 0 or cc < arch.DP4A or not experts.type.is_quantized:
        return "simple"
    if T <= mmvq.MMVQ_MAX_BATCH_SIZE and T <= mmvq.mmid_max_batch(experts.type, cc):
        return "simple"
    if (mmq.supports_id(node) and mmq.should_use_mmq(experts.type, cc, T, experts.ne[2], device.smem_per_block_optin)
            and mmq.best_j(experts.type, T, experts.ne[1] % mmq.I != 0, cc, device.smem_per_block_optin)):
        return "mmq"
    return "simple"


def plan_mul_mat_id(node: Tensor, ctx: PlanContext) -> list[Launch]:
    if mul_mat_id_path(node, ctx.device) == "mmq":
        return mmq.plan_id(node, ctx)
    return plan_mm_id_simple(node, ctx)


def plan_mm_id_simple(node: Tensor, ctx: PlanContext) -> list[Launch]:
    """One warp per output row and (slot, token), the expert's row dequantized on the fly."""
    experts, b, ids = node.src
    K, M, n_expert = experts.ne[:3]
    n_used, n_tokens = ids.ne[:2]
    if node.nelements == 0:
        return []
    grid = ((M + ID_WARPS - 1) // ID_WARPS, min(n_used, MAX_GRID_YZ), min(n_tokens, MAX_GRID_YZ))
    args = (np.uint64(ctx.ptr(experts)), np.uint64(ctx.ptr(b)), np.uint64(ctx.ptr(ids)), np.uint64(ctx.ptr(node)),
            np.int32(K), np.int32(M), np.int32(n_expert), np.int32(n_used), np.int32(n_tokens), np.int32(b.ne[1]),
            np.int64(experts.nb[1]), np.int64(experts.nb[2]), np.int64(b.nb[1]), np.int64(b.nb[2]),
            np.int64(ids.nb[0]), np.int64(ids.nb[1]), np.int64(node.nb[1]), np.int64(node.nb[2]))
    return [KernelLaunch(id_kernel(experts.type), grid, (ID_WARPS * WARP, 1, 1), args)]


register(Op.MUL_MAT, supports_mul_mat, plan_mul_mat)
register(Op.MUL_MAT_ID, supports_mul_mat_id, plan_mul_mat_id)
