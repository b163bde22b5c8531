"""ggx.wire: a graph as plain data and back, rebuilt with the graph builder's checks.

Round trips: every conformance case (every op variant of the catalogue) and every split of a
small transformer layer (a scheduler's split: views of tensors made outside it, a KV-cache
write) rebuild node for node and compute to the same bytes on the reference backend.
Refusals: each malformed message raises GGXShapeError naming the problem. Fuzz: mutated
messages decode or raise GGXError, nothing else.
"""
from __future__ import annotations

import math
import random
import reprlib

import numpy as np
import pytest

from ggx import registry, wire
from ggx.alloc import alloc_tensors
from ggx.conformance.cases import op_cases
from ggx.conformance.harness import storage_tensors
from ggx.errors import GGXError, GGXShapeError
from ggx.graph import Context, Graph, build_graph
from ggx.ops import GeluKind, GluKind, Op, RopeMode, SortOrder
from ggx.tensor import Tensor
from ggx.tensor_data import set_tensor_data
from ggx.types import GType

F32, F16, I32, I64, Q4_0 = GType.F32, GType.F16, GType.I32, GType.I64, GType.Q4_0
BUF_ID = 3  # the id the receiver knows the buffer by

REF = registry.get_device("ref")
CASES = [c for c in op_cases() if c.expect_error is None]


# --- helpers --------------------------------------------------------------------------------
def _encode(graph: Graph, buf) -> tuple:
    return wire.encode_graph(graph, lambda b: {id(buf): BUF_ID}[id(b)])


class _Placer:
    """The receiver's `place`: every tensor with storage goes to `buf` at the given offset."""

    def __init__(self, buf):
        self.buf = buf
        self.placed: list[Tensor] = []

    def __call__(self, t: Tensor, buffer_id: int, offset: int) -> None:
        assert buffer_id == BUF_ID
        t.buffer, t.offset = self.buf, offset
        self.buf.init_tensor(t)
        self.placed.append(t)


def _decode(msg, buf) -> tuple[Graph, _Placer]:
    place = _Placer(buf)
    return wire.decode_graph(msg, place), place


def _layout(t: Tensor) -> tuple:
    return (t.op, t.type, t.ne, t.nb, t.params, t.data_offset, t.ndim, t.flags, t.name, t.is_view)


def _assert_same_nodes(graph: Graph, rebuilt: Graph) -> None:
    assert len(rebuilt.nodes) == len(graph.nodes)
    for a, b in zip(graph.nodes, rebuilt.nodes):
        assert _layout(b) == _layout(a), f"{a} rebuilt as {b}"
        # sources: same memory and shape (an outside view comes back as a VIEW of its root)
        assert [(s.type, s.ne, s.nb, s.data_offset) for s in b.src] == \
               [(s.type, s.ne, s.nb, s.data_offset) for s in a.src], a
    for b in rebuilt.leafs:
        assert b.op is Op.NONE and b.is_contiguous() and b.buffer is not None


def _ref_compute(graph: Graph, buf, start: np.ndarray) -> np.ndarray:
    """The whole buffer after computing `graph` from the bytes `start`."""
    buf.host_view()[:] = start
    REF.init_backend().graph_compute(graph)
    return buf.host_view().copy()


def _round_trip(graph: Graph, buf) -> Graph:
    """Encode, decode into the same buffer, check the nodes and that both compute the same bytes."""
    msg = _encode(graph, buf)
    rebuilt, place = _decode(msg, buf)
    _assert_same_nodes(graph, rebuilt)
    # every tensor with its own storage was placed, at the offset it has here
    owners = {(t.type, t.ne, t.data_offset) for t in graph.leafs} | \
             {(n.type, n.ne, n.data_offset) for n in graph.nodes if n.view_src is None}
    assert owners <= {(t.type, t.ne, t.offset) for t in place.placed}
    start = buf.host_view().copy()
    want = _ref_compute(graph, buf, start)
    got = _ref_compute(rebuilt, buf, start)
    assert np.array_equal(got, want), f"{int(np.count_nonzero(got != want))} bytes differ"
    buf.host_view()[:] = start
    return rebuilt


