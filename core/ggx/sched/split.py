"""Splits, their input copies and the allocation order: pass 5 of ggml_backend_sched_split_graph.

5. splits — a new split starts where the backend changes (or where a weight would have to be
   copied to a backend that cannot read it); every source a split's backend cannot read gets a
   copy in that backend's buffer type, made once per graph and backend. With `n_copies > 1`
   every split input has `n_copies` copies, used in turn by successive graphs.

Split graphs: for each Graph object and copy set, a split's nodes, where a node reading a copied
input is replaced by a clone (same op and storage) reading the copy, and so is every node of the
split reading a replaced one: within a split graph every source is a node of that graph or
something computed before it (a leaf, a copy, another split's result). Each split graph goes once
through its backend's `graph_optimize` when it is built (ggml does this per split, before
allocating), and the graph it returns is the one computed. The allocation order follows the
order the backend chose: a split's input copies at its start (each keeping its source alive
until then), then its nodes. A reorder must depend only on the graph's structure: another Graph
object with the same key must come back in the same order, since it reuses the allocation.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..alloc import Plan, Step
from ..backend import Backend, BufferType, BufferUsage, Event
from ..errors import SchedComputeError
from ..graph import Graph
from ..tensor import Tensor, TensorFlag
from .assign import Cause, preallocated


@dataclass(slots=True)
class Split:
    backend_id: int
    i_start: int  # node indices [i_start, i_end)
    i_end: int
    inputs: list[int]  # positions (leafs + nodes) of the tensors copied in
    order: list[int] | None = None  # node indices as graph_optimize ordered them (None: graph order)
    clone_program: list[tuple[int, tuple]] = field(default_factory=list)  # see _clone_program


class CopySource(NamedTuple):
    """Source `slot` of a node reads the copy of the input at position `pos` made for `backend_id`."""

    slot: int
    pos: int
    backend_id: int


@dataclass(slots=True)
class InputRun:
    """One split input as the execution loop needs it (resolved once per Graph object)."""

    tensor: Tensor
    dsts: list[Tensor]  # its copy in each copy set
    src_backend: int
    user: bool  # an INPUT leaf: copied synchronously at once
    nbytes: int


@dataclass(slots=True)
class SplitRun:
    """One split as the execution loop needs it: backend, split graph per copy set, inputs, events."""

    backend_id: int
    backend: Backend
    graphs: list[Graph]  # per copy set, as graph_optimize returned them
    inputs: list[InputRun]
    events: list[Event | None]  # per copy set


@dataclass
class SchedPlan:
    """Everything planned for one graph key; the split graphs and runs for one Graph object."""

    key: tuple
    backend_of: list[int]  # by position in leafs + nodes
    cause: list[Cause]
    splits: list[Split]
    copy_sources: dict[int, list[CopySource]]  # node index -> its sources read from copies
    copies: dict[tuple[int, int], list[Tensor]]  # (input position, backend) -> one tensor per copy set
    alloc: Plan = field(default_factory=Plan)
    record_pos: list[int] = field(default_factory=list)  # per allocator record: position, -1 for a copy
    # materialized for one Graph object
    graph: Graph | None = None
    order: list[Tensor] = field(default_factory=list)  # its leafs + nodes
    placed: list[Tensor] = field(default_factory=list)  # per allocator record, its tensor
    clones: dict[int, Tensor] = field(default_factory=dict)  # id(clone) -> original node
    runs: list[SplitRun] = field(default_factory=list)


def cut_splits(graph: Graph, bid: dict[int, int], backends: Sequence[Backend], bufts: Sequence[BufferType],
               n_copies: int) -> tuple[list[Split], dict[int, list[CopySource]], dict[tuple[int, int], list[Tensor]]]:
    """Pass 5: the splits, which node sources read copies, and the copies (one per copy set)."""
    cutter = _Cutter(graph, bid, backends, bufts, n_copies)
    for i, node in enumerate(graph.nodes):
        if not node.op.is_view:
            cutter.node(i, node)
    return cutter.splits, cutter.copy_sources, cutter.copies


class _Cutter:
    def __init__(self, graph: Graph, bid: dict[int, int], backends: Sequence[Backend],
                 bufts: Sequence[BufferType], n_copies: int):
        self.bid = bid
        self.backends = backends
        self.bufts = bufts
        self.n_copies = n_copies
        self.n_nodes = len(graph.nodes)
        self.pos = {id(t): i for i, t in enumerate(graph.leafs + graph.nodes)}
        self.splits: list[Split] = []
        self.copy_sources: dict[int, list[CopySource]] = {}
        self.copies: dict[tuple[int, int], list[Tensor]] = {}

    def _readable(self, t: Tensor, b: int) -> bool:
        buf = preallocated(t)
        bid = self.bid
        buft = buf.buft if buf is not None else self.bufts[bid[id(t.root)] if id(t.root) in bid else bid[id(t)]]
        return self.backends[b].device.supports_buft(buft)

    def _new_split_for_weight(self, node: Tensor, b: int) -> bool:
        """A weight the backend cannot read: a new split lets its copy be freed sooner."""
        for src in node.src:
            sbuf = preallocated(src)
            if sbuf is not None and sbuf.usage == BufferUsage.WEIGHTS and self.bid[id(src)] != b \
                    and not self._readable(src, b):
                return True
        return False

    def node(self, i: int, node: Tensor) -> None:
        b = self.bid[id(node)]
        split = self.splits[-1] if self.splits else None
        if split is None or b != split.backend_id or (split.inputs and self._new_split_for_weight(node, b)):
            if split is not None:
                split.i_end = i
            split = Split(b, 0 if split is None else i, self.n_nodes, [])
            self.splits.append(split)
        for j, src in enumerate(node.src):
            if self.bid[id(src)] == b or self._readable(src, b):
                continue
            p = self.pos[id(src)]
            if (p, b) not in self.copies:
                name = f"{self.backends[b].name}#{src.name or src.op.name.lower()}"
                self.copies[(p, b)] = [Tensor(src.type, src.ne, src.nb, name=f"{name}#{c}", ndim=src.ndim)
                                       for c in range(self.n_copies)]
                split.inputs.append(p)
            self.copy_sources.setdefault(i, []).append(CopySource(j, p, b))


def alloc_order(plan: SchedPlan, graph: Graph, n_copies: int) -> tuple[list[Step], list[Tensor]]:
    """(steps, pinned) for the allocator: per split its input copies, then its nodes in the
    order its backend chose. With several copy sets, every copy stays allocated (pinned)."""
    nodes = graph.nodes
    order = graph.leafs + nodes
    steps: list[Step] = []
    pinned: list[Tensor] = []
    if n_copies > 1:  # successive graphs use the copy sets in turn
        for made in plan.copies.values():
            steps.extend(Step(cp, ()) for cp in made)
            pinned.extend(made)
    for sp in plan.splits:
        for p in sp.inputs:
            steps.append(Step(None, (order[p],)))
            if n_copies == 1:
                steps.append(Step(plan.copies[(p, sp.backend_id)][0], ()))
        for i in sp.order if sp.order is not None else range(sp.i_start, sp.i_end):
            node = nodes[i]
            srcs = node.src
            if i in plan.copy_sources:
                srcs = list(srcs)
                for cs in plan.copy_sources[i]:
                    srcs[cs.slot] = plan.copies[(cs.pos, cs.backend_id)][0]
                srcs = tuple(srcs)
            steps.append(Step(node, srcs))
    return steps, pinned


def buft_resolver(plan: SchedPlan, graph: Graph, buft_index: Sequence[int]) -> Callable[[Tensor], int]:
    """The allocator's buffer type (index) for each tensor of the steps: its backend's."""
    backend_of = {id(t): b for t, b in zip(graph.leafs + graph.nodes, plan.backend_of)}
    for (_p, b), made in plan.copies.items():
        for cp in made:
            backend_of[id(cp)] = b
    host = len(buft_index) - 1

    def buft_of(t: Tensor) -> int:
        b = backend_of.get(id(t), -1)
        return buft_index[b if b >= 0 else host]
    return buft_of


def _clone_program(plan: SchedPlan, nodes: list[Tensor], sp: Split) -> list[tuple[int, tuple]]:
    """Which nodes of split `sp` are replaced, and from what: per replaced node its index and, per
    source slot, None (the source itself), the index of an earlier replacement in this list, or
    the key of the copy it reads. Structural: one program serves every graph of the plan's key."""
    program: list[tuple[int, tuple]] = []
    replaced: dict[int, int] = {}  # id(node) -> its place in the program
    for i in range(sp.i_start, sp.i_end):
        node = nodes[i]
        spec: list = [replaced.get(id(s)) for s in node.src]
        for cs in plan.copy_sources.get(i, ()):
            spec[cs.slot] = (cs.pos, cs.backend_id)
        if any(r is not None for r in spec):
            replaced[id(node)] = len(program)
            program.append((i, tuple(spec)))
    return program


