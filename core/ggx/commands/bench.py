"""`ggx bench MODEL -p 512 -n 128 -t 1,2 [-r 5]`: llama-bench's table for ggx.

Tests, as llama-bench runs them: ppN evaluates N random tokens as one batch on an empty cache
(logits of the last one only); tgN generates N tokens one at a time from an empty cache. Each
test first runs once (the warm-up: kernels compiled or loaded, launches bound, buffers
allocated), then `-r` timed repetitions; a repetition that compiled a kernel all the same is run
again, and the garbage collector waits outside the timed part (as `timeit` does). The table
shows mean ± std tokens/s; `-o json` prints the same as a JSON list with llama-bench's field
names (avg_ts, stddev_ts, samples_ts, n_prompt, n_gen, n_threads), for scripts, plus first_ts:
the tokens/s of that first run, what a prompt of a length the process has not run before costs
(its graph built, planned and bound then, unless loading prepared it). After the table, as
`benchmarks/vs_llamacpp.py` measures a process that loads the file and computes one token:
"start", the seconds from the process's start (the interpreter's included) to the model loaded
and one token computed, where the load's time went, and the process's peak resident memory at
the end (JSON: start_s, load_s, load_split, peak_rss_bytes in every record). With
`--profile`, where the time of a decode step goes: graph building, the scheduler's planning and
input copies, the backends' compute (kernels), and the rest (Python around them).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import numpy as np

from .argtypes import int_at_least, int_list_at_least
from .run import add_model_argument, add_override_tensor, add_tensor_split, chosen_model

#: extra runs a test may take to replace repetitions that compiled a kernel
MAX_RETRIES = 3
#: std / mean above which the table is followed by a note on why the runs may differ
NOISY = 0.10


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="llama-bench style prompt/generation throughput",
                              description="Measure prompt processing (pp) and generation (tg) tokens/s.")
    add_model_argument(p)
    p.add_argument("-p", "--n-prompt", type=int_list_at_least(0), default=[512],
                   help="prompt lengths, e.g. 128,512; 0 skips the pp test (default 512)")
    p.add_argument("-n", "--n-gen", type=int_list_at_least(0), default=[128],
                   help="generation lengths; 0 skips the tg test (default 128)")
    p.add_argument("-t", "--threads", type=int_list_at_least(1), default=None,
                   help="thread counts, e.g. 1,2 (default: the backend's)")
    p.add_argument("-r", "--repetitions", type=int_at_least(1), default=5,
                   help="timed repetitions per test (default 5)")
    p.add_argument("--device", action="append", default=None, metavar="D", help="device (repeatable)")
    add_tensor_split(p)
    add_override_tensor(p)
    p.add_argument("--no-flash-attn", action="store_true", help="use mul_mat + soft_max attention")
    p.add_argument("--no-mmap", action="store_true",
                   help="copy every weight instead of mapping the plain-memory ones from the file (for a file "
                        "that may change while the model runs)")
    p.add_argument("--profile", action="store_true", help="also break a decode step's time down")
    p.add_argument("-o", "--output", choices=("md", "json"), default="md",
                   help="md: llama-bench's markdown table (default); json: one JSON list, llama-bench's field names")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import GGXContextOverflow, GGXValueError
    from ..host import process_memory, process_seconds
    from ..models import load_model

    tests = [("pp", n) for n in args.n_prompt if n] + [("tg", n) for n in args.n_gen if n]
    if not tests and not args.profile:
        raise GGXValueError("bench: nothing to run (every -p and -n is 0)")
    longest = max(n for _, n in tests) if tests else 1
    threads = args.threads or [None]
    # loaded with the first thread count: the graphs prepared at load are bound for it
    model = load_model(chosen_model(args), args.device, threads[0], n_ctx=max(longest + 1, 256),
                       flash_attn=not args.no_flash_attn, use_mmap=not args.no_mmap,
                       tensor_split=args.tensor_split, buft_overrides=args.override_tensor)
    model.eval([0])  # one token: what "start" measures
    model.reset()
    start_s = process_seconds()
    if tests == [("tg", 1)] and not args.profile:
        model.stop_preparing()  # the start-up run (-p 0 -n 1): one more token, then it exits
    else:
        model.wait_prepared()  # the prompt buckets' background preparation stays out of the timings
    if longest > model.n_ctx:
        raise GGXContextOverflow(f"bench: a test of {longest} tokens does not fit the model's context of "
                                 f"{model.n_ctx} tokens (its training context)", 0, longest, model.n_ctx)
    rng = np.random.default_rng(0)
    size = sum(t.nbytes for t in model.file.tensors.values())  # the file's weights, as llama-bench
    name = f"{model.file.get('general.name', str, 'model')} {model.file.tensor('blk.0.attn_q.weight').type.name}"
    backend = ",".join(d.name for d in model.runner.devices)
    as_json = args.output == "json"
    if not as_json:
        print("| model | size | backend | threads | test | t/s |\n|---|---:|---|---:|---:|---:|", flush=True)
    spread = 0.0
    records = []
    for nt in threads:
        if nt is not None:
            model.runner.set_n_threads(nt)
        for kind, n in tests:
            first = _one(model, kind, n, rng)
            tps = repetitions(model, kind, n, rng, args.repetitions, warm=False)
            mean, std = statistics.fmean(tps), (statistics.stdev(tps) if len(tps) > 1 else 0.0)
            spread = max(spread, std / mean if mean else 0.0)
            if as_json:
                used = nt or getattr(model.runner.backends[0], "n_threads", None)
                records.append({"model_filename": str(model.file.path), "model_type": name, "model_size": size,
                                "backends": backend, "n_threads": used,
                                "n_prompt": n if kind == "pp" else 0, "n_gen": n if kind == "tg" else 0,
                                "avg_ts": mean, "stddev_ts": std, "samples_ts": tps, "first_ts": first,
                                "start_s": start_s, "load_s": model.stats.load_s,
                                "load_split": model.stats.load_split})
            else:
                row = (name, f"{size / 2**20:.2f} MiB", backend, str(nt or "-"), f"{kind}{n}",
                       f"{mean:.2f} ± {std:.2f}")
                print("| " + " | ".join(row) + " |", flush=True)
    peak = process_memory()[1]
    if as_json:
        for r in records:
            r["peak_rss_bytes"] = peak
        print(json.dumps(records, indent=2), flush=True)
    else:
        print(start_line(start_s, model.stats.load_s, model.stats.load_split, peak), flush=True)
    if spread > NOISY:
        _say_why_noisy(spread)
    if args.profile:
        profile_decode(model, rng, sys.stdout)
    return 0


def start_line(start_s: float | None, load_s: float, split: dict[str, float], peak: int) -> str:
    """The start-up figures for people: start, the load and where it went, peak RSS."""
    start = f"start {start_s:.2f} s (process start to one token); " if start_s is not None else ""
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in split.items())
    return f"\n{start}load {load_s:.2f} s ({parts}); peak RSS {peak / 1e6:.0f} MB"


def _say_why_noisy(spread: float) -> None:
    """The likely cause of repetitions that disagree: other processes on the CPU (a parallel region
    waits for its slowest thread, so one busy core slows every step)."""
    import os

    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; " if hasattr(os, "getloadavg") else ""
    print(f"note: repetitions differ by up to {100 * spread:.0f}% of their mean ({load}other processes using the "
          "CPU make the figures vary; fewer threads than cores, or a quiet machine, give steadier ones)",
          file=sys.stderr)


def repetitions(model, kind: str, n: int, rng: np.random.Generator, count: int, warm: bool = True) -> list[float]:
    """tokens/s of `count` timed runs of the test, after one untimed warm-up run (unless `warm` is
    False: the caller ran it); a run during which a kernel was compiled (or loaded from the disk
    cache) is replaced, up to MAX_RETRIES times."""
    from .. import progress

    if warm:
        _one(model, kind, n, rng)
    out: list[float] = []
    retries = 0
    while len(out) < count:
        compiled = progress.compiles()
        tps = _one(model, kind, n, rng)
        if progress.compiles() != compiled and retries < MAX_RETRIES:
            retries += 1
            continue
        out.append(tps)
    return out


def _one(model, kind: str, n: int, rng: np.random.Generator) -> float:
    """Tokens per second of one run of the test (the garbage collector held off while it runs)."""
    from ..models.gc_pause import gc_paused

    tokens = rng.integers(0, model.n_vocab, size=n)
    model.reset()
    gc.collect()
    with gc_paused():
        t0 = time.perf_counter()
        if kind == "pp":
            model.eval(tokens)
        else:
            for tok in tokens:
                model.eval([int(tok)])
        return n / (time.perf_counter() - t0)


def profile_decode(model, rng: np.random.Generator, out, n: int = 64) -> None:
    """Break the time of `n` decode steps down: model Python, scheduler, backend dispatch, kernels.

    While it runs, each backend computes what the scheduler hands it through its per-node timing
    hook, `Backend.graph_profile`: the hook's (node, seconds) give the per-op kernel times, and
    the rest of its time is the backend's dispatch (its launch loop and the timers).
    """
    from collections import defaultdict

    model.wait_prepared()  # no prompt bucket's preparation in the background among the timings
    model.reset()
    model.eval(rng.integers(0, model.n_vocab, size=8))
    model.eval([1])  # build and plan the decode graph before timing
    backend_s: dict[str, float] = defaultdict(float)
    kernel_s: dict[str, float] = defaultdict(float)
    kernel_n: dict[str, int] = defaultdict(int)

    def profiled(be):
        own = be.graph_compute
        inside = False

        def graph_compute(graph):
            nonlocal inside
            if inside:  # a graph_profile computing node by node through graph_compute
                return own(graph)
            inside = True
            try:
                t = time.perf_counter()
                times = be.graph_profile(graph)
                backend_s[be.name] += time.perf_counter() - t
            finally:
                inside = False
            for node, seconds in times:
                kernel_s[node.op.name] += seconds
                kernel_n[node.op.name] += 1
        return graph_compute

    backends = list(model.runner.backends)
    for be in backends:
        be.graph_compute = profiled(be)
    try:
        model.eval([1])  # once untimed through the hook
        for d in (backend_s, kernel_s, kernel_n):
            d.clear()
        model.runner.timings.clear()
        t0 = time.perf_counter()
        for tok in rng.integers(0, model.n_vocab, size=n):
            model.eval([int(tok)])
        total = (time.perf_counter() - t0) / n * 1e3
    finally:
        for be in backends:
            be.__dict__.pop("graph_compute", None)
    ms = {k: v / n * 1e3 for k, v in model.runner.timings.items()}
    backend_ms = sum(backend_s.values()) / n * 1e3
    kernels = sum(kernel_s.values()) / n * 1e3
    rows = [("model Python (inputs, outputs, eval)", total - ms.get("sched.graph_compute", 0.0)),
            ("scheduler (plan reuse, copies, events)", ms.get("sched.graph_compute", 0.0) - backend_ms),
            ("backend dispatch (launch loop, timers)", backend_ms - kernels)]
    rows += [(f"kernel {op} x{kernel_n[op] // n}", v / n * 1e3)
             for op, v in sorted(kernel_s.items(), key=lambda kv: -kv[1])]
    out.write(f"\ndecode step: {total:.3f} ms ({1e3 / total:.1f} tokens/s); kernels {kernels:.3f} ms, "
              f"Python around them {total - kernels:.3f} ms\n")
    for key, v in rows:
        out.write(f"  {key:<40s} {v:8.3f} ms  {100 * v / total:5.1f} %\n")