def _placed_case(case):
    b = case.make()
    graph = build_graph(b.out)
    buf = alloc_tensors(REF.buffer_type(), storage_tensors(graph))
    buf.clear(0xFF)
    for leaf, raw in b.inputs.items():
        leaf.buffer.set_tensor(leaf, raw, 0)
    return graph, buf


# --- round trips ------------------------------------------------------------------------------
def test_cases_cover_every_op():
    ops = set()
    for case in CASES:
        ops |= {n.op for n in build_graph(case.make().out).nodes}
    assert ops == set(Op) - {Op.NONE}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_round_trip_case(case):
    graph, buf = _placed_case(case)
    _round_trip(graph, buf)


def _layer():
    """A small decoder layer (a scheduler's graph): embedding rows, norm, Q/K/V with RoPE, K
    written into a cache by SET_ROWS and V by CPY into a view of its cache, flash attention
    over permuted/viewed caches with a mask, a fused and a split GLU, logits with two
    softmaxes, top-k, argsort, a transposed copy and an MoE product."""
    rng = np.random.default_rng(7)
    ctx = Context()
    n_embd, D, H, Hkv, T, n_ctx, n_past, F, V = 64, 16, 4, 2, 3, 8, 2, 32, 16
    leaves: dict[Tensor, np.ndarray] = {}

    def leaf(gtype, ne, name, values=None):
        t = ctx.tensor(gtype, ne, name)
        shape = tuple(reversed(ne))
        leaves[t] = rng.uniform(-1, 1, shape).astype(np.float32) if values is None else values
        return t

    tok_embd = leaf(F32, [n_embd, 20], "tok_embd")
    tokens = leaf(I32, [T], "tokens", rng.integers(0, 20, T))
    pos = leaf(I32, [T], "pos", np.arange(n_past, n_past + T))
    norm_w = leaf(F32, [n_embd], "norm_w")
    wq, wk, wv = (leaf(F32, [n_embd, D * h], n) for h, n in ((H, "wq"), (Hkv, "wk"), (Hkv, "wv")))
    wo = leaf(F32, [D * H, n_embd], "wo")
    cache_k = leaf(F16, [D * Hkv, n_ctx], "cache_k")
    cache_v = leaf(F16, [D * Hkv, n_ctx], "cache_v")
    kv_idx = leaf(I64, [T], "kv_idx", np.arange(n_past, n_past + T))
    mask = leaf(F16, [n_ctx, T], "mask")
    w_gu = leaf(F32, [n_embd, 2 * F], "w_gu")
    w_gate, w_up = leaf(F32, [n_embd, F], "w_gate"), leaf(F32, [n_embd, F], "w_up")
    w_down = leaf(F32, [F, n_embd], "w_down")
    w_out = leaf(F32, [n_embd, V], "w_out")
    mask_lg = leaf(F32, [V, T], "mask_lg")
    experts = leaf(F32, [n_embd, 8, 4], "experts")
    expert_ids = leaf(I32, [2, T], "expert_ids", rng.integers(0, 4, (T, 2)))

    rope = {"freq_base": 1e6, "freq_scale": 0.5, "n_ctx_orig": 256, "ext_factor": 1.0, "attn_factor": 0.9,
            "beta_fast": 16.0, "beta_slow": 2.0}
    x = ctx.get_rows(tok_embd, tokens)
    h = ctx.mul(ctx.rms_norm(x, 1e-5), norm_w)
    q = ctx.rope(ctx.reshape(ctx.mul_mat(wq, h), [D, H, T]), pos, D, RopeMode.NEOX, **rope)
    k = ctx.rope(ctx.reshape(ctx.mul_mat(wk, h), [D, Hkv, T]), pos, D // 2, RopeMode.NORMAL, **rope)
    k_set = ctx.set_rows(cache_k, ctx.reshape(k, [D * Hkv, T]), kv_idx)
    v_dst = ctx.view(cache_v, [D * Hkv, T], [cache_v.nb[1]], offset=n_past * cache_v.nb[1])
    v_store = ctx.cpy(ctx.mul_mat(wv, h), v_dst)  # the KV-cache write: CPY into a view
    kk = ctx.view(k_set, [D, n_ctx, Hkv], [cache_k.nb[1], D * 2])
    vv = ctx.view(cache_v, [D, n_ctx, Hkv], [cache_v.nb[1], D * 2])
    att = ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), kk, vv, mask, 1 / math.sqrt(D), 0.0, 30.0)
    h2 = ctx.add(ctx.mul_mat(wo, ctx.reshape(att, [D * H, T])), x)
    n = ctx.norm(h2, 1e-6)
    fused = ctx.glu(ctx.mul_mat(w_gu, n))
    split = ctx.glu(ctx.mul_mat(w_gate, n), ctx.mul_mat(w_up, n), GluKind.GEGLU, True)
    h3 = ctx.add(h2, ctx.mul_mat(w_down, ctx.add(fused, split)))
    act = ctx.sum_rows(ctx.gelu(ctx.silu(ctx.scale(h3, 0.5, 0.1)), GeluKind.ERF))
    logits = ctx.mul_mat(w_out, h3)
    sm = ctx.soft_max(logits)
    sm_masked = ctx.soft_max(logits, mask_lg, 0.5)
    top = ctx.top_k(logits, 3)
    order = ctx.argsort(logits, SortOrder.DESC)
    tr = ctx.dup(ctx.cont(ctx.transpose(logits)))
    moe = ctx.mul_mat_id(experts, ctx.reshape(h3, [n_embd, 1, T]), expert_ids)
    # v_store first: the graph writes the V cache before attention reads it
    graph = build_graph([v_store, h3, act, sm, sm_masked, top, order, tr, moe])
    buf = alloc_tensors(REF.buffer_type(), storage_tensors(graph))
    buf.clear(0xFF)
    for t, values in leaves.items():
        set_tensor_data(t, values)
    return graph, buf


