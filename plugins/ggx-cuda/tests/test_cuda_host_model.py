"""A whole model on ggx-cuda's real kernels without a GPU: the backend over HostKernelDriver (the
driver double running each launch by its kernels/*.cu source compiled for the host) against the
reference, node by node with ggx.compare. A tiny synthetic llama keeps it to seconds (its random
weights make accumulated figures meaningless: the isolated ones are the check); the default
model's 2-layer cut takes about three minutes this way, too long for CI (the report's command)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from host_driver import HostKernelDriver

from ggx import registry
from ggx.compare import compare_model
from ggx_cuda.device import CudaBackendReg

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "models"))
from gguf_synth import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def emu(host_cc):
    reg = CudaBackendReg(driver=HostKernelDriver(deferred=True), prefix="EMUCUDA")
    reg.name = "cuda-host-kernels"
    registry.register(reg, name="cuda-host-kernels")
    yield registry.get_device("EMUCUDA0")
    registry.unregister("cuda-host-kernels")


def test_a_llama_on_the_host_built_kernels_agrees_node_by_node(emu, tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    r = compare_model(path, "ref", emu, prompt=[5, 9, 33, 2, 7], n_decode=3)
    assert r.first_isolated is None, "\n".join(r.summary())
    on_device = {n.op for n in r.nodes if n.note == "EMUCUDA0"}
    assert {"MUL_MAT", "FLASH_ATTN_EXT", "ROPE", "RMS_NORM", "SET_ROWS", "SWIGLU", "ADD", "MUL"} <= on_device
    assert all(n.isolated is not None for n in r.nodes), {n.note for n in r.nodes if n.isolated is None}



def test_cuda_graphs_of_host_kernels_replay_bit_identically(emu, tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    launches = emu.reg.driver.graph_launches
    r = compare_model(path, emu, emu, prompt=[5, 9, 33], n_decode=4, graphs=True)
    assert r.graphs.identical, r.graphs
    assert emu.reg.driver.graph_launches > launches  # decode replayed a captured graph of host kernels
