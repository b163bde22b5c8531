"""The scheduler with work in flight: an async test device whose stream is held (`hold()`) keeps
a graph's work queued while the next graph is planned, placed and grown; graph_optimize per split;
buffer lifetimes; the llama model over the async device."""
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from sched_device import TestBackend, TestDevice, alloc_weights, llama_inputs, llama_like

from ggx.alloc import alloc_tensors
from ggx.backend import Backend
from ggx.errors import GGXError
from ggx.graph import Context, Graph, build_graph
from ggx.ops import Op
from ggx.reference import RefDevice
from ggx.sched import SchedComputeError, Scheduler
from ggx.tensor import TensorFlag
from ggx.tensor_data import get_tensor_data, set_tensor_data

sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))  # the synthetic GGUF writer
from gguf_synth import write_tiny_llama  # noqa: E402

REF = RefDevice()
RELEASE_AFTER_S = 0.2  # a held stream is released this long after the call that must wait for it


def release_later(gate: threading.Event) -> threading.Timer:
    timer = threading.Timer(RELEASE_AFTER_S, gate.set)
    timer.start()
    return timer


def chain_graph(buft, n: int, n_inputs: int, n_steps: int, seed: int = 0):
    """Each INPUT [n] times a weight in `buft`, summed, then `n_steps` adds: with the weight in
    device memory, every node runs on the device. Returns (graph, inputs, values)."""
    ctx = Context()
    w = ctx.tensor("F32", (n,), "w")
    alloc_weights(buft, [w])
    rng = np.random.default_rng(seed)
    set_tensor_data(w, rng.uniform(-1, 1, n).astype(np.float32))
    inputs = [ctx.tensor("F32", (n,), f"x{i}").set_flag(TensorFlag.INPUT) for i in range(n_inputs)]
    terms = [ctx.mul(x, w) for x in inputs]
    cur = terms[0]
    for t in terms[1:]:
        cur = ctx.add(cur, t)
    for _ in range(n_steps):
        cur = ctx.add(cur, cur)
    values = {x: rng.uniform(-1, 1, n).astype(np.float32) for x in inputs}
    return build_graph(cur), inputs, values


def reference_output(n: int, n_inputs: int, n_steps: int, seed: int = 0) -> np.ndarray:
    """chain_graph's output computed on the host alone."""
    graph, _, values = chain_graph(REF.buffer_type(), n, n_inputs, n_steps, seed)
    sched = Scheduler([REF.init_backend()])
    submit(sched, graph, values)
    sched.synchronize()
    return get_tensor_data(graph.nodes[-1])


def submit(sched, graph, values):
    sched.alloc_graph(graph)
    for t, v in values.items():
        set_tensor_data(t, v)
    sched.graph_compute_async(graph)


def no_wait(monkeypatch):
    """Take the wait before re-planning, growing and freeing away: the scheduler as it was."""
    monkeypatch.setattr(Scheduler, "_wait_for_realloc", lambda self: None)


# --- the test device is really asynchronous --------------------------------------------------
def test_graph_compute_returns_before_the_work_is_done():
    dev = TestDevice(ops={Op.ADD})
    be = dev.init_backend()
    ctx = Context()
    a = ctx.tensor("F32", (16,), "a")
    out = ctx.add(a, a)
    alloc_tensors(dev.buffer_type(), [a, out])
    set_tensor_data(a, np.arange(16, dtype=np.float32))
    set_tensor_data(out, np.zeros(16, dtype=np.float32))
    gate = be.hold()
    be.graph_compute(Graph([out], [a]))  # a synchronous graph_compute would wait for the gate: 30 s, then fail
    np.testing.assert_array_equal(get_tensor_data(out), 0)  # not computed yet
    gate.set()
    be.synchronize()
    np.testing.assert_array_equal(get_tensor_data(out), 2 * np.arange(16, dtype=np.float32))


def test_default_async_set_and_get_synchronize_first():
    """ggml's fallbacks: without its own async copies a backend waits for its stream, then copies."""
    ctx = Context()
    t = ctx.tensor("F32", (4,), "t")
    alloc_tensors(REF.buffer_type(), [t])
    set_tensor_data(t, np.zeros(4, dtype=np.float32))
    seen = []

    class Stream(Backend):
        name = "stream"

        def graph_compute(self, graph):
            pass

        def synchronize(self):
            seen.append(get_tensor_data(t).copy())  # what the tensor holds when the wait happens

    be = Stream(REF)
    be.set_tensor_async(t, np.ones(4, dtype=np.float32).view(np.uint8))
    assert len(seen) == 1 and not seen[0].any()  # the wait came before the write
    np.testing.assert_array_equal(get_tensor_data(t), 1)
    got = be.get_tensor_async(t)
    assert len(seen) == 2
    np.testing.assert_array_equal(got.view(np.float32), 1)