def test_round_trip_layer():
    graph, buf = _layer()
    assert {n.op for n in graph.nodes} == set(Op) - {Op.NONE}
    _round_trip(graph, buf)


def test_round_trip_splits():
    """Each split `Graph(nodes[k:], [])` of the layer (what a scheduler sends) reads tensors
    made outside it: roots go as leaves, outside views as VIEWs of their root. Computing the
    prefix, then the rebuilt split, gives the bytes of the whole graph."""
    graph, buf = _layer()
    start = buf.host_view().copy()
    want = _ref_compute(graph, buf, start)
    outside_views = 0
    for k in range(1, len(graph.nodes)):
        split = Graph(graph.nodes[k:], [])
        msg = _encode(split, buf)
        tensors, nodes = msg
        assert len(nodes) == len(split.nodes)
        for j in sorted(set(range(len(tensors))) - set(nodes)):  # what the split reads from outside
            m = tensors[j]
            assert m[0] in (Op.NONE.value, Op.VIEW.value), m
            if m[0] == Op.VIEW.value:
                assert m[9] is None and tensors[m[8][0]][0] == Op.NONE.value
                outside_views += 1
        rebuilt, _ = _decode(msg, buf)
        _assert_same_nodes(split, rebuilt)
        _ref_compute(Graph(graph.nodes[:k], graph.leafs), buf, start)
        REF.init_backend().graph_compute(rebuilt)
        got = buf.host_view().copy()
        assert np.array_equal(got, want), f"split at node {k} ({graph.nodes[k]}): bytes differ"
    assert outside_views >= 5


def test_round_trip_outside_view_of_a_computed_tensor():
    """A split reading a permuted and a transposed view of a result another split computed."""
    ctx = Context()
    a = ctx.tensor(F32, [6, 4, 2], "a")
    s = ctx.scale(a, 3.0)
    p = ctx.permute(s, 1, 2, 0, 3)
    t = ctx.transpose(s)
    c1 = ctx.cont(p)
    c2 = ctx.add(c1, c1)
    c3 = ctx.cont(t)
    buf = alloc_tensors(REF.buffer_type(), [a, s, c1, c2, c3])
    set_tensor_data(a, np.random.default_rng(1).uniform(-1, 1, (2, 4, 6)))
    REF.init_backend().graph_compute(Graph([s], [a]))
    split = Graph([c1, c2, c3], [])
    tensors, nodes = _encode(split, buf)
    assert [m[0] for m in tensors] == ["NONE", "VIEW", "CONT", "ADD", "VIEW", "CONT"]
    assert nodes == (2, 3, 5)
    assert (tensors[1][2], tensors[1][3]) == (list(p.ne), list(p.nb))
    assert (tensors[4][2], tensors[4][3]) == (list(t.ne), list(t.nb))
    _round_trip(split, buf)


