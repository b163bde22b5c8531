"""The reference backend against ggml's own op outputs (ggx/conformance/golden_ops).

Each case's graph is rebuilt with `ggx.Context` from the recorded inputs (types, ne, nb, view
offsets), the raw input bytes are loaded, the graph runs on `ref` and the result is compared with
ggml's: float outputs by NMSE (sum((a-b)^2)/sum(b^2), as ggml's test-backend-ops) under a
tolerance per op, integer outputs exactly, F16/quantized conversions byte for byte.
"""
from __future__ import annotations

import itertools
import json
from importlib import resources

import numpy as np
import pytest

import ggx
from ggx.tensor import Tensor

GOLDEN = resources.files("ggx.conformance") / "golden_ops"
INDEX = json.loads((GOLDEN / "index.json").read_text())
CASES = INDEX["cases"]
N_CASES = 95  # every case of the dev set is used

# Largest NMSE accepted per op, with the reason ref and ggml may differ there (measured on the dev
# set: the margin is 10-50x the largest NMSE seen, so a real semantic error cannot hide under it).
NMSE_TOL = {
    "ROPE": 1e-10,  # ggml: f32 sin/cos of an f32 theta built by repeated products (seen 2e-13)
    "SOFT_MAX": 1e-12,  # ggml: f32 exp and sums; ref: f64 (seen 7e-15)
    "FLASH_ATTN_EXT": 1e-5,  # ggml under 64 tokens rounds Q and the V accumulator to F16 (seen 1e-6)
    "RMS_NORM": 1e-12,  # f32 vs f64 summation (seen 4e-15)
    "NORM": 1e-12,  # f32 vs f64 summation (seen 4e-15)
    "UNARY:GELU": 1e-6,  # ggml looks GELU up in an F16 table: input and output rounded (seen 6e-8)
    "UNARY:GELU_QUICK": 1e-6,  # the same F16 table lookup as GELU (seen 7e-8)
    "UNARY:GELU_ERF": 1e-12,  # f32 erff vs f64 erf (seen 8e-16)
    "UNARY:SILU": 1e-12,  # f32 expf vs f64 exp (seen 3e-15)
    "GLU:SWIGLU": 1e-12,  # f32 expf vs f64 exp (seen 3e-15)
    "ADD": 0.0,  # one correctly rounded f32 operation: identical
    "MUL": 0.0,  # one correctly rounded f32 operation: identical
    "SCALE": 1e-14,  # one f32 multiply, last bit at most (seen 8e-17)
    "SUM_ROWS": 1e-12,  # f32 vs f64 summation
    "GET_ROWS": 0.0,  # dequantization to f32 is exact in both
}
FA_TILED_TOL = 1e-10  # ggml's tiled path (>= 64 tokens) is all F32 (seen 2e-14)
# MUL_MAT / MUL_MAT_ID: ggml converts the activations to the weight's vec_dot_type; ref keeps them exact.
MUL_MAT_TOL = {
    "f32": 1e-10,  # no conversion: summation order only (seen 1e-14)
    "f16": 5e-7,  # activations rounded to F16, 11-bit mantissa (seen 4e-8)
    "bf16": 3e-5,  # activations rounded to BF16, 8-bit mantissa (seen 2.4e-6)
    "q8_0": 2e-4,  # activations quantized to Q8_0, 8-bit blocks of 32 (seen 2e-5)
    "q8_1": 2e-4,  # activations quantized to Q8_1, 8-bit blocks of 32 (seen 1.5e-5)
    "q8_K": 2e-4,  # activations quantized to Q8_K, 8-bit blocks of 256 (seen 2e-5)
}
EXACT_OPS = {"ARGSORT", "ARGSORT(view)", "TOP_K", "CPY", "SET_ROWS"}


def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    return float(np.sum((out - ref) ** 2) / np.sum(ref * ref))


def load(case: dict) -> dict:
    with (GOLDEN / case["file"]).open("rb") as f:
        z = np.load(f)
        return {k: z[k] for k in z.files}


def _as_permutation(ctx: ggx.Context, storage: Tensor, ne: tuple, nb: tuple) -> Tensor | None:
    """A transpose/permute of `storage` with exactly these ne and nb, if there is one."""
    for axes in itertools.permutations(range(4)):
        if all(storage.ne[i] == ne[ax] and storage.nb[i] == nb[ax] for i, ax in enumerate(axes)):
            if axes == (1, 0, 2, 3):
                return ctx.transpose(storage)
            if axes != (0, 1, 2, 3) and not (storage.type.is_quantized and axes[0] != 0):
                return ctx.permute(storage, *axes)
    return None


def build_input(ctx: ggx.Context, z: dict, i: int) -> tuple[Tensor, Tensor]:
    """(tensor as the op takes it, root storage leaf) for input i of a case."""
    ne, nb = tuple(int(x) for x in z[f"in{i}_ne"]), tuple(int(x) for x in z[f"in{i}_nb"])
    offs = int(z[f"in{i}_view_offs"])
    storage = ctx.tensor(str(z[f"in{i}_storage_type"]), [int(x) for x in z[f"in{i}_storage_ne"]],
                         name=str(z[f"in{i}_name"]))
    if storage.ne == ne and storage.nb == nb and offs == 0:
        return storage, storage
    t = _as_permutation(ctx, storage, ne, nb) if offs == 0 else None
    if t is None:
        t = ctx.view(storage, ne, nb, offs)
    assert t.ne == ne and t.nb == nb, (t.ne, t.nb, ne, nb)
    return t, storage


