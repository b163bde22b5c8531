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
CASES = [c for c in json.loads((GOLDEN / "index.json").read_text())
         if c["op"] in ("MUL_MAT", "MUL_MAT_ID")]
if isinstance(CASES, dict):  # pragma: no cover - index layout guard
    CASES = CASES["cases"]


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
    fn(node, n_threads)
    out = tensor_array(node)
    assert out.shape == expected.shape
    # same activation quantization as ggml: only float summation order differs
    assert nmse(out, expected) < 1e-9, case["name"]
    np.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max())
