"""Weight placement of a model: each device's own buffer types, the placement report, and another
plugin's host-memory device (the `ggx new-plugin` scaffold) changing nothing in the default run."""
from __future__ import annotations

import importlib
import sys

import pytest
from weight_bufts import host_extra_bufts

from ggx import registry
from ggx.errors import GGXUnsupported
from ggx.models import load_model
from ggx.scaffold import write_plugin

PROMPT = [5, 70, 71, 72, 3, 200, 33]


def _placed_in(model) -> dict[str, str]:
    return {name: t.data_buffer.buft.name for name, t in model.weights.items()}


@pytest.fixture
def scaffold_reg(tmp_path):
    """The BackendReg of a freshly generated `ggx new-plugin` package (the test registers it
    in-process, which lists its device before the CPU device); unregistered afterwards."""
    root = write_plugin("zz-scaffold-test", tmp_path)
    sys.path.insert(0, str(root))
    reg = importlib.import_module("ggx_zz_scaffold_test.device").ZzScaffoldTestBackendReg()
    yield reg
    if any(p.name == reg.name for p in registry.plugins()):
        registry.unregister(reg.name)
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.startswith("ggx_zz_scaffold_test")]:
        del sys.modules[name]


@pytest.mark.parametrize("wtype", ["Q4_0", "Q4_1"])
def test_another_host_device_keeps_repack_and_the_tokens(tmp_path, scaffold_reg, wtype):
    from gguf_synth import write_tiny_llama

    path = write_tiny_llama(tmp_path / f"tiny-{wtype}.gguf", wtype=wtype)
    plain = load_model(path, n_ctx=256)
    want_tokens = [t.id for t in plain.generate(PROMPT, 6, stop_at_eos=False)]
    want_places = _placed_in(plain)
    # the CPU's first extra buffer type that takes Q4 (CPU_REPACK; AMX where the CPU has it)
    extra = want_places["blk.0.attn_output.weight"]
    assert extra in host_extra_bufts()
    registry.register(scaffold_reg)
    scaffold = scaffold_reg.devices()[0]
    assert registry.devices().index(scaffold) < registry.devices().index(registry.get_device("CPU"))

    model = load_model(path, n_ctx=256)
    assert [d.name for d in model.runner.devices] == ["CPU"]  # another CPU-type device runs only when named
    assert _placed_in(model) == want_places
    assert [t.id for t in model.generate(PROMPT, 6, stop_at_eos=False)] == want_tokens
    used = {u.name: u for u in model.placement.used}
    assert used[extra].n_tensors == sum(1 for b in want_places.values() if b == extra)

    named = load_model(path, devices=[scaffold.name], n_ctx=256)  # the scaffold README's promise
    assert [d.name for d in named.runner.devices] == [scaffold.name, "CPU"]
    assert _placed_in(named)["blk.0.attn_output.weight"] == extra  # its mul_mat refuses Q4: the CPU's type
    assert len([t.id for t in named.generate(PROMPT, 6, stop_at_eos=False)]) == 6
    after = load_model(path, devices=["CPU", scaffold.name], n_ctx=256)  # listed last: the CPU keeps its type
    assert _placed_in(after)["blk.0.attn_output.weight"] == extra


def test_placement_report_lists_every_candidate(tiny_llama):
    m = load_model(tiny_llama, devices=["ref"], n_ctx=256)
    assert [d.name for d in m.runner.devices][0] == "ref"
    report = m.placement
    assert report.bufts[0].name == "ref" and report.bufts[0].device == "ref"
    assert sum(u.n_tensors for u in report.used) == len({id(t) for t in m.weights.values()})
    assert sum(u.nbytes for u in report.used) == sum({id(t): t.nbytes for t in m.weights.values()}.values())
    assert all(u.skipped for u in report.skipped) and "ref" in str(report)


def test_weights_of_a_type_no_device_computes_are_refused_by_name(tmp_path):
    """ggx-cpu does not compute Q5_K: placing the weights names the first one no buffer type takes;
    the reference backend computes the same file."""
    from gguf_synth import write_tiny_llama

    path = write_tiny_llama(tmp_path / "q5_k.gguf", n_embd=256, n_head=4, n_head_kv=2, n_ff=256, wtype="Q5_K")
    with pytest.raises(GGXUnsupported, match=r"Q5_K\[256, 256, 1, 1\]: no buffer type supports MUL_MAT"):
        load_model(str(path), devices=["CPU"], n_ctx=64)
    logits = load_model(str(path), devices=["ref"], n_ctx=64).forward([1, 2, 3])
    assert logits.shape[-1] > 256 and bool((logits == logits).all())
