"""The suite runner: eval, perf and support modes over op cases, golden cases and contract checks.

    suite = Suite("cpu")                      # the device under test; the oracle is "ref"
    report = suite.run(suite.items(ops=["MUL_MAT"]))
    print(report.summary())                   # "CPU (...): N passed, N failed, N skipped"

"Not supported" (supports_op says no for a node of the case) is a skip, never a pass, and is
counted per op. Any exception while computing a case the device said it supports is a failure.

`Suite(device, weight_buft="CPU_REPACK")` runs the MUL_MAT / MUL_MAT_ID cases with their weights
in that extra buffer type of the device (a case whose weight the buffer type refuses is a skip).
A device's own NMSE bounds (`Device.max_nmse_err`) replace the core table's for its cases; each
one that differs is listed in the report (`Report.details()`), never applied silently.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .. import registry
from ..backend import Backend, BufferType, Device
from ..eager import resolve_device
from ..errors import GGXError, GGXPluginError, GGXUnsupported
from ..graph import Graph, build_graph
from ..ops import Op
from ..types import GType
from .case import OpCase, Tolerance, type_name
from .cases import op_cases
from .contract import CHECKS
from .golden import golden_cases
from .harness import WEIGHT_OPS, compare, execute, prepare, unsupported_nodes, weights_refused

PASS, FAIL, SKIP = "pass", "fail", "skip"
CONTRACT = "CONTRACT"


@dataclass(frozen=True)
class Check:
    """A contract check as a suite item."""

    name: str
    fn: Callable[[Device, Backend], str] = field(compare=False)

    @property
    def op_name(self) -> str:
        return CONTRACT

    @property
    def source(self) -> str:
        return "contract"

    @property
    def id(self) -> str:
        return f"contract:{self.name}"


Item = OpCase | Check


def item_id(item: Item) -> str:
    """A readable, unique id: the case name ("MUL_MAT(type_a=q4_0,...)") or "contract:<check>"."""
    return item.id if isinstance(item, Check) else item.name


@dataclass(frozen=True)
class ToleranceOverride:
    """A device's NMSE bound (`Device.max_nmse_err`) that a case was judged by instead of the core
    table's."""

    op: str  # as printed ("MUL_MAT", "GELU_ERF")
    gtype: GType | None  # the case's characteristic type
    core: float
    device: float
    reason: str

    def __str__(self) -> str:
        t = type_name(self.gtype) if self.gtype is not None else "-"
        return f"{self.op} {t}: {self.core:g} -> {self.device:g} ({self.reason})"


@dataclass
class Result:
    id: str
    op: str  # the op as printed ("MUL_MAT", "GELU_ERF"), or "CONTRACT"
    status: str
    message: str = ""
    nmse: float | None = None
    source: str = "ggx"  # "ggx" (reference oracle), "ggml" (golden data) or "contract"
    override: ToleranceOverride | None = None  # the device's bound this result was judged by


@dataclass
class Report:
    device: str
    results: list[Result]
    label: str = ""  # the device as printed: "CPU (AMD EPYC ...)"; default: its name

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status == FAIL]

    def skipped_by_op(self) -> dict[str, int]:
        return dict(Counter(r.op for r in self.results if r.status == SKIP))

    def tolerance_overrides(self) -> list[ToleranceOverride]:
        """The device's own bounds the results were judged by, each once, in run order."""
        return list(dict.fromkeys(r.override for r in self.results if r.override is not None))

    @property
    def ok(self) -> bool:
        return not self.failures

    def counts(self) -> str:
        return f"{self.count(PASS)} passed, {self.count(FAIL)} failed, {self.count(SKIP)} skipped"

    def summary(self) -> str:
        """One line naming the device: "CPU (AMD EPYC ...): N passed, N failed, N skipped"."""
        return f"{self.label or self.device}: {self.counts()}"

    def details(self) -> list[str]:
        """The lines printed before the summary: skips per op, then each tolerance override."""
        lines = []
        skipped = self.skipped_by_op()
        if skipped:
            listed = ", ".join(f"{op} {n}" for op, n in sorted(skipped.items()))
            lines.append(f"{self.device}: skipped (not supported): {listed}")
        lines += [f"{self.device}: tolerance override {o}" for o in self.tolerance_overrides()]
        return lines


@dataclass
class PerfResult:
    id: str
    op: str
    status: str  # PASS (timed), SKIP (not supported), FAIL (raised)
    seconds: float = 0.0  # per graph_compute + synchronize
    runs: int = 0
    flops: int = 0
    nbytes: int = 0
    message: str = ""

    @property
    def rate(self) -> tuple[float, str]:
        """(value, unit): GFLOPS for matrix products and attention, else GB/s moved."""
        if self.seconds <= 0:
            return 0.0, ""
        if self.flops:
            return self.flops / self.seconds / 1e9, "GFLOPS"
        return self.nbytes / self.seconds / 1e9, "GB/s"


