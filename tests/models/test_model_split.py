"""A model split over several devices by layers (llama.cpp's split mode LAYER): where each
layer's weights and KV cache go, that the scheduler then runs the layers where they are, that
results equal a one-device run with the same kernels, the bytes moved between devices, and
`ggx run --tensor-split`."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ggx.cli import main
from ggx.errors import GGXStateError, GGXValueError
from ggx.models import load_model
from ggx.models import model as model_module
from ggx.models.weights import load_weights, tensor_layer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/sched_device.py, shared with sched tests
from sched_device import TestDevice  # noqa: E402
from weight_bufts import host_extra_bufts  # noqa: E402

PROMPT = [5, 70, 71, 72, 3, 200, 33]


def placed(m) -> dict[str, str]:
    return {name: t.data_buffer.buft.name for name, t in m.weights.items()}


def layer_bufts(m, il: int) -> set[str]:
    return {b for name, b in placed(m).items() if tensor_layer(name) == il}


def greedy(m, prompt, n: int) -> list[int]:
    return [t.id for t in m.generate(prompt, n, stop_at_eos=False)]


def test_the_default_devices_keep_one_device_and_its_placement(tiny_llama):
    m = load_model(tiny_llama, n_ctx=256)  # no accelerator here: the host device alone
    host = m.runner.host
    assert m.runner.split_devices == [host] and m.layer_split.layers == (host,) * m.hp.n_layer
    assert str(m.layer_split) == f"{host.name} layers 0-1 + output"
    # every weight where the one buffer-type list of all the devices puts it (the placement before splits)
    one_list = load_weights(m.file, m.hp, m.arch.expected_tensors(m.hp), m.runner.weight_bufts, host.buffer_type())
    assert placed(m) == {name: t.data_buffer.buft.name for name, t in one_list.tensors.items()}
    # the same uses of the same buffer types; the basis (the profile, or why none) is load_model's
    assert m.placement.bufts == one_list.placement.bufts
    assert m.placement.basis.startswith("priority order")
    assert [b.buft for b in m.cache.buffers] == [host.buffer_type()] and m.cache.buffer is m.cache.buffers[0]


@pytest.mark.parametrize("shares, alone", [([1, 0], "ref"), ([0, 1], "CPU")])
def test_all_layers_on_one_listed_device_equal_that_device_alone(tiny_llama, shares, alone):
    split = load_model(tiny_llama, devices=["ref", "CPU"], n_ctx=256, tensor_split=shares)
    assert str(split.layer_split) == f"{alone} layers 0-1 + output"
    single = load_model(tiny_llama, devices=[alone], n_ctx=256)
    np.testing.assert_array_equal(split.forward(PROMPT), single.forward(PROMPT))
    assert [b.buft.name for b in split.cache.buffers] == [alone]
    assert placed(split)["token_embd.weight"] == "CPU"  # the host device's memory (llama.cpp: tok_embd on the CPU)


def test_a_split_over_a_device_with_its_own_memory_moves_activations(tiny_llama):
    dev = TestDevice("split-test")  # not host memory; reference kernels, so results equal ref's
    m = load_model(tiny_llama, devices=[dev, "ref"], n_ctx=256, tensor_split=[1, 1])
    assert m.wait_prepared(120)  # the scheduler's statistics below are the test's graphs only
    ref = m.runner.host
    assert ref.name == "ref" and str(m.layer_split) == "split-test layer 0, ref layer 1 + output"
    assert layer_bufts(m, 0) == {"split-test_mem"} and layer_bufts(m, 1) == {"ref"}
    assert placed(m)["output_norm.weight"] == "ref" and placed(m)["token_embd.weight"] == "ref"
    assert [b.buft.name for b in m.cache.buffers] == ["split-test_mem", "ref"]
    assert m.cache.k[0].buffer is m.cache.v[0].buffer is m.cache.buffers[0]
    assert m.cache.k[1].buffer is m.cache.buffers[1]
    with pytest.raises(GGXStateError, match="use .buffers"):
        _ = m.cache.buffer

    alone = load_model(tiny_llama, devices=["ref"], n_ctx=256)
    np.testing.assert_allclose(m.forward(PROMPT), alone.forward(PROMPT), rtol=1e-5, atol=1e-5)
    assert greedy(m, PROMPT, 4) == greedy(alone, PROMPT, 4)
    assert {s.backend.device.name for s in m.runner.sched.splits} == {"split-test", "ref"}
    st = m.stats
    assert all(n > 1 for n in st.splits)
    # at each boundary at least the F32 activations of the batch cross: n_embd floats per token
    assert st.prompt_bytes_copied >= 4 * m.hp.n_embd * len(PROMPT)
    assert st.gen_tokens == 3 and st.bytes_copied_per_decode_step >= 4 * m.hp.n_embd
    total = m.runner.bytes_copied
    m.eval([3])
    assert m.runner.bytes_copied - total == m.runner.sched.stats.bytes_copied > 0  # summed per graph


def test_bad_tensor_split_is_refused_before_the_weights_load(tiny_llama, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(model_module, "load_weights", no_loading)
    with pytest.raises(GGXValueError, match="3 shares for 2 split devices"):
        load_model(tiny_llama, devices=["ref", "CPU"], tensor_split=[1, 1, 1])
    with pytest.raises(GGXValueError, match="all zero"):
        load_model(tiny_llama, devices=["ref", "CPU"], tensor_split=[0, 0])
    with pytest.raises(GGXValueError, match="non-negative"):
        load_model(tiny_llama, devices=["ref"], tensor_split=[-1])


def _summary(err: str) -> dict[str, str]:
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in err.splitlines() if ":" in ln)}


def test_run_prints_the_split_and_the_bytes_moved(tiny_llama, capsys):
    assert main(["run", str(tiny_llama), "--device", "ref", "--device", "CPU", "-ts", "1,1", "-p", "a", "-n", "3"]) == 0
    s = _summary(capsys.readouterr().err)
    assert s["layer split"] == "ref layer 0, CPU layer 1 + output"
    # both read host memory: the scheduler copies nothing between them
    assert s["moved between devices"] == "0 B per decode step, 0 B prefill"
    assert main(["run", str(tiny_llama), "--device", "ref", "--device", "CPU", "-ts", "1,0", "-p", "a", "-n", "2"]) == 0
    s = _summary(capsys.readouterr().err)
    assert "layer split" not in s  # one device holds the layers
    assert main(["run", str(tiny_llama), "--device", "ref", "-p", "a", "-n", "2"]) == 0
    s = _summary(capsys.readouterr().err)
    assert "layer split" not in s and "moved between devices" not in s


@pytest.mark.parametrize("cmd", ["run", "bench"])
def test_bad_tensor_split_arguments(tiny_llama, capsys, cmd):
    for bad in ("0,0", "1,x", "-1,2", "1,,2", "nan"):
        assert main([cmd, str(tiny_llama), "--device", "ref", "--tensor-split", bad]) == 2
        out, err = capsys.readouterr()
        assert out == "" and "--tensor-split" in err
    assert main([cmd, str(tiny_llama), "--device", "ref", "--device", "CPU", "-ts", "1,1,1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "3 shares for 2 split devices" in err


def test_the_default_model_split_over_ref_and_cpu(smollm2_path):
    """SmolLM2 (30 layers) with layers 0-2 on ref, 3-29 and the output on CPU: each layer's
    weights and cache on its device, several splits a token, and the CPU run's greedy tokens."""
    prompt = "The capital of France is"
    cpu = load_model(smollm2_path, devices=["CPU"], n_ctx=256)
    ids = cpu.tokenize(prompt)
    want_logits, want = cpu.forward(ids), greedy(cpu, ids, 3)

    m = load_model(smollm2_path, devices=["ref", "CPU"], n_ctx=256, tensor_split=[1, 9])
    cpu_types = {"CPU", *host_extra_bufts()}  # plain memory or any extra buffer type of the CPU here
    assert str(m.layer_split) == "ref layers 0-2, CPU layers 3-29 + output"
    for il in range(m.hp.n_layer):
        if il < 3:
            assert layer_bufts(m, il) == {"ref"}, il
        else:
            assert layer_bufts(m, il) and layer_bufts(m, il) <= cpu_types, il
        assert m.cache.k[il].buffer.buft.name == m.cache.v[il].buffer.buft.name == ("ref" if il < 3 else "CPU")
    assert placed(m)["output.weight"] in cpu_types and placed(m)["output_norm.weight"] == "CPU"
    assert placed(m)["token_embd.weight"] == "CPU"
    assert [b.buft.name for b in m.cache.buffers] == ["ref", "CPU"]
    used = {u.name: u.n_tensors for u in m.placement.used}  # the report counts each device's part
    assert used["ref"] == sum(1 for name in m.weights if tensor_layer(name) is not None and tensor_layer(name) < 3)

    got_logits = m.forward(ids)
    nmse = float(((got_logits - want_logits) ** 2).sum() / (want_logits**2).sum())
    assert nmse < 1e-2, nmse  # ref computes in float64, the CPU quantizes activations as ggml does
    assert greedy(m, ids, 3) == want
    assert all(n > 1 for n in m.stats.splits)
    names = [s.backend.device.name for s in m.runner.sched.splits]
    assert "ref" in names and "CPU" in names
