"""MUL_MAT and MUL_MAT_ID on the CPU (ggml_compute_forward_mul_mat / _mul_mat_id).

Quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K): the F32 activations are quantized once per
call to the weight type's vec_dot_type (`quantize_act`), then every dot product runs on
integers in the ISA variant `ggx_cpu.isa` selected (AVX-512 VNNI, AVX2 or portable). Float
weights (F32, F16, BF16): activations are rounded once to the weight's type (ggml's F16/BF16
vec_dot_type) and dotted in float32 (`matmul_float.float_mm`, which picks its own row blocks).

Both ops run as one split kernel (`ggx_cpu.launch.split`, run by the backend's plan) over tasks
= (group, 4-row tile): a *group* is one weight matrix and the list of activation columns it
multiplies. MUL_MAT has one group per (i2, i3) batch (weights broadcast over b's dims 2/3);
MUL_MAT_ID has one group per expert that some token uses, so repeated experts share a pass over
their weights and unused experts cost nothing (grouped at every compute), except for one token
(a decode step), bound once with one group per expert slot whose weight offset a compiled step
reads from the ids (`token_experts`). Inside a task, columns go 4 at a time
through a 4x4 register tile (the gemm path); leftover columns, and a single column (the gemv
path), use row quads.

`mul_mat` / `mul_mat_id` return a `Launch` (see `common`); the ISA variant is the one selected
when the launch is made.

Layouts passed to the kernels (everything is validated before any kernel runs):
  w     the weight tensor's whole host buffer: uint8 bytes (quantized) or a typed flat view
        (float32 for F32, uint16 bits for F16, int16 bits for BF16); group g's matrix starts
        at wg[g] (bytes, or elements for float types), row r at wg[g] + r * wrs.
  act   the quantized (or rounded) activations, one row of K values per column (see Q8Act).
  cstart, ycol, ocol  group g owns columns cstart[g]..cstart[g+1]: ycol = activation row,
        ocol = output row; out is the destination flattened to rows of M floats.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numba import njit
from numba.extending import overload

from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.host import tensor_array
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType

from .. import isa as _isa
from ..isa import portable, vector, vector_avx512, vector_kquants
from ..isa.tokens import TokenType, register_token
from ..launch import launch, split
from .common import Launch, elems, host_bytes, in_order, index_check, nothing, split_parts
from .matmul_float import float_mm
from .quantize_act import act_launch


# --- the weight type is a token too: each type compiles its own kernel, holding only its code ---
class KindToken:
    """The `kind` argument of the quantized kernel: a weight type by ggml's lower-case name."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"KindToken({self.name!r})"


class KindType(TokenType):
    """numba type of a `KindToken`; `kind_name` is the weight type ("q4_0", "q4_K", ...)."""

    def __init__(self, token: KindToken):
        self.kind_name = token.name
        super().__init__(name=f"Kind({token.name})")


register_token(KindToken, KindType)

#: quantized weight type -> its kind token
QUANT_KINDS = {t: KindToken(name) for t, name in ((GType.Q4_0, "q4_0"), (GType.Q4_1, "q4_1"), (GType.Q5_0, "q5_0"),
                                                  (GType.Q8_0, "q8_0"), (GType.Q4_K, "q4_K"), (GType.Q6_K, "q6_K"))}
FLOAT_TYPES = (GType.F32, GType.F16, GType.BF16)
SUPPORTED = tuple(QUANT_KINDS) + FLOAT_TYPES
TILE = 4


# --- which kernels each ISA variant runs ---------------------------------------------------------
class QuantKernels(NamedTuple):
    """One weight type's kernels under one ISA variant (signatures and layouts: `ggx_cpu.isa.vector`)."""

    dot: Callable  # one row dot
    rows4: Callable | None  # a row quad (the gemv); None: 4 row dots
    tile: Callable  # a 4x4 tile (the gemm)


