"""Tests of the driver double itself (tests/fake_driver.py): memory checks, stream order, events,
capture, and run() computing nodes in place in fake device memory."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from fake_driver import BASE, FakeCaptureError, FakeDriver, FakeGraph, FakeLaunchError, FakeMemoryError

from ggx.errors import GGXOutOfMemory
from ggx.graph import Context
from ggx.tensor import Tensor
from ggx.types import GType
from ggx_cuda.driver import Allocation, GemmLaunch, Kernel, KernelLaunch

K = Kernel("test.cu", "k_test<float>")
NAMES = {"test.cu": ["k_test<float>"]}


class DevBuf:
    """Stand-in for the device code's CudaBuffer: what the fake reads is `ptr`."""

    def __init__(self, alloc: Allocation):
        self.alloc, self.ptr, self.size = alloc, alloc.ptr, alloc.size


def place(fake: FakeDriver, *tensors: Tensor) -> None:
    for t in tensors:
        t.buffer, t.offset = DevBuf(fake.alloc(0, t.nbytes)), 0


def addr(t: Tensor) -> int:
    return t.data_buffer.ptr + t.data_offset


def upload(fake: FakeDriver, s, t: Tensor, values: np.ndarray) -> None:
    fake.copy_h2d(s, addr(t), np.ascontiguousarray(values, dtype=t.type.block_dtype))


def download(fake: FakeDriver, s, t: Tensor) -> np.ndarray:
    out = np.empty(t.shape, t.type.block_dtype)
    fake.copy_d2h(s, out, addr(t))
    fake.synchronize(s)
    return out


def launch(*args, grid=(1, 1, 1), block=(32, 1, 1), shared=0) -> KernelLaunch:
    return KernelLaunch(K, grid, block, tuple(args), shared)


# --- memory --------------------------------------------------------------------------------------
def test_addresses_aligned_never_reused_with_gaps():
    fake = FakeDriver()
    a, b = fake.alloc(0, 100), fake.alloc(0, 1000)
    assert a.ptr == BASE and a.ptr % 256 == 0 and b.ptr % 256 == 0
    assert b.ptr >= a.ptr + 100 + 4096
    fake.free(b)
    c = fake.alloc(0, 1000)
    assert c.ptr > b.ptr
    arr, off = fake.resolve(a.ptr + 10, 90)
    assert arr is a.owner and off == 10 and arr.size == 100
    assert (arr == 0xFF).all()  # fresh memory is poison, not zeros


@pytest.mark.parametrize("where, nbytes", [(-1, 1), (0, 101), (99, 2), (100, 1), (200, 1), (4096, 1)])
def test_out_of_range_is_caught(where, nbytes):
    fake = FakeDriver()
    a = fake.alloc(0, 100)
    fake.alloc(0, 100)
    with pytest.raises(FakeMemoryError):
        fake.resolve(a.ptr + where, nbytes)


def test_freed_memory_is_caught():
    fake = FakeDriver()
    a, b = fake.alloc(0, 64), fake.alloc(0, 64)
    pa, pb = a.ptr, b.ptr
    fake.free(a)
    with pytest.raises(FakeMemoryError, match="freed"):
        fake.resolve(pa, 1)
    with pytest.raises(FakeMemoryError):
        fake.free(a)
    del b
    gc.collect()
    with pytest.raises(FakeMemoryError, match="freed"):
        fake.resolve(pb, 1)
    assert fake.used(0) == 0


def test_free_before_queued_work_runs():
    fake = FakeDriver(deferred=True)
    s = fake.stream(0)
    a = fake.alloc(0, 64)
    fake.memset(s, a.ptr, 0, 64)
    fake.free(a)
    with pytest.raises(FakeMemoryError, match="before the work ran"):
        fake.synchronize(s)


def test_mem_info_and_oom():
    fake = FakeDriver(total_memory=1 << 20, oom_above=4096)
    keep = fake.alloc(0, 3000)  # noqa: F841 - an allocation lives as long as its Allocation
    assert fake.mem_info(0) == ((1 << 20) - 3000, 1 << 20)
    with pytest.raises(GGXOutOfMemory, match=r"2000 bytes \(3000 bytes in use.*4096"):
        fake.alloc(0, 2000)
    fake.mem = (123, 456)
    assert fake.mem_info(0) == (123, 456)
    assert fake.probe()[0][0].warp_size == 32
    assert FakeDriver(devices=0).probe() == ([], "no CUDA device")
    h = fake.alloc_host(1000)
    assert h.dtype == np.uint8 and h.size == 1000 and h.ctypes.data % 256 == 0


