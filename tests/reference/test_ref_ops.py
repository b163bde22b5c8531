"""Each op of the reference backend against a straightforward numpy formula (small random inputs).

Values are written in numpy order: an array for a tensor with ne [a, b, c, d] has shape (d, c, b, a).
The formulas here are written independently of ggx.reference.ops (loops over ggml's indices where
that is the clearest statement of the semantics).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQT
from gguf import quants as gguf_quants

import ggx
from ggx import GGXShapeError, GGXUnsupported, GType, Op
from ggx.backend import DeviceType
from ggx.host import tensor_array
from ggx.reference import RefBackend, RefBackendReg, RefDevice
from ggx.reference.codec import encode

rng = np.random.default_rng(1234)


def rand(*shape: int) -> np.ndarray:
    """float32 values in [-1, 1), numpy shape."""
    return rng.uniform(-1, 1, size=shape).astype(np.float32)


def np_permute(v: np.ndarray, axes: tuple[int, int, int, int]) -> np.ndarray:
    """numpy values of ggml_permute(t, *axes) given t's 4-d numpy values (source dim i -> axes[i])."""
    order = [0] * 4
    for i, ax in enumerate(axes):
        order[3 - ax] = 3 - i
    return np.transpose(v, order)


def random_blocks(gtype: GType, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Random bytes of a quantized type with sane scales, and their values (gguf's dequantize)."""
    blocks = rng.integers(0, 256, size=math.prod(shape) // gtype.block_size * gtype.type_size, dtype=np.uint8)
    view = blocks.view(gtype.block_dtype)
    for field in ("d", "dmin", "m"):
        if field in view.dtype.names:
            view[field] = rng.uniform(0.001, 0.02, size=view.shape).astype(np.float16)
    values = gguf_quants.dequantize(blocks, GQT[gtype.name]).reshape(shape)
    return blocks, values


def close(got: np.ndarray, want: np.ndarray, tol: float = 1e-6) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol)


# --- the device layer --------------------------------------------------------------------------


def test_device_reg_and_backend_facts():
    reg = RefBackendReg()
    (dev,) = reg.devices()
    assert reg.name == "ref" and reg.version == ggx.__version__
    assert isinstance(dev, RefDevice) and dev.reg is reg
    assert dev.name == "ref" and dev.type == DeviceType.CPU
    assert dev.description == "reference (numpy, float64)"
    free, total = dev.memory()
    assert 0 < free <= total
    buft = dev.buffer_type()
    assert buft.name == "ref" and buft.is_host and buft.device is dev
    assert dev.supports_buft(buft)
    be = dev.init_backend()
    assert isinstance(be, RefBackend) and be.device is dev
    with pytest.raises(GGXUnsupported, match="no parameters"):
        dev.init_backend(n_threads=2)


def test_supports_every_op_of_the_catalogue(ref_device):
    ctx = ggx.Context()
    a, b = ctx.tensor("f32", (64, 4, 2)), ctx.tensor("f32", (64, 4, 2))
    w = ctx.tensor("q4_0", (64, 6, 3))
    ids = ctx.tensor("i32", (2, 4))
    pos = ctx.tensor("i32", 2)
    nodes = [
        ctx.get_rows(w, ctx.tensor("i32", (3, 3))), ctx.set_rows(ctx.tensor("q8_0", (64, 9, 2)), a,
                                                                 ctx.tensor("i64", (4, 2))),
        ctx.cpy(a, ctx.tensor("bf16", (64, 4, 2))), ctx.dup(a), ctx.cont(ctx.transpose(a)),
        ctx.add(a, b), ctx.mul(a, b), ctx.scale(a, 2.0), ctx.silu(a), ctx.gelu(a), ctx.swiglu(a),
        ctx.rms_norm(a, 1e-5), ctx.norm(a, 1e-5), ctx.mul_mat(w, ctx.tensor("f32", (64, 5, 3))),
        ctx.mul_mat_id(w, ctx.tensor("f32", (64, 2, 4)), ids), ctx.rope(a, pos, 64),
        ctx.soft_max(a, ctx.tensor("f16", (64, 4))),
        ctx.flash_attn_ext(ctx.tensor("f32", (64, 3, 4)), ctx.tensor("f16", (64, 7, 2)),
                           ctx.tensor("f16", (64, 7, 2)), scale=0.125),
        ctx.argsort(a), ctx.top_k(a, 3), ctx.sum_rows(a), ctx.view(a, (32, 4)), ctx.reshape(a, (128, 4)),
        ctx.permute(a, 1, 0, 2, 3), ctx.transpose(a),
    ]
    covered = {n.op for n in nodes}
    assert covered == set(Op) - {Op.NONE}
    for n in nodes:
        assert ref_device.supports_op(n), n


# --- rows and copies ---------------------------------------------------------------------------


@pytest.mark.parametrize("gtype", ["f32", "f16", "bf16", "q4_0", "q8_0"])
def test_get_rows(run_on_ref, gtype):
    ctx = ggx.Context()
    a = ctx.tensor(gtype, (64, 10, 2))
    ids = ctx.tensor("i32", (4, 2))
    av = rand(1, 2, 10, 64)
    raw = encode(av, GType.parse(gtype)).view(np.uint8).reshape(-1)
    # what the row values are, read independently from the bytes
    qt = GQT[gtype.upper()]
    exact = gguf_quants.dequantize(raw.copy(), qt).reshape(av.shape) if gtype != "f32" else av
    idv = np.array([[[[3, 0, 9, 3], [1, 1, 5, 8]]]], np.int32)
    (got,) = run_on_ref(ctx.get_rows(a, ids), {a: raw, ids: idv})
    want = np.zeros((1, 2, 4, 64))
    for i11 in range(2):
        for i10 in range(4):
            want[0, i11, i10] = exact[0, i11, idv[0, 0, i11, i10]]
    np.testing.assert_array_equal(got, want)


def test_get_rows_out_of_range_id_raises(run_on_ref):
    ctx = ggx.Context()
    a, ids = ctx.tensor("f32", (8, 5)), ctx.tensor("i32", 3)
    with pytest.raises(GGXShapeError, match="index 5 is out of range 0..4"):
        run_on_ref(ctx.get_rows(a, ids), {a: rand(1, 1, 5, 8), ids: np.array([0, 5, 1], np.int32)})


@pytest.mark.parametrize("dst_type", ["f32", "f16", "q4_0"])
def test_set_rows_broadcast_ids_and_repeats(run_on_ref, raw_bytes, dst_type):
    """ids [n, 1, 1] broadcast over src planes; a repeated id keeps the last row written (ggml order)."""
    ctx = ggx.Context()
    gt = GType.parse(dst_type)
    dst = ctx.tensor(gt, (32, 6, 2))
    src = ctx.tensor("f32", (32, 3, 2))
    ids = ctx.tensor("i64", 3)
    dv, sv = rand(1, 2, 6, 32), rand(1, 2, 3, 32)
    idv = np.array([4, 1, 4], np.int64)
    out = ctx.set_rows(dst, src, ids)
    assert out.view_src is dst
    run_on_ref(out, {dst: dv, src: sv, ids: idv})

    def bytes_of(v):  # the destination type's bytes of float rows, independently of ggx
        if gt is GType.F32:
            return v.astype("<f4").view(np.uint8)
        return np.ascontiguousarray(gguf_quants.quantize(v.reshape(-1, 32), GQT[gt.name])).view(np.uint8)

    want = bytes_of(dv).reshape(1, 2, 6, -1).copy()
    for i2 in range(2):
        for i1 in range(3):
            want[0, i2, idv[i1]] = bytes_of(sv[0, i2, i1]).reshape(-1)
    np.testing.assert_array_equal(raw_bytes(out), want.reshape(-1))


def test_set_rows_ids_broadcast_over_dims_2_3(run_on_ref):
    ctx = ggx.Context()
    dst, src, ids = ctx.tensor("f32", (4, 5, 2, 2)), ctx.tensor("f32", (4, 2, 2, 2)), ctx.tensor("i32", (2, 1, 2))
    dv, sv = rand(2, 2, 5, 4), rand(2, 2, 2, 4)
    idv = np.array([[[[0, 3]], [[4, 2]]]], np.int32)  # numpy (1, ids.ne2=2, ids.ne1=1, 2)
    (got,) = run_on_ref(ctx.set_rows(dst, src, ids), {dst: dv, src: sv, ids: idv})
    want = dv.copy()
    for i3 in range(2):
        for i2 in range(2):
            for i1 in range(2):
                want[i3, i2, idv[0, i3 % 2, i2 % 1, i1]] = sv[i3, i2, i1]
    np.testing.assert_array_equal(got, want)


def test_cpy_transposed_source_to_f16_and_bf16(run_on_ref):
    ctx = ggx.Context()
    a = ctx.tensor("f32", (5, 7))
    at = ctx.transpose(a)  # ne [7, 5]: a non-contiguous source
    h, bf = ctx.tensor("f16", (7, 5)), ctx.tensor("bf16", (7, 5))
    av = rand(1, 1, 7, 5) * 100
    got16, gotbf = run_on_ref([ctx.cpy(at, h), ctx.cpy(at, bf)], {a: av})
    tv = np.swapaxes(av, -1, -2)
    np.testing.assert_array_equal(got16, tv.astype(np.float16))
    bits = tv.astype(np.float32).view(np.uint32).astype(np.uint64)
    np.testing.assert_array_equal(gotbf, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16))


def test_cpy_into_strided_destination_and_back_to_f32(run_on_ref):
    """CPY writes through a view of its destination; f16 -> f32 is exact."""
    ctx = ggx.Context()
    a = ctx.tensor("f16", (6, 4))
    big = ctx.tensor("f32", (10, 4))
    window = ctx.view(big, (6, 4), (40,), offset=8)  # columns 2..7 of each row
    out = ctx.cpy(a, window)
    av = rand(1, 1, 4, 6).astype(np.float16)
    bv = rand(1, 1, 4, 10)
    (got,) = run_on_ref(out, {a: av.view(np.uint8), big: bv})
    np.testing.assert_array_equal(got, av.astype(np.float32))
    full = np.array(tensor_array(big))
    np.testing.assert_array_equal(full[..., :2], bv[..., :2])
    np.testing.assert_array_equal(full[..., 8:], bv[..., 8:])


def test_cont_and_dup_of_permuted_and_quantized(run_on_ref, raw_bytes):
    ctx = ggx.Context()
    a = ctx.tensor("f32", (3, 4, 5))
    p = ctx.permute(a, 2, 0, 1, 3)  # ne [4, 5, 3]
    c = ctx.cont(p, (20, 3))
    q = ctx.tensor("q8_0", (64, 3))
    qd = ctx.dup(q)
    qc = ctx.cont(q, (32, 6))  # same blocks, new row length
    av = rand(1, 5, 4, 3)
    qraw = rng.integers(0, 255, size=q.nbytes, dtype=np.uint8)
    qraw.view(GType.Q8_0.block_dtype)["d"] = np.float16(0.01)
    got_c, _, _ = run_on_ref([c, qd, qc], {a: av, q: qraw})
    np.testing.assert_array_equal(got_c.reshape(-1), np_permute(av, (2, 0, 1, 3)).reshape(-1))
    np.testing.assert_array_equal(raw_bytes(qd), qraw)
    np.testing.assert_array_equal(raw_bytes(qc), qraw)


def test_cpy_to_quantized_matches_gguf_bytes(run_on_ref, raw_bytes):
    ctx = ggx.Context()
    a = ctx.tensor("f32", (64, 3))
    outs = {t: ctx.cpy(a, ctx.tensor(t, (64, 3))) for t in ("q4_0", "q4_1", "q8_0")}
    av = rand(1, 1, 3, 64)
    run_on_ref(list(outs.values()), {a: av})
    for t, out in outs.items():
        want = np.ascontiguousarray(gguf_quants.quantize(av.reshape(3, 64), GQT[t.upper()])).view(np.uint8)
        np.testing.assert_array_equal(raw_bytes(out), want.reshape(-1), err_msg=t)


# --- elementwise -------------------------------------------------------------------------------


def test_add_mul_broadcast_with_permuted_a(run_on_ref):
    ctx = ggx.Context()
    x = ctx.tensor("f32", (6, 2, 3, 2))
    a = ctx.permute(x, 0, 2, 1, 3)  # ne [6, 3, 2, 2], not contiguous
    b = ctx.tensor("f32", (6, 1, 2, 1))
    xv, bv = rand(2, 3, 2, 6), rand(1, 2, 1, 6)
    got_add, got_mul = run_on_ref([ctx.add(a, b), ctx.mul(a, b)], {x: xv, b: bv})
    av = np_permute(xv, (0, 2, 1, 3))
    want_add, want_mul = np.empty(av.shape), np.empty(av.shape)
    for i3, i2, i1, i0 in np.ndindex(*av.shape):
        bb = bv[i3 % 1, i2 % 2, i1 % 1, i0 % 6]
        want_add[i3, i2, i1, i0] = np.float32(av[i3, i2, i1, i0]) + np.float32(bb)
        want_mul[i3, i2, i1, i0] = np.float32(av[i3, i2, i1, i0]) * np.float32(bb)
    np.testing.assert_array_equal(got_add, want_add.astype(np.float32))
    np.testing.assert_array_equal(got_mul, want_mul.astype(np.float32))


def test_unary_ops_on_a_strided_view(run_on_ref):
    ctx = ggx.Context()
    big = ctx.tensor("f32", (12, 5))
    x = ctx.view(big, (9, 5), (48,), offset=4)  # rows contiguous, tensor not
    outs = [ctx.scale(x, 0.5, 0.25), ctx.silu(x), ctx.gelu(x), ctx.gelu(x, "gelu_erf"), ctx.gelu(x, "gelu_quick")]
    bv = rand(1, 1, 5, 12) * 12  # reaches past +-10: GELU's clamps
    got = run_on_ref(outs, {big: bv})
    v = bv[..., 1:10].astype(np.float64)
    gelu = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
    gelu = np.where(v <= -10, 0.0, np.where(v >= 10, v, gelu))
    erf = np.vectorize(math.erf)(v / math.sqrt(2))
    wants = [v * 0.5 + 0.25, v / (1 + np.exp(-v)), gelu, 0.5 * v * (1 + erf), v / (1 + np.exp(-1.702 * v))]
    for g, w in zip(got, wants):
        close(g, w)


def test_gelu_clamps_as_ggml(run_on_ref):
    """ggml: x <= -10 gives 0 and x >= 10 gives x (so -inf gives 0, where the formula gives NaN)."""
    ctx = ggx.Context()
    a = ctx.tensor("f32", 5)
    (got,) = run_on_ref(ctx.gelu(a), {a: np.array([-np.inf, np.inf, -20.0, 20.0, np.nan], np.float32)})
    got = got.reshape(-1)
    np.testing.assert_array_equal(got[:4], [0.0, np.inf, 0.0, 20.0])
    assert np.isnan(got[4])


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize("swapped", [False, True])
def test_glu_fused_and_split(run_on_ref, kind, swapped):
    ctx = ggx.Context()
    a = ctx.tensor("f32", (16, 3))
    g, u = ctx.tensor("f32", (8, 3)), ctx.tensor("f32", (8, 3))
    av, gv, uv = rand(1, 1, 3, 16) * 3, rand(1, 1, 3, 8), rand(1, 1, 3, 8)
    fused, split = run_on_ref([ctx.glu(a, kind=kind, swapped=swapped), ctx.glu(g, u, kind=kind)],
                              {a: av, g: gv, u: uv})

    def act(x):
        x = x.astype(np.float64)
        if kind == "swiglu":
            return x / (1 + np.exp(-x))
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    first, second = av[..., :8], av[..., 8:]
    gate, up = (second, first) if swapped else (first, second)
    close(fused, act(gate) * up)
    close(split, act(gv) * uv)


def test_norms_and_sum_rows_on_permuted_input(run_on_ref):
    ctx = ggx.Context()
    x = ctx.tensor("f32", (40, 3, 2))
    a = ctx.permute(x, 0, 2, 1, 3)  # rows stay contiguous
    xv = rand(1, 2, 3, 40) + 0.3
    rms, nrm, srow = run_on_ref([ctx.rms_norm(a, 1e-6), ctx.norm(a, 1e-5), ctx.sum_rows(a)], {x: xv})
    av = np_permute(xv, (0, 2, 1, 3)).astype(np.float64)
    close(rms, av / np.sqrt((av**2).mean(-1, keepdims=True) + 1e-6))
    mu = av.mean(-1, keepdims=True)
    close(nrm, (av - mu) / np.sqrt(((av - mu) ** 2).mean(-1, keepdims=True) + 1e-5))
    close(srow, av.sum(-1, keepdims=True))
    assert srow.shape == (1, 3, 2, 1)


# --- matrix products ---------------------------------------------------------------------------


@pytest.mark.parametrize("wtype", ["f32", "f16", "q4_0", "q4_1", "q8_0", "q4_K", "q6_K"])
def test_mul_mat_broadcast_and_permuted_b(run_on_ref, wtype):
    """a [K, M, 2, 1] over b [K, N, 4, 2] (a permuted view): weights dequantized, activations exact."""
    K, M, N = 256, 5, 3
    ctx = ggx.Context()
    a = ctx.tensor(wtype, (K, M, 2, 1))
    bs = ctx.tensor("f32", (K, 4, N, 2))
    b = ctx.permute(bs, 0, 2, 1, 3)  # ne [K, N, 4, 2]
    wv = rand(1, 2, M, K)
    if wtype == "f32":
        raw, wexact = wv.view(np.uint8), wv
    elif wtype == "f16":
        raw, wexact = wv.astype(np.float16).view(np.uint8), wv.astype(np.float16)
    else:  # random valid blocks, read back with gguf's dequantize (independent of ggx)
        raw, wexact = random_blocks(GType.parse(wtype), wv.shape)
    bsv = rand(2, N, 4, K)
    (got,) = run_on_ref(ctx.mul_mat(a, b), {a: raw, bs: bsv})
    bv = np_permute(bsv, (0, 2, 1, 3)).astype(np.float64)  # (2, 4, N, K)
    want = np.zeros((2, 4, N, M))
    for i3, i2, n, m in np.ndindex(*want.shape):
        want[i3, i2, n, m] = np.dot(wexact[0, i2 // 2, m].astype(np.float64), bv[i3, i2, n])
    close(got, want, 1e-5)


@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
@pytest.mark.parametrize("b_ne1", [1, 2])
def test_mul_mat_id(run_on_ref, wtype, b_ne1):
    K, M, E, U, T = 64, 4, 5, 2, 3
    ctx = ggx.Context()
    w = ctx.tensor(wtype, (K, M, E))
    b = ctx.tensor("f32", (K, b_ne1, T))
    ids = ctx.tensor("i32", (U, T))
    wv, bv = rand(1, E, M, K), rand(1, T, b_ne1, K)
    idv = np.array([[4, 0], [2, 2], [1, 4]], np.int32).reshape(1, 1, T, U)
    raw = wv.view(np.uint8) if wtype == "f32" else \
        np.ascontiguousarray(gguf_quants.quantize(wv, GQT.Q8_0)).view(np.uint8)
    wexact = wv if wtype == "f32" else gguf_quants.dequantize(raw.reshape(-1), GQT.Q8_0).reshape(wv.shape)
    (got,) = run_on_ref(ctx.mul_mat_id(w, b, ids), {w: raw, b: bv, ids: idv})
    want = np.zeros((1, T, U, M))
    for t in range(T):
        for e in range(U):
            want[0, t, e] = wexact[0, idv[0, 0, t, e]].astype(np.float64) @ bv[0, t, e % b_ne1]
    close(got, want, 1e-5)


def test_mul_mat_id_bad_expert_raises(run_on_ref):
    ctx = ggx.Context()
    w, b, ids = ctx.tensor("f32", (8, 2, 3)), ctx.tensor("f32", (8, 1, 2)), ctx.tensor("i32", (1, 2))
    with pytest.raises(GGXShapeError, match="out of range"):
        run_on_ref(ctx.mul_mat_id(w, b, ids), {w: rand(1, 3, 2, 8), b: rand(1, 2, 1, 8),
                                               ids: np.array([0, 3], np.int32)})


# --- positions and attention -------------------------------------------------------------------


def rope_loop(x, pos, n_dims, mode, base, fscale, n_ctx_orig=0, ext=0.0, attn=1.0, bfast=32.0, bslow=1.0, ff=None):
    """ggml-cpu's rope, element by element (ggml_rope_cache_init + rope_yarn + rotate), in float64;
    ff: the frequency factors, pair i's angle divided by ff[i]."""
    def corr_dim(n_rot):
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    if ext != 0.0:
        low = max(0.0, math.floor(corr_dim(bfast)))
        high = min(n_dims - 1.0, math.ceil(corr_dim(bslow)))
    out = x.astype(np.float64).copy()
    for i3, i2, i1 in np.ndindex(*x.shape[:3]):
        for i0 in range(0, n_dims, 2):
            theta_extrap = pos[i2] * base ** (-i0 / n_dims) / (1.0 if ff is None else float(ff[i0 // 2]))
            theta, mscale = fscale * theta_extrap, attn
            if ext != 0.0:
                ramp = 1 - min(1.0, max(0.0, (i0 // 2 - low) / max(0.001, high - low)))
                theta = theta * (1 - ramp * ext) + theta_extrap * ramp * ext
                mscale *= 1 + 0.1 * math.log(1 / fscale)
            c, s = math.cos(theta) * mscale, math.sin(theta) * mscale
            j0, j1 = (i0, i0 + 1) if mode == 0 else (i0 // 2, i0 // 2 + n_dims // 2)
            x0, x1 = float(x[i3, i2, i1, j0]), float(x[i3, i2, i1, j1])
            out[i3, i2, i1, j0] = x0 * c - x1 * s
            out[i3, i2, i1, j1] = x0 * s + x1 * c
    return out


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("yarn", [False, True])
def test_rope_partial_dims_view_and_yarn(run_on_ref, mode, yarn):
    ctx = ggx.Context()
    big = ctx.tensor("f32", (16, 5, 3, 2))
    a = ctx.view(big, (16, 3, 3, 2), (64, 320, 960), offset=64)  # heads 1..3 of 5
    pos = ctx.tensor("i32", 3)
    kw = dict(n_ctx_orig=4096, ext_factor=1.0, attn_factor=0.9, beta_fast=32.0, beta_slow=1.0) if yarn else {}
    out = ctx.rope(a, pos, 12, mode, freq_base=10000.0, freq_scale=0.25 if yarn else 1.0, **kw)
    bv, pv = rand(2, 3, 5, 16), np.array([7, 0, 300], np.int32)
    (got,) = run_on_ref(out, {big: bv, pos: pv})
    want = rope_loop(bv[:, :, 1:4], pv, 12, mode, 10000.0, 0.25 if yarn else 1.0,
                     **({"n_ctx_orig": 4096, "ext": 1.0, "attn": 0.9} if yarn else {}))
    close(got, want, 1e-5)
    np.testing.assert_array_equal(got[..., 12:], bv[:, :, 1:4, 12:])  # dims >= n_dims are copied


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("yarn", [False, True])
def test_rope_freq_factors(run_on_ref, mode, yarn):
    """ggml_rope_ext's c: pair i's angle is divided by c[i] (c may hold more than n_dims/2 values);
    the YaRN ramp still goes by the pair's index."""
    ctx = ggx.Context()
    a, pos, ff = ctx.tensor("f32", (16, 3, 4)), ctx.tensor("i32", 4), ctx.tensor("f32", 9)
    kw = dict(n_ctx_orig=4096, ext_factor=1.0, attn_factor=0.9) if yarn else {}
    out = ctx.rope(a, pos, 12, mode, freq_base=5e5, freq_scale=0.25 if yarn else 1.0, freq_factors=ff, **kw)
    assert out.src[2] is ff
    av, pv = rand(1, 4, 3, 16), np.array([3, 0, 1000, 40], np.int32)
    fv = np.array([1, 1, 1.5, 2, 4, 8, 8, 8, 100], np.float32)
    (got,) = run_on_ref(out, {a: av, pos: pv, ff: fv})
    want = rope_loop(av, pv, 12, mode, 5e5, 0.25 if yarn else 1.0, ff=fv,
                     **({"n_ctx_orig": 4096, "ext": 1.0, "attn": 0.9} if yarn else {}))
    close(got, want, 1e-5)
    unscaled = rope_loop(av, pv, 12, mode, 5e5, 0.25 if yarn else 1.0,
                         **({"n_ctx_orig": 4096, "ext": 1.0, "attn": 0.9} if yarn else {}))
    assert np.abs(got - unscaled).max() > 0.1  # the factors matter


def test_rope_freq_factors_are_checked():
    ctx = ggx.Context()
    a, pos = ctx.tensor("f32", (16, 3, 4)), ctx.tensor("i32", 4)
    with pytest.raises(GGXShapeError, match=r"rope: freq_factors .* must be F32"):
        ctx.rope(a, pos, 16, freq_factors=ctx.tensor("f16", 8))
    with pytest.raises(GGXShapeError, match=r"rope: freq_factors .* at least n_dims/2=8 factors"):
        ctx.rope(a, pos, 16, freq_factors=ctx.tensor("f32", 7))
    with pytest.raises(GGXShapeError, match=r"rope: freq_factors .* must be contiguous"):
        ctx.rope(a, pos, 16, freq_factors=ctx.transpose(ctx.tensor("f32", (8, 2))))
    with pytest.raises(GGXShapeError, match=r"rope: freq_factors must be a Tensor"):
        ctx.rope(a, pos, 16, freq_factors=np.ones(8, np.float32))


def alibi(n_head, max_bias):
    if max_bias == 0:
        return [1.0] * n_head
    n_log2 = 2 ** math.floor(math.log2(n_head))
    m0, m1 = 2 ** (-max_bias / n_log2), 2 ** (-max_bias / 2 / n_log2)
    return [m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(n_head)]


@pytest.mark.parametrize("max_bias", [0.0, 8.0])
def test_soft_max_mask_broadcast_and_alibi(run_on_ref, max_bias):
    ctx = ggx.Context()
    a = ctx.tensor("f32", (9, 3, 6, 2))
    mask = ctx.tensor("f16", (9, 5, 1, 2))  # more rows than a.ne1: extra rows ignored
    av = rand(2, 6, 3, 9) * 4
    mv = np.where(rng.random((2, 1, 5, 9)) < 0.3, -np.inf, rand(2, 1, 5, 9)).astype(np.float16)
    mv[..., 0] = 0  # every row keeps at least one finite logit
    (got,) = run_on_ref(ctx.soft_max(a, mask, 0.3, max_bias), {a: av, mask: mv})
    slope = alibi(6, max_bias)
    want = np.zeros(av.shape)
    for i3, i2, i1 in np.ndindex(2, 6, 3):
        z = av[i3, i2, i1] * 0.3 + slope[i2] * mv[i3, 0, i1].astype(np.float64)
        e = np.exp(z - z.max())
        want[i3, i2, i1] = e / e.sum()
    close(got, want)


@pytest.mark.parametrize("softcap,max_bias", [(0.0, 0.0), (20.0, 0.0), (0.0, 4.0)])
def test_flash_attn_ext_gqa_mask_and_permuted_output(run_on_ref, softcap, max_bias):
    D, T, H, Hkv, KV = 16, 3, 6, 2, 7
    ctx = ggx.Context()
    qs = ctx.tensor("f32", (D, H, T))
    q = ctx.permute(qs, 0, 2, 1, 3)  # [D, T, H]: the usual permuted view
    k, v = ctx.tensor("f16", (D, KV, Hkv)), ctx.tensor("f16", (D, KV, Hkv))
    mask = ctx.tensor("f16", (KV, T))
    out = ctx.flash_attn_ext(q, k, v, mask, scale=0.25, max_bias=max_bias, logit_softcap=softcap)
    assert out.ne == (D, H, T, 1)
    qsv = rand(1, T, H, D) * 2
    kv_, vv = rand(1, Hkv, KV, D).astype(np.float16), rand(1, Hkv, KV, D).astype(np.float16)
    mv = np.zeros((1, 1, T, KV), np.float16)
    mv[0, 0, 0, 3:] = -np.inf  # causal-like
    mv[0, 0, 1, 5:] = -np.inf
    (got,) = run_on_ref(out, {qs: qsv, k: kv_.view(np.uint8), v: vv.view(np.uint8), mask: mv.view(np.uint8)})
    slope = alibi(H, max_bias)
    want = np.zeros((1, T, H, D))
    for t in range(T):
        for h in range(H):
            hk = h // (H // Hkv)
            s = kv_[0, hk].astype(np.float64) @ qsv[0, t, h].astype(np.float64) * 0.25
            if softcap:
                s = softcap * np.tanh(s / softcap)
            s = s + slope[h] * mv[0, 0, t].astype(np.float64)
            p = np.exp(s - s.max())
            want[0, t, h] = (p / p.sum()) @ vv[0, hk].astype(np.float64)
    close(got, want, 1e-5)


def test_flash_attn_ext_fully_masked_row_gives_zeros(run_on_ref):
    ctx = ggx.Context()
    q, k, v = ctx.tensor("f32", (8, 2, 1)), ctx.tensor("f16", (8, 4, 1)), ctx.tensor("f16", (8, 4, 1))
    mask = ctx.tensor("f16", (4, 2))
    mv = np.zeros((1, 1, 2, 4), np.float16)
    mv[0, 0, 1] = -np.inf
    (got,) = run_on_ref(ctx.flash_attn_ext(q, k, v, mask, 1.0),
                        {q: rand(1, 1, 2, 8), k: rand(1, 1, 4, 8).astype(np.float16).view(np.uint8),
                         v: rand(1, 1, 4, 8).astype(np.float16).view(np.uint8), mask: mv.view(np.uint8)})
    assert np.all(got[0, 1] == 0) and np.all(np.isfinite(got)) and np.any(got[0, 0] != 0)


# --- sorting -----------------------------------------------------------------------------------


def test_argsort_and_top_k(run_on_ref):
    ctx = ggx.Context()
    a = ctx.tensor("f32", (11, 4))
    av = rand(1, 1, 4, 11)
    asc, desc, top, top1 = run_on_ref([ctx.argsort(a, "asc"), ctx.argsort(a, "desc"), ctx.top_k(a, 4),
                                      ctx.top_k(a, 1)], {a: av})
    for r in range(4):
        row = av[0, 0, r]
        assert list(asc[0, 0, r]) == sorted(range(11), key=lambda i: row[i])
        assert list(desc[0, 0, r]) == sorted(range(11), key=lambda i: -row[i])
        best = sorted(range(11), key=lambda i: -row[i])[:4]
        assert list(top[0, 0, r]) == [best[1], best[0], best[2], best[3]]  # ggml swaps the first two
        assert top1[0, 0, r, 0] == best[0]
    assert asc.dtype == np.int32 and top.shape == (1, 1, 4, 4)


# --- the backend -------------------------------------------------------------------------------


def test_chain_with_views_between_nodes(run_on_ref):
    """A graph mixing views and ops: each node reads its sources' memory through their strides."""
    ctx = ggx.Context()
    x = ctx.tensor("f32", (4, 6))
    y = ctx.scale(x, 2.0)
    t = ctx.transpose(y)  # [6, 4] view of y
    z = ctx.cont(t)
    s = ctx.sum_rows(ctx.reshape(z, (24,)))
    xv = rand(1, 1, 6, 4)
    got_z, got_s = run_on_ref([z, s], {x: xv})
    np.testing.assert_array_equal(got_z[0, 0], (xv[0, 0] * 2).T)
    close(got_s.reshape(-1), [xv.sum() * 2])


def test_graph_compute_checks_storage_before_running(ref_device):
    ctx = ggx.Context()
    a = ctx.tensor("f32", 8)
    out = ctx.silu(a)
    graph = ggx.build_graph(out)
    with pytest.raises(GGXUnsupported, match="has no storage"):
        ref_device.init_backend().graph_compute(graph)


def test_in_place_node_sharing_its_source_memory(ref_device):
    """An allocator may give ADD the memory of src[0]: the result must still be right."""
    ctx = ggx.Context()
    a, b = ctx.tensor("f32", (5, 3)), ctx.tensor("f32", 5)
    out = ctx.add(a, b)
    buft = ref_device.buffer_type()
    buf = buft.alloc_buffer(a.nbytes + 64)
    a.buffer, a.offset = buf, 0
    out.buffer, out.offset = buf, 0  # same bytes as a
    b.buffer, b.offset = buf, a.nbytes
    av, bv = rand(1, 1, 3, 5), rand(1, 1, 1, 5)
    buf.set_tensor(a, av.view(np.uint8))
    buf.set_tensor(b, bv.view(np.uint8))
    ref_device.init_backend().graph_compute(ggx.build_graph(out))
    np.testing.assert_array_equal(tensor_array(out), av + bv)
