"""The kernels against ggml's recorded outputs (bytes where ggml's are exact) and the reference backend."""
import json
from importlib import resources

import numpy as np
import pytest

import ggx
from ggx.errors import GGXShapeError
from ggx.ops import GeluKind, RopeMode, SortOrder
from ggx.types import GType
from ggx_cpu.plugin import backend_reg

GOLDEN = resources.files("ggx.conformance") / "golden_ops"


@pytest.fixture(scope="module")
def cpu():
    return backend_reg().devices()[0]


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sum((a - b) ** 2) / max(np.sum(b * b), 1e-30))


def golden(name: str) -> dict:
    with GOLDEN.joinpath(f"{name}.npz").open("rb") as f, np.load(f) as z:
        return {k: z[k] for k in z.files}


def golden_input(ctx, inputs, z, i):
    """Leaf over the recorded storage bytes, viewed like ggml's input."""
    t = GType.parse(str(z[f"in{i}_type"]))
    leaf = ctx.tensor(GType.parse(str(z[f"in{i}_storage_type"])), [int(x) for x in z[f"in{i}_storage_ne"]])
    raw = z[f"in{i}_raw"]
    inputs[leaf] = raw.view(np.float32) if leaf.type is GType.F32 else raw  # ggx.tensor_data.to_raw reads F32 as values
    ne, nb = [int(x) for x in z[f"in{i}_ne"]], [int(x) for x in z[f"in{i}_nb"]]
    offs = int(z[f"in{i}_view_offs"])
    if list(leaf.ne) == ne and offs == 0 and tuple(nb) == leaf.nb and t is leaf.type:
        return leaf
    return ctx.view(leaf, ne, nb, offset=offs)


def raw_bytes(cpu, out):
    """The bytes of a CPU result tensor (whole storage of its root)."""
    buf = out.data_buffer
    return buf.host_view()[out.data_offset: out.data_offset + out.nbytes].copy()


# --- ggml's exact outputs -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cpy_f32_f16_37x3_specials", "cpy_f32_f16_37x5_transposed", "cpy_f32_q8_0_96x5",
                                  "cpy_f32_q4_0_96x5", "cpy_f32_q4_1_96x5"])
def test_cpy_bytes_equal_ggml(cpu, name):
    z = golden(name)
    ctx, inputs = ggx.Context(), {}
    a = golden_input(ctx, inputs, z, 0)
    b = ctx.tensor(GType.parse(str(z["out_type"])), [int(x) for x in z["out_ne"]])
    out = ctx.cpy(a, b)
    inputs[b] = np.zeros(b.nbytes, np.uint8) if b.type is not GType.F32 else np.zeros(b.nelements, np.float32)
    ggx.compute(out, inputs, device=cpu)
    assert np.array_equal(raw_bytes(cpu, out), z["out_raw"])


@pytest.mark.parametrize("name", ["set_rows_f16", "set_rows_q8_0"])
def test_set_rows_bytes_equal_ggml(cpu, name):
    z = golden(name)
    ctx, inputs = ggx.Context(), {}
    dst, src, ids = (golden_input(ctx, inputs, z, i) for i in range(3))
    out = ctx.set_rows(dst, src, ids)
    ggx.compute(out, inputs, device=cpu)
    assert np.array_equal(raw_bytes(cpu, out), z["out_raw"])


@pytest.mark.parametrize("name", ["argsort_asc_37x4", "argsort_desc_37x4", "top_k_5_37x4", "argsort_top_k_5_37x4"])
def test_sort_indices_equal_ggml(cpu, name):
    z = golden(name)
    params = json.loads(str(z["params_json"]))
    ctx, inputs = ggx.Context(), {}
    a = golden_input(ctx, inputs, z, 0)
    if name.startswith("top_k"):
        out = ctx.top_k(a, params["k"])
    elif "top_k" in name:
        out = ctx.argsort_top_k(a, params["k"])
    else:
        out = ctx.argsort(a, SortOrder(params["fn"]))
    got = ggx.compute(out, inputs, device=cpu)[0]
    assert np.array_equal(got.reshape(-1), z["out_values_i32"].reshape(-1))


@pytest.mark.parametrize("name,kind", [("gelu_1000x3_specials", GeluKind.TANH), ("gelu_37x5_view", GeluKind.TANH),
                                       ("gelu_quick_37x5", GeluKind.QUICK)])
