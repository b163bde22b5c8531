"""FLASH_ATTN_EXT: `plan` is ggml_cuda_flash_attn_ext, the kernel ggml's choice maps to
(ops/fattn.py: vec and tile kernels in kernels/fattn.cu), and for what they do not take the
generic kernel k_flash_attn_ext in kernels/attention.cu: one block per (query row, head, batch),
online softmax in float over the keys in chunks (simple and correct).

q F32 [D, T, H, B]; k, v F16 or F32 [D, KV, Hkv, Bk] / [Dv, KV, Hkv, Bk] (head h reads kv head
h / (H / Hkv), batch b kv batch b / (B / Bk)); optional F16 mask [KV, >=T, Hm, Bm] (plane
(h % Hm, b % Bm)); out F32 [Dv, H, T, B]. Every operand goes by its byte strides, so permuted q/k/v
views (llama.cpp's layout) are taken as they are. Computed in float whatever `prec` says (ggml
rounds Q to F16 and may accumulate in F16: this is at least as precise). Heads wider than 256
(D or Dv) are declined.
"""
from __future__ import annotations

import numpy as np

from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType

from .. import arch
from ..driver import Kernel, KernelLaunch, Launch
from ..kernels import names
from . import PlanContext, fattn, register
from .fattn import alibi

SOURCE = "attention.cu"
BLOCK = 128  # FA_BLOCK
MAX_HEAD = 256  # FA_DMAX
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
INT_MAX = 2**31 - 1

_CTYPE = {GType.F16: "__half", GType.F32: "float"}
KV_TYPES = tuple(_CTYPE)


def kernel(k_type: GType, v_type: GType) -> Kernel:
    return Kernel(SOURCE, f"k_flash_attn_ext<{_CTYPE[k_type]}, {_CTYPE[v_type]}>")


names(SOURCE, [kernel(kt, vt).name for kt in KV_TYPES for vt in KV_TYPES])


def _aligned(t: Tensor) -> bool:
    size = t.type.type_size
    return t.has_contiguous_rows() and all(nb % size == 0 for nb in t.nb[1:]) and t.view_offs % size == 0


def supports(node: Tensor) -> bool:
    q, k, v = node.src[:3]
    mask = node.src[3] if len(node.src) > 3 else None
    if q.type is not GType.F32 or k.type not in KV_TYPES or v.type not in KV_TYPES or node.type is not GType.F32:
        return False
    if not all(_aligned(t) for t in (q, k, v, node)) or node.nb[0] != 4:
        return False
    if mask is not None and (mask.type is not GType.F16 or not _aligned(mask) or mask.ne[0] != k.ne[1]
                             or mask.ne[1] < q.ne[1] or mask.ne[2] == 0 or mask.ne[3] == 0):
        return False
    D, T, H, B = q.ne
    return (D <= MAX_HEAD and v.ne[0] <= MAX_HEAD and k.ne[0] == D
            and k.ne[2] > 0 and H % k.ne[2] == 0 and k.ne[3] > 0 and B % k.ne[3] == 0
            and T <= MAX_GRID_X and H <= MAX_GRID_YZ and B <= MAX_GRID_YZ and k.ne[1] <= INT_MAX)


def plan(node: Tensor, ctx: PlanContext) -> list[Launch]:
    """ggml_cuda_flash_attn_ext: the kernel ggml's choice maps to (ops/fattn.py), else the generic one."""
    if node.nelements and fattn.usable(node):
        kind = fattn.kernel_for(fattn.FattnShape.of(node), arch.cc_int(ctx.device.cc))
        if kind == fattn.VEC:
            return fattn.plan_vec(node, ctx)
        if kind == fattn.TILE:
            return fattn.plan_tile(node, ctx)
    return plan_generic(node, ctx)


def plan_generic(node: Tensor, ctx: PlanContext) -> list[Launch]:
    """One block per (query row, head, batch): any head size up to 256, F16 / F32 K and V."""
    q, k, v = node.src[:3]
    mask = node.src[3] if len(node.src) > 3 else None
    p = node.params
    D, T, H, B = q.ne
    if node.nelements == 0:
        return []
    m0, m1, n_head_log2 = alibi(H, p.max_bias)
    if mask is not None:
        m_ptr, m_ne2, m_ne3, m_nb = ctx.ptr(mask), mask.ne[2], mask.ne[3], mask.nb[1:]
    else:
        m_ptr, m_ne2, m_ne3, m_nb = 0, 1, 1, (0, 0, 0)
    i64 = np.int64
    args = (np.uint64(ctx.ptr(q)), np.uint64(ctx.ptr(k)), np.uint64(ctx.ptr(v)), np.uint64(m_ptr),
            np.uint64(ctx.ptr(node)),
            np.int32(D), np.int32(v.ne[0]), np.int32(k.ne[1]), np.int32(H // k.ne[2]), np.int32(B // k.ne[3]),
            np.int32(mask is not None), np.int32(m_ne2), np.int32(m_ne3),
            *(i64(x) for x in q.nb[1:]), *(i64(x) for x in k.nb[1:]), *(i64(x) for x in v.nb[1:]),
            *(i64(x) for x in m_nb), *(i64(x) for x in node.nb[1:]),
            np.float32(p.scale), np.float32(p.max_bias), np.float32(m0), np.float32(m1), np.int32(n_head_log2),
            np.float32(p.logit_softcap))
    return [KernelLaunch(kernel(k.type, v.type), (T, H, B), (BLOCK, 1, 1), args)]


register(Op.FLASH_ATTN_EXT, supports, plan)
