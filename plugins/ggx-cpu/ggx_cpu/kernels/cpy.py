"""CPY / DUP / CONT: copy a tensor's values, in logical (row-major over ne) order, into a
destination of the same element count, converting the type on the way (ggml_cpy / ggml_dup /
ggml_cont).

Element k of the source (flat index over its ne, ne0 fastest) goes to element k of the
destination, whatever the two shapes and strides are. Float sources (F32/F16/BF16) are converted
to any storable destination, quantizing with ggml's reference quantizers (bit-exact with
ggml_quantize_chunk); same-type copies move raw bytes (index types, and quantized blocks row by
row). One byte-level kernel serves every type pair.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit

from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.tensor import Tensor

from . import FLOAT_TYPES, SLOW_STORE_TYPES
from .common import Launch, host_bytes, need_rows, need_srcs, nothing, rows_launch
from .convert import BF16, F16, F32, STORE_TYPES, f32_to_bf16, f32_to_f16, load_elem, store_row, wr_u16


@njit(cache=True, inline="always")
def _unravel(flat, ne):
    i0 = flat % ne[0]
    flat //= ne[0]
    i1 = flat % ne[1]
    flat //= ne[1]
    return i0, i1, flat % ne[2], flat // ne[2]


@njit(cache=True, inline="always")
def _src_off(i0, r, same_rows, s_ne, s_nb, so, ne0):
    """Byte offset of source element number r*ne0 + i0 (same_rows: the source's ne0 is ne0 too)."""
    if same_rows:
        _, s1, s2, s3 = _unravel(r * s_ne[0], s_ne)
        return so + i0 * s_nb[0] + s1 * s_nb[1] + s2 * s_nb[2] + s3 * s_nb[3]
    s0, s1, s2, s3 = _unravel(r * ne0 + i0, s_ne)
    return so + s0 * s_nb[0] + s1 * s_nb[1] + s2 * s_nb[2] + s3 * s_nb[3]


CONVERT, COPY_ELEMS, COPY_ROWS = 0, 1, 2


@njit(cache=True)
def cpy_rows(r0, r1, mode, es, s, so, s_nb, s_ne, scode, d, do, d_nb, d_ne, dcode):
    """Fill destination rows r0..r1-1 (of its ne1*ne2*ne3). COPY_ELEMS: move `es` bytes per element; COPY_ROWS: move the
    `es` bytes of a whole row (quantized, equal row lengths); CONVERT: load floats, store dcode."""
    n1, n2 = d_ne[1], d_ne[2]
    ne0 = d_ne[0]
    same_rows = s_ne[0] == ne0
    for r in range(r0, r1):
        i1, i2, i3 = r % n1, (r // n1) % n2, r // (n1 * n2)
        db = do + i1 * d_nb[1] + i2 * d_nb[2] + i3 * d_nb[3]
        if mode == COPY_ELEMS and s_nb[0] == es and d_nb[0] == es:
            # both sides dense along dim 0: move runs of whole source rows' elements, not one
            # element (and one index unravel) at a time
            i0 = 0
            while i0 < ne0:
                s0, s1, s2, s3 = _unravel(r * ne0 + i0, s_ne)
                n = min(ne0 - i0, s_ne[0] - s0) * es
                sb = so + s0 * es + s1 * s_nb[1] + s2 * s_nb[2] + s3 * s_nb[3]
                dbi = db + i0 * es
                d[dbi: dbi + n] = s[sb: sb + n]
                i0 += n // es
        elif mode != CONVERT:
            units = 1 if mode == COPY_ROWS else ne0
            for i0 in range(units):
                sb = _src_off(i0, r, same_rows, s_ne, s_nb, so, ne0)
                dbi = db + i0 * d_nb[0]
                for c in range(es):
                    d[dbi + c] = s[sb + c]
        else:
            tmp = np.empty(ne0, np.float32)
            for i0 in range(ne0):
                tmp[i0] = load_elem(s, _src_off(i0, r, same_rows, s_ne, s_nb, so, ne0), scode)
            if dcode == F32 or dcode == F16 or dcode == BF16:  # element types: honour the dst stride
                for i0 in range(ne0):
                    o = db + i0 * d_nb[0]
                    if dcode == F32:
                        d[o: o + 4].view(np.float32)[0] = tmp[i0]
                    elif dcode == F16:
                        wr_u16(d, o, f32_to_f16(tmp[i0]))
                    else:
                        wr_u16(d, o, f32_to_bf16(tmp[i0]))
            else:
                store_row(tmp, dcode, ne0, d, db)


def cpy(node: Tensor, n_threads: int) -> Launch:
    """CPY(a, b) writes into b (node is the view of b); DUP and CONT write into node itself."""
    op = node.op.name
    need_srcs(node, 1)
    src = node.src[0]
    dst = node
    if node.nelements != src.nelements:
        raise GGXShapeError(f"{op}: {src.describe()} and {dst.describe()} differ in element count")
    if src.nelements == 0:
        return nothing
    sbuf, so = host_bytes(src, "src", op)
    dbuf, do = host_bytes(dst, "dst", op)
    if src.type is dst.type:
        if src.type.is_quantized:
            # whole rows of blocks: both sides need contiguous rows of equal length
            need_rows(src, "src", op)
            need_rows(dst, "dst", op)
            if src.ne[0] != dst.ne[0]:
                if not (src.is_contiguous() and dst.is_contiguous()):
                    raise GGXUnsupported(f"{op}: reshaping copy of quantized {src.describe()} needs contiguous tensors")
                d, s = dbuf[do: do + dst.nbytes], sbuf[so: so + src.nbytes]
                return functools.partial(np.copyto, d, s)
            mode, es = COPY_ROWS, src.row_bytes
        else:
            mode, es = COPY_ELEMS, src.type.type_size
        return rows_launch(cpy_rows, n_threads, tuple(dst.ne), mode, es, sbuf, so, tuple(src.nb), tuple(src.ne),
                           src.type.ggml_id, dbuf, do, tuple(dst.nb), tuple(dst.ne), dst.type.ggml_id)
    if src.type not in FLOAT_TYPES:
        raise GGXUnsupported(f"{op}: cannot convert {src.describe()} to {dst.type.name}")
    if dst.type in SLOW_STORE_TYPES:
        need_rows(dst, "dst", op)
        return functools.partial(_cpy_via_f32, node, src, sbuf, so)
    if dst.type not in STORE_TYPES:
        raise GGXUnsupported(f"{op}: cannot convert to {dst.describe()}")
    if dst.type.is_quantized:
        need_rows(dst, "dst", op)
    return rows_launch(cpy_rows, n_threads, tuple(dst.ne), CONVERT, 0, sbuf, so, tuple(src.nb), tuple(src.ne),
                       src.type.ggml_id, dbuf, do, tuple(dst.nb), tuple(dst.ne), dst.type.ggml_id)


def _cpy_via_f32(node: Tensor, src: Tensor, sbuf: np.ndarray, so: int) -> None:
    """Gather src into contiguous F32 rows shaped like the destination, quantize with ggx.quants."""
    from ggx.quants import quantize

    dst = node
    ne = tuple(int(x) for x in dst.ne)
    rows = np.empty(ne[::-1], np.float32)
    nb = (4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2])
    cpy_rows(0, ne[1] * ne[2] * ne[3], CONVERT, 0, sbuf, so, tuple(src.nb), tuple(src.ne), src.type.ggml_id,
               rows.reshape(-1).view(np.uint8), 0, nb, ne, F32)
    write_rows(dst, quantize(rows, dst.type))


def write_rows(dst: Tensor, blocks: np.ndarray) -> None:
    """Store whole rows of bytes (numpy shape = reversed ne, last axis = row bytes) into dst."""
    data, off = host_bytes(dst, "dst", dst.op.name)
    view = np.lib.stride_tricks.as_strided(data[off:], (*dst.ne[:0:-1], dst.row_bytes),
                                           (*dst.nb[:0:-1], 1))
    view[...] = blocks
