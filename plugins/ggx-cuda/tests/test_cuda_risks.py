"""The review's ordering and lifetime risks (CUDA-REVIEW.md, section 4), on the driver double:
a failed CUDA-graph capture, copies between two CUDA devices ordered on the source stream, the
pinned buffer of get_tensor_async kept until synchronize, and set_graphs."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from fake_driver import FakeCaptureError, FakeDriver

from ggx import registry
from ggx.alloc import alloc_tensors
from ggx.graph import Context, build_graph
from ggx_cuda.cuda_graph import DISABLED, EAGER
from ggx_cuda.device import CudaBackend, CudaBackendReg


@pytest.fixture(scope="module")
def fake():
    return FakeDriver(deferred=True, devices=2)


@pytest.fixture(scope="module")
def devices(fake):
    reg = CudaBackendReg(driver=fake, prefix="RISKCUDA")
    reg.name = "cuda-risks"
    registry.register(reg, name="cuda-risks")
    yield registry.get_device("RISKCUDA0"), registry.get_device("RISKCUDA1")
    registry.unregister("cuda-risks")


def _silu_graph(device, n=256):
    c = Context()
    x = c.tensor("F32", (n,), "x")
    y = c.silu(c.scale(x, 0.5))
    g = build_graph(y)
    alloc_tensors(device.buffer_type(), [x, *[t for t in g.nodes if t.view_src is None]])
    x.data_buffer.set_tensor(x, np.arange(n, dtype=np.float32).view(np.uint8))
    v = np.arange(n, dtype=np.float32) * 0.5
    return g, y, v / (1 + np.exp(-v))


def test_a_failed_capture_runs_eagerly_from_then_on(devices, fake, monkeypatch):
    be = devices[0].init_backend()
    g, y, want = _silu_graph(devices[0])
    ends = []

    def invalidated(stream):
        ends.append(stream)
        stream.capture = None  # the capture is over, as CUDA ends an invalidated one
        raise FakeCaptureError("operation not permitted when stream is capturing")

    monkeypatch.setattr(fake, "capture_end", invalidated)
    actions = []
    for _ in range(4):
        be.graph_compute(g)  # the failed capture does not surface: the graph runs eagerly
        be.synchronize()
        actions.append(be.graphs.last(id(g)))
        assert np.allclose(y.data_buffer.get_tensor(y).view(np.float32), want, rtol=1e-6)
    assert [d.action for d in actions] == [EAGER, "capture", EAGER, EAGER]
    assert len(ends) == 1  # captured once, never tried again
    assert actions[-1].reason.startswith("capture failed: FakeCaptureError: operation not permitted")


def test_a_kernel_error_while_capturing_still_raises_and_ends_the_capture(devices, fake, monkeypatch):
    be = devices[0].init_backend()
    g, _, _ = _silu_graph(devices[0])
    for _ in range(1):
        be.graph_compute(g)
        be.synchronize()
    real_run = fake.run

    def broken(stream, node, launches):
        raise RuntimeError("illegal address")

    monkeypatch.setattr(fake, "run", broken)
    with pytest.raises(RuntimeError, match="illegal address"):
        be.graph_compute(g)  # the capture fails, the eager run raises the real error
    assert be.stream.capture is None  # the capture was ended
    monkeypatch.setattr(fake, "run", real_run)
    be.graph_compute(g)
    be.synchronize()
    assert be.graphs.last(id(g)).reason.startswith("capture failed: RuntimeError: illegal address")


def test_copy_between_two_cuda_devices_is_ordered_on_the_source_stream(devices, fake):
    d0, d1 = devices
    b0, b1 = d0.init_backend(), d1.init_backend()
    c = Context()
    src, dst = c.tensor("F32", (64,), "src"), c.tensor("F32", (64,), "dst")
    alloc_tensors(d0.buffer_type(), [src])
    alloc_tensors(d1.buffer_type(), [dst])
    src.data_buffer.set_tensor(src, np.full(64, 7.0, np.float32).view(np.uint8))
    assert b1.cpy_tensor_async(b0, src, dst)
    # the source stream's next work overwrites src (a later split reusing that memory)
    fake.memset(b0.stream, src.data_buffer.address(src), 0, src.nbytes)
    b0.synchronize()  # run the source stream to its end first
    b1.synchronize()
    assert np.array_equal(dst.data_buffer.get_tensor(dst).view(np.float32), np.full(64, 7.0, np.float32))


def test_get_tensor_async_keeps_its_pinned_buffer_until_synchronize(devices):
    d0 = devices[0]
    be = d0.init_backend()
    c = Context()
    t = c.tensor("F32", (32,), "t")
    alloc_tensors(d0.buffer_type(), [t])
    t.data_buffer.set_tensor(t, np.arange(32, dtype=np.float32).view(np.uint8))
    out = be.get_tensor_async(t)
    assert any(x is out for x in be._staging)
    be.synchronize()
    assert np.array_equal(out.view(np.float32), np.arange(32, dtype=np.float32)) and not be._staging
    del out
    gc.collect()


def test_set_graphs_turns_capture_off_and_on(devices):
    be = devices[0].init_backend()
    assert isinstance(be, CudaBackend)
    fn = devices[0].reg.get_proc_address("set_graphs")
    g, _, _ = _silu_graph(devices[0])
    for _ in range(3):
        be.graph_compute(g)
    assert be.graphs.last(id(g)).action == "launch"
    fn(be, False)
    be.graph_compute(g)
    assert be.graphs.last(id(g)) is None and len(be.graphs) == 0  # disabled: graphs dropped
    assert be.graphs.reasons().get(f"eager: {DISABLED}") == 1
    fn(be, True)
    assert [be.graph_compute(g) or be.graphs.last(id(g)).action for _ in range(2)] == ["eager", "capture"]
    be.synchronize()