# --- re-planning and growing while work is in flight -----------------------------------------
def test_growing_while_work_is_in_flight_waits_for_it(monkeypatch):
    want = reference_output(4096, 2, 4, seed=1)

    def run(wait: bool):
        dev = TestDevice(ops={Op.MUL, Op.ADD})
        be = dev.init_backend()
        sched = Scheduler([be, REF.init_backend()])
        small, _, small_vals = chain_graph(dev.buffer_type(), 64, 1, 4)
        big, _, big_vals = chain_graph(dev.buffer_type(), 4096, 2, 4, seed=1)
        sched.alloc_graph(small)
        waits = sched.stats.n_realloc_waits
        old = sched.alloc.buffers[0]
        gate = be.hold()
        submit(sched, small, small_vals)  # the plan is reused (no wait); its work is queued behind the gate
        if wait:
            release_later(gate)
        sched.alloc_graph(big)  # a new plan, and the device buffer grows: waits for the gate first
        assert sched.alloc.buffers[0] is not old and old.is_freed
        assert sched.stats.n_realloc_waits == waits + (1 if wait else 0)
        gate.set()
        sched.synchronize()
        for t, v in big_vals.items():
            set_tensor_data(t, v)
        sched.graph_compute(big)
        return get_tensor_data(big.nodes[-1])

    np.testing.assert_allclose(run(wait=True), want, rtol=1e-6)
    # without the wait, the old buffer is freed under the queued work: a use after free
    no_wait(monkeypatch)
    with pytest.raises(GGXError, match="freed"):
        run(wait=False)


def test_replanning_while_work_is_in_flight_keeps_results_right(monkeypatch):
    """Pipelining (n_copies 2): graph B's input copies use the other copy set, whose event does
    not cover graph A's queued work. Under B's new plan they lie where A's queued work still
    writes, so without the wait A's late writes land in B's inputs (ggml: "the re-allocation may
    cause the split inputs to be moved")."""

    def run(wait: bool):
        dev = TestDevice(ops={Op.MUL, Op.ADD})
        be = dev.init_backend()
        sched = Scheduler([be, REF.init_backend()], n_copies=2)
        a, _, a_vals = chain_graph(dev.buffer_type(), 256, 1, 6)
        b, b_inputs, b_vals = chain_graph(dev.buffer_type(), 256, 3, 1, seed=1)
        want = reference_output(256, 3, 1, seed=1)
        sched.reserve(a)
        sched.reserve(b)  # both fit from now on: no buffer grows below
        grows = sched.alloc.n_grows
        sched.alloc_graph(a)  # planned now: submitting it below reuses the plan, with no wait
        gate = be.hold()
        submit(sched, a, a_vals)
        if wait:
            release_later(gate)
        sched.alloc_graph(b)  # a new plan, same buffer
        assert sched.alloc.n_grows == grows
        # B's copies of this copy set overlap memory where A's queued nodes write
        dev_nodes = [n for n in a.nodes if n.data_buffer is sched.alloc.buffers[0] and not n.op.is_view]
        spans = [(n.data_offset, n.data_offset + n.nbytes) for n in dev_nodes]
        copies = [sched.copy_of(x, be) for x in b_inputs]
        assert any(c.data_offset < hi and lo < c.data_offset + c.nbytes for c in copies for lo, hi in spans)
        for t, v in b_vals.items():
            set_tensor_data(t, v)
        sched.graph_compute_async(b)
        gate.set()
        sched.synchronize()
        return get_tensor_data(b.nodes[-1]), want

    got, want = run(wait=True)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    no_wait(monkeypatch)
    got, want = run(wait=False)
    assert not np.allclose(got, want, rtol=1e-3)  # corrupted: the wait is what keeps it right


def test_a_reused_plan_waits_for_nothing():
    """The decode loop: same graph, same buffers: no wait beyond graph_compute's own synchronize."""
    dev = TestDevice(ops={Op.MUL, Op.ADD})
    sched = Scheduler([dev.init_backend(), REF.init_backend()])
    graph, _, values = chain_graph(dev.buffer_type(), 64, 2, 3)
    submit(sched, graph, values)
    sched.synchronize()
    waits, plans = sched.stats.n_realloc_waits, sched.stats.n_plans
    for _ in range(5):
        submit(sched, graph, values)
        sched.synchronize()
    assert sched.stats.n_realloc_waits == waits and sched.stats.n_plans == plans and sched.stats.plan_reused


