"""What the MUL_MAT / MUL_MAT_ID kernels of an extra buffer type share (CPU_REPACK, AMX): the
checks of the node around the weight (`matmul_problem`) and MUL_MAT_ID's columns grouped by
expert (`expert_columns`, ggml's mmid row mapping); and, with ggx-cpu's own MUL_MAT_ID, one
token's MUL_MAT_ID bound once (`token_experts`)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ggx.backend import BufferType, Launch
from ggx.errors import GGXShapeError
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType

from ..launch import in_order, launch
from .common import elems, index_check


def _buft_of(t: Tensor) -> BufferType | None:
    buf = t.data_buffer
    return buf.buft if buf is not None else None


def matmul_problem(op: Tensor, buft: BufferType) -> str | None:
    """Why `op` is not a MUL_MAT / MUL_MAT_ID that a kernel of `buft` can compute from host memory
    (None: it is): its weight (not a view, contiguous; 2-D for MUL_MAT) in `buft`, F32 activations
    with contiguous rows of K, every other source in host memory, I32 ids [n_used, n_tokens], an
    F32 destination of the op's shape. The weight's type and layout are the buffer type's to judge."""
    if op.op not in (Op.MUL_MAT, Op.MUL_MAT_ID):
        return f"{op.op.name} is not a matmul ({buft.name} computes MUL_MAT and MUL_MAT_ID only)"
    if len(op.src) < (3 if op.op is Op.MUL_MAT_ID else 2):
        return f"{op.describe()} lacks sources"
    a, b = op.src[0], op.src[1]
    if _buft_of(a) is not buft:
        return f"weight {a.describe()} is not in {buft.name}"
    if a.view_src is not None or not a.is_contiguous():
        return f"weight {a.describe()} is a view or not contiguous"
    if op.op is Op.MUL_MAT and (a.ne[2] != 1 or a.ne[3] != 1):
        return f"MUL_MAT weight {a.describe()} is not 2-D"
    if b.type is not GType.F32 or a.ne[0] != b.ne[0] or not b.has_contiguous_rows():
        return f"activations {b.describe()} must be F32 with contiguous rows of K={a.ne[0]}"
    for s in op.src[1:]:
        sb = _buft_of(s) if s is not None else None
        if sb is not None and not sb.is_host:
            return f"{s.describe()} is not in host memory ({sb.name})"
    if op.type is not GType.F32:
        return f"destination {op.describe()} must be F32"
    if op.op is Op.MUL_MAT_ID:
        ids = op.src[2]
        if ids.type is not GType.I32 or ids.ne[2] != 1 or ids.ne[3] != 1 or b.ne[3] != 1:
            return f"MUL_MAT_ID ids {ids.describe()} / b {b.describe()} have unexpected shapes"
        want = (a.ne[1], ids.ne[0], ids.ne[1], 1)
    else:
        want = (a.ne[1], b.ne[1], b.ne[2], b.ne[3])
    if tuple(op.ne) != want:  # the kernel writes exactly this many rows of M
        return f"destination {op.describe()} should be {list(want)}"
    return None


class ExpertColumns(NamedTuple):
    """The columns of a MUL_MAT_ID, expert by expert.

    used: the experts used, ascending; expert used[g] multiplies columns cstart[g]..cstart[g + 1].
    Column c reads activation row ycol[c] (b's rows in order: token t's row j at t * b_ne1 + j)
    and writes output row slot[c] (slot s = t * n_used + e, ids[e, t]'s result). All int64.
    """

    used: np.ndarray
    cstart: np.ndarray
    ycol: np.ndarray
    slot: np.ndarray


def expert_columns(experts: np.ndarray, n_expert: int, b_ne1: int, what: str = "mul_mat_id") -> ExpertColumns:
    """Group the slots of `experts` (the ids as [n_tokens, n_used] in numpy order) by expert,
    keeping slot order within an expert (a stable sort); GGXShapeError naming the first id that
    is not an expert 0..n_expert-1, before any kernel runs. b_ne1 is b's ne[1] (1: every used
    expert of a token reads its one row; n_used: expert slot e reads row e)."""
    n_used = experts.shape[1]
    bad = (experts < 0) | (experts >= n_expert)
    if bad.any():
        t, e = np.argwhere(bad)[0]
        raise GGXShapeError(f"{what}: ids[{e}, {t}] = {experts[t, e]} is not an expert (0..{n_expert - 1})")
    flat = experts.reshape(-1)
    slot = np.argsort(flat, kind="stable").astype(np.int64)
    used, counts = np.unique(flat[slot], return_counts=True)
    ycol = (slot // n_used) * b_ne1 + (slot % n_used) % b_ne1
    cstart = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    return ExpertColumns(used.astype(np.int64), cstart, ycol.astype(np.int64), slot)


class TokenExperts(NamedTuple):
    """One token's MUL_MAT_ID as fixed columns (`token_experts`): slot e is a group of its own
    (cstart = 0, 1, .., n_used), reading activation row ycol[e] = e % b.ne1 into output row
    ocol[e] = e. Only wg, the offset of slot e's expert matrix, depends on the ids' values:
    `fill` checks the ids and writes wg at every compute, before the product reads it."""

    wg: np.ndarray
    cstart: np.ndarray
    ycol: np.ndarray
    ocol: np.ndarray
    fill: Launch


@njit(cache=True, nogil=True)
def fill_expert_offsets(ids, off, stride, base, step, wg):
    """wg[e] = base + ids[off + e * stride] * step: the offset of the matrix of one token's expert
    slot e (ids one I32 column [n_used, 1] at element `off`, elements `stride` apart)."""
    for e in range(wg.shape[0]):
        wg[e] = base + ids[off + e * stride] * step


def token_experts(op: Tensor, base: int, step: int) -> TokenExperts | None:
    """A MUL_MAT_ID of one token (ids [n_used, 1]) as `TokenExperts`, where expert x's matrix
    starts at base + x * step in the weight's array (the caller's unit); None for more tokens,
    whose grouping by expert is made at every compute (`expert_columns`). Bound once, the
    product of a decode step then runs as compiled steps like MUL_MAT's (no Python between
    them); a repeated expert is two groups reading its matrix twice, which top-k routing never
    asks for."""
    a, b, ids = op.src[0], op.src[1], op.src[2]
    if ids.ne[1] != 1 or ids.ne[0] < 1:
        return None
    arr, off, st, _ = elems(ids, "ids", "mul_mat_id")
    slots = np.arange(ids.ne[0], dtype=np.int64)
    wg = np.full(ids.ne[0], base, np.int64)
    fill = in_order(index_check(ids, "ids", "mul_mat_id", a.ne[2]),
                    launch(fill_expert_offsets, arr, off, st[0], base, step, wg))
    return TokenExperts(wg, np.arange(ids.ne[0] + 1, dtype=np.int64), slots % b.ne[1], slots, fill)
