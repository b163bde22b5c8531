"""ARGSORT (ascending / descending) and TOP_K over each row (ne0) of an F32 tensor -> I32 indices.

Ties keep index order (a stable sort; ggml's std::sort leaves tie order unspecified). TOP_K
returns the indices of the k largest values in descending order and then, like ggml's CPU
backend, swaps the first two on purpose: the order is not part of TOP_K's contract.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ggx.errors import GGXShapeError
from ggx.ops import SortOrder
from ggx.tensor import Tensor
from ggx.types import GType

from .common import Launch, elems, need_ne, need_srcs, need_type, rows_launch


@njit(cache=True)
def sort_rows(r0, r1, desc, k, swap_first, x, xo, xs, ne, y, yo, ys):
    """y[:k] of rows r0..r1-1 = the first k indices of a (stable) argsort of each row."""
    n0, n1, n2 = ne[0], ne[1], ne[2]
    for r in range(r0, r1):
        i1, i2, i3 = r % n1, (r // n1) % n2, r // (n1 * n2)
        xb = xo + i1 * xs[1] + i2 * xs[2] + i3 * xs[3]
        yb = yo + i1 * ys[1] + i2 * ys[2] + i3 * ys[3]
        row = np.empty(n0, np.float32)
        for i in range(n0):
            row[i] = -x[xb + i * xs[0]] if desc else x[xb + i * xs[0]]
        idx = np.argsort(row, kind="mergesort")
        for i in range(k):
            y[yb + i * ys[0]] = np.int32(idx[i])
        if swap_first and k > 1:
            t = y[yb]
            y[yb] = y[yb + ys[0]]
            y[yb + ys[0]] = t


def _sort(node: Tensor, n_threads: int, desc: bool, k: int, swap_first: bool) -> Launch:
    op = node.op.name
    need_srcs(node, 1)
    a = node.src[0]
    need_type(a, "a", op, GType.F32)
    need_type(node, "dst", op, GType.I32)
    if not 1 <= k <= a.ne[0] and a.ne[0] > 0:
        raise GGXShapeError(f"{op}: k={k} must be in 1..{a.ne[0]}")
    need_ne(node, (k,) + tuple(a.ne[1:]), "dst", op)
    x, xo, xs, ne = elems(a, "a", op)
    y, yo, ys, _ = elems(node, "dst", op)
    return rows_launch(sort_rows, n_threads, ne, desc, k, swap_first, x, xo, xs, ne, y, yo, ys)


def argsort(node: Tensor, n_threads: int) -> Launch:
    return _sort(node, n_threads, node.params.order is SortOrder.DESC, node.src[0].ne[0] if node.src else 0, False)


def top_k(node: Tensor, n_threads: int) -> Launch:
    return _sort(node, n_threads, True, node.params.k, True)
