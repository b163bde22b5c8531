"""A synthetic MoE llama (mul_mat_id, top-k routing): the reference backend alone, and a split
run with the experts in host memory, MUL_MAT_ID offloaded to the scheduler's test device and the
used experts uploaded by the scheduler's expert-upload copy callback, agree."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ggx.models import load_model
from ggx.ops import Op

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/sched_device.py, shared with sched tests
from sched_device import TestDevice  # noqa: E402

PROMPT = [40, 41, 42, 100, 7, 8, 9, 250, 12]


@pytest.fixture(scope="module")
def ref_logits(tiny_moe):
    m = load_model(tiny_moe, devices=["ref"])
    assert m.hp.n_expert == 4 and m.hp.n_expert_used == 2
    return m.forward(PROMPT), [m.forward(PROMPT[:k])[-1] for k in (3, 6)]


def test_moe_graph_uses_mul_mat_id(tiny_moe):
    from ggx.graph import Context, build_graph
    from ggx.models.blocks import BatchShape

    m = load_model(tiny_moe, devices=["ref"])
    logits, _ = m.arch.build(Context(), m.hp, m.weights, m.cache, BatchShape(4, 256, 4))
    ops = [n.op for n in build_graph(logits).nodes]
    assert ops.count(Op.MUL_MAT_ID) == 3 * m.hp.n_layer and Op.ARGSORT in ops


def test_moe_split_with_expert_upload_matches_reference(tiny_moe, ref_logits):
    from ggx.reference import RefDevice

    dev = TestDevice("moe-test", offload=lambda op: op.op is Op.MUL_MAT_ID)
    # both listed devices take part in the layer split: every layer on the test device, none on ref
    m = load_model(tiny_moe, devices=[dev, RefDevice()], host_experts=True, tensor_split=[1, 0])
    assert m.wait_prepared(120)  # the scheduler's statistics below are the test's graphs only
    exps = [w for n, w in m.weights.items() if n.endswith("_exps.weight")]
    assert exps and all(w.data_buffer.is_host for w in exps)
    # the token embedding stays in host memory (llama.cpp keeps tok_embd on the CPU)
    others = [w for n, w in m.weights.items() if not n.endswith("_exps.weight") and n != "token_embd.weight"]
    assert all(not w.data_buffer.is_host for w in others)
    full, prefixes = ref_logits
    np.testing.assert_allclose(m.forward(PROMPT), full, atol=1e-4, rtol=1e-4)
    cb, st = m.runner.copy_callback, m.runner.sched.stats
    assert st.n_callback_copies > 0 and cb.runs, "the expert uploads went through the copy callback"
    assert st.n_splits > 1
    m.reset()
    for k, want in zip((3, 6), prefixes):  # decode steps: one token uses at most n_expert_used experts
        m.reset()
        m.eval(PROMPT[: k - 1])
        got = m.eval([PROMPT[k - 1]])[-1]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        assert sum(last - first + 1 for first, last in cb.runs) <= 3 * m.hp.n_layer * m.hp.n_expert_used


@pytest.mark.parametrize("flash_attn", [True, False])
def test_cpu_plugin_matches_reference(tiny_moe, tiny_llama, flash_attn):
    """Dense and MoE graphs on ggx-cpu (activations quantized as ggml does) against ref (float64)."""
    for path in (tiny_moe, tiny_llama):
        want = load_model(path, devices=["ref"], flash_attn=flash_attn).forward(PROMPT)
        got = load_model(path, devices=["CPU"], flash_attn=flash_attn).forward(PROMPT)
        nmse = float(((got - want) ** 2).sum() / (want**2).sum())
        assert nmse < 1e-2, (path.name, nmse)