def test_free_waits_for_queued_work_then_frees_the_compute_buffers(monkeypatch):
    dev = TestDevice(ops={Op.MUL, Op.ADD})
    be = dev.init_backend()
    sched = Scheduler([be, REF.init_backend()])
    graph, _, values = chain_graph(dev.buffer_type(), 256, 2, 4)
    want = reference_output(256, 2, 4)
    submit(sched, graph, values)
    sched.synchronize()
    buffers = [b for b in sched.alloc.buffers if b is not None]
    gate = be.hold()
    submit(sched, graph, values)
    release_later(gate)
    sched.free()
    assert buffers and all(b.is_freed for b in buffers) and all(b is None for b in sched.alloc.buffers)
    with pytest.raises(GGXError, match="freed"):
        get_tensor_data(graph.nodes[-1])  # its memory is gone
    submit(sched, graph, values)  # still usable: planned and allocated again
    sched.synchronize()
    np.testing.assert_allclose(get_tensor_data(graph.nodes[-1]), want, rtol=1e-6)

    no_wait(monkeypatch)
    gate = be.hold()
    submit(sched, graph, values)
    sched.free()
    gate.set()
    with pytest.raises(GGXError, match="freed"):
        sched.synchronize()


# --- graph_optimize ---------------------------------------------------------------------------
def lifo_order(nodes: list) -> list:
    """A valid order other than the given one: of the nodes whose sources are done, the last first."""
    inside = {id(n) for n in nodes}
    deps = {id(n): {id(s) for s in (*n.src, n.view_src) if s is not None and id(s) in inside} for n in nodes}
    done: set[int] = set()
    out = []
    while len(out) < len(nodes):
        ready = [n for n in nodes if id(n) not in done and deps[id(n)] <= done]
        n = ready[-1]
        done.add(id(n))
        out.append(n)
    return out


class ReorderingBackend(TestBackend):
    """Reorders every split graph it is given (and records what it was given and computed)."""

    def __init__(self, device, reorder=lifo_order):
        super().__init__(device)
        self.reorder = reorder
        self.optimized: list[tuple[Graph, Graph]] = []
        self.computed: list[Graph] = []

    def graph_optimize(self, graph):
        out = Graph(self.reorder(list(graph.nodes)), [])
        self.optimized.append((graph, out))
        return out

    def graph_compute(self, graph):
        self.computed.append(graph)
        super().graph_compute(graph)


class ReorderingDevice(TestDevice):
    def __init__(self, reorder=lifo_order, **kw):
        super().__init__(**kw)
        self.reorder = reorder

    def init_backend(self, **params):
        return ReorderingBackend(self, self.reorder)


@pytest.mark.parametrize("n_copies", [1, 2])
def test_graph_optimize_once_per_split_and_its_order_is_computed_and_allocated(n_copies):
    rng = np.random.default_rng(0)
    graph, weights, inputs = llama_like(n_layer=2)
    alloc_weights(REF.buffer_type(), weights, rng)
    values = llama_inputs(inputs, rng)
    want = Scheduler([REF.init_backend()])
    want.alloc_graph(graph)
    for t, v in values.items():
        set_tensor_data(t, v)
    want.graph_compute(graph)
    want_out = get_tensor_data(graph.nodes[-1])

    dev = ReorderingDevice(ops=set(Op) - {Op.ROPE, Op.SOFT_MAX})  # several splits
    graph2, weights2, inputs2 = llama_like(n_layer=2)
    alloc_weights(dev.buffer_type(), weights2, np.random.default_rng(0))
    be = dev.init_backend()
    sched = Scheduler([be, REF.init_backend()], n_copies=n_copies)
    values2 = {inputs2[k]: values[inputs[k]] for k in inputs}
    for _ in range(2):
        sched.alloc_graph(graph2)
        for t, v in values2.items():
            set_tensor_data(t, v)
        sched.graph_compute(graph2)
        np.testing.assert_allclose(get_tensor_data(graph2.nodes[-1]), want_out, rtol=1e-5, atol=1e-5)
        n_dev_splits = sum(sp.backend is be for sp in sched.splits)
        assert n_dev_splits > 1
        assert len(be.optimized) == n_dev_splits * n_copies  # once per split graph, at the first plan only
    returned = {id(out) for _given, out in be.optimized}
    assert be.computed and all(id(g) in returned for g in be.computed)  # the returned graphs are what ran
    assert any(list(map(id, g.nodes)) != list(map(id, out.nodes)) for g, out in be.optimized)  # really reordered

    # a rebuilt graph (same key): its split graphs are built, and optimized, once more
    graph3, weights3, inputs3 = llama_like(n_layer=2)
    for a, b in zip(weights3, weights2):
        a.buffer, a.offset = b.buffer, b.offset
    sched.alloc_graph(graph3)
    assert sched.stats.plan_reused and len(be.optimized) == 2 * n_dev_splits * n_copies
    for k in inputs3:
        set_tensor_data(inputs3[k], values[inputs[k]])
    sched.graph_compute(graph3)
    np.testing.assert_allclose(get_tensor_data(graph3.nodes[-1]), want_out, rtol=1e-5, atol=1e-5)


