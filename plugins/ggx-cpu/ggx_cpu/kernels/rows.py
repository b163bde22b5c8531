"""GET_ROWS (rows of any type -> F32, I32 -> I32) and SET_ROWS (F32 rows -> any storable type).

GET_ROWS: out[:, i, j, k] = to_float(a[:, ids[i, j, k], j, k]), a [ne0, n_rows, ne2, ne3],
ids I32 [n, ne2, ne3]. SET_ROWS: dst[:, ids[i, j % ids.ne1, k % ids.ne2], j, k] = from_float(
src[:, i, j, k]), ids I32 or I64. Index values are checked against the row count before the
kernel runs. Rows are (de)quantized by `convert.load_row` / `store_row`, one kernel for every type.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit

from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.tensor import Tensor
from ggx.types import GType

from ..launch import split
from . import LOAD_TYPES, SLOW_STORE_TYPES, STORE_TYPES
from .common import (
    Launch,
    elems,
    host_bytes,
    in_order,
    index_check,
    need_ne,
    need_rows,
    need_srcs,
    need_type,
    rows_launch,
)
from .convert import load_row, store_row


@njit(cache=True)
def get_rows_rows(r0, r1, code, a, ao, anb, n0, ids, io, ist, ine, d, do, ds):
    """Output rows r0..r1-1. a: bytes (byte offset/strides); ids: int32 elements; d: float32 elements."""
    n1, n2 = ine[0], ine[1]
    for r in range(r0, r1):
        i, j, k = r % n1, (r // n1) % n2, r // (n1 * n2)
        row = ids[io + i * ist[0] + j * ist[1] + k * ist[2]]
        db = do + i * ds[1] + j * ds[2] + k * ds[3]
        load_row(a, ao + row * anb[1] + j * anb[2] + k * anb[3], code, n0, d[db: db + n0])


@njit(cache=True)
def set_rows_part(part, parts, code, s, so, ss, sne, ids, io, ist, ine, d, do, dnb):
    """Part `part` of `parts` of a SET_ROWS (a split kernel). s: float32 elements; ids: int32 or
    int64 elements; d: bytes (byte offset/strides). Every part walks all source rows in order and
    writes those whose destination row r has r % parts == part: each destination row is written
    by one part, so where the ids repeat a row the last write wins, as in ggml's single pass,
    whatever the ids hold and however many parts run."""
    if 0 <= part < parts:
        n1, n2 = sne[1], sne[2]
        for r in range(sne[1] * sne[2] * sne[3]):
            i, j, k = r % n1, (r // n1) % n2, r // (n1 * n2)
            row = ids[io + i * ist[0] + (j % ine[1]) * ist[1] + (k % ine[2]) * ist[2]]
            if row % parts == part:
                sb = so + i * ss[1] + j * ss[2] + k * ss[3]
                store_row(s[sb: sb + sne[0]], code, sne[0], d, do + row * dnb[1] + j * dnb[2] + k * dnb[3])


def get_rows(node: Tensor, n_threads: int) -> Launch:
    op = "GET_ROWS"
    need_srcs(node, 2)
    a, ids = node.src[0], node.src[1]
    need_type(ids, "ids", op, GType.I32)
    if ids.ne[1] != a.ne[2] or ids.ne[2] != a.ne[3] or ids.ne[3] != 1:
        raise GGXShapeError(f"{op}: ids {ids.describe()} must be [n, a.ne2, a.ne3, 1] for a {a.describe()}")
    need_ne(node, (a.ne[0], ids.ne[0], ids.ne[1], ids.ne[2]), "dst", op)
    need_rows(a, "a", op)
    check = index_check(ids, "ids", op, a.ne[1])
    ii, io, ist, ine = elems(ids, "ids", op)
    if a.type is GType.I32:  # index rows stay integers: plain gather, no conversion
        need_type(node, "dst", op, GType.I32)
        src, _, _, _ = elems(a, "a", op)
        out, _, _, _ = elems(node, "dst", op)
        sv = np.lib.stride_tricks.as_strided(src[a.data_offset // 4:], a.ne[::-1], tuple(x for x in a.nb[::-1]))
        ov = np.lib.stride_tricks.as_strided(out[node.data_offset // 4:], node.ne[::-1], tuple(node.nb[::-1]))
        iv = np.lib.stride_tricks.as_strided(ii[io:], ids.ne[::-1], tuple(x * 4 for x in ist[::-1]))

        def gather() -> None:
            for k in range(ids.ne[2]):
                for j in range(ids.ne[1]):
                    ov[k, j] = sv[k, j, iv[0, k, j]]
        return in_order(check, gather)
    if a.type not in LOAD_TYPES:
        raise GGXUnsupported(f"{op}: rows of {a.type.name} cannot be converted to F32")
    need_type(node, "dst", op, GType.F32)
    need_rows(node, "dst", op)
    ab, ao = host_bytes(a, "a", op)
    d, do, ds, _ = elems(node, "dst", op)
    # rows of the output = the ids' n * ne2 * ne3
    return in_order(check, rows_launch(get_rows_rows, n_threads, (0,) + ine[:3], a.type.ggml_id,
                                       ab, ao, tuple(a.nb), a.ne[0], ii, io, ist, ine, d, do, ds))


def set_rows(node: Tensor, n_threads: int) -> Launch:
    op = "SET_ROWS"
    need_srcs(node, 3)
    dst, src, ids = node.src
    need_type(src, "src", op, GType.F32)
    need_type(ids, "ids", op, GType.I32, GType.I64)
    if dst.type not in STORE_TYPES and dst.type not in SLOW_STORE_TYPES:
        raise GGXUnsupported(f"{op}: cannot convert F32 rows to {dst.type.name}")
    if dst.ne[0] != src.ne[0] or dst.ne[2] != src.ne[2] or dst.ne[3] != src.ne[3]:
        raise GGXShapeError(f"{op}: dst {dst.describe()} and src {src.describe()} differ in dims 0/2/3")
    if ids.ne[0] != src.ne[1] or 0 in ids.ne[1:3] or src.ne[2] % ids.ne[1] or src.ne[3] % ids.ne[2]:
        raise GGXShapeError(f"{op}: ids {ids.describe()} do not broadcast over src {src.describe()}")
    need_rows(src, "src", op)
    need_rows(dst, "dst", op)
    if node.data_offset != dst.data_offset or node.nb != dst.nb:
        raise GGXShapeError(f"{op}: result {node.describe()} is not the view of dst it must be")
    check = index_check(ids, "ids", op, dst.ne[1])
    if dst.type in SLOW_STORE_TYPES:
        return in_order(check, functools.partial(_set_rows_via_quants, dst, src, ids))
    ii, io, ist, ine = elems(ids, "ids", op)
    s, so, ss, sne = elems(src, "src", op)
    db, do = host_bytes(dst, "dst", op)
    # parts own destination rows (set_rows_part): the split needs no look at the ids' values
    return in_order(check, split(set_rows_part, dst.type.ggml_id, s, so, ss, sne, ii, io, ist, ine, db, do,
                                 tuple(dst.nb), parts=max(1, n_threads)))


def _set_rows_via_quants(dst: Tensor, src: Tensor, ids: Tensor) -> None:
    """SET_ROWS into a type without a numba quantizer: quantize the rows with ggx.quants."""
    from ggx.quants import quantize

    s, so, ss, sne = elems(src, "src", "SET_ROWS")
    ii, io, ist, _ = elems(ids, "ids", "SET_ROWS")
    db, do = host_bytes(dst, "dst", "SET_ROWS")
    rb = dst.row_bytes
    for k in range(sne[3]):
        for j in range(sne[2]):
            for i in range(sne[1]):
                sb = so + i * ss[1] + j * ss[2] + k * ss[3]
                row = int(ii[io + i * ist[0] + (j % ids.ne[1]) * ist[1] + (k % ids.ne[2]) * ist[2]])
                o = do + row * dst.nb[1] + j * dst.nb[2] + k * dst.nb[3]
                db[o: o + rb] = quantize(s[sb: sb + sne[0]], dst.type).reshape(-1)