def test_flags_and_names_travel():
    ctx = Context()
    a = ctx.tensor(F32, [4], "input a").set_flag(1)
    y = ctx.silu(a)
    y.name = "y" * 300
    g = build_graph(y)
    buf = alloc_tensors(REF.buffer_type(), storage_tensors(g))
    tensors, _ = _encode(g, buf)
    assert tensors[0][5] == 1 and tensors[1][5] == 2  # INPUT, OUTPUT (build_graph's)
    assert tensors[1][6] == "y" * wire.MAX_NAME
    rebuilt, _ = _decode((tensors, (1,)), buf)
    assert rebuilt.leafs[0].name == "input a" and int(rebuilt.leafs[0].flags) == 1
    assert int(rebuilt.nodes[0].flags) == 2


def test_encode_refuses_a_node_read_before_it_is_computed():
    ctx = Context()
    a = ctx.tensor(F32, [4], "a")
    s = ctx.scale(a, 2.0)
    y = ctx.silu(s)
    buf = alloc_tensors(REF.buffer_type(), [a, s, y])
    with pytest.raises(GGXShapeError, match="read before it is computed"):
        _encode(Graph([y, s], [a]), buf)


# --- refusals ---------------------------------------------------------------------------------
def _base():
    """A small graph as a mutable message: 0 a, 1 w (leaves), 2 MUL_MAT, 3 SCALE, 4 VIEW, 5 GLU."""
    ctx = Context()
    a = ctx.tensor(F32, [8, 4], "a")
    w = ctx.tensor(F32, [8, 6], "w")
    y = ctx.mul_mat(w, a)
    z = ctx.scale(y, 2.0)
    v = ctx.view(z, [3, 4], [z.nb[1]], 4)
    u = ctx.glu(z, None, GluKind.GEGLU, True)
    graph = Graph([y, z, v, u], [a, w])
    buf = alloc_tensors(REF.buffer_type(), [a, w, y, z, u])
    tensors, nodes = _encode(graph, buf)
    assert [m[0] for m in tensors] == ["NONE", "NONE", "MUL_MAT", "SCALE", "VIEW", "GLU"]
    return [list(m) for m in tensors], list(nodes), buf


def _set(i, field, value):
    def mutate(m):
        m[i][field] = value
    return mutate