def test_copies_check_their_arguments():
    fake = FakeDriver()
    s = fake.stream(0)
    a = fake.alloc(0, 64)
    with pytest.raises(FakeMemoryError):
        fake.copy_h2d(s, a.ptr + 8, np.zeros(64, np.uint8))
    with pytest.raises(FakeMemoryError, match="contiguous"):
        fake.copy_h2d(s, a.ptr, np.zeros((8, 8), np.uint8)[:, ::2])
    with pytest.raises(FakeMemoryError, match="overlap"):
        fake.copy_d2d(s, a.ptr + 8, a.ptr, 16)
    fake.copy_h2d(s, a.ptr, np.arange(16, dtype=np.float32))
    fake.copy_d2d(s, a.ptr + 32, a.ptr, 32)
    fake.memset(s, a.ptr, 0, 4)
    out = np.empty(16, np.float32)
    fake.copy_d2h(s, out, a.ptr)
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7]


# --- streams and events --------------------------------------------------------------------------
def test_deferred_d2h_is_stale_until_synchronize():
    fake = FakeDriver(deferred=True)
    s = fake.stream(0)
    a = fake.alloc(0, 16)
    fake.copy_h2d(s, a.ptr, np.arange(4, dtype=np.float32))
    out = np.zeros(4, np.float32)
    fake.copy_d2h(s, out, a.ptr)
    assert out.tolist() == [0, 0, 0, 0]  # read before synchronize: stale
    fake.synchronize(s)
    assert out.tolist() == [0, 1, 2, 3]


def test_h2d_reads_the_source_when_it_runs():
    fake = FakeDriver(deferred=True)
    s = fake.stream(0)
    a = fake.alloc(0, 4)
    staging = fake.alloc_host(4)
    staging[:] = 1
    fake.copy_h2d(s, a.ptr, staging)
    staging[:] = 2  # reused before the copy ran
    fake.synchronize(s)
    assert fake.resolve(a.ptr, 4)[0].tolist() == [2, 2, 2, 2]


def test_eager_runs_at_once():
    fake = FakeDriver()
    s = fake.stream(0)
    a = fake.alloc(0, 4)
    fake.memset(s, a.ptr, 7, 4)
    assert a.owner.tolist() == [7] * 4 and fake.trace == ["memset 4B"]


def test_events_order_two_streams():
    fake = FakeDriver(deferred=True)
    s1, s2 = fake.stream(0), fake.stream(0)
    a, b = fake.alloc(0, 4), fake.alloc(0, 4)
    e = fake.event(0)
    fake.memset(s1, a.ptr, 5, 4)
    fake.record(e, s1)
    fake.memset(s1, a.ptr, 9, 4)  # after the marker: not part of what s2 waits for
    fake.wait_event(s2, e)
    fake.copy_d2d(s2, b.ptr, a.ptr, 4)
    assert b.owner.tolist() == [0xFF] * 4
    fake.synchronize(s2)
    assert b.owner.tolist() == [5] * 4 and a.owner.tolist() == [5] * 4
    assert fake.trace == ["memset 4B", "record on stream1", "wait stream1@2", "d2d 4B"]
    assert len(s1.queue) == 1
    fake.synchronize(s1)
    assert a.owner.tolist() == [9] * 4


def test_event_synchronize_runs_up_to_the_marker():
    fake = FakeDriver(deferred=True)
    s = fake.stream(0)
    a = fake.alloc(0, 4)
    e = fake.event(0)
    fake.event_synchronize(e)  # never recorded: complete
    fake.memset(s, a.ptr, 1, 4)
    fake.record(e, s)
    fake.memset(s, a.ptr, 2, 4)
    fake.event_synchronize(e)
    assert a.owner.tolist() == [1] * 4 and len(s.queue) == 1


def test_wait_uses_the_record_at_call_time():
    fake = FakeDriver(deferred=True)
    s1, s2 = fake.stream(0), fake.stream(0)
    a = fake.alloc(0, 4)
    e = fake.event(0)
    fake.memset(s1, a.ptr, 1, 4)
    fake.record(e, s1)
    fake.wait_event(s2, e)
    fake.memset(s1, a.ptr, 2, 4)
    fake.record(e, s1)  # re-recorded after the wait: s2 still waits for the first marker
    fake.synchronize(s2)
    assert a.owner.tolist() == [1] * 4 and len(s1.queue) == 2


