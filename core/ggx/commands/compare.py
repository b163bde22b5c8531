"""`ggx compare MODEL -b A -b B`: one model's graphs on two backends, node by node (ggx.compare).

    ggx compare [MODEL] -b ref -b CPU:CPU_REPACK [--layers N] [-n STEPS] [-p PROMPT] [-o json]
    ggx compare [MODEL] -b CUDA0 --graphs on,off      # graph capture on vs off: bit-identical

A backend is `DEVICE` (weights in the device's own memory) or `DEVICE:BUFT` (weights offered
that extra buffer type first): ref, CPU, CPU:CPU_REPACK, CPU:AMX, RAY0, CUDA0. One -b compares
it against `ref`. Prints per step the worst isolated node, the first node beyond its op's
tolerance (op, types, shapes, strides, views, and its inputs' agreement), where B's own run
parts from A's, and the teacher-forced logits by the model criteria; `-o json` prints all of it,
every node included. Progress goes to stderr. Exit status: 0 when the backends agree, 1 when not.
"""
from __future__ import annotations

import argparse
import json
import sys

from .argtypes import int_at_least, utf8_text
from .run import add_model_argument, chosen_model

_GRAPH_PAIRS = {"on,off", "off,on", "on|off", "off|on", "on/off"}


def graphs_pair(text: str) -> str:
    if text.replace(" ", "").lower() not in _GRAPH_PAIRS:
        raise argparse.ArgumentTypeError(f"expected on,off (capture on against off), got {text!r}")
    return "on,off"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("compare", help="compare two backends node by node on a model's graphs",
                              description="Run a model's graphs (a prompt, then decode steps) on two backends and "
                                          "compare every node (accumulated and isolated NMSE against the op's "
                                          "tolerance) and the teacher-forced logits.")
    add_model_argument(p)
    p.add_argument("-b", "--backend", action="append", default=[], metavar="BACKEND",
                   help="DEVICE or DEVICE:BUFT, e.g. ref, CPU, CPU:CPU_REPACK, CPU:AMX, CUDA0; give A then B "
                        "(one: B against ref)")
    p.add_argument("--layers", type=int_at_least(1), default=None, metavar="N",
                   help="cut the model to its first N layers (a fast check on the model's own shapes)")
    p.add_argument("-p", "--prompt", type=utf8_text, default=None, help="the prompt (default: a short sentence)")
    p.add_argument("-n", "--n-decode", type=int_at_least(0), default=None, metavar="STEPS",
                   help="decode steps after the prompt, each fed A's argmax (default 4)")
    p.add_argument("-c", "--ctx-size", type=int_at_least(16), default=None, metavar="N",
                   help="context length (default 256: small caches to copy per attention node)")
    p.add_argument("--no-isolated", action="store_true", help="skip the isolated recomputation of each node")
    p.add_argument("--graphs", nargs="?", const="on,off", type=graphs_pair, default=None, metavar="on,off",
                   help="also compare B with itself, graph capture (CUDA graphs) on against off: must be "
                        "bit-identical; with one -b only this runs")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..compare import compare_model
    from ..compare.model import DEFAULT_DECODE, DEFAULT_N_CTX, DEFAULT_PROMPT
    from ..errors import GGXValueError

    backends = args.backend
    if len(backends) > 2:
        raise GGXValueError(f"compare takes one or two -b, got {len(backends)}")
    if not backends:
        raise GGXValueError("name the backend to compare: -b DEVICE[:BUFT] (twice for A and B; once: against ref)")
    graphs = args.graphs is not None
    if len(backends) == 1:
        a, b = (backends[0], backends[0]) if graphs else ("ref", backends[0])
    else:
        a, b = backends
    err = Console(stderr=True, highlight=False)
    status = err.status("starting") if err.is_terminal else None

    shown = []

    def progress(text: str) -> None:  # a spinner on a terminal, else a line per phase ("decode step 2/4")
        if status is not None:
            status.update(text)
            return
        phase = text.split(": ")[0]
        if not shown or shown[-1] != phase:
            shown.append(phase)
            err.print(phase)

    if status is not None:
        status.start()
    try:
        report = compare_model(chosen_model(args), a, b, args.prompt or DEFAULT_PROMPT,
                               DEFAULT_DECODE if args.n_decode is None else args.n_decode, args.layers,
                               args.ctx_size or DEFAULT_N_CTX, not args.no_isolated, graphs, progress)
    finally:
        if status is not None:
            status.stop()
    if args.output == "json":
        json.dump(report.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print("\n".join(report.summary()))
    return 0 if report.ok else 1
