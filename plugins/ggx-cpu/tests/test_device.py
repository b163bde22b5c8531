"""The device layer: registration, identity, threads, supports_op, extra buffer types, laziness,
kept launches, profiling."""
import gc
import subprocess
import sys
import weakref

import numpy as np
import pytest

import ggx
from ggx import registry
from ggx.backend import API_VERSION, Buffer, DeviceType, ExtraBufferType
from ggx.errors import GGXError, GGXShapeError, GGXUnsupported
from ggx.host import HostBufferType
from ggx.types import GType
from ggx_cpu import device as cpu_device
from ggx_cpu import plugin, sysinfo
from ggx_cpu.device import CpuDevice
from ggx_cpu.plugin import backend_reg, ggx_backend_reg


@pytest.fixture(scope="module")
def dev():
    return backend_reg().devices()[0]


def test_registration_and_identity(dev):
    reg = ggx_backend_reg()
    assert reg is backend_reg() and plugin.GGX_API_VERSION == API_VERSION and reg.name == "CPU"
    assert dev.name == "CPU" and dev.type == DeviceType.CPU and dev.reg is reg
    assert sysinfo.cpu_model() in dev.description
    free, total = dev.memory()
    assert 0 < free <= total
    buft = dev.buffer_type()
    assert isinstance(buft, HostBufferType) and buft.name == "CPU" and buft.device is dev
    assert dev.supports_buft(buft) and dev.supports_buft(HostBufferType(dev, name="other host"))


def test_entry_point_finds_the_plugin():
    assert any(d.name == "CPU" for d in ggx.devices())


def test_set_n_threads_and_features(dev):
    be = dev.init_backend()
    assert be.n_threads == sysinfo.default_threads()
    backend_reg().get_proc_address("set_n_threads")(be, 1)
    assert be.n_threads == 1
    be.get_proc_address("set_n_threads")(2)
    assert be.n_threads == 2
    with pytest.raises(GGXShapeError):
        be.set_n_threads(0)
    assert dev.init_backend(n_threads=1).n_threads == 1
    with pytest.raises(GGXUnsupported):
        dev.init_backend(threads=3)
    feats = backend_reg().get_proc_address("get_features")()
    assert {"cpu", "isa", "features"} <= set(feats)
    assert backend_reg().get_proc_address("no such thing") is None


def test_supports_op_by_type(dev):
    ctx = ggx.Context()
    f32 = ctx.tensor(GType.F32, (256, 4))
    assert dev.supports_op(ctx.get_rows(ctx.tensor(GType.Q6_K, (256, 8)), ctx.tensor(GType.I32, (2,))))
    assert dev.supports_op(ctx.cpy(f32, ctx.tensor(GType.Q4_0, (256, 4))))
    q5 = ctx.tensor(GType.Q5_0, (640, 8))
    assert dev.supports_op(ctx.cpy(f32, ctx.tensor(GType.Q5_0, (256, 4))))
    assert dev.supports_op(ctx.mul_mat(q5, ctx.tensor(GType.F32, (640, 3))))
    assert dev.supports_op(ctx.get_rows(q5, ctx.tensor(GType.I32, (2,))))
    assert not dev.supports_op(ctx.cpy(f32, ctx.tensor(GType.Q8_K, (256, 4))))
    assert dev.supports_op(ctx.reshape(f32, (1024,)))
    assert dev.supports_op(ctx.flash_attn_ext(ctx.tensor(GType.F32, (64, 2, 4)), ctx.tensor(GType.F16, (64, 8, 2)),
                                              ctx.tensor(GType.F16, (64, 8, 2))))


class FakeExtra(ExtraBufferType):
    """An extra buffer type over plain host memory that accepts SCALE: `launch` is what its
    prepare_forward gives (None declines); `host` is its is_host."""

    name = "FAKE"

    def __init__(self, dev, launch=None, host=True):
        self._dev = dev
        self.launch = launch
        self.host = host
        self.calls = []

    @property
    def device(self):
        return self._dev

    @property
    def is_host(self) -> bool:
        return self.host

    def alloc_buffer(self, size: int) -> Buffer:
        buf = HostBufferType(self._dev).alloc_buffer(size)
        buf.buft = self  # the same memory, now this buffer type's
        return buf

    def supports_op(self, op) -> bool:
        return op.op is ggx.Op.SCALE

    def prepare_forward(self, op, n_threads: int = 1):
        self.calls.append((op.op, n_threads))
        return self.launch


