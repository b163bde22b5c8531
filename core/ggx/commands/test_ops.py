"""`ggx test-ops`: the conformance suite from the command line (ggml's test-backend-ops).

    ggx test-ops [-b BACKEND]... [-o OP]... [-t TYPE]... [--buft BUFT] [--mode eval|perf|support]

eval (default): runs op cases, ggml's golden outputs and contract checks; prints one line per
failure, the skipped ("not supported") cases per op, the device's own tolerance bounds where they
differ from the core table, and closes with `DEVICE (description): N passed, N failed, N skipped`
per device; the exit status is 1 when anything failed.
--buft NAME: only the MUL_MAT / MUL_MAT_ID cases, their weights in that extra buffer type of the
device (e.g. CPU_REPACK); an unknown name lists the device's extra buffer types.
perf: times the perf cases, GFLOPS or GB/s per case; with two -b, both side by side and their ratio.
support: the op x type matrix of what each backend's supports_op accepts.
--model [MODEL]: model mode instead of the op cases (ggx.conformance.model): the model (default:
the default model, cut to --model-layers layers) through each backend against the reference,
node by node; fails on a node beyond its op's tolerance or logits outside the model criteria.
Without -b, every device except the reference runs (the reference alone when it is the only one).
"""
from __future__ import annotations

import argparse
import sys

from .argtypes import finite_float, int_at_least


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("test-ops", help="run the conformance suite against backends",
                              description="Run the conformance suite (op cases, ggml golden outputs, contract "
                                          "checks) against one or more backends.")
    p.add_argument("-b", "--backend", action="append", default=[], metavar="BACKEND",
                   help="device to test (repeatable; default: every device but the reference)")
    p.add_argument("-o", "--op", action="append", default=[], metavar="OP",
                   help="only this op, e.g. MUL_MAT, GELU_ERF, CONTRACT (repeatable, or comma-separated)")
    p.add_argument("-t", "--type", action="append", default=[], metavar="TYPE",
                   help="only cases involving this type, e.g. q4_0 (repeatable, or comma-separated)")
    p.add_argument("--buft", metavar="BUFT",
                   help="put the weights of MUL_MAT / MUL_MAT_ID cases in this extra buffer type of the device "
                        "(e.g. CPU_REPACK); only those cases run")
    p.add_argument("--mode", choices=("eval", "perf", "support"), default="eval")
    p.add_argument("--min-time", type=finite_float(0.0, low_open=True), default=0.25, metavar="S",
                   help="perf: seconds to time each case")
    p.add_argument("-v", "--verbose", action="store_true", help="eval: also print passing and skipped cases")
    p.add_argument("--model", nargs="?", const="", default=None, metavar="MODEL",
                   help="model mode: run a model (default: the default model) through the backend against the "
                        "reference, node by node, instead of the op cases")
    p.add_argument("--model-layers", type=int_at_least(0), default=None, metavar="N",
                   help="model mode: cut the model to its first N layers (default 2; 0: the whole model)")
    p.add_argument("--model-steps", type=int_at_least(0), default=None, metavar="N",
                   help="model mode: decode steps after the prompt (default 1)")
    p.set_defaults(func=run)