def test_gelu_table_equals_ggml(cpu, name, kind):
    """ggml's F16 lookup table: the results are F16 values, so they match ggml exactly."""
    z = golden(name)
    ctx, inputs = ggx.Context(), {}
    out = ctx.gelu(golden_input(ctx, inputs, z, 0), kind)
    got = ggx.compute(out, inputs, device=cpu)[0]
    assert np.array_equal(got.reshape(-1), z["out_values"].reshape(-1))


@pytest.mark.parametrize("name", ["fa_d64_gqa1_t7_kv33_prec_default", "fa_d128_gqa3_t5_kv40_prec_f32",
                                  "fa_d64_gqa4_t1_kv50", "fa_d128_gqa4_t3_kv19_nomask", "fa_d64_gqa1_t64_kv70_tiled",
                                  "fa_d64_gqa3_t6_kv21_views"])
def test_flash_attn_close_to_ggml(cpu, name):
    """Same precision path as ggml (F16 Q and V accumulator below 64 tokens): far below the 5e-4 bar."""
    z = golden(name)
    p = json.loads(str(z["params_json"]))
    ctx, inputs = ggx.Context(), {}
    x = {str(z[f"in{i}_name"]): golden_input(ctx, inputs, z, i) for i in range(int(z["n_inputs"]))}
    out = ctx.flash_attn_ext(x["q"], x["k"], x["v"], x.get("mask"), p["scale"], p["max_bias"], p["logit_softcap"])
    got = ggx.compute(out, inputs, device=cpu)[0]
    assert nmse(got.reshape(-1), z["out_values"].reshape(-1)) < 1e-7


@pytest.mark.parametrize("name", ["rope_normal_nd32_base1e4_fs1", "rope_neox_nd32_base1e5_fs0.5_view",
                                  "softmax_maskf16_s0.125_alibi8_h4", "softmax_maskf32_s0.125_alibi8_h6",
                                  "rms_norm_eps1e-5_576x4_view", "norm_eps1e-5_1000x3_view", "get_rows_q4_1",
                                  "get_rows_q8_0_3d", "swiglu_fused_37x5", "add_permuted_a_37x5x2",
                                  "mul_37x5x2x3_b37x5x1x3", "sum_rows_37x5x2", "silu_37x5_view", "gelu_erf_37x5"])
def test_ops_close_to_ggml(cpu, name):
    z = golden(name)
    p = json.loads(str(z["params_json"]))
    ctx, inputs = ggx.Context(), {}
    x = [golden_input(ctx, inputs, z, i) for i in range(int(z["n_inputs"]))]
    op = str(z["op"])
    build = {
        "ROPE": lambda: ctx.rope(x[0], x[1], p["n_dims"], RopeMode(p["mode"]), p["freq_base"], p["freq_scale"]),
        "SOFT_MAX": lambda: ctx.soft_max(x[0], x[1] if len(x) > 1 else None, p["scale"], p["max_bias"]),
        "RMS_NORM": lambda: ctx.rms_norm(x[0], p["eps"]),
        "NORM": lambda: ctx.norm(x[0], p["eps"]),
        "GET_ROWS": lambda: ctx.get_rows(x[0], x[1]),
        "GLU:SWIGLU": lambda: ctx.swiglu(x[0], x[1] if len(x) > 1 else None),
        "ADD": lambda: ctx.add(x[0], x[1]),
        "MUL": lambda: ctx.mul(x[0], x[1]),
        "SUM_ROWS": lambda: ctx.sum_rows(x[0]),
        "UNARY:SILU": lambda: ctx.silu(x[0]),
        "UNARY:GELU_ERF": lambda: ctx.gelu(x[0], GeluKind.ERF),
    }[op]
    got = ggx.compute(build(), inputs, device=cpu)[0]
    assert nmse(got.reshape(-1), z["out_values"].reshape(-1)) < 1e-10


@pytest.mark.parametrize("name", ["softmax_maskf16_s0.125_alibi8_h4", "softmax_maskf32_s0.125_alibi8_h6",
                                  "swiglu_fused_37x5", "silu_37x5_view"])
def test_exp_ops_equal_ggml_bit_for_bit(cpu, ggml_avx512_form, name):
    """ggml's vectorized expf in its AVX-512 form (the build these outputs come from), chunks of 16
    and libm expf on the tail: SOFT_MAX, SILU and the swiglu GLU give ggml's float32 bits."""
    z = golden(name)
    p = json.loads(str(z["params_json"]))
    ctx, inputs = ggx.Context(), {}
    x = [golden_input(ctx, inputs, z, i) for i in range(int(z["n_inputs"]))]
    op = str(z["op"])
    if op == "SOFT_MAX":
        out = ctx.soft_max(x[0], x[1] if len(x) > 1 else None, p["scale"], p["max_bias"])
    else:
        out = ctx.swiglu(x[0]) if op == "GLU:SWIGLU" else ctx.silu(x[0])
    got = ggx.compute(out, inputs, device=cpu)[0].reshape(-1)
    assert np.array_equal(got.view(np.uint32), z["out_values"].astype(np.float32).reshape(-1).view(np.uint32))


