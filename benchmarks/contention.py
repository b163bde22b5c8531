"""Decode and a short prompt on a busy machine: each path quiet, then beside one other CPU-bound
process, side by side in one run.

The other process is a busy loop in a subprocess of its own session (as another program would
run), started before and stopped after each busy measurement by this script, and bounded in
time (it exits by itself after --busy-limit seconds whatever happens here). Paths: every buffer
type installed for the CPU's weights, each pinned alone with `ggx bench --override-tensor`
(plain CPU memory, CPU_REPACK, AMX where present), and llama.cpp's llama-bench under the same
load where --llama-bench is given. Prints tokens/s quiet and busy and the busy / quiet ratio of
decode (tgN) and of the prompt (ppN). Target (issue 28): every ggx path keeps at least half its
quiet speed, decode and pp32 alike.

    python benchmarks/contention.py [MODEL] [-t 2] [-p 32] [-n 64] [-r 3] [--llama-bench PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

#: the busy loop: pure Python arithmetic, exits by itself after argv[1] seconds
BUSY = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nx = 0\nwhile time.monotonic() < end:\n" \
       "    for _ in range(10000):\n        x += 1\n"
#: the weights each extra buffer type is pinned for: the matrix products' (norms, embeddings and
#: biases stay in plain memory, where placement puts them anyway)
PRODUCTS = r"(attn_(q|k|v|qkv|output)|ffn_(gate|up|down|gate_up)(_exps)?|output)\.weight$"


class BusyLoop:
    """One other CPU-bound process for the length of a `with` block (at most `limit` seconds)."""

    def __init__(self, limit: float):
        self.limit = limit
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> BusyLoop:
        self.proc = subprocess.Popen([sys.executable, "-c", BUSY, str(self.limit)], start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.2)  # running before the measurement starts
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: its process group is its own
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    @property
    def ran_throughout(self) -> bool:
        return self.proc is not None and self.proc.returncode in (None, -signal.SIGTERM)


def _json(text: str) -> list[dict]:
    return json.loads(text[text.index("["):])


def _rates(records: list[dict]) -> dict[str, float]:
    """test name (ppN / tgN) -> tokens/s of a ggx bench / llama-bench JSON list."""
    return {(f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"): float(r["avg_ts"]) for r in records}


def _measure(cmd: list[str], busy: float | None, timeout: float) -> dict[str, float] | str:
    """The rates of one run (beside a busy loop of at most `busy` seconds when given), or why none."""
    def run() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    try:
        if busy is None:
            done = run()
        else:
            with BusyLoop(busy) as loop:
                done = run()
            if not loop.ran_throughout:
                return "the busy loop ended before the run did (raise --busy-limit)"
    except subprocess.TimeoutExpired:
        return f"no result within {timeout:.0f} s"
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:300]
    return _rates(_json(done.stdout))


def installed_bufts() -> list[str]:
    """"CPU" (plain memory) and the CPU device's extra buffer types here, best first."""
    from ggx import registry

    return ["CPU", *(b.name for b in registry.extra_buffer_types(registry.get_device("CPU")))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2", help="GGUF file or known model name (default smollm2)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=32)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--bufts", help="comma-separated buffer types (default: every one installed)")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="llama-bench (default $LLAMA_BENCH)")
    ap.add_argument("--busy-limit", type=float, default=900.0,
                    help="seconds after which a busy loop exits by itself (default 900)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a single run may take (default 900)")
    args = ap.parse_args()

    ggx = shutil.which("ggx", path=str(Path(sys.executable).parent)) or shutil.which("ggx")
    if ggx is None:
        ap.error("the ggx command is not on PATH (pip install -e . in this environment)")
    common = ["-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", str(args.repetitions), "-t", str(args.threads),
              "-o", "json"]
    paths: list[tuple[str, list[str]]] = []
    for name in (args.bufts.split(",") if args.bufts else installed_bufts()):
        pin = ".*=CPU" if name == "CPU" else f"{PRODUCTS}={name}"
        paths.append((f"ggx {name}", [ggx, "bench", args.model, *common, "-ot", pin]))
    if args.llama_bench:
        if not Path(args.llama_bench).is_file():
            ap.error(f"--llama-bench {args.llama_bench}: no such file")
        if not Path(args.model).is_file():
            ap.error("llama-bench needs a GGUF file path for MODEL")
        paths.append(("llama.cpp", [args.llama_bench, "-m", args.model, *common]))

    tests = [f"tg{args.n_gen}", f"pp{args.n_prompt}"]
    print(f"{args.model}, {args.threads} threads; busy: one Python busy loop in its own session "
          f"({os.cpu_count()} CPUs here)")
    print("| path | test | quiet t/s | busy t/s | busy / quiet |\n|---|---|---:|---:|---:|")
    for label, cmd in paths:
        print(f"  {label}: quiet ...", file=sys.stderr, flush=True)
        quiet = _measure(cmd, None, args.timeout)
        print(f"  {label}: busy ...", file=sys.stderr, flush=True)
        busy = _measure(cmd, args.busy_limit, args.timeout) if isinstance(quiet, dict) else quiet
        for test in tests:
            if isinstance(quiet, str) or isinstance(busy, str):
                print(f"| {label} | {test} | {quiet if isinstance(quiet, str) else ''} | "
                      f"{busy if isinstance(busy, str) else ''} | |")
                break
            q, b = quiet.get(test), busy.get(test)
            if q and b:
                mark = "" if label == "llama.cpp" or b / q >= 0.5 else " (below 0.5)"
                print(f"| {label} | {test} | {q:.2f} | {b:.2f} | {b / q:.2f}x{mark} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
