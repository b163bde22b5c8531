"""The default model split across CPU and RAY0 (ggml's layer split) gives a local run's tokens."""
from __future__ import annotations

import numpy as np
import pytest

from ggx import registry
from ggx.models import load_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def plain_cpu():
    """Both sides compute from plain CPU memory (the worker's memory is its device's plain
    buffer type): without the plugins that add the CPU's extra buffer types (repack, and amx on a
    CPU with AMX) the driver's CPU kernels are the worker's, so the results are bit-equal, not
    only close."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GGX_DISABLE_PLUGINS", "repack,amx")
    registry.load_plugins(force=True)
    assert not registry.extra_buffer_types(registry.get_device("CPU"))  # a plugin adding one: name it above
    yield
    mp.undo()
    registry.load_plugins(force=True)


@pytest.fixture(scope="module")
def local(plain_cpu):
    return load_model(devices=["CPU"])


def _greedy(model, n: int = 12) -> list[int]:
    return [t.id for t in model.generate(PROMPT, max_tokens=n)]


def test_layers_split_across_ray0_and_cpu_give_the_local_tokens(ray_device, local):
    want = _greedy(local)
    by_memory = load_model(devices=["RAY0", "CPU"])  # shares from free memory: both take layers, in order
    parts = [p for p in by_memory.layer_split.parts if p.n_layers]
    assert [p.device.name for p in parts] == ["RAY0", "CPU"] and parts[0].start == 0 and parts[1].stop == 30
    del by_memory
    split = load_model(devices=["RAY0", "CPU"], tensor_split=[1, 1])
    assert str(split.layer_split) == "RAY0 layers 0-14, CPU layers 15-29 + output"
    assert _greedy(split) == want
    assert split.runner.last_splits >= 3  # CPU (embedding) -> RAY0 -> CPU
    assert split.stats.bytes_copied_per_decode_step > 0
    ids = split.tokenize(PROMPT)
    assert np.array_equal(split.forward(ids), local.forward(ids))


def test_tensor_split_moves_the_boundary(ray_device, local):
    split = load_model(devices=["CPU", "RAY0"], tensor_split=[2, 1])
    assert str(split.layer_split) == "CPU layers 0-19, RAY0 layers 20-29 + output"
    assert _greedy(split) == _greedy(local)


def test_ray0_alone_gives_the_local_tokens(ray_device, local):
    remote = load_model(devices=["RAY0"])
    assert {u.device for u in remote.placement.used} >= {"RAY0"}
    assert _greedy(remote) == _greedy(local)
