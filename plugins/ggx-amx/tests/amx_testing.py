"""Helpers of the ggx-amx tests: a graph computed with its matmul weights in an extra buffer type
(the conformance harness's weight buffer type mode), and the same graph on plain ggx-cpu."""
from __future__ import annotations

import numpy as np

from ggx.conformance.harness import execute, unsupported_nodes, weight_uses, weights_refused
from ggx.graph import Context, build_graph
from ggx.quants import quantize
from ggx.tensor import Tensor
from ggx.types import GType


def run_in(device, backend, buft, out: Tensor, inputs: dict) -> np.ndarray:
    """`out` computed on `device` with its matmul weights in `buft` (None: plain host memory)."""
    graph = build_graph(out)
    assert not unsupported_nodes(device, graph)
    if buft is not None:
        refused = weights_refused(buft, graph)
        assert refused is None, refused
        assert weight_uses(graph)
    run = execute(device, backend, out, inputs, graph, buft)
    assert not run.problems, run.problems
    return run.values


def nmse(got: np.ndarray, ref: np.ndarray) -> float:
    ref = np.asarray(ref, np.float64)
    return float(((np.asarray(got, np.float64) - ref) ** 2).sum() / (ref ** 2).sum())


def mul_mat_graph(gtype: GType, K: int, M: int, n: int, batch: tuple[int, int] = (1, 1), seed: int = 0):
    """(out, inputs) of mul_mat(w [K, M], x [K, n, *batch]) with random data."""
    rng = np.random.default_rng(seed)
    ctx = Context()
    w = ctx.tensor(gtype, (K, M), "w")
    x = ctx.tensor(GType.F32, (K, n, *batch), "x")
    raw = quantize(rng.standard_normal((M, K)).astype(np.float32), gtype).reshape(-1)
    xv = rng.standard_normal((*reversed(batch), n, K)).astype(np.float32)
    return ctx.mul_mat(w, x), {w: raw, x: xv.view(np.uint8).reshape(-1)}


def mul_mat_id_graph(gtype: GType, K: int, M: int, ids: np.ndarray, n_expert: int, b_ne1: int, seed: int = 0):
    """(out, inputs) of mul_mat_id(experts [K, M, n_expert], x [K, b_ne1, n_tokens], ids) where ids
    is [n_tokens, n_used] in numpy order."""
    rng = np.random.default_rng(seed)
    n_tokens, n_used = ids.shape
    ctx = Context()
    w = ctx.tensor(gtype, (K, M, n_expert), "as")
    x = ctx.tensor(GType.F32, (K, b_ne1, n_tokens), "x")
    t_ids = ctx.tensor(GType.I32, (n_used, n_tokens), "ids")
    raw = quantize(rng.standard_normal((n_expert * M, K)).astype(np.float32), gtype).reshape(-1)
    xv = rng.standard_normal((n_tokens, b_ne1, K)).astype(np.float32)
    inputs = {w: raw, x: xv.view(np.uint8).reshape(-1), t_ids: ids.astype(np.int32).view(np.uint8).reshape(-1)}
    return ctx.mul_mat_id(w, x, t_ids), inputs
