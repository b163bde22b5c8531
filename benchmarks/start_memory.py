"""Where ggx's start-up time and resident memory go, per model, each in a fresh process:

    python benchmarks/start_memory.py [MODEL ...] [-t 2] [--no-mmap] [--profile N]

A child process per model times its phases from the interpreter's start: importing ggx, the
load's own split (`Model.stats.load_split`: the file and tokenizer, devices, weights, the warm-up
preparing graphs; kernels loaded or compiled inside those) and one decode token, and reads its
resident memory (VmRSS) after each, with the peak (VmHWM) at the end. The memory is broken down
as llama.cpp prints its buffers: weights copied into buffers (repacked or plain) and mapped from
the file (of which resident: the pages read), the KV cache, the compute buffers, and the rest
(interpreter, numpy, numba, the kernels' machine code and the Python objects of graphs and
plans); then the seconds the prompt buckets' preparation went on in the background after the load
(`Model.background_s`) and the resident memory once it is over. `--profile N` prints the load's
N costliest functions under cProfile (which inflates the Python-heavy parts: use it for where the
time goes, not for how much). MODEL is a path or a
known model's name (default: the default model).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, sys, time
t_import0 = time.perf_counter()
import numba  # noqa: F401 - with LLVM: what the CPU kernels need in any case
import numpy as np
from ggx import registry
from ggx.host import process_memory, process_seconds
from ggx.models import load_model
from ggx.models.weights import mappable
registry.devices()  # the plugins, numba and the kernels' modules imported
t_import = time.perf_counter() - t_import0
rss_libraries = process_memory()[0]
model_name, threads, use_mmap, profile = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
if profile:
    import cProfile, io, pstats
    prof = cProfile.Profile()
    prof.enable()
m = load_model(None if model_name == "-" else model_name, n_threads=threads, use_mmap=use_mmap)
if profile:
    prof.disable()
rss_loaded = process_memory()[0]
t0 = time.perf_counter()
m.eval([1])
one_token = time.perf_counter() - t0
start = process_seconds()
rss = process_memory()[0]
m.wait_prepared()  # the prompt buckets prepared in the background after the load
rss_prepared, peak = process_memory()
copied = sum(b.size for b in m.weight_buffers
             if not (mappable(b.buft) and np.shares_memory(b.host_view(), m.file.memory)))
mapped_resident = 0
with open("/proc/self/smaps", encoding="utf-8", errors="replace") as fh:  # the file map's resident pages
    inside = False
    for line in fh:
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            inside = head[-1] == m.path
        elif inside and head[0] == "Rss:":
            mapped_resident += int(head[1]) * 1024
compute = sum(b.size for b in m.runner.sched.alloc.buffers if b is not None)
out = {"model": m.path, "threads": threads, "use_mmap": use_mmap, "import_s": t_import,
       "load_s": m.stats.load_s, "load_split": m.stats.load_split, "one_token_s": one_token, "start_s": start,
       "background_s": m.background_s, "rss_prepared": rss_prepared,
       "rss_libraries": rss_libraries, "rss_loaded": rss_loaded, "rss": rss, "peak_rss": peak,
       "weights_copied": copied, "weights_mapped": m.mapped_nbytes, "mapped_resident": mapped_resident,
       "kv_cache": m.cache.nbytes, "compute_buffers": compute}
if profile:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(profile)
    out["profile"] = s.getvalue()
print(json.dumps(out))
"""


def measure(model: str, threads: int, use_mmap: bool, profile: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, model, str(threads), "1" if use_mmap else "0", str(profile)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{model}: the child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(r: dict) -> str:
    mb = 1e6
    split = ", ".join(f"{k} {v:.2f}" for k, v in r["load_split"].items())
    before = r["start_s"] - r["load_s"] - r["one_token_s"]
    known = r["weights_copied"] + r["mapped_resident"] + r["kv_cache"] + r["compute_buffers"]
    rest = r["rss"] - r["rss_libraries"] - known
    lines = [f"{r['model']} ({r['threads']} threads, {'mapped' if r['use_mmap'] else 'copied'} weights)",
             f"  start {r['start_s']:.2f} s = interpreter and imports {before:.2f} + load {r['load_s']:.2f} "
             f"({split}) + one token {r['one_token_s'] * 1e3:.1f} ms",
             f"  then the prompt buckets prepared in the background: {r['background_s'] or 0:.2f} s "
             f"(RSS {r['rss_prepared'] / mb:.0f} MB after them)",
             f"  peak RSS {r['peak_rss'] / mb:.0f} MB; {r['rss'] / mb:.0f} MB after one token:",
             f"    interpreter, numpy, numba, plugins imported  {r['rss_libraries'] / mb:6.1f} MB",
             f"    weights copied (repacked, fused, plain)      {r['weights_copied'] / mb:6.1f} MB",
             f"    weights mapped {r['weights_mapped'] / mb:6.1f} MB, resident          "
             f"{r['mapped_resident'] / mb:6.1f} MB",
             f"    KV cache                                     {r['kv_cache'] / mb:6.1f} MB",
             f"    compute buffers                              {r['compute_buffers'] / mb:6.1f} MB",
             f"    the rest: kernels loaded, tokenizer, graphs   {rest / mb:6.1f} MB",
             "      and plans of the prepared buckets, Python objects"]
    if "profile" in r:
        lines.append(r["profile"])
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=["-"])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--no-mmap", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--json", action="store_true", help="print the raw figures as JSON lines")
    args = ap.parse_args()
    for model in args.models:
        r = measure(model, args.threads, not args.no_mmap, args.profile)
        print(json.dumps(r) if args.json else report(r), flush=True)


if __name__ == "__main__":
    main()
