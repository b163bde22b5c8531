"""The backend end to end on the driver double (tests/fake_driver.py): the conformance suite, the
scheduler with a host device, async copies, events and CUDA-graph warm-up, without a GPU. The
double computes each node with the reference backend's op over fake device memory and checks
every launch's pointers against live allocations; what it cannot show (kernel arithmetic) the
kernel families' tests and the GPU check cover."""
from __future__ import annotations

import numpy as np
import pytest
from fake_driver import FakeDriver

from ggx import registry
from ggx.conformance import Suite
from ggx.eager import compute
from ggx.errors import GGXOutOfMemory
from ggx.graph import Context
from ggx.tensor import TensorFlag
from ggx_cuda.device import CudaBackend, CudaBackendReg, CudaDevice


@pytest.fixture(scope="module")
def fake():
    return FakeDriver(deferred=True)


@pytest.fixture(scope="module")
def device(fake):
    reg = CudaBackendReg(driver=fake, prefix="FAKECUDA")
    reg.name = "cuda-fake"
    registry.register(reg, name="cuda-fake")
    yield registry.get_device("FAKECUDA0")
    registry.unregister("cuda-fake")


def test_the_device_describes_itself(device: CudaDevice):
    assert device.description and device.info.cc == (8, 9)
    free, total = device.memory()
    assert 0 < free <= total
    assert device.host_buffer_type().is_host and device.host_buffer_type().name == "CUDA_Host"
    assert not device.buffer_type().is_host


def test_the_conformance_suite_passes_on_the_double(device: CudaDevice, fake: FakeDriver):
    suite = Suite(device)
    report = suite.run(suite.items())
    failures = "\n".join(f"{r.id}: {r.message}" for r in report.failures)
    assert report.ok, failures
    assert fake.nodes_computed > 400
    # every node of every case ran through a planner whose launches the double checked
    assert fake.launched


def test_eager_compute_with_host_fallback(device: CudaDevice):
    c = Context()
    x = c.tensor("F32", (64, 4), "x")
    y = c.rms_norm(c.scale(x, 3.0), 1e-6)
    data = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    got = compute(y, {x: data}, device=device)[0]
    scaled = data * 3.0
    want = scaled / np.sqrt((scaled * scaled).mean(axis=1, keepdims=True) + 1e-6)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_graph_without_cublas_is_captured_after_two_calls_then_launched(device: CudaDevice, fake: FakeDriver):
    be = device.init_backend()
    assert isinstance(be, CudaBackend)
    c = Context()
    x = c.tensor("F32", (256,), "x")
    y = c.silu(c.scale(x, 0.5))
    from ggx.alloc import alloc_tensors
    from ggx.graph import build_graph

    g = build_graph(y)
    alloc_tensors(device.buffer_type(), [x, *[n for n in g.nodes if n.view_src is None]])
    x.data_buffer.set_tensor(x, np.arange(256, dtype=np.float32).view(np.uint8))
    captures = fake.captures
    actions = []
    for _ in range(4):
        be.graph_compute(g)
        be.synchronize()
        actions.append(be.graphs.last(id(g)).action)
    assert actions == ["eager", "capture", "launch", "launch"]
    assert fake.captures == captures + 1
    v = np.arange(256, dtype=np.float32) * 0.5
    assert np.allclose(y.data_buffer.get_tensor(y).view(np.float32), v / (1 + np.exp(-v)), rtol=1e-6)