REFUSALS = {
    "unknown op": (_set(2, 0, "MATMUL"), r"tensor 2: unknown op or type 'MATMUL'/'F32'"),
    "unknown type": (_set(0, 1, "F64"), r"tensor 0: unknown op or type 'NONE'/'F64'"),
    "op not a string": (_set(2, 0, ["MUL_MAT"]), r"unknown op or type \['MUL_MAT'\]"),
    "ne of 3": (_set(0, 2, [8, 4, 1]), r"tensor 0: ne must be 4 ints"),
    "ne not a list": (_set(0, 2, "8x4"), r"ne must be 4 ints"),
    "negative ne": (_set(0, 2, [8, -4, 1, 1]), r"ne must be an int in 0\.\.\d+, got -4"),
    "float ne": (_set(0, 2, [8.0, 4, 1, 1]), r"ne must be an int in .*got 8\.0"),
    "bool ne": (_set(0, 2, [8, True, 1, 1]), r"ne must be an int in .*got True"),
    "huge ne": (_set(0, 2, [8, 1 << 20000, 1, 1]), r"ne must be an int in 0\.\.\d+, got <int>"),
    "too many elements": (_set(0, 2, [1 << 21, 1 << 21, 1, 1]), r"more than \d+ elements"),
    "negative nb": (_set(0, 3, [4, -32, 128, 128]), r"nb must be an int in"),
    "ndim 0": (_set(0, 4, 0), r"ndim must be an int in 1\.\.4, got 0"),
    "ndim 5": (_set(0, 4, 5), r"ndim must be an int in 1\.\.4, got 5"),
    "ndim below the dims": (_set(0, 4, 1), r"ne=\[8, 4, 1, 1\] has more than ndim=1 dims"),
    "flags PARAM": (_set(0, 5, 4), r"flags must be an int in 0\.\.3, got 4"),
    "name too long": (_set(0, 6, "x" * (wire.MAX_NAME + 1)), r"name must be a string of at most 128"),
    "name not a string": (_set(0, 6, 7), r"name must be a string"),
    "src forward": (_set(2, 8, [1, 3]), r"tensor 2: src index must be an int in 0\.\.1, got 3"),
    "src self": (_set(2, 8, [1, 2]), r"src index must be an int in 0\.\.1, got 2"),
    "src negative": (_set(2, 8, [-1, 0]), r"src index must be an int in 0\.\.1, got -1"),
    "src of the first tensor": (_set(0, 8, [0]), r"tensor 0: src index must be an int in 0\.\.-1"),
    "src not a list": (_set(2, 8, 1), r"src must be a list of at most 4 indices"),
    "five sources": (_set(2, 8, [0, 1, 0, 1, 0]), r"src must be a list of at most 4"),
    "too few sources": (_set(2, 8, [1]), r"MUL_MAT with 1 source\(s\) is not a valid call"),
    "wrong ne": (_set(2, 2, [6, 5, 1, 1]), r"MUL_MAT described as F32\[6, 5, 1, 1\].*builder made F32\[6, 4, 1, 1\]"),
    "swapped sources": (_set(2, 8, [0, 1]), r"MUL_MAT described as F32\[6, 4, 1, 1\].*made F32\[4, 6, 1, 1\]"),
    "wrong nb": (_set(3, 3, [4, 28, 96, 96]), r"SCALE described as F32\[6, 4, 1, 1\] nb=\[4, 28, 96, 96\]"),
    "wrong type": (_set(3, 1, "F16"), r"SCALE described as F16.*builder made F32"),
    "extra source": (_set(3, 8, [2, 0]), r"SCALE.*builder made"),
    "unknown param": (_set(3, 7, {"s": 2.0, "bias": 1.0}), r"unknown SCALE parameter\(s\) 'bias'$"),
    "param of the wrong type": (_set(3, 7, {"s": "2"}), r"SCALE parameter s='2' has the wrong type"),
    "bool for a float": (_set(3, 7, {"s": True}), r"SCALE parameter s=True has the wrong type"),
    "huge int for a float": (_set(3, 7, {"s": 2.0, "b": 1 << 1100}), r"SCALE parameter b=\d+\.\.\.\d+ has the"),
    "params not a dict": (_set(3, 7, [2.0]), r"SCALE needs its parameters"),
    "missing params": (_set(3, 7, None), r"SCALE needs its parameters"),
    "missing required param": (_set(3, 7, {"b": 1.0}), r"SCALE parameters: .*missing .*'s'"),
    "params for an op without": (_set(2, 7, {}), r"MUL_MAT takes no parameters"),
    "unknown enum value": (_set(5, 7, {"kind": "relu", "swapped": True}), r"GLU parameter kind='relu' has the"),
    "int for a bool": (_set(5, 7, {"kind": "geglu", "swapped": 1}), r"GLU parameter swapped=1 has the wrong"),
    "leaf without storage": (_set(0, 9, None), r"tensor 0: a leaf needs storage"),
    "leaf with params": (_set(0, 7, {"s": 1.0}), r"a leaf has no parameters or sources"),
    "leaf with sources": (_set(1, 8, [0]), r"a leaf has no parameters or sources"),
    "non-contiguous leaf": (_set(0, 3, [4, 64, 256, 256]), r"a leaf is contiguous: nb=\[4, 64, 256, 256\] is not"),
    "view with storage": (_set(4, 9, [BUF_ID, 0]), r"VIEW: storage given for a view, or missing for a node"),
    "node without storage": (_set(2, 9, None), r"MUL_MAT: storage given for a view, or missing for a node"),
    "storage of one field": (_set(0, 9, [BUF_ID]), r"storage must be \(buffer_id, offset\)"),
    "storage not a list": (_set(0, 9, BUF_ID), r"storage must be \(buffer_id, offset\)"),
    "negative offset": (_set(0, 9, [BUF_ID, -64]), r"offset must be an int in 0\.\.\d+, got -64"),
    "buffer id a string": (_set(0, 9, ["3", 0]), r"buffer id must be an int"),
    "view past its source": (_set(4, 7, {"offset": 10_000}), r"view: .* at offset 10000 reaches byte \d+, past the"),
    "view at a negative offset": (_set(4, 7, {"offset": -4}), r"view: negative offset -4"),
    "view with permute axes": (_set(4, 7, {"offset": 4, "axes": [1, 0, 2, 3]}), r"VIEW described as"),
}


