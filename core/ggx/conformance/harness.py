"""Running one built case on one device, with the checks that do not need an oracle.

Memory layout of a case (one buffer of the device's buffer type)::

    [guard][tensor 0][guard][tensor 1][guard] ... [tensor n][guard]

Every tensor that owns storage (the leaves and every non-view node) gets `get_alloc_size`
bytes at an `alignment` boundary; each guard is at least 64 bytes. The whole buffer is first
cleared to FILL_BYTE (0xFF: NaN as F32/F16, -1 as I32, so an output element a kernel never
writes cannot pass), then each guard is set to GUARD_BYTE. After compute the guards must read
back untouched and every input that the graph does not write in place must be unchanged.

With a weight buffer type (an extra buffer type such as CPU_REPACK), the weights of the case's
matrix products (`weight_uses`) go to one WEIGHTS buffer of that type instead, back to back as
the model loader places them; it has no guards, and a transforming type's weights are not read
back (its buffers are write-only).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..alloc import alloc_tensors, layout_tensors
from ..backend import Backend, Buffer, BufferType, BufferUsage, Device, ExtraBufferType
from ..graph import Graph, build_graph
from ..ops import Op
from ..placement import supports_weight_op
from ..tensor import Tensor
from ..tensor_data import get_tensor_data
from ..types import GType
from .case import Tolerance

GUARD_BYTE = 0xA5
FILL_BYTE = 0xFF
MIN_GUARD = 64
#: Ops whose src[0] is a weight: what a weight buffer type holds (the model loader's choice).
WEIGHT_OPS = (Op.MUL_MAT, Op.MUL_MAT_ID)


@dataclass
class Placement:
    """A case's buffer, its guard regions and which tensor each guard follows, and the buffer of
    the weights placed in a weight buffer type (None: every tensor is in `buffer`)."""

    buffer: Buffer
    guards: list[tuple[Tensor, str]] = field(default_factory=list)
    weights: Buffer | None = None


def place(buft: BufferType, tensors: list[Tensor]) -> Placement:
    """Allocate one buffer holding `tensors` with a guard region before, between and after them.

    A guard starts right where a tensor's `get_alloc_size` bytes end (so even a write one byte
    past that is seen) and runs to the next aligned tensor start, at least MIN_GUARD bytes.
    """
    offsets, size = layout_tensors(buft, tensors, gap=MIN_GUARD)
    buf = buft.alloc_buffer(size)
    for t, off in zip(tensors, offsets):
        t.buffer, t.offset = buf, off
        buf.init_tensor(t)
    stops = [off + max(buft.get_alloc_size(t), 1) for t, off in zip(tensors, offsets)]
    placement = Placement(buf)
    for i, (start, stop) in enumerate(zip([0] + stops, offsets + [size])):
        # F16 elements: every ggml type size is even, so guard bounds are too
        g = Tensor(GType.F16, ((stop - start) // 2,), name=f"guard{i}")
        g.buffer, g.offset = buf, start
        after = tensors[i - 1].describe() if i else "the buffer start"
        placement.guards.append((g, after))
    buf.clear(FILL_BYTE)
    for g, _ in placement.guards:
        buf.memset_tensor(g, GUARD_BYTE)
    return placement


def weight_uses(graph: Graph) -> list[tuple[Tensor, Tensor]]:
    """(weight, node) for every MUL_MAT / MUL_MAT_ID node: its src[0]."""
    return [(n.src[0], n) for n in graph.nodes if n.op in WEIGHT_OPS]


def weights_refused(buft: BufferType, graph: Graph) -> str | None:
    """Why the case's weights cannot all go to `buft` (None: they can), as the model loader's
    select_buft decides: only a whole leaf whose op `buft` supports with the weight in it."""
    leafs = {id(t) for t in graph.leafs}
    for w, node in weight_uses(graph):
        if id(w) not in leafs or w.view_src is not None:
            return f"not supported: the weight {w.describe()} of {node.op.name} is not a whole leaf tensor"
        if not supports_weight_op(buft, w, node):
            return f"not supported: {buft.name} refuses {node.op.name} over weight {w.describe()}"
    return None


def storage_tensors(graph: Graph) -> list[Tensor]:
    """Tensors that own memory: every leaf and every node that is not a view of another."""
    return list(graph.leafs) + [n for n in graph.nodes if n.view_src is None]


def unsupported_nodes(device: Device, graph: Graph) -> list[Tensor]:
    """Compute nodes the device says it cannot run (view nodes never reach a kernel)."""
    return [n for n in graph.nodes if not n.op.is_view and not device.supports_op(n)]


@dataclass
class Execution:
    """The result of one case on one device: output values and problems found on the way."""

    values: np.ndarray
    problems: list[str]
    graph: Graph
    placement: Placement


def prepare(device: Device, out: Tensor, inputs: Mapping[Tensor, np.ndarray], graph: Graph | None = None,
            weight_buft: BufferType | None = None) -> tuple[Graph, Placement]:
    """Place the graph computing `out` and upload `inputs` (leaf -> raw bytes, `Builder.inputs`):
    in the device's buffer type with guards, the weights of its matrix products in `weight_buft`
    when given (ask `weights_refused` first)."""
    graph = graph or build_graph(out)
    weights = list({id(w): w for w, _ in weight_uses(graph)}.values()) if weight_buft is not None else []
    in_weights = {id(w) for w in weights}
    placement = place(device.buffer_type(), [t for t in storage_tensors(graph) if id(t) not in in_weights])
    if weights:
        placement.weights = alloc_tensors(weight_buft, weights, BufferUsage.WEIGHTS)
    for leaf, raw in inputs.items():
        leaf.buffer.set_tensor(leaf, raw, 0)
    return graph, placement


def execute(device: Device, backend: Backend, out: Tensor, inputs: Mapping[Tensor, np.ndarray],
            graph: Graph | None = None, weight_buft: BufferType | None = None) -> Execution:
    """Run the graph computing `out` (a built case: `b.out, b.inputs`): place, upload, compute,
    synchronize, read back, check guards and inputs."""
    graph, placement = prepare(device, out, inputs, graph, weight_buft)
    backend.graph_compute(graph)
    backend.synchronize()
    values = get_tensor_data(out).reshape(tuple(reversed(out.ne)))  # always 4-d, numpy order
    problems = check_guards(placement) + check_inputs(out, inputs, placement)
    return Execution(values, problems, graph, placement)


def check_guards(placement: Placement) -> list[str]:
    problems = []
    for g, after in placement.guards:
        got = placement.buffer.get_tensor(g)
        bad = np.flatnonzero(got != GUARD_BYTE)
        if bad.size:
            problems.append(f"{bad.size} guard bytes after {after} were overwritten (first at +{bad[0]})")
    return problems


def check_inputs(out: Tensor, inputs: Mapping[Tensor, np.ndarray], placement: Placement | None = None) -> list[str]:
    """Inputs must come back unchanged, except a destination the graph writes in place (`out`'s
    storage) and weights in a transforming extra buffer type (write-only: not ggml's layout)."""
    written = out.root
    weights = placement.weights if placement is not None else None
    write_only = weights is not None and isinstance(weights.buft, ExtraBufferType) and not weights.buft.is_host
    problems = []
    for leaf, raw in inputs.items():
        if leaf is written or (write_only and leaf.buffer is weights):
            continue
        got = leaf.buffer.get_tensor(leaf)
        if not np.array_equal(got, raw):
            n = int(np.count_nonzero(got != raw))
            problems.append(f"input {leaf.describe()} was modified ({n} bytes differ)")
    return problems


# ----------------------------------------------------------------------------------------------
def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    """Normalized mean squared error sum((out-ref)^2) / sum(ref^2), in float64 (ggml's nmse)."""
    ref64 = ref.astype(np.float64).ravel()
    diff = out.astype(np.float64).ravel() - ref64
    num, den = float(diff @ diff), float(ref64 @ ref64)
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def compare(out: np.ndarray, ref: np.ndarray, tol: Tolerance) -> tuple[bool, float | None, str]:
    """(ok, nmse or None, message). Checks shape, non-finite values, then the tolerance."""
    if out.shape != ref.shape:
        return False, None, f"result has numpy shape {out.shape}, expected {ref.shape}"
    if tol.kind == "exact":
        if np.array_equal(out, ref):
            return True, None, ""
        n = int(np.count_nonzero(out != ref))
        return False, None, f"{n} of {ref.size} indices differ (first at flat index {np.flatnonzero(out != ref)[0]})"
    if tol.kind == "set":
        if np.array_equal(np.sort(out, axis=-1), np.sort(ref, axis=-1)):
            return True, None, ""
        return False, None, "the rows do not hold the same sets of indices"
    out_bad, ref_bad = ~np.isfinite(out), ~np.isfinite(ref)
    surprise = out_bad & ~ref_bad
    if surprise.any():
        first = np.flatnonzero(surprise.ravel())[0]
        return False, None, (f"{int(surprise.sum())} NaN/inf values where the oracle is finite "
                             f"(first at flat index {first})")
    if ref_bad.any() and not np.array_equal(out[ref_bad], ref[ref_bad], equal_nan=True):
        return False, None, "NaN/inf values differ from the oracle's"
    ok_mask = ~ref_bad
    err = nmse(out[ok_mask], ref[ok_mask])
    if err <= tol.max_nmse:
        return True, err, ""
    return False, err, f"NMSE {err:.3g} > {tol.max_nmse:g} ({tol.reason})"
