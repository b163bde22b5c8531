"""mul_mat / mul_mat_id kernels against ggml's own outputs and a float64 numpy oracle."""
from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest

import ggx
from ggx.errors import GGXShapeError, GGXUnsupported
from ggx.host import HostBufferType, tensor_array
from ggx.types import GType
from ggx_cpu import isa
from ggx_cpu.kernels import matmul
from ggx_cpu.kernels.quantize_act import quantize_act, to_blocks

GOLDEN = resources.files("ggx.conformance") / "golden_ops"
CASES = [c for c in json.loads((GOLDEN / "index.json").read_text())["cases"]
         if c["op"] in ("MUL_MAT", "MUL_MAT_ID")]


def alloc(*tensors: ggx.Tensor) -> None:
    """Place the roots of `tensors` in one host buffer, 64-byte aligned."""
    roots = list(dict.fromkeys(t.root for t in tensors))
    offs, size = [], 0
    for r in roots:
        offs.append(size)
        size += -(-r.nbytes // 64) * 64 + 64
    buf = HostBufferType(None).alloc_buffer(size)
    buf.clear(0xAB)  # garbage, so unwritten outputs show
    for r, o in zip(roots, offs):
        r.buffer, r.offset = buf, o


def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    return float(np.sum((out - ref) ** 2) / max(np.sum(ref ** 2), 1e-30))


def golden_graph(case: dict):
    """Build the case's graph with its exact strides and data; returns (node, expected)."""
    z = np.load(GOLDEN / case["file"])
    ctx = ggx.Context()
    ins, raws = [], []
    for i in range(int(z["n_inputs"])):
        st = GType.parse(str(z[f"in{i}_storage_type"]))
        root = ctx.tensor(st, [int(x) for x in z[f"in{i}_storage_ne"]])
        t = root
        offs = int(z[f"in{i}_view_offs"])
        ne, nb = [int(x) for x in z[f"in{i}_ne"]], [int(x) for x in z[f"in{i}_nb"]]
        if offs or tuple(nb) != root.nb or tuple(ne) != root.ne:
            t = ctx.view(root, ne, nb[1:], offs)
        ins.append(t)
        raws.append((root, z[f"in{i}_raw"]))
    node = ctx.mul_mat(*ins) if case["op"] == "MUL_MAT" else ctx.mul_mat_id(*ins)
    alloc(*ins, node)
    for root, raw in raws:
        root.buffer.set_tensor(root, raw)
    return node, z["out_values"]


VARIANTS = isa.available()


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    monkeypatch.setenv(isa.ENV_VAR, request.param)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_golden(case, variant, n_threads):
    node, expected = golden_graph(case)
    fn = matmul.mul_mat if case["op"] == "MUL_MAT" else matmul.mul_mat_id
    fn(node, n_threads)()
    out = tensor_array(node)
    assert out.shape == expected.shape
    # same activation quantization as ggml: only float summation order differs
    assert nmse(out, expected) < 1e-9, case["name"]
    np.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max())


