"""Model level: a Q4_0 feed-forward stack (rms_norm, mul_mat, swiglu, residual add) gives the
same result with its weights repacked as in plain host memory, within the mul_mat threshold."""
from __future__ import annotations

import numpy as np
from repack_testing import repack_buft

from ggx.conformance.harness import execute, nmse, weight_uses, weights_refused
from ggx.graph import Context, build_graph
from ggx.quants import quantize
from ggx.types import GType

MUL_MAT_NMSE = 5e-4  # the conformance suite's mul_mat threshold


def build(n_embd=256, n_ff=512, n_layers=2, n_tokens=5):
    rng = np.random.default_rng(11)
    ctx = Context()
    x = ctx.tensor(GType.F32, (n_embd, n_tokens), "x")
    inputs = {x: rng.standard_normal((n_tokens, n_embd)).astype(np.float32).view(np.uint8).reshape(-1)}
    cur = x
    for il in range(n_layers):
        ws = {}
        for name, ne in (("gate", (n_embd, n_ff)), ("up", (n_embd, n_ff)), ("down", (n_ff, n_embd))):
            ws[name] = ctx.tensor(GType.Q4_0, ne, f"blk.{il}.ffn_{name}")
            vals = rng.standard_normal((ne[1], ne[0])).astype(np.float32) / np.sqrt(ne[0])
            inputs[ws[name]] = quantize(vals, GType.Q4_0).reshape(-1)
        h = ctx.rms_norm(cur, 1e-5)
        h = ctx.swiglu(ctx.mul_mat(ws["gate"], h), ctx.mul_mat(ws["up"], h))
        cur = ctx.add(cur, ctx.mul_mat(ws["down"], h))
    return cur, inputs


def test_q4_0_graph_same_with_and_without_repack(cpu, cpu_backend):
    buft = repack_buft(cpu)
    out, inputs = build()
    graph = build_graph(out)
    assert weights_refused(buft, graph) is None
    repacked = execute(cpu, cpu_backend, out, inputs, graph, buft)
    assert sum(w.buffer is repacked.placement.weights for w, _ in weight_uses(graph)) == 6

    plain = execute(cpu, cpu_backend, *build())
    assert not repacked.problems and not plain.problems
    assert nmse(repacked.values, plain.values) < MUL_MAT_NMSE
    assert np.isfinite(repacked.values).all()


def test_tied_output_gets_a_repacked_copy(monkeypatch):
    """SmolLM2 ties its output matrix to the Q8_0 token embedding: get_rows reads the embedding
    from plain host memory, the output mul_mat reads its own copy, repacked (llama.cpp duplicates
    the tensor the same way). The weights may go to CPU_REPACK alone (on a CPU with AMX, the AMX
    buffer type would come first)."""
    from ggx import placement
    from ggx.backend import ExtraBufferType
    from ggx.models import load_model

    every = placement.buft_list
    monkeypatch.setattr(placement, "buft_list", lambda devices: [
        b for b in every(devices) if not isinstance(b, ExtraBufferType) or b.name == "CPU_REPACK"])
    model = load_model(n_threads=1)
    embd, out = model.weights["token_embd.weight"], model.weights["output.weight"]
    assert model.hp.tied_output and out is not embd
    assert embd.buffer.buft.name == "CPU" and out.buffer.buft.name == "CPU_REPACK"
    assert out.type is embd.type and out.ne == embd.ne
    logits = model.forward([1, 2, 3])
    assert logits.shape == (3, model.n_vocab) and np.isfinite(logits).all()
