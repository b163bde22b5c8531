"""Scheduler overhead per node: first plan vs reused plan, on a ~600-node llama-like graph.

Kernels cost nothing (no-op backends from tests/sched_device.py), so the time measured is the
scheduler's own: planning, placing tensors, copies bookkeeping, dispatch. Two set-ups:
  host     — one no-op host backend (a CPU-only run);
  offload  — a no-op async test device holding the weights, plus the no-op host backend;
  mixed    — the same, but the device lacks ROPE and SOFT_MAX (ping-pong: many splits, copies).
Target: a reused plan costs at most 2 µs per node. Run: python benchmarks/sched_overhead.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sched_device import NoopHostDevice, TestDevice, alloc_weights, llama_like  # noqa: E402

from ggx.ops import Op  # noqa: E402
from ggx.sched import Scheduler  # noqa: E402


def measure(name: str, make_backends, n_layer: int = 21, reps: int = 200) -> None:
    graph, weights, _ = llama_like(n_layer=n_layer)
    backends, wbuft = make_backends()
    alloc_weights(wbuft, weights)
    n = len(graph.nodes)
    sched = Scheduler(backends)
    t0 = time.perf_counter()
    sched.graph_compute(graph)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(reps):
        sched.graph_compute(graph)
    reused = (time.perf_counter() - t0) / reps
    # a rebuilt graph of the same shape (new Tensor objects, same key): the decode-loop case
    rebuilt = []
    for _ in range(20):
        g2, w2, _ = llama_like(n_layer=n_layer)
        for a, b in zip(w2, weights):
            a.buffer, a.offset = b.buffer, b.offset
        t0 = time.perf_counter()
        sched.graph_compute(g2)
        rebuilt.append(time.perf_counter() - t0)
        assert sched.stats.plan_reused
    rb = sorted(rebuilt)[len(rebuilt) // 2]
    print(f"{name:8s} {n} nodes, {sched.stats.n_splits} splits: first plan {first / n * 1e6:7.2f} us/node | "
          f"reused plan {reused / n * 1e6:5.2f} us/node | rebuilt graph, same key {rb / n * 1e6:5.2f} us/node "
          f"(incl. Graph.key)")


def main() -> None:
    host = NoopHostDevice()

    def host_only():
        return [host.init_backend()], host.buffer_type()

    dev = TestDevice(noop=True)
    mixed_dev = TestDevice(noop=True, ops=set(Op) - {Op.ROPE, Op.SOFT_MAX})

    def offload():
        return [dev.init_backend(), host.init_backend()], dev.buffer_type()

    def mixed():
        return [mixed_dev.init_backend(), host.init_backend()], mixed_dev.buffer_type()

    measure("host", host_only)
    measure("offload", offload)
    measure("mixed", mixed)  # ROPE and SOFT_MAX fall back to the host: many splits and copies
    print("target: reused plan <= 2 us/node of scheduler time")


if __name__ == "__main__":
    main()
