"""ggx.conformance: the suite every plugin passes (ggml's test-backend-ops, for ggx).

- `cases.op_cases()`: op cases (op x types x shapes x params) checked against the reference
  backend by normalized mean squared error, with a threshold and its reason per op and type;
- `golden.golden_cases()`: ggml's own op outputs, checked against the backend under test;
- `contract.CHECKS`: buffer, stream, event and error contracts, independent of ops;
- `runner.Suite`: runs them in eval, perf and support modes (`ggx test-ops`, `-p ggx.testing`).
"""
from .case import Builder, OpCase, Tolerance
from .cases import op_cases, perf_cases
from .golden import golden_cases
from .runner import FAIL, PASS, SKIP, Report, Result, Suite, item_id, select

__all__ = ["Builder", "FAIL", "OpCase", "PASS", "Report", "Result", "SKIP", "Suite", "Tolerance", "golden_cases",
           "item_id", "op_cases", "perf_cases", "select"]
