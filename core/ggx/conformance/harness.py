"""Running one built case on one device, with the checks that do not need an oracle.

Memory layout of a case (one buffer of the device's buffer type)::

    [guard][tensor 0][guard][tensor 1][guard] ... [tensor n][guard]

Every tensor that owns storage (the leaves and every non-view node) gets `get_alloc_size`
bytes at an `alignment` boundary; each guard is at least 64 bytes. The whole buffer is first
cleared to FILL_BYTE (0xFF: NaN as F32/F16, -1 as I32, so an output element a kernel never
writes cannot pass), then each guard is set to GUARD_BYTE. After compute the guards must read
back untouched and every input that the graph does not write in place must be unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..backend import Backend, Buffer, BufferType, Device
from ..compute import get_tensor_data
from ..graph import Graph, build_graph
from ..tensor import Tensor
from ..types import GType
from .case import Builder, Tolerance

GUARD_BYTE = 0xA5
FILL_BYTE = 0xFF
MIN_GUARD = 64


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class Placement:
    """A case's buffer, its guard regions, and which tensor each guard follows."""

    buffer: Buffer
    guards: list[tuple[Tensor, str]] = field(default_factory=list)


def place(buft: BufferType, tensors: list[Tensor]) -> Placement:
    """Allocate one buffer holding `tensors` with a guard region before, between and after them.

    A guard starts right where a tensor's `get_alloc_size` bytes end (so even a write one byte
    past that is seen) and runs to the next aligned tensor start, at least MIN_GUARD bytes.
    """
    align = max(1, buft.alignment)
    guards, offsets, end = [(0, _align(MIN_GUARD, align))], [], _align(MIN_GUARD, align)
    for t in tensors:
        offsets.append(end)
        stop = end + max(buft.get_alloc_size(t), 1)
        end = _align(stop + MIN_GUARD, align)
        guards.append((stop, end))
    buf = buft.alloc_buffer(end)
    for t, off in zip(tensors, offsets):
        t.buffer, t.offset = buf, off
        buf.init_tensor(t)
    placement = Placement(buf)
    for i, (start, stop) in enumerate(guards):
        # F16 elements: every ggml type size is even, so guard bounds are too
        g = Tensor(GType.F16, ((stop - start) // 2,), name=f"guard{i}")
        g.buffer, g.offset = buf, start
        after = tensors[i - 1].describe() if i else "the buffer start"
        placement.guards.append((g, after))
    buf.clear(FILL_BYTE)
    for g, _ in placement.guards:
        buf.memset_tensor(g, GUARD_BYTE)
    return placement


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


def prepare(device: Device, b: Builder, graph: Graph | None = None) -> tuple[Graph, Placement]:
    """Place the built case in the device's buffer type and upload its inputs."""
    graph = graph or build_graph(b.out)
    placement = place(device.buffer_type(), storage_tensors(graph))
    for leaf, raw in b.inputs.items():
        leaf.buffer.set_tensor(leaf, raw, 0)
    return graph, placement


def execute(device: Device, backend: Backend, b: Builder, graph: Graph | None = None) -> Execution:
    """Run the built case: place, upload, compute, synchronize, read back, check guards/inputs."""
    graph, placement = prepare(device, b, graph)
    backend.graph_compute(graph)
    backend.synchronize()
    values = get_tensor_data(b.out).reshape(tuple(reversed(b.out.ne)))  # always 4-d, numpy order
    problems = check_guards(placement) + check_inputs(b)
    return Execution(values, problems, graph, placement)


def check_guards(placement: Placement) -> list[str]:
    problems = []
    for g, after in placement.guards:
        got = placement.buffer.get_tensor(g)
        bad = np.flatnonzero(got != GUARD_BYTE)
        if bad.size:
            problems.append(f"{bad.size} guard bytes after {after} were overwritten (first at +{bad[0]})")
    return problems


def check_inputs(b: Builder) -> list[str]:
    """Inputs must come back unchanged, except a destination the graph writes in place."""
    written = b.out.root
    problems = []
    for leaf, raw in b.inputs.items():
        if leaf is written:
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
