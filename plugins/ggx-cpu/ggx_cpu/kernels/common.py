"""What every kernel wrapper does before a numba kernel runs: check the tensors, hand out memory,
and bind the kernel's call into a `Launch`.

A wrapper `fn(node, n_threads) -> Launch` validates the node and returns a zero-argument callable
that runs its kernel. The backend runs it at once, or keeps the launches of a graph it computes
again (decode submits the same graph every token) and only calls them: validation, layout
checks and numba's argument typing are paid once. Whatever depends on tensor *data* (index
ranges, expert routing) is checked inside the launch, every time.

Kernels receive a tensor as (a 1-D array over its *whole* host buffer, the offset of element
(0,0,0,0), four strides, four sizes), all in units of the array's element, so any view (strided,
permuted, offset) reaches a kernel without a copy. That array is the buffer's `host_view()`: any
`is_host` buffer type works, whichever plugin made it. These helpers prove, before the kernel
runs, that every index the kernel can form (0 <= i_k < ne_k) stays inside that array: numba does
not check bounds.
"""
from __future__ import annotations

import weakref

import numpy as np

from ggx.backend import Buffer, Launch
from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.tensor import Tensor
from ggx.types import GType

from ..jobs import row_split
from ..launch import IndexCheck, in_order, launch, nothing, split

__all__ = ["Launch", "in_order", "launch", "nothing", "elems", "host_bytes", "index_check", "rows_launch",
           "split_parts", "need_type", "need_ne", "need_rows", "need_srcs", "ELEM_DTYPES"]

#: numpy element type a kernel sees for each element type (F16/BF16 as raw bits).
ELEM_DTYPES = {GType.F32: np.float32, GType.F16: np.uint16, GType.BF16: np.uint16,
               GType.I32: np.int32, GType.I64: np.int64}

Int4 = tuple[int, int, int, int]

# keyed by id(): Enum.__hash__ is a Python-level call, ~0.3 us per lookup on the per-node path
_DTYPE_BY_ID = {id(k): v for k, v in ELEM_DTYPES.items()}


# Decode runs the same few hundred nodes every step: the proof that a layout fits its buffer
# depends only on (type, ne, nb, byte offset, buffer size), so it is made once per layout and
# remembered (a few us per tensor in Python otherwise, more than the kernel of a one-token op).
_LAYOUT_MAX = 8192
_layouts: dict[tuple, tuple[int, Int4, Int4]] = {}
# typed views of each buffer's host view, one per element dtype (rebuilt when that array changes),
# held weakly: a freed buffer's memory lives only as long as the launches bound to it
_typed: weakref.WeakKeyDictionary[Buffer, tuple[weakref.ref, weakref.WeakValueDictionary]] = \
    weakref.WeakKeyDictionary()


def _host_view(t: Tensor, role: str, op: str) -> tuple[Buffer, np.ndarray]:
    """(t's buffer, that buffer's host_view); GGXUnsupported unless it is host memory."""
    buf = t.data_buffer
    if buf is None:
        raise GGXUnsupported(f"{op}: {role} {t.describe()} has no storage")
    if not buf.buft.is_host:
        raise GGXUnsupported(f"{op}: {role} {t.describe()} lives in {buf.buft.name}, not host memory")
    return buf, buf.host_view()


def _check_span(t: Tensor, off: int, size: int, role: str, op: str) -> None:
    if any(x < 0 for x in t.nb):
        raise GGXShapeError(f"{op}: {role} {t.describe()} has a negative stride {list(t.nb)}")
    if off < 0 or off + t.nbytes > size:
        raise GGXShapeError(f"{op}: {role} {t.describe()} at byte {off} (+{t.nbytes}) overruns "
                            f"its {size}-byte buffer")


def host_bytes(t: Tensor, role: str, op: str) -> tuple[np.ndarray, int]:
    """(uint8 array of t's whole host buffer, byte offset of t's first element), bounds checked."""
    _, data = _host_view(t, role, op)
    off = t.data_offset
    key = _key(None, t, off, data)
    if key is None or key not in _layouts:
        _check_span(t, off, data.size, role, op)
        _remember(key, (off, (0, 0, 0, 0), (0, 0, 0, 0)))
    return data, off


def _key(dtype: type | None, t: Tensor, off: int, data: np.ndarray) -> tuple | None:
    """What a layout check depends on; None (check every time) for ne/nb edited into lists."""
    if type(t.ne) is not tuple or type(t.nb) is not tuple:
        return None
    return (dtype, t.ne, t.nb, off, data.size, id(t.type))


def _remember(key: tuple | None, value: tuple[int, Int4, Int4]) -> None:
    if key is None:
        return
    if len(_layouts) >= _LAYOUT_MAX:  # graphs of many shapes (tests): start over rather than grow
        _layouts.clear()
    _layouts[key] = value


