"""CPU_REPACK as a buffer type: registration, write-only rules, supports_op, MoE, fallback."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from repack_testing import alloc, repack_buft, run_repacked

from ggx import registry
from ggx.errors import GGXUnsupported
from ggx.graph import Context
from ggx.hookspecs import PRIORITY_REPACK
from ggx.quants import dequantize, quantize
from ggx.types import GType
from ggx_cpu import isa
from ggx_repack.buffer import RepackBufferType


def weight(ctx, gtype=GType.Q4_0, K=256, M=16, E=1):
    return ctx.tensor(gtype, (K, M, E) if E > 1 else (K, M), "w")


def test_registered_for_the_cpu_device_only(cpu):
    bufts = registry.extra_buffer_types(cpu)
    assert [b.name for b in bufts if isinstance(b, RepackBufferType)] == ["CPU_REPACK"]
    assert cpu.supports_buft(repack_buft(cpu))
    assert not any(isinstance(b, RepackBufferType) for b in registry.extra_buffer_types(registry.get_device("ref")))
    from ggx_repack import plugin
    assert plugin.ggx_extra_buffer_types(cpu)[0][0] == PRIORITY_REPACK


def test_set_tensor_whole_only_and_write_only(cpu):
    buft = repack_buft(cpu)
    ctx = Context()
    w = weight(ctx)
    alloc(buft, [w])
    raw = np.zeros(w.nbytes, np.uint8)
    with pytest.raises(GGXUnsupported, match="set whole"):
        w.buffer.set_tensor(w, raw[:18], 0)
    with pytest.raises(GGXUnsupported, match="set whole"):
        w.buffer.set_tensor(w, raw[18:], 18)
    w.buffer.set_tensor(w, raw, 0)
    with pytest.raises(GGXUnsupported, match="write-only"):
        w.buffer.get_tensor(w)
    other = Context().tensor(GType.Q4_0, (256, 16))
    with pytest.raises(GGXUnsupported, match="write-only"):
        w.buffer.cpy_tensor(other, w)


def test_tensor_without_layout_is_refused(cpu):
    buft = repack_buft(cpu)
    ctx = Context()
    w = ctx.tensor(GType.Q6_K, (256, 16), "w")
    alloc(buft, [w])
    with pytest.raises(GGXUnsupported, match="no repacked layout"):
        w.buffer.set_tensor(w, np.zeros(w.nbytes, np.uint8), 0)


@pytest.mark.parametrize("gtype, M, ok", [
    (GType.Q4_0, 16, True), (GType.Q4_0, 12, False), (GType.Q8_0, 12, True),
    (GType.Q6_K, 16, False), (GType.F16, 16, False), (GType.Q4_1, 24, True), (GType.Q4_K, 8, True),
])
def test_supports_op_follows_the_selection(cpu, gtype, M, ok, monkeypatch):
    monkeypatch.delenv("GGX_REPACK_LAYOUTS", raising=False)
    buft = repack_buft(cpu)
    ctx = Context()
    w = weight(ctx, gtype, M=M)
    op = ctx.mul_mat(w, ctx.tensor(GType.F32, (256, 3)))
    alloc(buft, [w])
    assert buft.supports_op(op) is ok
    assert cpu.supports_op(op) is ok


def test_supports_op_refuses_other_ops_and_3d_mul_mat(cpu):
    buft = repack_buft(cpu)
    ctx = Context()
    w3 = weight(ctx, E=2)
    w = weight(ctx)
    alloc(buft, [w3, w])
    assert not buft.supports_op(ctx.mul_mat(w3, ctx.tensor(GType.F32, (256, 3, 2))))
    assert not buft.supports_op(ctx.get_rows(w, ctx.tensor(GType.I32, (2,))))
    with pytest.raises(GGXUnsupported, match="not a matmul"):
        buft.compute_forward(ctx.get_rows(w, ctx.tensor(GType.I32, (2,))), 1)
    host_w = weight(ctx)
    assert buft.compute_forward(ctx.mul_mat(host_w, ctx.tensor(GType.F32, (256, 1))), 1) is False


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
