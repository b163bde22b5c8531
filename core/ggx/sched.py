"""The scheduler: runs one graph over several backends, as ggml_backend_sched does.

Planning (`_assign`, `_split`, then the allocator):

1. pass 1 — tensors that already have storage run where that storage is readable
   ("1.dst"/"1.vsrc"); graph inputs go to the last (host) backend ("1.inp"); an op reading a
   weight runs on the backend owning the weight's buffer ("1.wgt"), unless the weight is in host
   memory and a higher-priority backend's `offload_op` asks for the op ("1.off");
2. pass 2 — assignments spread to unassigned neighbours whose op the backend supports: first
   non-host backends down then up the graph ("2.gpu_down"/"2.gpu_up"), then all ("2.down"/"2.up");
3. pass 3 — a node moves to a higher-priority backend that shares its buffer type and supports
   it with all its inputs ("3.upg"); a still unassigned node goes to the backend supporting it
   that can read the most of its inputs ("3.best");
4. pass 4 — views follow their view source, remaining sources follow their consumer ("4.vsrc",
   "4.cur");
5. splits — a new split starts where the backend changes (or where a weight would have to be
   copied to a backend that cannot read it); every source a split's backend cannot read gets a
   copy in that backend's buffer type, made once per graph and backend.

Execution (`graph_compute`): per split, user inputs are copied at once (synchronously), other
inputs next, weights in host memory last (so a copy callback can read the split's other inputs,
e.g. MoE ids); async copies where the destination backend has them, else a synchronous copy
after waiting for the source; an event is recorded after each split and waited on by the next
user of that backend's copies instead of synchronizing whole devices. With `n_copies > 1` every
split input has `n_copies` copies, used in turn by successive graphs, so the host can submit
graph N+1 (`graph_compute_async`) while graph N still runs.

A plan is reused, without re-planning, when a graph with the same `Graph.key` whose
preallocated leafs live in the same buffer types comes back (a decode loop).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .alloc import GraphAllocator, Step
from .backend import Backend, Buffer, BufferUsage, Event
from .errors import GGXError, GGXShapeError, GGXUnsupported
from .graph import Graph
from .ops import Op
from .tensor import Tensor, TensorFlag

__all__ = ["MoeExpertUpload", "SchedComputeError", "SchedStats", "Scheduler", "SplitInfo", "is_host_weight",
           "tensor_copy"]

CopyCallback = Callable[[Backend, Tensor, Tensor, Graph], bool]
EvalCallback = Callable[[Tensor, bool], bool]

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


class SchedComputeError(GGXError, RuntimeError):
    """A backend failed while computing a split; `node` is the failing node when known."""

    def __init__(self, message: str, node: Tensor | None = None, backend: Backend | None = None):
        super().__init__(message)
        self.node = node
        self.backend = backend


@dataclass
class SchedStats:
    """What the last `graph_compute` did, plus running totals."""

    n_splits: int = 0
    n_copies: int = 0  # split inputs copied by the scheduler (callback-handled ones excluded)
    n_callback_copies: int = 0  # weight uploads taken over by the copy callback
    bytes_copied: int = 0
    plan_time_s: float = 0.0  # planning (or plan reuse) time of the last graph
    plan_reused: bool = False
    n_graphs: int = 0
    n_plans: int = 0  # graphs that needed a full plan

    def __str__(self) -> str:
        return (f"{self.n_splits} splits, {self.n_copies} copies ({self.bytes_copied} B), "
                f"{self.n_callback_copies} by callback, plan {self.plan_time_s * 1e6:.0f} us "
                f"({'reused' if self.plan_reused else 'new'})")


@dataclass
class SplitInfo:
    """One split of the last graph (for inspection and the DOT writer)."""

    backend: Backend
    nodes: list[Tensor]
    inputs: list[Tensor]


@dataclass
class _SplitPlan:
    backend_id: int
    i_start: int  # node indices [i_start, i_end)
    i_end: int
    inputs: list[int]  # positions (leafs + nodes) of the tensors copied in


@dataclass(slots=True)
class _InputRun:
    """One split input as the execution loop needs it (resolved once per Graph object)."""

    pos: int  # position in leafs + nodes
    tensor: Tensor
    dsts: list[Tensor]  # its copy in each copy set
    src_backend: int
    user: bool  # an INPUT leaf: copied synchronously at once
    nbytes: int


@dataclass(slots=True)
class _SplitRun:
    """One split as the execution loop needs it: backend, split graph per copy set, inputs, events."""

    backend_id: int
    backend: Backend
    graphs: list[Graph]  # per copy set
    inputs: list[_InputRun]
    events: list[Event | None]  # per copy set


@dataclass
class _Plan:
    key: tuple
    backend_of: list[int]  # by position in leafs + nodes
    cause: list[str]
    splits: list[_SplitPlan]
    subst: dict[int, list[tuple[int, int, int]]]  # node index -> [(src slot, input position, backend)]
    copies: dict[tuple[int, int], list[Tensor]]  # (input position, backend) -> one tensor per copy
    records: list[tuple[int, Tensor | None, int, int]]  # (position or -1, own tensor, buft, offset)
    sizes: list[int]
    # materialized for one Graph object
    graph: Graph | None = None
    order: list[Tensor] = field(default_factory=list)
    split_graphs: list[list[Graph]] = field(default_factory=list)  # [copy][split]
    split_inputs: list[list[tuple[int, Tensor]]] = field(default_factory=list)  # (position, tensor)
    clones: dict[int, Tensor] = field(default_factory=dict)  # id(clone) -> original node
    runs: list[_SplitRun] = field(default_factory=list)
    placed: list[tuple[Tensor, Buffer, int]] = field(default_factory=list)  # (tensor, buffer, offset)
    placed_buffers: list[Buffer | None] = field(default_factory=list)  # the allocator's buffers `placed` used


def is_host_weight(t: Tensor) -> bool:
    """A weight kept in host memory (ggml_backend_sched_is_host_weight): copy-callback territory."""
    buf = t.data_buffer
    return buf is not None and buf.usage == BufferUsage.WEIGHTS and buf.is_host


def tensor_copy(src: Tensor, dst: Tensor) -> None:
    """Synchronous copy of src's bytes into dst (same layout), across any two buffers."""
    if src.nbytes != dst.nbytes:
        raise GGXShapeError(f"tensor_copy: {src.describe()} and {dst.describe()} differ in size")
    _copy_sync(src, dst, src.nbytes)


