"""numpy models of the integer-product kernels (quantize.cu, mmvq.cu, mmq.cu), for cuda_testing's
MODELS: each executes a planned launch from its arguments bound by parameter name.

* the quantizers reproduce the kernels' recipes bit for bit (the warp's butterfly sum included),
  so a host run of the .cu source must equal them byte for byte;
* the products are float64 over the exact integer dot products: the weights dequantized as gguf
  does, the activations as q * d with their f16 d (MMQ: float d); where a kernel multiplies a
  weight's offset or min by the block's stored f16 sum s = d * sum(q) rather than the f32 d times
  the integer sum (MMVQ: Q4_0, Q4_1, Q5_0; MMQ: the DS4 types, Q4_K / Q5_K included; MMVQ's Q4_K /
  Q5_K sum the quants, as ggml's vec_dot_q4_K_q8_1_impl_vmmq does), the model does too. So a
  kernel run differs from its model only by float32 rounding. The MMQ model splits the work over
  the grid's blocks as the kernel's stream-K loop does, partial tiles into the fixup buffer, and
  the fixup model adds them.
"""
from __future__ import annotations

import cuda_testing as ct
import numpy as np

from ggx.quants import dequantize, fp32_to_fp16
from ggx.types import GType

F32 = np.float32
Q8_1 = np.dtype([("d", "<u2"), ("s", "<u2"), ("qs", "i1", 32)])
Q8_1_MMQ = np.dtype([("ds", "<u4", 4), ("qs", "i1", 128)])

#: the weight type of each MMVQ dot-product struct and MMQ loader
MMVQ_TYPES = {"mmvq_q4_0": GType.Q4_0, "mmvq_q4_1": GType.Q4_1, "mmvq_q5_0": GType.Q5_0, "mmvq_q8_0": GType.Q8_0,
              "mmvq_q4_K": GType.Q4_K, "mmvq_q5_K": GType.Q5_K, "mmvq_q6_K": GType.Q6_K}
MMQ_TYPES = {k.replace("mmvq", "mmq"): t for k, t in MMVQ_TYPES.items()}
MMQ_DS4 = (GType.Q4_0, GType.Q4_1, GType.Q4_K, GType.Q5_K)
MMQ_I, ITER_K = 128, 256


# --- activations -----------------------------------------------------------------------------------
def warp_sum(x: np.ndarray) -> np.ndarray:
    """ggx_warp_sum over the last axis (32 lanes): the xor butterfly, in float32."""
    v = x.astype(F32)
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return v[..., 0]


def round_away(v: np.ndarray) -> np.ndarray:
    """roundf: halves away from zero."""
    v = v.astype(np.float64)
    return (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)


