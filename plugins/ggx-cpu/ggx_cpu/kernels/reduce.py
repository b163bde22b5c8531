"""SUM_ROWS: out[0, i1, i2, i3] = sum over ne0, accumulated in float64 (ggml_vec_sum_f32)."""
from __future__ import annotations

import numpy as np
from numba import njit

from ggx.tensor import Tensor
from ggx.types import GType

from .common import Launch, elems, need_ne, need_srcs, need_type, rows_launch


@njit(cache=True)
def sum_rows_rows(r0, r1, x, xo, xs, ne, y, yo, ys):
    """Rows r0..r1-1 of the ne1*ne2*ne3."""
    n1, n2 = ne[1], ne[2]
    for r in range(r0, r1):
        i1, i2, i3 = r % n1, (r // n1) % n2, r // (n1 * n2)
        xb = xo + i1 * xs[1] + i2 * xs[2] + i3 * xs[3]
        acc = 0.0
        for i in range(ne[0]):
            acc += np.float64(x[xb + i * xs[0]])
        y[yo + i1 * ys[1] + i2 * ys[2] + i3 * ys[3]] = np.float32(acc)


def sum_rows(node: Tensor, n_threads: int) -> Launch:
    op = "SUM_ROWS"
    need_srcs(node, 1)
    src = node.src[0]
    need_type(src, "a", op, GType.F32)
    need_type(node, "dst", op, GType.F32)
    need_ne(node, (1,) + tuple(src.ne[1:]), "dst", op)
    x, xo, xs, ne = elems(src, "a", op)
    y, yo, ys, _ = elems(node, "dst", op)
    return rows_launch(sum_rows_rows, n_threads, ne, x, xo, xs, ne, y, yo, ys)