# --- a float64 oracle on random data, every weight type and ISA variant ------------------------
def quantized_weights(gtype: GType, m: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes, dequantized float64 values [m, k]) of random weights in gtype."""
    from gguf import GGMLQuantizationType, quants

    x = rng.standard_normal((m, k)).astype(np.float32)
    if gtype is GType.F32:
        return x.view(np.uint8).reshape(-1), x.astype(np.float64)
    if gtype is GType.F16:
        h = x.astype(np.float16)
        return h.view(np.uint8).reshape(-1), h.astype(np.float64)
    if gtype is GType.BF16:
        h = bf16_bits(x)
        return h.view(np.uint8).reshape(-1), (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    qt = GGMLQuantizationType[gtype.name]
    if gtype in (GType.Q4_K, GType.Q6_K):  # gguf cannot quantize these: random blocks, sane scales
        blocks = np.frombuffer(rng.bytes(m * k // 256 * gtype.type_size), gtype.block_dtype).copy()
        blocks["d"] = np.float16(0.01)
        if gtype is GType.Q4_K:
            blocks["dmin"] = np.float16(0.02)
        raw = blocks.view(np.uint8).reshape(m, -1)
        return raw.reshape(-1), quants.dequantize(raw, qt).astype(np.float64).reshape(m, k)
    raw = quants.quantize(x, qt)
    return raw.reshape(-1), quants.dequantize(raw, qt).astype(np.float64).reshape(m, k)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    u = x.view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def act_values(x: np.ndarray, gtype: GType) -> np.ndarray:
    """What the kernels multiply by: b quantized/rounded to gtype's vec_dot_type, dequantized."""
    vt = gtype.vec_dot_type
    if vt is GType.F32:
        return x.astype(np.float64)
    if vt is GType.F16:
        return x.astype(np.float16).astype(np.float64)
    if vt is GType.BF16:
        return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    act = quantize_act(x, vt)
    per = 256 if vt is GType.Q8_K else 32
    return (act.qs.reshape(-1, per) * act.d.reshape(-1, 1)).reshape(x.shape).astype(np.float64)