def q8_1_groups(x: np.ndarray, mmq: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int8, d float32, s float32) of 32-value groups x[..., 32]: quantize_q8_1's recipe
    (d = amax / 127, q = roundf(x / d)), or with `mmq` quantize_mmq_q8_1's (d_inv = 127 / amax,
    q = roundf(x * d_inv), d = 1 / d_inv); s = d * sum(q) (ggml-cpu's, not ggml-cuda's float sum
    of x). A zero group: q = 0, d = 0, s = 0."""
    x = x.astype(F32)
    amax = np.abs(x).max(axis=-1)
    zero = amax == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        if mmq:
            d_inv = F32(127) / amax
            q = round_away(x * d_inv[..., None])
            d = np.where(zero, F32(0), F32(1) / d_inv)
        else:
            d = amax / F32(127)
            q = round_away(x / d[..., None])
    q[zero] = 0
    d = d.astype(F32)
    return q, d, (d * warp_sum(q.astype(F32))).astype(F32)


def model_quantize_q8_1(launch, a: dict, ctx) -> None:
    K, ne1, ne2, ncols = int(a["K"]), int(a["ne1"]), int(a["ne2"]), int(a["ncols"])
    assert launch.grid[0] * launch.block[0] >= K and K % 32 == 0
    nb = (int(a["nb1"]), int(a["nb2"]), int(a["nb3"]))
    cols = [ct._rows(c, ne1, ne2) for c in range(ncols)]
    x = np.stack([ct._row(ctx.mem, a["x"], i, (4, *nb), K) for i in cols])
    q, d, s = q8_1_groups(x.reshape(ncols, K // 32, 32))
    out = ctx.mem.view(int(a["y"]), (ncols * K // 32 * 36,), (1,), np.uint8).view(Q8_1).reshape(ncols, K // 32)
    out["d"], out["s"], out["qs"] = fp32_to_fp16(d).view(np.uint16), fp32_to_fp16(s).view(np.uint16), q


def _ints(ctx, addr, n: int) -> np.ndarray:
    return ctx.mem.view(int(addr), (n,), (4,), np.int32).copy()


def model_quantize_mmq(launch, a: dict, ctx) -> None:
    ds4 = ct._template_args(launch.kernel.name)[0] == "true"
    nkb, ne1, nz = launch.grid
    K, ne2, ne1_src = int(a["K"]), int(a["ne2"]), int(a["ne1_src"])
    assert launch.block == (128, 1, 1) and nkb * 128 >= K and nkb % 2 == 0
    nb = (4, int(a["nb1"]), int(a["nb2"]), int(a["nb3"]))
    ids = _ints(ctx, a["ids"], ne1) if int(a["ids"]) else None
    assert ids is None or nz == 1
    x = np.zeros((nz, ne1, nkb * 128), F32)
    for z in range(nz):
        for i1 in range(ne1):
            i = (i1, z % ne2, z // ne2) if ids is None else (int(ids[i1]) % ne1_src, int(ids[i1]) // ne1_src, 0)
            x[z, i1, :K] = ct._row(ctx.mem, a["x"], i, nb, K)
    q, d, s = q8_1_groups(x.reshape(nz, ne1, nkb, 4, 32), mmq=True)
    out = ctx.mem.view(int(a["y"]), (nz * nkb * ne1 * 144,), (1,), np.uint8).view(Q8_1_MMQ).reshape(nz, nkb, ne1)
    out["qs"] = q.transpose(0, 2, 1, 3, 4).reshape(nz, nkb, ne1, 128)
    d, s = d.transpose(0, 2, 1, 3), s.transpose(0, 2, 1, 3)
    if ds4:
        out["ds"] = fp32_to_fp16(d).view(np.uint16).astype(np.uint32) | (
            fp32_to_fp16(s).view(np.uint16).astype(np.uint32) << 16)
    else:
        out["ds"] = d.view(np.uint32)


# --- weights ---------------------------------------------------------------------------------------
def _k_mins(scales: np.ndarray) -> np.ndarray:
    """The 6-bit mins of the 8 sub-blocks of Q4_K / Q5_K super-blocks (get_scale_min_k4)."""
    s = scales.astype(np.int64)
    lo = s[:, 4:8] & 63
    hi = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return np.concatenate([lo, hi], axis=1)


def group_offsets(raw: np.ndarray, gtype: GType) -> np.ndarray:
    """Per 32 values of each row of raw blocks [rows, bytes]: the constant a weight adds to q * scale
    (Q4_0: -8 d, Q4_1: m, Q5_0: -16 d, Q4_K / Q5_K: -dmin * min; 0 for Q8_0, Q6_K)."""
    blocks = raw.reshape(-1).view(gtype.block_dtype).reshape(raw.shape[0], -1)
    if gtype in (GType.Q4_0, GType.Q5_0):
        return blocks["d"].astype(np.float64) * (-8.0 if gtype is GType.Q4_0 else -16.0)
    if gtype is GType.Q4_1:
        return blocks["m"].astype(np.float64)
    if gtype in (GType.Q4_K, GType.Q5_K):
        dmin = blocks["dmin"].astype(np.float64)[..., None]
        mins = _k_mins(blocks["scales"].reshape(-1, 12)).reshape(*blocks.shape, 8)
        return (-dmin * mins).reshape(raw.shape[0], -1)
    return np.zeros((raw.shape[0], raw.shape[1] // gtype.type_size * gtype.block_size // 32))


#: the weight types whose offset / min MMVQ multiplies by the q8_1 block's stored sum s
MMVQ_USES_S = (GType.Q4_0, GType.Q4_1, GType.Q5_0)


def product(raw_x: np.ndarray, gtype: GType, yq: np.ndarray, yd: np.ndarray, ys: np.ndarray | None) -> np.ndarray:
    """Rows of raw weight blocks [M, bytes] times q8_1 columns (q [N, K], d [N, K / 32]) as the
    integer kernels compute it, in float64: [N, M]. With `ys` (the stored sums [N, K / 32]), the
    weight's offsets multiply s instead of d * sum(q)."""
    M, K = raw_x.shape[0], yq.shape[1]
    w = dequantize(raw_x.reshape(-1), gtype, M * K).astype(np.float64).reshape(M, K)
    yv = yq.astype(np.float64) * np.repeat(yd.astype(np.float64), 32, axis=1)
    out = yv @ w.T
    if ys is not None:
        exact_sum = (yq.reshape(len(yq), -1, 32).astype(np.float64).sum(axis=2)) * yd
        out += (ys.astype(np.float64) - exact_sum) @ group_offsets(raw_x, gtype).T  # offsets [M, K / 32]
    return out


