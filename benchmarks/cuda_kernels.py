"""ggx-cuda kernel benchmark: every figure measured side by side in one run on one GPU.

    python benchmarks/cuda_kernels.py                  # everything on CUDA0
    python benchmarks/cuda_kernels.py --quick          # fewer shapes, no model
    python benchmarks/cuda_kernels.py --skip-model     # kernels only

1. bandwidth: a device-to-device copy of 1 GiB (read + write bytes / time), the reference for (2).
2. MMVQ: weights [K 8192, M 32768] (151 MB as Q4_0: more than the L2 holds) times 1..8
   columns; GB/s of weight bytes per call (the q8_1 quantization of the columns included) and the
   ratio to (1). Target on an H200: Q4_0 at one column >= 80 % of the copy's bandwidth.
3. MMQ: [8192, 8192] weights times n = 16..512 columns; TOPS (2 M N K / time) of MMQ against
   cuBLAS over the same weights dequantized to F16 beforehand (ggml-cuda's fallback without its
   dequantization time), and the ratio.
4. flash attention: a decode step (1 row, 32 heads over 8 KV heads, head 128, 4096 keys, F16
   K/V: the vec kernel and its parallel blocks) as K/V GB/s, and a prompt of 512 rows (the tile
   kernel) as TFLOPS (4 T KV D H / time).
5. SmolLM2 (the default model, or `-m FILE`): `ggx bench` pp512 / tg128 on CUDA0 with and without CUDA graphs
   (GGX_CUDA_DISABLE_GRAPHS=1), each in its own process; the ratio. Target: decode with graphs
   faster than without.

Kernels are timed with CUDA events over repeated `graph_compute` calls of one node's graph
(captured as a CUDA graph after ggml's warm-up where it can be); every product and attention
result is first checked against numpy (NMSE), so a wrong kernel gets no figure. Without a CUDA
device the script says why and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from ggx.alloc import alloc_tensors
from ggx.graph import Context, build_graph
from ggx.quants import dequantize
from ggx.types import GType

NO_DEVICE = 2
QUANT = [GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0, GType.Q4_K, GType.Q5_K, GType.Q6_K]
NMSE_BOUND = 5e-4  # ggml's bound for quantized activations; attention is held to the same


def cuda_device(name: str):
    """The ggx CUDA device, or None with the reason."""
    from ggx_cuda.device import CudaBackendReg

    reg = CudaBackendReg()
    devices = {d.name: d for d in reg.devices()}
    if name not in devices:
        return None, reg.note or f"no device {name} (devices: {', '.join(devices) or 'none'})"
    return devices[name], ""


def random_blocks(rng, gtype: GType, nvalues: int) -> np.ndarray:
    """Random quant bytes with sane f16 scales (quantizing 268 M values in numpy would take minutes)."""
    raw = rng.integers(0, 256, (nvalues // gtype.block_size, gtype.type_size), dtype=np.uint8)
    blocks = raw.view(gtype.block_dtype).reshape(-1)
    for name in ("d", "dmin", "m"):
        if name in gtype.block_dtype.names:
            blocks[name] = rng.uniform(0.001, 0.01, blocks.shape[0]).astype(np.float16)
    return raw.reshape(-1)


class Node:
    """One node's graph on the device: its tensors allocated, inputs set, a backend to run it."""

    def __init__(self, device, out, inputs: dict):
        self.device, self.out = device, out
        self.graph = build_graph(out)
        tensors = list(self.graph.leafs) + [n for n in self.graph.nodes if n.view_src is None]
        self.buffer = alloc_tensors(device.buffer_type(), tensors)
        for t, data in inputs.items():
            t.data_buffer.set_tensor(t, np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        self.backend = device.init_backend()

    def result(self) -> np.ndarray:
        """The output in numpy order (ne reversed: [ne3, ne2, ne1, ne0])."""
        self.backend.graph_compute(self.graph)
        self.backend.synchronize()
        raw = self.out.data_buffer.get_tensor(self.out)
        return raw.view(np.float32).reshape(tuple(reversed(self.out.ne)))

    def seconds(self, iters: int) -> float:
        """Seconds per call over `iters` calls between two CUDA events (after a warm-up)."""
        import cupy as cp

        for _ in range(4):  # plans, kernels compiled and loaded, the CUDA graph captured
            self.backend.graph_compute(self.graph)
        self.backend.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(self.backend.stream)
        for _ in range(iters):
            self.backend.graph_compute(self.graph)
        end.record(self.backend.stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3 / iters

    def free(self) -> None:
        self.buffer.free()


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(((got.astype(np.float64) - want) ** 2).sum() / max((want**2).sum(), 1e-300))


def check(what: str, got: np.ndarray, want: np.ndarray) -> float:
    err = nmse(got, want)
    if not err <= NMSE_BOUND:
        raise SystemExit(f"{what}: NMSE {err:.3g} against numpy (bound {NMSE_BOUND}): no figure for a wrong kernel")
    return err


# --- 1. bandwidth ----------------------------------------------------------------------------------
def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written), best of `reps`."""
    import cupy as cp

    src, dst = cp.empty(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
    src.fill(1)
    best = float("inf")
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        dst.data.copy_from_device(src.data, nbytes)
        end.record()
        end.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
    del src, dst
    return 2 * nbytes / best / 1e9


# --- 2. MMVQ -------------------------------------------------------------------------------------------
def mul_mat_node(device, gtype: GType, K: int, M: int, N: int, raw: np.ndarray, x: np.ndarray) -> Node:
    ctx = Context()
    w, b = ctx.tensor(gtype, (K, M), "w"), ctx.tensor(GType.F32, (K, N), "x")
    return Node(device, ctx.mul_mat(w, b), {w: raw, b: x})


def reference_rows(gtype: GType, raw: np.ndarray, K: int, rows: int, x: np.ndarray) -> np.ndarray:
    """The first `rows` output rows in float64: the weights' first rows dequantized (gguf's code)."""
    w = dequantize(raw[: gtype.row_size(K) * rows], gtype, K * rows).astype(np.float64).reshape(rows, K)
    return x.astype(np.float64) @ w.T


def bench_mmvq(device, bandwidth: float, types, cols, rng) -> None:
    K, M = 8192, 32768
    print(f"\n== MMVQ: [{K}, {M}] weights x N columns; GB/s of weights, % of the copy's {bandwidth:.0f} GB/s")
    print(f"{'type':6} {'N':>3} {'MB':>7} {'us':>9} {'GB/s':>8} {'% copy':>7} {'NMSE':>9}")
    for t in types:
        raw = random_blocks(rng, t, K * M)
        for n in cols:
            x = rng.standard_normal((n, K)).astype(np.float32)
            node = mul_mat_node(device, t, K, M, n, raw, x)
            err = check(f"MMVQ {t.name} N={n}", node.result()[0, 0, :, :256], reference_rows(t, raw, K, 256, x))
            s = node.seconds(50)
            gbs = raw.nbytes / s / 1e9
            print(f"{t.name:6} {n:3d} {raw.nbytes / 1e6:7.1f} {s * 1e6:9.1f} {gbs:8.1f} {100 * gbs / bandwidth:6.1f}% "
                  f"{err:9.2e}")
            node.free()
            if t is GType.Q4_0 and n == 1:
                met = "met" if gbs >= 0.8 * bandwidth else "NOT met"
                print(f"target Q4_0 at 1 column >= 80 % of the copy's bandwidth: {met} ({100 * gbs / bandwidth:.0f} %)")


# --- 3. MMQ vs cuBLAS ----------------------------------------------------------------------------------
def bench_mmq(device, types, cols, rng) -> None:
    K = M = 8192
    print(f"\n== MMQ: [{K}, {M}] weights x N columns, TOPS; cuBLAS over the weights dequantized to F16")
    print(f"{'type':6} {'N':>4} {'MMQ TOPS':>9} {'cuBLAS':>8} {'ratio':>6} {'NMSE':>9}")
    for t in types:
        raw = random_blocks(rng, t, K * M)
        w16 = dequantize(raw, t, K * M).astype(np.float16)
        for n in cols:
            x = rng.standard_normal((n, K)).astype(np.float32)
            q = mul_mat_node(device, t, K, M, n, raw, x)
            f = mul_mat_node(device, GType.F16, K, M, n, w16.view(np.uint8), x)
            err = check(f"MMQ {t.name} N={n}", q.result()[0, 0, :, :256], reference_rows(t, raw, K, 256, x))
            ops = 2.0 * M * n * K
            tq, tf = q.seconds(20), f.seconds(20)
            print(f"{t.name:6} {n:4d} {ops / tq / 1e12:9.1f} {ops / tf / 1e12:8.1f} {tf / tq:6.2f} {err:9.2e}")
            q.free()
            f.free()


# --- 4. flash attention --------------------------------------------------------------------------------
def bench_fattn(device, rng) -> None:
    D, H, Hkv, KV = 128, 32, 8, 4096
    print(f"\n== flash attention: head {D}, {H} heads over {Hkv} KV heads, {KV} keys, F16 K/V")
    for T in (1, 512):
        ctx = Context()
        q = ctx.tensor(GType.F32, (D, T, H), "q")
        k, v = ctx.tensor(GType.F16, (D, KV, Hkv), "k"), ctx.tensor(GType.F16, (D, KV, Hkv), "v")
        mask = ctx.tensor(GType.F16, (KV, T), "mask")
        out = ctx.flash_attn_ext(q, k, v, mask, 1 / np.sqrt(D))
        qv = rng.standard_normal((H, T, D)).astype(np.float32)
        kv_ = [rng.standard_normal((Hkv, KV, D)).astype(np.float16) for _ in range(2)]
        mv = np.where(np.arange(KV)[None, :] <= KV - T + np.arange(T)[:, None], 0, -np.inf).astype(np.float16)
        node = Node(device, out, {q: qv, k: kv_[0], v: kv_[1], mask: mv})
        got = node.result()[0]  # [T, H, D]
        kk = np.repeat(kv_[0].astype(np.float64), H // Hkv, axis=0)
        vv = np.repeat(kv_[1].astype(np.float64), H // Hkv, axis=0)
        s = np.einsum("htd,hkd->htk", qv.astype(np.float64), kk) / np.sqrt(D) + mv.astype(np.float64)[None]
        p = np.exp(s - s.max(axis=2, keepdims=True))
        want = np.einsum("htk,hkd->thd", p / p.sum(axis=2, keepdims=True), vv)
        err = check(f"flash attention T={T}", got, want)
        sec = node.seconds(20 if T > 1 else 200)
        if T == 1:
            rate = f"K/V {2 * KV * D * Hkv * 2 / sec / 1e9:7.1f} GB/s"
        else:
            rate = f"{4 * T * KV * D * H / sec / 1e12:7.2f} TFLOPS"
        print(f"{'decode ' if T == 1 else 'prefill'} T={T:<3d}: {sec * 1e6:9.1f} us  {rate}  NMSE {err:.2e}")
        node.free()


# --- 5. the model, with and without CUDA graphs ---------------------------------------------------------
def bench_model(device_name: str, model: str | None) -> None:
    ggx = shutil.which("ggx", path=os.path.dirname(sys.executable)) or shutil.which("ggx")
    print(f"\n== {model or 'SmolLM2'} on {device_name}: ggx bench, tokens/s")
    rows = {}
    for label, env in (("graphs", {}), ("no graphs", {"GGX_CUDA_DISABLE_GRAPHS": "1"})):
        cmd = [ggx, "bench", "--device", device_name, "-p", "512", "-n", "128", "-r", "3", "-o", "json"]
        r = subprocess.run(cmd + (["-m", model] if model else []),
                           capture_output=True, text=True, env={**os.environ, **env})
        if r.returncode != 0:
            raise SystemExit(f"ggx bench ({label}) failed:\n{r.stderr[-2000:]}")
        rows[label] = {f"{'pp' if x['n_prompt'] else 'tg'}": x["avg_ts"] for x in json.loads(r.stdout)}
    for test in ("pp", "tg"):
        g, n = rows["graphs"][test], rows["no graphs"][test]
        print(f"{test}{512 if test == 'pp' else 128}: graphs {g:9.1f}  no graphs {n:9.1f}  ratio {g / n:5.2f}")
    met = "met" if rows["graphs"]["tg"] > rows["no graphs"]["tg"] else "NOT met"
    print(f"target decode with CUDA graphs faster than without: {met}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="CUDA0")
    p.add_argument("--quick", action="store_true", help="Q4_0 / Q4_K only, fewer columns, no model")
    p.add_argument("--skip-model", action="store_true", help="no SmolLM2 runs")
    p.add_argument("-m", "--model", default=None, help="GGUF file for the model runs (default: the default model)")
    args = p.parse_args()
    device, why = cuda_device(args.device)
    if device is None:
        print(f"benchmarks/cuda_kernels.py: cannot run: {why}. Every figure here is measured on a CUDA GPU; "
              "none was measured.", file=sys.stderr)
        return NO_DEVICE
    info = device.info
    print(f"{device.name}: {info.name}, compute capability {info.cc[0]}.{info.cc[1]}, {info.sm_count} SMs")
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    bandwidth = copy_bandwidth()
    print(f"\n== device-to-device copy: {bandwidth:.0f} GB/s (read + write)")
    types = [GType.Q4_0, GType.Q4_K] if args.quick else QUANT
    bench_mmvq(device, bandwidth, types, (1, 2, 4, 8) if args.quick else range(1, 9), rng)
    bench_mmq(device, types, (16, 128, 512) if args.quick else (16, 32, 64, 128, 256, 512), rng)
    bench_fattn(device, rng)
    if not (args.quick or args.skip_model):
        bench_model(args.device, args.model)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