def _copy_sync(src: Tensor, dst: Tensor, nbytes: int) -> None:
    """tensor_copy without the size check (the plan made dst as src's copy)."""
    dbuf = dst.data_buffer
    if not dbuf.cpy_tensor(src, dst):
        dbuf.set_tensor(dst, src.data_buffer.get_tensor(src, 0, nbytes), 0)


class Scheduler:
    """Computes graphs over `backends` (priority order, a host backend last), ggml-style.

    copy_callback(backend, src, dst, split_graph) -> bool may take over the upload of a weight
    in host memory (True: done). eval_callback(tensor, ask) -> bool: asked (ask=True) for each
    node whether the caller wants to see it; if so the node is computed, its backend synchronized
    and the callback called again (ask=False); returning False there stops the graph.
    """

    def __init__(self, backends: Sequence[Backend], n_copies: int = 1, copy_callback: CopyCallback | None = None,
                 eval_callback: EvalCallback | None = None, op_offload: bool = True):
        backends = list(backends)
        if not backends:
            raise GGXUnsupported("Scheduler needs at least one backend")
        if not backends[-1].device.buffer_type().is_host:
            raise GGXUnsupported(f"the last backend must be a host backend (it runs what nothing else can); "
                                 f"{backends[-1].name} uses {backends[-1].device.buffer_type().name}")
        if n_copies < 1:
            raise GGXShapeError(f"n_copies must be at least 1, got {n_copies}")
        self.backends = backends
        self.n_copies = n_copies
        self.copy_callback = copy_callback
        self.eval_callback = eval_callback
        self.op_offload = op_offload
        self.bufts = [b.device.buffer_type() for b in backends]
        self.alloc = GraphAllocator(self.bufts)
        self._buft_index = [self.alloc._index(b) for b in self.bufts]
        self.events: list[list[Event | None]] = [
            [b.device.event_new() if b.device.caps.events else None for _ in range(n_copies)] for b in backends]
        self.cur_copy = 0
        self.stats = SchedStats()
        self._plan: _Plan | None = None
        self._pos: dict[int, int] | None = None
        self._last_key: tuple[Graph, list[Buffer | None], tuple] | None = None  # (graph, leaf buffers, key)

    # --- public -----------------------------------------------------------------------------
    def reserve(self, graph: Graph) -> None:
        """Plan `graph` (a worst case) and size the compute buffers, without placing its tensors."""
        plan = self._make_plan(graph, self._plan_key(graph))
        self.alloc.ensure_sizes(plan.sizes)
        self._plan = plan

    def alloc_graph(self, graph: Graph) -> None:
        """Plan (or reuse the plan of) `graph` and place its tensors: inputs can be set after this."""
        t0 = time.perf_counter()
        key = self._plan_key(graph)
        plan = self._plan
        reused = plan is not None and plan.key == key
        if not reused:
            plan = self._make_plan(graph, key)
            self.stats.n_plans += 1
            self._plan = plan
        self.alloc.ensure_sizes(plan.sizes)
        self._apply(plan, graph)
        self.stats.plan_time_s = time.perf_counter() - t0
        self.stats.plan_reused = reused

    def graph_compute(self, graph: Graph) -> None:
        """Compute `graph`; returns once every result is ready."""
        try:
            self.graph_compute_async(graph)
        finally:
            self.synchronize()

    def graph_compute_async(self, graph: Graph) -> None:
        """Submit `graph`; results are ready after `synchronize()`."""
        self.alloc_graph(graph)
        plan = self._plan
        st = self.stats
        st.n_graphs += 1
        st.n_splits = len(plan.splits)
        st.n_copies = st.n_callback_copies = st.bytes_copied = 0
        reset = getattr(self.copy_callback, "reset", None)
        if reset is not None:
            reset()
        c = self.cur_copy
        try:
            self._compute_splits(plan, c)
        except BaseException:
            self._recover()
            raise
        self.cur_copy = (c + 1) % self.n_copies

    def synchronize(self) -> None:
        """Wait for every backend; a failure of queued work surfaces here as SchedComputeError."""
        first: GGXError | None = None
        for b in self.backends:
            try:
                self._sync_backend(b)
            except GGXError as e:
                first = first or e
        if first is not None:
            raise first

    def _sync_backend(self, be: Backend) -> None:
        try:
            be.synchronize()
        except GGXError:
            raise
        except Exception as e:
            plan = self._plan
            node = getattr(e, "node", None)
            if node is not None and plan is not None:
                node = plan.clones.get(id(node), node)
            where = f" computing node {node.describe()} ({node.op.name})" if node is not None else ""
            raise SchedComputeError(f"backend {be.name} failed{where}: {type(e).__name__}: {e}", node, be) from e

    def backend_of(self, tensor: Tensor) -> Backend | None:
        """The backend a tensor of the last graph was assigned to (None if it was not in it)."""
        p = self._position(tensor)
        return None if p is None else self.backends[self._plan.backend_of[p]]

    def explain(self, tensor: Tensor) -> str:
        """Which backend a tensor of the last graph went to, and which pass put it there."""
        p = self._position(tensor)
        if p is None:
            return f"{tensor.describe()}: not part of the last graph"
        b = self.backends[self._plan.backend_of[p]]
        code, _, detail = self._plan.cause[p].partition("|")
        src_name, _, buft = detail.partition("|")
        why = CAUSES.get(code, code).format(src=src_name, buft=buft)
        return f"{tensor.describe()} -> {b.name} (pass {code}: {why})"

    @property
    def splits(self) -> list[SplitInfo]:
        plan = self._plan
        if plan is None or plan.graph is None:
            return []
        nodes = plan.graph.nodes
        return [SplitInfo(self.backends[s.backend_id], nodes[s.i_start:s.i_end], [t for _, t in inp])
                for s, inp in zip(plan.splits, plan.split_inputs)]

    def copy_of(self, tensor: Tensor, backend: Backend) -> Tensor | None:
        """The copy of a split input made for `backend` in the current copy set (None if none)."""
        p = self._position(tensor)
        if p is None:
            return None
        copies = self._plan.copies.get((p, self.backends.index(backend)))
        return None if copies is None else copies[self.cur_copy]

    # --- planning ---------------------------------------------------------------------------
    def _prealloc(self, t: Tensor) -> Buffer | None:
        """The buffer of a tensor with storage from outside the scheduler (None otherwise)."""
        buf = t.root.buffer
        return None if buf is None or self.alloc.owns(buf) else buf

    def _plan_key(self, graph: Graph) -> tuple:
        """Graph.key plus the buffer type of every preallocated leaf (None for scratch or no storage).

        The decode loop submits the same Graph object with its leafs in the same buffers: then
        the key of the last call is returned after one identity comparison of the leaf buffers
        (asking the allocator whether a buffer is scratch costs ~0.5 us a leaf).
        """
        buffers = [(t.view_src or t).buffer for t in graph.leafs]
        last = self._last_key
        if last is not None and last[0] is graph and last[1] == buffers:
            return last[2]
        bufts = tuple(None if b is None or self.alloc.owns(b) else id(b.buft) for b in buffers)
        key = (graph.key, bufts)
        self._last_key = (graph, buffers, key)
        return key

    def _supports(self, b: int, node: Tensor) -> bool:
        return node.op is Op.NONE or node.op.is_view or self.backends[b].device.supports_op(node)

    def _from_buffer(self, buf: Buffer, op: Tensor) -> int:
        for i, be in enumerate(self.backends):
            if be.device.supports_buft(buf.buft) and self._supports(i, op):
                return i
        return -1

    def _assign(self, graph: Graph) -> tuple[dict[int, int], dict[int, str]]:
        n_back = len(self.backends)
        host = n_back - 1
        bid: dict[int, int] = {}
        cause: dict[int, str] = {}

        def from_cur(t: Tensor) -> int:
            buf = self._prealloc(t)
            if buf is not None:
                b = self._from_buffer(buf, t)
                if b < 0:
                    raise GGXUnsupported(
                        f"{t.describe()} is preallocated in {buf.buft.name}, and no backend that can read "
                        f"{buf.buft.name} runs {t.op.name} ({', '.join(x.name for x in self.backends)} asked)")
                cause[id(t)] = ("1.vsrc" if t.view_src is not None else "1.dst") + f"||{buf.buft.name}"
                return b
            if t.flags & TensorFlag.INPUT:
                cause[id(t)] = "1.inp"
                return host
            for src in t.src:
                sbuf = self._prealloc(src)
                # ROPE is skipped: its frequency factors are too small to choose a backend by
                if t.op is Op.ROPE or sbuf is None or sbuf.usage != BufferUsage.WEIGHTS:
                    continue
                sb = self._from_buffer(sbuf, t)
                if sb < 0:
                    continue
                if self.op_offload and sb == host and sbuf.is_host:
                    for b in range(sb):
                        if self._supports(b, t) and self.backends[b].device.offload_op(t):
                            cause[id(t)] = f"1.off|{src.name}|{sbuf.buft.name}"
                            return b
                cause[id(t)] = f"1.wgt|{src.name}|{sbuf.buft.name}"
                return sb
            return -1

        for leaf in graph.leafs:
            b = from_cur(leaf)
            if b >= 0:
                bid[id(leaf)] = b
        nodes = graph.nodes
        for node in nodes:
            if id(node) not in bid:
                b = from_cur(node)
                if b >= 0:
                    bid[id(node)] = b
            for src in node.src:
                if src.op is Op.NONE and id(src) not in bid:
                    b = from_cur(src)
                    if b >= 0:
                        bid[id(src)] = b

        # pass 2: expansion
        def expand(seq, skip_host: bool, tag: str) -> None:
            cur = -1
            for node in seq:
                if node.op.is_view:
                    continue
                b = bid.get(id(node), -1)
                if b >= 0:
                    cur = -1 if (skip_host and b == host) else b
                elif cur >= 0 and self._supports(cur, node):
                    bid[id(node)] = cur
                    cause[id(node)] = tag

        expand(nodes, True, "2.gpu_down")
        expand(reversed(nodes), True, "2.gpu_up")
        expand(nodes, False, "2.down")
        expand(reversed(nodes), False, "2.up")

        # pass 3: upgrade to higher priority backends sharing the buffer type; place the rest
        def readable(src: Tensor, b: int) -> bool:
            sbuf = self._prealloc(src)
            if sbuf is not None:
                return self.backends[b].device.supports_buft(sbuf.buft)
            sb = bid.get(id(src.root), bid.get(id(src), -1))
            return sb < 0 or self.backends[b].device.supports_buft(self.bufts[sb])

        for node in nodes:
            if node.op.is_view:
                continue
            b = bid.get(id(node), -1)
            if b < 0:
                best, best_n = -1, -1
                for cand in range(n_back):
                    if self._supports(cand, node):
                        n = sum(readable(s, cand) for s in node.src)
                        if n > best_n:
                            best, best_n = cand, n
                if best >= 0:
                    bid[id(node)] = best
                    cause[id(node)] = "3.best"
            else:
                for cand in range(b):
                    if self.bufts[cand] is self.bufts[b] and self._supports(cand, node) \
                            and all(readable(s, cand) for s in node.src):
                        bid[id(node)] = cand
                        cause[id(node)] = "3.upg"
                        break

        # pass 4: views and remaining sources
        for node in nodes:
            b = bid.get(id(node), -1)
            if node.view_src is not None and b < 0:
                b = bid[id(node)] = bid.get(id(node.view_src), -1)
                cause[id(node)] = "4.vsrc"
            for src in node.src:
                if id(src) in bid:
                    continue
                if src.view_src is not None:
                    bid[id(src)] = bid.get(id(src.view_src), -1)
                    cause[id(src)] = "4.vsrc"
                else:
                    bid[id(src)] = b
                    cause[id(src)] = "4.cur"

        for node in nodes:
            if bid.get(id(node), -1) < 0:
                if node.op.is_view:
                    bid[id(node)] = host
                    cause[id(node)] = "5.host"
                    continue
                names = ", ".join(f"{be.name} ({be.device.name})" for be in self.backends)
                raise GGXUnsupported(f"no backend supports op {node.op.name} of {node.describe()}; asked: {names}")
        for leaf in graph.leafs:
            if bid.get(id(leaf), -1) < 0:
                bid[id(leaf)] = host
                cause[id(leaf)] = "5.host"
        return bid, cause

    def _make_plan(self, graph: Graph, key: tuple) -> _Plan:
        bid, cause = self._assign(graph)
        order = graph.leafs + graph.nodes
        pos = {id(t): i for i, t in enumerate(order)}
        nodes = graph.nodes

        def buffer_ok(t: Tensor, b: int) -> bool:
            buf = self._prealloc(t)
            buft = buf.buft if buf is not None else self.bufts[bid[id(t.root)] if id(t.root) in bid else bid[id(t)]]
            return self.backends[b].device.supports_buft(buft)

        # pass 5: splits and their inputs
        splits: list[_SplitPlan] = []
        subst: dict[int, list[tuple[int, int, int]]] = {}
        copies: dict[tuple[int, int], list[Tensor]] = {}
        cur = -1
        split: _SplitPlan | None = None
        for i, node in enumerate(nodes):
            if node.op.is_view:
                continue
            b = bid[id(node)]
            need_new = False
            if split is not None and b == cur and split.inputs:
                for src in node.src:  # a weight the backend cannot read: a new split lets its copy be freed sooner
                    sbuf = self._prealloc(src)
                    if sbuf is not None and sbuf.usage == BufferUsage.WEIGHTS and bid[id(src)] != cur \
                            and not buffer_ok(src, cur):
                        need_new = True
                        break
            if split is None or b != cur or need_new:
                if split is not None:
                    split.i_end = i
                split = _SplitPlan(b, 0 if split is None else i, len(nodes), [])
                splits.append(split)
                cur = b
            for j, src in enumerate(node.src):
                if bid[id(src)] == cur or buffer_ok(src, cur):
                    continue
                p = pos[id(src)]
                if (p, cur) not in copies:
                    be = self.backends[cur]
                    made = []
                    for c in range(self.n_copies):
                        cp = Tensor(src.type, src.ne, src.nb, name=f"{be.name}#{src.name or src.op.name.lower()}#{c}",
                                    ndim=src.ndim)
                        made.append(cp)
                    copies[(p, cur)] = made
                    split.inputs.append(p)
                subst.setdefault(i, []).append((j, p, cur))

        # allocation order: a split's input copies at its start, then its nodes
        copy_bid: dict[int, int] = {}
        for (_p, b), cps in copies.items():
            for cp in cps:
                copy_bid[id(cp)] = b
        steps: list[Step] = []
        pinned: list[Tensor] = []
        if self.n_copies > 1:  # every copy set stays allocated: successive graphs use them in turn
            for cps in copies.values():
                for cp in cps:
                    steps.append(Step(cp, ()))
                    pinned.append(cp)
        for sp in splits:
            for p in sp.inputs:
                steps.append(Step(None, (order[p],)))
                if self.n_copies == 1:
                    steps.append(Step(copies[(p, sp.backend_id)][0], ()))
            for i in range(sp.i_start, sp.i_end):
                node = nodes[i]
                srcs = node.src
                if i in subst:
                    srcs = list(srcs)
                    for j, p, b in subst[i]:
                        srcs[j] = copies[(p, b)][0]
                    srcs = tuple(srcs)
                steps.append(Step(node, srcs))
        bix = self._buft_index

        def buft_of(t: Tensor) -> int:
            b = copy_bid.get(id(t))
            if b is None:
                b = bid.get(id(t), -1)
            return bix[b if b >= 0 else len(self.backends) - 1]

        aplan = self.alloc.plan(steps, graph.leafs, buft_of, pinned)
        records = [(pos.get(id(r.tensor), -1), None if id(r.tensor) in pos else r.tensor, r.buft, r.offset)
                   for r in aplan.records]
        return _Plan(key, [bid[id(t)] for t in order], [cause.get(id(t), "?") for t in order], splits,
                     subst, copies, records, aplan.sizes)

    def _apply(self, plan: _Plan, graph: Graph) -> None:
        """Place the tensors of `graph` as the plan says; build split graphs for a new Graph object.

        Placing runs at every call, even for the very graph placed last time: another scheduler
        (or the user) may have moved its tensors since. It is one identity check per tensor.
        """
        buffers = self.alloc.buffers
        if plan.graph is not graph or plan.placed_buffers != buffers:
            order = plan.order = graph.leafs + graph.nodes
            plan.placed = [(order[p] if t is None else t, buffers[b], off) for p, t, b, off in plan.records]
            plan.placed_buffers = list(buffers)
        for t, buf, off in plan.placed:
            if t.buffer is not buf or t.offset != off:
                t.buffer = buf
                t.offset = off
                buf.init_tensor(t)
        if plan.graph is graph:
            return
        self._pos = None
        order = plan.order
        nodes = graph.nodes
        plan.clones = {}
        plan.split_graphs = []
        for c in range(self.n_copies):
            graphs = []
            for sp in plan.splits:
                gnodes = nodes[sp.i_start:sp.i_end]
                for i in range(sp.i_start, sp.i_end):
                    if i in plan.subst:
                        node = nodes[i]
                        srcs = list(node.src)
                        for j, p, b in plan.subst[i]:
                            srcs[j] = plan.copies[(p, b)][c]
                        clone = _clone(node, tuple(srcs))
                        plan.clones[id(clone)] = node
                        gnodes[i - sp.i_start] = clone
                graphs.append(Graph(gnodes, []))
            plan.split_graphs.append(graphs)
        plan.split_inputs = [[(p, order[p]) for p in sp.inputs] for sp in plan.splits]
        plan.runs = []
        for k, sp in enumerate(plan.splits):
            b = sp.backend_id
            inputs = [_InputRun(p, order[p], plan.copies[(p, b)], plan.backend_of[p],
                                bool(order[p].flags & TensorFlag.INPUT), order[p].nbytes) for p in sp.inputs]
            plan.runs.append(_SplitRun(b, self.backends[b], [g[k] for g in plan.split_graphs], inputs,
                                       self.events[b]))
        plan.graph = graph

    def _position(self, tensor: Tensor) -> int | None:
        plan = self._plan
        if plan is None or plan.graph is None:
            return None
        if self._pos is None:
            self._pos = {id(t): i for i, t in enumerate(plan.order)}
        return self._pos.get(id(tensor))

    # --- execution ----------------------------------------------------------------------------
    def _compute_splits(self, plan: _Plan, c: int) -> None:
        prev = -1
        eval_cb = self.eval_callback
        for k, run in enumerate(plan.runs):
            b = run.backend_id
            be = run.backend
            if run.inputs:
                self._copy_inputs(plan, run, k, c)
            elif prev >= 0 and prev != b:
                # the allocator may have reused the previous split's memory across backends
                self._sync_event(prev, c)
            g = run.graphs[c]
            if eval_cb is not None:
                if not self._run(be, g, plan):
                    return
            else:
                try:
                    be.graph_compute(g)
                except Exception as e:
                    err = self._error(be, g, plan, e)
                    if err is e:
                        raise
                    raise err from e
            ev = run.events[c]
            if ev is not None:
                be.event_record(ev)
            prev = b

    def _sync_event(self, b: int, c: int) -> None:
        ev = self.events[b][c]
        if ev is not None:
            ev.synchronize()
        else:
            self._sync_backend(self.backends[b])

    def _copy_inputs(self, plan: _Plan, run: _SplitRun, k: int, c: int) -> None:
        """Copy a split's inputs into its backend: user inputs at once, others next, host weights last.

        Each wait happens once per split, not once per input: nothing is recorded on the split's
        backend while its inputs are being copied, so a second wait on the same event (or a second
        synchronize of the same source backend) would wait for nothing.
        """
        b = run.backend_id
        be = run.backend
        st = self.stats
        ev = run.events[c]
        waited = host_synced = False
        synced: set[int] = set()
        weights: list[_InputRun] = []
        for inp in run.inputs:
            t = inp.tensor
            if inp.user:
                # user data is copied at once: the caller may overwrite it as soon as we return
                if not host_synced:
                    self._sync_event(b, c)
                    host_synced = True
                _copy_sync(t, inp.dsts[c], inp.nbytes)
                st.n_copies += 1
                st.bytes_copied += inp.nbytes
                continue
            if is_host_weight(t):  # last: a copy callback may read the other inputs
                weights.append(inp)
                continue
            if not waited:
                waited = self._wait_split_backend(be, ev)
            host_synced = self._copy_async(be, b, inp, c, synced, host_synced)
        for inp in weights:
            if not waited:
                waited = self._wait_split_backend(be, ev)
            dst = inp.dsts[c]
            if self.copy_callback is not None and self.copy_callback(be, inp.tensor, dst, run.graphs[c]):
                st.n_callback_copies += 1
                continue
            host_synced = self._copy_async(be, b, inp, c, synced, host_synced)

    def _wait_split_backend(self, be: Backend, ev: Event | None) -> bool:
        """The split backend must be done with the previous use of these copies before they are overwritten."""
        if ev is not None:
            be.event_wait(ev)
        else:
            self._sync_backend(be)
        return True

    def _copy_async(self, be: Backend, b: int, inp: _InputRun, c: int, synced: set[int], host_synced: bool) -> bool:
        """Copy one input with the destination's async copy, else synchronously; returns host_synced."""
        dst = inp.dsts[c]
        src_b = inp.src_backend
        src_be = self.backends[src_b]
        if not be.cpy_tensor_async(src_be, inp.tensor, dst):
            if src_b not in synced:
                self._sync_backend(src_be)
                synced.add(src_b)
            if not host_synced:
                self._sync_event(b, c)
                host_synced = True
            _copy_sync(inp.tensor, dst, inp.nbytes)
        st = self.stats
        st.n_copies += 1
        st.bytes_copied += inp.nbytes
        return host_synced

    def _run(self, be: Backend, g: Graph, plan: _Plan) -> bool:
        """Compute one split graph; False when the eval callback asked to stop."""
        cb = self.eval_callback
        if cb is None:
            self._guarded(be, g, plan)
            return True
        nodes = g.nodes
        j0 = 0
        while j0 < len(nodes):
            j1 = j0
            t = plan.clones.get(id(nodes[j1]), nodes[j1])
            need = cb(t, True)
            while not need and j1 < len(nodes) - 1:
                j1 += 1
                t = plan.clones.get(id(nodes[j1]), nodes[j1])
                need = cb(t, True)
            self._guarded(be, Graph(nodes[j0:j1 + 1], []), plan)
            self._sync_backend(be)
            if need and not cb(t, False):
                return False
            j0 = j1 + 1
        return True

    def _guarded(self, be: Backend, g: Graph, plan: _Plan) -> None:
        try:
            be.graph_compute(g)
        except Exception as e:
            err = self._error(be, g, plan, e)
            if err is e:
                raise
            raise err from e

    @staticmethod
    def _error(be: Backend, g: Graph, plan: _Plan, e: Exception) -> Exception:
        """A SchedComputeError naming the node; a GGXError (a clear error already) keeps its type
        and gets the node as a note."""
        node = getattr(e, "node", None)
        if node is None and len(g.nodes) == 1:
            node = g.nodes[0]
        if node is not None:
            node = plan.clones.get(id(node), node)
            where = f"node {node.describe()} ({node.op.name})"
        else:
            names = [plan.clones.get(id(n), n) for n in g.nodes if not n.op.is_view]
            where = "one of nodes " + ", ".join(n.describe() for n in names[:8]) + (" ..." if len(names) > 8 else "")
        if isinstance(e, GGXError):
            e.add_note(f"(backend {be.name}, computing {where})")
            return e
        return SchedComputeError(f"backend {be.name} failed computing {where}: {type(e).__name__}: {e}", node, be)

    def _recover(self) -> None:
        """After a failure: drain every backend (dropping their errors) so the next graph starts clean."""
        for b in self.backends:
            try:
                b.synchronize()
            except Exception:  # noqa: BLE001 - the first error is the one being raised
                pass