def model_mmvq(launch, a: dict, ctx) -> None:
    name, ncols, nwarps, rpb = ct._template_args(launch.kernel.name)
    gtype, ncols, nwarps, rpb = MMVQ_TYPES[name], int(ncols), int(nwarps), int(rpb)
    assert launch.block == (32, nwarps, 1)
    nrows, bpr, block_bytes = int(a["nrows"]), int(a["blocks_per_row"]), int(a["block_bytes"])
    assert block_bytes == gtype.type_size
    assert (launch.grid[0] - 1) * rpb < nrows <= launch.grid[0] * rpb, "the grid does not cover the rows"
    K, nyb = bpr * gtype.block_size, bpr * gtype.block_size // 32
    mem = ctx.mem
    for sample in range(launch.grid[2]):
        for channel in range(launch.grid[1]):
            xs = (int(a["x"]) + sample // int(a["sample_ratio"]) * int(a["stride_sample_x"])
                  + channel // int(a["channel_ratio"]) * int(a["stride_channel_x"]))
            raw = np.stack([mem.view(xs + r * int(a["stride_row_x"]), (bpr * block_bytes,), (1,), np.uint8)
                            for r in range(nrows)])
            ys = int(a["y"]) + (sample * int(a["stride_sample_y"]) + channel * int(a["stride_channel_y"])) * 36
            y = np.stack([mem.view(ys + j * int(a["stride_col_y"]) * 36, (nyb * 36,), (1,), np.uint8).view(Q8_1)
                          for j in range(ncols)])
            yd, ysum = (y["d"].view(np.float16).astype(np.float64), y["s"].view(np.float16).astype(np.float64))
            out = product(raw, gtype, y["qs"].reshape(ncols, K), yd, ysum if gtype in MMVQ_USES_S else None)
            base = int(a["dst"]) + (sample * int(a["stride_sample_dst"]) + channel * int(a["stride_channel_dst"])) * 4
            for j in range(ncols):
                mem.view(base + j * int(a["stride_col_dst"]) * 4, (nrows,), (4,), F32)[:] = out[j]


# --- running a product both ways ---------------------------------------------------------------------
def _fill(sc, node, rng) -> None:
    """Random weight blocks (every field's bits, finite f16 scales) and activations with a zero
    group and a tiny one."""
    a, b = node.src
    nblocks = a.nelements // a.type.block_size
    sc.mem.view(sc.ptr(a), (a.nbytes,), (1,), np.uint8)[:] = ct.random_blocks(rng, a.type, nblocks).reshape(-1)
    x = rng.standard_normal(tuple(reversed(b.ne))).astype(np.float32)
    x[..., :32] = 0  # a zero group: d = 0, q = 0
    x[..., 32:64] *= np.float32(1e-3)
    sc.array(b, np.float32)[:] = x


def reference(node, sc) -> np.ndarray:
    """The float64 product of the node's weights (dequantized) and activations in sc's memory: what
    the kernels approximate with 8-bit activations, computed without splitting anything."""
    a, b = node.src
    K, M = a.ne[:2]
    raw = sc.mem.view(sc.ptr(a), (a.nbytes,), (1,), np.uint8)
    w = dequantize(raw.copy(), a.type, a.nelements).astype(np.float64).reshape(a.ne[3], a.ne[2], M, K)
    x = sc.array(b, np.float32).astype(np.float64)  # [B3, B2, N, K]
    w = np.repeat(np.repeat(w, b.ne[3] // a.ne[3], axis=0), b.ne[2] // a.ne[2], axis=1)
    return x @ np.swapaxes(w, -1, -2)


def run_host_and_model(node, device=ct.H100, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A MUL_MAT node's planned launches on the host-built kernels, then on the models, over the same
    inputs (the quantized activations must be equal byte for byte): (host out, model out). Both
    must also be the plain product (`reference`) up to the activations' 8-bit rounding (NMSE 5e-4,
    ggml's bound for it): so a split of the work that loses or repeats a part cannot pass."""
    from ggx_cuda.ops import matmul

    sc = ct.StubCtx(device)
    _fill(sc, node, np.random.default_rng(seed))
    launches = matmul.plan_mul_mat(node, sc)
    y, y_bytes = sc.scratches[0]
    outs, ys = [], []
    for host in (True, False):
        ct.run_launches(launches[:1], sc, host)
        ys.append(sc.mem.view(y, (y_bytes,), (1,), np.uint8).copy())
        ct.run_launches(launches[1:], sc, host)
        outs.append(sc.array(node, np.float32).copy())
    assert np.array_equal(ys[0], ys[1]), f"{launches[0].kernel.name} differs from its model"
    ref = reference(node, sc)
    for out in outs:
        nmse = float(((out - ref) ** 2).sum() / (ref**2).sum())
        assert nmse < 5e-4, f"NMSE {nmse} against the plain product"
    return outs[0], outs[1]


def _stream_k_ranges(total: int, nblocks: int):
    """Each block's units [start, stop) of the stream-K split."""
    return [(b * total // nblocks, (b + 1) * total // nblocks) for b in range(nblocks)]


def _tile_columns(a: dict, ctx, z: int, col0: int, J: int, ncols: int) -> tuple[int, list[int], list[int]]:
    """mmq.cu's mmq_cols: (the tile's first column in y's channel, its y columns, their dst columns)."""
    if int(a["bounds"]):
        lo, hi = _ints(ctx, int(a["bounds"]) + 4 * z, 2)
        first = int(lo) + col0
        n = max(0, min(J, int(hi) - first))
        return first, list(range(first, first + n)), [int(c) for c in _ints(ctx, a["ids_dst"], ncols)[first:first + n]]
    cols = [c for c in range(col0, col0 + J) if c < ncols]
    return col0, cols, cols


def model_mmid_group(launch, a: dict, ctx) -> None:
    E, n_used, T, b_ne1, M = (int(a[x]) for x in ("n_expert", "n_used", "n_tokens", "b_ne1", "M"))
    assert launch.grid == (1, 1, 1)
    ids = np.array([[int(ctx.mem.view(int(a["ids"]) + s * int(a["nb_ids0"]) + t * int(a["nb_ids1"]), (1,), (4,),
                                      np.int32)[0]) for s in range(n_used)] for t in range(T)])
    src1, dst, bounds = [], [], [0]
    for e in range(E):
        for t in range(T):
            for s in range(n_used):
                if ids[t, s] == e:
                    src1.append(t * b_ne1 + s % b_ne1)
                    dst.append(t * n_used + s)
        bounds.append(len(src1))
    P = n_used * T
    src1, dst = src1 + [0] * (P - len(src1)), dst + [-1] * (P - len(dst))
    for addr, v in ((a["ids_src1"], src1), (a["ids_dst"], dst), (a["bounds"], bounds)):
        ctx.mem.view(int(addr), (len(v),), (4,), np.int32)[:] = v
    for t in range(T):
        for s in range(n_used):
            if not 0 <= ids[t, s] < E:
                ctx.mem.view(int(a["dst"]) + s * int(a["nb_dst1"]) + t * int(a["nb_dst2"]), (M,), (4,), F32)[:] = np.nan


def model_mmq(launch, a: dict, ctx) -> None:
    name, jmax = ct._template_args(launch.kernel.name)
    gtype, jmax = MMQ_TYPES[name], int(jmax)
    J, K, nrows, ncols = (int(a[x]) for x in ("J", "K", "nrows", "ncols"))
    nty, ntx, ne12, total = int(a["nty"]), int(a["ntx"]), int(a["ne12"]), int(a["total"])
    assert launch.block == (32, 8, 1) and J % 8 == 0 and J <= jmax and launch.shared >= 4 * (MMQ_I * 94 + J * 84)
    ipt = (K + ITER_K - 1) // ITER_K
    nkb = 2 * ipt
    assert total == nty * ntx * (total // (nty * ntx * ipt)) * ipt
    mem, ts, bs = ctx.mem, gtype.type_size, gtype.block_size
    ds4 = gtype in MMQ_DS4
    for b, (start, stop) in enumerate(_stream_k_ranges(total, launch.grid[0])):
        kbc = start
        while kbc < stop:
            tile, k0 = divmod(kbc, ipt)
            k1 = min(ipt, k0 + stop - kbc)
            row0, col0, z = tile % nty * MMQ_I, tile // nty % ntx * J, tile // (nty * ntx)
            i2, i3 = z % ne12, z // ne12
            _, cols, dst_cols = _tile_columns(a, ctx, z, col0, J, ncols)
            if not cols:  # an expert with fewer columns: skipped
                kbc += k1 - k0
                continue
            xs = (int(a["x"]) + i3 // int(a["sample_ratio"]) * int(a["stride_sample_x"])
                  + i2 // int(a["channel_ratio"]) * int(a["stride_channel_x"]))
            rows = [min(row0 + i, nrows - 1) for i in range(MMQ_I)]
            zy = 0 if int(a["bounds"]) else z
            part = np.zeros((J, MMQ_I))
            for it in range(k0, k1):
                kk = min(ITER_K, K - it * ITER_K)  # values of this slice
                off = it * ITER_K // bs * ts
                raw = np.stack([mem.view(xs + r * int(a["stride_row_x"]) + off, (kk // bs * ts,), (1,), np.uint8)
                                for r in rows])
                blocks = mem.view(int(a["y"]) + ((zy * nkb + 2 * it) * ncols) * 144, (2 * ncols * 144,), (1,),
                                  np.uint8).view(Q8_1_MMQ).reshape(2, ncols)[:, cols]
                yq = blocks["qs"].transpose(1, 0, 2).reshape(len(cols), 256)[:, :kk]
                ds = blocks["ds"].transpose(1, 0, 2).reshape(len(cols), 8)[:, :kk // 32]
                if ds4:
                    yd = (ds & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
                    ysum = (ds >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
                else:
                    yd, ysum = ds.view(F32).astype(np.float64), None
                part[:len(cols)] += product(raw, gtype, yq, yd, ysum)
            if k1 == ipt:
                out = int(a["dst"]) + (i3 * int(a["stride_sample_dst"]) + i2 * int(a["stride_channel_dst"])) * 4
                for j, c in enumerate(dst_cols):
                    n = min(MMQ_I, nrows - row0)
                    mem.view(out + (c * int(a["stride_col_dst"]) + row0) * 4, (n,), (4,), F32)[:] = part[j, :n]
            else:
                mem.view(int(a["fixup"]) + b * MMQ_I * J * 4, (J, MMQ_I), (MMQ_I * 4, 4), F32)[:] = part
            kbc += k1 - k0


def model_mmq_fixup(launch, a: dict, ctx) -> None:
    K, J, nrows, ncols = (int(a[x]) for x in ("K", "J", "nrows", "ncols"))
    nty, ntx, ne12, total = int(a["nty"]), int(a["ntx"]), int(a["ne12"]), int(a["total"])
    ipt = (K + ITER_K - 1) // ITER_K
    ranges = _stream_k_ranges(total, launch.grid[0])
    for b, (start, stop) in enumerate(ranges):
        tile = start // ipt
        if start == stop or start % ipt == 0 or stop < (tile + 1) * ipt:
            continue
        acc = np.zeros((J, MMQ_I), F32)
        for bp in range(b - 1, -1, -1):
            s0, s1 = ranges[bp]
            if s0 == s1:
                continue
            if (s1 - 1) // ipt != tile:
                break
            acc += ctx.mem.view(int(a["fixup"]) + bp * MMQ_I * J * 4, (J, MMQ_I), (MMQ_I * 4, 4), F32)
            if s0 <= tile * ipt:
                break
        row0, col0, z = tile % nty * MMQ_I, tile // nty % ntx * J, tile // (nty * ntx)
        plane = (z // ne12) * int(a["stride_sample_dst"]) + (z % ne12) * int(a["stride_channel_dst"])
        out = int(a["dst"]) + 4 * plane
        n = min(MMQ_I, nrows - row0)
        for j, c in enumerate(_tile_columns(a, ctx, z, col0, J, ncols)[2]):
            ctx.mem.view(out + (c * int(a["stride_col_dst"]) + row0) * 4, (n,), (4,), F32)[:] += acc[j, :n]


MODELS = {"k_quantize_q8_1": model_quantize_q8_1, "k_quantize_mmq": model_quantize_mmq, "k_mul_mat_vec_q": model_mmvq,
          "k_mul_mat_q": model_mmq, "k_mmq_fixup": model_mmq_fixup, "k_mmid_group": model_mmid_group}
