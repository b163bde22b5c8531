"""ggml's own op outputs as conformance cases (package data in `golden_ops/`, see its README.md).

Each golden case rebuilds the recorded ggml call with ggx's graph builder over the recorded
input bytes (views keep their strides and offsets), and its expected result is ggml's output,
not the reference backend's: a plugin is held to ggml itself. Thresholds are the same table as
for the generated cases (`case.tolerance`); it already allows for ggml's own approximations
(F16 GELU table, activations quantized to vec_dot_type, F16 attention accumulators).
"""
from __future__ import annotations

import json
from functools import cache
from importlib import resources

import numpy as np

from ..ops import GeluKind, Op, Prec, RopeMode, SortOrder
from ..tensor import Tensor, contiguous_strides
from ..types import GType
from .case import Builder, OpCase, tolerance

# Golden "op" field -> (Op, label as printed).
_OPS = {
    "UNARY:GELU": (Op.GELU, "GELU"),
    "UNARY:GELU_QUICK": (Op.GELU, "GELU_QUICK"),
    "UNARY:GELU_ERF": (Op.GELU, "GELU_ERF"),
    "UNARY:SILU": (Op.SILU, ""),
    "GLU:SWIGLU": (Op.GLU, "GLU_SWIGLU"),
    "ARGSORT(view)": (Op.ARGSORT, "ARGSORT_TOP_K"),
}
_GELU = {"GELU": GeluKind.TANH, "GELU_QUICK": GeluKind.QUICK, "GELU_ERF": GeluKind.ERF}


def _dir():
    return resources.files(__package__).joinpath("golden_ops")


@cache
def _index() -> dict:
    return json.loads(_dir().joinpath("index.json").read_text())


def _load(file: str) -> dict[str, np.ndarray]:
    with _dir().joinpath(file).open("rb") as f:
        with np.load(f) as z:
            return {k: z[k] for k in z.files}


def _input(b: Builder, z: dict, i: int) -> Tensor:
    """Input i as the op takes it: a leaf over the recorded storage bytes, viewed if it was a view."""
    gtype = GType.parse(str(z[f"in{i}_type"]))
    ne = tuple(int(x) for x in z[f"in{i}_ne"])
    nb = tuple(int(x) for x in z[f"in{i}_nb"])
    offs = int(z[f"in{i}_view_offs"])
    storage_type = GType.parse(str(z[f"in{i}_storage_type"]))
    storage_ne = tuple(int(x) for x in z[f"in{i}_storage_ne"])
    name = str(z[f"in{i}_name"])
    leaf = b.raw_leaf(storage_type, storage_ne, name, z[f"in{i}_raw"])
    if storage_ne == ne and offs == 0 and nb == contiguous_strides(gtype, ne):
        return leaf
    return b.ctx.view(leaf, ne, nb, offset=offs)


def _build(entry: dict, op: Op, label: str):
    params = entry["params"]

    def build(b: Builder) -> Tensor:
        z = _load(entry["file"])
        x = {str(z[f"in{i}_name"]): _input(b, z, i) for i in range(int(z["n_inputs"]))}
        ctx = b.ctx
        if op is Op.ROPE:
            return ctx.rope(x["a"], x["pos"], params["n_dims"], RopeMode(params["mode"]), params["freq_base"],
                            params["freq_scale"], params["n_ctx_orig"], params["ext_factor"],
                            params["attn_factor"], params["beta_fast"], params["beta_slow"])
        if op is Op.SOFT_MAX:
            return ctx.soft_max(x["a"], x.get("mask"), params["scale"], params["max_bias"])
        if op is Op.FLASH_ATTN_EXT:
            prec = Prec.F32 if params["prec"].endswith("F32") else Prec.DEFAULT
            return ctx.flash_attn_ext(x["q"], x["k"], x["v"], x.get("mask"), params["scale"], params["max_bias"],
                                      params["logit_softcap"], prec)
        if op in (Op.RMS_NORM, Op.NORM):
            return (ctx.rms_norm if op is Op.RMS_NORM else ctx.norm)(x["a"], params["eps"])
        if op is Op.GELU:
            return ctx.gelu(x["a"], _GELU[label])
        if op is Op.SILU:
            return ctx.silu(x["a"])
        if op is Op.GLU:
            return ctx.swiglu(x["a"], x.get("b"))
        if op in (Op.ADD, Op.MUL):
            return (ctx.add if op is Op.ADD else ctx.mul)(x["a"], x["b"])
        if op is Op.SCALE:
            return ctx.scale(x["a"], params["s"])
        if op is Op.SUM_ROWS:
            return ctx.sum_rows(x["a"])
        if op is Op.GET_ROWS:
            return ctx.get_rows(x["a"], x["ids"])
        if op is Op.SET_ROWS:
            return ctx.set_rows(x["dst"], x["src"], x["ids"])
        if op is Op.CPY:
            out_ne = tuple(int(v) for v in z["out_ne"])
            return ctx.cpy(x["a"], b.leaf(GType.parse(str(z["out_type"])), out_ne, "b"))
        if op is Op.ARGSORT and label:
            return ctx.argsort_top_k(x["a"], params["k"])
        if op is Op.ARGSORT:
            return ctx.argsort(x["a"], SortOrder(params["fn"]))
        if op is Op.TOP_K:
            return ctx.top_k(x["a"], params["k"])
        if op is Op.MUL_MAT:
            return ctx.mul_mat(x["a"], x["b"])
        if op is Op.MUL_MAT_ID:
            return ctx.mul_mat_id(x["as"], x["b"], x["ids"])
        raise AssertionError(f"golden op {entry['op']} has no builder")  # caught by golden_cases' test

    return build


def _expected(entry: dict):
    def expected() -> np.ndarray:
        z = _load(entry["file"])
        values = z["out_values_i32"] if "out_values_i32" in z else z["out_values"]
        return values.reshape(tuple(reversed([int(v) for v in z["out_ne"]])))
    return expected


def _char_type(entry: dict, op: Op) -> GType:
    """The type that sets the threshold: weight of a product, destination of a copy, K of attention."""
    ins = {i["name"]: i for i in entry["inputs"]}
    if op in (Op.MUL_MAT, Op.MUL_MAT_ID):
        return GType.parse(ins.get("a", ins.get("as"))["type"])
    if op in (Op.CPY, Op.SET_ROWS):
        return GType.parse(entry["output"]["type"])
    if op is Op.FLASH_ATTN_EXT:
        return GType.parse(ins["k"]["type"])
    return GType.parse(entry["inputs"][0]["type"])


def golden_cases() -> list[OpCase]:
    """One case per recorded ggml op output."""
    out = []
    for entry in _index()["cases"]:
        op, label = _OPS.get(entry["op"], (None, ""))
        op = op or Op[entry["op"]]
        t = _char_type(entry, op)
        types = tuple(dict.fromkeys([t] + [GType.parse(i["type"]) for i in entry["inputs"]]))
        out.append(OpCase(op, (("ggml", entry["name"]),), _build(entry, op, label), tolerance(op, t, label),
                          types, expected=_expected(entry), source="ggml", label=label))
    return out
