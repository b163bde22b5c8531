"""The graph allocator: reuse after the last consumer, in-place reuse, views, preallocated tensors."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_device import llama_like

from ggx.alloc import GraphAllocator, graph_steps, is_scratch
from ggx.backend import BufferUsage
from ggx.errors import GGXShapeError
from ggx.graph import Context, build_graph
from ggx.host import HostBufferType
from ggx.tensor import TensorFlag


def host_buft(name="host"):
    return HostBufferType(None, name=name)


def alloc_graph(galloc, graph, buft_of=None):
    """The allocator's three steps for a plain graph: plan, reserve (grow), place."""
    plan = galloc.plan(graph_steps(graph), graph.leafs, buft_of)
    galloc.reserve(plan)
    galloc.place(plan)
    return plan


def check_no_overlap(plan):
    """No two tensors alive at a common step share a byte (in-place pairs hand over at one step).

    Memory is given back after the step's node is placed, so even the step that frees a tensor
    counts as a step where it is alive."""
    recs = plan.records
    for i, a in enumerate(recs):
        a_end = a.last if a.last >= 0 else 1 << 30
        for b in recs[i + 1:]:
            if a.buft != b.buft:
                continue
            b_end = b.last if b.last >= 0 else 1 << 30
            if b.inplace_of is a.tensor or a.inplace_of is b.tensor:
                continue
            alive_together = a.first <= b_end and b.first <= a_end
            if alive_together:
                assert a.offset + a.size <= b.offset or b.offset + b.size <= a.offset, (a, b)