def select(cases: Iterable[OpCase], ops: Sequence[str] | None = None,
           types: Sequence[GType | str] | None = None) -> list[OpCase]:
    """Cases of the named ops (Op name or printed label, any case) involving any of the types."""
    want_ops = {o.upper() for o in ops} if ops else None
    want_types = {GType.parse(t) for t in types} if types else None
    out = []
    for c in cases:
        if want_ops is not None and c.op.name not in want_ops and c.op_name.upper() not in want_ops:
            continue
        if want_types is not None and not want_types & set(c.types):
            continue
        out.append(c)
    return out


def graph_cost(graph) -> tuple[int, int]:
    """(flops, bytes) of a graph: 2*K per output of a product, 4*D*n_kv per attention row, and
    the bytes each kernel reads and writes (for bandwidth-bound ops)."""
    flops = nbytes = 0
    for n in graph.nodes:
        if n.op.is_view:
            continue
        nbytes += n.nbytes + sum(s.nbytes for s in n.src)
        if n.op in (Op.MUL_MAT, Op.MUL_MAT_ID):
            flops += 2 * n.src[0].ne[0] * n.nelements
        elif n.op is Op.FLASH_ATTN_EXT:
            q, k = n.src[0], n.src[1]
            flops += 4 * q.ne[0] * k.ne[1] * q.ne[1] * q.ne[2] * q.ne[3]
    return flops, nbytes


def weight_buffer_type(device: Device, buft: BufferType | str) -> BufferType:
    """`buft`, or the device's extra buffer type of that name; GGXPluginError lists the device's
    extra buffer types when there is none of that name."""
    if isinstance(buft, str):
        bufts = registry.extra_buffer_types(device)
        found = [b for b in bufts if b.name.upper() == buft.upper()]
        if not found:
            names = ", ".join(b.name for b in bufts) or "none"
            raise GGXPluginError(f"device {device.name} has no extra buffer type {buft!r} "
                                 f"(its extra buffer types: {names})")
        return found[0]
    if not device.supports_buft(buft):
        raise GGXUnsupported(f"device {device.name} cannot compute from buffer type {buft.name}")
    return buft