def _split_graph(plan: SchedPlan, nodes: list[Tensor], sp: Split, c: int, clones: dict[int, Tensor]) -> Graph:
    """Split `sp` with copy set `c`, in graph order. The graph is closed: a node reading a copy,
    or a node of the split that was replaced, is replaced by a clone (same op and storage: a view
    of the node, or of its root) reading the replacements; `clones` maps each to its node."""
    gnodes = nodes[sp.i_start:sp.i_end]
    made: list[Tensor] = []
    copies, start = plan.copies, sp.i_start
    for i, spec in sp.clone_program:
        node = nodes[i]
        srcs = tuple([s if r is None else made[r] if r.__class__ is int else copies[r][c]
                      for s, r in zip(node.src, spec)])
        # built field by field: the node was validated when it was made
        t = Tensor.__new__(Tensor)
        t.type, t.ne, t.nb, t.op, t.params, t.src = node.type, node.ne, node.nb, node.op, node.params, srcs
        t.flags, t.name, t.ndim, t.extra, t.buffer, t.offset = node.flags, node.name, node.ndim, node.extra, None, 0
        if node.view_src is not None:
            t.view_src, t.view_offs = node.view_src, node.view_offs
        else:
            t.view_src, t.view_offs = node, 0
        made.append(t)
        clones[id(t)] = node
        gnodes[i - start] = t
    return Graph(gnodes, [])