def _refusal_mutations():
    """REFUSALS, and a tensor message replaced by something else."""
    cases = dict(REFUSALS)

    def whole(value):
        def mutate(m):
            m[1] = value
        return mutate

    cases["tensor not a tuple"] = (whole("NONE F32"), r"tensor 1: not a 10-field tensor description")
    cases["tensor of 9 fields"] = (whole(["NONE", "F32", [8, 6, 1, 1], [4, 32, 192, 192], 2, 0, "w", None, []]),
                                   r"tensor 1: not a 10-field tensor description")
    cases["tensor as a dict"] = (whole({"op": "NONE"}), r"not a 10-field tensor description")
    return cases


@pytest.mark.parametrize("what", list(_refusal_mutations()))
def test_refusal(what):
    mutate, pattern = _refusal_mutations()[what]
    tensors, nodes, buf = _base()
    _decode((tensors, nodes), buf)  # the unmutated message is fine
    mutate(tensors)
    with pytest.raises(GGXShapeError, match=pattern):
        _decode((tensors, nodes), buf)


@pytest.mark.parametrize("msg, pattern", [
    ("graph", r"expected \(tensors, nodes\)"),
    (None, r"expected \(tensors, nodes\)"),
    (5, r"expected \(tensors, nodes\)"),
    (((),), r"expected \(tensors, nodes\)"),
    (((), (), ()), r"expected \(tensors, nodes\)"),
    (({}, ()), r"expected \(tensors, nodes\)"),
    (((), "0"), r"expected \(tensors, nodes\)"),
    (((None,) * (wire.MAX_TENSORS + 1), ()), r"65537 tensors, more than 65536"),
])
def test_refusal_of_the_envelope(msg, pattern):
    with pytest.raises(GGXShapeError, match=pattern):
        wire.decode_graph(msg, lambda *a: None)


@pytest.mark.parametrize("nodes, pattern", [
    ([0], r"node index 0 is a leaf"),
    ([2, 6], r"node index must be an int in 0\.\.5, got 6"),
    ([-1], r"node index must be an int in 0\.\.5, got -1"),
    ([2.0], r"node index must be an int in 0\.\.5, got 2\.0"),
])
def test_refusal_of_node_indices(nodes, pattern):
    tensors, _, buf = _base()
    with pytest.raises(GGXShapeError, match=pattern):
        _decode((tensors, nodes), buf)


def test_refusal_by_the_receivers_place():
    tensors, nodes, _ = _base()

    def place(t, buffer_id, offset):
        raise GGXShapeError(f"{t.describe()} does not fit buffer {buffer_id}")

    with pytest.raises(GGXShapeError, match="'a' F32.* does not fit buffer 3"):
        wire.decode_graph((tensors, nodes), place)


def _view_of_leaf(gtype: GType, ne, nb, offset: int):
    """The message of GET_ROWS over a VIEW (ne, nb, offset) of a one-block leaf of `gtype`."""
    ctx = Context()
    w = ctx.tensor(gtype, [gtype.block_size * 2], "w")
    ids = ctx.tensor(I32, [1], "ids")
    v = ctx.view(w, [gtype.block_size], None, 0)
    out = ctx.get_rows(v, ids)
    buf = alloc_tensors(REF.buffer_type(), [w, ids, out])
    tensors, nodes = _encode(Graph([v, out], [w, ids]), buf)
    tensors = [list(m) for m in tensors]
    tensors[2][2], tensors[2][3], tensors[2][7] = list(ne), list(nb), {"offset": offset, "axes": [0, 1, 2, 3]}
    return (tensors, nodes), buf


