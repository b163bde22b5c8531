"""Fuzzing every op's graph builder with random shapes, strides and types (hypothesis).

For each op: build a graph from random inputs. The builder either refuses with GGXShapeError
(never another exception) or accepts; an accepted graph must be supported by the reference
backend and compute there without NaN/inf from finite inputs, guards intact. Examples are
derandomized (the same every run, so CI is stable) and counted per op (printed with -s).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggx.conformance.case import Builder
from ggx.conformance.harness import check_guards, prepare, unsupported_nodes
from ggx.errors import GGXShapeError
from ggx.graph import build_graph
from ggx.ops import GeluKind, GluKind, RopeMode, SortOrder
from ggx.reference import RefBackendReg
from ggx.tensor_data import get_tensor_data
from ggx.types import GType

EXAMPLES = 60
REF = RefBackendReg().devices()[0]
BACKEND = REF.init_backend()
COUNTS: dict[str, Counter] = {}

ANY_TYPE = st.sampled_from(list(GType))
MOSTLY_F32 = st.sampled_from([GType.F32] * 6 + [GType.F16, GType.Q4_0, GType.I32])
INDEX_TYPE = st.sampled_from([GType.I32] * 4 + [GType.I64, GType.F32])
NE0 = st.sampled_from([1, 2, 3, 7, 16, 32, 64, 256])
DIM = st.integers(1, 4)
LAYOUT = st.sampled_from(["contiguous"] * 3 + ["transposed", "permuted", "row_strided"])


def shape(draw, ndim=None):
    ndim = ndim or draw(st.integers(1, 4))
    return (draw(NE0),) + tuple(draw(DIM) for _ in range(ndim - 1))


def tensor(draw, b: Builder, name: str, gtype=None, ne=None, layout=None, high: int | None = None):
    """A random input: type, shape and layout drawn unless given; index types get values in [0, high)."""
    gtype = gtype or draw(MOSTLY_F32)
    ne = tuple(ne or shape(draw))
    ne = ne + (1,) * (4 - len(ne))
    layout = layout or draw(LAYOUT)
    if gtype in (GType.I32, GType.I64):
        return b.indices(gtype, ne, name, max(1, high or 4))
    if layout == "transposed":
        return b.transposed(gtype, ne, name)
    if layout == "permuted":
        return b.permuted(gtype, ne, draw(st.permutations(range(4))), name)
    if layout == "row_strided":
        return b.row_strided(gtype, ne, name)
    return b.uniform(gtype, ne, name)


# One builder per op: draws its inputs and parameters, returns the output tensor.
def f_get_rows(draw, b):
    a = tensor(draw, b, "a", draw(ANY_TYPE))
    ids = tensor(draw, b, "ids", draw(INDEX_TYPE), (draw(DIM), a.ne[2], a.ne[3]), "contiguous", a.ne[1])
    return b.ctx.get_rows(a, ids)


def f_set_rows(draw, b):
    dst = tensor(draw, b, "dst", draw(ANY_TYPE), layout="contiguous")
    n = draw(st.integers(1, dst.ne[1]))
    src = tensor(draw, b, "src", draw(MOSTLY_F32), (dst.ne[0], n, dst.ne[2], dst.ne[3]), "contiguous")
    rows = np.stack([b.rng.permutation(dst.ne[1])[:n] for _ in range(dst.ne[2] * dst.ne[3])])
    it = draw(INDEX_TYPE)
    ids = (b.ints(it, (n, dst.ne[2], dst.ne[3]), "ids", rows) if it is not GType.F32
           else b.uniform(it, (n, dst.ne[2], dst.ne[3]), "ids"))
    return b.ctx.set_rows(dst, src, ids)


def f_cpy(draw, b):
    a = tensor(draw, b, "a")
    ne = a.ne if draw(st.booleans()) else tuple(reversed(a.ne))
    return b.ctx.cpy(a, b.leaf(draw(ANY_TYPE), ne, "b"))


def f_dup(draw, b):
    return b.ctx.dup(tensor(draw, b, "a"))


def f_cont(draw, b):
    a = tensor(draw, b, "a")
    return b.ctx.cont(a, tuple(reversed(a.ne)) if draw(st.booleans()) else None)


def f_view(draw, b):
    a = tensor(draw, b, "a", layout="contiguous")
    ne = shape(draw, 2)
    return b.ctx.view(a, ne, (draw(st.integers(1, 4)) * a.nb[1],), offset=draw(st.sampled_from([0, 4, 18, 64])))


def f_reshape(draw, b):
    a = tensor(draw, b, "a")
    return b.ctx.reshape(a, draw(st.sampled_from([(a.nelements,), tuple(reversed(a.ne)), (a.ne[0], a.nrows)])))


def f_permute(draw, b):
    return b.ctx.permute(tensor(draw, b, "a"), *draw(st.permutations(range(4))))


def f_transpose(draw, b):
    return b.ctx.transpose(tensor(draw, b, "a"))


def _binary(fn):
    def build(draw, b):
        a = tensor(draw, b, "a")
        ne_b = tuple(n if draw(st.booleans()) else draw(st.sampled_from([1, n, n + 1])) for n in a.ne)
        return getattr(b.ctx, fn)(a, tensor(draw, b, "b", draw(MOSTLY_F32), ne_b, "contiguous"))
    return build


def f_scale(draw, b):
    return b.ctx.scale(tensor(draw, b, "a"), draw(st.floats(-10, 10)), draw(st.floats(-1, 1)))


def f_silu(draw, b):
    return b.ctx.silu(tensor(draw, b, "a"))


def f_gelu(draw, b):
    return b.ctx.gelu(tensor(draw, b, "a"), draw(st.sampled_from(list(GeluKind))))


def f_glu(draw, b):
    a = tensor(draw, b, "a")
    other = tensor(draw, b, "b", ne=a.ne if draw(st.booleans()) else None) if draw(st.booleans()) else None
    return b.ctx.glu(a, other, draw(st.sampled_from(list(GluKind))), draw(st.booleans()))


def f_rms_norm(draw, b):
    return b.ctx.rms_norm(tensor(draw, b, "a"), draw(st.sampled_from([1e-6, 1e-5])))


def f_norm(draw, b):
    return b.ctx.norm(tensor(draw, b, "a"), draw(st.sampled_from([1e-6, 1e-5])))


def f_sum_rows(draw, b):
    return b.ctx.sum_rows(tensor(draw, b, "a"))


def f_mul_mat(draw, b):
    a = tensor(draw, b, "a", draw(ANY_TYPE))
    k = a.ne[0] if draw(st.integers(0, 5)) else draw(NE0)
    ne_b = (k, draw(DIM), a.ne[2] * draw(st.integers(1, 2)), a.ne[3] * draw(st.integers(1, 2)))
    return b.ctx.mul_mat(a, tensor(draw, b, "b", draw(MOSTLY_F32), ne_b))


def f_mul_mat_id(draw, b):
    n_expert = draw(st.integers(1, 4))
    experts = tensor(draw, b, "as", draw(ANY_TYPE), (draw(NE0), draw(DIM), n_expert), "contiguous")
    n_used, n_tokens = draw(st.integers(1, 5)), draw(DIM)
    b_ne1 = draw(st.sampled_from([1, n_used, n_used + 1]))
    act = tensor(draw, b, "b", draw(MOSTLY_F32), (experts.ne[0], b_ne1, n_tokens))
    ids = tensor(draw, b, "ids", draw(INDEX_TYPE), (n_used, n_tokens), "contiguous", n_expert)
    return b.ctx.mul_mat_id(experts, act, ids)


def f_rope(draw, b):
    a = tensor(draw, b, "a", ne=(draw(st.sampled_from([2, 8, 64, 7])), draw(DIM), draw(DIM)))
    pos = tensor(draw, b, "pos", draw(INDEX_TYPE), (draw(st.sampled_from([a.ne[2], a.ne[2] + 1])),), "contiguous", 99)
    return b.ctx.rope(a, pos, draw(st.sampled_from([2, 4, 8, 64, 3])), draw(st.sampled_from(list(RopeMode))),
                      freq_scale=draw(st.sampled_from([1.0, 0.25])))


def f_soft_max(draw, b):
    a = tensor(draw, b, "a")
    mask = None
    if draw(st.booleans()):
        rows = a.ne[1] + draw(st.integers(-1, 2))
        mask = tensor(draw, b, "mask", draw(st.sampled_from([GType.F16, GType.F32, GType.Q8_0])),
                      (a.ne[0], max(rows, 1)), "contiguous")
    return b.ctx.soft_max(a, mask, draw(st.sampled_from([1.0, 0.125])), draw(st.sampled_from([0.0, 8.0])))


def f_flash_attn_ext(draw, b):
    d, n_kv, hkv = draw(st.sampled_from([32, 64, 7])), draw(st.integers(1, 40)), draw(st.integers(1, 2))
    kv_t = draw(st.sampled_from([GType.F16, GType.F32, GType.Q8_0]))
    q = tensor(draw, b, "q", draw(MOSTLY_F32), (d, draw(DIM), hkv * draw(st.integers(1, 3))))
    k = tensor(draw, b, "k", kv_t, (d, n_kv, hkv))
    v = tensor(draw, b, "v", kv_t, (draw(st.sampled_from([d, d + 1])), n_kv, hkv))
    mask = None
    if draw(st.booleans()):
        mask = tensor(draw, b, "mask", draw(st.sampled_from([GType.F16, GType.F32])),
                      (n_kv, q.ne[1] + draw(st.integers(-1, 1))), "contiguous")
    return b.ctx.flash_attn_ext(q, k, v, mask, 1.0 / np.sqrt(d), draw(st.sampled_from([0.0, 8.0])),
                                draw(st.sampled_from([0.0, 30.0])))


def f_argsort(draw, b):
    return b.ctx.argsort(tensor(draw, b, "a"), draw(st.sampled_from(list(SortOrder))))


def f_top_k(draw, b):
    a = tensor(draw, b, "a")
    return b.ctx.top_k(a, draw(st.integers(0, a.ne[0] + 1)))


FUZZ = {
    "GET_ROWS": f_get_rows, "SET_ROWS": f_set_rows, "CPY": f_cpy, "DUP": f_dup, "CONT": f_cont, "VIEW": f_view,
    "RESHAPE": f_reshape, "PERMUTE": f_permute, "TRANSPOSE": f_transpose, "ADD": _binary("add"),
    "MUL": _binary("mul"), "SCALE": f_scale, "SILU": f_silu, "GELU": f_gelu, "GLU": f_glu, "RMS_NORM": f_rms_norm,
    "NORM": f_norm, "SUM_ROWS": f_sum_rows, "MUL_MAT": f_mul_mat, "MUL_MAT_ID": f_mul_mat_id, "ROPE": f_rope,
    "SOFT_MAX": f_soft_max, "FLASH_ATTN_EXT": f_flash_attn_ext, "ARGSORT": f_argsort, "TOP_K": f_top_k,
}


def compute_on_ref(b: Builder) -> None:
    graph = build_graph(b.out)
    missing = unsupported_nodes(REF, graph)
    assert not missing, f"the builder accepted {missing[0].describe()} but the reference does not support it"
    graph, placement = prepare(REF, b.out, b.inputs, graph)
    BACKEND.graph_compute(graph)
    BACKEND.synchronize()
    assert not check_guards(placement)
    out = b.out
    if out.type.is_quantized and not out.is_contiguous():
        return  # a strided view of blocks has no value order to read; guards were checked
    values = get_tensor_data(out)
    if out.type.is_float or out.type.is_quantized:
        assert np.isfinite(values).all(), f"non-finite values in {out.describe()} from finite inputs"


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print("\nfuzz examples per op (accepted / refused with GGXShapeError):")
    for op, c in sorted(COUNTS.items()):
        print(f"  {op:15s} {c['accepted']:3d} / {c['refused']:3d}")


@pytest.mark.parametrize("op", sorted(FUZZ))
def test_fuzz_builder_and_reference(op):
    counts = COUNTS.setdefault(op, Counter())

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(st.data())
    def run(data):
        b = Builder(f"fuzz-{op}")
        try:
            b.out = FUZZ[op](data.draw, b)
        except GGXShapeError:
            counts["refused"] += 1
            return
        counts["accepted"] += 1
        compute_on_ref(b)

    run()
    assert counts["accepted"] >= 5, f"{op}: the strategy almost never builds a valid graph ({counts})"
