"""ggx-ray on loopback: the default model local, split across CPU + RAY0, and on RAY0 alone.

Prompt processing (pp, one batch) and decode (tg, one token per step) in tokens/s, measured in
one run, side by side, with:
- the overhead of one remote split: a one-node graph on RAY0 minus the same graph on the local
  CPU (a Ray actor call carrying the split's inputs and answering with its result);
- the bytes the scheduler moved between devices per decode step, and what a model 10x larger
  would spend on the network per token (its hidden size grows about sqrt(10)-fold at the same
  depth, and so does each boundary's activation row).

The remote device computes from plain CPU memory (its worker's device buffer type), so the
local run is shown both as installed and with plain CPU weights (no extra buffer types).

    python benchmarks/ray.py                   # starts a one-node Ray cluster on loopback
    GGX_RAY_ADDRESS=127.0.0.1:6379 python benchmarks/ray.py    # an existing cluster
    python benchmarks/ray.py --pp 128 --tg 32 --reps 3
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np

# this file is named ray.py: without its folder on the path, `import ray` finds Ray, not itself
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def _start_cluster() -> str | None:
    address = os.environ.get("GGX_RAY_ADDRESS")
    if address:
        return address
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # before ray is imported
    os.environ.setdefault("RAY_AUTH_TOKEN", uuid.uuid4().hex)
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="ggx", log_to_driver=False,
             logging_level="warning")
    return None


def _rate(model, kind: str, n: int, reps: int, rng: np.random.Generator) -> float:
    """Median tokens/s over `reps` runs, as `ggx bench` times them (a warm-up first; a run that
    compiled a kernel is run again)."""
    from ggx.commands.bench import repetitions

    return statistics.median(repetitions(model, kind, n, rng, reps))


def _split_overhead_ms(ray_device, cpu_device, reps: int = 200) -> tuple[float, float]:
    """(ms per one-node graph on RAY0, the same on CPU) with the graph's input set each time."""
    from ggx.graph import Context, build_graph
    from ggx.sched import Scheduler

    times = []
    for device in (ray_device, cpu_device):
        c = Context()
        x = c.tensor("F32", (576,), "x")
        x.set_flag(x.flags.INPUT)
        y = c.scale(x, 2.0)
        g = build_graph(y)
        backends = [device.init_backend()] + ([cpu_device.init_backend()] if device is not cpu_device else [])
        sched = Scheduler(backends)
        from ggx.alloc import alloc_tensors

        alloc_tensors(device.buffer_type(), [x])
        sched.alloc_graph(g)
        data = np.ones(576, dtype=np.float32).view(np.uint8)
        for i in range(reps + 10):
            if i == 10:
                t0 = time.perf_counter()
            x.data_buffer.set_tensor(x, data)
            sched.graph_compute(g)
            y.data_buffer.get_tensor(y)
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--tg", type=int, default=32, help="decode steps (default 32)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per figure, median (default 3)")
    args = ap.parse_args()

    address = _start_cluster()
    import ggx_ray

    from ggx import registry
    from ggx.models import load_model

    ray0 = ggx_ray.connect(address)[0]
    cpu = registry.get_device("CPU")
    print(f"RAY0: {ray0.description}; local: CPU ({cpu.description})")
    rng = np.random.default_rng(0)
    setups = [("local CPU (as installed)", ["CPU"], False), ("local CPU, plain weights", ["CPU"], True),
              ("CPU + RAY0 (layer split)", ["RAY0", "CPU"], False), ("RAY0 alone", ["RAY0"], False)]
    rows = []
    disabled = os.environ.get("GGX_DISABLE_PLUGINS", "")
    for label, devices, plain in setups:
        # plain: the kernels the worker runs (no extra buffer types)
        os.environ["GGX_DISABLE_PLUGINS"] = f"{disabled},repack" if plain else disabled
        registry.load_plugins(force=True)
        model = load_model(devices=devices)
        model.wait_prepared()  # the prompt buckets' background preparation stays out of the timings
        pp = _rate(model, "pp", args.pp, args.reps, rng)
        tg = _rate(model, "tg", args.tg, args.reps, rng)
        list(model.generate("Hello", max_tokens=8))  # for the per-step traffic figure
        rows.append((label, pp, tg, model.stats.bytes_copied_per_decode_step, model.runner.last_splits,
                     str(model.layer_split)))
        del model
    os.environ["GGX_DISABLE_PLUGINS"] = disabled
    base_pp, base_tg = rows[0][1], rows[0][2]
    print(f"\n{'setup':28} {'pp' + str(args.pp):>10} {'ratio':>6} {'tg' + str(args.tg):>10} {'ratio':>6} "
          f"{'splits':>6} {'moved/step':>11}")
    for label, pp, tg, moved, splits, split in rows:
        print(f"{label:28} {pp:10.1f} {pp / base_pp:6.2f} {tg:10.1f} {tg / base_tg:6.2f} {splits:6d} "
              f"{moved / 1024:8.1f} KiB   {split}")

    remote_ms, local_ms = _split_overhead_ms(ray0, cpu)
    print(f"\none-node graph: RAY0 {remote_ms:.3f} ms, CPU {local_ms:.3f} ms: "
          f"{remote_ms - local_ms:.3f} ms overhead per remote split (input in, result out, one call)")
    split_step_ms = 1e3 / rows[2][2]
    local_step_ms = 1e3 / base_tg
    print(f"decode step: local {local_step_ms:.2f} ms, split {split_step_ms:.2f} ms "
          f"(+{split_step_ms - local_step_ms:.2f} ms)")
    moved = rows[2][3]
    big = moved * math.sqrt(10)
    for gbit in (1, 10, 100):
        print(f"a 10x larger model, split the same way: ~{big / 1024:.1f} KiB per token, "
              f"{big * 8 / (gbit * 1e9) * 1e6:.1f} us on a {gbit} Gbit/s link + the per-split latency above")


if __name__ == "__main__":
    main()
