"""The conformance suite's MUL_MAT / MUL_MAT_ID cases (generated and ggml golden) with the
weights in CPU_REPACK (the suite's weight buffer type mode): every layout, every ISA variant this
machine can run, against the reference backend with each case's own tolerance."""
from __future__ import annotations

import pytest

from ggx.conformance import PASS, Suite
from ggx_cpu import isa
from ggx_repack.layouts import ENV_FORCE, LAYOUTS, runs_on


@pytest.fixture(scope="module")
def suite(cpu):
    """One suite for every layout and variant: the reference results are computed once."""
    return Suite(cpu, weight_buft="CPU_REPACK")


@pytest.mark.parametrize("layout, variant", [(lay, v) for lay in sorted(LAYOUTS) for v in isa.available()
                                             if runs_on(LAYOUTS[lay], v)])
def test_conformance_matmul_cases(layout, variant, suite, monkeypatch):
    monkeypatch.setenv("GGX_CPU_ISA", variant)
    monkeypatch.setenv(ENV_FORCE, layout)
    report = suite.run(suite.items(types=[LAYOUTS[layout].gtype]))
    assert report.ok, [f"{r.id}: {r.message}" for r in report.failures]
    # a pass is a case whose weights were all in CPU_REPACK; a weight it refuses makes a skip
    assert report.count(PASS) >= 5, f"only {report.count(PASS)} cases put their weights in {layout}"
