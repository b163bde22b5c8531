"""Load on `ggx serve` (and llama.cpp's llama-server, side by side): N concurrent streaming clients.

    python benchmarks/serve.py [MODEL] [--clients 1,2,4,8] [--seconds 30] [--max-tokens 64] [-t THREADS]
                               [--no-pad-decode] [--llama-server PATH]

For each client count N, N clients on loopback each send streaming completion requests one after
another (each its own prompt, greedy, `--max-tokens` tokens) for `--seconds`; requests in flight
at the end finish. Printed per N: aggregate generated tokens/s (all clients' tokens over the
wall time), its ratio to one client's, time to first token and the time between tokens
(p50/p90/p99, ms). The server runs with `--parallel` = the largest N, so every level has a slot
per client. With 4 clients the aggregate rate should be >= 2.5x one client's (a decode step
reads the weights once for every slot). By default ggx decodes a fixed number of rows (one per
slot, for batch invariance), so one client alone pays for all the rows; `--no-pad-decode` runs the
server with only the generating rows (one client at its fastest): run both.

llama-server comes from `--llama-server` or $LLAMA_SERVER (build it as llama-bench is built, see
benchmarks/vs_llamacpp.py, with `--target llama-server`); it serves the same GGUF file with the
same slots, context and threads. Run on a quiet machine: these are timings.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROMPTS = ["Write a story about a lighthouse keeper.", "Explain how rain forms.", "List ten animals of the sea.",
           "Describe a busy market.", "What makes a good friend?", "Tell me about the moon.",
           "How do bees make honey?", "Write a letter to a pen pal."]


@dataclass
class ClientStats:
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    errors: int = 0


def stream_one(host: str, port: int, prompt: str, max_tokens: int, st: ClientStats) -> None:
    """One streaming completion; counts its tokens (the usage chunk, else one per chunk)."""
    conn = http.client.HTTPConnection(host, port, timeout=300)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        st.errors += 1
        conn.close()
        return
    last, chunks, used = None, 0, None
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if obj.get("usage"):
            used = obj["usage"].get("completion_tokens")
        if not obj.get("choices") or not obj["choices"][0].get("text"):
            continue
        now = time.perf_counter()
        if last is None:
            st.ttft.append(now - t0)
        else:
            st.gaps.append(now - last)
        last = now
        chunks += 1
    conn.close()
    st.tokens += used if used is not None else chunks


def load(host: str, port: int, n_clients: int, seconds: float, max_tokens: int) -> dict:
    stats = [ClientStats() for _ in range(n_clients)]
    stop_at = time.perf_counter() + seconds

    def client(i: int) -> None:
        k = 0
        while time.perf_counter() < stop_at:
            stream_one(host, port, PROMPTS[(i + k * n_clients) % len(PROMPTS)], max_tokens, stats[i])
            k += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [x for s in stats for x in s.ttft]
    gaps = [x for s in stats for x in s.gaps]

    def pct(xs: list[float]) -> str:
        if not xs:
            return "-"
        return "/".join(f"{np.percentile(xs, q) * 1000:.0f}" for q in (50, 90, 99))

    tokens = sum(s.tokens for s in stats)
    return {"clients": n_clients, "tokens": tokens, "wall_s": wall, "tps": tokens / wall if wall else 0.0,
            "ttft_ms": pct(ttft), "itl_ms": pct(gaps), "errors": sum(s.errors for s in stats)}


def wait_health(host: str, port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection(host, port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become ready")


def start_ggx(model: str | None, parallel: int, ctx: int, threads: int | None,
              pad: bool = True) -> tuple[subprocess.Popen, int]:
    ggx = Path(sys.executable).with_name("ggx")
    cmd = [str(ggx), "serve", *([model] if model else []), "--port", "0", "--parallel", str(parallel),
           "--ctx-size", str(ctx), *(["-t", str(threads)] if threads else []), *([] if pad else ["--no-pad-decode"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"http://[^:]+:(\d+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"ggx serve did not say where it listens: {line!r}")
    return proc, int(m.group(1))


def start_llama(binary: str, gguf: Path, parallel: int, ctx: int, threads: int | None,
                port: int) -> subprocess.Popen:
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
           "-c", str(ctx), *(["-t", str(threads)] if threads else [])]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_levels(name: str, host: str, port: int, levels: list[int], seconds: float, max_tokens: int) -> list[dict]:
    rows = []
    stream_one(host, port, "Hello", 2, ClientStats())  # the first request's set-up out of the figures
    for n in levels:
        rows.append(load(host, port, n, seconds, max_tokens))
        base = rows[0]["tps"] if rows[0]["clients"] == 1 else None
        r = rows[-1]
        ratio = f"{r['tps'] / base:5.2f}x" if base else "    -"
        print(f"{name:12s} {n:7d} {r['tokens']:7d} {r['tps']:9.1f} {ratio} {r['ttft_ms']:>16s} {r['itl_ms']:>16s}"
              f" {r['errors']:6d}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="GGUF path or known model name (default: the default)")
    ap.add_argument("--clients", default="1,2,4,8", help="client counts (default 1,2,4,8)")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of load per client count (default 30)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--ctx-per-slot", type=int, default=1024, help="context per slot (default 1024)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for both servers")
    ap.add_argument("--no-pad-decode", action="store_true", help="ggx serve --no-pad-decode (see above)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                    help="llama-server binary (default $LLAMA_SERVER; none: ggx only)")
    ap.add_argument("--llama-port", type=int, default=18080, help="port for llama-server (default 18080)")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    parallel = max(levels)
    ctx = parallel * args.ctx_per_slot
    print(f"{'server':12s} {'clients':>7s} {'tokens':>7s} {'tokens/s':>9s} {'vs 1':>6s} {'ttft p50/90/99':>16s}"
          f" {'itl p50/90/99':>16s} {'errors':>6s}")
    proc, port = start_ggx(args.model, parallel, ctx, args.threads, not args.no_pad_decode)
    try:
        wait_health("127.0.0.1", port, proc)
        name = "ggx no-pad" if args.no_pad_decode else "ggx"
        run_levels(name, "127.0.0.1", port, levels, args.seconds, args.max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if args.llama_server:
        from ggx.models.catalog import resolve_model

        llama = start_llama(args.llama_server, resolve_model(args.model), parallel, ctx, args.threads,
                            args.llama_port)
        try:
            wait_health("127.0.0.1", args.llama_port, llama)
            run_levels("llama-server", "127.0.0.1", args.llama_port, levels, args.seconds, args.max_tokens)
        finally:
            llama.terminate()
            llama.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
