"""The AMX buffer type (its emulated engine here): registration order, write-only rules, ggml's
supports_op, sizes, and results against plain ggx-cpu on the same quantized activations (which
leaves only the float summation order to differ), for the tile path, the gemv path and MoE."""
from __future__ import annotations

import numpy as np
import pytest
from amx_testing import mul_mat_graph, mul_mat_id_graph, nmse, run_in

from ggx import registry
from ggx.alloc import alloc_tensors
from ggx.errors import GGXError, GGXShapeError, GGXUnsupported
from ggx.graph import Context, build_graph
from ggx.placement import buft_list, select_buft
from ggx.quants import quantize
from ggx.types import GType
from ggx_amx.buffer import AmxBufferType
from ggx_amx.layout import FORMATS
from ggx_amx.plugin import PRIORITY_AMX
from ggx_repack.plugin import PRIORITY_REPACK

TYPES = sorted(FORMATS, key=lambda t: t.name)
#: Same activations, same integer dots: only the order of float additions differs from ggx-cpu.
SAME_DOTS = 1e-9


def test_registered_before_repack(amx_cpu, amx_buft, cpu):
    names = [b.name for b in registry.extra_buffer_types(amx_cpu)]
    assert names[0] == "AMX_EMULATED" and "CPU_REPACK" in names[1:]
    assert PRIORITY_AMX < PRIORITY_REPACK
    assert amx_cpu.supports_buft(amx_buft) and not cpu.supports_buft(amx_buft)
    assert "AMX_EMULATED" not in [b.name for b in registry.extra_buffer_types(cpu)]  # the session's CPU: untouched


def test_placement_tries_amx_first(amx_cpu):
    ctx = Context()
    ok, odd = ctx.tensor(GType.Q4_0, (256, 64), "ok"), ctx.tensor(GType.Q4_0, (256, 48), "odd")
    bufts = buft_list([amx_cpu])
    assert select_buft(ok, lambda c, w: c.mul_mat(w, c.tensor(GType.F32, (256, 3))), bufts).name == "AMX_EMULATED"
    # 48 rows: not a multiple of 32, AMX refuses and the next type takes it
    assert select_buft(odd, lambda c, w: c.mul_mat(w, c.tensor(GType.F32, (256, 3))), bufts).name == "CPU_REPACK"


def test_set_tensor_whole_only_and_write_only(amx_buft):
    ctx = Context()
    w = ctx.tensor(GType.Q4_0, (64, 32), "w")
    alloc_tensors(amx_buft, [w])
    raw = np.zeros(w.nbytes, np.uint8)
    with pytest.raises(GGXUnsupported, match="set whole"):
        w.buffer.set_tensor(w, raw[:18], 0)
    w.buffer.set_tensor(w, raw, 0)
    with pytest.raises(GGXUnsupported, match="write-only"):
        w.buffer.get_tensor(w)
    assert w.buffer.cpy_tensor(Context().tensor(GType.Q4_0, (64, 32)), w) is False
    w.buffer.memset_tensor(w, 0)
    w.buffer.clear(0)


def test_free_releases_the_memory(amx_buft):
    ctx = Context()
    w = ctx.tensor(GType.Q8_0, (64, 32), "w")
    buf = alloc_tensors(amx_buft, [w])
    buf.free()
    for access in (lambda: buf.set_tensor(w, np.zeros(w.nbytes, np.uint8)), lambda: buf.clear(0)):
        with pytest.raises(GGXError, match="freed"):
            access()


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_alloc_size_is_the_packed_size(amx_buft, gtype):
    K = 2 * gtype.block_size
    w = Context().tensor(gtype, (K, 64, 3), "w")
    tiles = 64 // 16 * (K // gtype.block_size) * 3
    assert amx_buft.get_alloc_size(w) == max(w.nbytes, tiles * FORMATS[gtype].tile_bytes)
    assert amx_buft.get_alloc_size(w) > w.nbytes if gtype in (GType.Q8_0, GType.Q4_K) else True


@pytest.mark.parametrize("gtype, K, M, ok", [
    (GType.Q4_0, 64, 32, True), (GType.Q4_0, 64, 16, False), (GType.Q4_0, 64, 48, False),
    (GType.Q4_1, 96, 64, True), (GType.Q8_0, 32, 96, True), (GType.Q4_K, 512, 32, True),
    (GType.Q6_K, 256, 64, True), (GType.Q6_K, 256, 16, False), (GType.Q5_0, 64, 32, False),
    (GType.F16, 64, 32, False), (GType.F32, 64, 32, False),
])
def test_supports_op_is_ggml_s(amx_cpu, amx_buft, gtype, K, M, ok):
    """MUL_MAT over a weight of a type with AMX kernels whose rows divide by 32 (K divides by the
    block by construction: 32, or 256 for the K-quants)."""
    ctx = Context()
    w = ctx.tensor(gtype, (K, M), "w")
    op = ctx.mul_mat(w, ctx.tensor(GType.F32, (K, 3)))
    alloc_tensors(amx_buft, [w])
    assert amx_buft.supports_op(op) is ok
    assert amx_cpu.supports_op(op) is ok
    if not ok:
        with pytest.raises(GGXUnsupported):
            amx_buft.prepare_forward(op, 1)


