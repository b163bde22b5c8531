"""SUM_ROWS: out[0, i1, i2, i3] = sum over ne0, accumulated in float64 (ggml_vec_sum_f32)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ggx.tensor import Tensor
from ggx.types import GType

from .common import Launch, elems, launch, need_ne, need_srcs, need_type


@njit(cache=True, parallel=True)
def sum_rows_kernel(x, xo, xs, ne, y, yo, ys):
    n1, n2 = ne[1], ne[2]
    for r in prange(ne[1] * ne[2] * ne[3]):
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
    return launch(sum_rows_kernel, x, xo, xs, ne, y, yo, ys, n_threads=n_threads)
