"""ADD, MUL (b broadcast over a), SCALE, SILU, GELU (tanh / erf / quick), GLU (swiglu, geglu).

All F32. Rows (ne0) are the unit of work: each family has one serial `*_rows(r0, r1, ...)` kernel
over a range of the ne1*ne2*ne3 rows, run directly on one thread (small ops) or split in
n_threads parts (`common.rows_launch`).
GELU (tanh) and GELU_QUICK follow ggml's CPU: the input is rounded to F16 and looked up in a
65536-entry table of F16 results (GGML_GELU_FP16); GELU returns 0 for x <= -10 and x for
x >= 10. GELU_ERF is plain F32. SILU and the swiglu GLU on unit-stride rows are ggml's
ggml_vec_silu_f32 / ggml_vec_swiglu_f32 for the ISA variant's float form (`ggx_cpu.isa.vmath`):
ggml_v_silu, x / (1 + exp(-x)) with the vectorized expf, over chunks of 16 (AVX-512) or 8
(AVX2) values, and ggml_silu_f32 (libm expf) on the tail; strided rows use the scalar form.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ggx.errors import GGXShapeError
from ggx.ops import GeluKind, GluKind
from ggx.tensor import Tensor
from ggx.types import GType

from .. import isa
from ..isa.vmath import expf, float_simd, lanes, silu_chunk, swiglu_chunk
from .common import Launch, elems, need_ne, need_srcs, need_type, rows_launch
from .convert import f32_to_f16

# unary codes
SCALE, SILU, GELU, GELU_ERF, GELU_QUICK = 0, 1, 2, 3, 4
# binary codes
ADD, MUL = 0, 1

_tables: dict[str, np.ndarray] = {}


def gelu_table(kind: str) -> np.ndarray:
    """ggml_table_gelu_f16 / ggml_table_gelu_quick_f16 as float32: f16(act(f16 value i)) for bits i.

    float32 arithmetic as in ggml's C (as GCC compiles it); tanhf/expf are taken from float64 and
    rounded once, as glibc's correctly rounded float functions give (numpy's float32 tanh is 1 ulp
    off near -1, and that ulp survives the F16 rounding for x around -5).
    """
    tab = _tables.get(kind)
    if tab is None:
        f32 = np.float32
        x = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
        with np.errstate(all="ignore"):
            if kind == "tanh":
                # ggml's build contracts 1 + a*x*x into fma(a*x, x, 1): one rounding (a product of
                # two float32 is exact in float64)
                inner = (f32(0.044715) * x).astype(np.float64) * x.astype(np.float64) + 1.0
                arg = f32(0.7978845608028654) * x * inner.astype(np.float32)
                th = np.tanh(arg.astype(np.float64)).astype(np.float32)
                y = f32(0.5) * x * (f32(1.0) + th)
            else:
                ex = np.exp((f32(-1.702) * x).astype(np.float64)).astype(np.float32)
                y = x * (f32(1.0) / (f32(1.0) + ex))
            tab = _tables[kind] = y.astype(np.float16).astype(np.float32)
    return tab


@njit(cache=True, inline="always")
def silu(x):
    """ggml_silu_f32: x / (1 + expf(-x)) (libm's expf bits, inline)."""
    return x / (np.float32(1.0) + expf(-x))


@njit(cache=True, inline="always")
def gelu_lut(x, table):
    if x <= np.float32(-10.0):
        return np.float32(0.0)
    if x >= np.float32(10.0):
        return x
    return table[f32_to_f16(x)]


@njit(cache=True, inline="always")
def gelu_erf(x):
    return np.float32(0.5 * x * (1.0 + math.erf(x * 0.7071067811865476)))


@njit(cache=True, inline="always")
def activate(code, x, table):
    if code == SILU:
        return silu(x)
    if code == GELU:
        return gelu_lut(x, table)
    if code == GELU_QUICK:
        return table[f32_to_f16(x)]
    return gelu_erf(x)


@njit(cache=True, inline="always")
def _unary_row(code, s, b, table, x, y):
    if code == SCALE:
        for i in range(x.size):
            y[i] = x[i] * s + b
    else:
        for i in range(x.size):
            y[i] = activate(code, x[i], table)


@njit(cache=True, inline="always")
def _silu_row(fs, x, xb, y, yb, n, u, ub):
    """y[yb + i] = silu(x[xb + i]) (times u[ub + i] when u has elements: swiglu) for i < n on
    unit-stride rows, as ggml_vec_silu_f32 / ggml_vec_swiglu_f32: vectors over chunks of
    lanes(fs), the scalar form on the tail."""
    gated = u.size > 0
    i = 0
    while i + lanes(fs) <= n:
        if gated:
            swiglu_chunk(fs, y, yb + i, x, xb + i, u, ub + i)
        else:
            silu_chunk(fs, y, yb + i, x, xb + i, u, ub + i)
        i += lanes(fs)
    while i < n:
        y[yb + i] = silu(x[xb + i]) * u[ub + i] if gated else silu(x[xb + i])
        i += 1


@njit(cache=True)
def unary_rows(r0, r1, fs, code, s, b, table, x, xo, xs, ne, y, yo, ys):
    """y = f(x) elementwise over rows r0..r1-1 of ne; SCALE: y = x*s + b. Rows are passed on as
    1-D slices, unit-stride ones separately so that LLVM vectorizes them (SILU: explicit vectors)."""
    n0, n1, n2 = ne[0], ne[1], ne[2]
    for r in range(r0, r1):
        i1, i2, i3 = r % n1, (r // n1) % n2, r // (n1 * n2)
        xb = xo + i1 * xs[1] + i2 * xs[2] + i3 * xs[3]
        yb = yo + i1 * ys[1] + i2 * ys[2] + i3 * ys[3]
        if xs[0] == 1 and ys[0] == 1 and code == SILU:
            _silu_row(fs, x, xb, y, yb, n0, x[:0], 0)
        elif xs[0] == 1 and ys[0] == 1:
            _unary_row(code, s, b, table, x[xb: xb + n0], y[yb: yb + n0])
        else:
            _unary_row(code, s, b, table, x[xb: xb + (n0 - 1) * xs[0] + 1: xs[0]],
                       y[yb: yb + (n0 - 1) * ys[0] + 1: ys[0]])


@njit(cache=True, inline="always")
def _binary_row(code, a, b, d):
    if code == ADD:
        for i in range(d.size):
            d[i] = a[i] + b[i]
    else:
        for i in range(d.size):
            d[i] = a[i] * b[i]


@njit(cache=True)
def binary_rows(r0, r1, code, a, ao, as_, ne, b, bo, bs, bne, d, do, ds):
    """d = a (op) b over rows r0..r1-1, b repeated over a: b index = i % b.ne per dim."""
    n0, n1, n2 = ne[0], ne[1], ne[2]
    for r in range(r0, r1):
        i1, i2, i3 = r % n1, (r // n1) % n2, r // (n1 * n2)
        ab = ao + i1 * as_[1] + i2 * as_[2] + i3 * as_[3]
        bb = bo + (i1 % bne[1]) * bs[1] + (i2 % bne[2]) * bs[2] + (i3 % bne[3]) * bs[3]
        db = do + i1 * ds[1] + i2 * ds[2] + i3 * ds[3]
        if bne[0] == n0 and as_[0] == 1 and bs[0] == 1 and ds[0] == 1:
            _binary_row(code, a[ab: ab + n0], b[bb: bb + n0], d[db: db + n0])
        elif bne[0] == n0:
            _binary_row(code, a[ab: ab + (n0 - 1) * as_[0] + 1: as_[0]], b[bb: bb + (n0 - 1) * bs[0] + 1: bs[0]],
                        d[db: db + (n0 - 1) * ds[0] + 1: ds[0]])
        else:
            for i in range(n0):
                bv = b[bb + (i % bne[0]) * bs[0]]
                d[db + i * ds[0]] = a[ab + i * as_[0]] + bv if code == ADD else a[ab + i * as_[0]] * bv


@njit(cache=True, inline="always")
def _glu_row(code, table, g, u, d):
    for i in range(d.size):
        d[i] = activate(code, g[i], table) * u[i]


@njit(cache=True)
def glu_rows(r0, r1, fs, code, table, g, go, gs, u, uo, us, ne, d, do, ds):
    """d = act(gate) * up over rows r0..r1-1; gate and up are separate operands (fused rows pass
    shifted offsets)."""
    n0, n1, n2 = ne[0], ne[1], ne[2]
    for r in range(r0, r1):
        i1, i2, i3 = r % n1, (r // n1) % n2, r // (n1 * n2)
        gb = go + i1 * gs[1] + i2 * gs[2] + i3 * gs[3]
        ub = uo + i1 * us[1] + i2 * us[2] + i3 * us[3]
        db = do + i1 * ds[1] + i2 * ds[2] + i3 * ds[3]
        if gs[0] == 1 and us[0] == 1 and ds[0] == 1 and code == SILU:
            _silu_row(fs, g, gb, d, db, n0, u, ub)
        elif gs[0] == 1 and us[0] == 1 and ds[0] == 1:
            _glu_row(code, table, g[gb: gb + n0], u[ub: ub + n0], d[db: db + n0])
        else:
            _glu_row(code, table, g[gb: gb + (n0 - 1) * gs[0] + 1: gs[0]], u[ub: ub + (n0 - 1) * us[0] + 1: us[0]],
                     d[db: db + (n0 - 1) * ds[0] + 1: ds[0]])


_NO_TABLE = np.zeros(1, np.float32)


def _unary(node: Tensor, n_threads: int, code: int, s: float = 0.0, b: float = 0.0,
           table: np.ndarray = _NO_TABLE) -> Launch:
    op = node.op.name
    need_srcs(node, 1)
    src = node.src[0]
    need_type(src, "a", op, GType.F32)
    need_type(node, "dst", op, GType.F32)
    need_ne(node, src.ne, "dst", op)
    x, xo, xs, ne = elems(src, "a", op)
    y, yo, ys, _ = elems(node, "dst", op)
    return rows_launch(unary_rows, n_threads, ne, float_simd(isa.active()), code, np.float32(s),
                       np.float32(b), table, x, xo, xs, ne, y, yo, ys)


def scale(node: Tensor, n_threads: int) -> Launch:
    return _unary(node, n_threads, SCALE, node.params.s, node.params.b)


def silu_op(node: Tensor, n_threads: int) -> Launch:
    return _unary(node, n_threads, SILU)


def gelu(node: Tensor, n_threads: int) -> Launch:
    kind = node.params.kind if node.params is not None else GeluKind.TANH
    if kind is GeluKind.TANH:
        return _unary(node, n_threads, GELU, table=gelu_table("tanh"))
    elif kind is GeluKind.QUICK:
        return _unary(node, n_threads, GELU_QUICK, table=gelu_table("quick"))
    else:
        return _unary(node, n_threads, GELU_ERF)


def _binary(node: Tensor, n_threads: int, code: int) -> Launch:
    op = node.op.name
    need_srcs(node, 2)
    a, b = node.src[0], node.src[1]
    for role, t in (("a", a), ("b", b), ("dst", node)):
        need_type(t, role, op, GType.F32)
    need_ne(node, a.ne, "dst", op)
    if any(bn == 0 or an % bn for an, bn in zip(a.ne, b.ne)):
        raise GGXShapeError(f"{op}: b {b.describe()} does not broadcast over a {a.describe()}")
    aa, ao, as_, ne = elems(a, "a", op)
    bb, bo, bs, bne = elems(b, "b", op)
    dd, do, ds, _ = elems(node, "dst", op)
    return rows_launch(binary_rows, n_threads, ne, code, aa, ao, as_, ne, bb, bo, bs, bne, dd, do, ds)


def add(node: Tensor, n_threads: int) -> Launch:
    return _binary(node, n_threads, ADD)


def mul(node: Tensor, n_threads: int) -> Launch:
    return _binary(node, n_threads, MUL)


def glu(node: Tensor, n_threads: int) -> Launch:
    """ggml_glu: fused (one source, rows [gate | up], swapped: [up | gate]) or split (gate=a, up=b)."""
    op = "GLU"
    need_srcs(node, 1)
    a = node.src[0]
    kind, swapped = node.params.kind, node.params.swapped
    code, table = (SILU, _NO_TABLE) if kind is GluKind.SWIGLU else (GELU, gelu_table("tanh"))
    need_type(a, "a", op, GType.F32)
    need_type(node, "dst", op, GType.F32)
    g, go, gs, ane = elems(a, "a", op)
    d, do, ds, ne = elems(node, "dst", op)
    if len(node.src) > 1 and node.src[1] is not None:
        b = node.src[1]
        need_type(b, "b", op, GType.F32)
        need_ne(b, a.ne, "b", op)
        need_ne(node, a.ne, "dst", op)
        u, uo, us, _ = elems(b, "b", op)
    else:
        nc = ane[0] // 2
        if ane[0] != 2 * nc or ne != (nc,) + ane[1:]:
            raise GGXShapeError(f"GLU: fused input {a.describe()} must have 2x the row of dst {node.describe()}")
        u, uo, us = g, go + (0 if swapped else nc * gs[0]), gs
        go = go + (nc * gs[0] if swapped else 0)
    return rows_launch(glu_rows, n_threads, ne, float_simd(isa.active()), code, table,
                       g, go, gs, u, uo, us, ne, d, do, ds)
