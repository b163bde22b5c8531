"""Watching every node of a model's graph on two backends (ggml's compare_graph_backend,
llama.cpp's eval-callback), and recomputing one node from the other run's exact input bytes.

`Recorder` is a scheduler eval callback: it asks to see every node that computes something (so
each runs as its own piece, eagerly) and keeps its result, and the values of its sources as
they were just before it ran; with `snapshots` also the bytes the node reads (the ranges of
each source's memory, at the same offsets, strides and views). `Recompute` runs such a node once
more on another model's backend, *isolated*: from those bytes, with the other model's own
weights (possibly repacked or on a device), so one kernel's error is seen alone.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..alloc import alloc_tensors
from ..backend import Backend, BufferUsage
from ..graph import Graph, build_graph
from ..ops import Op
from ..tensor import Tensor, TensorFlag
from ..tensor_data import get_tensor_data


def is_weight(t: Tensor) -> bool:
    buf = t.root.buffer
    return buf is not None and buf.usage == BufferUsage.WEIGHTS


def computes(t: Tensor) -> bool:
    """A node that runs a kernel (views and reshapes only describe memory)."""
    return t.op is not Op.NONE and not t.op.is_view


def graph_order(nodes: Sequence[Tensor]) -> list[Tensor]:
    """The computing nodes of the graph the seen `nodes` belong to, in the order build_graph
    gives from its OUTPUT-flagged nodes: the same order for two models built alike, whatever
    order their backends ran them in."""
    outputs = sorted((t for t in nodes if t.flags & TensorFlag.OUTPUT), key=lambda t: t.name)
    return [t for t in build_graph(outputs).nodes if computes(t)] if outputs else []


def _span(t: Tensor) -> tuple[int, int]:
    """The byte range [lo, hi) of t's root that t covers."""
    lo = t.view_offs if t.view_src is not None else 0
    return lo, lo + t.nbytes


def snapshot(node: Tensor) -> dict[int, tuple[Tensor, int, np.ndarray]]:
    """The bytes `node` reads (and, for a node writing into another tensor's memory, the bytes
    it writes over), per root: id(root) -> (root, lo, the bytes from lo). Weights are left out."""
    spans: dict[int, tuple[Tensor, int, int]] = {}
    for t in (*node.src, *((node,) if node.view_src is not None else ())):
        if is_weight(t):
            continue
        r, (lo, hi) = t.root, _span(t)
        if id(r) in spans:
            _, lo0, hi0 = spans[id(r)]
            lo, hi = min(lo, lo0), max(hi, hi0)
        spans[id(r)] = (r, lo, hi)
    return {k: (r, lo, r.buffer.get_tensor(r, lo, hi - lo).copy()) for k, (r, lo, hi) in spans.items()}


@dataclass
class Seen:
    """One node as a run saw it: its result and its sources' values just before it ran (None
    for a weight: each side has its own copy, in its own layout)."""

    values: np.ndarray
    inputs: list[np.ndarray | None]
    snapshot: dict[int, tuple[Tensor, int, np.ndarray]] = field(default_factory=dict)  # Recompute.snapshot


@dataclass
class Recompute:
    """Runs a node of one model on another model's backend from the first run's bytes.

    `backends`: the other model's backends in scheduler order (its host last); `weights`: its
    weights by name. A node runs on the backend given (where the other model's scheduler ran
    it), else on the first whose device supports it and the buffer types of its weights."""

    backends: Sequence[Backend]
    weights: dict[str, Tensor]

    def backend_for(self, node: Tensor) -> Backend | None:
        wbufts = [w.buffer.buft for w in (self.weights.get(s.root.name) for s in node.src if is_weight(s))
                  if w is not None]
        for be in self.backends:
            d = be.device
            if all(d.supports_buft(b) for b in wbufts) and d.supports_op(node):
                return be
        return None

    def run(self, node: Tensor, snap: dict[int, tuple[Tensor, int, np.ndarray]],
            backend: Backend | None = None) -> tuple[np.ndarray | None, str]:
        """(the node's values computed on the other model's backend, its name) or (None, why not).
        A weight in memory the backend cannot compute from is copied into its memory first, as
        the scheduler copies such a weight as a split input."""
        be = backend or self.backend_for(node)
        if be is None:
            return None, "no backend of the other model runs it"
        clones: dict[int, Tensor] = {}
        roots: list[Tensor] = []
        leafs: list[Tensor] = []
        uploads: list[tuple[Tensor, int, np.ndarray]] = []

        def root_of(t: Tensor) -> Tensor:
            r = t.root
            if id(r) in clones:
                return clones[id(r)]
            mine = None
            if is_weight(r):
                mine = self.weights.get(r.name)
                if mine is None or mine.type is not r.type or mine.ne != r.ne:
                    raise LookupError(f"weight {r.describe()} has no twin in the other model")
                if be.device.supports_buft(mine.buffer.buft):
                    clones[id(r)] = mine
                    return mine
            c = clones[id(r)] = Tensor(r.type, r.ne, r.nb, name=r.name, ndim=r.ndim)
            roots.append(c)
            leafs.append(c)
            if mine is not None:
                uploads.append((c, 0, mine.buffer.get_tensor(mine)))
            return c

        def clone(t: Tensor) -> Tensor:
            if id(t) in clones:
                return clones[id(t)]
            r = root_of(t)
            if t is t.root:
                return r
            c = clones[id(t)] = Tensor(t.type, t.ne, t.nb, name=t.name, view_src=r, view_offs=t.view_offs,
                                       ndim=t.ndim)
            leafs.append(c)
            return c

        try:
            src = tuple(clone(s) for s in node.src)
        except LookupError as e:
            return None, str(e)
        own_root = root_of(node) if node.view_src is not None else None
        twin = Tensor(node.type, node.ne, node.nb, op=node.op, params=node.params, src=src, name=node.name,
                      view_src=own_root, view_offs=node.view_offs, ndim=node.ndim)
        twin.set_flag(TensorFlag.OUTPUT)
        buf = alloc_tensors(be.device.buffer_type(), roots + ([twin] if own_root is None else []),
                            BufferUsage.COMPUTE)
        try:
            uploads += [(clones[key], lo, raw) for key, (_root, lo, raw) in snap.items()]
            for c, lo, raw in uploads:
                c.buffer.set_tensor(c, raw, lo)
            be.graph_compute(Graph([twin], leafs))
            be.synchronize()
            return get_tensor_data(twin), be.name
        finally:
            buf.free()


@dataclass
class Recorder:
    """A scheduler eval callback keeping every computing node's result (see the module
    docstring); `on_node(done)` is told after each node. `seen` holds one step's nodes by
    id; `clear()` before the next step."""

    snapshots: bool = False
    on_node: Callable[[int], None] | None = None
    seen: dict[int, Seen] = field(default_factory=dict)
    order: list[Tensor] = field(default_factory=list)  # every node asked about, views included
    _pending: tuple[list[np.ndarray | None], dict] | None = None

    def clear(self) -> None:
        self.seen, self.order = {}, []

    def __call__(self, t: Tensor, ask: bool) -> bool:
        if ask:
            self.order.append(t)
            if not computes(t):
                return False
            inputs = [None if is_weight(s) else get_tensor_data(s) for s in t.src]
            self._pending = (inputs, snapshot(t) if self.snapshots else {})
            return True
        inputs, snap = self._pending or ([], {})
        self._pending = None
        self.seen[id(t)] = Seen(get_tensor_data(t), inputs, snap)
        if self.on_node is not None:
            self.on_node(len(self.seen))
        return True
