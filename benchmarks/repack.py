"""CPU_REPACK vs plain ggx-cpu: the same weights through both, side by side in one run.

MUL_MAT of a [K, M] weight: gemv (one column, cold weights: the call rotates over enough
weight copies to overflow the last-level cache) and gemm (512 columns), on 1 and 2 threads,
for Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K; plus the one-time repack cost per MB at load. Prints GB/s of
weights (gemv), GOPS (gemm) and the repack / plain ratio. Targets: gemm >= 1.3x, gemv >= 1.0x.

    python benchmarks/repack.py [--k 4096] [--m 4096] [--n 512] [--types q4_0,q4_1,q5_0,q8_0,q4_K,q6_K]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

# Pin OpenMP threads before numba starts them (docs/perf-notes.md: unpinned 2-thread calls stall ~8 ms).
os.environ.setdefault("OMP_PROC_BIND", "true")
os.environ.setdefault("OMP_PLACES", "cores")

import numpy as np  # noqa: E402

from ggx import registry  # noqa: E402
from ggx.graph import Context  # noqa: E402
from ggx.host import tensor_array  # noqa: E402
from ggx.quants import quantize  # noqa: E402
from ggx.types import GType  # noqa: E402

COLD_BYTES = 256 << 20  # gemv rotates over this many bytes of weight copies (beyond any cache)


def _alloc(buft, t):
    buf = buft.alloc_buffer(buft.get_alloc_size(t))
    t.buffer, t.offset = buf, 0
    buf.init_tensor(t)
    return buf


def _median_time(fn, min_time: float) -> float:
    """Median of calls repeated for `min_time` seconds (at least one) after a warm-up call."""
    fn()  # warm-up (compiles on a cold cache)
    times, start = [], time.perf_counter()
    while not times or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_type(gtype: GType, K: int, M: int, N: int, threads: list[int], min_time: float) -> None:
    from ggx_repack.plugin import buffer_type

    cpu = registry.get_device("CPU")
    repack = buffer_type(cpu)
    host = cpu.buffer_type()
    rng = np.random.default_rng(0)
    raw = quantize(rng.standard_normal((M, K)).astype(np.float32), gtype).reshape(-1)
    n_copies = max(1, -(-COLD_BYTES // raw.size))
    lay = repack.layout_for(Context().tensor(gtype, (K, M)))
    if lay is None:
        print(f"{gtype.name}: no repacked layout on this CPU")
        return

    # one-time repack cost
    ctx = Context()
    w = ctx.tensor(gtype, (K, M), "w")
    _alloc(repack, w)
    rep_s = _median_time(lambda: w.buffer.set_tensor(w, raw, 0), min_time / 2)
    print(f"{gtype.name} -> {lay.name}: repack {rep_s * 1e3:.1f} ms for {raw.size / 1e6:.1f} MB = "
          f"{rep_s * 1e3 / (raw.size / 1e6):.2f} ms/MB")

    for n_cols, label in ((1, "gemv"), (N, f"gemm n={N}")):
        copies = n_copies if n_cols == 1 else 1
        plain_nodes, repack_nodes = [], []
        for path, nodes in (("plain", plain_nodes), ("repack", repack_nodes)):
            for _ in range(copies):
                ctx = Context()
                a = ctx.tensor(gtype, (K, M), "a")
                b = ctx.tensor(GType.F32, (K, n_cols), "b")
                out = ctx.mul_mat(a, b)
                _alloc(repack if path == "repack" else host, a)
                a.buffer.set_tensor(a, raw, 0)
                for t in (b, out):
                    _alloc(host, t)
                tensor_array(b)[...] = rng.standard_normal((1, 1, n_cols, K)).astype(np.float32)
                nodes.append(out)
        for nt in threads:
            backend = cpu.init_backend(n_threads=nt)

            def run(nodes, backend=backend):
                """Cycle over the nodes' launches, bound once and planned as the backend does for a
                graph it reruns (`launch_for`: a split kernel of one column runs on the workers)."""
                launches = [backend.launch_for(node) for node in nodes]
                i = [0]

                def step():
                    launches[i[0] % len(launches)]()
                    i[0] += 1
                return step

            t_plain = _median_time(run(plain_nodes), min_time)
            t_rep = _median_time(run(repack_nodes), min_time)
            if n_cols == 1:
                unit, fp, fr = "GB/s", raw.size / t_plain / 1e9, raw.size / t_rep / 1e9
            else:
                ops = 2.0 * K * M * n_cols
                unit, fp, fr = "GOPS", ops / t_plain / 1e9, ops / t_rep / 1e9
            print(f"  {label:11s} {nt} thr  plain {fp:7.1f} {unit}  repack {fr:7.1f} {unit}  "
                  f"ratio {t_plain / t_rep:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default="q4_0,q4_1,q5_0,q8_0,q4_K,q6_K")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timing per measurement")
    args = ap.parse_args()
    from ggx_cpu import isa

    print(f"MUL_MAT K={args.k} M={args.m}; ISA {isa.active()}; gemv over {COLD_BYTES >> 20} MiB of weight copies")
    for name in args.types.split(","):
        bench_type(GType.parse(name), args.k, args.m, args.n, [int(x) for x in args.threads.split(",")], args.min_time)


if __name__ == "__main__":
    main()
