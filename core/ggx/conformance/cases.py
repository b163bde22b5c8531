"""The op cases: every op of the catalogue, across the types it accepts, over shapes that matter.

Modelled on make_test_cases_eval() in ggml's tests/test-backend-ops.cpp: one generator per op
family, each yielding declarative `OpCase`s (op, variables, graph builder, tolerance). Shapes are
kept modest so the whole reference run stays well under a minute; a few large rows (K-quant
rows of 4096, 1024-wide softmax) stay where size matters. `perf_cases()` holds the larger
shapes the perf mode times.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..errors import GGXShapeError
from ..ops import GeluKind, GluKind, Op, Prec, RopeMode, SortOrder
from ..tensor import Tensor
from ..types import GType
from .case import COPY, Builder, OpCase, Tolerance, tolerance

F32, F16, BF16, I32, I64 = GType.F32, GType.F16, GType.BF16, GType.I32, GType.I64
Q4_0, Q4_1, Q5_0, Q8_0 = GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0
Q4_K, Q5_K, Q6_K = GType.Q4_K, GType.Q5_K, GType.Q6_K

FLOAT_TYPES = (F32, F16, BF16)
QUANT_TYPES = (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)
WEIGHT_TYPES = FLOAT_TYPES + QUANT_TYPES


def case(op: Op, build, types=(), label: str = "", tol: Tolerance | None = None,
         expect_error=None, **variables) -> OpCase:
    """An OpCase whose tolerance defaults to the table in `case.tolerance` for its first type."""
    types = tuple(types)
    tol = tol or tolerance(op, types[0] if types else None, label)
    return OpCase(op, tuple(variables.items()), build, tol, types, expect_error, label=label)


def row_len(t: GType, small: int = 37) -> int:
    """A row length the type can hold: odd for element types, one or two blocks for quantized."""
    if t.block_size == 1:
        return small
    return t.block_size * (1 if t.block_size == 256 else 2)


# ---------------------------------------------------------------------------------------------
def get_rows_cases() -> Iterator[OpCase]:
    for t in WEIGHT_TYPES:
        k = row_len(t)
        for n_rows, n_ids, batch in ((10, 7, 1), (5, 12, 3)):
            def build(b: Builder, t=t, k=k, n_rows=n_rows, n_ids=n_ids, batch=batch):
                a = b.uniform(t, (k, n_rows, batch), "a")
                ids = b.indices(I32, (n_ids, batch), "ids", n_rows)
                return b.ctx.get_rows(a, ids)
            yield case(Op.GET_ROWS, build, (t,), type=t, n=k, rows=n_rows, ids=n_ids, batch=batch)

    def build_i32(b: Builder):
        a = b.ints(I32, (9, 6), "a", b.rng.integers(-1000, 1000, 54))
        return b.ctx.get_rows(a, b.indices(I32, (4,), "ids", 6))
    yield case(Op.GET_ROWS, build_i32, (I32,), type=I32, n=9, rows=6, ids=4, batch=1)

    def build_view(b: Builder):
        a = b.row_strided(F32, (37, 8), "a")
        return b.ctx.get_rows(a, b.indices(I32, (5,), "ids", 8))
    yield case(Op.GET_ROWS, build_view, (F32,), type=F32, n=37, rows=8, ids=5, batch=1, view="row_strided")


def set_rows_cases() -> Iterator[OpCase]:
    shapes = ((10, 4, 1), (6, 3, 2))
    for t in WEIGHT_TYPES:
        k = row_len(t)
        index_types = (I64, I32) if t in (F32, F16, Q8_0) else (I64,)
        for it in index_types:
            for n_dst, n_src, batch in shapes if it is I64 else shapes[:1]:
                def build(b: Builder, t=t, k=k, it=it, n_dst=n_dst, n_src=n_src, batch=batch):
                    dst = b.uniform(t, (k, n_dst, batch), "dst")
                    src = b.uniform(F32, (k, n_src, batch), "src")
                    # distinct rows per batch: two writes to one row would race
                    rows = np.stack([b.rng.permutation(n_dst)[:n_src] for _ in range(batch)])
                    ids = b.ints(it, (n_src, batch), "ids", rows)
                    return b.ctx.set_rows(dst, src, ids)
                yield case(Op.SET_ROWS, build, (t, it), type=t, idx=it, n=k, dst_rows=n_dst, src_rows=n_src,
                           batch=batch)


def cpy_cases() -> Iterator[OpCase]:
    # F32 source into every destination type, contiguous.
    for dst_t in WEIGHT_TYPES:
        ne = (row_len(dst_t), 5, 3)
        def build(b: Builder, dst_t=dst_t, ne=ne):
            return b.ctx.cpy(b.uniform(F32, ne, "a"), b.leaf(dst_t, ne, "b"))
        yield case(Op.CPY, build, (dst_t, F32), src=F32, dst=dst_t, ne=ne)
    # Between element types and same-type copies (quantized to itself is a byte copy).
    for src_t, dst_t in ((F16, F32), (F16, F16), (BF16, F32), (BF16, BF16), (F32, F32), (I32, I32),
                         (Q4_0, Q4_0), (Q5_0, Q5_0), (Q4_K, Q4_K)):
        ne = (row_len(src_t, 19), 4, 2)
        def build(b: Builder, src_t=src_t, dst_t=dst_t, ne=ne):
            a = (b.ints(I32, ne, "a", b.rng.integers(-99, 99, math.prod(ne))) if src_t is I32
                 else b.uniform(src_t, ne, "a"))
            return b.ctx.cpy(a, b.leaf(dst_t, ne, "b"))
        yield case(Op.CPY, build, (dst_t, src_t), tol=COPY if src_t is dst_t else None, src=src_t, dst=dst_t, ne=ne)
    # Non-contiguous sources (transposed, permuted) into contiguous destinations.
    for src_t, dst_t, how in ((F32, F16, "transposed"), (F32, F32, "permuted"), (F16, F32, "transposed"),
                              (F32, Q8_0, "permuted"), (F32, BF16, "row_strided")):
        ne = (64, 5, 3)
        def build(b: Builder, src_t=src_t, dst_t=dst_t, how=how, ne=ne):
            a = (b.transposed(src_t, ne, "a") if how == "transposed"
                 else b.permuted(src_t, ne, (0, 2, 1, 3), "a") if how == "permuted"
                 else b.row_strided(src_t, ne, "a"))
            return b.ctx.cpy(a, b.leaf(dst_t, ne, "b"))
        yield case(Op.CPY, build, (dst_t, src_t), src=src_t, dst=dst_t, ne=ne, view=how)
    # Non-contiguous destination: write through a transposed view of the destination leaf.
    for dst_t in (F32, F16):
        def build(b: Builder, dst_t=dst_t):
            dst = b.leaf(dst_t, (5, 37), "b")
            return b.ctx.cpy(b.uniform(F32, (37, 5), "a"), b.ctx.transpose(dst))
        yield case(Op.CPY, build, (dst_t, F32), src=F32, dst=dst_t, ne=(37, 5), view="transposed_dst")
    # Same element count, other shape (ggml_cpy only needs equal counts).
    def build_reshape(b: Builder):
        return b.ctx.cpy(b.uniform(F32, (32, 6), "a"), b.leaf(F16, (64, 3), "b"))
    yield case(Op.CPY, build_reshape, (F16, F32), src=F32, dst=F16, ne=(32, 6), dst_ne=(64, 3))


def dup_cont_cases() -> Iterator[OpCase]:
    for t, how in ((F32, "contiguous"), (F16, "contiguous"), (BF16, "contiguous"), (F32, "transposed"),
                   (F16, "permuted"), (Q8_0, "contiguous")):
        ne = (row_len(t, 23), 6, 3)
        def build(b: Builder, t=t, how=how, ne=ne):
            a = (b.uniform(t, ne, "a") if how == "contiguous" else b.transposed(t, ne, "a")
                 if how == "transposed" else b.permuted(t, ne, (0, 2, 1, 3), "a"))
            return b.ctx.dup(a)
        yield case(Op.DUP, build, (t,), type=t, ne=ne, view=how)
    for t, how in ((F32, "transposed"), (F32, "permuted"), (F16, "transposed"), (BF16, "permuted"),
                   (F32, "row_strided"), (I32, "transposed")):
        ne = (23, 6, 3)
        def build(b: Builder, t=t, how=how, ne=ne):
            if t is I32:
                leaf = b.ints(I32, (6, 23, 3), "a", b.rng.integers(-50, 50, 6 * 23 * 3))
                a = b.ctx.transpose(leaf)
            else:
                a = (b.transposed(t, ne, "a") if how == "transposed" else b.permuted(t, ne, (0, 2, 1, 3), "a")
                     if how == "permuted" else b.row_strided(t, ne, "a"))
            return b.ctx.cont(a)
        yield case(Op.CONT, build, (t,), type=t, ne=ne, view=how)
    def build_reshape(b: Builder):
        return b.ctx.cont(b.transposed(F32, (12, 10), "a"), (30, 4))
    yield case(Op.CONT, build_reshape, (F32,), type=F32, ne=(12, 10), new_ne=(30, 4), view="transposed")


def view_cases() -> Iterator[OpCase]:
    """View ops never reach a kernel: the result is the input's memory re-described. Each view is
    taken of a leaf (the backend only skips the node) and of a computed result."""
    def make(kind: str, t: GType, computed: bool):
        def build(b: Builder):
            a = b.uniform(t, (12, 10, 3), "a")
            if computed:
                a = b.ctx.scale(a, 2.0)
            ctx = b.ctx
            if kind == "VIEW":
                return ctx.view(a, (5, 4, 2), (a.nb[1], a.nb[2]), offset=a.nb[1] + 3 * a.nb[0])
            if kind == "RESHAPE":
                return ctx.reshape(a, (30, 12))
            if kind == "PERMUTE":
                return ctx.permute(a, 2, 0, 1, 3)
            return ctx.transpose(a)
        return build
    for kind in ("VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"):
        for t, computed in ((F32, False), (F16, False), (F32, True)):
            yield case(Op[kind], make(kind, t, computed), (t,), type=t, ne=(12, 10, 3),
                       of="scale" if computed else "leaf")


BCAST_SHAPES = (
    ((16, 10, 1, 1), (16, 10, 1, 1)),
    ((16, 10, 10, 1), (16, 10, 10, 1)),
    ((16, 10, 10, 10), (16, 10, 10, 10)),
    ((16, 10, 10, 10), (16, 1, 1, 1)),
    ((16, 10, 10, 10), (1, 1, 1, 1)),
    ((16, 10, 10, 10), (16, 10, 1, 10)),
    ((16, 10, 10, 10), (1, 10, 1, 10)),
    ((32, 10, 10, 10), (16, 10, 10, 10)),
    ((37, 5, 3, 2), (37, 1, 3, 1)),
    ((4096, 3, 1, 1), (4096, 1, 1, 1)),
    ((577, 7, 1, 1), (577, 7, 1, 1)),
    ((1, 1, 1, 1), (1, 1, 1, 1)),
)


def binary_cases() -> Iterator[OpCase]:
    for op in (Op.ADD, Op.MUL):
        fn = "add" if op is Op.ADD else "mul"
        for ne_a, ne_b in BCAST_SHAPES:
            def build(b: Builder, fn=fn, ne_a=ne_a, ne_b=ne_b):
                return getattr(b.ctx, fn)(b.uniform(F32, ne_a, "a"), b.uniform(F32, ne_b, "b"))
            yield case(op, build, (F32,), ne_a=ne_a, ne_b=ne_b)
        for how in ("permuted", "row_strided"):
            def build(b: Builder, fn=fn, how=how):
                a = (b.permuted(F32, (37, 5, 2), (0, 2, 1, 3), "a") if how == "permuted"
                     else b.row_strided(F32, (37, 5, 2), "a"))
                return getattr(b.ctx, fn)(a, b.uniform(F32, (37, 1, 2), "b"))
            yield case(op, build, (F32,), ne_a=(37, 5, 2), ne_b=(37, 1, 2), view=how)


UNARY_SHAPES = ((128, 2, 2, 2), (37, 5, 1, 1), (4096, 3, 1, 1), (5, 7, 11, 3))


def unary_cases() -> Iterator[OpCase]:
    for ne, s, bias in (((10, 10, 10, 10), 2.0, 0.0), ((37, 5, 1, 1), 0.37, 0.5), ((4096, 2, 1, 1), -1.5, 0.0),
                        ((1, 1, 1, 1), 3.0, -1.0)):
        def build(b: Builder, ne=ne, s=s, bias=bias):
            return b.ctx.scale(b.uniform(F32, ne, "a"), s, bias)
        yield case(Op.SCALE, build, (F32,), ne=ne, s=s, b=bias)
    kinds = (("SILU", None), ("GELU", GeluKind.TANH), ("GELU_ERF", GeluKind.ERF), ("GELU_QUICK", GeluKind.QUICK))
    for label, kind in kinds:
        op = Op.SILU if kind is None else Op.GELU
        for ne in UNARY_SHAPES + ("row_strided",):
            def build(b: Builder, kind=kind, ne=ne):
                a = b.row_strided(F32, (37, 5), "a") if ne == "row_strided" else b.uniform(F32, ne, "a", -6.0, 6.0)
                return b.ctx.silu(a) if kind is None else b.ctx.gelu(a, kind)
            view = {"view": ne} if ne == "row_strided" else {"ne": ne}
            yield case(op, build, (F32,), label=label, **view)
        def build_special(b: Builder, kind=kind):
            x = b.rng.uniform(-6.0, 6.0, (3, 37)).astype(np.float32)
            x[0, :len(SPECIAL_VALUES)] = SPECIAL_VALUES
            a = b.leaf(F32, (37, 3), "a", x)
            return b.ctx.silu(a) if kind is None else b.ctx.gelu(a, kind)
        yield case(op, build_special, (F32,), label=label, ne=(37, 3), values="special")


#: inf, NaN and large values (within F16 range: ggml's CPU GELU_QUICK reads an F16 table, where
#: larger values are infinite) for the unary ops: both sides follow IEEE arithmetic through
#: ggml's formulas, e.g. silu(-inf) = -inf / (1 + inf) = NaN, gelu(-inf) = 0 (its clamp at -10)
SPECIAL_VALUES = (np.inf, -np.inf, np.nan, 0.0, 100.0, -100.0, 60000.0, -60000.0)


def glu_cases() -> Iterator[OpCase]:
    variants = ((GluKind.SWIGLU, False, False, (37, 5)), (GluKind.SWIGLU, False, False, (1000, 2, 2)),
                (GluKind.SWIGLU, True, False, (37, 5)), (GluKind.SWIGLU, False, True, (576, 3)),
                (GluKind.SWIGLU, False, True, (64, 4, 3, 2)), (GluKind.GEGLU, False, False, (37, 5)),
                (GluKind.GEGLU, True, False, (128, 3)), (GluKind.GEGLU, False, True, (576, 3)))
    for kind, swapped, split, ne in variants:
        def build(b: Builder, kind=kind, swapped=swapped, split=split, ne=ne):
            if split:
                return b.ctx.glu(b.uniform(F32, ne, "a", -4, 4), b.uniform(F32, ne, "b"), kind, swapped)
            fused = (2 * ne[0],) + tuple(ne[1:])
            return b.ctx.glu(b.uniform(F32, fused, "a", -4, 4), None, kind, swapped)
        label = "GLU_" + kind.name
        yield case(Op.GLU, build, (F32,), label=label, ne=ne, swapped=int(swapped), split=int(split))


def norm_cases() -> Iterator[OpCase]:
    for op, fn in ((Op.RMS_NORM, "rms_norm"), (Op.NORM, "norm")):
        for ne, eps in (((576, 3), 1e-5), ((576, 3), 1e-6), ((4096, 2), 1e-5), ((37, 5, 3), 1e-5),
                        ((64, 5, 4, 3), 1e-6), ((1, 4), 1e-5)):
            def build(b: Builder, fn=fn, ne=ne, eps=eps):
                return getattr(b.ctx, fn)(b.uniform(F32, ne, "a", -1.0, 3.0), eps)
            yield case(op, build, (F32,), ne=ne, eps=eps)
        def build_view(b: Builder, fn=fn):
            return getattr(b.ctx, fn)(b.row_strided(F32, (576, 4), "a"), 1e-5)
        yield case(op, build_view, (F32,), ne=(576, 4), eps=1e-5, view="row_strided")
        # eps 0 over a zero row and a constant row, and a row holding inf: ggml scales by
        # 1/sqrtf(mean + eps) (ops.cpp, ggml_compute_forward_rms_norm_f32 / norm_f32), so a zero
        # variance gives 0 * inf = NaN and an inf gives NaN there and 0 * x elsewhere (RMS_NORM)
        def build_edge(b: Builder, fn=fn):
            x = b.rng.uniform(-1.0, 3.0, (5, 37)).astype(np.float32)
            x[0], x[1], x[2, 5] = 0.0, 3.0, np.inf
            return getattr(b.ctx, fn)(b.leaf(F32, (37, 5), "a", x), 0.0)
        yield case(op, build_edge, (F32,), ne=(37, 5), eps=0.0, rows="zero,constant,inf")


def sum_rows_cases() -> Iterator[OpCase]:
    for ne in ((576, 7, 3), (37, 5, 2), (4096, 2), (1, 5, 3), (10, 10, 10, 10), "row_strided"):
        def build(b: Builder, ne=ne):
            a = b.row_strided(F32, (37, 6), "a") if ne == "row_strided" else b.uniform(F32, ne, "a")
            return b.ctx.sum_rows(a)
        yield case(Op.SUM_ROWS, build, (F32,), **({"view": ne} if ne == "row_strided" else {"ne": ne}))


def mm_biased(t: GType, m: int, n: int, k: int) -> OpCase:
    """A product whose activations are uniform in [0, 2] with channels 3, 300 and k - 7 scaled up
    (one per 256 values, so one 256-wide Q8_K block never holds two): x30 where the activations
    are quantized in blocks of 32 (Q8_0, Q8_1), x8 where in blocks of 256 (Q8_K). With x30 one
    outlier sets the scale of 255 other values, and ggml's own arithmetic (Q8_K-rounded
    activations, everything else exact) is then 7-14e-4 from the exact product by itself, over
    the 5e-4 bound whatever the kernel does; x8 keeps that part at 2-4e-4."""
    boost = 8.0 if t.vec_dot_type is GType.Q8_K else 30.0
    def build(b: Builder):
        a = b.uniform(t, (k, m), "a")
        x = b.rng.uniform(0.0, 2.0, (n, k)).astype(np.float32)
        x[:, [3, 300, k - 7]] *= boost
        return b.ctx.mul_mat(a, b.leaf(F32, (k, n), "b", x))
    return case(Op.MUL_MAT, build, (t,), type_a=t, type_b=F32, m=m, n=n, k=k, b_dist="u02_outliers")


# ---------------------------------------------------------------------------------------------
def mul_mat_cases() -> Iterator[OpCase]:
    def mm(t, m, n, k, bs=(1, 1), nr=(1, 1), b_perm=False, a_view=False):
        def build(b: Builder):
            a_ne = (k, m, bs[0], bs[1])
            a = b.row_strided(t, a_ne, "a") if a_view else b.uniform(t, a_ne, "a")
            b_ne = (k, n, bs[0] * nr[0], bs[1] * nr[1])
            act = b.permuted(F32, b_ne, (0, 2, 1, 3), "b") if b_perm else b.uniform(F32, b_ne, "b")
            return b.ctx.mul_mat(a, act)
        extra = {}
        if bs != (1, 1) or nr != (1, 1):
            extra.update(bs=bs, nr=nr)
        if b_perm:
            extra["b_view"] = "permuted"
        if a_view:
            extra["a_view"] = "row_strided"
        return case(Op.MUL_MAT, build, (t,), type_a=t, type_b=F32, m=m, n=n, k=k, **extra)

    for t in WEIGHT_TYPES:
        for m, n, k in ((16, 1, 256), (16, 8, 256), (67, 33, 256), (32, 1, 1024), (13, 7, 512)):
            yield mm(t, m, n, k)
        for bs, nr in (((2, 3), (1, 1)), ((2, 1), (3, 1)), ((1, 2), (1, 2))):
            yield mm(t, 16, 5, 256, bs, nr)
        yield mm(t, 16, 4, 256, (3, 1), b_perm=True)
    for t in (F32, F16, Q4_0, Q5_0):
        yield mm(t, 9, 3, 256, a_view=True)
    for t in (F32, F16, Q8_0):
        yield mm(t, 1, 1, 32 if t.block_size > 1 else 1)
    # Large K-quant rows (and their neighbours): long dot products, several super-blocks per row.
    for t in (F16, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K):
        yield mm(t, 64, 4, 4096)
    # Gemma 3 270M's Q5_0 weights have rows of K = 640 (20 blocks), e.g. attn_k [640, 256]
    yield mm(Q5_0, 256, 3, 640)
    # Activations as a model's are: not zero-mean (uniform in [0, 2]) with a few x30 outlier
    # channels. A kernel folding the weight's offset (Q4_0's -8, Q4_1's and the K-quants' mins)
    # through a sum of the activations shows here how that sum was taken: ggml-cpu's d * sum(q)
    # meets the bound, the float sum of the unquantized activations does not (zero-mean
    # activations hide the difference). A decode product and a batch, K of 1024.
    for t in (Q4_0, Q4_1, Q5_0, Q4_K, Q5_K):
        for n in (1, 8):
            yield mm_biased(t, 32, n, 1024)

    # Refused at build time: a row that is not a whole number of blocks, K that differs.
    for t in QUANT_TYPES:
        k = t.block_size + t.block_size // 2
        def build(b: Builder, t=t, k=k):
            return b.ctx.mul_mat(b.uniform(t, (k, 4), "a"), b.uniform(F32, (k, 2), "b"))
        yield case(Op.MUL_MAT, build, (t,), expect_error=GGXShapeError, type_a=t, m=4, n=2, k=k,
                   refused="row_not_block_multiple")
    def build_k(b: Builder):
        return b.ctx.mul_mat(b.uniform(F32, (64, 4), "a"), b.uniform(F32, (65, 2), "b"))
    yield case(Op.MUL_MAT, build_k, (F32,), expect_error=GGXShapeError, type_a=F32, m=4, n=2, k=64, k_b=65,
               refused="k_mismatch")


# ids [n_used, n_tokens] for MoE cases, fixed so they say what they test.
MOE_IDS = {
    # token 1 selects expert 3 twice; experts 0..3 all used
    "repeated": (4, [[1, 3], [3, 3], [0, 1], [2, 0], [3, 1]]),
    # experts 4..7 are never used
    "unused": (8, [[0, 2], [1, 0], [3, 3], [2, 1], [0, 0], [1, 3]]),
    # every expert in every token
    "all": (4, [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]]),
    # one token (decode), three experts of eight
    "decode": (8, [[6, 1, 4]]),
}


def mul_mat_id_cases() -> Iterator[OpCase]:
    """Every pattern of MOE_IDS at 16 rows per expert, and once more at 32 rows (the first b_ne1 of
    each pattern): the expert row counts weight buffer types with 32-row tiles take (AMX's), so
    their MUL_MAT_ID is checked by the suite too (`ggx test-ops --buft AMX -o MUL_MAT_ID`)."""
    for t in WEIGHT_TYPES:
        for pattern, (n_expert, ids) in MOE_IDS.items():
            ids_arr = np.array(ids, dtype=np.int32)  # [n_tokens, n_used] in numpy order
            n_tokens, n_used = ids_arr.shape
            b_ne1s = (n_used, 1) if pattern == "repeated" else (1 if pattern == "unused" else n_used,)
            for m, b_ne1 in [(16, b) for b in b_ne1s] + [(32, b_ne1s[0])]:
                def build(b: Builder, t=t, n_expert=n_expert, ids_arr=ids_arr, b_ne1=b_ne1, m=m):
                    n_tokens, n_used = ids_arr.shape
                    experts = b.uniform(t, (256, m, n_expert), "as")
                    act = b.uniform(F32, (256, b_ne1, n_tokens), "b")
                    ids = b.ints(I32, (n_used, n_tokens), "ids", ids_arr)
                    return b.ctx.mul_mat_id(experts, act, ids)
                yield case(Op.MUL_MAT_ID, build, (t,), type_a=t, n_expert=n_expert, n_used=n_used, b_ne1=b_ne1,
                           n_tokens=n_tokens, m=m, k=256, ids=pattern)


# ---------------------------------------------------------------------------------------------
def rope_cases() -> Iterator[OpCase]:
    def rope(mode, head_dim, n_dims, n_head, n_tokens, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0,
             n_ctx_orig=0, view=False, max_pos=300, n_factors=0):
        def build(b: Builder):
            ne = (head_dim, n_head, n_tokens)
            if view:  # heads 1..n_head of a tensor holding n_head + 2 heads (llama.cpp's fused QKV)
                leaf = b.uniform(F32, (head_dim, n_head + 2, n_tokens), "a")
                a = b.ctx.view(leaf, ne, leaf.nb[1:3], offset=leaf.nb[1])
            else:
                a = b.uniform(F32, ne, "a")
            pos = b.ints(I32, (n_tokens,), "pos", b.rng.integers(max_pos - 300, max_pos, n_tokens))
            # Llama 3.1's rope_freqs span 1 (high frequencies) to 8 (low); a few below 1 too
            ff = b.uniform(F32, (n_factors,), "freq_factors", 0.5, 8.0) if n_factors else None
            return b.ctx.rope(a, pos, n_dims, mode, freq_base, freq_scale, n_ctx_orig, ext_factor,
                              freq_factors=ff)
        extra = {"view": "heads"} if view else {}
        if n_factors:
            extra["freq_factors"] = n_factors
        if ext_factor:
            extra.update(ext_factor=ext_factor, n_ctx_orig=n_ctx_orig)
        if max_pos != 300:
            extra["max_pos"] = max_pos
        return case(Op.ROPE, build, (F32,), tol=_ROPE_FAR if max_pos > 300 else None, mode=mode,
                    head_dim=head_dim, n_dims=n_dims, n_head=n_head,
                    n_tokens=n_tokens, freq_base=freq_base, freq_scale=freq_scale, **extra)

    for mode in (RopeMode.NORMAL, RopeMode.NEOX):
        for head_dim in (64, 128):
            for n_dims in (head_dim, head_dim // 2):
                yield rope(mode, head_dim, n_dims, 4, 5)
                yield rope(mode, head_dim, n_dims, 3, 7, freq_base=1e6, freq_scale=0.25)
        yield rope(mode, 64, 32, 3, 7, freq_base=1e5, freq_scale=0.5, view=True)
        yield rope(mode, 128, 128, 2, 4, freq_scale=0.25, ext_factor=1.0, n_ctx_orig=512)
        # far positions: ggml (and ggx-cpu) compute the angles in float32, the reference exactly
        yield rope(mode, 128, 128, 2, 6, max_pos=65536)
        yield rope(mode, 64, 64, 2, 6, freq_base=1e6, max_pos=65536)
        # frequency factors (ggml_rope_ext's c): exactly n_dims/2, more than needed, with YaRN
        yield rope(mode, 64, 64, 4, 5, freq_base=5e5, n_factors=32)
        yield rope(mode, 64, 32, 3, 7, n_factors=20, view=True)
        yield rope(mode, 128, 128, 2, 4, freq_scale=0.25, ext_factor=1.0, n_ctx_orig=512, n_factors=64)


#: ggml's rope takes theta = (float) pos * theta_scale^i in float32, one multiplication per pair
#: (ggml_rope_cache_init): the angle error grows with the position, ~pos * 2^-24 radians per step
_ROPE_FAR = Tolerance(1e-5, "float32 angles pos * theta_scale^i at positions up to 65536, as ggml's")


def soft_max_cases() -> Iterator[OpCase]:
    def sm(ne, mask=None, scale=0.125, max_bias=0.0, mask_rows=None, mask_heads=1, causal=False):
        def build(b: Builder):
            a = b.uniform(F32, ne, "a", -4, 4)
            m = None
            if mask is not None:
                m = b.mask(mask, ne[0], mask_rows or ne[1], causal=causal, n_head=mask_heads)
            return b.ctx.soft_max(a, m, scale, max_bias)
        extra = {}
        if mask_rows:
            extra["mask_rows"] = mask_rows
        if mask_heads > 1:
            extra["mask_heads"] = mask_heads
        if causal:
            extra["causal"] = 1
        return case(Op.SOFT_MAX, build, (mask or F32,), ne=ne, mask=mask or "none", scale=scale,
                    max_bias=max_bias, **extra)

    for ne in ((37, 5, 4, 1), (256, 7, 8, 1), (1024, 2, 1, 1), (16, 16, 2, 3)):
        for mask in (None, F32, F16):
            yield sm(ne, mask)
    yield sm((37, 5, 4, 1), None, scale=1.0)
    yield sm((37, 5, 4, 1), F16, max_bias=8.0)
    yield sm((37, 5, 6, 1), F32, max_bias=8.0)
    yield sm((64, 3, 8, 1), F16, max_bias=8.0, scale=1.0)
    yield sm((37, 5, 3, 1), F16, mask_rows=8)
    yield sm((37, 5, 3, 1), F32, mask_rows=6)
    yield sm((32, 8, 4, 1), F16, causal=True)
    yield sm((32, 8, 4, 1), F32, causal=True)
    yield sm((37, 5, 4, 1), F32, mask_heads=4)
    # a row that is all -inf, one holding +inf, and a row the mask sets to -inf: NaN throughout
    # those rows, as in ggml (ggml_compute_forward_soft_max_f32: exp(-inf - -inf) and 1/sum
    # with no guard; only flash attention guards a fully masked row)
    for mask in (None, F32, F16):
        def build_edge(b: Builder, mask=mask):
            x = b.rng.uniform(-4.0, 4.0, (6, 37)).astype(np.float32)
            x[0], x[1, 3] = -np.inf, np.inf
            m = None
            if mask is not None:
                mv = b.rng.uniform(-1.0, 1.0, (6, 37)).astype(np.float32)
                mv[2], mv[3, :30] = -np.inf, -np.inf
                m = b.leaf(mask, (37, 6), "mask", mv)
            return b.ctx.soft_max(b.leaf(F32, (37, 6), "a", x), m, 0.5)
        yield case(Op.SOFT_MAX, build_edge, (mask or F32,), ne=(37, 6), mask=mask or "none", scale=0.5,
                   rows="-inf,+inf" + (",masked" if mask else ""))


def _window_mask(b: Builder, n_kv: int, rows: int, window: int) -> Tensor:
    """A causal mask [n_kv, rows] that also hides keys `window` or more positions back (a
    sliding-window layer's, as Gemma's), the last row at position n_kv - 1."""
    pos = np.arange(rows)[:, None] + (n_kv - rows)
    keys = np.arange(n_kv)[None, :]
    return b.leaf(F16, (n_kv, rows), "mask", np.where((keys > pos) | (keys <= pos - window), -np.inf, 0.0))


def flash_attn_cases() -> Iterator[OpCase]:
    def fa(d, gqa, kv_t, n_tokens, n_kv, mask=True, n_head_kv=2, causal=False, max_bias=0.0, softcap=0.0,
           prec=Prec.DEFAULT, views=False, window=0, batch=1):
        n_head = n_head_kv * gqa
        def build(b: Builder):
            if views:  # llama.cpp's layout: q from [D, H, T], k/v from [D, Hkv, KV], permuted
                q = b.permuted(F32, (d, n_tokens, n_head), (0, 2, 1, 3), "q")
                k = b.permuted(kv_t, (d, n_kv, n_head_kv), (0, 2, 1, 3), "k")
                v = b.permuted(kv_t, (d, n_kv, n_head_kv), (0, 2, 1, 3), "v")
            else:
                q = b.uniform(F32, (d, n_tokens, n_head, batch), "q")
                k = b.uniform(kv_t, (d, n_kv, n_head_kv, batch), "k")
                v = b.uniform(kv_t, (d, n_kv, n_head_kv, batch), "v")
            m = None
            if window:
                m = _window_mask(b, n_kv, n_tokens, window)
            elif mask:
                m = b.mask(F16, n_kv, n_tokens, causal=causal)
            return b.ctx.flash_attn_ext(q, k, v, m, 1.0 / math.sqrt(d), max_bias, softcap, prec)
        extra = {}
        for key, value, default in (("mask", int(mask), 1), ("causal", int(causal), 0), ("max_bias", max_bias, 0.0),
                                    ("softcap", softcap, 0.0), ("prec", prec, Prec.DEFAULT),
                                    ("views", int(views), 0), ("window", window, 0), ("batch", batch, 1)):
            if value != default:
                extra[key] = value
        return case(Op.FLASH_ATTN_EXT, build, (kv_t,), hs=d, gqa=gqa, type_kv=kv_t, n_head=n_head,
                    n_tokens=n_tokens, n_kv=n_kv, **extra)

    for d in (64, 128):
        for gqa in (1, 3, 4, 8):
            for kv_t in (F16, F32):
                for n_tokens, n_kv in ((1, 64), (7, 33)):
                    yield fa(d, gqa, kv_t, n_tokens, n_kv)
    yield fa(64, 1, F16, 3, 19, mask=False)
    yield fa(128, 4, F16, 3, 19, mask=False, n_head_kv=1)
    yield fa(64, 1, F16, 8, 16, causal=True)
    yield fa(128, 3, F16, 64, 70, causal=True)
    yield fa(64, 1, F16, 7, 33, max_bias=8.0)
    yield fa(64, 4, F16, 5, 40, softcap=50.0)
    yield fa(128, 3, F16, 5, 40, prec=Prec.F32)
    yield fa(64, 3, F16, 6, 21, views=True)
    yield fa(128, 4, F32, 2, 32, views=True)
    # 64 query rows or more: ggml's tiled kernel (F32 throughout), whose KV tiles of 64 slots are
    # skipped where the mask hides them from every row (causal, sliding window); n_kv not a
    # multiple of the tile, head sizes 64/128/256, GQA 1/3/4, ALiBi, softcap, batches
    yield fa(64, 3, F16, 96, 150, causal=True)
    yield fa(64, 1, F32, 64, 64, causal=True)
    yield fa(128, 4, F16, 80, 200, window=48)
    yield fa(256, 4, F16, 70, 130, n_head_kv=1, window=64)
    yield fa(256, 1, F32, 64, 100, n_head_kv=1, causal=True)
    yield fa(64, 3, F16, 130, 130, mask=False)
    yield fa(128, 3, F16, 72, 90, causal=True, max_bias=8.0)
    yield fa(64, 4, F16, 64, 70, softcap=30.0)
    yield fa(64, 3, F32, 65, 80, causal=True, batch=2)
    # a decode token over 512 slots or more: ggml splits the slots over the threads and merges
    # the partial softmaxes; a sliding window hides most of them
    yield fa(64, 3, F16, 1, 600, n_head_kv=3)
    yield fa(128, 4, F32, 1, 530)
    yield fa(256, 4, F16, 1, 700, n_head_kv=1, window=512)
    yield fa(64, 4, F16, 7, 300, window=64)
    # decode over a cache padded to a multiple of 256 slots (ggml pads the KV cache so): ggml-cuda
    # takes its vec kernel and merges the parallel blocks' partial softmaxes (combine); the slots
    # past the filled ones are -inf in the mask. SmolLM2's GQA 3, head sizes 64 and 128.
    for d, n_kv, filled in ((64, 256, 37), (128, 512, 300), (64, 4096, 4000), (128, 4096, 1)):
        yield fa_padded(d, n_kv, filled)
    # a query row whose every key is masked gives zeros: ggml defines it (S == 0 leaves the
    # output 0: ops.cpp, flash_attn_ext one_chunk, tiled and the reduction of partials)
    for kv_t, n_tokens in ((F16, 4), (F32, 4), (F16, 64)):
        def build_masked(b: Builder, kv_t=kv_t, n_tokens=n_tokens):
            q = b.uniform(F32, (64, n_tokens, 4), "q")
            k = b.uniform(kv_t, (64, 40, 2), "k")
            v = b.uniform(kv_t, (64, 40, 2), "v")
            mv = b.rng.uniform(-1.0, 1.0, (n_tokens, 40)).astype(np.float32)
            mv[1], mv[2, 7:] = -np.inf, -np.inf
            return b.ctx.flash_attn_ext(q, k, v, b.leaf(F16, (40, n_tokens), "mask", mv), 0.125)
        yield case(Op.FLASH_ATTN_EXT, build_masked, (kv_t,), hs=64, gqa=2, type_kv=kv_t, n_head=4,
                   n_tokens=n_tokens, n_kv=40, rows="masked")


def fa_padded(d: int, n_kv: int, filled: int, gqa: int = 3, n_head_kv: int = 1) -> OpCase:
    """One decode row over `n_kv` F16 slots of which the first `filled` are visible (-inf after)."""
    def build(b: Builder):
        q = b.uniform(F32, (d, 1, n_head_kv * gqa), "q")
        k = b.uniform(F16, (d, n_kv, n_head_kv), "k")
        v = b.uniform(F16, (d, n_kv, n_head_kv), "v")
        m = np.where(np.arange(n_kv) < filled, 0.0, -np.inf).astype(np.float32).reshape(1, n_kv)
        return b.ctx.flash_attn_ext(q, k, v, b.leaf(F16, (n_kv, 1), "mask", m), 1.0 / math.sqrt(d))
    return case(Op.FLASH_ATTN_EXT, build, (F16,), hs=d, gqa=gqa, type_kv=F16, n_head=n_head_kv * gqa, n_tokens=1,
                n_kv=n_kv, filled=filled)


def sort_cases() -> Iterator[OpCase]:
    for ne in ((37, 4), (1024, 3), (16, 10, 10), (5, 1)):
        for order in (SortOrder.ASC, SortOrder.DESC):
            def build(b: Builder, ne=ne, order=order):
                return b.ctx.argsort(b.distinct_rows(ne, "a"), order)
            yield case(Op.ARGSORT, build, (F32,), ne=ne, order=order)
    for ne, k in (((37, 4), 1), ((37, 4), 5), ((37, 4), 37), ((1024, 2), 40), ((16, 3, 2), 4)):
        def build(b: Builder, ne=ne, k=k):
            return b.ctx.top_k(b.distinct_rows(ne, "a"), k)
        yield case(Op.TOP_K, build, (F32,), ne=ne, k=k)
    for ne, k in (((37, 4), 5), ((100, 3), 8)):
        def build(b: Builder, ne=ne, k=k):
            return b.ctx.argsort_top_k(b.distinct_rows(ne, "a"), k)
        yield case(Op.ARGSORT, build, (F32,), label="ARGSORT_TOP_K", ne=ne, k=k)


GENERATORS = (get_rows_cases, set_rows_cases, cpy_cases, dup_cont_cases, view_cases, binary_cases, unary_cases,
              glu_cases, norm_cases, sum_rows_cases, mul_mat_cases, mul_mat_id_cases, rope_cases, soft_max_cases,
              flash_attn_cases, sort_cases)


def op_cases() -> list[OpCase]:
    """Every eval case, in catalogue order."""
    return [c for gen in GENERATORS for c in gen()]


# ---------------------------------------------------------------------------------------------
def perf_cases() -> list[OpCase]:
    """Larger shapes for `--mode perf` (as make_test_cases_perf): decode (n=1) and prompt (n=512)
    matrix products of a 4096-wide model, attention over a long cache, and bandwidth-bound ops."""
    out: list[OpCase] = []
    for t in WEIGHT_TYPES:
        for n in (1, 512):
            def build(b: Builder, t=t, n=n):
                return b.ctx.mul_mat(b.uniform(t, (4096, 4096), "a"), b.uniform(F32, (4096, n), "b"))
            out.append(case(Op.MUL_MAT, build, (t,), type_a=t, type_b=F32, m=4096, n=n, k=4096))
    for n_tokens in (1, 512):
        def build(b: Builder, n_tokens=n_tokens):
            q = b.uniform(F32, (128, n_tokens, 32), "q")
            k = b.uniform(F16, (128, 4096, 8), "k")
            v = b.uniform(F16, (128, 4096, 8), "v")
            return b.ctx.flash_attn_ext(q, k, v, b.mask(F16, 4096, n_tokens), 1 / math.sqrt(128))
        out.append(case(Op.FLASH_ATTN_EXT, build, (F16,), hs=128, gqa=4, type_kv=F16, n_head=32,
                        n_tokens=n_tokens, n_kv=4096))
    def rms(b: Builder):
        return b.ctx.rms_norm(b.uniform(F32, (4096, 512), "a"), 1e-5)
    out.append(case(Op.RMS_NORM, rms, (F32,), ne=(4096, 512), eps=1e-5))
    def sm(b: Builder):
        return b.ctx.soft_max(b.uniform(F32, (4096, 32, 32), "a"), b.mask(F16, 4096, 32), 0.125)
    out.append(case(Op.SOFT_MAX, sm, (F16,), ne=(4096, 32, 32), mask=F16, scale=0.125))
    def add(b: Builder):
        return b.ctx.add(b.uniform(F32, (4096, 512), "a"), b.uniform(F32, (4096, 1), "b"))
    out.append(case(Op.ADD, add, (F32,), ne_a=(4096, 512), ne_b=(4096, 1)))
    def rope(b: Builder):
        pos = b.ints(I32, (512,), "pos", np.arange(512))
        return b.ctx.rope(b.uniform(F32, (128, 32, 512), "a"), pos, 128, RopeMode.NEOX)
    out.append(case(Op.ROPE, rope, (F32,), mode=RopeMode.NEOX, head_dim=128, n_dims=128, n_head=32, n_tokens=512))
    def cpy(b: Builder):
        return b.ctx.cpy(b.uniform(F32, (4096, 512), "a"), b.leaf(F16, (4096, 512), "b"))
    out.append(case(Op.CPY, cpy, (F16, F32), src=F32, dst=F16, ne=(4096, 512)))
    for t in (Q4_0, Q5_0):
        def get_rows(b: Builder, t=t):
            return b.ctx.get_rows(b.uniform(t, (4096, 1024), "a"), b.indices(I32, (512,), "ids", 1024))
        out.append(case(Op.GET_ROWS, get_rows, (t,), type=t, n=4096, rows=1024, ids=512, batch=1))
    return out
