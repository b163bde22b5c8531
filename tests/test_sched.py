"""The scheduler over a real async non-host test device and the reference backend."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_device import TestDevice, alloc_weights, llama_inputs, llama_like
from test_alloc import random_graph

from ggx.errors import GGXUnsupported
from ggx.graph import Context, build_graph
from ggx.models.moe import MoeExpertUpload
from ggx.ops import Op
from ggx.reference import RefDevice
from ggx.sched import SchedComputeError, Scheduler
from ggx.tensor import TensorFlag
from ggx.tensor_data import get_tensor_data, set_tensor_data

REF = RefDevice()


def run(sched, graph, values):
    sched.alloc_graph(graph)
    for t, v in values.items():
        set_tensor_data(t, v)
    sched.graph_compute(graph)
    return [get_tensor_data(t) for t in graph.nodes if t.flags & TensorFlag.OUTPUT]


def input_values(graph, rng):
    return {t: rng.uniform(-1, 1, t.shape).astype(np.float32) for t in graph.leafs if t.flags & TensorFlag.INPUT}


OP_SUBSETS = [set(), {Op.ADD}, {Op.MUL_MAT, Op.CONT}, {Op.SILU, Op.SCALE, Op.RMS_NORM}, set(Op)]


@settings(max_examples=40, deadline=None)
@given(random_graph(), st.sampled_from(range(len(OP_SUBSETS))), st.integers(0, 1000))
def test_random_graphs_same_results_on_test_device_and_ref(graph, subset, seed):
    values = input_values(graph, np.random.default_rng(seed))
    expected = run(Scheduler([REF.init_backend()]), graph, values)
    dev = TestDevice(ops=OP_SUBSETS[subset])
    got = run(Scheduler([dev.init_backend(), REF.init_backend()]), graph, values)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


def test_llama_like_with_weights_on_device_matches_ref_and_pins_consumers():
    rng = np.random.default_rng(0)
    graph, weights, inputs = llama_like(n_layer=2)
    alloc_weights(REF.buffer_type(), weights, rng)
    values = llama_inputs(inputs, rng)
    expected = run(Scheduler([REF.init_backend()]), graph, values)

    dev = TestDevice(ops={Op.MUL_MAT, Op.ADD, Op.MUL, Op.RMS_NORM, Op.GLU})
    graph2, weights2, inputs2 = llama_like(n_layer=2)
    alloc_weights(dev.buffer_type(), weights2, np.random.default_rng(0))
    values2 = {inputs2[k]: values[inputs[k]] for k in inputs}
    sched = Scheduler([dev.init_backend(), REF.init_backend()])
    got = run(sched, graph2, values2)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)
    for node in graph2.nodes:
        if any(s in weights2 for s in node.src):
            assert sched.backend_of(node).device is dev
            assert "1.wgt" in sched.explain(node)
    assert sched.stats.n_splits > 1 and sched.stats.n_inputs_copied > 0 and sched.stats.bytes_copied > 0
    for sp in sched.splits:  # what crosses to the ref backend was produced on the device, and vice versa
        for inp in sp.inputs:
            assert sched.backend_of(inp) is not sp.backend


def test_plan_is_reused_for_the_same_graph_and_for_a_rebuilt_one():
    rng = np.random.default_rng(2)
    dev = TestDevice(ops={Op.MUL_MAT})
    sched = Scheduler([dev.init_backend(), REF.init_backend()])
    results = []
    for _ in range(2):
        graph, weights, inputs = llama_like(n_layer=1)
        alloc_weights(dev.buffer_type(), weights, np.random.default_rng(5))
        values = llama_inputs(inputs, np.random.default_rng(6))
        results.append(run(sched, graph, values)[0])
        assert sched.stats.plan_reused  # graph_compute after alloc_graph reuses
        run(sched, graph, values)
        assert sched.stats.plan_reused
    assert sched.stats.n_plans == 1
    np.testing.assert_array_equal(results[0], results[1])
    del rng


def test_graphs_taking_turns_keep_their_plans():
    """A prompt's graph, decode's, the prompt's again: each is planned once; switching to a kept
    plan waits for the backends (the other graph's work may still use the compute memory) and
    re-places its tensors, so the results do not change."""
    dev = TestDevice(ops={Op.MUL_MAT, Op.ADD})
    sched = Scheduler([dev.init_backend(), REF.init_backend()])
    graphs = []
    for n_tokens in (4, 8):
        graph, weights, inputs = llama_like(n_layer=1, n_tokens=n_tokens)
        alloc_weights(dev.buffer_type(), weights, np.random.default_rng(n_tokens))
        graphs.append((graph, llama_inputs(inputs, np.random.default_rng(n_tokens + 1))))
    first = [run(sched, g, v)[0] for g, v in graphs]
    assert sched.stats.n_plans == 2
    for _ in range(2):
        for (g, v), expected in zip(graphs, first):
            waits = sched.stats.n_realloc_waits
            np.testing.assert_array_equal(run(sched, g, v)[0], expected)
            assert sched.stats.plan_reused and sched.stats.n_realloc_waits == waits + 1
    assert sched.stats.n_plans == 2
    sched.free()
    np.testing.assert_array_equal(run(sched, *graphs[0])[0], first[0])
    assert sched.stats.n_plans == 3  # free() forgets the kept plans


def test_graph_prepare_hands_each_backend_the_split_graphs_it_will_compute():
    """graph_prepare plans, places and asks every split's backend to get ready, computing
    nothing; graph_compute then computes those very split graphs with no new plan."""
    dev = TestDevice(ops={Op.MUL_MAT, Op.ADD})
    backends = [dev.init_backend(), REF.init_backend()]
    prepared, computed = [], []
    for be in backends:
        be.graph_prepare = prepared.append
        compute = be.graph_compute
        be.graph_compute = lambda g, compute=compute: (computed.append(g), compute(g))
    sched = Scheduler(backends)
    graph, weights, inputs = llama_like(n_layer=1)
    alloc_weights(dev.buffer_type(), weights, np.random.default_rng(1))
    sched.graph_prepare(graph)
    assert not computed and len(prepared) == len(sched.splits) > 1
    assert sched.stats.n_plans == 1
    expected = run(Scheduler([REF.init_backend()]), *_on_ref(weights, inputs))
    got = run(sched, graph, llama_inputs(inputs, np.random.default_rng(2)))
    assert sched.stats.n_plans == 1 and sched.stats.plan_reused
    assert [id(g) for g in computed] == [id(g) for g in prepared]
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)


def _on_ref(weights, inputs):
    """The same llama_like graph with the same weights (seed 1) and inputs (seed 2), on ref."""
    graph, ref_weights, ref_inputs = llama_like(n_layer=1)
    alloc_weights(REF.buffer_type(), ref_weights, np.random.default_rng(1))
    return graph, llama_inputs(ref_inputs, np.random.default_rng(2))


def test_n_copies_2_gives_the_same_results_as_1():
    dev1, dev2 = TestDevice(ops={Op.MUL_MAT, Op.ADD}), TestDevice(ops={Op.MUL_MAT, Op.ADD})
    graph, weights, inputs = llama_like(n_layer=2)
    alloc_weights(REF.buffer_type(), weights, np.random.default_rng(0))
    offload = {"offload": lambda op: op.op is Op.MUL_MAT}
    dev1._offload = dev2._offload = offload["offload"]
    s1 = Scheduler([dev1.init_backend(), REF.init_backend()], n_copies=1)
    s2 = Scheduler([dev2.init_backend(), REF.init_backend()], n_copies=2)
    for step in range(3):
        values = llama_inputs(inputs, np.random.default_rng(step))
        a = run(s1, graph, values)[0]
        b = run(s2, graph, values)[0]
        np.testing.assert_array_equal(a, b)
    assert s2.stats.n_inputs_copied > 0 and s2.cur_copy == 1
    assert s2.alloc.peak_bytes[dev2.buffer_type()] > s1.alloc.peak_bytes[dev1.buffer_type()]


def moe_graph(n_expert=8, n_used=2, n_tokens=3, k=32, m=16):
    ctx = Context()
    experts = ctx.tensor("F32", (k, m, n_expert), "ffn_experts")
    b = ctx.tensor("F32", (k, 1, n_tokens), "b").set_flag(TensorFlag.INPUT)
    ids = ctx.tensor("I32", (n_used, n_tokens), "ids").set_flag(TensorFlag.INPUT)
    out = ctx.mul_mat_id(experts, b, ids)
    return build_graph(out), experts, b, ids


def test_moe_copy_callback_uploads_exactly_the_used_experts():
    graph, experts, b, ids = moe_graph()
    rng = np.random.default_rng(3)
    alloc_weights(REF.buffer_type(), [experts], rng)
    id_vals = np.array([[1, 2], [2, 5], [1, 7]], dtype=np.int32)  # used: 1, 2, 5, 7 -> runs 1-2, 5, 7
    values = {b: rng.uniform(-1, 1, b.shape).astype(np.float32), ids: id_vals}
    expected = run(Scheduler([REF.init_backend()]), graph, values)[0]

    dev = TestDevice(ops={Op.MUL_MAT_ID}, offload=lambda op: op.op is Op.MUL_MAT_ID)
    cb = MoeExpertUpload()
    backend = dev.init_backend()
    sched = Scheduler([backend, REF.init_backend()], copy_callback=cb)
    got = run(sched, graph, values)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert "1.off" in sched.explain(graph.nodes[-1])
    assert cb.runs == [(1, 2), (5, 5), (7, 7)]
    es = experts.nb[2]
    assert cb.bytes_uploaded == (2 * es + min(es, 512)) + (es + min(es, 512)) + es
    assert sched.stats.n_callback_copies == 1 and sched.stats.n_inputs_copied == 2  # b and ids by the scheduler
    assert sched.stats.bytes_copied == b.nbytes + ids.nbytes


def test_eval_callback_sees_nodes_and_can_stop():
    graph, weights, inputs = llama_like(n_layer=1)
    alloc_weights(REF.buffer_type(), weights, np.random.default_rng(0))
    values = llama_inputs(inputs, np.random.default_rng(1))
    seen = []

    def cb(t, ask):
        if ask:
            return t.op is Op.MUL_MAT
        seen.append(get_tensor_data(t))
        return len(seen) < 3

    dev = TestDevice(ops={Op.MUL_MAT}, offload=lambda op: True)
    sched = Scheduler([dev.init_backend(), REF.init_backend()], eval_callback=cb)
    run(sched, graph, values)
    assert len(seen) == 3 and all(np.isfinite(s).all() for s in seen)


def test_op_no_backend_supports_raises_naming_op_and_backends():
    class PickyHost(RefDevice):
        def supports_op(self, op):
            return op.op is not Op.SILU and super().supports_op(op)

    ctx = Context()
    a = ctx.tensor("F32", (4,), "a").set_flag(TensorFlag.INPUT)
    graph = build_graph(ctx.silu(ctx.scale(a, 2.0)))
    sched = Scheduler([TestDevice(ops={Op.SCALE}).init_backend(), PickyHost().init_backend()])
    with pytest.raises(GGXUnsupported, match=r"SILU.*test.*ref"):
        sched.alloc_graph(graph)


def test_backend_failure_names_the_node_and_scheduler_stays_usable():
    rng = np.random.default_rng(0)
    graph, weights, inputs = llama_like(n_layer=1)
    alloc_weights(REF.buffer_type(), weights, rng)
    values = llama_inputs(inputs, rng)
    expected = run(Scheduler([REF.init_backend()]), graph, values)[0]
    dev = TestDevice(ops={Op.MUL_MAT, Op.ADD}, fail_on=Op.ADD, offload=lambda op: True)
    sched = Scheduler([dev.init_backend(), REF.init_backend()])
    with pytest.raises(SchedComputeError, match="ADD") as info:
        run(sched, graph, values)
    assert info.value.node is not None and info.value.node.op is Op.ADD and info.value.node in graph.nodes
    dev.fail_on = None
    np.testing.assert_allclose(run(sched, graph, values)[0], expected, rtol=1e-6)


def test_last_backend_must_be_host():
    with pytest.raises(GGXUnsupported, match="host"):
        Scheduler([TestDevice().init_backend()])


def test_same_graph_object_replans_when_a_weight_moves_to_another_buffer_type():
    """The decode-loop shortcut (same Graph, same leaf buffers: last key reused) must notice a
    weight moved elsewhere: the plan is made again and the weight's consumers follow it."""
    rng = np.random.default_rng(4)
    graph, weights, inputs = llama_like(n_layer=1)
    alloc_weights(REF.buffer_type(), weights, rng)
    values = llama_inputs(inputs, np.random.default_rng(5))
    expected = run(Scheduler([REF.init_backend()]), graph, values)[0]
    host_data = {w: get_tensor_data(w) for w in weights}
    dev = TestDevice(ops={Op.MUL_MAT, Op.ADD, Op.MUL, Op.RMS_NORM, Op.GLU})
    sched = Scheduler([dev.init_backend(), REF.init_backend()])
    np.testing.assert_allclose(run(sched, graph, values)[0], expected, rtol=1e-6)
    assert sched.stats.n_splits == 1 and sched.stats.n_plans == 1  # weights on the host: all on ref
    run(sched, graph, values)
    assert sched.stats.plan_reused and sched.stats.n_plans == 1
    alloc_weights(dev.buffer_type(), weights)  # the same tensors, now in device memory
    for w, v in host_data.items():
        set_tensor_data(w, v)
    np.testing.assert_allclose(run(sched, graph, values)[0], expected, rtol=1e-5, atol=1e-5)
    assert sched.stats.n_plans == 2 and sched.stats.n_splits > 1
    wq = next(w for w in weights if w.name.endswith("wq"))
    assert all(sched.backend_of(n).device is dev for n in graph.nodes if wq in n.src)


def test_waits_once_per_split_and_copies_every_input():
    """A device split with several inputs from the host: one event wait before its async copies
    (not one per input), and every input arrives."""
    dev = TestDevice(ops={Op.ADD, Op.MUL})
    ctx = Context()
    a, b, c = (ctx.tensor("F32", (8,), n).set_flag(TensorFlag.INPUT) for n in "abc")
    w = ctx.tensor("F32", (8,), "w")
    s = ctx.silu(ctx.add(a, b))  # SILU is not on the device: these run on ref
    t = ctx.silu(ctx.mul(a, c))
    out = ctx.add(t, ctx.mul(w, s))  # the weight pins its mul to the device; s and t are copied there
    graph = build_graph(out)
    rng = np.random.default_rng(0)
    w_val = rng.uniform(-1, 1, 8).astype(np.float32)
    alloc_weights(REF.buffer_type(), [w])
    set_tensor_data(w, w_val)
    values = {x: rng.uniform(-1, 1, 8).astype(np.float32) for x in (a, b, c)}
    expected = run(Scheduler([REF.init_backend()]), graph, values)[0]
    alloc_weights(dev.buffer_type(), [w])
    set_tensor_data(w, w_val)
    backend = dev.init_backend()
    waits = []
    orig = backend.event_wait
    backend.event_wait = lambda ev: (waits.append(ev), orig(ev))
    sched = Scheduler([backend, REF.init_backend()])
    for _ in range(2):
        waits.clear()
        np.testing.assert_allclose(run(sched, graph, values)[0], expected, rtol=1e-6)
        last = sched.splits[-1]
        assert last.backend is backend and {i.op for i in last.inputs} == {Op.SILU}
        assert len(last.inputs) == 2
        async_splits = [sp for sp in sched.splits if sp.backend is backend
                        and any(not (i.flags & TensorFlag.INPUT) for i in sp.inputs)]
        assert len(waits) == len(async_splits)  # one wait per split, not one per input
        assert sched.stats.n_inputs_copied == sum(len(sp.inputs) for sp in sched.splits)