def _typed_view(buf: Buffer, data: np.ndarray, dtype: type) -> np.ndarray:
    """`data` (buf's host view) as one array of `dtype` elements, the same for every tensor of buf."""
    views = _typed.get(buf)
    if views is None or views[0]() is not data:
        views = _typed[buf] = (weakref.ref(data), weakref.WeakValueDictionary())
    arr = views[1].get(dtype)
    if arr is None:
        size = np.dtype(dtype).itemsize
        arr = views[1][dtype] = data[: data.size // size * size].view(dtype)
    return arr


def elems(t: Tensor, role: str, op: str) -> tuple[np.ndarray, int, Int4, Int4]:
    """(typed 1-D array over t's buffer, element offset, element strides, ne) for an element type."""
    dtype = _DTYPE_BY_ID.get(id(t.type))
    if dtype is None:
        raise GGXUnsupported(f"{op}: {role} {t.describe()} is not an element type")
    buf, data = _host_view(t, role, op)
    off = t.data_offset
    key = _key(dtype, t, off, data)
    layout = _layouts.get(key) if key is not None else None
    if layout is None:
        layout = _elem_layout(t, off, data.size, role, op)
        _remember(key, layout)
    return (_typed_view(buf, data, dtype),) + layout


def _elem_layout(t: Tensor, off: int, bufsize: int, role: str, op: str) -> tuple[int, Int4, Int4]:
    _check_span(t, off, bufsize, role, op)
    size = t.type.type_size
    if off % size or any(nb % size for nb in t.nb):
        raise GGXUnsupported(f"{op}: {role} {t.describe()} (offset {off}, nb {list(t.nb)}) is not aligned to "
                             f"its {size}-byte elements")
    if t.nb[0] == 0 and t.ne[0] > 1:
        raise GGXUnsupported(f"{op}: {role} {t.describe()} repeats one element along ne0 (nb0 = 0)")
    st = tuple(nb // size for nb in t.nb)
    # a row of one element may have any nb0; kernels slice rows with step st[0], which must be > 0
    st = (st[0] if t.ne[0] > 1 else 1,) + st[1:]
    return off // size, st, tuple(int(x) for x in t.ne)


def need_type(t: Tensor, role: str, op: str, *allowed: GType) -> None:
    if t.type not in allowed:
        raise GGXUnsupported(f"{op}: {role} {t.describe()} must be {'/'.join(a.name for a in allowed)}")


def need_ne(t: Tensor, ne: tuple[int, ...], role: str, op: str) -> None:
    if tuple(t.ne) != tuple(ne):
        raise GGXShapeError(f"{op}: {role} {t.describe()} must have ne={list(ne)}")


def need_rows(t: Tensor, role: str, op: str) -> None:
    if not t.has_contiguous_rows():
        raise GGXUnsupported(f"{op}: {role} {t.describe()} needs contiguous rows (nb0 = element size)")


def need_srcs(node: Tensor, n: int) -> None:
    if len(node.src) < n or any(s is None for s in node.src[:n]):
        raise GGXShapeError(f"{node.op.name}: {node.describe()} needs {n} sources, has {len(node.src)}")


def index_check(t: Tensor, role: str, op: str, bound: int) -> Launch:
    """The launch checking that index tensor `t` holds only values in [0, bound) (`IndexCheck`)."""
    arr, off, st, ne = elems(t, role, op)
    if 0 in ne:
        return nothing
    return IndexCheck(t, role, op, bound, arr, off, st, ne)


#: parts per thread of a batch's split kernels: on a busy machine a thread descheduled in the
#: middle of a part holds up the launch by that part only, and the others claim the rest
PARTS_PER_THREAD = 4


def split_parts(n_threads: int, n_items: int) -> int:
    """How many parts a split kernel over `n_items` (activation columns, rows) takes: one per
    thread for one item (a decode token's product: its parts already are short), else
    PARTS_PER_THREAD per thread, at most one per item."""
    if n_threads <= 1 or n_items <= 1:
        return max(1, n_threads)
    return max(1, min(n_items, PARTS_PER_THREAD * n_threads))


def rows_launch(kernel, n_threads: int, ne: Int4, *args) -> Launch:
    """A row kernel `kernel(r0, r1, *args)` over the ne1*ne2*ne3 rows of `ne`: one call on one
    thread, else split in `split_parts` parts (`jobs.row_split`), which the backend runs
    on the worker pool or as a region."""
    n_rows = ne[1] * ne[2] * ne[3]
    if n_threads <= 1 or n_rows <= 1:
        return launch(kernel, 0, n_rows, *args)
    return split(row_split(kernel, len(args)), 0, n_rows, *args, parts=split_parts(n_threads, n_rows))
