"""Helpers of the ggx-amx tests: a graph computed with its matmul weights in an extra buffer type
(the conformance harness's weight buffer type mode) or on plain ggx-cpu, and conformance cases at
AMX's shapes."""
from __future__ import annotations

import numpy as np

from ggx.conformance import OpCase
from ggx.conformance.case import tolerance
from ggx.conformance.harness import execute, unsupported_nodes, weight_uses, weights_refused
from ggx.graph import Context, build_graph
from ggx.ops import Op
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


# --- conformance cases at AMX's shapes (rows a multiple of 32) ----------------------------------------
def mul_mat_case(t: GType, m: int, n: int, k: int, batch: tuple[int, int] = (1, 1)) -> OpCase:
    def build(b):
        return b.ctx.mul_mat(b.uniform(t, (k, m), "a"), b.uniform(GType.F32, (k, n, *batch), "b"))
    return OpCase(Op.MUL_MAT, (("type_a", t), ("m", m), ("n", n), ("k", k), ("b_batch", batch), ("amx", 1)), build,
                  tolerance(Op.MUL_MAT, t), (t,))


def mul_mat_id_case(t: GType, ids: list[list[int]], n_expert: int, b_ne1: int, m: int = 32, k: int = 256) -> OpCase:
    ids_arr = np.array(ids, np.int32)

    def build(b):
        n_tokens, n_used = ids_arr.shape
        experts = b.uniform(t, (k, m, n_expert), "as")
        act = b.uniform(GType.F32, (k, b_ne1, n_tokens), "b")
        return b.ctx.mul_mat_id(experts, act, b.ints(GType.I32, (n_used, n_tokens), "ids", ids_arr))
    return OpCase(Op.MUL_MAT_ID, (("type_a", t), ("ids", ids), ("b_ne1", b_ne1), ("m", m), ("k", k), ("amx", 1)),
                  build, tolerance(Op.MUL_MAT_ID, t), (t,))


def amx_cases(t: GType) -> list[OpCase]:
    """Rows of 32, 64 and 96 (one or more tasks), 1 column (the gemv), a partial 32-column block, a
    full one and a partial one, b's dims 2/3 broadcast; MoE with repeated, unused and single-column
    experts and b broadcast over the used experts."""
    k = 256
    cases = [mul_mat_case(t, m, n, k) for m, n in ((32, 1), (64, 1), (32, 7), (64, 33), (96, 40))]
    cases += [mul_mat_case(t, 32, 5, 2 * k, (2, 3)), mul_mat_case(t, 64, 2, 2 * k)]
    cases += [mul_mat_id_case(t, [[1, 3], [3, 3], [0, 1], [2, 0], [3, 1]], 4, b_ne1) for b_ne1 in (1, 2)]
    cases += [mul_mat_id_case(t, [[0, 2], [1, 0], [3, 3], [2, 1], [0, 0], [1, 3]], 8, 1),
              mul_mat_id_case(t, [[6, 1, 4]], 8, 3)]
    return cases
