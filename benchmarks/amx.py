"""AMX vs CPU_REPACK vs plain ggx-cpu: the same weights through all three, side by side in one run.

MUL_MAT of a [K, M] weight for Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K: gemm with n = 32 ... 512 columns
(GOPS) and gemv (one column over cold weights: the launches rotate over enough weight copies to
overflow the last-level cache; GB/s of weights), on the thread counts asked. Prints each path's
figure and the ratios AMX / plain and AMX / repack ("-" where CPU_REPACK has no layout).

On a machine without usable AMX (no CPU flags, no OS tile state, or the tile permission refused)
it prints why and runs the emulated engine (GGX_AMX_EMULATE's AMX_EMULATED) once per type on a
small shape as a correctness run against plain ggx-cpu: NMSE only, no timing (the emulation
models the tile instructions in software; its speed means nothing).

    python benchmarks/amx.py [--k 4096] [--m 4096] [--n 32,64,128,256,512] [--types q4_0,...]
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
TYPES = "q4_0,q4_1,q8_0,q4_K,q6_K"


def matmul_nodes(buft, host, gtype: GType, raw: np.ndarray, K: int, M: int, n: int, copies: int, rng) -> list:
    """`copies` MUL_MAT nodes of the weight bytes `raw` in `buft` times random activations [K, n]."""
    nodes = []
    for _ in range(copies):
        ctx = Context()
        a, b = ctx.tensor(gtype, (K, M), "a"), ctx.tensor(GType.F32, (K, n), "b")
        out = ctx.mul_mat(a, b)
        for t, bt in ((a, buft), (b, host), (out, host)):
            buf = bt.alloc_buffer(bt.get_alloc_size(t))
            t.buffer, t.offset = buf, 0
            buf.init_tensor(t)
        a.buffer.set_tensor(a, raw, 0)
        tensor_array(b)[...] = rng.standard_normal((1, 1, n, K)).astype(np.float32)
        nodes.append(out)
    return nodes


def seconds_per_call(launches: list, min_time: float) -> float:
    """Median seconds of one launch, the launches called in rotation for `min_time` seconds after
    one warm-up round (which compiles on a cold numba cache)."""
    for f in launches:
        f()
    times, start, i = [], time.perf_counter(), 0
    while not times or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        launches[i % len(launches)]()
        times.append(time.perf_counter() - t0)
        i += 1
    return statistics.median(times)


def paths(cpu, amx, gtype: GType, K: int) -> dict:
    """name -> prepare(node, n_threads) for plain ggx-cpu, CPU_REPACK (where it has a layout) and AMX."""
    from ggx_cpu.kernels import matmul

    out = {"plain": (cpu.buffer_type(), matmul.mul_mat)}
    repack = [b for b in registry.extra_buffer_types(cpu) if b.name == "CPU_REPACK"]
    if repack and repack[0].layout_for(Context().tensor(gtype, (K, 32))) is not None:
        out["repack"] = (repack[0], repack[0].prepare_forward)
    out["AMX"] = (amx, amx.prepare_forward)
    return out


def bench_type(cpu, amx, gtype: GType, K: int, M: int, ns: list[int], threads: list[int], min_time: float) -> None:
    rng = np.random.default_rng(0)
    raw = quantize(rng.standard_normal((M, K)).astype(np.float32), gtype).reshape(-1)
    host = cpu.buffer_type()
    ways = paths(cpu, amx, gtype, K)
    print(f"{gtype.name}: {raw.size / 1e6:.1f} MB of weights; paths {', '.join(ways)}")
    for n in [1] + ns:
        copies = max(1, -(-COLD_BYTES // raw.size)) if n == 1 else 1
        nodes = {name: matmul_nodes(bt, host, gtype, raw, K, M, n, copies, rng) for name, (bt, _) in ways.items()}
        for nt in threads:
            secs = {name: seconds_per_call([prep(node, nt) for node in nodes[name]], min_time)
                    for name, (_, prep) in ways.items()}
            unit, work = ("GB/s", raw.size) if n == 1 else ("GOPS", 2.0 * K * M * n)
            figures = "  ".join(f"{name} {work / s / 1e9:7.1f}" for name, s in secs.items())
            vs_repack = f"{secs['repack'] / secs['AMX']:5.2f}x" if "repack" in secs else "    -"
            label = "gemv" if n == 1 else f"gemm n={n}"
            print(f"  {label:12s} {nt:2d} thr  {unit}: {figures}   AMX/plain {secs['plain'] / secs['AMX']:5.2f}x"
                  f"  AMX/repack {vs_repack}")


def correctness_run(cpu, gtypes: list[GType]) -> None:
    """The emulated engine on a small shape per type, against plain ggx-cpu (the same quantized
    activations, so only the float summation order may differ): NMSE, never a time."""
    from ggx.conformance.harness import execute
    from ggx.graph import build_graph
    from ggx_amx.plugin import buffer_type

    emulated = buffer_type(cpu, "emulated")
    backend = cpu.init_backend(n_threads=2)
    rng = np.random.default_rng(1)
    for gtype in gtypes:
        K = 512 if gtype.block_size == 256 else 128
        for n in (1, 40):
            ctx = Context()
            w, x = ctx.tensor(gtype, (K, 64), "w"), ctx.tensor(GType.F32, (K, n), "x")
            out = ctx.mul_mat(w, x)
            inputs = {w: quantize(rng.standard_normal((64, K)).astype(np.float32), gtype).reshape(-1),
                      x: rng.standard_normal((n, K)).astype(np.float32).view(np.uint8).reshape(-1)}
            got = execute(cpu, backend, out, inputs, build_graph(out), emulated).values.astype(np.float64)
            want = execute(cpu, backend, out, inputs, build_graph(out), None).values.astype(np.float64)
            err = ((got - want) ** 2).sum() / (want ** 2).sum()
            print(f"  {gtype.name} n={n:2d}: NMSE vs plain ggx-cpu {err:.1e} ({'ok' if err < 1e-9 else 'MISMATCH'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--n", default="32,64,128,256,512", help="gemm column counts (gemv always runs)")
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timing per measurement")
    args = ap.parse_args()
    from ggx_cpu import isa
    from ggx_cpu.extension import amx_support

    gtypes = [GType.parse(t) for t in args.types.split(",")]
    cpu = registry.get_device("CPU")
    usable, why = amx_support()
    amx = [b for b in registry.extra_buffer_types(cpu) if b.name == "AMX"]
    if not usable or not amx:
        print(f"AMX cannot run here: {why if not usable else 'the AMX buffer type is not registered'}.")
        print("No speed figures. Correctness run of the emulated engine (AMX_EMULATED) instead:")
        correctness_run(cpu, gtypes)
        return
    print(f"MUL_MAT K={args.k} M={args.m}; ISA {isa.active()}; AMX: {why}; "
          f"gemv over {COLD_BYTES >> 20} MiB of weight copies")
    for gtype in gtypes:
        bench_type(cpu, amx[0], gtype, args.k, args.m, [int(x) for x in args.n.split(",")],
                   [int(x) for x in args.threads.split(",")], args.min_time)


if __name__ == "__main__":
    main()