_VECTOR = {
    "q4_0": QuantKernels(vector.dot_q4_0, vector.rows4_q4_0, vector.tile_q4_0),
    "q4_1": QuantKernels(vector.dot_q4_1, vector.rows4_q4_1, vector.tile_q4_1),
    "q5_0": QuantKernels(vector.dot_q5_0, vector.rows4_q5_0, vector.tile_q5_0),
    "q8_0": QuantKernels(vector.dot_q8_0, vector.rows4_q8_0, vector.tile_q8_0),
    "q4_K": QuantKernels(vector_kquants.dot_q4_K, vector_kquants.rows4_q4_K, vector_kquants.tile_q4_K),
    "q6_K": QuantKernels(vector_kquants.dot_q6_K, vector_kquants.rows4_q6_K, vector_kquants.tile_q6_K),
}
#: ISA variant -> weight kind -> its kernels (AVX-512 VNNI has 512-bit gemv row quads for Q4_0/Q4_1
#: only; its Q5_0 and Q8_0 run the 256-bit ones, with vpdpbusd as their product)
QUANT_KERNELS: dict[str, dict[str, QuantKernels]] = {
    "avx512_vnni": {**_VECTOR,
                    "q4_0": _VECTOR["q4_0"]._replace(rows4=vector_avx512.rows4_q4_0),
                    "q4_1": _VECTOR["q4_1"]._replace(rows4=vector_avx512.rows4_q4_1)},
    "avx2": _VECTOR,
    "portable": {
        "q4_0": QuantKernels(portable.dot_q4_0, None, portable.tile_q4_0),
        "q4_1": QuantKernels(portable.dot_q4_1, None, portable.tile_q4_1),
        "q5_0": QuantKernels(portable.dot_q5_0, None, portable.tile_q5_0),
        "q8_0": QuantKernels(portable.dot_q8_0, None, portable.tile_q8_0),
        "q4_K": QuantKernels(portable.dot_q4_K, None, portable.tile_q4_K),
        "q6_K": QuantKernels(portable.dot_q6_K, None, portable.tile_q6_K),
    },
}


def _kernels(isa, kind) -> QuantKernels:
    return QUANT_KERNELS[isa.isa_name][kind.kind_name]


def _qdot(isa, kind, w, wo, nb, yq, yd, ys, ys4, yo):
    """One row dot of weight `kind` under `isa` (by the tokens' types)."""
    raise NotImplementedError


def _qtile(isa, kind, w, wo, wrs, nb, yq, yd, ys, ys4, y0, y1, y2, y3, out, o0, o1, o2, o3):
    """A 4x4 tile."""
    raise NotImplementedError