def test_a_batch_of_tokens_stays_eager_and_says_why(device: CudaDevice):
    """ggml-cuda captures single-token steps only: an ADD over more than one row of its second
    source keeps the graph eager, however often it comes back unchanged."""
    from ggx.alloc import alloc_tensors
    from ggx.graph import build_graph

    be = device.init_backend()
    for rows, expected in ((1, ["eager", "capture", "launch"]), (4, ["eager", "eager", "eager"])):
        c = Context()
        a, b = c.tensor("F32", (64, rows), "a"), c.tensor("F32", (64, rows), "b")
        y = c.add(a, b)
        g = build_graph(y)
        alloc_tensors(device.buffer_type(), [a, b, y])
        for t in (a, b):
            t.data_buffer.set_tensor(t, np.ones(t.nelements, dtype=np.float32).view(np.uint8))
        got = []
        for _ in range(3):
            be.graph_compute(g)
            be.synchronize()
            got.append(be.graphs.last(id(g)).action)
        assert got == expected
        assert np.allclose(y.data_buffer.get_tensor(y).view(np.float32), 2.0)
    assert "ADD over a batch of 4" in be.graphs.last(id(g)).reason


def test_a_graph_using_cublas_stays_eager_and_says_why(device: CudaDevice):
    be = device.init_backend()
    c = Context()
    a, b = c.tensor("F32", (32, 8), "a"), c.tensor("F32", (32, 2), "b")
    y = c.mul_mat(a, b)
    from ggx.alloc import alloc_tensors
    from ggx.graph import build_graph

    g = build_graph(y)
    alloc_tensors(device.buffer_type(), [a, b, y])
    for t in (a, b):
        t.data_buffer.set_tensor(t, np.ones(t.nelements, dtype=np.float32).view(np.uint8))
    for _ in range(3):
        be.graph_compute(g)
        be.synchronize()
    last = be.graphs.last(id(g))
    assert last.action == "eager" and "cuBLAS" in last.reason
    assert np.allclose(y.data_buffer.get_tensor(y).view(np.float32), 32.0)


def test_out_of_memory_names_the_sizes(device: CudaDevice, fake: FakeDriver):
    saved, fake.oom_above = fake.oom_above, 1 << 20
    try:
        with pytest.raises(GGXOutOfMemory, match="bytes"):
            device.buffer_type().alloc_buffer(2 << 20)
    finally:
        fake.oom_above = saved


def test_without_a_gpu_the_real_plugin_registers_no_device_and_says_why():
    reg = CudaBackendReg()
    assert reg.devices() == [] or all(d.name.startswith("CUDA") for d in reg.devices())
    if not reg.devices():
        assert reg.note  # "no CUDA device", "CuPy is not usable: ...", ...


def test_the_default_model_on_the_device_and_the_cpu_matches_the_reference(device: CudaDevice, fake: FakeDriver):
    """The scheduler with FAKECUDA0 and the CPU on the model graph: weights uploaded, the layers on
    the device, the embedding on the host, splits and copies between them; the double computes
    like the reference backend, so the logits equal a reference-only run's."""
    from ggx.models import load_model

    prompt = [1, 504, 3575, 282, 4649]
    on_device = load_model(devices=["FAKECUDA0"], n_ctx=64)  # the CPU appended as fallback
    assert str(on_device.layer_split) == "FAKECUDA0 layers 0-29 + output"
    got = on_device.forward(prompt)
    assert on_device.runner.last_splits >= 2
    want = load_model(devices=["ref"], n_ctx=64).forward(prompt)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_pipeline_copies_between_the_device_and_the_cpu(device: CudaDevice):
    """Scheduler(n_copies=2): split inputs alternate between two copy sets (ggml's pipeline
    parallelism); each graph's result is still its own."""
    from ggx.alloc import alloc_tensors
    from ggx.backend import BufferUsage
    from ggx.graph import build_graph
    from ggx.sched import Scheduler

    cpu = registry.get_device("CPU")
    rng = np.random.default_rng(1)
    c = Context()
    w1, w2 = c.tensor("F32", (32, 16), "w1"), c.tensor("F32", (16, 8), "w2")
    x = c.tensor("F32", (32, 3), "x").set_flag(TensorFlag.INPUT)
    y = c.mul_mat(w2, c.silu(c.mul_mat(w1, x)))  # w1 on the device, w2 on the CPU: splits, copies
    alloc_tensors(device.buffer_type(), [w1], BufferUsage.WEIGHTS)
    alloc_tensors(cpu.buffer_type(), [w2], BufferUsage.WEIGHTS)
    a1, a2 = rng.standard_normal((16, 32), dtype=np.float32), rng.standard_normal((8, 16), dtype=np.float32)
    w1.data_buffer.set_tensor(w1, a1.view(np.uint8).reshape(-1))
    w2.data_buffer.set_tensor(w2, a2.view(np.uint8).reshape(-1))
    sched = Scheduler([device.init_backend(), cpu.init_backend()], n_copies=2)
    g = build_graph(y)
    sched.alloc_graph(g)
    for _ in range(4):
        xs = rng.standard_normal((3, 32), dtype=np.float32)
        x.data_buffer.set_tensor(x, xs.view(np.uint8).reshape(-1))
        sched.graph_compute(g)
        h = xs @ a1.T
        want = (h / (1 + np.exp(-h))) @ a2.T
        got = y.data_buffer.get_tensor(y).view(np.float32).reshape(3, 8)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert sched.stats.n_splits >= 2 and sched.stats.n_inputs_copied >= 1


