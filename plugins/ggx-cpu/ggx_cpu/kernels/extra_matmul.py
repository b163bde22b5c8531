"""What the MUL_MAT / MUL_MAT_ID kernels of an extra buffer type share (CPU_REPACK, AMX): the
checks of the node around the weight (`matmul_problem`) and MUL_MAT_ID's columns grouped by
expert (`expert_columns`, ggml's mmid row mapping). Imported at discovery (the extra buffer
types' checks): no numba here."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ggx.backend import BufferType
from ggx.errors import GGXShapeError
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType


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