def _qrows4(isa, kind, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
    """A row quad, or 4 row dots where the variant has none."""
    raise NotImplementedError


@overload(_qdot)
def _ol_qdot(isa, kind, w, wo, nb, yq, yd, ys, ys4, yo):
    f = _kernels(isa, kind).dot
    return lambda isa, kind, w, wo, nb, yq, yd, ys, ys4, yo: np.float32(f(isa, w, wo, nb, yq, yd, ys, ys4, yo))


@overload(_qtile)
def _ol_qtile(isa, kind, w, wo, wrs, nb, yq, yd, ys, ys4, y0, y1, y2, y3, out, o0, o1, o2, o3):
    f = _kernels(isa, kind).tile
    return lambda isa, kind, w, wo, wrs, nb, yq, yd, ys, ys4, y0, y1, y2, y3, out, o0, o1, o2, o3: f(
        isa, w, wo, wrs, nb, yq, yd, ys, ys4, y0, y1, y2, y3, out, o0, o1, o2, o3)


@overload(_qrows4)
def _ol_qrows4(isa, kind, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
    f = _kernels(isa, kind).rows4
    if f is not None:
        return lambda isa, kind, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo: f(
            isa, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo)

    def rows(isa, kind, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo):
        for r in range(4):
            out[oo + r] = _qdot(isa, kind, w, wo + r * wrs, nb, yq, yd, ys, ys4, yo)
    return rows


@njit(cache=True)
def quant_mm(part, parts, isa, kind, w, wg, wrs, M, nb, yq, yd, ys, ys4, K, cstart, ycol, ocol, out):
    """The quantized MUL_MAT / MUL_MAT_ID kernel as a split kernel (`ggx_cpu.launch.split`): part
    p runs a contiguous share of the (group, 4 rows) tasks; no prologue or epilogue."""
    if part < 0 or part >= parts:
        return
    n_groups = wg.shape[0]
    n_tiles = (M + TILE - 1) // TILE
    n = n_groups * n_tiles
    for t in range(part * n // parts, (part + 1) * n // parts):
        g = t // n_tiles
        r0 = (t % n_tiles) * TILE
        nr = min(TILE, M - r0)
        wo = wg[g] + r0 * wrs
        c = cstart[g]
        ce = cstart[g + 1]
        if nr == TILE:
            while c + TILE <= ce:  # gemm: 4x4 register tiles
                _qtile(isa, kind, w, wo, wrs, nb, yq, yd, ys, ys4,
                       ycol[c] * K, ycol[c + 1] * K, ycol[c + 2] * K, ycol[c + 3] * K, out,
                       ocol[c] * M + r0, ocol[c + 1] * M + r0, ocol[c + 2] * M + r0, ocol[c + 3] * M + r0)
                c += TILE
        for cc in range(c, ce):  # gemv and leftover columns: row quads, or row dots at the edge
            yo = ycol[cc] * K
            oo = ocol[cc] * M + r0
            if nr == TILE:
                _qrows4(isa, kind, w, wo, wrs, nb, yq, yd, ys, ys4, yo, out, oo)
            else:
                for r in range(nr):
                    out[oo + r] = _qdot(isa, kind, w, wo + r * wrs, nb, yq, yd, ys, ys4, yo)


# --- one token's MUL_MAT_ID, bound once ----------------------------------------------------------
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


# --- validation and preparation ----------------------------------------------------------------
def _fail(op: str, msg: str) -> GGXShapeError:
    return GGXShapeError(f"{op}: {msg}")


def _weights(a: Tensor, op: str) -> tuple[np.ndarray, int, int, int, int]:
    """(w, unit, off0, nb1, nb2) in units of w's elements; see the module docstring."""
    data, _ = host_bytes(a, "weights", op)
    if a.type.is_quantized:
        return data, 1, a.data_offset, a.nb[1], a.nb[2]
    dtype = {GType.F32: np.float32, GType.F16: np.uint16, GType.BF16: np.int16}[a.type]
    size = np.dtype(dtype).itemsize
    if a.data_offset % size or a.nb[1] % size or a.nb[2] % size or a.nb[3] % size:
        raise GGXUnsupported(f"{op}: weights {a.describe()} are not aligned to {size} bytes")
    flat = np.ndarray((len(data) // size,), dtype, data, 0)
    return flat, size, a.data_offset // size, a.nb[1] // size, a.nb[2] // size


def _b_rows(b: Tensor) -> np.ndarray | None:
    """b's rows as a float32 [rows, K] view of its buffer, or None when b is strided."""
    arr = tensor_array(b)
    return arr.reshape(-1, b.ne[0]) if arr.flags.c_contiguous else None


def _round_act(x: np.ndarray, a_type: GType, out: np.ndarray) -> None:
    """Round the activation rows x to float weight type a_type's precision (ggml's F16/BF16
    vec_dot_type), into out."""
    if a_type is GType.F16:
        out[...] = x.astype(np.float16)
    else:  # BF16, ggml's fp32 -> bf16: round to nearest even (NaN kept quiet)
        u = x.view(np.uint32)
        r = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16) << 16
        r = np.where(np.isnan(x), (u | np.uint32(0x400000)) & np.uint32(0xFFFF0000), r)
        out[...] = r.astype(np.uint32).view(np.float32)


def _check_weight(op: str, a: Tensor, b: Tensor) -> None:
    if a.type not in SUPPORTED:
        raise GGXUnsupported(f"{op}: weight type {a.type.name} is not supported by the CPU kernels "
                             f"(supported: {', '.join(t.name for t in SUPPORTED)})")
    if b.type is not GType.F32:
        raise _fail(op, f"b {b.describe()} must be F32")
    if a.ne[0] != b.ne[0]:
        raise _fail(op, f"a {a.describe()} and b {b.describe()} differ in K (ne0)")
    if a.ne[0] % a.type.block_size:
        raise _fail(op, f"K={a.ne[0]} is not a multiple of the {a.type.name} block size")
    if not a.has_contiguous_rows() or not b.has_contiguous_rows():
        raise _fail(op, f"rows of a {a.describe()} and b {b.describe()} must be contiguous")


def _out_rows(dst: Tensor, op: str) -> np.ndarray | None:
    """The destination's values as the flat float32 array the kernel writes, or None when strided."""
    if dst.type is not GType.F32:
        raise _fail(op, f"destination {dst.describe()} must be F32")
    view = tensor_array(dst)
    return view.reshape(-1) if view.flags.c_contiguous else None


def _mm_launch(a: Tensor, w, wg: np.ndarray, wrs: int, x: np.ndarray, cstart, ycol, ocol, out,
               n_threads: int) -> Launch:
    """Quantize (or round) the activations x, then the one parallel kernel for a's type. x and
    out are read and written when the launch runs: they must be the tensors' own memory."""
    K, M = a.ne[0], a.ne[1]
    wg, cstart, ycol, ocol = (np.ascontiguousarray(v, dtype=np.int64) for v in (wg, cstart, ycol, ocol))
    parts = split_parts(n_threads, len(ycol))
    if a.type in QUANT_KINDS:
        act, quantize = act_launch(x, a.type.vec_dot_type, n_threads)
        return in_order(quantize, split(quant_mm, _isa.token(), QUANT_KINDS[a.type], w, wg, wrs, M,
                                        K // a.type.block_size, act.qs, act.d, act.s, act.s4, K, cstart, ycol,
                                        ocol, out, parts=parts))
    if a.type is GType.F32:
        return split(float_mm, w, wg, wrs, M, x.reshape(-1), K, cstart, ycol, ocol, out, parts=parts)
    y = np.empty(x.size, np.float32)
    return in_order(functools.partial(_round_act, x.reshape(-1), a.type, y),
                    split(float_mm, w, wg, wrs, M, y, K, cstart, ycol, ocol, out, parts=parts))


def _through_copies(b: Tensor, dst: Tensor, run) -> Launch:
    """The launch of a strided b or destination: each run copies b to contiguous rows, computes
    into a contiguous result and writes that through the destination's view (`run(x, out)`
    makes and runs the kernel's launch)."""
    def strided() -> None:
        x = np.ascontiguousarray(tensor_array(b), dtype=np.float32).reshape(-1, b.ne[0])
        view = tensor_array(dst)
        out = np.empty(view.size, np.float32)
        run(x, out)
        view[...] = out.reshape(view.shape)
    return strided


# --- the ops -----------------------------------------------------------------------------------
def mul_mat(node: Tensor, n_threads: int = 1) -> Launch:
    """dst[m, n, i2, i3] = sum_k a[k, m, i2 / (B2/A2), i3 / (B3/A3)] * b[k, n, i2, i3]."""
    op = "mul_mat"
    if node.op is not Op.MUL_MAT or len(node.src) < 2:
        raise GGXUnsupported(f"{op}: {node.describe()} is not a MUL_MAT node")
    a, b = node.src[0], node.src[1]
    _check_weight(op, a, b)
    if b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
        raise _fail(op, f"a {a.describe()} does not broadcast over b {b.describe()} in dims 2/3")
    if tuple(node.ne) != (a.ne[1], b.ne[1], b.ne[2], b.ne[3]):
        raise _fail(op, f"destination {node.describe()} should be [{a.ne[1]}, {b.ne[1]}, {b.ne[2]}, {b.ne[3]}]")
    if node.nelements == 0:
        return nothing
    w, unit, off0, nb1, nb2 = _weights(a, op)
    nb3 = a.nb[3] // unit
    N, B2, B3 = b.ne[1], b.ne[2], b.ne[3]
    r2, r3 = B2 // a.ne[2], B3 // a.ne[3]
    i2 = np.tile(np.arange(B2), B3)
    i3 = np.repeat(np.arange(B3), B2)
    wg = off0 + (i2 // r2) * nb2 + (i3 // r3) * nb3
    cstart = np.arange(B2 * B3 + 1) * N
    cols = np.arange(B2 * B3 * N)
    x, out = _b_rows(b), _out_rows(node, op)
    if x is not None and out is not None:
        return _mm_launch(a, w, wg, nb1, x, cstart, cols, cols, out, n_threads)
    return _through_copies(b, node, lambda x, out: _mm_launch(a, w, wg, nb1, x, cstart, cols, cols, out,
                                                                   n_threads)())


def mul_mat_id(node: Tensor, n_threads: int = 1) -> Launch:
    """dst[:, e, t] = as[:, :, ids[e, t]]^T @ b[:, e % b.ne1, t] (the MoE matmul). Which expert
    multiplies which column is data: the launch groups the columns by expert every run."""
    op = "mul_mat_id"
    if node.op is not Op.MUL_MAT_ID or len(node.src) < 3:
        raise GGXUnsupported(f"{op}: {node.describe()} is not a MUL_MAT_ID node")
    a, b, ids = node.src[0], node.src[1], node.src[2]
    _check_weight(op, a, b)
    n_used, T = ids.ne[0], ids.ne[1]
    if ids.type is not GType.I32 or ids.ne[2] != 1 or ids.ne[3] != 1:
        raise _fail(op, f"ids {ids.describe()} must be I32 [n_used, n_tokens]")
    if a.ne[3] != 1 or b.ne[3] != 1 or b.ne[2] != T or b.ne[1] not in (1, n_used):
        raise _fail(op, f"as {a.describe()}, b {b.describe()}, ids {ids.describe()} do not fit together")
    if tuple(node.ne) != (a.ne[1], n_used, T, 1):
        raise _fail(op, f"destination {node.describe()} should be [{a.ne[1]}, {n_used}, {T}, 1]")
    if node.nelements == 0:
        return nothing
    w, unit, off0, nb1, nb2 = _weights(a, op)
    x, out = _b_rows(b), _out_rows(node, op)
    one = token_experts(node, off0, nb2) if x is not None and out is not None else None
    if one is not None:  # a decode step's: bound once
        return in_order(one.fill, _mm_launch(a, w, one.wg, nb1, x, one.cstart, one.ycol, one.ocol, out, n_threads))
    bne1 = b.ne[1]
    ids_view = tensor_array(ids)

    def run(x: np.ndarray, out: np.ndarray) -> None:
        experts = np.ascontiguousarray(ids_view).reshape(T, n_used)
        bad = (experts < 0) | (experts >= a.ne[2])
        if bad.any():
            t, e = np.argwhere(bad)[0]
            raise _fail(op, f"ids[{e}, {t}] = {experts[t, e]} is not an expert of as {a.describe()} "
                            f"(0..{a.ne[2] - 1})")
        flat = experts.reshape(-1)  # slot s = t * n_used + e is output row s
        slots = np.argsort(flat, kind="stable")
        used, counts = np.unique(flat[slots], return_counts=True)
        ycol = (slots // n_used) * bne1 + (slots % n_used) % bne1
        cstart = np.concatenate(([0], np.cumsum(counts)))
        _mm_launch(a, w, off0 + used * nb2, nb1, x, cstart, ycol, slots, out, n_threads)()

    if x is not None and out is not None:
        return functools.partial(run, x, out)
    return _through_copies(b, node, run)