def test_supports_op_refuses_other_ops_views_and_layouts(amx_buft):
    ctx = Context()
    w, w3 = ctx.tensor(GType.Q4_0, (64, 32), "w"), ctx.tensor(GType.Q4_0, (64, 32, 2), "w3")
    alloc_tensors(amx_buft, [w, w3])
    assert not amx_buft.supports_op(ctx.mul_mat(w3, ctx.tensor(GType.F32, (64, 3, 2))))  # MUL_MAT: 2-D only
    assert "not a matmul" in amx_buft.why_not(ctx.get_rows(w, ctx.tensor(GType.I32, (2,))))
    strided = ctx.permute(ctx.tensor(GType.F32, (64, 2, 3)), 0, 2, 1, 3)
    assert "contiguous" in amx_buft.why_not(ctx.mul_mat(w, strided))
    host_w = ctx.tensor(GType.Q4_0, (64, 32), "host")
    with pytest.raises(GGXUnsupported, match="is not in AMX_EMULATED"):
        amx_buft.prepare_forward(ctx.mul_mat(host_w, ctx.tensor(GType.F32, (64, 1))), 1)


def test_set_tensor_refuses_weights_without_kernels(amx_buft):
    ctx = Context()
    w = ctx.tensor(GType.Q5_0, (64, 32), "w")
    alloc_tensors(amx_buft, [w])
    with pytest.raises(GGXUnsupported, match="no AMX kernel for Q5_0"):
        w.buffer.set_tensor(w, np.zeros(w.nbytes, np.uint8), 0)


# --- results --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M, n, batch", [(64, 1, (1, 1)), (32, 5, (1, 1)), (64, 40, (1, 1)), (32, 7, (2, 1))])
def test_mul_mat_agrees_with_ggx_cpu(amx_cpu, amx_backend, amx_buft, gtype, M, n, batch):
    """n = 1: the gemv; 5: partial tiles (gathered A); 40: a full 32-column block straight from the
    activations plus a partial one; batch: b's dims 2/3 broadcast over the weight."""
    K = 2 * gtype.block_size if gtype.block_size == 256 else 96
    out, inputs = mul_mat_graph(gtype, K, M, n, batch, seed=M + n)
    got = run_in(amx_cpu, amx_backend, amx_buft, out, inputs)
    want = run_in(amx_cpu, amx_backend, None, out, inputs)
    assert nmse(got, want) < SAME_DOTS


@pytest.mark.parametrize("gtype", [GType.Q4_0, GType.Q8_0, GType.Q4_K], ids=lambda t: t.name)
def test_mul_mat_id_agrees_with_ggx_cpu(amx_cpu, amx_backend, amx_buft, gtype):
    """Experts used by 0, 1 (gemv) and several columns, one twice by the same token, b broadcast."""
    ids = np.array([[3, 0], [1, 1], [0, 3], [3, 0], [0, 0]])  # expert 2 unused; 1 only by token 1 (twice)
    K = 256
    for b_ne1 in (1, 2):
        out, inputs = mul_mat_id_graph(gtype, K, 32, ids, n_expert=4, b_ne1=b_ne1, seed=b_ne1)
        got = run_in(amx_cpu, amx_backend, amx_buft, out, inputs)
        want = run_in(amx_cpu, amx_backend, None, out, inputs)
        assert nmse(got, want) < SAME_DOTS


def test_mul_mat_id_refuses_bad_ids(amx_cpu, amx_backend, amx_buft):
    out, inputs = mul_mat_id_graph(GType.Q8_0, 64, 32, np.array([[0, 4]]), n_expert=4, b_ne1=1)
    with pytest.raises(GGXShapeError, match=r"ids\[1, 0\] = 4 is not an expert \(0..3\)"):
        run_in(amx_cpu, amx_backend, amx_buft, out, inputs)


def test_launch_bound_once_per_graph(amx_cpu, amx_backend, amx_buft):
    out, inputs = mul_mat_graph(GType.Q8_0, 64, 32, 3)
    run_in(amx_cpu, amx_backend, amx_buft, out, inputs)
    graph = build_graph(out)
    amx_backend.graph_compute(graph)
    kept = amx_backend.prepared.kept(graph)
    amx_backend.graph_compute(graph)
    assert amx_backend.prepared.kept(graph) is kept and len(kept.launches) == 1


def test_weights_go_whole_into_the_layout(amx_buft):
    """set_tensor writes exactly the packed bytes at the tensor's offset (layout.pack's)."""
    from ggx_amx.layout import pack

    ctx = Context()
    a, b = ctx.tensor(GType.Q4_1, (64, 32), "a"), ctx.tensor(GType.Q4_1, (64, 32), "b")
    buf = alloc_tensors(amx_buft, [a, b])
    raw = quantize(np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32), GType.Q4_1).reshape(-1)
    buf.clear(0x5A)
    b.buffer.set_tensor(b, raw, 0)
    mem = buf.packed_bytes()
    packed = pack(GType.Q4_1, raw, b.ne)
    assert np.array_equal(mem[b.data_offset: b.data_offset + packed.size], packed)
    assert (mem[a.data_offset: a.data_offset + amx_buft.get_alloc_size(a)] == 0x5A).all()


def test_an_unknown_engine_is_refused(amx_cpu):
    with pytest.raises(GGXUnsupported, match="unknown engine"):
        AmxBufferType(amx_cpu, "fast")


def test_the_emulated_type_is_never_timed(amx_cpu, tmp_path, monkeypatch):
    """`ggx tune` on a CPU device holding AMX_EMULATED lists it as not timed (its speed means
    nothing, benchmarks/amx.py's rule) and times the others; a profile can thus never choose it."""
    from ggx import tune

    monkeypatch.setenv(tune.CACHE_ENV, str(tmp_path))
    assert registry.extra_buffer_types(amx_cpu)[0].emulated
    p = tune.tune(amx_cpu, types=["Q4_0"], shape=(256, 32), prompt=4, budget_s=60)
    assert p.not_timed["AMX_EMULATED"] == "emulated (its speed means nothing)"
    assert {b for b, _, _ in p.timings} <= {b.name for b in tune.candidates(amx_cpu) if not b.emulated}
    assert not any(b == "AMX_EMULATED" for b, _, _ in p.timings)
