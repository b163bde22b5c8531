"""The Q4_K / Q6_K dot products of every ISA variant this CPU runs (ggx_cpu.isa.vector_kquants
under AVX2 / AVX-512 VNNI, ggx_cpu.isa.portable everywhere): exact integer parts against a
numpy model, and mul_mat under each variant against the portable variant and the reference
backend."""
from __future__ import annotations

import numpy as np
import pytest

import ggx
from ggx.conformance.case import tolerance
from ggx.host import HostBufferType, tensor_array
from ggx.ops import Op
from ggx.types import GType
from ggx_cpu import isa
from ggx_cpu.isa import portable, vector_kquants
from ggx_cpu.kernels import matmul

KQUANTS = [GType.Q4_K, GType.Q6_K]
VECTOR = [v for v in isa.available() if v != "portable"]


def nmse(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((out - ref) ** 2) / max(np.sum(ref ** 2), 1e-30))


def random_blocks(gtype: GType, n_blocks: int, rng, d=None) -> np.ndarray:
    """Random block bytes with sane f16 scales (random ones may be inf/NaN); d=None: random
    small scales of both signs, else d (and Q4_K's dmin) set to that value."""
    blocks = np.frombuffer(rng.bytes(n_blocks * gtype.type_size), gtype.block_dtype).copy()
    if d is None:
        blocks["d"] = (rng.uniform(0.002, 0.02, n_blocks) * rng.choice([-1, 1], n_blocks)).astype(np.float16)
        if gtype is GType.Q4_K:
            blocks["dmin"] = rng.uniform(0.0, 0.03, n_blocks).astype(np.float16)
    else:
        blocks["d"] = np.float16(d)
        if gtype is GType.Q4_K:
            blocks["dmin"] = np.float16(d)
    return blocks


