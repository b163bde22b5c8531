"""Faults: a killed worker, a call past its timeout, absurd requests; then reconnecting."""
from __future__ import annotations

import time

import numpy as np
import pytest

import ggx_ray
from ggx import registry
from ggx.eager import compute
from ggx.errors import GGXDeviceError, GGXOutOfMemory
from ggx.graph import Context, build_graph
from ggx.sched import Scheduler

N = 1536  # a matmul the worker takes a while over


def _matmul_graph():
    c = Context()
    a, b = c.tensor("F32", (N, N), "a"), c.tensor("F32", (N, N), "b")
    out = c.mul_mat(a, b)
    return c, a, b, out


def _cpu_sum_graph():
    c = Context()
    x = c.tensor("F32", (8,), "x")
    return x, c.scale(x, 2.0)


def test_an_absurd_request_is_refused_before_allocating(ray_device):
    with pytest.raises(GGXOutOfMemory, match="cannot allocate"):
        ray_device.buffer_type().alloc_buffer(1 << 55)
    with pytest.raises(GGXOutOfMemory):
        ray_device.link.call("alloc", ray_device.index, (1 << 62) - 1)
    assert ray_device.link.call("ping") == ray_device.link.session  # still serving


def test_a_call_past_its_timeout_names_the_device(ray_device):
    link = ray_device.link
    c, a, b, out = _matmul_graph()
    sched = Scheduler([ray_device.init_backend(), registry.get_device("CPU").init_backend()])
    sched.alloc_graph(build_graph(out))
    saved, link.timeout = link.timeout, 0.01
    try:
        with pytest.raises(GGXDeviceError, match="no answer within"):
            sched.graph_compute(build_graph(out))
    finally:
        link.timeout = saved
    sched.synchronize()  # the late answer is still collected; the stream goes on


def test_a_killed_worker_raises_naming_the_device_then_reconnects(ray_device):
    import ray

    cpu = registry.get_device("CPU")
    c, a, b, out = _matmul_graph()
    g = build_graph(out)
    sched = Scheduler([ray_device.init_backend(), cpu.init_backend()])
    sched.alloc_graph(g)
    old_session = ray_device.link.session
    sched.graph_compute_async(g)  # returns at once: the matmul runs in the worker
    ray.kill(ray_device.link.actor, no_restart=True)
    t0 = time.perf_counter()
    with pytest.raises(GGXDeviceError, match="died or is unreachable"):
        sched.synchronize()
    assert time.perf_counter() - t0 < 30
    with pytest.raises(GGXDeviceError, match="lost"):
        ray_device.memory()

    # the local device and a scheduler over it keep working
    x, y = _cpu_sum_graph()
    assert np.array_equal(compute(y, {x: np.arange(8, dtype=np.float32)}, device=cpu)[0],
                          2 * np.arange(8, dtype=np.float32))
    x2, y2 = _cpu_sum_graph()
    local = Scheduler([cpu.init_backend()])
    gy = build_graph(y2)
    local.alloc_graph(gy)
    local.graph_compute(gy)

    # reconnecting starts a new worker; RAY0 keeps its name and works again
    devices = ggx_ray.connect()
    assert devices[0] is ray_device and ray_device.link.session != old_session
    assert registry.get_device("RAY0") is ray_device
    x3, y3 = _cpu_sum_graph()
    got = compute(y3, {x3: np.ones(8, dtype=np.float32)}, device=ray_device)[0]
    assert np.array_equal(got, np.full(8, 2, dtype=np.float32))


def test_a_copy_between_two_workers_goes_actor_to_actor(ray_device):
    """Two workers (a second one started on this node under another name): a RAY tensor copied
    into another worker's tensor is read by one actor and written by the other, the bytes passing
    between them as an object reference (the driver never holds them)."""
    import ray

    from ggx.alloc import alloc_tensors
    from ggx_ray.cluster import NAMESPACE, Link, _actor_class
    from ggx_ray.device import RayDevice

    actor = _actor_class().options(name="ggx-worker-second-for-test", namespace=NAMESPACE, num_cpus=0).remote()
    try:
        link = Link(actor, "second test worker", "second-node", {"session": "?"}, 60.0)
        link.info = link.wait(actor.hello.remote())
        other = RayDevice("RAYX", link, 0, ray_device.reg)
        c = Context()
        src, dst = c.tensor("F32", (1000,), "src"), c.tensor("F32", (1000,), "dst")
        alloc_tensors(ray_device.buffer_type(), [src])
        alloc_tensors(other.buffer_type(), [dst])
        data = np.arange(1000, dtype=np.float32)
        src.data_buffer.set_tensor(src, data.view(np.uint8))
        received = ray_device.link.stats.bytes_received
        be = other.init_backend()
        assert be.cpy_tensor_async(ray_device.init_backend(), src, dst)
        be.synchronize()
        assert ray_device.link.stats.bytes_received == received  # nothing came back to the driver
        assert np.array_equal(dst.data_buffer.get_tensor(dst).view(np.float32), data)
    finally:
        ray.kill(actor)