# --- capture -------------------------------------------------------------------------------------
def test_capture_refuses_host_copies_sync_and_outside_waits():
    fake = FakeDriver(deferred=True)
    s, other = fake.stream(0), fake.stream(0)
    a = fake.alloc(0, 4)
    e = fake.event(0)
    fake.record(e, other)
    fake.capture_begin(s)
    with pytest.raises(FakeCaptureError):
        fake.copy_h2d(s, a.ptr, np.zeros(4, np.uint8))
    with pytest.raises(FakeCaptureError):
        fake.copy_d2h(s, np.zeros(4, np.uint8), a.ptr)
    with pytest.raises(FakeCaptureError):
        fake.synchronize(s)
    with pytest.raises(FakeCaptureError):
        fake.wait_event(s, e)
    with pytest.raises(FakeCaptureError):
        fake.capture_begin(s)
    inner = fake.event(0)
    fake.record(inner, s)
    fake.wait_event(s, inner)  # same capture, same stream: fine
    with pytest.raises(FakeCaptureError):
        fake.event_synchronize(inner)
    fake.memset(s, a.ptr, 3, 4)
    g = fake.capture_end(s)
    assert isinstance(g, FakeGraph) and fake.captures == 1
    assert a.owner.tolist() == [0xFF] * 4 and not s.queue  # captured, not run
    with pytest.raises(FakeCaptureError):
        fake.capture_end(s)
    fake.graph_launch(g, s)
    fake.synchronize(s)
    assert a.owner.tolist() == [3] * 4 and fake.graph_launches == 1


def test_capture_needs_kernels_loaded_first():
    fake = FakeDriver(names=NAMES)
    s = fake.stream(0)
    ctx = Context()
    a = ctx.tensor(GType.F32, (4,))
    node = ctx.scale(a, 2.0)
    place(fake, a, node)
    fake.capture_begin(s)
    with pytest.raises(FakeCaptureError, match="not loaded"):
        fake.run(s, node, [launch(np.uint64(addr(a)))])
    fake.capture_end(s)
    fake.load([K])
    assert fake.loaded == [K]
    fake.capture_begin(s)
    fake.run(s, node, [launch(np.uint64(addr(a)))])
    fake.capture_end(s)
    with pytest.raises(FakeLaunchError, match="not declared"):
        fake.load([Kernel("test.cu", "k_other<float>")])


def test_graph_relaunch_reruns_nodes_at_baked_addresses():
    fake = FakeDriver(names=NAMES, deferred=True)
    s = fake.stream(0)
    ctx = Context()
    a, b = ctx.tensor(GType.F32, (4, 2)), ctx.tensor(GType.F32, (4, 2))
    node = ctx.add(a, b)
    place(fake, a, b, node)
    fake.load([K])
    upload(fake, s, a, np.ones((2, 4)))
    upload(fake, s, b, np.full((2, 4), 2.0))
    fake.capture_begin(s)
    fake.run(s, node, [launch(np.uint64(addr(a)), np.uint64(addr(b)), np.uint64(addr(node)), np.int32(8))])
    g = fake.capture_end(s)
    assert fake.nodes_computed == 0 and len(fake.launched) == 1
    for i in range(3):
        upload(fake, s, a, np.full((2, 4), float(i)))
        fake.graph_launch(g, s)
        assert (download(fake, s, node) == i + 2.0).all()
    assert fake.nodes_computed == 3 and fake.graph_launches == 3 and len(fake.launched) == 1
    # the graph keeps the addresses it was captured with, whatever the tensor says now
    old = node.buffer
    place(fake, node)
    upload(fake, s, a, np.full((2, 4), 5.0))
    fake.graph_launch(g, s)
    fake.synchronize(s)
    assert (fake.resolve(addr(node), node.nbytes)[0] == 0xFF).all()
    assert (old.alloc.owner.view(np.float32) == 7.0).all()
    fake.free(old.alloc)  # and running it on freed memory is caught
    fake.graph_launch(g, s)
    with pytest.raises(FakeMemoryError, match="freed"):
        fake.synchronize(s)


# --- run() -------------------------------------------------------------------------------------
def test_run_add_with_broadcast():
    fake = FakeDriver(names=NAMES)
    s = fake.stream(0)
    ctx = Context()
    a, b = ctx.tensor(GType.F32, (5, 3)), ctx.tensor(GType.F32, (5, 1))
    node = ctx.add(a, b)
    place(fake, a, b, node)
    x, y = np.random.default_rng(0).standard_normal((2, 3, 5)).astype(np.float32)
    upload(fake, s, a, x)
    upload(fake, s, b, y[:1])
    fake.run(s, node, [])
    np.testing.assert_allclose(download(fake, s, node), x + y[:1], rtol=1e-6)
    assert fake.launched == [("ADD", ())]