# --- integer model -----------------------------------------------------------------------------------
def q4_K_ints(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale * q, min) per value of Q4_K blocks as int64 [n_blocks, 256]: value = d sq - dmin m."""
    q = blocks["qs"].reshape(-1, 4, 32).astype(np.int64)
    vals = np.stack([q & 15, q >> 4], axis=2).reshape(-1, 256)  # run 2j low nibbles, 2j+1 high
    sc = blocks["scales"].astype(np.int64)
    s = np.empty((len(blocks), 8), np.int64)
    m = np.empty((len(blocks), 8), np.int64)
    s[:, :4], m[:, :4] = sc[:, :4] & 63, sc[:, 4:8] & 63
    s[:, 4:] = (sc[:, 8:] & 15) | ((sc[:, :4] >> 6) << 4)
    m[:, 4:] = (sc[:, 8:] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return vals * np.repeat(s, 32, axis=1), np.repeat(m, 32, axis=1)


def q6_K_ints(blocks: np.ndarray) -> np.ndarray:
    """scale * (q - 32) per value of Q6_K blocks as int64 [n_blocks, 256] (value = d times it)."""
    ql = blocks["ql"].reshape(-1, 2, 64).astype(np.int64)
    qh = blocks["qh"].reshape(-1, 2, 32).astype(np.int64)
    l0, l1 = ql[:, :, :32], ql[:, :, 32:]
    q = np.stack([(l0 & 15) | ((qh & 3) << 4), (l1 & 15) | (((qh >> 2) & 3) << 4),
                  (l0 >> 4) | (((qh >> 4) & 3) << 4), (l1 >> 4) | ((qh >> 6) << 4)], axis=2)
    return (q.reshape(-1, 256) - 32) * np.repeat(blocks["scales"].astype(np.int64), 16, axis=1)


def exact_dot(gtype: GType, blocks: np.ndarray, y: np.ndarray) -> tuple[int, int]:
    """(sum, sum of absolute terms) of one row (d = dmin = 1) with int8 activations y (yd = 1)."""
    yb = y.astype(np.int64).reshape(-1, 256)
    if gtype is GType.Q4_K:
        sq, m = q4_K_ints(blocks)
        terms = np.concatenate([(sq * yb).ravel(), -(m * yb).ravel()])
    else:
        terms = (q6_K_ints(blocks) * yb).ravel()
    return int(terms.sum()), int(np.abs(terms).sum())


def kernel_args(gtype: GType, rows: list[np.ndarray], cols: list[np.ndarray]):
    """(w, row bytes, nb, yq, yd, ys, ys4) in the kernels' layouts (see vector_kquants)."""
    w = np.concatenate([r.view(np.uint8) for r in rows])
    yq = np.concatenate(cols).astype(np.int8)
    yd = np.ones(yq.size // 256, np.float32)
    ys4 = yq.astype(np.int32).reshape(-1, 16).sum(axis=1).astype(np.int32)  # Q8_K bsums
    return w, rows[0].nbytes, rows[0].size, yq, yd, yd.copy(), ys4


def extreme_rows(gtype: GType, nb: int) -> list[np.ndarray]:
    """Rows at the ends of the value ranges (unit scales d = dmin = 1): every product the
    widest it can be (Q4_K: q = 15, 6-bit scale = min = 63; Q6_K: q - 32 = -32 with scale
    -128, and 31 with -1), so a saturating or overflowing intermediate shows."""
    hi = np.frombuffer(np.full(nb * gtype.type_size, 0xFF, np.uint8).tobytes(), gtype.block_dtype).copy()
    hi["d"] = np.float16(1.0)
    rows = [hi]
    if gtype is GType.Q4_K:
        hi["dmin"] = np.float16(1.0)
        lo = hi.copy()
        lo["scales"][:, :4] = 0x3F  # scales 0..3 high, the rest low and mins low: no cancellation
        lo["scales"][:, 4:] = 0x00
        rows.append(lo)
    else:
        lo = np.zeros(nb, gtype.block_dtype)
        lo["scales"] = -128
        lo["d"] = np.float16(1.0)
        rows.append(lo)
    return rows


@pytest.mark.parametrize("variant", isa.available())
@pytest.mark.parametrize("gtype", KQUANTS, ids=lambda t: t.name)
def test_integer_parts_exact(variant, gtype):
    """dot, row quad and 4x4 tile of the variant against exact integers (unit scales)."""
    rng = np.random.default_rng(1)
    nb = 3
    rows = extreme_rows(gtype, nb) + [random_blocks(gtype, nb, rng, d=1.0) for _ in range(2)]
    cols = [np.full(nb * 256, 127), np.full(nb * 256, -127), rng.integers(-127, 128, nb * 256),
            rng.integers(-127, 128, nb * 256)]
    w, rs, nb, yq, yd, ys, ys4 = kernel_args(gtype, rows, cols)
    want = np.array([[exact_dot(gtype, r, c) for c in cols] for r in rows])  # [row, col, (sum, abs)]
    tok = isa.token(variant)
    mod = portable if variant == "portable" else vector_kquants
    name = gtype.name.lower().replace("_k", "_K")
    dot = getattr(mod, f"dot_{name}")
    got_dot = np.array([[dot(tok, w, r * rs, nb, yq, yd, ys, ys4, c * nb * 256) for c in range(4)] for r in range(4)])
    got_tile = np.full(16, np.nan, np.float32)
    getattr(mod, f"tile_{name}")(tok, w, 0, rs, nb, yq, yd, ys, ys4, 0, 768, 1536, 2304, got_tile, 0, 4, 8, 12)
    results = [got_dot, got_tile.reshape(4, 4).T]
    if hasattr(mod, f"rows4_{name}"):
        got_rows = np.full(16, np.nan, np.float32)
        for c in range(4):
            getattr(mod, f"rows4_{name}")(tok, w, 0, rs, nb, yq, yd, ys, ys4, c * nb * 256, got_rows, 4 * c)
        results.append(got_rows.reshape(4, 4).T)
    # the float path adds integers below 2^24 exactly; beyond, rounding of the partial sums only
    for got in results:
        err = np.abs(got.astype(np.float64) - want[..., 0])
        assert (err <= 2.0**-22 * want[..., 1]).all(), (got, want[..., 0])
    # the extreme rows with constant columns are exactly representable: no rounding at all
    assert (got_dot[:2, :2] == want[:2, :2, 0]).all()


# --- mul_mat per variant -------------------------------------------------------------------------
def mul_mat_under(variant: str, monkeypatch, gtype: GType, weights: np.ndarray, x: np.ndarray,
                  n_threads: int) -> np.ndarray:
    """mul_mat of weights [m rows of K] by x [n, K] with the kernel launch bound under `variant`."""
    n, k = x.shape
    m = weights.size // (k // 256)
    ctx = ggx.Context()
    a, b = ctx.tensor(gtype, (k, m)), ctx.tensor(GType.F32, (k, n))
    out = ctx.mul_mat(a, b)
    tensors = (a, b, out)
    buf = HostBufferType(None).alloc_buffer(sum(-(-t.nbytes // 64) * 64 for t in tensors))
    buf.clear(0xAB)  # garbage, so unwritten outputs show
    off = 0
    for t in tensors:
        t.buffer, t.offset = buf, off
        off += -(-t.nbytes // 64) * 64
    buf.set_tensor(a, weights.view(np.uint8))
    tensor_array(b)[...] = x
    monkeypatch.setenv(isa.ENV_VAR, variant)
    matmul.mul_mat(out, n_threads)()  # the launch binds the ISA token when it is made
    return tensor_array(out).reshape(n, m).copy()


@pytest.mark.parametrize("gtype", KQUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 6])  # gemv: row quads + a lone row; gemm: a 4x4 tile + 2 columns
def test_mul_mat_variants_agree(monkeypatch, gtype, n):
    """Every variant equals the portable one to float rounding, and each meets the conformance
    threshold against the reference backend."""
    rng = np.random.default_rng(n)
    m, k = 13, 768  # 3 row quads and a lone row; 3 super-blocks per row (odd)
    weights = random_blocks(gtype, m * k // 256, rng)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ctx = ggx.Context()
    a, b = ctx.tensor(gtype, (k, m)), ctx.tensor(GType.F32, (k, n))
    ref = ggx.compute(ctx.mul_mat(a, b), {a: weights.view(np.uint8), b: x}, device="ref")[0]
    got = {v: mul_mat_under(v, monkeypatch, gtype, weights, x, n_threads=2) for v in isa.available()}
    limit = tolerance(Op.MUL_MAT, gtype).max_nmse
    for v, res in got.items():
        assert res.shape == ref.shape and np.isfinite(res).all()
        assert nmse(res, ref) < limit, v
        assert nmse(res, got["portable"]) < 1e-12, v  # same integers, other summation order