# --- against the reference backend -----------------------------------------------------------------
def both(cpu, outs, inputs):
    return ggx.compute(outs, inputs, device=cpu), ggx.compute(outs, inputs, device="ref")


def test_cont_of_permuted_and_dup(cpu):
    rng = np.random.default_rng(0)
    ctx = ggx.Context()
    a = ctx.tensor(GType.F32, (8, 5, 3, 2))
    p = ctx.permute(a, 2, 0, 3, 1)
    outs = [ctx.cont(p), ctx.dup(p), ctx.cont(ctx.transpose(a), (5 * 8, 3, 2))]
    got, ref = both(cpu, outs, {a: rng.standard_normal((2, 3, 5, 8)).astype(np.float32)})
    for g, r in zip(got, ref):
        assert np.array_equal(g, r)


@pytest.mark.parametrize("dst", ["F16", "BF16", "Q8_0", "Q4_K", "F32"])
def test_cpy_reshaping_conversions(cpu, dst):
    """CPY between different shapes of the same element count, from a strided view."""
    rng = np.random.default_rng(1)
    ctx = ggx.Context()
    a = ctx.tensor(GType.F32, (6, 256, 2))
    b = ctx.tensor(GType.parse(dst), (256, 12))
    out = ctx.cpy(ctx.transpose(a), b)
    zero = np.zeros(b.nbytes, np.uint8) if b.type is not GType.F32 else np.zeros(b.nelements, np.float32)
    inputs = {a: rng.standard_normal((2, 256, 6)).astype(np.float32), b: zero}
    got = ggx.compute(out, inputs, device=cpu)[0]
    ref = ggx.compute(out, inputs, device="ref")[0]
    assert np.array_equal(got, ref)


def test_f16_to_f32_copy_and_i32_rows(cpu):
    rng = np.random.default_rng(2)
    ctx = ggx.Context()
    h = ctx.tensor(GType.F16, (33, 4))
    f = ctx.tensor(GType.F32, (33, 4))
    table = ctx.tensor(GType.I32, (5, 7))
    ids = ctx.tensor(GType.I32, (3,))
    outs = [ctx.cpy(h, f), ctx.get_rows(table, ids)]
    inputs = {h: rng.standard_normal((4, 33)), f: np.zeros((4, 33), np.float32),
              table: rng.integers(-1000, 1000, (7, 5)), ids: np.array([6, 0, 6])}
    got, ref = both(cpu, outs, inputs)
    assert np.array_equal(got[0], ref[0])
    assert np.array_equal(got[1], ref[1])


def test_glu_swapped_and_geglu(cpu):
    rng = np.random.default_rng(3)
    ctx = ggx.Context()
    a = ctx.tensor(GType.F32, (64, 3))
    outs = [ctx.glu(a, kind="swiglu", swapped=True), ctx.glu(a, kind="geglu")]
    got, ref = both(cpu, outs, {a: rng.standard_normal((3, 64)).astype(np.float32) * 4})
    for g, r in zip(got, ref):
        assert nmse(g, r) < 1e-7


def test_scale_bias_and_rope_yarn(cpu):
    rng = np.random.default_rng(4)
    ctx = ggx.Context()
    a = ctx.tensor(GType.F32, (64, 2, 3))
    pos = ctx.tensor(GType.I32, (3,))
    outs = [ctx.scale(a, 0.5, 0.25),
            ctx.rope(a, pos, 48, RopeMode.NEOX, 10000.0, 0.25, 4096, 1.0, 1.0, 32.0, 1.0)]
    got, ref = both(cpu, outs, {a: rng.standard_normal((3, 2, 64)).astype(np.float32), pos: np.array([0, 7, 300])})
    assert np.array_equal(got[0], ref[0])
    assert nmse(got[1], ref[1]) < 1e-10