class Suite:
    """The conformance suite against one device, with the reference backend as oracle.

    `weight_buft` (a buffer type, or the name of one of the device's extra buffer types): run the
    MUL_MAT / MUL_MAT_ID cases only, with their weights in that buffer type.
    """

    def __init__(self, device: Device | str, oracle: Device | str = "ref",
                 weight_buft: BufferType | str | None = None):
        self.device = resolve_device(device)
        self.oracle = resolve_device(oracle)
        self.weight_buft = None if weight_buft is None else weight_buffer_type(self.device, weight_buft)
        self._backends: dict[int, Backend] = {}
        self._oracle_cache: dict[str, np.ndarray] = {}  # case name -> values (a case's data is fixed)

    @property
    def label(self) -> str:
        """The device as the report names it: "CPU (AMD EPYC ...), weights in CPU_REPACK"."""
        d = self.device
        text = f"{d.name} ({d.description})" if d.description else d.name
        return text + (f", weights in {self.weight_buft.name}" if self.weight_buft is not None else "")

    def backend(self, device: Device) -> Backend:
        be = self._backends.get(id(device))
        if be is None:
            be = self._backends[id(device)] = device.init_backend()
        return be

    # --- what to run ----------------------------------------------------------------------------
    def items(self, ops: Sequence[str] | None = None, types: Sequence[GType | str] | None = None,
              golden: bool = True, contracts: bool = True) -> list[Item]:
        cases = op_cases() + (golden_cases() if golden else [])
        items: list[Item] = list(self.applicable(select(cases, ops, types)))
        want_contracts = (contracts and self.weight_buft is None and not types
                          and (not ops or CONTRACT in {o.upper() for o in ops}))
        if want_contracts:
            items += [Check(name, fn) for name, fn in CHECKS.items()]
        return items

    def applicable(self, cases: Iterable[OpCase]) -> list[OpCase]:
        """The cases this suite runs: all, or with a weight buffer type those that compute a
        MUL_MAT / MUL_MAT_ID (not the ones refused at build time)."""
        if self.weight_buft is None:
            return list(cases)
        return [c for c in cases if c.op in WEIGHT_OPS and c.expect_error is None]

    def skip_reason(self, graph: Graph) -> str | None:
        """Why the built case cannot run here (None: it can): a node the device does not support,
        or a weight the weight buffer type refuses."""
        missing = unsupported_nodes(self.device, graph)
        if missing:
            return "not supported: " + ", ".join(f"{n.op.name} {n.describe()}" for n in missing)
        return weights_refused(self.weight_buft, graph) if self.weight_buft is not None else None

    def tolerance(self, case: OpCase) -> tuple[Tolerance, ToleranceOverride | None]:
        """The case's threshold on this device: the core table's, or the device's own NMSE bound
        (`Device.max_nmse_err`, asked only for NMSE-judged cases) with the override to report."""
        core = case.tol
        if core.kind != "nmse":
            return core, None
        gtype = case.types[0] if case.types else None
        answer = self.device.max_nmse_err(case.op, gtype, core.max_nmse)
        if answer is None:
            return core, None
        try:
            bound, reason = answer
            ok = isinstance(bound, int | float) and math.isfinite(bound) and bound >= 0
            ok = ok and isinstance(reason, str) and bool(reason.strip())
        except (TypeError, ValueError):
            ok = False
        if not ok:
            t = type_name(gtype) if gtype is not None else None
            raise GGXPluginError(f"device {self.device.name}: max_nmse_err({case.op.name}, {t}) returned "
                                 f"{answer!r}; expected None or (a finite bound >= 0, a reason)")
        if bound == core.max_nmse:
            return core, None
        override = ToleranceOverride(case.op_name, gtype, core.max_nmse, float(bound), reason)
        return Tolerance(float(bound), f"{self.device.name}: {reason}"), override

    # --- eval -------------------------------------------------------------------------------------
    def run_item(self, item: Item) -> Result:
        if isinstance(item, Check):
            return self.run_check(item)
        return self.run_case(item)

    def run_check(self, check: Check) -> Result:
        try:
            note = check.fn(self.device, self.backend(self.device))
        except Exception as e:  # a contract failure or anything the device raised
            return Result(check.id, CONTRACT, FAIL, f"{type(e).__name__}: {e}", source="contract")
        return Result(check.id, CONTRACT, PASS, note, source="contract")

    def run_case(self, case: OpCase) -> Result:
        def result(status: str, message: str = "", err: float | None = None,
                   override: ToleranceOverride | None = None) -> Result:
            return Result(case.name, case.op_name, status, message, err, case.source, override)

        try:
            b = case.make()
        except Exception as e:
            if case.expect_error is not None and isinstance(e, case.expect_error):
                return result(PASS, f"refused at build time: {e}")
            return result(FAIL, f"building the graph raised {type(e).__name__}: {e}")
        if case.expect_error is not None:
            return result(FAIL, f"the graph was accepted; expected {case.expect_error.__name__} at build time")
        graph = build_graph(b.out)
        why = self.skip_reason(graph)
        if why is not None:
            return result(SKIP, why)
        try:
            tol, override = self.tolerance(case)
        except GGXError as e:
            return result(FAIL, str(e))
        try:
            run = execute(self.device, self.backend(self.device), b.out, b.inputs, graph, self.weight_buft)
        except Exception as e:
            return result(FAIL, f"supports_op said yes, but computing raised {type(e).__name__}: {e}")
        try:
            expected = case.expected() if case.expected is not None else self._oracle_values(case)
        except Exception as e:
            return result(FAIL, f"oracle: {type(e).__name__}: {e}")
        ok, err, msg = compare(run.values, expected, tol)
        problems = run.problems + ([] if ok else [msg])
        return result(FAIL if problems else PASS, "; ".join(problems), err, override)

    def _oracle_values(self, case: OpCase) -> np.ndarray:
        values = self._oracle_cache.get(case.name)
        if values is None:
            b = case.make()
            run = execute(self.oracle, self.backend(self.oracle), b.out, b.inputs)
            if run.problems:
                raise GGXError("the reference backend failed its own checks: " + "; ".join(run.problems))
            values = self._oracle_cache[case.name] = run.values
        return values

    def run(self, items: Iterable[Item], progress: Callable[[Result], None] | None = None) -> Report:
        results = []
        for item in items:
            r = self.run_item(item)
            results.append(r)
            if progress is not None:
                progress(r)
        return Report(self.device.name, results, self.label)

    # --- perf -------------------------------------------------------------------------------------
    def perf(self, case: OpCase, min_time: float = 0.25, max_runs: int = 1000) -> PerfResult:
        """Time graph_compute + synchronize (after one warm-up run) until `min_time` has passed."""
        b = case.make()
        graph = build_graph(b.out)
        flops, nbytes = graph_cost(graph)
        res = PerfResult(case.name, case.op_name, PASS, flops=flops, nbytes=nbytes)
        why = self.skip_reason(graph)
        if why is not None:
            res.status, res.message = SKIP, why
            return res
        backend = self.backend(self.device)
        try:
            prepare(self.device, b.out, b.inputs, graph, self.weight_buft)
            backend.graph_compute(graph)
            backend.synchronize()
            runs, start = 0, time.perf_counter()
            while True:
                backend.graph_compute(graph)
                backend.synchronize()
                runs += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_time or runs >= max_runs:
                    break
        except Exception as e:
            res.status, res.message = FAIL, f"{type(e).__name__}: {e}"
            return res
        res.seconds, res.runs = elapsed / runs, runs
        return res

    # --- support ----------------------------------------------------------------------------------
    def support(self, cases: Iterable[OpCase]) -> dict[str, dict[str, tuple[int, int]]]:
        """op -> type -> (cases supported, cases) by supports_op, over the cases' characteristic type."""
        table: dict[str, dict[str, list[int]]] = {}
        for c in cases:
            if c.expect_error is not None:
                continue
            b = c.make()
            ok = self.skip_reason(build_graph(b.out)) is None
            cell = table.setdefault(c.op_name, {}).setdefault(c.types[0].name if c.types else "-", [0, 0])
            cell[0] += ok
            cell[1] += 1
        return {op: {t: (v[0], v[1]) for t, v in row.items()} for op, row in table.items()}