def test_run_mul_mat():
    fake = FakeDriver(names=NAMES)
    s = fake.stream(0)
    ctx = Context()
    a, b = ctx.tensor(GType.F32, (8, 6)), ctx.tensor(GType.F32, (8, 3))  # [K, M], [K, N]
    node = ctx.mul_mat(a, b)
    place(fake, a, b, node)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)
    upload(fake, s, a, x)
    upload(fake, s, b, y)
    gemm = GemmLaunch(addr(a), addr(b), addr(node), m=6, n=3, k=8, lda=8, ldb=8, ldc=6)
    fake.run(s, node, [gemm])
    np.testing.assert_allclose(download(fake, s, node), y @ x.T, rtol=1e-5)
    with pytest.raises(FakeMemoryError, match="GEMM C"):
        fake.run(s, node, [GemmLaunch(addr(a), addr(b), addr(node) + 4, m=6, n=3, k=8, lda=8, ldb=8, ldc=6)])
    with pytest.raises(FakeMemoryError, match="GEMM B"):
        fake.run(s, node, [GemmLaunch(addr(a), addr(b), addr(node), m=6, n=4, k=8, lda=8, ldb=8, ldc=6)])
    with pytest.raises(FakeLaunchError, match="bad GEMM"):
        fake.run(s, node, [GemmLaunch(addr(a), addr(b), addr(node), m=6, n=3, k=8, lda=4, ldb=8, ldc=6)])


def test_run_into_views_shares_the_root():
    """A CPY into a view of a larger tensor writes at the view's offset of the root's memory, and a
    node reading a transposed view reads the root's bytes with the view's strides."""
    fake = FakeDriver(names=NAMES)
    s = fake.stream(0)
    ctx = Context()
    src, big = ctx.tensor(GType.F32, (4, 2)), ctx.tensor(GType.F32, (4, 5))
    dst = ctx.view(big, (4, 2), (big.nb[1],), offset=2 * big.nb[1])
    node = ctx.cpy(src, dst)
    place(fake, src, big)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    upload(fake, s, src, x)
    fake.memset(s, addr(big), 0, big.nbytes)
    fake.run(s, node, [])
    got = download(fake, s, big)
    assert (got[2:4] == x).all() and (got[:2] == 0).all() and (got[4:] == 0).all()
    t = ctx.transpose(big)
    c = ctx.cont(t)
    place(fake, c)
    fake.run(s, c, [])
    assert (download(fake, s, c) == got.T).all()


def test_run_checks_launches():
    fake = FakeDriver(names=NAMES)
    s = fake.stream(0)
    ctx = Context()
    a = ctx.tensor(GType.F32, (4,))
    node = ctx.scale(a, 2.0)
    place(fake, a, node)
    p = np.uint64(addr(a))
    fake.run(s, node, [launch(p, np.uint64(0), np.int64(4), np.float32(2.0))])  # 0: a null pointer
    bad = [
        (FakeLaunchError, "not declared", KernelLaunch(Kernel("test.cu", "k_nope<float>"), (1, 1, 1), (32, 1, 1), ())),
        (FakeLaunchError, "numpy scalar", launch(p, 4)),
        (FakeLaunchError, "numpy scalar", launch(int(p))),
        (FakeMemoryError, "argument 1", launch(p, np.uint64(addr(a) + 100))),
        (FakeLaunchError, "grid", launch(p, grid=(1, 65536, 1))),
        (FakeLaunchError, "grid", launch(p, block=(64, 32, 1))),
        (FakeLaunchError, "grid", launch(p, shared=1 << 20)),
    ]
    for err, msg, bad_launch in bad:
        with pytest.raises(err, match=msg):
            fake.run(s, node, [bad_launch])
    assert len(fake.launched) == 1 and fake.nodes_computed == 1


def test_run_needs_device_storage():
    fake = FakeDriver(names=NAMES)
    s = fake.stream(0)
    ctx = Context()
    a = ctx.tensor(GType.F32, (4,))
    node = ctx.scale(a, 2.0)
    place(fake, node)
    with pytest.raises(FakeMemoryError, match="no device storage"):
        fake.run(s, node, [])
    a.buffer = DevBuf(fake.alloc(0, 8))  # too small for the tensor
    with pytest.raises(FakeMemoryError, match="outside"):
        fake.run(s, node, [])


def test_default_names_are_the_registry():
    from ggx_cuda.kernels import NAME_EXPRESSIONS

    assert FakeDriver()._declared() is NAME_EXPRESSIONS
