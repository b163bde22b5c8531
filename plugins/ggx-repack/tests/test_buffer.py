"""CPU_REPACK as a buffer type: registration, write-only rules, supports_op, one layout choice
and one verdict per op, launches, MoE, fallback."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from repack_testing import repack_buft, run_repacked

from ggx import registry
from ggx.alloc import alloc_tensors
from ggx.errors import GGXError, GGXUnsupported
from ggx.graph import Context, build_graph
from ggx.quants import dequantize, quantize
from ggx.types import GType
from ggx_cpu import isa
from ggx_cpu.device import CpuDevice
from ggx_repack import buffer as repack_buffer
from ggx_repack.buffer import RepackBufferType
from ggx_repack.plugin import PRIORITY_REPACK


def weight(ctx, gtype=GType.Q4_0, K=256, M=16, E=1):
    return ctx.tensor(gtype, (K, M, E) if E > 1 else (K, M), "w")


def test_registered_for_the_cpu_device_only(cpu):
    bufts = registry.extra_buffer_types(cpu)
    assert [b.name for b in bufts if isinstance(b, RepackBufferType)] == ["CPU_REPACK"]
    assert cpu.supports_buft(repack_buft(cpu))
    assert not any(isinstance(b, RepackBufferType) for b in registry.extra_buffer_types(registry.get_device("ref")))
    from ggx_repack import plugin
    assert plugin.ggx_extra_buffer_types(cpu)[0][0] == PRIORITY_REPACK
    # ggx-cpu's registration decides, not the name: a renamed CPU device of ggx-cpu gets it, a device named CPU not
    renamed = CpuDevice()
    renamed.name, renamed.reg = "CPU1", cpu.reg
    assert isinstance(plugin.ggx_extra_buffer_types(renamed)[0][1], RepackBufferType)
    impostor = type("Impostor", (type(registry.get_device("ref")),), {"name": "CPU"})()
    assert plugin.ggx_extra_buffer_types(impostor) is None


def test_set_tensor_whole_only_and_write_only(cpu):
    buft = repack_buft(cpu)
    ctx = Context()
    w = weight(ctx)
    alloc_tensors(buft, [w])
    raw = np.zeros(w.nbytes, np.uint8)
    with pytest.raises(GGXUnsupported, match="set whole"):
        w.buffer.set_tensor(w, raw[:18], 0)
    with pytest.raises(GGXUnsupported, match="set whole"):
        w.buffer.set_tensor(w, raw[18:], 18)
    w.buffer.set_tensor(w, raw, 0)
    with pytest.raises(GGXUnsupported, match="write-only"):
        w.buffer.get_tensor(w)
    other = Context().tensor(GType.Q4_0, (256, 16))
    assert w.buffer.cpy_tensor(other, w) is False  # declines, per the contract: set_tensor repacks


def test_free_releases_the_memory(cpu):
    buft = repack_buft(cpu)
    ctx = Context()
    w = weight(ctx)
    buf = alloc_tensors(buft, [w])
    buf.free()
    assert buf.is_freed
    for access in (lambda: buf.set_tensor(w, np.zeros(w.nbytes, np.uint8)), lambda: buf.clear(0),
                   lambda: buf.memset_tensor(w, 0)):
        with pytest.raises(GGXError, match="freed"):
            access()
    op = ctx.mul_mat(w, ctx.tensor(GType.F32, (256, 1)))
    with pytest.raises(GGXError, match="freed"):
        buft.prepare_forward(op, 1)


def test_tensor_without_layout_is_refused(cpu):
    buft = repack_buft(cpu)
    ctx = Context()
    w = ctx.tensor(GType.Q4_0, (256, 12), "w")  # 12 rows: not a multiple of q4_0_8x8's group
    alloc_tensors(buft, [w])
    with pytest.raises(GGXUnsupported, match="no repacked layout"):
        w.buffer.set_tensor(w, np.zeros(w.nbytes, np.uint8), 0)


@pytest.mark.parametrize("gtype, M, ok", [
    (GType.Q4_0, 16, True), (GType.Q4_0, 12, False), (GType.Q8_0, 12, True),
    (GType.Q6_K, 16, "avx512_vnni"), (GType.F16, 16, False), (GType.Q4_1, 24, True), (GType.Q4_K, 8, True),
    (GType.Q5_0, 16, True), (GType.Q5_0, 12, False),
])
def test_supports_op_follows_the_selection(cpu, gtype, M, ok, monkeypatch):
    """ok: the verdict, or the one ISA variant with a layout for the type (q6_K_8x8)."""
    monkeypatch.delenv("GGX_REPACK_LAYOUTS", raising=False)
    if isinstance(ok, str):
        ok = isa.active() == ok
    buft = repack_buft(cpu)
    ctx = Context()
    w = weight(ctx, gtype, M=M)
    op = ctx.mul_mat(w, ctx.tensor(GType.F32, (256, 3)))
    alloc_tensors(buft, [w])
    assert buft.supports_op(op) is ok
    assert cpu.supports_op(op) is ok


def test_supports_op_refuses_other_ops_and_3d_mul_mat(cpu):
    buft = repack_buft(cpu)
    ctx = Context()
    w3 = weight(ctx, E=2)
    w = weight(ctx)
    alloc_tensors(buft, [w3, w])
    assert not buft.supports_op(ctx.mul_mat(w3, ctx.tensor(GType.F32, (256, 3, 2))))
    assert not buft.supports_op(ctx.get_rows(w, ctx.tensor(GType.I32, (2,))))
    # what supports_op refuses, prepare_forward refuses with the reason (never a None that
    # would hand a repacked weight to a CPU kernel)
    with pytest.raises(GGXUnsupported, match="not a matmul"):
        buft.prepare_forward(ctx.get_rows(w, ctx.tensor(GType.I32, (2,))), 1)
    host_w = weight(ctx)
    with pytest.raises(GGXUnsupported, match="is not in CPU_REPACK"):
        buft.prepare_forward(ctx.mul_mat(host_w, ctx.tensor(GType.F32, (256, 1))), 1)


def test_a_weight_layout_is_chosen_once(cpu, monkeypatch):
    """get_alloc_size, init_tensor, set_tensor, supports_op and prepare_forward all use the one
    choice, even if the selection would now choose otherwise."""
    chosen = []
    real = repack_buffer.optimal_layout

    def optimal_layout(*args):
        chosen.append(args[:2])
        return real(*args)

    monkeypatch.setattr(repack_buffer, "optimal_layout", optimal_layout)
    monkeypatch.delenv("GGX_REPACK_LAYOUTS", raising=False)
    buft = repack_buft(cpu)
    ctx = Context()
    w = weight(ctx, GType.Q4_0, M=16)
    op = ctx.mul_mat(w, ctx.tensor(GType.F32, (256, 1)))
    alloc_tensors(buft, [w])
    lay = w.extra
    monkeypatch.setenv("GGX_REPACK_LAYOUTS", "q4_0_4x4")  # the selection would now choose another
    w.buffer.set_tensor(w, quantize(np.ones((16, 256), np.float32), GType.Q4_0).reshape(-1), 0)
    assert buft.supports_op(op) and callable(buft.prepare_forward(op, 1))
    assert chosen == [(GType.Q4_0, 16)] and w.extra is lay and buft.layout_for(w) is lay
    assert lay.name != "q4_0_4x4"


def test_why_not_runs_once_per_op_and_storage(cpu, monkeypatch):
    """The verdict is kept per op node, and asked again only when its sources' storage changed
    (the scheduler may ask before the activations have storage, the backend after)."""
    import ggx_cpu.traits

    asked = []
    real = ggx_cpu.traits.matmul_problem  # the first check of every verdict (the base's why_not)
    monkeypatch.setattr(ggx_cpu.traits, "matmul_problem", lambda op, buft: asked.append(op) or real(op, buft))
    buft = repack_buft(cpu)
    ctx = Context()
    w = weight(ctx)
    x = ctx.tensor(GType.F32, (256, 2))
    op = ctx.mul_mat(w, x)
    assert not buft.supports_op(op) and not buft.supports_op(op)  # the weight is nowhere yet
    assert len(asked) == 1
    alloc_tensors(buft, [w])
    assert buft.supports_op(op) and len(asked) == 2
    alloc_tensors(cpu.buffer_type(), [x])
    for _ in range(3):
        assert buft.supports_op(op) and cpu.supports_op(op)
    w.buffer.set_tensor(w, np.zeros(w.nbytes, np.uint8), 0)
    buft.prepare_forward(op, 1)
    assert asked == [op, op, op]
    x.buffer = registry.get_device("ref").buffer_type().alloc_buffer(x.nbytes)  # other host memory
    assert buft.supports_op(op) and len(asked) == 4


def test_the_cpu_backend_runs_the_launch_of_every_op_it_accepted(cpu, cpu_backend):
    """A repacked weight's matmul runs repack's launch, bound once per graph."""
    rng = np.random.default_rng(3)
    ctx = Context()
    w = weight(ctx, GType.Q8_0, M=8)
    x = ctx.tensor(GType.F32, (256, 2), "x")
    out = ctx.mul_mat(w, x)
    raw = quantize(rng.standard_normal((8, 256)).astype(np.float32), GType.Q8_0).reshape(-1)
    xv = rng.standard_normal((2, 256)).astype(np.float32)
    got, weights = run_repacked(cpu, cpu_backend, repack_buft(cpu), out, {w: raw, x: xv.view(np.uint8).reshape(-1)})
    assert weights == [w]
    ref = xv @ dequantize(raw, GType.Q8_0, 8 * 256).reshape(8, 256).T
    assert np.abs(got.reshape(2, 8) - ref).max() < 0.02 * np.abs(ref).max()
    graph = build_graph(out)
    cpu_backend.graph_compute(graph)
    kept = cpu_backend.prepared.kept(graph)
    cpu_backend.graph_compute(graph)
    assert cpu_backend.prepared.kept(graph) is kept and len(kept.launches) == 1


@pytest.mark.parametrize("n", [1, 3, 8, 21])
def test_mul_mat_and_batches(cpu, cpu_backend, n):
    rng = np.random.default_rng(n)
    ctx = Context()
    w = weight(ctx, GType.Q4_0, K=512, M=24)
    x = ctx.tensor(GType.F32, (512, n, 2), "x")
    out = ctx.mul_mat(w, x)
    raw = quantize(rng.standard_normal((24, 512)).astype(np.float32), GType.Q4_0).reshape(-1)
    xv = rng.standard_normal((2, n, 512)).astype(np.float32)
    got, weights = run_repacked(cpu, cpu_backend, repack_buft(cpu), out, {w: raw, x: xv.view(np.uint8).reshape(-1)})
    assert weights == [w]
    ref = xv @ dequantize(raw, GType.Q4_0, 24 * 512).reshape(24, 512).T
    assert np.abs(got.reshape(2, n, 24) - ref).max() < 0.05 * np.abs(ref).max()


def test_mul_mat_id_experts(cpu, cpu_backend):
    rng = np.random.default_rng(7)
    ctx = Context()
    E, K, M = 4, 256, 16
    w = weight(ctx, GType.Q8_0, K=K, M=M, E=E)
    x = ctx.tensor(GType.F32, (K, 1, 3), "x")
    ids = ctx.tensor(GType.I32, (2, 3), "ids")
    out = ctx.mul_mat_id(w, x, ids)
    raw = quantize(rng.standard_normal((E, M, K)).astype(np.float32), GType.Q8_0).reshape(-1)
    xv = rng.standard_normal((3, 1, K)).astype(np.float32)
    idv = np.array([[3, 0], [1, 1], [2, 3]], np.int32)
    got, weights = run_repacked(cpu, cpu_backend, repack_buft(cpu), out,
                                {w: raw, x: xv.view(np.uint8).reshape(-1), ids: idv.view(np.uint8).reshape(-1)})
    assert weights == [w]
    wf = dequantize(raw, GType.Q8_0, E * M * K).reshape(E, M, K)
    ref = np.stack([[wf[idv[t, e]] @ xv[t, 0] for e in range(2)] for t in range(3)])
    assert np.abs(got.reshape(3, 2, M) - ref).max() < 0.02 * np.abs(ref).max()


@pytest.mark.parametrize("variant", isa.available())
@pytest.mark.parametrize("M, E, n", [(64, 1, 11), (64, 1, 1), (36, 1, 11), (32, 3, 4)])
def test_q8_0_gemm_group_tasks(cpu, cpu_backend, variant, M, E, n, monkeypatch):
    """Q8_0 4x4 gemm tasks take 8 row groups (rows % 32 == 0), else one: both, every variant,
    MUL_MAT (a full tile plus a partial one; the one-column gemv) and MUL_MAT_ID."""
    monkeypatch.setenv("GGX_CPU_ISA", variant)
    rng = np.random.default_rng(M + n)
    K = 128
    ctx = Context()
    w = weight(ctx, GType.Q8_0, K=K, M=M, E=E)
    raw = quantize(rng.standard_normal((E, M, K)).astype(np.float32), GType.Q8_0).reshape(-1)
    wf = dequantize(raw, GType.Q8_0, E * M * K).reshape(E, M, K)
    if E == 1:
        x = ctx.tensor(GType.F32, (K, n), "x")
        out = ctx.mul_mat(w, x)
        xv = rng.standard_normal((n, K)).astype(np.float32)
        inputs = {w: raw, x: xv.view(np.uint8).reshape(-1)}
        ref = xv @ wf[0].T
    else:  # every token uses every expert: each expert's task sees n columns
        x = ctx.tensor(GType.F32, (K, 1, n), "x")
        ids = ctx.tensor(GType.I32, (E, n), "ids")
        out = ctx.mul_mat_id(w, x, ids)
        xv = rng.standard_normal((n, 1, K)).astype(np.float32)
        idv = np.array([rng.permutation(E) for _ in range(n)], np.int32)
        inputs = {w: raw, x: xv.view(np.uint8).reshape(-1), ids: idv.view(np.uint8).reshape(-1)}
        ref = np.stack([[wf[idv[t, e]] @ xv[t, 0] for e in range(E)] for t in range(n)])
    got, weights = run_repacked(cpu, cpu_backend, repack_buft(cpu), out, inputs)
    assert weights == [w]
    assert np.abs(got.reshape(ref.shape) - ref).max() < 0.02 * np.abs(ref).max()


def test_disabling_the_plugin_falls_back_cleanly():
    code = ("from ggx import registry; d = registry.get_device('CPU'); "
            "print([b.name for b in registry.extra_buffer_types(d)])")
    env = dict(os.environ, GGX_DISABLE_PLUGINS="ggx-repack")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "CPU_REPACK" not in out.stdout
    env.pop("GGX_DISABLE_PLUGINS")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "CPU_REPACK" in out.stdout


@pytest.mark.parametrize("gtype", [GType.Q4_0, GType.Q4_1, GType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("b_ne1", [1, 2])
def test_one_token_mul_mat_id_is_bound_once(cpu, cpu_backend, gtype, b_ne1):
    """A decode step's MUL_MAT_ID (one token) runs fused, as compiled steps only, and reads the
    ids at every compute (a repeated expert included); an id out of range raises, naming it,
    before the product writes anything."""
    from ggx.host import tensor_array
    from ggx_cpu.launch import SequenceLaunch

    rng = np.random.default_rng(b_ne1)
    E, K, M, n_used = 5, 256, 32, 2
    ctx = Context()
    w = weight(ctx, gtype, K=K, M=M, E=E)
    x = ctx.tensor(GType.F32, (K, b_ne1, 1), "x")
    ids = ctx.tensor(GType.I32, (n_used, 1), "ids")
    out = ctx.mul_mat_id(w, x, ids)
    alloc_tensors(repack_buft(cpu), [w])
    alloc_tensors(cpu.buffer_type(), [x, ids, out])
    raw = quantize(rng.standard_normal((E, M, K)).astype(np.float32), gtype).reshape(-1)
    w.buffer.set_tensor(w, raw)
    wf = dequantize(raw, gtype, E * M * K).reshape(E, M, K)
    graph = build_graph(out)
    cpu_backend.graph_prepare(graph)
    assert [type(f) for f in cpu_backend.prepared.kept(graph).calls] == [SequenceLaunch]
    for sel in ([4, 0], [2, 2], [1, 3]):
        xv = rng.standard_normal((b_ne1, K)).astype(np.float32)
        tensor_array(x)[...] = xv.reshape(tensor_array(x).shape)
        tensor_array(ids)[...] = np.array(sel, np.int32).reshape(tensor_array(ids).shape)
        cpu_backend.graph_compute(graph)
        got = tensor_array(out).reshape(n_used, M).astype(np.float64)
        ref = np.stack([wf[sel[e]].astype(np.float64) @ xv[e % b_ne1] for e in range(n_used)])
        assert np.sum((got - ref) ** 2) / np.sum(ref ** 2) < 1e-3, sel  # activations quantized to 8 bits
    before = tensor_array(out).copy()
    tensor_array(ids)[...] = np.array([5, 1], np.int32).reshape(tensor_array(ids).shape)
    with pytest.raises(GGXError, match="index 5, outside 0..4"):
        cpu_backend.graph_compute(graph)
    assert np.array_equal(tensor_array(out), before)