def _scale_from(dev, extra):
    """scale(w, 2) with w = [0, 1, ..., 15] in `extra`, the result in host memory."""
    ctx = ggx.Context()
    w = ctx.tensor(GType.F32, (8, 2))
    w.buffer, w.offset = extra.alloc_buffer(w.nbytes), 0
    w.buffer.set_tensor(w, np.arange(16, dtype=np.float32).view(np.uint8))
    node = ctx.scale(w, 2.0)
    node.buffer, node.offset = dev.buffer_type().alloc_buffer(node.nbytes), 0
    node.buffer.clear(0)
    return w, node


def _device_with(*extras):
    """A CPU device whose extra buffer types are `extras` (an extra buffer type belongs to the
    device it names: the device supports it by `buft.device is self`)."""
    dev = CpuDevice()
    for extra in extras:
        extra._dev = dev
    return dev


def test_extra_buffer_types_are_asked_first():
    """A launch from the extra type runs instead of the CPU kernel; an is_host type may decline
    and let the CPU kernel run."""
    ran = []
    extra = FakeExtra(None, launch=lambda: ran.append(True))
    dev = _device_with(extra)
    w, node = _scale_from(dev, extra)
    assert dev.supports_buft(extra)
    assert dev.supports_op(node) and dev.supports_op(ggx.Context().silu(w))
    dev.init_backend(n_threads=1).graph_compute(ggx.build_graph(node))
    assert extra.calls == [(ggx.Op.SCALE, 1)] and ran == [True]
    assert not ggx.host.tensor_array(node).any()  # the CPU kernel did not run

    declining = FakeExtra(None)
    dev = _device_with(declining)
    w, node = _scale_from(dev, declining)
    dev.init_backend(n_threads=1).graph_compute(ggx.build_graph(node))
    assert declining.calls == [(ggx.Op.SCALE, 1)]
    assert np.array_equal(ggx.host.tensor_array(node).reshape(-1), 2 * np.arange(16, dtype=np.float32))


def test_a_transforming_extra_type_must_give_a_launch():
    """No CPU kernel can read a layout that is not host memory: declining is an error naming the type."""
    extra = FakeExtra(None, host=False)
    dev = _device_with(extra)
    w, node = _scale_from(dev, extra)
    assert dev.supports_op(node) and not dev.supports_op(ggx.Context().silu(w))
    with pytest.raises(GGXUnsupported, match="FAKE.*no launch"):
        dev.init_backend(n_threads=1).graph_compute(ggx.build_graph(node))


def test_an_extra_type_of_another_device_is_not_asked():
    extra = FakeExtra(CpuDevice(), host=False)
    dev = _device_with()
    _, node = _scale_from(dev, extra)
    assert not dev.supports_buft(extra) and not dev.supports_op(node)


def test_the_plugins_extra_buffer_types_belong_to_the_device():
    """The CPU device has no extra buffer types of its own and never asks the registry: the engine
    merges the plugins' (`registry.extra_buffer_types`, also what "dev_get_extra_bufts" answers),
    and each of them names this device, which is how the device supports it."""
    dev = registry.get_device("CPU")
    assert dev.extra_buffer_types() == []
    merged = registry.extra_buffer_types(dev)
    assert backend_reg().get_proc_address("dev_get_extra_bufts")(dev) == merged
    assert all(b.device is dev and dev.supports_buft(b) for b in merged)
    other = CpuDevice()
    assert not any(other.supports_buft(b) for b in merged if not b.is_host)


def test_buffer_from_host_ptr(dev):
    from ggx.host import aligned_empty

    mem = aligned_empty(256)
    buf = dev.buffer_from_host_ptr(mem, 256)
    ctx = ggx.Context()
    t = ctx.tensor(GType.F32, (64,))
    t.buffer, t.offset = buf, 0
    buf.set_tensor(t, np.arange(64, dtype=np.float32).view(np.uint8))
    assert np.array_equal(mem.view(np.float32), np.arange(64, dtype=np.float32))
    with pytest.raises(GGXUnsupported):
        dev.buffer_from_host_ptr(aligned_empty(257)[1:], 256)
    buf.free()
    with pytest.raises(GGXError, match="freed"):
        buf.get_tensor(t)