@pytest.mark.parametrize("mode", [RopeMode.NORMAL, RopeMode.NEOX])
def test_rope_freq_factors(cpu, mode):
    """The third source divides each pair's angle (ggml_rope_ext's c), as the reference does;
    without it the result differs (the factors reach the kernel)."""
    rng = np.random.default_rng(6)
    ctx = ggx.Context()
    a, pos, ff = ctx.tensor(GType.F32, (64, 2, 3)), ctx.tensor(GType.I32, (3,)), ctx.tensor(GType.F32, (24,))
    outs = [ctx.rope(a, pos, 48, mode, 5e5, freq_factors=ff),
            ctx.rope(a, pos, 48, mode, 5e5, 0.25, 4096, 1.0, 1.0, 32.0, 1.0, freq_factors=ff),
            ctx.rope(a, pos, 48, mode, 5e5)]
    inputs = {a: rng.standard_normal((3, 2, 64)).astype(np.float32), pos: np.array([0, 7, 300]),
              ff: rng.uniform(1.0, 8.0, 24).astype(np.float32)}
    got, ref = both(cpu, outs, inputs)
    for g, r in zip(got, ref):
        assert nmse(g, r) < 1e-10
    assert nmse(got[0], got[2]) > 1e-3


def test_flash_attn_softcap_alibi_f32_kv(cpu):
    rng = np.random.default_rng(5)
    ctx = ggx.Context()
    q = ctx.tensor(GType.F32, (32, 3, 4))
    k = ctx.tensor(GType.F32, (32, 10, 2))
    v = ctx.tensor(GType.F32, (16, 10, 2))
    m = ctx.tensor(GType.F16, (10, 3))
    out = ctx.flash_attn_ext(q, k, v, m, scale=0.2, max_bias=4.0, logit_softcap=20.0)
    mask = np.zeros((3, 10), np.float32)
    mask[0, 5:] = -np.inf
    inputs = {q: rng.standard_normal((4, 3, 32)), k: rng.standard_normal((2, 10, 32)),
              v: rng.standard_normal((2, 10, 16)), m: mask}
    got, ref = both(cpu, [out], inputs)
    assert nmse(got[0], ref[0]) < 1e-8


@pytest.mark.parametrize("id_type", [GType.I64, GType.I32])
def test_set_rows_duplicates_last_write_wins(cpu, id_type):
    """Where the ids repeat a row the last source row wins, on one thread and split in parts
    (each destination row belongs to one part, whatever the ids hold)."""
    from ggx.host import tensor_array
    from ggx_cpu import device

    ctx = ggx.Context()
    dst = ctx.tensor(GType.F32, (32, 4))
    src = ctx.tensor(GType.F32, (32, 3))
    ids = ctx.tensor(id_type, (3,))
    out = ctx.set_rows(dst, src, ids)
    rows = np.arange(3 * 32, dtype=np.float32).reshape(3, 32)
    got = ggx.compute(out, {dst: np.zeros((4, 32), np.float32), src: rows, ids: np.array([2, 2, 0])}, device=cpu)[0]
    assert np.array_equal(got[2], rows[1]) and np.array_equal(got[0], rows[2]) and not got[1].any()

    rng = np.random.default_rng(5)
    big_dst, big_src = ctx.tensor(GType.F16, (64, 9)), ctx.tensor(GType.F32, (64, 40))
    big_ids = ctx.tensor(id_type, (40,))
    many = ctx.set_rows(big_dst, big_src, big_ids)
    values, which = rng.standard_normal((40, 64)).astype(np.float32), rng.integers(0, 9, 40)
    ggx.compute(many, {big_dst: np.zeros((9, 64), np.float32), big_src: values, big_ids: which}, device=cpu)
    want = np.zeros((9, 64), np.float32)
    for i, r in enumerate(which):
        want[r] = values[i].astype(np.float16)
    for n in (1, 2, 3, 4):
        tensor_array(big_dst)[...] = 0
        device.kernel_for(many.op)(many, n)()
        assert np.array_equal(tensor_array(many).reshape(9, 64).astype(np.float32), want), n


# --- bad input never reaches a kernel ---------------------------------------------------------------
def test_out_of_range_ids_are_refused(cpu):
    ctx = ggx.Context()
    a = ctx.tensor(GType.Q8_0, (32, 4))
    ids = ctx.tensor(GType.I32, (2,))
    out = ctx.get_rows(a, ids)
    with pytest.raises(GGXShapeError, match="outside 0..3"):
        ggx.compute(out, {a: np.zeros((4, 32)), ids: np.array([1, 4])}, device=cpu)
    dst = ctx.tensor(GType.F16, (32, 4))
    src = ctx.tensor(GType.F32, (32, 1))
    sids = ctx.tensor(GType.I64, (1,))
    with pytest.raises(GGXShapeError, match="outside"):
        ggx.compute(ctx.set_rows(dst, src, sids), {dst: np.zeros((4, 32)), src: np.zeros((1, 32)),
                                                     sids: np.array([-1])}, device=cpu)


