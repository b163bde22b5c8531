"""RMS_NORM and NORM over each row (ne0), F32, sums in float64 like ggml (ggml_float)."""
from __future__ import annotations

import numpy as np
from numba import njit

from ggx.tensor import Tensor
from ggx.types import GType

from .common import Launch, elems, need_ne, need_srcs, need_type, rows_launch

RMS, MEAN_VAR = 0, 1

# error_model="numpy": IEEE division as in ggml's C, so a zero row with eps 0 gives 1/sqrt(0) =
# inf and 0 * inf = NaN (ggml_compute_forward_rms_norm_f32) instead of raising ZeroDivisionError.

@njit(cache=True, inline="always", error_model="numpy")
def _norm_row(code, eps, x, y):
    n0 = x.size
    if code == RMS:
        acc = 0.0
        for i in range(n0):
            acc += np.float64(x[i] * x[i])
        mean = np.float32(acc / n0)
        sc = np.float32(1.0) / np.float32(np.sqrt(mean + eps))
        for i in range(n0):
            y[i] = x[i] * sc
    else:
        acc = 0.0
        for i in range(n0):
            acc += np.float64(x[i])
        mean = np.float32(acc / n0)
        acc2 = 0.0
        for i in range(n0):
            v = x[i] - mean
            y[i] = v
            acc2 += np.float64(v * v)
        var = np.float32(acc2 / n0)
        sc = np.float32(1.0) / np.float32(np.sqrt(var + eps))
        for i in range(n0):
            y[i] *= sc


@njit(cache=True, error_model="numpy")
def norm_rows(r0, r1, code, eps, x, xo, xs, ne, y, yo, ys):
    """Rows r0..r1-1. RMS: y = x / sqrt(mean(x^2) + eps).
    MEAN_VAR: y = (x - mean) / sqrt(mean((x - mean)^2) + eps)."""
    n0, n1, n2 = ne[0], ne[1], ne[2]
    for r in range(r0, r1):
        i1, i2, i3 = r % n1, (r // n1) % n2, r // (n1 * n2)
        xb = xo + i1 * xs[1] + i2 * xs[2] + i3 * xs[3]
        yb = yo + i1 * ys[1] + i2 * ys[2] + i3 * ys[3]
        if xs[0] == 1 and ys[0] == 1:  # unit-stride slices vectorize
            _norm_row(code, eps, x[xb: xb + n0], y[yb: yb + n0])
        else:
            _norm_row(code, eps, x[xb: xb + (n0 - 1) * xs[0] + 1: xs[0]], y[yb: yb + (n0 - 1) * ys[0] + 1: ys[0]])


def _norm(node: Tensor, n_threads: int, code: int) -> Launch:
    op = node.op.name
    need_srcs(node, 1)
    src = node.src[0]
    need_type(src, "a", op, GType.F32)
    need_type(node, "dst", op, GType.F32)
    need_ne(node, src.ne, "dst", op)
    x, xo, xs, ne = elems(src, "a", op)
    y, yo, ys, _ = elems(node, "dst", op)
    return rows_launch(norm_rows, n_threads, ne, code, np.float32(node.params.eps),
                       x, xo, xs, ne, y, yo, ys)


def rms_norm(node: Tensor, n_threads: int) -> Launch:
    return _norm(node, n_threads, RMS)


def norm(node: Tensor, n_threads: int) -> Launch:
    return _norm(node, n_threads, MEAN_VAR)
