"""ggml-cuda's CUDA-graph rule (ggx_cuda.cuda_graph): warm-up, changes, blockers, LRU."""
from __future__ import annotations

import pytest

from ggx.graph import Context
from ggx.types import GType
from ggx_cuda.cuda_graph import CAPTURE, DISABLED, EAGER, LAUNCH, CudaGraphCache, node_properties

P1, P2 = ("props", 1), ("props", 2)


def actions(cache, key, props, n, blocker=None):
    out = []
    for _ in range(n):
        d = cache.decide(key, props, blocker)
        out.append(d.action)
        if d.action == CAPTURE:
            cache.store(key, f"graph-{key}-{props}")
    return out


def test_warmup_then_capture_then_launch():
    c = CudaGraphCache()
    d = c.decide("g", P1)
    assert (d.action, d.reason, d.key, d.graph) == (EAGER, "warming up (1 of 2)", "g", None)
    d = c.decide("g", P1)
    assert d.action == CAPTURE
    c.store("g", "G1")
    d = c.decide("g", P1)
    assert (d.action, d.graph) == (LAUNCH, "G1")
    assert c.decide("g", P1).graph == "G1"
    assert c.reasons() == {"eager: warming up (1 of 2)": 1, "capture": 1, "launch": 2}
    assert c.last("g").action == LAUNCH and c.last("other") is None


def test_capture_repeats_until_stored():
    c = CudaGraphCache()
    assert [c.decide("g", P1).action for _ in range(3)] == [EAGER, CAPTURE, CAPTURE]


def test_change_drops_graph_and_restarts_warmup():
    dropped = []
    c = CudaGraphCache(on_drop=dropped.append)
    assert actions(c, "g", P1, 3) == [EAGER, CAPTURE, LAUNCH]
    d = c.decide("g", P2)
    assert (d.action, d.reason) == (EAGER, "properties changed")
    assert dropped == ["graph-g-('props', 1)"]
    assert actions(c, "g", P2, 3) == [CAPTURE, LAUNCH, LAUNCH]
    assert c.decide("g", P2).graph == "graph-g-('props', 2)"
    # alternating properties never capture
    assert actions(c, "g", P1, 1) + actions(c, "g", P2, 1) + actions(c, "g", P1, 1) == [EAGER] * 3
    # back to the old properties: warm up again, nothing of the old graph is kept
    assert actions(c, "g", P1, 3) == [CAPTURE, LAUNCH, LAUNCH]


def test_blocker_keeps_it_eager():
    c = CudaGraphCache()
    for _ in range(4):
        d = c.decide("g", P1, "node 12 MUL_MAT uses cuBLAS")
        assert (d.action, d.reason) == (EAGER, "node 12 MUL_MAT uses cuBLAS")
    assert c.reasons() == {"eager: node 12 MUL_MAT uses cuBLAS": 4}
    # a graph without the blocker (other properties) warms up from scratch
    assert actions(c, "g", P2, 3) == [EAGER, CAPTURE, LAUNCH]


def test_blocker_drops_a_stored_graph():
    dropped = []
    c = CudaGraphCache(on_drop=dropped.append)
    actions(c, "g", P1, 2)
    assert c.decide("g", P1, "blocked").action == EAGER and dropped == ["graph-g-('props', 1)"]
    assert c.decide("g", P1).action == CAPTURE  # unchanged properties: no second warm-up


def test_disabled():
    c = CudaGraphCache(enabled=False)
    for _ in range(3):
        d = c.decide("g", P1)
        assert (d.action, d.reason) == (EAGER, DISABLED)
    assert "GGX_CUDA_DISABLE_GRAPHS" in DISABLED
    assert len(c) == 0 and c.last("g") is None and c.reasons() == {f"eager: {DISABLED}": 3}


def test_failed_capture_stays_eager():
    c = CudaGraphCache()
    actions(c, "g", P1, 1)
    assert c.decide("g", P1).action == CAPTURE
    c.fail("g", "cudaErrorStreamCaptureUnsupported")
    for props in (P1, P1, P2, P2):
        d = c.decide("g", props)
        assert d.action == EAGER
    assert d.reason == "capture failed: cudaErrorStreamCaptureUnsupported"
    assert actions(c, "h", P1, 2) == [EAGER, CAPTURE]  # other keys unaffected
    c.invalidate("g")
    assert actions(c, "g", P1, 2) == [EAGER, CAPTURE]


def test_lru_eviction():
    dropped = []
    c = CudaGraphCache(max_keys=3, on_drop=dropped.append)
    for k in "abc":
        actions(c, k, P1, 2)
    assert len(c) == 3
    c.decide("a", P1)  # a is now the most recent: b goes first
    assert c.decide("d", P1).action == EAGER
    assert "b" not in c and {"a", "c", "d"} <= {k for k in "abcd" if k in c}
    assert dropped == ["graph-b-('props', 1)"]
    assert c.decide("a", P1).action == LAUNCH
    assert c.decide("b", P1).reason == "warming up (1 of 2)"  # evicts c
    assert "c" not in c and len(c) == 3
    with pytest.raises(KeyError):
        c.store("c", "G")


def test_clear_and_invalidate():
    dropped = []
    c = CudaGraphCache(on_drop=dropped.append)
    actions(c, "a", P1, 2)
    actions(c, "b", P1, 2)
    c.invalidate("a")
    c.invalidate("missing")
    assert "a" not in c and len(dropped) == 1
    c.clear()
    assert len(c) == 0 and len(dropped) == 2
    assert actions(c, "b", P1, 3) == [EAGER, CAPTURE, LAUNCH]


def test_store_replaces_and_warmup_knob():
    dropped = []
    c = CudaGraphCache(warmup=3, on_drop=dropped.append)
    assert [c.decide("g", P1).reason for _ in range(2)] == ["warming up (1 of 3)", "warming up (2 of 3)"]
    assert c.decide("g", P1).action == CAPTURE
    c.store("g", "G1")
    c.store("g", "G1")
    c.store("g", "G2")
    assert dropped == ["G1"] and c.decide("g", P1).graph == "G2"
    with pytest.raises(ValueError):
        CudaGraphCache(max_keys=0)


def test_node_properties():
    ctx = Context()
    a, b = ctx.tensor(GType.F32, (4, 3)), ctx.tensor(GType.F32, (4, 3))
    s = ctx.add(a, b)
    v = ctx.view(s, (4, 2), (s.nb[1],), 0)
    n = ctx.scale(v, 2.0)
    where = {id(a): 100, id(b): 200, id(s): 300, id(v): 300, id(n): 400}
    props = node_properties([s, v, n], lambda t: where[id(t)])
    assert len(props) == 2  # the view is skipped
    assert props[0] == (s.op, GType.F32, s.ne, s.nb, None, 300,
                        ((100, GType.F32, a.ne, a.nb), (200, GType.F32, b.ne, b.nb)))
    assert props[1][4] == n.params and props[1][6] == ((300, GType.F32, v.ne, v.nb),)
    assert node_properties([s, v, n], lambda t: where[id(t)]) == props
    where[id(b)] = 999  # a source moved
    moved = node_properties([s, v, n], lambda t: where[id(t)])
    assert moved != props and hash(moved) != hash(props)
    # a change of a source's shape alone changes the properties too
    v2 = ctx.view(s, (4, 3), (s.nb[1],), 0)
    n2 = ctx.scale(v2, 2.0)
    n2.ne, n2.nb = n.ne, n.nb  # same node shape, different source shape
    where.update({id(v2): 300, id(n2): 400})
    assert node_properties([n2], lambda t: where[id(t)]) != node_properties([n], lambda t: where[id(t)])