def run_mul_mat(a_type: GType, k: int, m: int, n: int, a23=(1, 1), b23=(1, 1), n_threads=1, seed=0,
                permute_b=False):
    rng = np.random.default_rng(seed)
    ctx = ggx.Context()
    a = ctx.tensor(a_type, (k, m, *a23))
    if permute_b:  # b stored as [k, b2, n, b3] and permuted to [k, n, b2, b3]
        bs = ctx.tensor(GType.F32, (k, b23[0], n, b23[1]))
        b = ctx.permute(bs, 0, 2, 1, 3)
    else:
        bs = b = ctx.tensor(GType.F32, (k, n, *b23))
    node = ctx.mul_mat(a, b)
    alloc(a, bs, node)
    mats, raws = [], []
    for _ in range(a23[0] * a23[1]):
        raw, vals = quantized_weights(a_type, m, k, rng)
        raws.append(raw)
        mats.append(vals)
    a.buffer.set_tensor(a, np.concatenate(raws))
    x = rng.standard_normal((b23[1], b23[0], n, k)).astype(np.float32)
    tensor_array(b)[...] = x
    matmul.mul_mat(node, n_threads)()
    ref = np.empty((b23[1], b23[0], n, m))
    for i3 in range(b23[1]):
        for i2 in range(b23[0]):
            wa = mats[(i3 // (b23[1] // a23[1])) * a23[0] + i2 // (b23[0] // a23[0])]
            ref[i3, i2] = act_values(x[i3, i2], a_type) @ wa.T
    return tensor_array(node), ref


WEIGHT_TYPES = [GType.F32, GType.F16, GType.BF16, GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0, GType.Q4_K,
                GType.Q6_K]


@pytest.mark.parametrize("a_type", WEIGHT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 9])  # gemv, row dots only, 4x4 tiles + leftovers
def test_random_vs_oracle(a_type, n, variant):
    out, ref = run_mul_mat(a_type, 512, 11, n, n_threads=2, seed=n)
    # Q4_1 uses Q8_1's s = d * sum(q) stored as f16, like ggml: the oracle does not round it
    assert nmse(out, ref) < (1e-5 if a_type is GType.Q4_1 else 1e-10)


@pytest.mark.parametrize("a_type", [GType.Q4_0, GType.Q4_1, GType.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 96, 320])  # 1, 3 (odd: a last lone block), 10 blocks per row
def test_gemv_row_quads_any_block_count(a_type, k, variant):
    """The gemv row quads (AVX-512 VNNI: two blocks per 512-bit step) for odd and even block
    counts, 13 rows = 3 quads + a lone row, against the oracle."""
    out, ref = run_mul_mat(a_type, k, 13, 1, n_threads=1, seed=k)
    assert nmse(out, ref) < (1e-5 if a_type is GType.Q4_1 else 1e-10)


@pytest.mark.parametrize("a_type", [GType.Q4_0, GType.Q5_0, GType.Q8_0, GType.F16], ids=lambda t: t.name)
def test_broadcast_and_permuted_b(a_type, variant):
    out, ref = run_mul_mat(a_type, 256, 8, 5, a23=(2, 1), b23=(6, 2), seed=3)
    assert nmse(out, ref) < 1e-10
    out, ref = run_mul_mat(a_type, 256, 8, 5, a23=(3, 1), b23=(3, 1), seed=4, permute_b=True)
    assert nmse(out, ref) < 1e-10


def test_threads_give_identical_results():
    one, _ = run_mul_mat(GType.Q4_0, 1024, 37, 6, n_threads=1, seed=7)
    one = one.copy()
    two, _ = run_mul_mat(GType.Q4_0, 1024, 37, 6, n_threads=2, seed=7)
    np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("n", [1, 8])
def test_q5_0_extreme_values_every_fifth_bit(n, variant):
    """Weights at both ends of Q5_0's range (q = 0 and 31, |q - 16| up to 16) against activations
    at +-127 after quantization: the 8-bit products must neither saturate nor drop a fifth bit.
    K = 640 is Gemma 3 270M's row (20 blocks)."""
    k, m = 640, 8
    rng = np.random.default_rng(9)
    blocks = np.zeros((m, k // 32), GType.Q5_0.block_dtype)
    blocks["d"] = np.float16(0.5)
    blocks["qh"] = rng.integers(0, 2**32, blocks.shape, dtype=np.uint64).astype(np.uint32)
    blocks["qh"][0] = 0xFFFFFFFF  # row 0: every value 16..31
    blocks["qh"][1] = 0  # row 1: every value 0..15
    blocks["qs"] = rng.choice(np.array([0x00, 0xFF, 0x0F, 0xF0], np.uint8), blocks["qs"].shape)
    raw = blocks.view(np.uint8).reshape(-1)
    from gguf import GGMLQuantizationType, quants
    wv = quants.dequantize(raw.reshape(m, -1), GGMLQuantizationType.Q5_0).astype(np.float64)
    ctx = ggx.Context()
    a, b = ctx.tensor(GType.Q5_0, (k, m)), ctx.tensor(GType.F32, (k, n))
    node = ctx.mul_mat(a, b)
    alloc(a, b, node)
    a.buffer.set_tensor(a, raw)
    x = np.where(rng.random((n, k)) < 0.5, -1.0, 1.0).astype(np.float32)
    tensor_array(b)[...] = x
    matmul.mul_mat(node, 1)()
    assert nmse(tensor_array(node), act_values(x, GType.Q5_0) @ wv.T) < 1e-10


@pytest.mark.parametrize("a_type", [GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q6_K, GType.F32], ids=lambda t: t.name)
@pytest.mark.parametrize("b_ne1", [1, 3])
def test_mul_mat_id_repeated_and_unused_experts(a_type, b_ne1, variant):
    rng = np.random.default_rng(11)
    k, m, n_expert, n_used, T = 256, 6, 5, 3, 7
    ctx = ggx.Context()
    a = ctx.tensor(a_type, (k, m, n_expert))
    b = ctx.tensor(GType.F32, (k, b_ne1, T))
    ids = ctx.tensor(GType.I32, (n_used, T))
    node = ctx.mul_mat_id(a, b, ids)
    alloc(a, b, ids, node)
    raws, mats = zip(*(quantized_weights(a_type, m, k, rng) for _ in range(n_expert)))
    a.buffer.set_tensor(a, np.concatenate(raws))
    x = rng.standard_normal((T, b_ne1, k)).astype(np.float32)
    tensor_array(b)[...] = x
    # expert 4 never used, expert 1 used by most tokens, one token uses expert 1 twice
    sel = np.array([[1, 0, 2], [1, 2, 3], [3, 1, 0], [1, 1, 2], [0, 1, 3], [2, 3, 1], [1, 0, 3]], np.int32)
    tensor_array(ids)[...] = sel
    matmul.mul_mat_id(node, 2)()
    out = tensor_array(node)[0]
    for t in range(T):
        for e in range(n_used):
            ref = mats[sel[t, e]] @ act_values(x[t, e % b_ne1][None], a_type)[0]
            assert nmse(out[t, e], ref) < (1e-5 if a_type is GType.Q4_1 else 1e-10), (t, e)


# --- bad input never reaches a kernel ------------------------------------------------------------
def _node(a_type=GType.Q4_0, k=64, m=4, n=2):
    ctx = ggx.Context()
    a, b = ctx.tensor(a_type, (k, m)), ctx.tensor(GType.F32, (k, n))
    node = ctx.mul_mat(a, b)
    return ctx, a, b, node


def test_rejects_missing_storage():
    _, a, b, node = _node()
    with pytest.raises(GGXUnsupported, match="no storage"):
        matmul.mul_mat(node, 1)()


def test_rejects_wrong_node_and_bad_destination():
    ctx, a, b, node = _node()
    alloc(a, b, node)
    with pytest.raises(GGXUnsupported, match="not a MUL_MAT node"):
        matmul.mul_mat(a, 1)
    node.ne = (4, 3, 1, 1)  # corrupted after build: must be caught before any kernel
    with pytest.raises(GGXShapeError, match="destination"):
        matmul.mul_mat(node, 1)()


def test_rejects_unsupported_weight_type():
    ctx, a, b, node = _node()
    alloc(a, b, node)
    a.type = GType.Q8_1
    with pytest.raises(GGXUnsupported, match="Q8_1"):
        matmul.mul_mat(node, 1)()


def test_rejects_buffer_overrun():
    ctx, a, b, node = _node()
    alloc(a, b, node)
    a.offset = a.buffer.size - 10
    with pytest.raises(GGXShapeError, match="overruns"):
        matmul.mul_mat(node, 1)()


def test_mul_mat_id_rejects_out_of_range_ids():
    ctx = ggx.Context()
    a = ctx.tensor(GType.Q4_0, (64, 4, 3))
    b = ctx.tensor(GType.F32, (64, 1, 2))
    ids = ctx.tensor(GType.I32, (2, 2))
    node = ctx.mul_mat_id(a, b, ids)
    alloc(a, b, ids, node)
    tensor_array(ids)[...] = np.array([[0, 1], [2, 3]], np.int32)
    with pytest.raises(GGXShapeError, match=r"ids\[1, 1\] = 3"):
        matmul.mul_mat_id(node, 1)()


# --- activation quantization --------------------------------------------------------------------
@pytest.mark.parametrize("gtype", [GType.Q8_0, GType.Q8_1, GType.Q8_K], ids=lambda t: t.name)
def test_quantize_act_blocks(gtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x[1, :256] = 0.0  # an all-zero block
    act = quantize_act(x, gtype)
    blocks = to_blocks(act)
    assert blocks.size == x.size // gtype.block_size * gtype.type_size
    blk = blocks.view(gtype.block_dtype)
    per = gtype.block_size
    qs = blk["qs"].astype(np.int64)
    d = blk["d"].astype(np.float64)
    back = (qs * d[:, None]).reshape(x.shape)
    # within half a step of the input (plus, for f16 d, its rounding, which q does not see, as
    # in ggml: 127 * 2**-11 steps); the all-zero block stays zero
    step = np.repeat(np.abs(d), per).reshape(x.shape)
    assert np.all(np.abs(back - x) <= 0.57 * step)
    assert np.all(back[1, :256] == 0)
    if gtype is GType.Q8_1:
        np.testing.assert_allclose(blk["s"].astype(np.float64), d * qs.sum(axis=1), rtol=2e-3, atol=1e-3)
    if gtype is GType.Q8_K:
        np.testing.assert_array_equal(blk["bsums"], qs.reshape(-1, 16, 16).sum(axis=2))
        assert np.all(qs.min(axis=1)[d != 0] == -127)  # the largest |x| maps to -127 (ggml's ref)
    if gtype is GType.Q8_0:  # gguf rounds half away from zero, ggml's AVX path (and ours) to even
        from gguf import GGMLQuantizationType, quants

        ref = quants.quantize(x, GGMLQuantizationType.Q8_0).reshape(-1).view(gtype.block_dtype)
        assert np.mean(ref["qs"] == blk["qs"]) > 0.99
        np.testing.assert_array_equal(ref["d"], blk["d"])
    group = 16 if gtype is GType.Q8_K else 4
    np.testing.assert_array_equal(act.s4, act.qs.reshape(-1, group).sum(axis=1))


def test_quantize_act_parallel_matches_serial():
    x = np.random.default_rng(1).standard_normal((64, 2048)).astype(np.float32)
    for gtype in (GType.Q8_0, GType.Q8_K):
        one, two = quantize_act(x, gtype, 1), quantize_act(x, gtype, 2)
        for p, q in zip(one[1:], two[1:]):
            np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("a_type", [GType.Q4_0, GType.Q4_K, GType.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("b_ne1", [1, 3])
def test_one_token_mul_mat_id_reads_the_ids_at_every_compute(a_type, b_ne1):
    """A decode step's MUL_MAT_ID is bound once (`token_experts`): prepared and run fused on two
    threads, every compute reads the ids anew (a repeated expert included), and an id out of
    range raises, naming it, before the product writes anything."""
    from ggx import registry
    from ggx.alloc import alloc_tensors
    from ggx_cpu.launch import SequenceLaunch

    rng = np.random.default_rng(5)
    k, m, n_expert, n_used = 256, 12, 6, 3
    ctx = ggx.Context()
    a = ctx.tensor(a_type, (k, m, n_expert))
    b = ctx.tensor(GType.F32, (k, b_ne1, 1))
    ids = ctx.tensor(GType.I32, (n_used, 1))
    node = ctx.mul_mat_id(a, b, ids)
    dev = registry.get_device("CPU")
    alloc_tensors(dev.buffer_type(), [a, b, ids, node])
    raws, mats = zip(*(quantized_weights(a_type, m, k, rng) for _ in range(n_expert)))
    a.buffer.set_tensor(a, np.concatenate(raws))
    graph = ggx.build_graph(node)
    be = dev.init_backend(n_threads=2)
    be.graph_prepare(graph)
    if a_type.vec_dot_type is not GType.F16:  # F16 rounds its activations in Python
        assert [type(f) for f in be.prepared.kept(graph).calls] == [SequenceLaunch]
    for sel in ([5, 0, 2], [1, 1, 4], [3, 2, 0]):
        x = rng.standard_normal((b_ne1, k)).astype(np.float32)
        tensor_array(b)[...] = x.reshape(tensor_array(b).shape)
        tensor_array(ids)[...] = np.array(sel, np.int32).reshape(tensor_array(ids).shape)
        be.graph_compute(graph)
        out = tensor_array(node).reshape(n_used, m)
        for e in range(n_used):
            ref = mats[sel[e]] @ act_values(x[e % b_ne1][None], a_type)[0]
            assert nmse(out[e], ref) < 1e-10, (sel, e)
    before = tensor_array(node).copy()
    tensor_array(ids)[...] = np.array([0, 6, 1], np.int32).reshape(tensor_array(ids).shape)
    with pytest.raises(GGXShapeError, match="index 6, outside 0..5"):
        be.graph_compute(graph)
    assert np.array_equal(tensor_array(node), before)
