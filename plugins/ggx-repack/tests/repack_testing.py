"""Helpers of the ggx-repack tests: the CPU_REPACK buffer type, and a graph computed with its
matmul weights there through the conformance harness's weight buffer type mode."""
from __future__ import annotations

import numpy as np

from ggx import registry
from ggx.conformance.harness import execute, unsupported_nodes, weight_uses, weights_refused
from ggx.graph import build_graph
from ggx.tensor import Tensor
from ggx_repack.buffer import RepackBufferType


def repack_buft(device) -> RepackBufferType:
    """The CPU_REPACK buffer type of `device`."""
    found = [b for b in registry.extra_buffer_types(device) if isinstance(b, RepackBufferType)]
    assert len(found) == 1, registry.extra_buffer_types(device)
    return found[0]


def run_repacked(device, backend, buft: RepackBufferType, out: Tensor, inputs: dict) -> tuple[np.ndarray, list]:
    """Compute `out` on `device` with the weights of its matmuls in `buft` (each one a weight `buft`
    accepts), the rest in host memory. Returns (values in numpy order, those weights)."""
    graph = build_graph(out)
    assert not unsupported_nodes(device, graph)
    refused = weights_refused(buft, graph)
    assert refused is None, refused
    run = execute(device, backend, out, inputs, graph, buft)
    assert not run.problems, run.problems
    return run.values, list(dict.fromkeys(w for w, _ in weight_uses(graph)))
