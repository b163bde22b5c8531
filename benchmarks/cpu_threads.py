"""Two-thread stalls: decode steps of the default model, timed one by one,
under numba's OpenMP layer with different OpenMP settings, each in a fresh process.

    python benchmarks/cpu_threads.py                # 300 steps per setting
    python benchmarks/cpu_threads.py --steps 1000

A decode step runs ~330 kernels, the matmuls (and large ops) as 2-thread parallel regions,
with Python in between; a *stall* is a step taking more than twice the median (a worker that
slept, or was descheduled, while the other waited for it). Printed per setting: median, 99th
percentile and maximum step time over the steady steps, the stall count, tokens/s = 1 / mean
step time (all steps), and the time of each step into a new 256-slot KV bucket (it builds,
plans and binds a new graph: not a stall). The 1-thread run is the baseline without wake-ups.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SETTINGS = {
    "1 thread": ({}, 1),
    "2 threads, defaults": ({}, 2),
    "2 threads, OMP_PROC_BIND=true OMP_PLACES=cores": ({"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"}, 2),
    "2 threads, OMP_WAIT_POLICY=passive": ({"OMP_WAIT_POLICY": "passive"}, 2),
    "2 threads, OMP_WAIT_POLICY=active": ({"OMP_WAIT_POLICY": "active"}, 2),
}

CHILD = r"""
import json, sys, time
import numpy as np
from ggx.models import load_model
steps, n_threads = int(sys.argv[1]), int(sys.argv[2])
model = load_model(n_threads=n_threads)
model.wait_prepared()  # the prompt buckets' background preparation stays out of the timings
model.eval(list(range(100, 132)))
for _ in range(20):
    model.eval([7])
ts, new_bucket = [], []
for i in range(steps):
    if model.cache.n_past >= model.n_ctx - 1:
        model.reset(); model.eval([1])
    fresh = model.cache.n_kv_for(model.cache.n_past + 1) != model.cache.n_kv_for(model.cache.n_past)
    t0 = time.perf_counter()
    model.eval([7 + i % 100])
    ts.append(time.perf_counter() - t0)
    new_bucket.append(fresh)
print(json.dumps([ts, new_bucket]))
"""


def run(env: dict[str, str], n_threads: int, steps: int) -> tuple[list[float], list[bool]]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    full.update(env)
    r = subprocess.run([sys.executable, "-c", CHILD, str(steps), str(n_threads)], env=full,
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    import numpy as np

    print(f"SmolLM2 decode, {args.steps} steps per setting, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print(f"{'setting':50s} {'median ms':>9s} {'p99 ms':>7s} {'max ms':>7s} {'stalls':>6s} {'tok/s':>6s} "
          f"{'new KV bucket ms':>16s}")
    for name, (env, n) in SETTINGS.items():
        times, fresh = run(env, n, args.steps)
        ts, fresh = np.array(times) * 1e3, np.array(fresh)
        steady = ts[~fresh]  # a step into a new 256-slot KV bucket builds, plans and binds a new graph
        med = float(np.median(steady))
        stalls = int((steady > 2 * med).sum())
        bucket = ", ".join(f"{t:.0f}" for t in ts[fresh]) or "-"
        print(f"{name:50s} {med:9.2f} {np.percentile(steady, 99):7.2f} {steady.max():7.2f} {stalls:6d} "
              f"{1e3 / ts.mean():6.1f} {bucket:>16s}", flush=True)


if __name__ == "__main__":
    main()
