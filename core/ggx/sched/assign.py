"""Which backend runs each tensor of a graph: passes 1-4 of ggml_backend_sched_split_graph.

1. pass 1 — tensors that already have storage run where that storage is readable
   ("1.dst"/"1.vsrc"); graph inputs go to the last (host) backend ("1.inp"); an op reading a
   weight runs on the backend owning the weight's buffer ("1.wgt"), unless the weight is in host
   memory and a higher-priority backend's `offload_op` asks for the op ("1.off"). "Owning": the
   first backend whose device has that buffer type as its own memory or one of its extra buffer
   types, when it supports the op; else, as in ggml, the first backend that can read the buffer
   type and supports the op. ggml needs no such rule (no two of its devices read each other's
   memory), but ggx's host devices do ("CPU" and "ref" both read any host memory): without it a
   model whose layers are split over "ref" and "CPU" (a layer split, `placement.layer_split`)
   would run every layer on whichever of them is listed first;
2. pass 2 — assignments spread to unassigned neighbours whose op the backend supports: first
   non-host backends down then up the graph ("2.gpu_down"/"2.gpu_up"), then all ("2.down"/"2.up");
3. pass 3 — a node moves to a higher-priority backend that shares its buffer type and supports
   it with all its inputs ("3.upg"); a still unassigned node goes to the backend supporting it
   that can read the most of its inputs ("3.best");
4. pass 4 — views follow their view source, remaining sources follow their consumer ("4.vsrc",
   "4.cur").

What is left (a view or leaf nobody placed) goes to the host backend ("5.host"); a node no
backend supports raises GGXUnsupported naming the op and every backend asked.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .. import registry
from ..alloc import is_scratch
from ..backend import Backend, Buffer, BufferUsage
from ..errors import GGXUnsupported
from ..graph import Graph
from ..ops import Op
from ..tensor import Tensor, TensorFlag

CAUSES = {
    "1.dst": "its storage is preallocated in {buft}",
    "1.vsrc": "its view source is preallocated in {buft}",
    "1.inp": "graph input: inputs start on the last (host) backend",
    "1.wgt": "it reads weight {src}, stored in {buft}",
    "1.off": "its weight {src} is in host memory and this backend's offload_op asked for the op",
    "2.gpu_down": "expanded down the graph from a neighbour on this (non-host) backend",
    "2.gpu_up": "expanded up the graph from a neighbour on this (non-host) backend",
    "2.down": "expanded down the graph from a neighbour on this backend",
    "2.up": "expanded up the graph from a neighbour on this backend",
    "3.upg": "upgraded to a higher-priority backend with the same buffer type",
    "3.best": "the backend supporting the op that reads the most of its inputs",
    "4.vsrc": "a view: it lives where its view source lives",
    "4.cur": "a source placed where its first consumer runs",
    "5.host": "a leaf nobody placed: host backend",
}


@dataclass(frozen=True, slots=True)
class Cause:
    """Why a tensor went to its backend: the pass (`code`, a key of CAUSES) and what it names."""

    code: str
    src: str = ""  # the weight read ("1.wgt", "1.off")
    buft: str = ""  # the buffer type that decided ("1.dst", "1.vsrc", "1.wgt", "1.off")

    def describe(self) -> str:
        return CAUSES.get(self.code, self.code).format(src=self.src, buft=self.buft)


_INPUT, _UPGRADE, _BEST = Cause("1.inp"), Cause("3.upg"), Cause("3.best")
_VIEW_SRC, _CONSUMER, _HOST = Cause("4.vsrc"), Cause("4.cur"), Cause("5.host")


def preallocated(t: Tensor) -> Buffer | None:
    """The buffer of a tensor with storage from outside the scheduler (None: none, or scratch)."""
    buf = t.root.buffer
    return None if buf is None or is_scratch(buf) else buf


class _Passes:
    """The state of one assignment: backend index and cause per tensor (by id)."""

    def __init__(self, backends: Sequence[Backend], op_offload: bool):
        self.backends = backends
        self.bufts = [b.device.buffer_type() for b in backends]
        self.host = len(backends) - 1
        self.op_offload = op_offload
        self.bid: dict[int, int] = {}
        self.cause: dict[int, Cause] = {}
        self._owners: dict[int, int] | None = None  # id(buffer type) -> first backend owning it

    def supports(self, b: int, node: Tensor) -> bool:
        return node.op is Op.NONE or node.op.is_view or self.backends[b].device.supports_op(node)

    def _set(self, t: Tensor, b: int, cause: Cause) -> None:
        self.bid[id(t)] = b
        self.cause[id(t)] = cause

    # --- pass 1 -------------------------------------------------------------------------------
    def _owner(self, buft: object) -> int:
        """The first backend whose device owns `buft` (its own memory or an extra buffer type), else -1."""
        if self._owners is None:
            owners: dict[int, int] = {}
            for i, be in enumerate(self.backends):
                for b in (be.device.buffer_type(), *registry.extra_buffer_types(be.device)):
                    owners.setdefault(id(b), i)
            self._owners = owners
        return self._owners.get(id(buft), -1)

    def _from_buffer(self, buf: Buffer, op: Tensor) -> int:
        """The backend running `op` over a tensor stored in `buf`: the buffer type's owner when it
        can (see the module docstring), else the highest-priority one that reads it (ggml)."""
        own = self._owner(buf.buft)
        if own >= 0 and self.backends[own].device.supports_buft(buf.buft) and self.supports(own, op):
            return own
        for i, be in enumerate(self.backends):
            if be.device.supports_buft(buf.buft) and self.supports(i, op):
                return i
        return -1

    def _from_storage(self, t: Tensor) -> None:
        """Pass 1 for one tensor: its own storage, its being an input, or a weight it reads."""
        buf = preallocated(t)
        if buf is not None:
            b = self._from_buffer(buf, t)
            if b < 0:
                raise GGXUnsupported(
                    f"{t.describe()} is preallocated in {buf.buft.name}, and no backend that can read "
                    f"{buf.buft.name} runs {t.op.name} ({', '.join(x.name for x in self.backends)} asked)")
            self._set(t, b, Cause("1.vsrc" if t.view_src is not None else "1.dst", buft=buf.buft.name))
        elif t.flags & TensorFlag.INPUT:
            self._set(t, self.host, _INPUT)
        else:
            self._from_weight(t)

    def _from_weight(self, t: Tensor) -> None:
        for src in t.src:
            sbuf = preallocated(src)
            # ROPE is skipped: its frequency factors are too small to choose a backend by
            if t.op is Op.ROPE or sbuf is None or sbuf.usage != BufferUsage.WEIGHTS:
                continue
            sb = self._from_buffer(sbuf, t)
            if sb < 0:
                continue
            if self.op_offload and sb == self.host and sbuf.is_host:
                for b in range(sb):
                    if self.supports(b, t) and self.backends[b].device.offload_op(t):
                        self._set(t, b, Cause("1.off", src.name, sbuf.buft.name))
                        return
            self._set(t, sb, Cause("1.wgt", src.name, sbuf.buft.name))
            return

    def pass1(self, graph: Graph) -> None:
        for leaf in graph.leafs:
            self._from_storage(leaf)
        for node in graph.nodes:
            if id(node) not in self.bid:
                self._from_storage(node)
            for src in node.src:
                if src.op is Op.NONE and id(src) not in self.bid:
                    self._from_storage(src)

    # --- pass 2 -------------------------------------------------------------------------------
    def _expand(self, seq: Iterable[Tensor], skip_host: bool, cause: Cause) -> None:
        bid = self.bid
        cur = -1
        for node in seq:
            if node.op.is_view:
                continue
            b = bid.get(id(node), -1)
            if b >= 0:
                cur = -1 if (skip_host and b == self.host) else b
            elif cur >= 0 and self.supports(cur, node):
                self._set(node, cur, cause)

    def pass2(self, nodes: list[Tensor]) -> None:
        self._expand(nodes, True, Cause("2.gpu_down"))
        self._expand(reversed(nodes), True, Cause("2.gpu_up"))
        self._expand(nodes, False, Cause("2.down"))
        self._expand(reversed(nodes), False, Cause("2.up"))

    # --- pass 3 -------------------------------------------------------------------------------
    def _readable(self, src: Tensor, b: int) -> bool:
        sbuf = preallocated(src)
        if sbuf is not None:
            return self.backends[b].device.supports_buft(sbuf.buft)
        sb = self.bid.get(id(src.root), self.bid.get(id(src), -1))
        return sb < 0 or self.backends[b].device.supports_buft(self.bufts[sb])

    def _best(self, node: Tensor) -> None:
        best, best_n = -1, -1
        for cand in range(len(self.backends)):
            if self.supports(cand, node):
                n = sum(self._readable(s, cand) for s in node.src)
                if n > best_n:
                    best, best_n = cand, n
        if best >= 0:
            self._set(node, best, _BEST)

    def _upgrade(self, node: Tensor, b: int) -> None:
        for cand in range(b):
            if self.bufts[cand] is self.bufts[b] and self.supports(cand, node) \
                    and all(self._readable(s, cand) for s in node.src):
                self._set(node, cand, _UPGRADE)
                return

    def pass3(self, nodes: list[Tensor]) -> None:
        for node in nodes:
            if node.op.is_view:
                continue
            b = self.bid.get(id(node), -1)
            if b < 0:
                self._best(node)
            else:
                self._upgrade(node, b)

    # --- pass 4 and what is left --------------------------------------------------------------
    def pass4(self, nodes: list[Tensor]) -> None:
        bid = self.bid
        for node in nodes:
            b = bid.get(id(node), -1)
            if node.view_src is not None and b < 0:
                b = bid.get(id(node.view_src), -1)
                self._set(node, b, _VIEW_SRC)
            for src in node.src:
                if id(src) in bid:
                    continue
                if src.view_src is not None:
                    self._set(src, bid.get(id(src.view_src), -1), _VIEW_SRC)
                else:
                    self._set(src, b, _CONSUMER)

    def finish(self, graph: Graph) -> None:
        for node in graph.nodes:
            if self.bid.get(id(node), -1) >= 0:
                continue
            if not node.op.is_view:
                names = ", ".join(f"{be.name} ({be.device.name})" for be in self.backends)
                raise GGXUnsupported(f"no backend supports op {node.op.name} of {node.describe()}; asked: {names}")
            self._set(node, self.host, _HOST)
        for leaf in graph.leafs:
            if self.bid.get(id(leaf), -1) < 0:
                self._set(leaf, self.host, _HOST)


def assign_backends(graph: Graph, backends: Sequence[Backend],
                    op_offload: bool = True) -> tuple[dict[int, int], dict[int, Cause]]:
    """(backend index, cause) per tensor of `graph`, by id: passes 1-4, then the host for what is left."""
    p = _Passes(backends, op_offload)
    p.pass1(graph)
    p.pass2(graph.nodes)
    p.pass3(graph.nodes)
    p.pass4(graph.nodes)
    p.finish(graph)
    return p.bid, p.cause
