"""The float MUL_MAT kernel (F32 / F16 / BF16 weights): gemv, 4 x 4 register tiles and their
edges (leftover rows, leftover columns, K not a multiple of the vector width, row blocks cut
short by a large K), against float64 numpy on the same rounded inputs; directly and through
mul_mat / mul_mat_id."""
from __future__ import annotations

import numpy as np
import pytest

import ggx
from ggx.host import HostBufferType, tensor_array
from ggx.types import GType
from ggx_cpu.kernels import matmul
from ggx_cpu.kernels.matmul_float import RB_MAX, float_mm, rows_per_task

FLOAT_TYPES = [GType.F32, GType.F16, GType.BF16]


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (ggml's conversion, finite values)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def weights(gtype: GType, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the kernel's flat weight array, its exact values as float64) for float32 values x."""
    if gtype is GType.F32:
        return x.astype(np.float32).reshape(-1), x.astype(np.float32).astype(np.float64)
    if gtype is GType.F16:
        h = x.astype(np.float16)
        return h.view(np.uint16).reshape(-1), h.astype(np.float64)
    b = bf16_bits(x)
    return b.view(np.int16).reshape(-1), (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def rounded(gtype: GType, x: np.ndarray) -> np.ndarray:
    """Activations as matmul hands them to the kernel: rounded to the weight's type, as float32."""
    if gtype is GType.F32:
        return x.astype(np.float32)
    if gtype is GType.F16:
        return x.astype(np.float16).astype(np.float32)
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sum((out - ref) ** 2) / max(np.sum(ref ** 2), 1e-30))


def run_kernel(gtype: GType, M: int, K: int, n_cols: list[int], seed: int = 0, n_threads: int = 2,
               pad: int = 0):
    """float_mm over len(n_cols) groups (group g: its own M x K matrix, n_cols[g] columns), with
    activation rows and output rows scattered (shuffled ycol / ocol, as MUL_MAT_ID does); weight
    rows `pad` elements longer than K. Returns (out as [columns, M], float64 reference)."""
    import numba

    rng = np.random.default_rng(seed)
    G, N = len(n_cols), sum(n_cols)
    wrs = K + pad
    x = rng.standard_normal((G, M, wrs)).astype(np.float32)
    w, wv = weights(gtype, x)
    wv = wv.reshape(G, M, wrs)[:, :, :K]
    y = rounded(gtype, rng.standard_normal((N + 1, K)).astype(np.float32))  # one row nobody reads
    wg = np.arange(G, dtype=np.int64) * M * wrs
    cstart = np.concatenate([[0], np.cumsum(n_cols)]).astype(np.int64)
    ycol = rng.permutation(N + 1)[:N].astype(np.int64)
    ocol = rng.permutation(N).astype(np.int64)
    out = np.full(N * M + 8, np.float32(1e30))  # unwritten outputs show; the tail must stay untouched
    numba.set_num_threads(min(n_threads, numba.config.NUMBA_NUM_THREADS))
    float_mm(0, 1, w, wg, wrs, M, y.reshape(-1), K, cstart, ycol, ocol, out)
    assert np.all(out[N * M:] == np.float32(1e30)), "kernel wrote past the last output row"
    ref = np.empty((N, M))
    for g in range(G):
        for c in range(cstart[g], cstart[g + 1]):
            ref[ocol[c]] = wv[g] @ y[ycol[c]].astype(np.float64)
    return out[:N * M].reshape(N, M), ref