def test_refusal_of_a_quantized_view_with_strided_blocks():
    """A Q4_0 view of one block with nb[0] = 0 spans 0 bytes by nbytes, so the builder's bound
    check lets it start at its root's end, while a kernel reads the whole 18-byte block there:
    past the root, and past the buffer when the root ends it (an out-of-bounds read, and for a
    CPY destination an out-of-bounds write, on the receiver)."""
    msg, buf = _view_of_leaf(Q4_0, [32, 1, 1, 1], [0, 18, 18, 18], 36)
    with pytest.raises(GGXShapeError, match=r"tensor 2: a Q4_0 tensor's blocks are contiguous: nb\[0\]=0 is not 18"):
        _decode(msg, buf)
    ok, buf = _view_of_leaf(Q4_0, [32, 1, 1, 1], [18, 18, 18, 18], 18)
    _decode(ok, buf)
    # element types take any nb[0] (transposed views); nbytes covers what they span
    ok, buf = _view_of_leaf(F32, [1, 1, 1, 1], [0, 4, 4, 4], 4)
    _decode(ok, buf)


@pytest.mark.parametrize("op", ["MUL_MAT", "SOFT_MAX"])
def test_refusal_of_a_zero_sized_broadcast(op):
    """The builder divides by source sizes (b.ne[2] % a.ne[2]); a 0 there is a GGXShapeError."""
    msg = [["NONE", "F32", [8, 3, 0, 1], [4, 32, 96, 0], 3, 0, "a", None, [], [BUF_ID, 0]],
           ["NONE", "F32", [8, 3, 2, 1], [4, 32, 96, 192], 3, 0, "b", None, [], [BUF_ID, 0]]]
    if op == "MUL_MAT":
        msg.append(["MUL_MAT", "F32", [3, 3, 2, 1], [4, 12, 36, 72], 3, 0, "", None, [0, 1], [BUF_ID, 0]])
    else:
        msg[0][1], msg[0][3] = "F16", [2, 16, 48, 0]
        msg.append(["SOFT_MAX", "F32", [8, 3, 2, 1], [4, 32, 96, 192], 3, 0, "", {"scale": 1.0, "max_bias": 0.0},
                    [1, 0], [BUF_ID, 0]])
    with pytest.raises(GGXShapeError, match=rf"tensor 2: {op} over .*modulo by zero"):
        wire.decode_graph((msg, [2]), lambda *a: None)