def test_graph_optimize_that_breaks_the_graph_is_refused_before_anything_runs():
    def drop_last(nodes):
        return nodes[:-1]

    def reverse(nodes):
        return nodes[::-1]

    for reorder, match in ((drop_last, "returned .* of the"), (reverse, "before its source")):
        dev = ReorderingDevice(reorder, ops={Op.MUL, Op.ADD})
        be = dev.init_backend()
        graph, _, _ = chain_graph(dev.buffer_type(), 16, 2, 2)
        with pytest.raises(SchedComputeError, match=match) as info:
            Scheduler([be, REF.init_backend()]).alloc_graph(graph)
        assert info.value.backend is be and be.computed == []


def test_graph_optimize_must_order_a_same_key_graph_the_same_way():
    calls = []

    def flip_flop(nodes):  # depends on something other than the structure: the call count
        calls.append(1)
        return lifo_order(nodes) if len(calls) % 2 else nodes

    dev = ReorderingDevice(flip_flop, ops={Op.MUL, Op.ADD})
    be = dev.init_backend()
    sched = Scheduler([be, REF.init_backend()])
    graph, _, _ = chain_graph(dev.buffer_type(), 16, 3, 0)
    sched.alloc_graph(graph)
    rebuilt, _, _ = chain_graph(dev.buffer_type(), 16, 3, 0)
    for a, b in zip(rebuilt.leafs, graph.leafs):
        if b.buffer is not None:
            a.buffer, a.offset = b.buffer, b.offset
    with pytest.raises(SchedComputeError, match="same key"):
        sched.alloc_graph(rebuilt)
    sched.alloc_graph(graph)  # the plan is unchanged: the first graph still runs
    assert sched.stats.plan_reused and sched.splits[0].nodes == graph.nodes


# --- the llama model over the async device ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def test_llama_model_on_the_async_device_matches_the_reference(tiny_llama):
    from ggx.models import load_model

    prompt = [5, 70, 71, 72, 3, 200, 33]
    ref = load_model(tiny_llama, devices=["ref"])
    want = ref.forward(prompt)
    want_next = [ref.eval([t]) for t in (8, 9)]

    dev = TestDevice("llama-async")
    m = load_model(tiny_llama, devices=[dev, RefDevice()], tensor_split=[1, 0])  # every layer on dev, none on ref
    assert m.wait_prepared(120)  # the scheduler's statistics below are the test's graphs only
    # weights in device memory, but the token embedding (host memory, as llama.cpp keeps tok_embd)
    assert all(not w.data_buffer.is_host for n, w in m.weights.items() if n != "token_embd.weight")
    np.testing.assert_allclose(m.forward(prompt), want, rtol=1e-4, atol=1e-4)
    sched = m.runner.sched
    assert sched.stats.n_splits >= 1 and any(sp.backend.device is dev for sp in sched.splits)
    np.testing.assert_allclose(m.eval([8]), want_next[0], rtol=1e-4, atol=1e-4)
    waits = sched.stats.n_realloc_waits
    np.testing.assert_allclose(m.eval([9]), want_next[1], rtol=1e-4, atol=1e-4)
    assert sched.stats.plan_reused and sched.stats.n_realloc_waits == waits  # decode: no extra wait


def test_a_scheduler_used_by_a_second_thread_at_once_raises():
    """A second thread entering a scheduler while the first is inside it (here: waiting for its
    held stream) gets GGXStateError instead of mixing two graphs' placement."""
    from ggx.errors import GGXStateError

    dev = TestDevice()
    be = dev.init_backend()
    sched = Scheduler([be, REF.init_backend()])
    graph, _, values = chain_graph(dev.buffer_type(), 64, 2, 3)
    submit(sched, graph, values)
    sched.synchronize()
    gate = be.hold()
    submit(sched, graph, values)  # queued behind the held stream
    first = threading.Thread(target=sched.synchronize)
    first.start()
    try:
        deadline = 50
        while sched._user is None and deadline:  # wait until the first thread is inside
            threading.Event().wait(0.01)
            deadline -= 1
        with pytest.raises(GGXStateError, match="another thread"):
            sched.alloc_graph(graph)
    finally:
        gate.set()
        first.join()
    submit(sched, graph, values)  # usable again once the first thread left
    sched.synchronize()
    np.testing.assert_allclose(get_tensor_data(graph.nodes[-1]), reference_output(64, 2, 3), rtol=1e-6)