@pytest.mark.parametrize("gtype", FLOAT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M, K, N", [
    (32, 256, 8),    # full 16-row tasks, full 4 x 4 tiles
    (21, 200, 11),   # a 5-row last task (one partial quad), 3 leftover columns, K % 16 == 8
    (6, 67, 5),      # one task of 6 rows, K % 8 == 3 (scalar tail in tiles and row dots)
    (3, 9, 4),       # fewer rows than one quad, K just above one vector
    (13, 40, 1),     # gemv: 13 rows from the weights directly
    (10, 133, 2),    # 2 columns: 2 x 3 tiles from the weights (third column a repeat)
    (7, 45, 3),      # 3 columns, a lone last row (2 x 3 tile on a repeated row), K % 8 == 5
    (9, 5, 6),       # K below one vector: tails only
])
def test_kernel_vs_float64(gtype, M, K, N):
    out, ref = run_kernel(gtype, M, K, [N], seed=M * K + N)
    assert nmse(out, ref) < 1e-10
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("gtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_groups_scattered_columns_and_padded_rows(gtype):
    """Several groups (MUL_MAT_ID's experts / MUL_MAT's batches) with 0, 1, 2, 4 and 7 columns,
    shuffled activation and output rows, weight rows longer than K."""
    out, ref = run_kernel(gtype, 19, 72, [3, 0, 1, 7, 2, 4], seed=5, pad=24)
    assert nmse(out, ref) < 1e-10
    for c in range(ref.shape[0]):
        assert nmse(out[c], ref[c]) < 1e-10, c


def test_large_k_shrinks_the_row_block():
    """K above 4096 cuts tasks to fewer than 16 rows (12 here, then 8, 4); results unchanged."""
    assert rows_per_task(4096) == RB_MAX
    assert rows_per_task(5000) == 12
    assert rows_per_task(14336) == 4
    assert rows_per_task(1 << 20) == 4 and rows_per_task(0) == RB_MAX
    out, ref = run_kernel(GType.F16, 27, 5000, [6, 1], seed=9)
    assert nmse(out, ref) < 1e-10


def test_gemm_agrees_with_gemv_and_threads_are_deterministic():
    """A column's result does not depend on how many columns share its group beyond float32
    summation order, and 1 or 2 threads give identical bits (each output has one owner)."""
    gemm, ref = run_kernel(GType.F16, 37, 300, [9], seed=3, n_threads=1)
    gemm2, _ = run_kernel(GType.F16, 37, 300, [9], seed=3, n_threads=2)
    np.testing.assert_array_equal(gemm, gemm2)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((37, 300)).astype(np.float32)
    w, wv = weights(GType.F16, x)
    y = rounded(GType.F16, rng.standard_normal((9, 300)).astype(np.float32))
    i64 = np.int64
    cols = np.arange(9, dtype=i64)
    many = np.zeros(9 * 37, np.float32)
    float_mm(0, 1, w, np.zeros(1, i64), 300, 37, y.reshape(-1), 300, np.array([0, 9], i64), cols, cols, many)
    for c in range(9):
        alone = np.zeros(37, np.float32)
        float_mm(0, 1, w, np.zeros(1, i64), 300, 37, y.reshape(-1), 300, np.array([0, 1], i64),
                 np.array([c], i64), np.array([0], i64), alone)
        np.testing.assert_allclose(many.reshape(9, 37)[c], alone, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(alone, wv @ y[c].astype(np.float64), rtol=1e-4, atol=1e-4)


def test_f16_conversion_is_exact_for_subnormal_and_extreme_halves():
    """Every finite half converts exactly (F16C or integer path): subnormals, +-65504, zeros."""
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 6.1e-5, 3e-5, 65504.0, -65504.0, 1.0, -2.5,
                        1e-3, 0.333, 1024.0, -7e-6, 5.96e-8, 2.0], np.float16)
    K = special.size
    w = np.stack([special, special[::-1]]).view(np.uint16)  # 2 rows
    eye = np.eye(K, dtype=np.float32)  # column j picks weight j of every row
    cols = np.arange(K, dtype=np.int64)
    for n in (1, K):  # gemv (converted in registers) and gemm (converted rows)
        out = np.zeros(K * 2, np.float32)
        float_mm(0, 1, w.reshape(-1), np.zeros(1, np.int64), K, 2, eye.reshape(-1), K,
                 np.array([0, n], np.int64), cols[:n], cols[:n], out)
        got = out.reshape(K, 2)[:n]
        np.testing.assert_array_equal(got[:, 0], special[:n].astype(np.float32))
        np.testing.assert_array_equal(got[:, 1], special[::-1][:n].astype(np.float32))


# --- through the ops ------------------------------------------------------------------------------
def alloc(*tensors: ggx.Tensor) -> None:
    roots = list(dict.fromkeys(t.root for t in tensors))
    size = sum(-(-r.nbytes // 64) * 64 + 64 for r in roots)
    buf = HostBufferType(None).alloc_buffer(size)
    buf.clear(0xAB)
    off = 0
    for r in roots:
        r.buffer, r.offset = buf, off
        off += -(-r.nbytes // 64) * 64 + 64


@pytest.mark.parametrize("gtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_mul_mat_broadcast_batches(gtype):
    """a [K, M, 2, 1] broadcast over b [K, N, 4, 3]: 12 groups, each a gemm with leftovers."""
    rng = np.random.default_rng(7)
    K, M, N = 136, 23, 6
    ctx = ggx.Context()
    a = ctx.tensor(gtype, (K, M, 2, 1))
    b = ctx.tensor(GType.F32, (K, N, 4, 3))
    node = ctx.mul_mat(a, b)
    alloc(a, b, node)
    raw, wv = weights(gtype, rng.standard_normal((2, M, K)).astype(np.float32))
    a.buffer.set_tensor(a, raw.view(np.uint8))
    x = rng.standard_normal((3, 4, N, K)).astype(np.float32)
    tensor_array(b)[...] = x
    matmul.mul_mat(node, 2)()
    out = tensor_array(node)
    y = rounded(gtype, x).astype(np.float64)
    for i3 in range(3):
        for i2 in range(4):
            ref = y[i3, i2] @ wv[i2 // 2].T
            assert nmse(out[i3, i2], ref) < 1e-10, (i3, i2)


@pytest.mark.parametrize("gtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_mul_mat_id(gtype):
    """Experts used by 0, 1 and many tokens: gemv, row-dot and 4 x 4 tile groups in one call."""
    rng = np.random.default_rng(13)
    K, M, n_expert, n_used, T = 72, 18, 4, 2, 9
    ctx = ggx.Context()
    a = ctx.tensor(gtype, (K, M, n_expert))
    b = ctx.tensor(GType.F32, (K, n_used, T))
    ids = ctx.tensor(GType.I32, (n_used, T))
    node = ctx.mul_mat_id(a, b, ids)
    alloc(a, b, ids, node)
    raw, wv = weights(gtype, rng.standard_normal((n_expert, M, K)).astype(np.float32))
    a.buffer.set_tensor(a, raw.view(np.uint8))
    x = rng.standard_normal((T, n_used, K)).astype(np.float32)
    tensor_array(b)[...] = x
    # expert 0: 8 uses (two 4x4 tiles), expert 1: 1 use (gemv), expert 2: 9 uses, expert 3: none
    sel = np.array([[0, 2], [2, 0], [0, 2], [2, 1], [0, 2], [2, 0], [0, 2], [2, 0], [0, 2]], np.int32)
    tensor_array(ids)[...] = sel
    matmul.mul_mat_id(node, 2)()
    out = tensor_array(node)[0]
    y = rounded(gtype, x).astype(np.float64)
    for t in range(T):
        for e in range(n_used):
            assert nmse(out[t, e], wv[sel[t, e]] @ y[t, e]) < 1e-10, (t, e)
