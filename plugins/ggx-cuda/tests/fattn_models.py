"""numpy models of kernels/fattn.cu for cuda_testing's MODELS, in float64 from the launch arguments:
the vec kernel's split of the keys over parallel blocks (block y: chunks y, y + P, ... of 128 keys)
with its partial rows and (max, sum) pairs, the combine kernel, and the tile kernel."""
from __future__ import annotations

import cuda_testing as ct
import numpy as np

F32 = np.float32
VEC_CHUNK = 128  # FA_VEC_CHUNK


def _kv_type(launch) -> type:
    return np.float16 if ct._template_args(launch.kernel.name)[-1] == "__half" else F32


def scores(launch, a: dict, ctx, D: int, b: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """(s [T, KV], v [KV, D]) of head h of sequence b, as the kernels define the scores."""
    mem = ctx.mem
    T, KV, gqa, r3 = (int(a[x]) for x in ("T", "KV", "gqa", "r3"))
    kt = _kv_type(launch)
    q = mem.view(int(a["q"]) + h * int(a["nbq2"]) + b * int(a["nbq3"]), (T, D), (int(a["nbq1"]), 4), F32)
    hk, bk = h // gqa, b // r3
    es = np.dtype(kt).itemsize
    k = mem.view(int(a["k"]) + hk * int(a["nbk2"]) + bk * int(a["nbk3"]), (KV, D), (int(a["nbk1"]), es), kt)
    v = mem.view(int(a["v"]) + hk * int(a["nbv2"]) + bk * int(a["nbv3"]), (KV, D), (int(a["nbv1"]), es), kt)
    s = (q.astype(np.float64) * float(a["scale"])) @ k.astype(np.float64).T
    if a["softcap"] != 0:
        s = float(a["softcap"]) * np.tanh(s)
    if int(a["mask"]):
        m = mem.view(int(a["mask"]) + (b % int(a["mask_ne3"])) * int(a["nbm3"]), (T, KV), (int(a["nbm1"]), 2),
                     np.float16)
        s = s + ct._alibi_slope(h, a) * m.astype(np.float64)
    return s, v.astype(np.float64)


def softmax_parts(s: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unnormalized rows, max, sum) of the keys given: weights exp(s - max); a row without a finite
    max has weight 0 everywhere (sum 0)."""
    mx = np.max(s, axis=1, initial=-np.inf)
    e = np.exp(s - np.where(mx == -np.inf, 0.0, mx)[:, None])
    e[mx == -np.inf] = 0.0
    return e @ v, mx, e.sum(axis=1)


def _rows(a: dict, D: int, addr: int, b: int, h: int, T: int, H: int, ctx) -> np.ndarray:
    """out's rows (b, t, h) for t < T: row r = (b T + t) H + h of D floats."""
    return ctx.mem.view(addr + ((b * T) * H + h) * D * 4, (T, D), (H * D * 4, 4), F32)


def model_fattn_vec(launch, a: dict, ctx) -> None:
    D, ncols, _ = ct._template_args(launch.kernel.name)
    D, ncols = int(D), int(ncols)
    T, H, KV = int(a["T"]), int(a["H"]), int(a["KV"])
    ntiles, P, HB = launch.grid
    assert launch.block == (128, 1, 1) and ntiles * ncols >= T > (ntiles - 1) * ncols and HB % H == 0
    for b in range(HB // H):
        for h in range(H):
            s, v = scores(launch, a, ctx, D, b, h)
            if P == 1:
                num, _, den = softmax_parts(s, v)
                _rows(a, D, int(a["dst"]), b, h, T, H, ctx)[:] = np.divide(
                    num, den[:, None], out=np.zeros_like(num), where=den[:, None] != 0)
                continue
            rows = (b * T + np.arange(T)) * H + h
            for y in range(P):
                keys = [j for j in range(KV) if (j // VEC_CHUNK) % P == y]
                num, mx, den = softmax_parts(s[:, keys], v[keys])
                for t, r in enumerate(rows):
                    ctx.mem.view(int(a["parts"]) + (r * P + y) * D * 4, (D,), (4,), F32)[:] = num[t]
                    ctx.mem.view(int(a["meta"]) + (r * P + y) * 8, (2,), (4,), F32)[:] = (mx[t], den[t])


def model_fattn_combine(launch, a: dict, ctx) -> None:
    T, H, B = launch.grid
    D, P = int(a["D"]), int(a["P"])
    for r in range(T * H * B):
        parts = ctx.mem.view(int(a["parts"]) + r * P * D * 4, (P, D), (D * 4, 4), F32).astype(np.float64)
        meta = ctx.mem.view(int(a["meta"]) + r * P * 8, (P, 2), (8, 4), F32).astype(np.float64)
        mx = meta[:, 0].max(initial=-np.inf)
        w = np.where(meta[:, 0] == -np.inf, 0.0, np.exp(meta[:, 0] - (0.0 if mx == -np.inf else mx)))
        den = (w * meta[:, 1]).sum()
        ctx.mem.view(int(a["dst"]) + r * D * 4, (D,), (4,), F32)[:] = 0.0 if den == 0 else (w @ parts) / den


def model_fattn_tile(launch, a: dict, ctx) -> None:
    D = int(ct._template_args(launch.kernel.name)[0])
    T, H = int(a["T"]), int(a["H"])
    ntiles, HB, _ = launch.grid
    assert launch.block == (256, 1, 1) and ntiles * 16 >= T > (ntiles - 1) * 16
    for b in range(HB // H):
        for h in range(H):
            s, v = scores(launch, a, ctx, D, b, h)
            num, _, den = softmax_parts(s, v)
            _rows(a, D, int(a["dst"]), b, h, T, H, ctx)[:] = np.divide(
                num, den[:, None], out=np.zeros_like(num), where=den[:, None] != 0)


MODELS = {"k_fattn_vec": model_fattn_vec, "k_fattn_combine": model_fattn_combine, "k_fattn_tile": model_fattn_tile}