def build_op(ctx: ggx.Context, case: dict, z: dict, x: dict[str, Tensor]) -> Tensor:
    """The ggx call that matches the case's ggml call."""
    op, p = case["op"], case["params"]
    if op == "ROPE":
        return ctx.rope(x["a"], x["pos"], p["n_dims"], p["mode"], p["freq_base"], p["freq_scale"],
                        p["n_ctx_orig"], p["ext_factor"], p["attn_factor"], p["beta_fast"], p["beta_slow"])
    if op == "SOFT_MAX":
        return ctx.soft_max(x["a"], x.get("mask"), p["scale"], p["max_bias"])
    if op == "FLASH_ATTN_EXT":
        prec = "f32" if p["prec"] == "GGML_PREC_F32" else "default"
        return ctx.flash_attn_ext(x["q"], x["k"], x["v"], x.get("mask"), p["scale"], p["max_bias"],
                                  p["logit_softcap"], prec)
    if op == "RMS_NORM":
        return ctx.rms_norm(x["a"], p["eps"])
    if op == "NORM":
        return ctx.norm(x["a"], p["eps"])
    if op.startswith("UNARY:"):
        fn = p["fn"]
        return ctx.silu(x["a"]) if fn == "silu" else ctx.gelu(x["a"], fn)
    if op == "GLU:SWIGLU":
        return ctx.swiglu(x["a"], x.get("b"))
    if op in ("ADD", "MUL"):
        return getattr(ctx, op.lower())(x["a"], x["b"])
    if op == "SCALE":
        return ctx.scale(x["a"], p["s"])
    if op == "SUM_ROWS":
        return ctx.sum_rows(x["a"])
    if op == "GET_ROWS":
        return ctx.get_rows(x["a"], x["ids"])
    if op == "SET_ROWS":
        return ctx.set_rows(x["dst"], x["src"], x["ids"])
    if op == "CPY":
        dst = ctx.tensor(str(z["out_type"]), [int(v) for v in z["out_ne"]], name="dst")
        return ctx.cpy(x["a"], dst)
    if op == "ARGSORT":
        return ctx.argsort(x["a"], p["fn"])
    if op == "ARGSORT(view)":
        return ctx.argsort_top_k(x["a"], p["k"])
    if op == "TOP_K":
        return ctx.top_k(x["a"], p["k"])
    if op == "MUL_MAT":
        return ctx.mul_mat(x["a"], x["b"])
    if op == "MUL_MAT_ID":
        return ctx.mul_mat_id(x["as"], x["b"], x["ids"])
    raise AssertionError(f"golden case {case['name']}: op {op} has no ggx builder here")


def tolerance(case: dict) -> float:
    if case["op"] in ("MUL_MAT", "MUL_MAT_ID"):
        return MUL_MAT_TOL[case["params"]["vec_dot_type"]]
    if case["op"] == "FLASH_ATTN_EXT" and case["params"]["cpu_kernel_path"].startswith("tiled"):
        return FA_TILED_TOL
    return NMSE_TOL[case["op"]]


def test_every_case_is_used():
    assert len(CASES) == N_CASES
    files = sorted(f.name for f in GOLDEN.iterdir() if f.name.endswith(".npz"))
    assert files == sorted(c["file"] for c in CASES)  # no case file left out of the index
    for case in CASES:
        assert case["op"] in EXACT_OPS or tolerance(case) >= 0.0


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden(case: dict, run_on_ref, raw_bytes):
    z = load(case)
    ctx = ggx.Context()
    taken, inputs = {}, {}
    for i in range(int(z["n_inputs"])):
        t, storage = build_input(ctx, z, i)
        taken[str(z[f"in{i}_name"])] = t
        inputs[storage] = z[f"in{i}_raw"]
    out = build_op(ctx, case, z, taken)
    assert list(out.ne) == [int(v) for v in z["out_ne"]]
    assert list(out.nb) == [int(v) for v in z["out_nb"]]
    assert out.type.name.lower() == str(z["out_type"]).lower()

    (got,) = run_on_ref(out, inputs)
    op = case["op"]
    if op in ("CPY", "SET_ROWS"):  # the conversion must give ggml's bytes exactly
        np.testing.assert_array_equal(raw_bytes(out), z["out_raw"])
    elif op in ("ARGSORT", "ARGSORT(view)"):
        np.testing.assert_array_equal(got, z["out_values_i32"])
    elif op == "TOP_K":  # order unspecified: the same set per row (and ggml's swap of the first two)
        np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(z["out_values_i32"], axis=-1))
        np.testing.assert_array_equal(got, z["out_values_i32"])
    else:
        expected = z["out_values"]
        assert got.shape == expected.shape
        assert np.all(np.isfinite(got)) and np.all(np.isfinite(expected))
        err = nmse(got, expected)
        assert err <= tolerance(case), f"{case['name']}: NMSE {err:.3g} > {tolerance(case):.3g}"