def _clone(node: Tensor, srcs: tuple[Tensor, ...]) -> Tensor:
    """The node as its split sees it: same op and storage, some sources replaced by copies."""
    if node.view_src is not None:
        vs, offs = node.view_src, node.view_offs
    else:
        vs, offs = node, 0
    t = Tensor(node.type, node.ne, node.nb, op=node.op, params=node.params, src=srcs, name=node.name,
               view_src=vs, view_offs=offs, ndim=node.ndim)
    t.flags = node.flags
    t.extra = node.extra
    return t


class MoeExpertUpload:
    """A copy callback uploading only the experts a MUL_MAT_ID uses (llama.cpp's sched_copy_experts).

    It acts when the split's first node is a MUL_MAT_ID whose expert tensor is `dst`: it reads the
    ids (already copied: weights are copied last), marks the used experts, and uploads each run of
    consecutive used experts with one `set_tensor_async`, plus up to 512 bytes of the next expert
    (kernels that read whole tiles must not meet uninitialized padding). The used set is cached per
    ids tensor and reset at every graph.
    """

    PADDING = 512

    def __init__(self) -> None:
        self.bytes_uploaded = 0
        self.runs: list[tuple[int, int]] = []  # (first, last) expert of each upload, last graph
        self._ids: Tensor | None = None
        self._used: np.ndarray | None = None

    def reset(self) -> None:
        self._ids = None
        self._used = None
        self.runs = []
        self.bytes_uploaded = 0

    def __call__(self, backend: Backend, src: Tensor, dst: Tensor, graph: Graph) -> bool:
        node = next((n for n in graph.nodes if not n.op.is_view), None)
        if node is None or node.op is not Op.MUL_MAT_ID or node.src[0] is not dst:
            return False
        ids = node.src[2]
        if ids.nelements == 0:
            return True
        n_expert = src.ne[2]
        expert_size = src.nb[2]
        if ids is not self._ids or self._used is None or len(self._used) != n_expert:
            raw = backend.get_tensor_async(ids, 0, ids.nbytes)
            backend.synchronize()
            vals = np.ndarray((ids.ne[1], ids.ne[0]), np.int32, raw, 0, (ids.nb[1], ids.nb[0]))
            if vals.size and (vals.min() < 0 or vals.max() >= n_expert):
                raise GGXShapeError(f"MUL_MAT_ID ids {ids.describe()} hold an expert outside 0..{n_expert - 1}")
            used = np.zeros(n_expert, dtype=bool)
            used[vals.reshape(-1)] = True
            self._ids, self._used = ids, used
        used = self._used
        first = 0
        while first < n_expert:
            if not used[first]:
                first += 1
                continue
            last = first
            while last + 1 < n_expert and used[last + 1]:
                last += 1
            offset = first * expert_size
            padding = min(expert_size, self.PADDING) if last < n_expert - 1 else 0
            size = (last + 1 - first) * expert_size + padding
            backend.set_tensor_async(dst, src.data_buffer.get_tensor(src, offset, size), offset)
            self.runs.append((first, last))
            self.bytes_uploaded += size
            first = last + 1
        return True
