"""The graph allocator: reuse after the last consumer, in-place reuse, views, preallocated tensors."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_device import llama_like

from ggx.alloc import GraphAllocator
from ggx.backend import BufferUsage
from ggx.graph import Context, build_graph
from ggx.host import HostBufferType
from ggx.tensor import TensorFlag


def host_buft(name="host"):
    return HostBufferType(None, name=name)


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
    plan = galloc.alloc_graph(graph)
    no_reuse = sum(-(-t.nbytes // 64) * 64 for t in graph.nodes if t.view_src is None) + \
        sum(-(-t.nbytes // 64) * 64 for t in inputs.values())
    peak = galloc.peak_bytes[buft]
    assert 0 < peak < no_reuse / 3
    check_no_overlap(plan)
    assert all(r.tensor.view_src is None for r in plan.records)
    assert all(w.offset == 0 and not galloc.owns(w.buffer) for w in weights)
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
    plan = galloc.alloc_graph(graph)
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
    galloc.reserve(big)
    size = galloc.buffer_size(buft)
    assert size > 0 and galloc.n_grows == 1
    for n_tokens in (1, 4, 16):
        g, _, _ = llama_like(n_layer=2, n_tokens=n_tokens)
        galloc.alloc_graph(g)
        assert galloc.buffer_size(buft) == size
    assert galloc.n_grows == 1
    g, _, _ = llama_like(n_layer=2, n_tokens=64)  # bigger: grows
    galloc.alloc_graph(g)
    assert galloc.buffer_size(buft) > size and galloc.n_grows == 2


def test_two_buffer_types():
    a_buft, b_buft = host_buft("a"), host_buft("b")
    graph, _, _ = llama_like(n_layer=1)
    galloc = GraphAllocator([a_buft, b_buft])
    galloc.alloc_graph(graph, buft_of=lambda t: b_buft if t.op.name == "MUL_MAT" else a_buft)
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
    plan = galloc.alloc_graph(graph)
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

    from ggx.compute import get_tensor_data, set_tensor_data

    alloc_weights(ref.buffer_type(), weights, rng)
    vals = llama_inputs(inputs, rng)
    galloc = GraphAllocator(ref.buffer_type())
    galloc.alloc_graph(graph)
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
