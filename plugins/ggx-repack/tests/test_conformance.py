"""The conformance suite's MUL_MAT / MUL_MAT_ID cases (generated and ggml golden) with the
weights in CPU_REPACK: every layout, every ISA variant this machine can run, against the
reference backend with each case's own tolerance."""
from __future__ import annotations

import pytest
from repack_testing import repack_buft, run_repacked

from ggx import registry
from ggx.conformance.cases import op_cases
from ggx.conformance.golden import golden_cases
from ggx.conformance.harness import compare, execute
from ggx.conformance.runner import select
from ggx_cpu import isa
from ggx_repack.layouts import ENV_FORCE, LAYOUTS

CASES = [c for c in select(op_cases() + golden_cases(), ["MUL_MAT", "MUL_MAT_ID"]) if c.expect_error is None]


@pytest.fixture(scope="module")
def oracle():
    ref = registry.get_device("ref")
    backend = ref.init_backend()
    cache: dict[str, object] = {}

    def values(case):
        if case.name not in cache:
            run = execute(ref, backend, case.make())
            assert not run.problems, run.problems
            cache[case.name] = case.expected() if case.expected is not None else run.values
        return cache[case.name]

    return values


@pytest.mark.parametrize("variant", isa.available())
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_conformance_matmul_cases(layout, variant, cpu, cpu_backend, oracle, monkeypatch):
    monkeypatch.setenv("GGX_CPU_ISA", variant)
    monkeypatch.setenv(ENV_FORCE, layout)
    lay = LAYOUTS[layout]
    buft = repack_buft(cpu)
    repacked, failures = 0, []
    for case in CASES:
        if lay.gtype not in case.types:
            continue
        b = case.make()
        got, weights = run_repacked(cpu, cpu_backend, buft, b.out, b.inputs)
        repacked += bool(weights)
        ok, err, msg = compare(got, oracle(case), case.tol)
        if not ok:
            failures.append(f"{case.name}: {msg}")
    assert not failures, failures
    assert repacked >= 5, f"only {repacked} cases put their weights in {layout}"
