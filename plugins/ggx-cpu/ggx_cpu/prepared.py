"""The launches a CPU backend keeps per graph: decode submits the same graph every token, so
every node is validated and its kernel call bound once, and later computes only call them.

A graph prepared ahead (`CpuBackend.graph_prepare`: the scheduler's, for the graphs a model
keeps) is also fused when it runs no parallel region (a decode step's: its matmuls and
attention are jobs of the worker pool): each run of consecutive steps that are compiled jobs
(`launch.steps_of`: one-thread kernels, split kernels planned as jobs, compiled index checks)
becomes one compiled call (`launch.SequenceLaunch`), so a decode step's ~450 kernels cost one
Python call instead of one each (the arguments are stored once in compiled form; nothing is
unboxed per token). Other launches stay between the sequences, in order. A graph nobody
prepared is fused at its second compute (a graph computed once, a test's or a one-off prompt's,
never pays for it: fusing loads a compiled thunk per kernel and argument types).
"""
from __future__ import annotations

import operator
import time
import weakref
from collections.abc import Callable

from ggx.backend import Buffer, Launch
from ggx.graph import Graph
from ggx.tensor import Tensor

from . import pool
from .launch import SequenceLaunch, Step, steps_of

#: Prepared graphs a backend keeps (decode keeps one per KV bucket and scheduler split).
MAX_PREPARED = 64
#: Computes after which a graph nobody prepared ahead runs fused too
FUSE_AFTER = 2

_storage = operator.attrgetter("buffer", "offset")


class PreparedGraph:
    """The launches of one graph: `launches[i]` runs `nodes[i]` (nodes with nothing to run left
    out); `calls` are what a compute runs: the launches, or once fused (`fuse_now`) their fused
    form, `covers[j]` the node of each step of `calls[j]`.

    Valid while the same graph is computed with the same thread count, every tensor it touches
    still has the storage it had (the scheduler re-places tensors when it re-plans), and no
    buffer it uses was freed. Checking that is one C-level pass over the roots plus one look at
    each distinct buffer. The graph is held weakly.
    """

    def __init__(self, graph: Graph, n_threads: int, launch_for: Callable[[Tensor], Launch | None]):
        self.graph = weakref.ref(graph)
        self.n_nodes = len(graph.nodes)
        self.n_threads = n_threads
        roots: dict[int, Tensor] = {}
        for node in graph.nodes:
            for t in (node, *node.src):
                if t is not None:
                    r = t.root
                    roots[id(r)] = r
        self.roots = list(roots.values())
        self.storage = list(map(_storage, self.roots))
        buffers = {id(b): b for b, _ in self.storage if b is not None}
        self.buffers: list[Buffer] = list(buffers.values())
        bound = [(node, launch_for(node)) for node in graph.nodes]  # validates all before any runs
        self.nodes = [node for node, f in bound if f is not None]
        self.launches = [f for _, f in bound if f is not None]
        self.calls: list[Launch] = self.launches
        self.covers: list[list[Tensor]] = [[node] for node in self.nodes]
        self.fused = False
        self.computes = 0

    def fuse_now(self) -> None:
        """Run fused from now on (`fuse`), once; nothing changes with the workers off."""
        if not self.fused and pool.enabled():
            self.calls, self.covers = fuse(self.nodes, self.launches)
        self.fused = True

    def run(self) -> None:
        if not self.fused:
            self.computes += 1
            if self.computes >= FUSE_AFTER:
                self.fuse_now()
        for f in self.calls:
            f()

    def profile(self) -> list[tuple[Tensor, float]]:
        """Run what a compute runs, timing each node: a fused sequence step by step through its
        compiled loop (its jobs as decode runs them; the one call's saving shows in the total)."""
        clock = time.perf_counter
        spent: dict[int, float] = {}
        for f, nodes in zip(self.calls, self.covers):
            if isinstance(f, SequenceLaunch):
                for i, node in enumerate(nodes):
                    t0 = clock()
                    f.run_step(i)
                    spent[id(node)] = spent.get(id(node), 0.0) + clock() - t0
            else:
                t0 = clock()
                f()
                spent[id(nodes[0])] = spent.get(id(nodes[0]), 0.0) + clock() - t0
        return [(node, spent[id(node)]) for node in self.nodes]

    def still_valid(self, graph: Graph, n_threads: int) -> bool:
        return (self.graph() is graph and len(graph.nodes) == self.n_nodes and self.n_threads == n_threads
                and list(map(_storage, self.roots)) == self.storage and not any(b.is_freed for b in self.buffers))


def fuse(nodes: list[Tensor], launches: list[Launch]) -> tuple[list[Launch], list[list[Tensor]]]:
    """The launches with each run of two or more consecutive compiled jobs as one
    `SequenceLaunch`, and the node of each step of each; as they are if one of them runs a
    parallel region (a prompt's graph: its launches are few against its work, and its kernels'
    jobs would only cost loading)."""
    steps = [(node, s) for node, f in zip(nodes, launches) for s in steps_of(f)]
    if any(s.region for _, s in steps):
        return launches, [[node] for node in nodes]
    calls: list[Launch] = []
    covers: list[list[Tensor]] = []
    run: list[tuple[Tensor, Step]] = []

    def close_run() -> None:
        if len(run) > 1:
            calls.append(SequenceLaunch([s for _, s in run]))
            covers.append([node for node, _ in run])
        else:
            calls.extend(s.launch for _, s in run)
            covers.extend([node] for node, _ in run)
        run.clear()

    for node, s in steps:
        if s.job is None:
            close_run()
            calls.append(s.launch)
            covers.append([node])
        else:
            run.append((node, s))
    close_run()
    return calls, covers


class PreparedGraphs:
    """The prepared graphs of one backend, by graph; a graph's entry goes when the graph does
    (its launches reference the graph's memory)."""

    def __init__(self) -> None:
        self._by_id: dict[int, PreparedGraph] = {}

    def get(self, graph: Graph, n_threads: int, launch_for: Callable[[Tensor], Launch | None]) -> PreparedGraph:
        """The graph's kept launches, prepared again when they no longer hold."""
        prepared = self._by_id.get(id(graph))
        if prepared is None or not prepared.still_valid(graph, n_threads):
            was_fused = prepared is not None and prepared.fused and prepared.graph() is graph
            if len(self._by_id) >= MAX_PREPARED:
                self._by_id.clear()
            prepared = self._by_id[id(graph)] = PreparedGraph(graph, n_threads, launch_for)
            if was_fused:  # re-placed by the scheduler: still a graph prepared ahead
                prepared.fuse_now()
            weakref.finalize(graph, self._forget, id(graph), prepared)
        return prepared

    def kept(self, graph: Graph) -> PreparedGraph | None:
        """The launches kept for `graph`, valid or not (None: none kept)."""
        prepared = self._by_id.get(id(graph))
        return prepared if prepared is not None and prepared.graph() is graph else None

    def _forget(self, key: int, entry: PreparedGraph) -> None:
        """A graph died: drop its launches (unless its id already belongs to a newer graph)."""
        if self._by_id.get(key) is entry:
            del self._by_id[key]
