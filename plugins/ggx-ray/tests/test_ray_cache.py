"""The content-hash cache (ggml-rpc's -c): weight bytes a node already has are not sent again."""
from __future__ import annotations

import gc

import numpy as np

from ggx.alloc import alloc_tensors
from ggx.backend import BufferUsage
from ggx.graph import Context
from ggx.models import load_model


def _weights_of(device, n_bytes: int, seed: int):
    t = Context().tensor("F32", (n_bytes // 4,), "w")
    alloc_tensors(device.buffer_type(), [t], BufferUsage.WEIGHTS)
    return t, np.random.default_rng(seed).integers(0, 256, n_bytes, dtype=np.uint8)


def test_new_bytes_are_sent_once_then_found_by_hash(ray_device):
    stats = ray_device.link.stats
    t, data = _weights_of(ray_device, 1 << 20, seed=1234)
    before = stats.weight_bytes_sent
    t.data_buffer.set_tensor(t, data)
    assert stats.weight_bytes_sent - before == data.size  # never seen: sent
    t2, _ = _weights_of(ray_device, 1 << 20, seed=0)
    before = stats.weight_bytes_sent
    t2.data_buffer.set_tensor(t2, data)
    assert stats.weight_bytes_sent == before  # same bytes, another buffer: from the cache
    assert np.array_equal(t2.data_buffer.get_tensor(t2), data)


def test_small_weights_and_activations_bypass_the_cache(ray_device):
    stats = ray_device.link.stats
    t = Context().tensor("F32", (16,), "small")
    alloc_tensors(ray_device.buffer_type(), [t], BufferUsage.COMPUTE)
    before = stats.weight_bytes_sent
    t.data_buffer.set_tensor(t, np.arange(16, dtype=np.float32).view(np.uint8))
    assert stats.weight_bytes_sent == before
    assert np.array_equal(t.data_buffer.get_tensor(t).view(np.float32), np.arange(16, dtype=np.float32))


def test_a_second_load_of_the_model_sends_no_weight_bytes(ray_device):
    stats = ray_device.link.stats
    model = load_model(devices=["RAY0"])
    remote = sum(u.nbytes for u in model.placement.used if u.device == "RAY0")
    assert remote > 50 << 20
    del model
    gc.collect()
    before = stats.weight_bytes_sent
    model = load_model(devices=["RAY0"])
    assert stats.weight_bytes_sent == before
    assert model.generate("Hello", max_tokens=2)  # the weights are really there
    assert len(list(model.generate("Hello", max_tokens=2))) == 2