def test_moe_expert_upload_through_the_copy_callback(device: CudaDevice):
    """Experts kept in host memory (--cpu-moe), a batch large enough that ggml-cuda offloads the
    expert product (offload_op): only the experts the batch uses go up, by the copy callback."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "models"))
    import tempfile

    from gguf_synth import write_tiny_llama

    from ggx.models import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_llama(Path(tmp) / "tiny-moe.gguf", n_expert=4, n_expert_used=2, wtype="Q4_0", seed=1)
        prompt = [int(t) for t in np.random.default_rng(2).integers(3, 200, 40)]
        want = load_model(path, devices=["ref"]).forward(prompt)
        m = load_model(path, devices=["FAKECUDA0"], host_experts=True)
        got = m.forward(prompt)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert m.runner.sched.stats.n_callback_copies > 0 and m.runner.copy_callback.runs


def test_a_decode_step_is_captured_as_a_cuda_graph(device: CudaDevice, fake: FakeDriver):
    """No node of the default model's decode step blocks capture (its Q4_1 / Q8_0 products run as
    MMVQ, attention as the vec kernel, nothing through cuBLAS): after ggml's warm-up the step is
    captured once, then relaunched, on the driver double (which refuses what a capture cannot hold).
    The model's warm-up computes a decode step once (its graph prepared), so the capture comes with
    the generation's decode steps."""
    from ggx.models import load_model

    captures = fake.captures
    model = load_model(devices=["FAKECUDA0"], n_ctx=64)
    # the prompt, then 4 decode steps: with the warm-up's one, past ggml's warm-up, one capture, relaunches
    tokens = [t.id for t in model.generate([1, 504, 3575, 282, 4649], max_tokens=5, stop_at_eos=False)]
    assert len(tokens) == 5
    be = next(b for b in model.runner.backends if isinstance(b, CudaBackend))
    reasons = be.graphs.reasons()
    assert not any("cuBLAS" in r for r in reasons), reasons
    assert reasons.get("capture") == 1 and reasons.get("launch", 0) >= 1, reasons
    assert fake.captures == captures + 1


def test_kernel_bounds_go_through_the_device_hook(device: CudaDevice):
    """The integer products declare ggml's bound for quantized activations through
    Device.max_nmse_err; it is the core table's (no override, never looser), and float kernels
    declare nothing."""
    from ggx.conformance.case import tolerance
    from ggx.ops import Op
    from ggx.types import GType

    for op in (Op.MUL_MAT, Op.MUL_MAT_ID):
        for t in (GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0, GType.Q4_K, GType.Q5_K, GType.Q6_K):
            bound, reason = device.max_nmse_err(op, t, tolerance(op, t).max_nmse)
            assert bound == tolerance(op, t).max_nmse == 5e-4 and "q8_1" in reason
        assert device.max_nmse_err(op, GType.F16, 5e-4) is None
    assert device.max_nmse_err(Op.FLASH_ATTN_EXT, GType.F16, 5e-4) is None