def test_llama_like_peak_below_no_reuse_total():
    graph, weights, inputs = llama_like(n_layer=4)
    buft = host_buft()
    for w in weights:
        w.buffer = buft.alloc_buffer(w.nbytes)  # preallocated: must stay untouched
        w.buffer.usage = BufferUsage.WEIGHTS
    galloc = GraphAllocator(buft)
    plan = alloc_graph(galloc, graph)
    no_reuse = sum(-(-t.nbytes // 64) * 64 for t in graph.nodes if t.view_src is None) + \
        sum(-(-t.nbytes // 64) * 64 for t in inputs.values())
    peak = galloc.peak_bytes[buft]
    assert 0 < peak < no_reuse / 3
    check_no_overlap(plan)
    assert all(r.tensor.view_src is None for r in plan.records)
    assert all(w.offset == 0 and not is_scratch(w.buffer) for w in weights)
    assert any(r.inplace_of is not None for r in plan.records)  # ADD/MUL reuse their input
    for t in graph.nodes:
        assert t.data_buffer is galloc.buffers[0] or t.data_buffer in [w.buffer for w in weights]


def test_views_are_not_allocated_and_keep_their_root_alive():
    ctx = Context()
    a = ctx.tensor("F32", (8, 4), "a").set_flag(TensorFlag.INPUT)
    b = ctx.silu(a)
    v = ctx.view(b, (8, 2), offset=8 * 4 * 2)
    c = ctx.scale(ctx.cont(v), 2.0)
    d = ctx.add(ctx.silu(c), ctx.cont(v))  # v is read again late: b must stay alive until then
    graph = build_graph(d)
    galloc = GraphAllocator(host_buft())
    plan = alloc_graph(galloc, graph)
    by_tensor = {id(r.tensor): r for r in plan.records}
    assert id(v) not in by_tensor
    assert v.data_buffer is b.buffer and v.data_offset == b.offset + 64
    rb = by_tensor[id(b)]
    last_reader = graph.nodes.index(d) - 1  # the second cont(v)
    assert rb.last >= last_reader
    check_no_overlap(plan)


def test_reserve_then_smaller_graphs_do_not_grow():
    buft = host_buft()
    galloc = GraphAllocator(buft)
    big, _, _ = llama_like(n_layer=2, n_tokens=16)
    galloc.reserve(galloc.plan(graph_steps(big), big.leafs))
    size = galloc.buffer_size(buft)
    assert size > 0 and galloc.n_grows == 1
    for n_tokens in (1, 4, 16):
        g, _, _ = llama_like(n_layer=2, n_tokens=n_tokens)
        alloc_graph(galloc, g)
        assert galloc.buffer_size(buft) == size
    assert galloc.n_grows == 1
    g, _, _ = llama_like(n_layer=2, n_tokens=64)  # bigger: grows
    alloc_graph(galloc, g)
    assert galloc.buffer_size(buft) > size and galloc.n_grows == 2


def test_two_buffer_types():
    a_buft, b_buft = host_buft("a"), host_buft("b")
    graph, _, _ = llama_like(n_layer=1)
    galloc = GraphAllocator([a_buft, b_buft])
    alloc_graph(galloc, graph, buft_of=lambda t: 1 if t.op.name == "MUL_MAT" else 0)
    for t in graph.nodes:
        if t.view_src is None:
            assert t.buffer.buft is (b_buft if t.op.name == "MUL_MAT" else a_buft)
    assert galloc.peak_bytes[a_buft] > 0 and galloc.peak_bytes[b_buft] > 0


@st.composite
def random_graph(draw):
    ctx = Context()
    n = 8
    live = [ctx.tensor("F32", (n, 3), f"in{i}").set_flag(TensorFlag.INPUT) for i in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["add", "mul", "silu", "scale", "cont", "view", "norm", "mm"]))
        a = draw(st.sampled_from(live))
        b = draw(st.sampled_from(live))
        if kind == "add":
            t = ctx.add(a, b)
        elif kind == "mul":
            t = ctx.mul(a, b)
        elif kind == "silu":
            t = ctx.silu(a)
        elif kind == "scale":
            t = ctx.scale(a, 0.5)
        elif kind == "cont":
            t = ctx.cont(ctx.transpose(ctx.cont(ctx.transpose(a))))
        elif kind == "view":
            t = ctx.reshape(ctx.cont(a) if not a.is_contiguous() else a, (n * 3,))
            t = ctx.reshape(t, (n, 3))
        elif kind == "norm":
            t = ctx.rms_norm(a, 1e-5)
        else:
            t = ctx.mul_mat(ctx.cont(ctx.transpose(a)), ctx.mul_mat(a, b))  # [8, 3]
        live.append(t)
    outs = draw(st.lists(st.sampled_from(live[-6:]), min_size=1, max_size=3))
    return build_graph(outs)


@settings(max_examples=150, deadline=None)
@given(random_graph())
def test_random_graphs_never_overlap_live_tensors(graph):
    galloc = GraphAllocator(host_buft())
    plan = alloc_graph(galloc, graph)
    check_no_overlap(plan)
    for r in plan.records:  # outputs and inputs are never freed
        if r.tensor.flags & (TensorFlag.OUTPUT | TensorFlag.INPUT):
            assert r.last == -1


def test_results_with_reuse_match_reference():
    """Memory reuse must not change results: compare against computing each node in its own memory."""
    from ggx.registry import get_device

    ref = get_device("ref")
    rng = np.random.default_rng(1)
    graph, weights, inputs = llama_like(n_layer=2)
    from sched_device import alloc_weights, llama_inputs

    from ggx.tensor_data import get_tensor_data, set_tensor_data

    alloc_weights(ref.buffer_type(), weights, rng)
    vals = llama_inputs(inputs, rng)
    galloc = GraphAllocator(ref.buffer_type())
    alloc_graph(galloc, graph)
    for t, v in vals.items():
        set_tensor_data(t, v)
    ref.init_backend().graph_compute(graph)
    reused = get_tensor_data(graph.nodes[-1])
    # no reuse: every node gets its own buffer
    for t in graph.nodes:
        if t.view_src is None:
            t.buffer, t.offset = ref.buffer_type().alloc_buffer(t.nbytes), 0
    for t in inputs.values():
        t.buffer, t.offset = ref.buffer_type().alloc_buffer(t.nbytes), 0
    for t, v in vals.items():
        set_tensor_data(t, v)
    ref.init_backend().graph_compute(graph)
    np.testing.assert_array_equal(get_tensor_data(graph.nodes[-1]), reused)


def test_reserve_frees_the_buffer_it_replaces_and_place_needs_room():
    buft = host_buft()
    galloc = GraphAllocator(buft)
    small, _, _ = llama_like(n_layer=1, n_tokens=2)
    big, _, _ = llama_like(n_layer=1, n_tokens=32)
    small_plan = galloc.plan(graph_steps(small), small.leafs)
    big_plan = galloc.plan(graph_steps(big), big.leafs)
    assert not galloc.fits(small_plan)
    with pytest.raises(GGXShapeError, match="reserve"):
        galloc.place(small_plan)  # nothing reserved yet
    galloc.reserve(small_plan)
    first = galloc.buffers[0]
    assert galloc.fits(small_plan) and not galloc.fits(big_plan)
    galloc.reserve(big_plan)
    assert first.is_freed and galloc.buffers[0] is not first and galloc.fits(small_plan)
    galloc.reserve(small_plan)  # fits: nothing replaced
    assert galloc.n_grows == 2 and not galloc.buffers[0].is_freed
    galloc.free()
    assert galloc.buffers == [None] and not galloc.fits(big_plan)


def test_a_plan_places_another_graph_of_the_same_shape():
    galloc = GraphAllocator(host_buft())
    g1, _, _ = llama_like(n_layer=1)
    g2, _, _ = llama_like(n_layer=1)
    plan = galloc.plan(graph_steps(g1), g1.leafs)
    galloc.reserve(plan)
    index = {id(t): i for i, t in enumerate(g1.leafs + g1.nodes)}
    order2 = g2.leafs + g2.nodes
    tensors = [order2[index[id(r.tensor)]] for r in plan.records]
    galloc.place(plan, tensors)
    for r, t in zip(plan.records, tensors):
        assert t.buffer is galloc.buffers[0] and t.offset == r.offset and r.tensor.buffer is None
    with pytest.raises(GGXShapeError, match="tensors"):
        galloc.place(plan, tensors[:-1])
