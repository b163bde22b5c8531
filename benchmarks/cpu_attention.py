"""CPU flash attention and the exp-based row ops: the current kernels against the previous ones,
measured side by side in one run (old and new alternate in every round; medians of the rounds).

    python benchmarks/cpu_attention.py                # 1 thread, every case
    python benchmarks/cpu_attention.py --threads 2    # also 2 threads
    python benchmarks/cpu_attention.py --quick        # fewer cases and rounds

Attention cases: SmolLM2-135M (head size 64, 9 query heads, 3 KV heads) and Gemma 3 270M (256,
4, 1; sliding window 512 on its local layers), F16 K/V as the models' caches: a 512-token
prefill under a causal mask and one decode token over 256..4096 cache slots. The previous kernel
(one query row per task, scalar per key; ggx-cpu before the tiled kernel) is kept below for
this comparison only. GFLOPS count 4 * D flops per (query row, unmasked key) pair (Q K^T and
P V); for decode the K/V bytes the token reads (unmasked slots) per second are printed too.
The row ops: SOFT_MAX, SILU and GLU (swiglu) against their previous scalar `math.exp` forms.
1 thread is timed in thread CPU time (a paused process does not count), more threads in wall
time.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_PROC_BIND", "true")  # numba's OpenMP layer: no 2-thread stalls
os.environ.setdefault("OMP_PLACES", "cores")

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

import ggx  # noqa: E402
from ggx.types import GType  # noqa: E402
from ggx_cpu import device  # noqa: E402
from ggx_cpu.kernels.common import elems  # noqa: E402
from ggx_cpu.kernels.convert import as_f32, f16_to_f32, f32_to_f16  # noqa: E402
from ggx_cpu.kernels.softmax import alibi_slopes  # noqa: E402
from ggx_cpu.plugin import backend_reg  # noqa: E402


# --- the previous kernels (for this comparison only) ---------------------------------------------
@njit(cache=True, inline="always")
def _h_old(x):
    return f16_to_f32(f32_to_f16(x))


@njit(cache=True, fastmath={"reassoc", "contract"})
def _dot_old(q, k):
    s = np.float32(0.0)
    for i in range(q.size):
        s += q[i] * as_f32(k[i])
    return s


@njit(cache=True, parallel=True)
def old_flash_attn_kernel(scale, softcap, slopes, q_f16, acc_f16, q, qo, qs, qne, k, ko, ks, kne, v, vo, vs_, vne,
                          has_mask, m, mo, ms, mne, d, do, ds):
    """ggx-cpu's FLASH_ATTN_EXT kernel before the tiled kernel: a prange over query rows, one key
    at a time (a vectorized dot, an online softmax update)."""
    D, T, H = qne[0], qne[1], qne[2]
    KV, Dv = kne[1], vne[0]
    rk2 = H // kne[2]
    rk3 = qne[3] // kne[3]
    for r in prange(T * H * qne[3]):
        t, h, b = r % T, (r // T) % H, r // (T * H)
        ik2, ik3 = h // rk2, b // rk3
        qb = qo + t * qs[1] + h * qs[2] + b * qs[3]
        qrow = q[qb: qb + D]
        qv = np.empty(D, np.float32)
        for i in range(D):
            qv[i] = _h_old(qrow[i]) if q_f16 else qrow[i]
        acc = np.zeros(Dv, np.float32)
        mb = mo + t * ms[1] + (h % mne[2]) * ms[2] + (b % mne[3]) * ms[3]
        slope = slopes[h]
        S = np.float32(0.0)
        M = np.float32(-np.inf)
        for ic in range(KV):
            mv = slope * as_f32(m[mb + ic * ms[0]]) if has_mask else np.float32(0.0)
            if mv == -np.inf:
                continue
            kb = ko + ic * ks[1] + ik2 * ks[2] + ik3 * ks[3]
            s = _dot_old(qv, k[kb: kb + D]) * scale
            if softcap != 0:
                s = softcap * np.float32(math.tanh(s))
            s += mv
            ms_ = np.float32(1.0)
            vs = np.float32(1.0)
            if s > M:
                Mold = M
                M = s
                ms_ = np.float32(math.exp(Mold - M))
                if acc_f16:
                    for i in range(Dv):
                        acc[i] = _h_old(acc[i] * ms_)
                else:
                    for i in range(Dv):
                        acc[i] *= ms_
            else:
                vs = np.float32(math.exp(s - M))
            vb = vo + ic * vs_[1] + ik2 * vs_[2] + ik3 * vs_[3]
            vrow = v[vb: vb + Dv]
            if acc_f16:
                for i in range(Dv):
                    acc[i] = _h_old(acc[i] + as_f32(vrow[i]) * vs)
            else:
                for i in range(Dv):
                    acc[i] += as_f32(vrow[i]) * vs
            S = S * ms_ + vs
        inv = np.float32(0.0) if S == 0 else np.float32(1.0) / S
        db = do + h * ds[1] + t * ds[2] + b * ds[3]
        for i in range(Dv):
            d[db + i * ds[0]] = acc[i] * inv


@njit(cache=True)
def old_swiglu(g, u, d):
    for i in range(d.size):
        x = g[i]
        d[i] = x / (np.float32(1.0) + np.float32(math.exp(-x))) * u[i]


@njit(cache=True)
def old_silu(x, y):
    for i in range(x.size):
        y[i] = x[i] / (np.float32(1.0) + np.float32(math.exp(-x[i])))


@njit(cache=True)
def old_softmax(x, y, n0, scale):
    for r in range(x.size // n0):
        b = r * n0
        vmax = np.float32(-np.inf)
        for i in range(n0):
            y[b + i] = x[b + i] * scale
            vmax = max(vmax, y[b + i])
        acc = 0.0
        for i in range(n0):
            e = np.float32(math.exp(y[b + i] - vmax))
            y[b + i] = e
            acc += np.float64(e)
        inv = np.float32(1.0 / acc)
        for i in range(n0):
            y[b + i] *= inv


# --- cases ---------------------------------------------------------------------------------------
def attention_case(cpu, D: int, H: int, Hk: int, T: int, n_kv: int, window: int | None, n_threads: int):
    """(new launch, old launch, live (row, key) pairs, K/V bytes a query row group reads, outputs)."""
    ctx = ggx.Context()
    q = ctx.tensor(GType.F32, (D, T, H), name="q")
    k = ctx.tensor(GType.F16, (D, n_kv, Hk), name="k")
    v = ctx.tensor(GType.F16, (D, n_kv, Hk), name="v")
    m = ctx.tensor(GType.F16, (n_kv, T), name="mask")
    out = ctx.flash_attn_ext(q, k, v, m, 1 / math.sqrt(D), prec="f32")
    rng = np.random.default_rng(0)
    pos = np.arange(T)[:, None] + (n_kv - T)
    keys = np.arange(n_kv)[None, :]
    visible = keys <= pos
    if window is not None:
        visible &= keys > pos - window
    inputs = {q: rng.standard_normal((H, T, D)), k: rng.standard_normal((Hk, n_kv, D)),
              v: rng.standard_normal((Hk, n_kv, D)), m: np.where(visible, 0.0, -np.inf).astype(np.float32)}
    ggx.compute(out, inputs, device=cpu)
    new = device.kernel_for(out.op)(out, n_threads)
    op = "FLASH_ATTN_EXT"
    qq, qo, qs, qne = elems(q, "q", op)
    kk, ko, ks, kne = elems(k, "k", op)
    vv, vo, vs, vne = elems(v, "v", op)
    mm, mo, ms, mne = elems(m, "mask", op)
    dd, do, ds, _ = elems(out, "dst", op)
    exact = T < 64
    old_args = (np.float32(1 / math.sqrt(D)), np.float32(0.0), alibi_slopes(H, 0.0), exact, exact,
                qq, qo, qs, qne, kk, ko, ks, kne, vv, vo, vs, vne, True, mm, mo, ms, mne, dd, do, ds)

    def old():
        numba.set_num_threads(n_threads)
        old_flash_attn_kernel(*old_args)

    def result():
        return dd[do: do + out.nelements].copy()
    live = int(visible.sum()) * H
    kv_bytes = int(visible.any(axis=0).sum()) * Hk * D * 2 * 2
    return new, old, live, kv_bytes, result


def timed(fn, reps: int, threads: int) -> float:
    clock = time.thread_time if threads == 1 else time.perf_counter
    t0 = clock()
    for _ in range(reps):
        fn()
    return (clock() - t0) / reps


def side_by_side(old, new, rounds: int, threads: int, budget: float = 0.2) -> tuple[float, float]:
    """Median seconds per call of old and new, alternating in every round."""
    old()
    new()
    reps = max(1, int(budget / max(timed(new, 1, threads), 1e-6)))
    t_old, t_new = [], []
    for _ in range(rounds):
        t_old.append(timed(old, reps, threads))
        t_new.append(timed(new, reps, threads))
    return statistics.median(t_old), statistics.median(t_new)


def row_ops(threads: int, rounds: int) -> None:
    """SOFT_MAX, SILU, GLU through the plugin's launches against the previous scalar-exp loops."""
    cpu = backend_reg().devices()[0]
    rng = np.random.default_rng(1)
    ctx = ggx.Context()
    a = ctx.tensor(GType.F32, (3072, 512), name="gate_up")
    sm_in = ctx.tensor(GType.F32, (512, 512, 9), name="kq")
    silu_in = ctx.tensor(GType.F32, (1536, 512), name="x")
    glu, sm, silu = ctx.swiglu(a), ctx.soft_max(sm_in, None, 0.125), ctx.silu(silu_in)
    inputs = {a: rng.uniform(-6, 6, (512, 3072)), sm_in: rng.uniform(-4, 4, (9, 512, 512)),
              silu_in: rng.uniform(-6, 6, (512, 1536))}
    ggx.compute([glu, sm, silu], inputs, device=cpu)
    g = inputs[a].astype(np.float32)
    gate, up = np.ascontiguousarray(g[:, :1536]).ravel(), np.ascontiguousarray(g[:, 1536:]).ravel()
    x_sm = inputs[sm_in].astype(np.float32).ravel()
    x_silu = inputs[silu_in].astype(np.float32).ravel()
    out = np.empty(512 * 512 * 9, np.float32)
    cases = [("GLU swiglu 1536x512", glu, lambda: old_swiglu(gate, up, out[: gate.size]), gate.size),
             ("SOFT_MAX 512x512x9", sm, lambda: old_softmax(x_sm, out, 512, np.float32(0.125)), x_sm.size),
             ("SILU 1536x512", silu, lambda: old_silu(x_silu, out[: x_silu.size]), x_silu.size)]
    print(f"\nrow ops, {threads} thread(s) (the previous forms single-threaded):")
    print(f"  {'op':24s} {'old ms':>9s} {'new ms':>9s} {'old/new':>8s} {'new Gelem/s':>12s}")
    for name, node, old, n in cases:
        new = device.kernel_for(node.op)(node, threads)
        t_old, t_new = side_by_side(old, new, rounds, 1 if threads == 1 else threads)
        print(f"  {name:24s} {t_old * 1e3:9.3f} {t_new * 1e3:9.3f} {t_old / t_new:7.2f}x {n / t_new / 1e9:12.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="also measure this many threads (default: 1 only)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    cpu = backend_reg().devices()[0]
    models = {"smollm2": (64, 9, 3, None), "gemma3": (256, 4, 1, 512)}
    cases = [(name, 512, 512) for name in models]
    kvs = (256, 4096) if args.quick else (256, 1024, 4096)
    cases += [(name, 1, n_kv) for name in models for n_kv in kvs]
    thread_counts = sorted({1, args.threads})
    print(f"ISA variant {__import__('ggx_cpu').isa.active()}; medians of {rounds} alternating rounds")
    for threads in thread_counts:
        print(f"\nFLASH_ATTN_EXT, {threads} thread(s):")
        print(f"  {'model':8s} {'T':>4s} {'n_kv':>5s} {'mask':>7s} {'old ms':>9s} {'new ms':>9s} {'old/new':>8s} "
              f"{'GFLOPS':>7s} {'K/V GB/s':>9s} {'max|diff|':>10s}")
        for name, T, n_kv in cases:
            D, H, Hk, window = models[name]
            for win in ((None, window) if window and T == 1 else (window,)):
                new, old, live, kv_bytes, result = attention_case(cpu, D, H, Hk, T, n_kv, win, threads)
                new()
                a = result()
                old()
                diff = float(np.abs(result() - a).max())
                t_old, t_new = side_by_side(old, new, rounds, threads)
                gbs = f"{kv_bytes / t_new / 1e9:9.1f}" if T == 1 else f"{'':9s}"
                mask = f"swa{win}" if win else "causal"
                print(f"  {name:8s} {T:4d} {n_kv:5d} {mask:>7s} {t_old * 1e3:9.3f} {t_new * 1e3:9.3f} "
                      f"{t_old / t_new:7.2f}x {4 * D * live / t_new / 1e9:7.1f} {gbs} {diff:10.2e}")
        row_ops(threads, rounds)


if __name__ == "__main__":
    main()
