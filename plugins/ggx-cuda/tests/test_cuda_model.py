"""Model mode on the driver double (tests/fake_driver.py): the default model's 2-layer cut through
a CUDA device against the reference, node by node, as CI runs it (ggx.conformance.model). The
double computes each node with the reference's op, so this checks the backend's plumbing on the
model's own graphs (plans, views and strides, the scheduler's copies between the host and the
device, CUDA-graph warm-up and replay, pool growth), not kernel arithmetic; the host-shim tests
check that, and the GPU check runs `ggx compare` on hardware."""
from __future__ import annotations

import pytest
from fake_driver import FakeDriver

from ggx import registry
from ggx.compare import compare_model
from ggx.conformance.model import model_check
from ggx.conformance.runner import PASS
from ggx_cuda.device import CudaBackendReg


@pytest.fixture(scope="module")
def fake():
    return FakeDriver(deferred=True)


@pytest.fixture(scope="module")
def device(fake):
    reg = CudaBackendReg(driver=fake, prefix="MODELCUDA")
    reg.name = "cuda-model"
    registry.register(reg, name="cuda-model")
    yield registry.get_device("MODELCUDA0")
    registry.unregister("cuda-model")


def test_model_mode_on_the_driver_double(device, fake):
    result, report = model_check(device)
    assert result.status == PASS, result.message
    assert {n.step for n in report.nodes} == {0, 1}
    on_device = [n for n in report.nodes if n.note == "MODELCUDA0"]
    assert len(on_device) > len(report.nodes) // 2  # the host runs the embedding rows only
    assert {"MUL_MAT", "FLASH_ATTN_EXT", "ROPE", "SET_ROWS"} <= {n.op for n in on_device}
    assert report.weights["b"].startswith("MODELCUDA0"), report.weights
    assert fake.launched  # the kernels were planned and launched on the double


def test_graphs_on_and_off_are_bit_identical_on_the_driver_double(device, fake):
    captures, launches = fake.captures, fake.graph_launches
    r = compare_model(None, device, device, prompt=[1, 2, 3], n_decode=4, layers=2, graphs=True)
    assert r.graphs is not None and r.graphs.identical and r.graphs.steps == 5, r.graphs
    assert r.nodes == []  # one backend: only the graphs check runs
    assert fake.captures == captures + 1 and fake.graph_launches > launches  # the "on" side replayed decode
