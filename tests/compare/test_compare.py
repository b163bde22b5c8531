"""ggx.compare on a tiny synthetic llama: the reference against devices that compute alike (every
node equal, isolated and accumulated), against one that breaks an op (that node named, its
inputs in agreement), the command line and its JSON."""
from __future__ import annotations

import json

import numpy as np
import pytest
from broken_device import BrokenDevice
from sched_device import TestDevice

from ggx import cli
from ggx.compare import BackendSpec, compare_model
from ggx.errors import GGXValueError
from ggx.ops import Op


def test_ref_against_the_async_test_device_agrees_node_for_node(tiny_llama):
    dev = TestDevice("sched-compare")
    seen = []
    r = compare_model(tiny_llama, "ref", dev, prompt=[5, 9, 33, 2], n_decode=2, progress=seen.append)
    assert r.ok, "\n".join(r.summary())
    assert {n.step for n in r.nodes} == {0, 1, 2}
    ops = {n.op for n in r.nodes}
    assert {"MUL_MAT", "RMS_NORM", "ROPE", "FLASH_ATTN_EXT", "SET_ROWS", "GET_ROWS"} <= ops
    # the device runs the reference's own per-op code: equal to the bit, both ways of comparing
    assert all(n.accumulated == 0.0 and n.isolated == 0.0 for n in r.nodes if n.accumulated is not None)
    # isolated where B's scheduler ran each node: the device, but the embedding rows on the host
    embd = [n for n in r.nodes if n.op == "GET_ROWS" and n.node["src"][0]["name"] == "token_embd.weight"]
    assert len(embd) == 3 and all(n.note != dev.name for n in embd)
    assert all(n.note == dev.name for n in r.nodes if n not in embd), {n.note for n in r.nodes}
    assert [x.position for x in r.logits] == [0, 1, 2, 3, 4, 5] and all(x.max_abs == 0.0 for x in r.logits)
    assert len(r.tokens) == 6 and r.n_prompt == 4
    assert any(s.startswith("decode step 2/2: sched-compare node") for s in seen)


def test_a_broken_op_is_named_with_its_layout_and_its_inputs_agreement(tiny_llama):
    r = compare_model(tiny_llama, "ref", BrokenDevice("noise", fault_ops=(Op.ROPE,), name="broken-rope"),
                      prompt=[5, 9, 33], n_decode=1)
    assert not r.ok
    first = r.first_isolated
    assert first is not None and first.op == "ROPE" and first.step == 0
    assert first.isolated > first.tolerance and "NMSE" in first.note
    # every node before it agrees; its inputs (a view of the Q/K product, the positions) agree
    assert all(n.isolated_ok for n in r.nodes if (n.step, n.index) < (0, first.index))
    assert first.inputs and all(x == 0.0 for x in first.inputs)
    src = first.node["src"][0]
    assert src["view"]["of"].endswith("]") and len(src["nb"]) == 4  # the strided view it read
    assert r.first_accumulated.index == first.index
    text = "\n".join(r.summary())
    assert "first node beyond its tolerance (isolated)" in text and "ROPE" in text and text.endswith("DISAGREE")


def test_without_isolation_only_the_accumulated_run_is_judged(tiny_llama):
    r = compare_model(tiny_llama, "ref", BrokenDevice("noise", fault_ops=(Op.SOFT_MAX,), name="broken-sm"),
                      prompt=[1, 2], n_decode=0, isolated=False)
    assert r.ok and all(n.isolated is None and n.isolated_ok is None for n in r.nodes)  # no SOFT_MAX: FA path


def test_backend_specs():
    assert BackendSpec.parse("CPU:CPU_REPACK") == BackendSpec("CPU", "CPU_REPACK")
    assert str(BackendSpec.parse("ref")) == "ref"
    for bad in ("", ":AMX", "CPU:"):
        with pytest.raises(GGXValueError, match="DEVICE or DEVICE:BUFT"):
            BackendSpec.parse(bad)


def test_an_unknown_extra_buffer_type_names_the_devices_own(capsys):
    assert cli.main(["compare", "-b", "ref:NOPE"]) == 2
    assert "no extra buffer type 'NOPE'" in capsys.readouterr().err


def test_cli_json_and_exit_status(tiny_llama, capsys):
    assert cli.main(["compare", str(tiny_llama), "-b", "ref", "-b", "ref", "-n", "1", "-p", "the", "-o", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] and d["a"] == d["b"] == "ref" and d["first_isolated"] is None
    assert len(d["logits"]) == d["n_prompt"] + 1 and all(n["isolated"] == 0.0 for n in d["nodes"])
    assert cli.main(["compare", str(tiny_llama), "-b", "ref", "-b", "ref", "-b", "ref"]) == 2
    assert "one or two -b" in capsys.readouterr().err


def test_graphs_need_a_backend_that_captures(tiny_llama, capsys):
    assert cli.main(["compare", str(tiny_llama), "-b", "ref", "--graphs", "on,off", "-n", "1"]) == 2
    assert 'set_graphs' in capsys.readouterr().err
    assert cli.main(["compare", str(tiny_llama), "-b", "ref", "--graphs", "sometimes"]) == 2


def test_logits_criteria():
    from ggx.compare.criteria import logits_rows

    a = np.zeros((3, 50), np.float32)
    a[:, 7] = [5.0, 0.2, 5.0]  # margins 5, 0.2, 5
    b = a.copy()
    b[1, 7], b[1, 8] = 0.0, 0.1  # argmax moves where the margin is 0.2: allowed
    b[2, :10] += 0.3  # mean |diff| over A's top 10 above 0.25
    rows = logits_rows(a, b, step=0, first_position=4)
    assert [r.position for r in rows] == [4, 5, 6]
    assert rows[0].ok and rows[1].ok and not rows[1].argmax_checked and rows[1].argmax_b == 8
    assert not rows[2].ok and "mean |diff|" in rows[2].problem()
    b2 = a.copy()
    b2[0, 3] = 6.0  # a clear argmax lost, and a top-10 logit 6 away
    (r,) = logits_rows(a[:1], b2[:1], 1, 9)
    assert not r.ok and "argmax 3 != 7" in r.problem() and "max |diff| 6" in r.problem()
