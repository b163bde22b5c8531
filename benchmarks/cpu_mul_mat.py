"""CPU mul_mat benchmark: gemv GB/s vs read bandwidth, gemm GOPS vs
dequantize + numpy matmul, all measured in the same run; plus cold/warm kernel start-up.

    python benchmarks/cpu_mul_mat.py                 # everything, active ISA
    python benchmarks/cpu_mul_mat.py --quick         # 4096x4096 only
    python benchmarks/cpu_mul_mat.py --types q4_0,q5_0   # only these weight types
    GGX_CPU_ISA=avx2 python benchmarks/cpu_mul_mat.py --no-startup

gemv: weights cycle over enough copies (>= 512 MiB) that each call reads them from DRAM; the
read bandwidth (a plain vector sum) is measured over that same memory right after each of 5
gemv rounds, and the median ratio printed.
gemm: 512 activation columns; the baseline dequantizes the weights (gguf's numpy
dequantize, or astype for F16) and multiplies with numpy (OpenBLAS) at the same thread count;
OpenBLAS is limited to 1 thread around numba calls so its spinning workers do not slow them
(threadpoolctl: `pip install -e ".[bench]"`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_PROC_BIND", "true")  # numba's OpenMP layer: no 2-thread stalls
os.environ.setdefault("OMP_PLACES", "cores")

import numba  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType, quants  # noqa: E402
from numba import njit, prange  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

import ggx  # noqa: E402
from ggx.host import HostBufferType  # noqa: E402
from ggx.types import GType  # noqa: E402
from ggx_cpu import isa  # noqa: E402
from ggx_cpu.isa.simd import fma_f32x8, hsum_f32x8, load_f32x8, splat_f32x8, zero_f32x8  # noqa: E402
from ggx_cpu.kernels import matmul  # noqa: E402

TYPES = [GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0, GType.F16]
CACHE_DEFEAT_BYTES = 512 << 20


@njit(parallel=True, cache=True)
def _read_sum(a, nchunks):
    """Sum of a float32 array: 4 independent 8-lane vector accumulators per chunk."""
    n = a.shape[0]
    out = np.zeros(nchunks, np.float32)
    for c in prange(nchunks):
        lo = c * n // nchunks
        hi = (c + 1) * n // nchunks
        one = splat_f32x8(np.float32(1.0))
        s0 = s1 = s2 = s3 = zero_f32x8()
        for i in range(lo, hi - 31, 32):
            s0 = fma_f32x8(s0, load_f32x8(a, i), one)
            s1 = fma_f32x8(s1, load_f32x8(a, i + 8), one)
            s2 = fma_f32x8(s2, load_f32x8(a, i + 16), one)
            s3 = fma_f32x8(s3, load_f32x8(a, i + 24), one)
        out[c] = hsum_f32x8(s0) + hsum_f32x8(s1) + hsum_f32x8(s2) + hsum_f32x8(s3)
    return out.sum()


def read_bandwidth(n_threads: int, a: np.ndarray, reps: int = 5) -> float:
    """GB/s of a read-only sum over the float32 array `a` (numba, n_threads), best of `reps`."""
    nbytes = a.nbytes
    numba.set_num_threads(n_threads)
    _read_sum(a, 64)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _read_sum(a, 64)
        ts.append(time.perf_counter() - t0)
    return nbytes / min(ts) / 1e9


def random_weights(gtype: GType, rows: int, k: int, rng) -> np.ndarray:
    """Raw bytes of a [k, rows] weight: random quants, small sane f16 scales."""
    if gtype is GType.F16:
        return (rng.standard_normal((rows, k), np.float32) * 0.05).astype(np.float16).view(np.uint8).reshape(-1)
    nblk = rows * k // gtype.block_size
    blocks = np.frombuffer(rng.bytes(nblk * gtype.type_size), gtype.block_dtype).copy()
    blocks["d"] = np.float16(0.01)
    if gtype is GType.Q4_1:
        blocks["m"] = np.float16(-0.08)
    return blocks.view(np.uint8).reshape(-1)


def build(gtype: GType, m: int, k: int, n: int, copies: int, rng):
    """`copies` weight tensors of [k, m] plus one b [k, n] and one mul_mat node per copy."""
    ctx = ggx.Context()
    ws = [ctx.tensor(gtype, (k, m), name=f"w{i}") for i in range(copies)]
    b = ctx.tensor(GType.F32, (k, n), name="b")
    nodes = [ctx.mul_mat(w, b) for w in ws]
    tensors = ws + [b] + nodes
    size = sum(-(-t.nbytes // 64) * 64 for t in tensors)
    buf = HostBufferType(None).alloc_buffer(size)
    off = 0
    for t in tensors:
        t.buffer, t.offset = buf, off
        off += -(-t.nbytes // 64) * 64
    raw = random_weights(gtype, m, k, rng)
    for w in ws:
        buf.set_tensor(w, raw)
    buf.set_tensor(b, rng.standard_normal((n, k), np.float32))
    return ws, b, nodes, raw


def time_calls(fn, reps: int) -> float:
    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_gemv(gtype, m, k, n_threads, rng, rounds: int = 5) -> tuple[float, float, float]:
    """(gemv GB/s, read bandwidth GB/s, gemv / bandwidth): medians over `rounds` rounds, each
    timing the gemv and then the read bandwidth *of the same memory* (the buffer holding the
    weight copies). Both see the same machine and memory state: on this virtual machine the
    read bandwidth of a region moves between ~34 GB/s (freshly allocated) and ~60 GB/s (read
    many times), and from minute to minute."""
    one = k // gtype.block_size * gtype.type_size * m
    copies = max(2, CACHE_DEFEAT_BYTES // one)
    ws, b, nodes, _ = build(gtype, m, k, 1, copies, rng)
    data = ws[0].data_buffer.host_view()
    weights_f32 = data[: data.size // 4 * 4].view(np.float32)
    launches = [matmul.mul_mat(node, n_threads) for node in nodes]  # bound once, as graph_compute does
    launches[0]()  # warm
    gemv, bw = [], []
    for _ in range(rounds):
        t = time_calls(lambda i: launches[i % copies](), max(2 * copies, 20))
        gemv.append(one / t / 1e9)
        bw.append(read_bandwidth(n_threads, weights_f32, reps=3))
    ratio = [g / w for g, w in zip(gemv, bw)]
    return statistics.median(gemv), statistics.median(bw), statistics.median(ratio)


def dequant(gtype: GType, raw: np.ndarray, m: int, k: int) -> np.ndarray:
    if gtype is GType.F16:
        return raw.view(np.float16).reshape(m, k).astype(np.float32)
    return quants.dequantize(raw.reshape(m, -1), GGMLQuantizationType[gtype.name]).astype(np.float32, copy=False)


def bench_gemm(gtype, m, k, n, n_threads, rng):
    ws, b, nodes, raw = build(gtype, m, k, n, 1, rng)
    x = rng.standard_normal((n, k), np.float32)
    b.buffer.set_tensor(b, x)
    ops = 2.0 * m * n * k
    with threadpool_limits(1):
        run = matmul.mul_mat(nodes[0], n_threads)
        run()
        t_ggx = time_calls(lambda i: run(), 3)
    with threadpool_limits(n_threads):
        def base(i):
            wf = dequant(gtype, raw, m, k)
            return x @ wf.T
        ref = base(0)
        t_np = time_calls(base, 3)
    out = ggx.host.tensor_array(nodes[0]).reshape(n, m)
    err = float(np.sum((out - ref) ** 2) / np.sum(ref ** 2))
    return ops / t_ggx / 1e9, ops / t_np / 1e9, err


STARTUP_SCRIPT = r"""
import time; t0 = time.perf_counter()
import numpy as np, ggx
from ggx.host import HostBufferType
from ggx.types import GType
from ggx_cpu.kernels import matmul
t1 = time.perf_counter()
for gt in [GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0, GType.Q4_K, GType.Q6_K, GType.F32, GType.F16, GType.BF16]:
    ctx = ggx.Context()
    w = ctx.tensor(gt, (256, 8)); b = ctx.tensor(GType.F32, (256, 5)); ids = ctx.tensor(GType.I32, (1, 5))
    b3 = ctx.view(b, (256, 1, 5), (b.nb[1], b.nb[1]))
    we = ctx.reshape(w, (256, 4, 2))
    nodes = [ctx.mul_mat(w, b), ctx.mul_mat_id(we, b3, ids)]
    buf = HostBufferType(None).alloc_buffer(1 << 20); off = 0
    for t in [w, b, ids] + nodes:
        t.buffer, t.offset = buf, off; off += -(-t.nbytes // 64) * 64
    buf.clear(0); buf.set_tensor(b, np.ones((5, 256), np.float32)); buf.set_tensor(ids, np.zeros(5, np.int32))
    matmul.mul_mat(nodes[0], 1)(); matmul.mul_mat_id(nodes[1], 2)()
print(f"{t1 - t0:.2f} {time.perf_counter() - t1:.2f}")
"""


def startup() -> None:
    """First-ever compile (empty numba cache) and warm-cache start-up, in fresh processes."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("cold (first-ever compile)", "warm cache"):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", STARTUP_SCRIPT], env=env, capture_output=True, text=True)
            if r.returncode:
                print(r.stderr)
                raise SystemExit(1)
            imp, run = r.stdout.split()
            print(f"  {label:28s} process {time.perf_counter() - t0:6.2f} s  (imports {imp} s, "
                  f"all mul_mat kernels {run} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only 4096x4096")
    ap.add_argument("--no-startup", action="store_true")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default=",".join(t.name.lower() for t in TYPES), help="weight types, comma-separated")
    args = ap.parse_args()
    types = [GType.parse(t) for t in args.types.split(",")]
    rng = np.random.default_rng(0)
    shapes = [(4096, 4096)] if args.quick else [(4096, 4096), (14336, 4096)]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"ggx-cpu mul_mat, ISA variant {isa.active()} (available: {', '.join(isa.available())}), "
          f"CPU {isa.cpu_name()}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if not args.no_startup:
        print("start-up, ISA", isa.active())
        startup()
    for nt in threads:
        print(f"\n== {nt} thread(s); gemv: medians of 5 rounds of (gemv, read bandwidth), % = median of "
              f"the rounds' ratios")
        print(f"{'type':6s} {'M x K':>12s} {'gemv GB/s':>10s} {'read GB/s':>10s} {'% of bw':>8s} "
              f"{'gemm GOPS':>10s} {'deq+np':>8s} {'ratio':>6s} {'nmse':>8s}")
        for gt in types:
            for m, k in shapes:
                gbs, bw, ratio = bench_gemv(gt, m, k, nt, rng)
                g, base, err = bench_gemm(gt, m, k, 512, nt, rng)
                print(f"{gt.name:6s} {f'{m}x{k}':>12s} {gbs:10.1f} {bw:10.1f} {100 * ratio:7.0f}% {g:10.1f} "
                      f"{base:8.1f} {g / base:5.2f}x {err:8.1e}", flush=True)
    print(f"\nnumba threading layer: {numba.threading_layer()}")


if __name__ == "__main__":
    main()
