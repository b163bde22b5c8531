"""kernels.repack_mm, a split kernel: a decode token's product as a job of ggx-cpu's worker
threads is bit for bit the same kernel as a parallel region, for every layout repack_mm computes,
MUL_MAT and MUL_MAT_ID, with chunks that do not divide the row groups evenly. A layout without
repack_mm's register gemv (Q4_K) takes tiles.tile_mm's one-column tile where the ISA variant has
tiles: the same holds for it."""
from __future__ import annotations

import numpy as np
import pytest
from repack_testing import repack_buft, run_repacked

import ggx_cpu.jobs
from ggx.graph import Context
from ggx.quants import quantize
from ggx.types import GType
from ggx_cpu import isa
from ggx_repack.kernels import has_register_gemv, repack_mm
from ggx_repack.layouts import optimal_layout
from ggx_repack.tiles import has_tiles, tile_mm

TYPES = [GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0, GType.Q4_K]
CASES = [(t, isa.select()) for t in TYPES] + [(GType.Q4_0, v) for v in isa.available() if v != isa.select()]


def _both(cpu, cpu_backend, monkeypatch, build, inputs_of, kernel=repack_mm):
    """`build()`'s output with the workers on (a job) and off (a parallel region): (on, off)."""
    assert cpu_backend.n_threads > 1
    split_jobs = []
    made = ggx_cpu.jobs.job
    monkeypatch.setattr(ggx_cpu.jobs, "job", lambda kernel, args, parts: (
        split_jobs.append(kernel) if parts > 0 else None) or made(kernel, args, parts))
    got = {}
    for workers in ("1", "0"):
        monkeypatch.setenv("GGX_CPU_WORKERS", workers)
        out, inputs = build()
        got[workers], _ = run_repacked(cpu, cpu_backend, repack_buft(cpu), out, inputs_of(inputs))
    assert split_jobs == [kernel]  # bound as a job once, with the workers on
    return got["1"], got["0"]


@pytest.mark.parametrize("gtype, variant", CASES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("K_blocks, groups", [(8, 3), (32, 9), (3, 1)])
def test_mul_mat_one_column(cpu, cpu_backend, gtype, variant, K_blocks, groups, monkeypatch):
    monkeypatch.setenv("GGX_CPU_ISA", variant)
    lay = optimal_layout(gtype, 64, variant)
    K, M = K_blocks * gtype.block_size, groups * lay.nrows
    rng = np.random.default_rng(K + M)
    raw = quantize(rng.standard_normal((M, K)).astype(np.float32), gtype).reshape(-1)
    xv = rng.standard_normal((1, K)).astype(np.float32)

    def build():
        ctx = Context()
        w, x = ctx.tensor(gtype, (K, M), "w"), ctx.tensor(GType.F32, (K, 1), "x")
        return ctx.mul_mat(w, x), (w, x)

    kernel = tile_mm if has_tiles(lay.name, variant, M) and not has_register_gemv(lay) else repack_mm
    on, off = _both(cpu, cpu_backend, monkeypatch, build,
                    lambda t: {t[0]: raw, t[1]: xv.view(np.uint8).reshape(-1)}, kernel)
    np.testing.assert_array_equal(on, off)


def test_mul_mat_id_one_token(cpu, cpu_backend, monkeypatch):
    E, K, M = 4, 256, 24
    rng = np.random.default_rng(3)
    raw = quantize(rng.standard_normal((E, M, K)).astype(np.float32), GType.Q4_0).reshape(-1)
    xv = rng.standard_normal((1, 1, K)).astype(np.float32)
    idv = np.array([[3, 1]], np.int32)

    def build():
        ctx = Context()
        w = ctx.tensor(GType.Q4_0, (K, M, E), "w")
        x, ids = ctx.tensor(GType.F32, (K, 1, 1), "x"), ctx.tensor(GType.I32, (2, 1), "ids")
        return ctx.mul_mat_id(w, x, ids), (w, x, ids)

    on, off = _both(cpu, cpu_backend, monkeypatch, build, lambda t: {
        t[0]: raw, t[1]: xv.view(np.uint8).reshape(-1), t[2]: idv.view(np.uint8).reshape(-1)})
    np.testing.assert_array_equal(on, off)