def test_unknown_op_is_unsupported(dev):
    ctx = ggx.Context()
    a = ctx.tensor(GType.F32, (4,))
    node = ctx.silu(a)
    node.op = ggx.Op.NONE  # op NONE is a leaf: nothing to run, no error
    assert dev.init_backend().launch_for(node) is None
    with pytest.raises(GGXUnsupported):
        cpu_device.kernel_for(ggx.Op.VIEW)


def test_discovery_is_light():
    """Registering, memory and supports_op import no numba (the description asks ggx_cpu.isa, which may)."""
    code = ("import sys, ggx; from ggx_cpu.plugin import ggx_backend_reg; d = ggx_backend_reg().devices()[0];"
            "c = ggx.Context(); a = c.tensor('q4_0', (64, 4)); d.memory();"
            "d.supports_op(c.mul_mat(a, c.tensor('f32', (64, 2)))); d.supports_op(c.silu(c.tensor('f32', 4)));"
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_small_ops_run_on_one_thread(dev):
    be = dev.init_backend(n_threads=2)
    ctx = ggx.Context()
    small, big = ctx.silu(ctx.tensor(GType.F32, (16,))), ctx.silu(ctx.tensor(GType.F32, (4096, 8)))
    assert be.threads_for(small) == 1 and be.threads_for(big) == 2


def test_thread_count_follows_the_work(dev):
    """SET_ROWS counts the rows it writes (not its destination, a whole KV cache); attention
    over a few cache slots runs on one thread, one token's over a 256-slot cache on all."""
    be = dev.init_backend(n_threads=2)
    ctx = ggx.Context()
    cache = ctx.tensor(GType.F16, (576, 4096))
    one_row = ctx.set_rows(cache, ctx.tensor(GType.F32, (576, 1)), ctx.tensor(GType.I64, (1,)))
    many_rows = ctx.set_rows(cache, ctx.tensor(GType.F32, (576, 64)), ctx.tensor(GType.I64, (64,)))
    assert be.threads_for(one_row) == 1 and be.threads_for(many_rows) == 2
    k = ctx.tensor(GType.F16, (64, 256, 3))
    short = ctx.tensor(GType.F16, (64, 32, 3))
    tiny = ctx.flash_attn_ext(ctx.tensor(GType.F32, (64, 1, 9)), short, short, scale=0.125)
    decode = ctx.flash_attn_ext(ctx.tensor(GType.F32, (64, 1, 9)), k, k, scale=0.125)
    batch = ctx.flash_attn_ext(ctx.tensor(GType.F32, (64, 32, 9)), k, k, scale=0.125)
    assert be.threads_for(tiny) == 1 and be.threads_for(decode) == 2 and be.threads_for(batch) == 2
    assert dev.init_backend(n_threads=1).threads_for(batch) == 1


# --- launches kept for a graph computed again ------------------------------------------------------
def _placed_graph(dev, n_rows=3):
    """x [8, n_rows] -> scale -> get_rows(ids) -> add(y): every tensor in one host buffer."""
    ctx = ggx.Context()
    x = ctx.tensor(GType.F32, (8, n_rows))
    ids = ctx.tensor(GType.I32, (2,))
    y = ctx.tensor(GType.F32, (8, 2))
    out = ctx.add(ctx.get_rows(ctx.scale(x, 2.0), ids), y)
    graph = ggx.build_graph(out)
    tensors = [x, ids, y] + [n for n in graph.nodes if n.view_src is None]
    buf = dev.buffer_type().alloc_buffer(4096)
    for i, t in enumerate(tensors):
        t.buffer, t.offset = buf, 256 * i
    return graph, x, ids, y, out, buf


def _set(t, values):
    t.buffer.set_tensor(t, np.ascontiguousarray(values).view(np.uint8).reshape(-1))


def test_graph_launches_are_reused_and_see_new_data(dev):
    graph, x, ids, y, out, _ = _placed_graph(dev)
    be = dev.init_backend(n_threads=2)
    xs = np.arange(24, dtype=np.float32).reshape(3, 8)
    _set(x, xs)
    _set(y, np.ones((2, 8), np.float32))
    _set(ids, np.array([2, 0], np.int32))
    be.graph_compute(graph)
    prepared = be.prepared.kept(graph)
    assert np.array_equal(ggx.host.tensor_array(out)[0, 0], 2 * xs[[2, 0]] + 1)
    _set(ids, np.array([1, 1], np.int32))  # new data, same graph: the same launches, new values
    _set(x, -xs)
    be.graph_compute(graph)
    assert be.prepared.kept(graph) is prepared
    assert np.array_equal(ggx.host.tensor_array(out)[0, 0], -2 * xs[[1, 1]] + 1)


def test_graph_prepare_binds_without_computing(dev):
    """graph_prepare validates and binds every node now and runs nothing; the next
    graph_compute uses those launches; a node that cannot run is refused by graph_prepare."""
    graph, x, ids, y, out, _ = _placed_graph(dev)
    be = dev.init_backend(n_threads=1)
    ggx.host.tensor_array(out)[...] = -1
    be.graph_prepare(graph)
    prepared = be.prepared.kept(graph)
    assert prepared is not None and (ggx.host.tensor_array(out) == -1).all()  # nothing ran
    xs = np.arange(24, dtype=np.float32).reshape(3, 8)
    _set(x, xs)
    _set(y, np.ones((2, 8), np.float32))
    _set(ids, np.array([2, 0], np.int32))
    be.graph_compute(graph)
    assert be.prepared.kept(graph) is prepared
    assert np.array_equal(ggx.host.tensor_array(out)[0, 0], 2 * xs[[2, 0]] + 1)
    bad, _, _, _, bad_out, _ = _placed_graph(dev)
    bad_out.type = GType.F16  # the last node's kernel takes F32 only
    with pytest.raises(GGXUnsupported, match="dst"):
        be.graph_prepare(bad)


def test_graph_launches_check_data_every_run(dev):
    graph, x, ids, y, out, _ = _placed_graph(dev)
    be = dev.init_backend(n_threads=1)
    _set(ids, np.array([0, 1], np.int32))
    be.graph_compute(graph)
    _set(ids, np.array([0, 3], np.int32))  # row 3 of a 3-row tensor
    with pytest.raises(GGXShapeError, match="index 3"):
        be.graph_compute(graph)


def test_a_prepared_graph_runs_fused(dev, monkeypatch):
    """A graph prepared ahead (graph_prepare) runs as one compiled sequence (the index check, the
    row kernels): new data still shows, and an index out of range still raises before its
    kernel writes anything; a graph only computed runs its launches one by one until its second
    compute, and a prepared one with GGX_CPU_WORKERS=0 always."""
    from ggx_cpu.launch import SequenceLaunch

    graph, x, ids, y, out, _ = _placed_graph(dev)
    be = dev.init_backend(n_threads=1)
    xs = np.arange(24, dtype=np.float32).reshape(3, 8)
    _set(x, xs)
    _set(y, np.ones((2, 8), np.float32))
    be.graph_prepare(graph)
    prepared = be.prepared.kept(graph)
    assert [type(f) for f in prepared.calls] == [SequenceLaunch]
    for k in range(3):
        _set(ids, np.array([k % 3, 2 - k % 3], np.int32))
        be.graph_compute(graph)
        assert np.array_equal(ggx.host.tensor_array(out)[0, 0], 2 * xs[[k % 3, 2 - k % 3]] + 1)
    assert be.prepared.kept(graph) is prepared
    ggx.host.tensor_array(out)[...] = -1
    _set(ids, np.array([0, 3], np.int32))
    with pytest.raises(GGXShapeError, match="index 3"):
        be.graph_compute(graph)
    assert (ggx.host.tensor_array(out) == -1).all()  # stopped at the check
    _set(ids, np.array([1, 0], np.int32))
    be.graph_compute(graph)  # the check's flag was reset
    assert np.array_equal(ggx.host.tensor_array(out)[0, 0], 2 * xs[[1, 0]] + 1)
    times = be.graph_profile(graph)  # through the fused sequence, step by step: every node timed
    assert [n for n, _ in times] == prepared.nodes and all(t > 0 for _, t in times)
    assert np.array_equal(ggx.host.tensor_array(out)[0, 0], 2 * xs[[1, 0]] + 1)

    computed, _, ids3, _, _, _ = _placed_graph(dev)
    _set(ids3, np.array([0, 0], np.int32))
    be.graph_compute(computed)
    assert be.prepared.kept(computed).calls == be.prepared.kept(computed).launches
    be.graph_compute(computed)  # nobody prepared it: fused at its second compute
    assert [type(f) for f in be.prepared.kept(computed).calls] == [SequenceLaunch]
    monkeypatch.setenv("GGX_CPU_WORKERS", "0")
    graph2, _, ids2, _, _, _ = _placed_graph(dev)
    _set(ids2, np.array([0, 0], np.int32))
    be.graph_prepare(graph2)
    be.graph_compute(graph2)
    assert be.prepared.kept(graph2).calls == be.prepared.kept(graph2).launches


def test_graph_launches_follow_storage_and_threads(dev):
    graph, x, ids, y, out, buf = _placed_graph(dev)
    be = dev.init_backend(n_threads=1)
    _set(x, np.ones((3, 8), np.float32))
    _set(y, np.zeros((2, 8), np.float32))
    _set(ids, np.array([0, 1], np.int32))
    be.graph_compute(graph)
    first = be.prepared.kept(graph)
    other = dev.buffer_type().alloc_buffer(4096)
    y.buffer, y.offset = other, 512  # moved: the old launch would read the old place
    _set(y, np.full((2, 8), 5, np.float32))
    be.graph_compute(graph)
    assert be.prepared.kept(graph) is not first
    assert np.array_equal(ggx.host.tensor_array(out)[0, 0], np.full((2, 8), 7, np.float32))
    second = be.prepared.kept(graph)
    be.set_n_threads(2)
    be.graph_compute(graph)
    assert be.prepared.kept(graph) is not second


def test_graph_launches_are_dropped_when_a_buffer_is_freed(dev):
    """Kept launches hold the memory they were bound to: after free() the graph is bound again,
    which raises instead of computing from released memory."""
    graph, x, ids, y, out, buf = _placed_graph(dev)
    be = dev.init_backend(n_threads=1)
    _set(ids, np.array([0, 1], np.int32))
    be.graph_compute(graph)
    buf.free()
    with pytest.raises(GGXError, match="freed"):
        be.graph_compute(graph)


def test_graph_errors_before_any_kernel_runs(dev):
    """A node that fails validation stops the graph before the first kernel writes anything."""
    graph, x, ids, y, out, _ = _placed_graph(dev)
    be = dev.init_backend(n_threads=1)
    _set(x, np.ones((3, 8), np.float32))
    scaled = graph.nodes[0]
    ggx.host.tensor_array(scaled)[...] = 0
    out.type = GType.F16  # the last node's kernel takes F32 only
    with pytest.raises(GGXUnsupported, match="dst"):
        be.graph_compute(graph)
    assert not ggx.host.tensor_array(scaled).any()  # the scale kernel never ran


def test_graph_launches_go_with_their_graph(dev):
    """Launches reference the graph's memory: they are dropped when the graph is."""
    graph, x, ids, y, out, _ = _placed_graph(dev)
    be = dev.init_backend(n_threads=1)
    _set(ids, np.array([0, 1], np.int32))
    be.graph_compute(graph)
    kept = weakref.ref(be.prepared.kept(graph))
    assert kept() is not None
    del graph
    gc.collect()
    assert kept() is None


def test_graph_profile_times_each_launch(dev):
    """graph_profile computes the graph through its kept launches: (node, seconds) per node
    that runs (views have nothing to run), the same results as graph_compute."""
    graph, x, ids, y, out, _ = _placed_graph(dev)
    be = dev.init_backend(n_threads=1)
    xs = np.arange(24, dtype=np.float32).reshape(3, 8)
    _set(x, xs)
    _set(y, np.ones((2, 8), np.float32))
    _set(ids, np.array([2, 0], np.int32))
    be.graph_compute(graph)
    prepared = be.prepared.kept(graph)
    ggx.host.tensor_array(out)[...] = 0
    times = be.graph_profile(graph)
    assert be.prepared.kept(graph) is prepared
    assert [n for n, _ in times] == [n for n in graph.nodes if not n.op.is_view]
    assert all(s >= 0 for _, s in times)
    assert np.array_equal(ggx.host.tensor_array(out)[0, 0], 2 * xs[[2, 0]] + 1)