def _split(values: list[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _devices(names: list[str]):
    from .. import registry

    if names:
        return [registry.get_device(n) for n in names]
    devs = [d for d in registry.devices() if d.name != "ref"]
    return devs or [registry.get_device("ref")]


def _progress(console, total: int, label: str):
    """A rich progress bar on a terminal for runs of more than a few cases, else nothing."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not console.is_terminal or total < 20:
        return None
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    transient=True)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..conformance import Suite
    from ..errors import GGXError
    from ..types import GType

    ops, types = _split(args.op), _split(args.type)
    try:
        types = [GType.parse(t) for t in types]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    devices = _devices(args.backend)  # an unknown device is a GGXError: the CLI prints it
    try:
        suites = [Suite(d, weight_buft=args.buft) for d in devices]
    except GGXError as e:
        print(f"error: --buft {args.buft}: {e}", file=sys.stderr)
        return 2
    out, err = Console(highlight=False), Console(stderr=True, highlight=False)
    if args.model is not None:
        return _model(devices, args, out, err)
    if args.mode == "perf":
        return _perf(suites, ops, types, args.min_time, out, err)
    if args.mode == "support":
        return _support(suites, ops, types, out)
    return _eval(suites, ops, types, args.verbose, out, err)


def _eval(suites, ops, types, verbose: bool, out, err) -> int:
    from rich.markup import escape

    from ..conformance.runner import FAIL, PASS, SKIP, Report

    totals: list[Report] = []
    for suite in suites:
        items = suite.items(ops or None, types or None)
        if not items:
            err.print(f"error: no cases match -o {','.join(ops) or '*'} -t {','.join(t.name for t in types) or '*'}")
            return 2
        bar = _progress(err, len(items), f"{suite.device.name}")
        task = bar.add_task("run", total=len(items)) if bar is not None else None

        def show(r, bar=bar, task=task):
            if r.status == FAIL:
                out.print(f"[red]FAIL[/] {escape(r.id)}: {escape(r.message)}", soft_wrap=True)
            elif verbose:
                tag = "[green]ok[/]  " if r.status == PASS else "[yellow]skip[/]"
                out.print(f"{tag} {escape(r.id)}" + (f": {escape(r.message)}" if r.message else ""), soft_wrap=True)
            if bar is not None:
                bar.advance(task)

        if bar is not None:
            with bar:
                report = suite.run(items, show)
        else:
            report = suite.run(items, show)
        for line in report.details():
            out.print(escape(line), soft_wrap=True)
        out.print(escape(report.summary()), soft_wrap=True)
        totals.append(report)
    failed = sum(r.count(FAIL) for r in totals)
    if len(totals) > 1:
        passed, skipped = (sum(r.count(s) for r in totals) for s in (PASS, SKIP))
        out.print(f"all: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


def _model(devices, args, out, err) -> int:
    from rich.markup import escape

    from ..conformance.model import MODEL_LAYERS, MODEL_STEPS, model_check
    from ..conformance.runner import FAIL

    layers = MODEL_LAYERS if args.model_layers is None else (args.model_layers or None)
    steps = MODEL_STEPS if args.model_steps is None else args.model_steps
    failed = 0
    for d in devices:
        status = err.status(f"{d.name}: model") if err.is_terminal else None
        if status is not None:
            status.start()
        try:
            result, report = model_check(d, args.buft, args.model or None, layers, steps,
                                         status.update if status is not None else None)
        finally:
            if status is not None:
                status.stop()
        if args.verbose or result.status == FAIL:
            for line in report.summary():
                out.print(escape(line), soft_wrap=True)
        failed += result.status == FAIL
        tag = "[red]FAIL[/]" if result.status == FAIL else "[green]ok[/]"
        out.print(f"{tag} {escape(d.name)}{escape(':' + args.buft) if args.buft else ''} {escape(result.id)}: "
                  f"{escape(result.message.splitlines()[0] if result.message else '')}", soft_wrap=True)
    return 1 if failed else 0


def _perf(suites, ops, types, min_time: float, out, err) -> int:
    from rich.markup import escape
    from rich.table import Table

    from ..conformance import perf_cases, select
    from ..conformance.runner import FAIL, PASS

    cases = suites[0].applicable(select(perf_cases(), ops or None, types or None))
    if not cases:
        err.print("error: no perf cases match")
        return 2
    if len(suites) > 2:
        err.print("error: perf compares at most two backends")
        return 2
    table = Table(title="perf", title_justify="left")
    table.add_column("case")
    for s in suites:
        table.add_column(s.device.name, justify="right")
    if len(suites) == 2:
        table.add_column(f"{suites[1].device.name} / {suites[0].device.name}", justify="right")
    failed = 0
    bar = _progress(err, len(cases) * len(suites), "perf")
    if bar is not None:
        bar.start()
        task = bar.add_task("perf", total=len(cases) * len(suites))
    for c in cases:
        cells, rates = [], []
        for s in suites:
            r = s.perf(c, min_time=min_time)
            if bar is not None:
                bar.advance(task)
            if r.status == PASS:
                value, unit = r.rate
                cells.append(f"{value:.2f} {unit}")
                rates.append(value)
            else:
                failed += r.status == FAIL
                cells.append("not supported" if r.status != FAIL else f"[red]error[/]: {escape(r.message)}")
                rates.append(None)
        if len(suites) == 2:
            ok = bool(rates[0]) and rates[1] is not None
            cells.append(f"{rates[1] / rates[0]:.2f}x" if ok else "-")
        table.add_row(escape(c.name), *cells)
    if bar is not None:
        bar.stop()
    out.print(table)
    return 1 if failed else 0


def _support(suites, ops, types, out) -> int:
    from rich.table import Table

    from ..conformance import golden_cases, op_cases, select

    cases = select(op_cases() + golden_cases(), ops or None, types or None)
    for s in suites:
        matrix = s.support(s.applicable(cases))
        cols = sorted({t for row in matrix.values() for t in row}, key=_type_order)
        # no outer edge and no wrapped op names: a column per type still fits 80 columns
        table = Table(title=f"{s.label}: supports_op over the suite's cases", title_justify="left", show_edge=False)
        table.add_column("op", no_wrap=True)
        for t in cols:
            table.add_column(t.lower().replace("_k", "_K"), justify="center")
        for op in sorted(matrix):
            row = []
            for t in cols:
                yes, n = matrix[op].get(t, (0, 0))
                row.append("" if n == 0 else "[green]yes[/]" if yes == n else "[red]no[/]" if yes == 0
                           else f"[yellow]{yes}/{n}[/]")
            table.add_row(op, *row)
        out.print(table)
    return 0


def _type_order(name: str) -> int:
    from ..types import GType

    return list(GType.__members__).index(name) if name in GType.__members__ else 99
