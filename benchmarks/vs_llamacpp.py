"""ggx against llama.cpp on the same GGUF files, side by side: llama-bench and `ggx bench` run
alternately, N rounds, and the medians and their ratio are printed per test.

    python benchmarks/vs_llamacpp.py MODEL [MODEL ...] [--llama-bench PATH] [--rounds 3] [-t 2]

Tests (as llama-bench defines them): pp512 (a 512-token prompt on an empty cache), tg128 (128
tokens generated one by one), the short prompts pp8 and pp37, and pp200 (past the prompt buckets
ggx prepares at load). "ppN first" is ggx's first run of that length in its process (`first_ts`
of `ggx bench`: a length not seen before) against llama-bench's mean for ppN, which builds its
graph every time: a ratio of 0.83 or more means no more than 1.2x llama.cpp's time. Each round
also starts both tools once for a single generated token (`-p 0 -n 1 -r 1`): the wall time of
that run (loading the file, setting up, one token) and the peak resident memory of each process
are reported as "start" and "peak RSS". The memory read bandwidth (a parallel sum over 1 GiB on
the same threads) is measured right before and right after each tool's timed run, and the
weights that tool read per second of tg128 (the file's tensor bytes times tokens/s) are compared
with the mean of those two: this machine's bandwidth moves between minutes, so each tool is
held against its own.

llama-bench comes from `--llama-bench` or $LLAMA_BENCH. To build it (CPU only; ~5-10 minutes on
two cores) from the llama.cpp sources, e.g. those vendored by the llama-cpp-python source
distribution: `cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF
-DBUILD_SHARED_LIBS=OFF && cmake --build build -j2 --target llama-bench llama-quantize`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TESTS = (("pp", 512), ("tg", 128), ("pp", 8), ("pp", 37), ("pp", 200))


def _run(cmd: list[str]) -> tuple[str, float, int]:
    """(stdout, wall seconds, peak RSS in bytes) of one process (its own, from os.wait4)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    return out, wall, usage.ru_maxrss * 1024


_BANDWIDTH = """
import sys, time, numba, numpy as np
@numba.njit(parallel=True, fastmath=True)
def total(a):
    s = 0.0
    for i in numba.prange(a.size):
        s += a[i]
    return s
a = np.ones(1 << 28, np.float32)
numba.set_num_threads(min(int(sys.argv[1]), numba.config.NUMBA_NUM_THREADS))
total(a)
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    total(a)
    best = min(best, time.perf_counter() - t0)
print(a.nbytes / best)
"""


