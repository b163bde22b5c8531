"""The real AMX path, executed: only where AMX is usable (CPU flags, OS tile state, the tile
permission granted to this process); skipped elsewhere with the reason. Everything it computes
is also checked without AMX: the same tiling loop and layout under the emulated engine
(test_amx_conformance.py, test_amx_buffer.py), the real kernels' assembly (test_amx_tiles.py)."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from amx_testing import amx_cases, mul_mat_graph, mul_mat_id_graph, run_in

from ggx import registry
from ggx.conformance import PASS, Suite
from ggx_amx.layout import FORMATS
from ggx_cpu.extension import amx_support

USABLE, WHY = amx_support()
pytestmark = pytest.mark.skipif(not USABLE, reason=f"AMX is not usable on this machine: {WHY}")
TYPES = sorted(FORMATS, key=lambda t: t.name)


@pytest.fixture(scope="module")
def amx_real(cpu):
    found = [b for b in registry.extra_buffer_types(cpu) if b.name == "AMX"]
    assert found, f"AMX is usable ({WHY}) but the CPU device has no AMX buffer type"
    return found[0]


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_real_tiles_give_the_emulated_bytes(cpu, amx_real, amx_cpu, amx_buft, gtype):
    """Integer tiles are exact, and the float code after them is the same: identical results."""
    backend = cpu.init_backend(n_threads=2)
    emu_backend = amx_cpu.init_backend(n_threads=2)
    K = 2 * gtype.block_size if gtype.block_size == 256 else 96
    for n in (1, 7, 40):  # a graph each: a run leaves its weights in that run's buffer type
        real = run_in(cpu, backend, amx_real, *mul_mat_graph(gtype, K, 64, n, seed=n))
        emulated = run_in(amx_cpu, emu_backend, amx_buft, *mul_mat_graph(gtype, K, 64, n, seed=n))
        assert np.array_equal(real, emulated), (gtype, n)
    id_graph = functools.partial(mul_mat_id_graph, gtype, K, 32, np.array([[1, 3], [3, 3], [0, 1]]), n_expert=4,
                                 b_ne1=1)
    assert np.array_equal(run_in(cpu, backend, amx_real, *id_graph()),
                          run_in(amx_cpu, emu_backend, amx_buft, *id_graph()))


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_real_amx_conformance(cpu, amx_real, gtype):
    suite = Suite(cpu, weight_buft=amx_real)
    report = suite.run(suite.items(types=[gtype]))
    assert report.ok and report.count(PASS) >= 1, [f"{r.id}: {r.message}" for r in report.failures]
    cases = amx_cases(gtype)
    report = suite.run(cases)
    assert report.count(PASS) == len(cases), [f"{r.id}: {r.message}" for r in report.results if r.status != PASS]