def test_tampered_node_is_refused(cpu):
    """A node whose shape disagrees with its sources (not built by Context) fails before the kernel."""
    ctx = ggx.Context()
    a = ctx.tensor(GType.F32, (16, 2))
    out = ctx.silu(a)
    out.ne = (32, 2, 1, 1)  # a lie the kernel would overrun on
    with pytest.raises(GGXShapeError):
        ggx.compute(out, {a: np.zeros((2, 16), np.float32)}, device=cpu)


# --- one thread (serial row kernels) and n threads (chunks of rows) agree ---------------------------
def test_serial_and_threaded_row_kernels_agree(cpu):
    """Small ops run the serial row kernel, big ones a prange over chunks of the same kernel: the
    bytes must not depend on which (nor on how the rows split: 7 rows over 2 and 3 threads)."""
    import numba

    from ggx.host import tensor_array
    from ggx_cpu import device

    rng = np.random.default_rng(11)
    ctx = ggx.Context()
    a = ctx.tensor(GType.F32, (64, 7))
    b = ctx.tensor(GType.F32, (64, 1))
    pos = ctx.tensor(GType.I32, (7,))
    mask = ctx.tensor(GType.F16, (64, 7))
    ids = ctx.tensor(GType.I32, (5,))
    rows = ctx.tensor(GType.I32, (3,))
    cache = ctx.tensor(GType.F16, (64, 9))
    heads = ctx.reshape(a, [16, 4, 7])
    outs = [ctx.add(a, b), ctx.mul(a, b), ctx.scale(a, 0.5, 0.25), ctx.gelu(a, GeluKind.TANH), ctx.swiglu(a),
            ctx.rms_norm(a, 1e-5), ctx.norm(a, 1e-5), ctx.rope(heads, pos, 16, RopeMode.NEOX, 10000.0),
            ctx.soft_max(a, mask, 0.3), ctx.get_rows(a, rows),
            ctx.set_rows(cache, ctx.view(a, [64, 5], [a.nb[1]]), ids)]
    m = np.zeros((7, 64), np.float32)
    m[:, 40:] = -np.inf
    inputs = {a: rng.standard_normal((7, 64)), b: rng.standard_normal((1, 64)), pos: np.arange(7) * 3,
              mask: m, ids: np.array([8, 0, 3, 5, 1]), rows: np.array([6, 0, 6]), cache: np.zeros((9, 64), np.float32)}
    ggx.compute(outs, inputs, device=cpu)
    runs = []
    for n in (1, 2, 3):
        got = []
        for out in outs:
            device.kernel_for(out.op)(out, n)()
            got.append(tensor_array(out).copy())
        runs.append(got)
    assert numba.get_num_threads() >= 1
    for one, many in zip(runs[0], runs[1]):
        assert one.tobytes() == many.tobytes()
    for one, many in zip(runs[0], runs[2]):
        assert one.tobytes() == many.tobytes()
    written = runs[0][-1].reshape(9, 64).view(np.float16).astype(np.float32)
    assert np.array_equal(written[8], inputs[a][0].astype(np.float16).astype(np.float32))
    assert np.abs(runs[0][0]).sum() > 0


def test_remembered_layouts_still_refuse_an_edited_view(cpu):
    """Layout proofs are remembered per (type, ne, nb, offset, buffer size): a view moved or
    widened after a successful run is a new layout, checked again before the kernel."""
    from ggx.host import tensor_array
    from ggx_cpu import device

    ctx = ggx.Context()
    a = ctx.tensor(GType.F32, (16, 4))
    v = ctx.view(a, [16, 2], [a.nb[1]], offset=0)
    out = ctx.silu(v)
    ggx.compute(out, {a: np.ones((4, 16), np.float32)}, device=cpu)
    silu = device.kernel_for(out.op)
    silu(out, 1)  # the same layout again: fine
    assert np.allclose(tensor_array(out), 1 / (1 + np.exp(-1.0)))
    v.view_offs = 3 * a.nb[1]  # rows 3..4 of a 4-row buffer: overruns it
    with pytest.raises(GGXShapeError, match="overruns"):
        silu(out, 1)
    v.view_offs = 0
    size = a.data_buffer.host_view().size
    v.nb = (4, size, 2 * size, 2 * size)  # a row stride that reaches past the end
    with pytest.raises(GGXShapeError, match="overruns"):
        silu(out, 1)
    v.nb = [4, 64, 128, 128]  # edited into a list: checked, not remembered
    silu(out, 1)