def _read_bandwidth(threads: int) -> float:
    """Bytes per second of a parallel float32 sum over 1 GiB on `threads` threads (best of 5), in
    a process of its own (its gigabyte would otherwise count in the next tool's peak RSS)."""
    out = subprocess.run([sys.executable, "-c", _BANDWIDTH, str(threads)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def _tests(records: list[dict]) -> dict[str, float]:
    """test name -> tokens/s from a llama-bench / ggx bench JSON list; for ggx's prompts also
    "ppN first", its first run of that length."""
    out = {}
    for r in records:
        name = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        out[name] = float(r["avg_ts"])
        if r["n_prompt"] and "first_ts" in r:
            out[f"{name} first"] = float(r["first_ts"])
    return out


def _json(text: str) -> list[dict]:
    start = text.index("[")
    return json.loads(text[start:])


def _commands(tool: str, model: str, threads: int, reps: int, exe: str) -> tuple[list[str], list[str]]:
    """(the timed run, the start-up run) of one tool."""
    pp = ",".join(str(n) for k, n in TESTS if k == "pp")
    tg = ",".join(str(n) for k, n in TESTS if k == "tg")
    common = ["-t", str(threads), "-o", "json"]
    if tool == "llama.cpp":
        return ([exe, "-m", model, "-p", pp, "-n", tg, "-r", str(reps), *common],
                [exe, "-m", model, "-p", "0", "-n", "1", "-r", "1", *common])
    return ([exe, "bench", model, "-p", pp, "-n", tg, "-r", str(reps), *common],
            [exe, "bench", model, "-p", "0", "-n", "1", "-r", "1", *common])


def compare(model: str, llama_bench: str, ggx: str, rounds: int, threads: int, reps: int) -> None:
    results: dict[str, dict[str, list[float]]] = {"llama.cpp": {}, "ggx": {}}
    bandwidth: dict[str, list[float]] = {"llama.cpp": [], "ggx": []}
    weight_bytes = 0
    for rnd in range(rounds):
        for tool, exe in (("llama.cpp", llama_bench), ("ggx", ggx)):
            timed, start = _commands(tool, model, threads, reps, exe)
            before = _read_bandwidth(threads)
            out, _, _ = _run(timed)
            bandwidth[tool].append((before + _read_bandwidth(threads)) / 2)
            records = _json(out)
            weight_bytes = int(records[0]["model_size"])
            for name, tps in _tests(records).items():
                results[tool].setdefault(name, []).append(tps)
            _, wall, rss = _run(start)
            results[tool].setdefault("start s", []).append(wall)
            results[tool].setdefault("peak RSS MB", []).append(rss / 1e6)
        print(f"  round {rnd + 1}/{rounds} done", file=sys.stderr, flush=True)
    print(f"\n{Path(model).name}, {threads} threads, {rounds} rounds alternating (medians; ranges over rounds)")
    print("| test | llama.cpp | ggx | ggx / llama.cpp |\n|---|---:|---:|---:|")
    firsts = [f"{k}{n} first" for k, n in TESTS if k == "pp"]
    for name in [f"{k}{n}" for k, n in TESTS] + firsts + ["start s", "peak RSS MB"]:
        a = results["llama.cpp"].get(name.removesuffix(" first"))
        b = results["ggx"].get(name)
        if not a or not b:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        per_round = [y / x for x, y in zip(a, b)]
        unit = "" if name.startswith(("start", "peak")) else " t/s"
        print(f"| {name} | {ma:.2f}{unit} ({min(a):.1f}-{max(a):.1f}) | {mb:.2f}{unit} ({min(b):.1f}-{max(b):.1f}) | "
              f"{mb / ma:.2f}x ({min(per_round):.2f}-{max(per_round):.2f}) |")
    tg = [f"{k}{n}" for k, n in TESTS if k == "tg"]
    if tg and weight_bytes:
        print(f"\nweights read during {tg[0]} ({weight_bytes / 2**20:.0f} MiB a token) against the memory read "
              "bandwidth measured around the same run (medians; ranges over rounds):")
        for tool, bws in bandwidth.items():
            read = [tps * weight_bytes for tps in results[tool][tg[0]]]
            share = [r / b for r, b in zip(read, bws)]
            print(f"  {tool}: {statistics.median(read) / 1e9:.1f} GB/s of {statistics.median(bws) / 1e9:.1f} GB/s "
                  f"({min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f}): {100 * statistics.median(share):.0f} % "
                  f"({100 * min(share):.0f}-{100 * max(share):.0f} %)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="GGUF files (both tools read the same file)")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="llama-bench (default $LLAMA_BENCH)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--repetitions", type=int, default=3, help="repetitions inside each tool's run")
    args = ap.parse_args()
    if not args.llama_bench or not Path(args.llama_bench).is_file():
        ap.error("llama-bench not found: pass --llama-bench PATH or set LLAMA_BENCH (see this script's docstring)")
    ggx = shutil.which("ggx", path=str(Path(sys.executable).parent)) or shutil.which("ggx")
    if ggx is None:
        ap.error("the ggx command is not installed next to this Python")
    for model in args.models:
        compare(model, args.llama_bench, ggx, args.rounds, args.threads, args.repetitions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
