"""The conformance suite's weight-buffer-type mode with the weights in AMX_EMULATED (the real
tiling loop and layout, tile instructions modeled): the suite's own MUL_MAT / MUL_MAT_ID cases
(generated and ggml golden; most have row counts AMX refuses, which are skips), and the same kind
of cases at AMX's shapes (rows a multiple of 32), every one of which must pass. Each case is judged
against the reference backend with the core's tolerance for its op and type."""
from __future__ import annotations

import pytest
from amx_testing import amx_cases

from ggx.conformance import PASS, SKIP, Suite
from ggx_amx.layout import FORMATS

TYPES = sorted(FORMATS, key=lambda t: t.name)


@pytest.fixture(scope="module")
def suite(amx_cpu, amx_buft):
    return Suite(amx_cpu, weight_buft=amx_buft)


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_the_suite_s_matmul_cases(suite, gtype):
    report = suite.run(suite.items(types=[gtype]))
    assert report.ok, [f"{r.id}: {r.message}" for r in report.failures]
    assert report.count(PASS) >= 1, report.summary()
    # a skip is AMX's refusal of the weight (rows not a multiple of 32, a 3-D MUL_MAT weight) or a
    # weight that is a view (which no weight buffer type holds)
    odd = [r for r in report.results if r.status == SKIP
           and "AMX_EMULATED refuses" not in r.message and "not a whole leaf tensor" not in r.message]
    assert not odd, odd


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_amx_shaped_cases_all_pass(suite, gtype):
    cases = amx_cases(gtype)
    report = suite.run(cases)
    assert report.count(PASS) == len(cases), [f"{r.id}: {r.status} {r.message}" for r in report.results
                                              if r.status != PASS]


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_the_suite_s_mul_mat_id_cases_of_amx_shapes_pass(suite, gtype):
    """`ggx test-ops --buft AMX -o MUL_MAT_ID`: the suite's MUL_MAT_ID cases with 32 rows per expert
    (one per ids pattern: repeated, unused, all and decode experts) run on AMX and pass; the others
    (16 rows, ggml's golden shapes) are AMX's refusal."""
    report = suite.run(suite.items(ops=["MUL_MAT_ID"], types=[gtype]))
    assert report.ok, [f"{r.id}: {r.message}" for r in report.failures]
    passed = [r.id for r in report.results if r.status == PASS]
    assert len(passed) >= 4 and all("m=32" in i for i in passed), report.summary()
    skipped = [r for r in report.results if r.status == SKIP]  # 16 rows, ggml's golden shapes
    assert all("m=32" not in r.id and "AMX_EMULATED refuses" in r.message for r in skipped), skipped