# --- fuzz -------------------------------------------------------------------------------------
def _fuzz_messages() -> list[tuple]:
    """Valid messages: one conformance case per op variant label, the layer, the base graph."""
    out, seen = [], set()
    for case in CASES:
        if case.op_name in seen:
            continue
        seen.add(case.op_name)
        graph = build_graph(case.make().out)
        for i, t in enumerate(storage_tensors(graph)):
            t.buffer, t.offset = None, 64 * i
        out.append(wire.encode_graph(graph, lambda b: BUF_ID))
    graph, buf = _layer()
    out.append(_encode(graph, buf))
    out.append(_encode(Graph(graph.nodes[len(graph.nodes) // 2:], []), buf))
    tensors, nodes, _ = _base()
    out.append((tensors, nodes))
    return out


def _short(v) -> str:
    try:
        return reprlib.repr(v)
    except ValueError:  # an int too long for str()
        return "<int>"


def _to_lists(x):
    if isinstance(x, (list, tuple)):
        return [_to_lists(y) for y in x]
    if isinstance(x, dict):
        return {k: _to_lists(v) for k, v in x.items()}
    return x


class _Junk:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def __call__(self, depth: int = 0):
        r = self.rng
        kind = r.randrange(14)
        if kind == 0:
            return None
        if kind == 1:
            return r.choice(["", "x", "F32", "VIEW", "NONE", "asc", "geglu", "f32", "é" * 200])
        if kind == 2:
            return r.choice([0.0, -1.5, 2.5, 1e300, float("inf"), float("nan"), -0.0])
        if kind == 3:
            return 1 << r.choice([31, 62, 63, 64, 200, 1100, 20000])
        if kind == 4:
            return -r.choice([1, 2, 64, 1 << 40, 1 << 63])
        if kind == 5:
            return [self(depth + 1) for _ in range(r.randrange(6))] if depth < 3 else []
        if kind == 6:
            return {self.rng.choice(["offset", "s", "k", "kind", 5, None]): self(depth + 1)} if depth < 3 else {}
        if kind == 7:
            return r.choice([True, False])
        if kind == 8:
            return (self(depth + 1),) if depth < 3 else ()
        if kind == 9:
            return b"\x00\x01"
        return r.choice([0, 1, 2, 3, 4, 5, 7, 8, 32, 64, 1000])


def _mutate(msg, rng: random.Random, junk: _Junk) -> tuple[object, list[str]]:
    """A copy of `msg` with 1..3 random changes, and what they were."""
    m = _to_lists(msg)
    what: list[str] = []
    for _ in range(rng.randrange(1, 4)):
        tensors, nodes = m
        r = rng.random()
        if r < 0.03:
            m = junk()
            what.append(f"message = {_short(m)}")
            break
        if r < 0.08:
            m[1] = junk()
            what.append(f"nodes = {_short(m[1])}")
            continue
        if not isinstance(tensors, list) or not tensors:
            continue
        if r < 0.14 and isinstance(nodes, list) and nodes:
            j = rng.randrange(len(nodes))
            nodes[j] = rng.randrange(len(tensors)) if rng.random() < 0.5 else junk()
            what.append(f"nodes[{j}] = {_short(nodes[j])}")
            continue
        i = rng.randrange(len(tensors))
        if r < 0.18:
            tensors[i] = junk()
            what.append(f"tensor {i} = {_short(tensors[i])}")
            continue
        t = tensors[i]
        if not isinstance(t, list) or len(t) != 10:
            continue
        f = rng.randrange(10)
        cur = t[f]
        if isinstance(cur, list) and cur and rng.random() < 0.7:
            j = rng.randrange(len(cur))
            if type(cur[j]) is int and rng.random() < 0.6:
                cur[j] = rng.choice([0, 1, cur[j] + 1, cur[j] - 1, cur[j] * 2, cur[j] + 4096, i, i + 1])
            else:
                cur[j] = junk()
            what.append(f"tensor {i} field {f}[{j}] = {_short(cur[j])}")
        elif isinstance(cur, dict) and cur and rng.random() < 0.8:
            key = rng.choice(list(cur))
            cur[key] = junk() if rng.random() < 0.5 else rng.choice([0, 1, -1, 2.0, 0.5, 1 << 70, "desc", "f32"])
            what.append(f"tensor {i} params[{_short(key)}] = {_short(cur[key])}")
        elif f == 4 and rng.random() < 0.5:
            t[4] = rng.randrange(0, 6)
            what.append(f"tensor {i} ndim = {t[4]}")
        else:
            t[f] = junk()
            what.append(f"tensor {i} field {f} = {_short(t[f])}")
    return m, what


def test_fuzz_decode_raises_only_ggx_errors():
    rng = random.Random(20240601)
    junk = _Junk(rng)
    messages = _fuzz_messages()
    for m in messages:
        wire.decode_graph(m, lambda *a: None)
    outcomes = {"ok": 0, "refused": 0}
    failures = []
    for n in range(4000):
        base = rng.randrange(len(messages))
        msg, what = _mutate(messages[base], rng, junk)
        try:
            wire.decode_graph(msg, lambda t, buffer_id, offset: None)
            outcomes["ok"] += 1
        except GGXError:
            outcomes["refused"] += 1
        except Exception as e:  # noqa: BLE001 - what the fuzz looks for
            failures.append(f"#{n} message {base}, {what}: {type(e).__name__}: {e}"[:400])
    assert not failures, "\n".join(failures[:20])
    assert outcomes["ok"] > 50 and outcomes["refused"] > 2000, outcomes
