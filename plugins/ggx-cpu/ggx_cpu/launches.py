"""The launches a CPU backend keeps per graph: decode submits the same graph every token, so
every node is validated and its kernel call bound once, and later computes only call them.

A graph computed a second time that runs no parallel region (a decode step's: its matmuls and
attention are jobs of the worker threads) is fused: each run of consecutive launches that are
jobs (a one-thread kernel's call, a job of the worker threads, a compiled index check) becomes
one compiled call through `pool.SequenceLaunch`, so a decode step's ~450 kernels cost one Python
call instead of one each (the arguments are stored once in compiled form; nothing is unboxed per
token). Other launches stay between the sequences, in order. The model's warm-up computes its
decode step twice, so the jobs' functions load with the model, not on the first token.
"""
from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

import numpy as np

from ggx.backend import Buffer, Launch
from ggx.graph import Graph
from ggx.tensor import Tensor

#: Prepared graphs a backend keeps (decode keeps one per KV bucket and scheduler split).
MAX_PREPARED = 64
#: Computes of a kept graph after which its launches run fused (a graph computed once, as a
#: prompt or a test case, never pays for it)
FUSE_AFTER = 2

_storage = operator.attrgetter("buffer", "offset")


class PreparedGraph:
    """The launches of one graph: `launches[i]` runs `nodes[i]` (nodes with nothing to run left out).

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
        self.computes = 0
        self.fused: list[Launch] | None = None

    def run(self) -> None:
        """Compute the graph: its launches, fused once it has been computed FUSE_AFTER times."""
        launches = self.fused
        if launches is None:
            self.computes += 1
            launches = self.launches
            if self.computes >= FUSE_AFTER:
                from . import pool

                if pool.enabled():
                    self.fused = launches = fuse(self.launches)
        for f in launches:
            f()

    def still_valid(self, graph: Graph, n_threads: int) -> bool:
        return (self.graph() is graph and len(graph.nodes) == self.n_nodes and self.n_threads == n_threads
                and list(map(_storage, self.roots)) == self.storage and not any(b.is_freed for b in self.buffers))


def fuse(launches: list[Launch]) -> list[Launch]:
    """`launches` with each run of two or more consecutive jobs as one `pool.SequenceLaunch`; as
    they are if one of them runs a parallel region (a prompt's graph: its launches are few
    against its work, and its kernels' jobs would only cost loading)."""
    from . import pool
    from .kernels.common import IndexCheck, runs_a_region

    flat = list(_flat(launches))
    if any(map(runs_a_region, flat)):
        return launches
    out: list[Launch] = []
    run: list[tuple[Launch, np.ndarray, np.ndarray | None]] = []

    def close_run() -> None:
        if len(run) > 1:
            out.append(pool.SequenceLaunch(*map(list, zip(*((job, f, flag) for f, job, flag in run)))))
        else:
            out.extend(f for f, _, _ in run)
        run.clear()

    for f in flat:
        job = _job_of(f)
        if job is None:
            close_run()
            out.append(f)
        else:
            run.append((f, job, f.failed if isinstance(f, IndexCheck) else None))
    close_run()
    return out


def _flat(launches: list[Launch]):
    from .kernels.common import InOrder

    for f in launches:
        if isinstance(f, InOrder):
            yield from _flat(list(f.launches))
        else:
            yield f


def _job_of(f: Launch) -> np.ndarray | None:
    from . import pool
    from .kernels.common import IndexCheck, KernelLaunch

    if isinstance(f, pool.JobLaunch) and len(f.jobs) == 1:
        return f.jobs[0]
    if isinstance(f, (KernelLaunch, IndexCheck)):
        return pool.kernel_job(f.kernel, f.args)
    return None


class PreparedGraphs:
    """The prepared graphs of one backend, by graph; a graph's entry goes when the graph does
    (its launches reference the graph's memory)."""

    def __init__(self) -> None:
        self._by_id: dict[int, PreparedGraph] = {}

    def get(self, graph: Graph, n_threads: int, launch_for: Callable[[Tensor], Launch | None]) -> PreparedGraph:
        """The graph's kept launches, prepared again when they no longer hold."""
        prepared = self._by_id.get(id(graph))
        if prepared is None or not prepared.still_valid(graph, n_threads):
            if len(self._by_id) >= MAX_PREPARED:
                self._by_id.clear()
            prepared = self._by_id[id(graph)] = PreparedGraph(graph, n_threads, launch_for)
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
