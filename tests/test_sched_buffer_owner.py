"""Pass 1 of the scheduler with two host devices: an op reading a weight runs on the backend whose
device owns the weight's buffer type (what makes a layer split over "ref" and "CPU" run each
layer where its weights are), and ggml's priority order where no listed backend owns it."""
import numpy as np
from sched_device import alloc_weights

from ggx.graph import Context, build_graph
from ggx.host import HostBufferType
from ggx.reference import RefDevice
from ggx.sched import Scheduler
from ggx.tensor import TensorFlag
from ggx.tensor_data import get_tensor_data, set_tensor_data


class NamedRef(RefDevice):
    """Another reference device with host memory of its own."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self._buft = HostBufferType(self, name=name)


class SharesHostMemory(RefDevice):
    """A device whose own buffer type is another device's (ggml's BLAS device uses the CPU's)."""

    def __init__(self, name: str, host: RefDevice):
        super().__init__()
        self.name = name
        self._buft = host.buffer_type()


def two_layers(bufts):
    """x -> mul_mat(w0) -> mul_mat(w1), w_i in bufts[i]; returns graph, (node0, node1), x, weights."""
    ctx = Context()
    x = ctx.tensor("F32", (8, 2), name="x").set_flag(TensorFlag.INPUT)
    ws = [ctx.tensor("F32", (8, 8), name=f"w{i}").set_flag(TensorFlag.PARAM) for i in range(2)]
    h0 = ctx.mul_mat(ws[0], x)
    h1 = ctx.mul_mat(ws[1], h0)
    rng = np.random.default_rng(0)
    for w, b in zip(ws, bufts):
        alloc_weights(b, [w], rng)
    return build_graph(h1), (h0, h1), x, ws


def compute(devices, bufts):
    graph, nodes, x, _ = two_layers(bufts)
    sched = Scheduler([d.init_backend() for d in devices])
    sched.alloc_graph(graph)
    set_tensor_data(x, np.ones((2, 8), np.float32))
    sched.graph_compute(graph)
    return [sched.backend_of(n).device.name for n in nodes], len(sched.splits), get_tensor_data(nodes[1])


def test_each_weight_runs_on_the_host_device_owning_its_memory():
    a, b = NamedRef("a"), NamedRef("b")
    # both read any host memory: by priority alone everything would run on the first listed
    for order in ([a, b], [b, a]):
        where, n_splits, out = compute(order, [a.buffer_type(), b.buffer_type()])
        assert where == ["a", "b"] and n_splits == 2
    where, n_splits, same = compute([a, b], [a.buffer_type(), a.buffer_type()])
    assert where == ["a", "a"] and n_splits == 1
    np.testing.assert_array_equal(out, same)


def test_without_an_owner_among_the_backends_priority_decides_as_in_ggml():
    a, b, other = NamedRef("a"), NamedRef("b"), NamedRef("other")
    where, _, _ = compute([a, b], [other.buffer_type(), other.buffer_type()])
    assert where == ["a", "a"]
    host = NamedRef("host")
    blas = SharesHostMemory("blas", host)  # owns the host's type too, and is listed first: it runs
    where, _, _ = compute([blas, host], [host.buffer_type(), host.buffer_type()])
    assert where == ["blas", "blas"]