def _chosen_order(sp: Split, be: Backend, got: Graph, clones: dict[int, Tensor], index: dict[int, int]) -> list[int]:
    """The node indices of `got`, what graph_optimize returned for split `sp` in another order.
    Checked: the same nodes, each after its sources in the split."""
    chosen: list[int] = []
    done: set[int] = set()
    for n in got.nodes:
        orig = clones.get(id(n), n)
        i = index.get(id(orig), -1)
        if not sp.i_start <= i < sp.i_end or i in done:
            raise SchedComputeError(f"backend {be.name}: graph_optimize returned {orig.describe()}, which is not "
                                    f"a node of its split (or is there twice)", orig, be)
        for s in (*orig.src, orig.view_src):
            j = index.get(id(s), -1) if s is not None else -1
            if sp.i_start <= j < sp.i_end and j not in done:
                raise SchedComputeError(f"backend {be.name}: graph_optimize put {orig.describe()} before its "
                                        f"source {s.describe()}", orig, be)
        done.add(i)
        chosen.append(i)
    if len(chosen) != sp.i_end - sp.i_start:
        raise SchedComputeError(f"backend {be.name}: graph_optimize returned {len(chosen)} of the "
                                f"{sp.i_end - sp.i_start} nodes of its split", None, be)
    return chosen


def materialize(plan: SchedPlan, graph: Graph, backends: Sequence[Backend], events: Sequence[Sequence[Event | None]],
                n_copies: int, planning: bool) -> None:
    """Build the split graphs (through graph_optimize) and runs of `plan` for `graph`. While
    `planning`, the orders graph_optimize chooses become the plan's; later they must match it.
    The plan changes only when every split graph was accepted."""
    nodes = graph.nodes
    order = graph.leafs + nodes
    clones: dict[int, Tensor] = {}
    index: dict[int, int] = {}  # node -> its index, made when a backend reorders
    graphs: list[list[Graph]] = [[] for _ in plan.splits]
    if planning:
        for sp in plan.splits:
            sp.clone_program = _clone_program(plan, nodes, sp)
    for c in range(n_copies):
        for k, sp in enumerate(plan.splits):
            be = backends[sp.backend_id]
            g = _split_graph(plan, nodes, sp, c, clones)
            given = list(g.nodes)
            got = be.graph_optimize(g)
            chosen = None
            if got.nodes != given:
                index = index or {id(t): i for i, t in enumerate(nodes)}
                chosen = _chosen_order(sp, be, got, clones, index)
            if planning and c == 0:
                sp.order = chosen
            elif chosen != sp.order:
                raise SchedComputeError(f"backend {be.name}: graph_optimize ordered a split differently from the "
                                        f"graph with the same key this plan was made for (a reorder must depend "
                                        f"only on the graph's structure)", None, be)
            graphs[k].append(got)
    runs = []
    for k, sp in enumerate(plan.splits):
        b = sp.backend_id
        inputs = [InputRun(order[p], plan.copies[(p, b)], plan.backend_of[p], bool(order[p].flags & TensorFlag.INPUT),
                           order[p].nbytes) for p in sp.inputs]
        runs.append(SplitRun(b, backends[b], graphs[k], inputs, list(events[b])))
    plan.order, plan.clones, plan.runs, plan.graph = order, clones, runs, graph


def place_list(plan: SchedPlan) -> list[Tensor]:
    """Per allocator record, the tensor of the materialized graph it places."""
    order = plan.order
    return [order[p] if p >= 0 else r.tensor for p, r in zip(plan.record_pos, plan.alloc.records)]
