"""What every kernel wrapper does before a numba kernel runs: check the tensors, hand out memory.

Kernels receive a tensor as (a 1-D array over its *whole* host buffer, the offset of element
(0,0,0,0), four strides, four sizes), all in units of the array's element, so any view (strided,
permuted, offset) reaches a kernel without a copy. These helpers prove, before the kernel runs,
that every index the kernel can form (0 <= i_k < ne_k) stays inside that array: numba does not
check bounds.
"""
from __future__ import annotations

import numpy as np

from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.host import HostBuffer
from ggx.tensor import Tensor
from ggx.types import GType

#: numpy element type a kernel sees for each element type (F16/BF16 as raw bits).
ELEM_DTYPES = {GType.F32: np.float32, GType.F16: np.uint16, GType.BF16: np.uint16,
               GType.I32: np.int32, GType.I64: np.int64}

Int4 = tuple[int, int, int, int]


def host_bytes(t: Tensor, role: str, op: str) -> tuple[np.ndarray, int]:
    """(uint8 array of t's whole host buffer, byte offset of t's first element), bounds checked."""
    buf = t.data_buffer
    if buf is None:
        raise GGXUnsupported(f"{op}: {role} {t.describe()} has no storage")
    if not isinstance(buf, HostBuffer):
        raise GGXUnsupported(f"{op}: {role} {t.describe()} lives in {buf.buft.name}, not host memory")
    if any(x < 0 for x in t.nb):
        raise GGXShapeError(f"{op}: {role} {t.describe()} has a negative stride {list(t.nb)}")
    if t.data_offset < 0 or t.data_offset + t.nbytes > buf.data.size:
        raise GGXShapeError(f"{op}: {role} {t.describe()} at byte {t.data_offset} (+{t.nbytes}) overruns "
                            f"its {buf.data.size}-byte buffer")
    return buf.data, t.data_offset


def elems(t: Tensor, role: str, op: str) -> tuple[np.ndarray, int, Int4, Int4]:
    """(typed 1-D array over t's buffer, element offset, element strides, ne) for an element type."""
    dtype = ELEM_DTYPES.get(t.type)
    if dtype is None:
        raise GGXUnsupported(f"{op}: {role} {t.describe()} is not an element type")
    data, off = host_bytes(t, role, op)
    size = t.type.type_size
    if off % size or any(nb % size for nb in t.nb):
        raise GGXUnsupported(f"{op}: {role} {t.describe()} (offset {off}, nb {list(t.nb)}) is not aligned to "
                             f"its {size}-byte elements")
    if t.nb[0] == 0 and t.ne[0] > 1:
        raise GGXUnsupported(f"{op}: {role} {t.describe()} repeats one element along ne0 (nb0 = 0)")
    arr = data[: data.size // size * size].view(dtype)
    st = tuple(nb // size for nb in t.nb)
    # a row of one element may have any nb0; kernels slice rows with step st[0], which must be > 0
    st = (st[0] if t.ne[0] > 1 else 1,) + st[1:]
    return arr, off // size, st, tuple(int(x) for x in t.ne)


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


def index_values(t: Tensor, role: str, op: str, bound: int) -> None:
    """Check the I32/I64 index tensor `t` holds only values in [0, bound) (data known only now)."""
    arr, off, st, ne = elems(t, role, op)
    if 0 in ne:
        return
    view = np.lib.stride_tricks.as_strided(arr[off:], shape=ne[::-1], strides=tuple(s * arr.itemsize for s in st[::-1]))
    lo, hi = int(view.min()), int(view.max())
    if lo < 0 or hi >= bound:
        raise GGXShapeError(f"{op}: {role} {t.describe()} holds index {lo if lo < 0 else hi}, outside 0..{bound - 1}")
