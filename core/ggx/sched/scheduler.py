"""The Scheduler: plan (or reuse the plan of) a graph, place it, run it over several backends.

A plan is reused, without re-planning, when a graph with the same `Graph.key` whose
preallocated leafs live in the same buffer types comes back (a decode loop). The last
`KEPT_PLANS` plans are kept by key, so graphs that take turns (a prompt's, then decode's, then
the next prompt's) are not planned again either. Before it re-plans, switches to another kept
plan, grows a compute buffer or frees one, the scheduler waits for every backend, as
ggml_backend_sched_alloc_splits does ("the re-allocation may cause the split inputs to be
moved"): queued work of an earlier graph may still read or write that memory. The plan of the
last graph, in buffers that fit, needs no wait.

A Scheduler holds the state of the graph it runs (placement, copies, events), so it serves one
thread at a time: a call entering it while another thread is inside raises GGXStateError instead
of mixing two graphs' tensors (use one scheduler per thread, or a lock, as `ggx.compute` does).
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..alloc import GraphAllocator, is_scratch
from ..backend import Backend, Buffer, Event
from ..errors import GGXError, GGXShapeError, GGXStateError, GGXUnsupported
from ..graph import Graph
from ..tensor import Tensor
from .assign import assign_backends
from .execute import CopyCallback, EvalCallback, Executor, SchedStats
from .split import SchedPlan, alloc_order, buft_resolver, cut_splits, materialize, place_list


@dataclass
class SplitInfo:
    """One split of the last graph (for inspection and the DOT writer)."""

    backend: Backend
    nodes: list[Tensor]
    inputs: list[Tensor]


_F = TypeVar("_F", bound=Callable)

#: plans a Scheduler keeps by key (a model keeps a graph per prompt bucket and KV bucket)
KEPT_PLANS = 32


def _one_thread(method: _F) -> _F:
    """Hold the scheduler for the calling thread during `method` (nested calls of that thread pass)."""
    @functools.wraps(method)
    def held(self: Scheduler, *args):
        me = threading.get_ident()
        if self._user == me:
            return method(self, *args)
        if not self._in_use.acquire(blocking=False):
            raise GGXStateError("this Scheduler is in use by another thread; a scheduler serves one thread at "
                                "a time (use one per thread, or a lock around its calls)")
        self._user = me
        try:
            return method(self, *args)
        finally:
            self._user = None
            self._in_use.release()
    return held  # type: ignore[return-value]


class Scheduler:
    """Computes graphs over `backends` (priority order, a host backend last), ggml-style.

    copy_callback(backend, src, dst, split_graph) -> bool may take over the upload of a weight
    in host memory (True: done). eval_callback(tensor, ask) -> bool: asked (ask=True) for each
    node whether the caller wants to see it; if so the node is computed, its backend synchronized
    and the callback called again (ask=False); returning False there stops the graph.
    `free()` releases the compute buffers (after waiting for every backend).
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
        self._buft_index = [self.alloc.buft_index(b) for b in self.bufts]
        self.events: list[list[Event | None]] = [
            [b.device.event_new() if b.device.caps.events else None for _ in range(n_copies)] for b in backends]
        self.cur_copy = 0
        self.stats = SchedStats()
        self._exec = Executor(backends, self.events, self.stats)
        self._plan: SchedPlan | None = None
        self._plans: dict[tuple, SchedPlan] = {}  # kept plans by key, least recently used first
        self._pos: dict[int, int] | None = None
        self._last_key: tuple[Graph, list[Buffer | None], tuple] | None = None  # (graph, leaf buffers, key)
        self._in_use = threading.Lock()
        self._user: int | None = None  # the thread inside a public call

    # --- memory -------------------------------------------------------------------------------
    @_one_thread
    def reserve(self, graph: Graph) -> None:
        """Plan `graph` (a worst case) and size the compute buffers, without placing its tensors."""
        self._wait_for_realloc()
        self._keep(self._make_plan(graph, self._plan_key(graph)))
        self.alloc.reserve(self._plan.alloc)

    @_one_thread
    def alloc_graph(self, graph: Graph) -> None:
        """Plan (or reuse the plan of) `graph` and place its tensors: inputs can be set after this."""
        t0 = time.perf_counter()
        key = self._plan_key(graph)
        plan = self._plan
        switched = plan is None or plan.key != key
        reused = not switched
        if switched:
            self._wait_for_realloc()
            plan = self._plans.get(key)
            reused = plan is not None
            if plan is None:
                plan = self._make_plan(graph, key)
                self.stats.n_plans += 1
            self._keep(plan)
        if reused and plan.graph is not graph:
            materialize(plan, graph, self.backends, self.events, self.n_copies, planning=False)
            plan.placed = place_list(plan)
            self._pos = None
        if not self.alloc.fits(plan.alloc):
            if not switched:
                self._wait_for_realloc()
            self.alloc.reserve(plan.alloc)
        self.alloc.place(plan.alloc, plan.placed)
        self.stats.plan_time_s = time.perf_counter() - t0
        self.stats.plan_reused = reused

    def _keep(self, plan: SchedPlan) -> None:
        """Make `plan` the current one and the most recently used of the kept plans."""
        self._plan, self._pos = plan, None
        self._plans.pop(plan.key, None)
        if len(self._plans) >= KEPT_PLANS:
            del self._plans[next(iter(self._plans))]
        self._plans[plan.key] = plan

    @_one_thread
    def free(self) -> None:
        """Release the compute buffers now, after waiting for every backend. The scheduler stays
        usable: the next graph is planned and allocated again."""
        try:
            self._wait_for_realloc()
        finally:
            self.alloc.free()
            self._plan = None
            self._plans.clear()
            self._pos = None
            self._last_key = None

    def _wait_for_realloc(self) -> None:
        """Wait for every backend before memory is re-planned, grown or freed (queued work of an
        earlier graph may still use it). Keeps cur_copy, as ggml does here."""
        self.stats.n_realloc_waits += 1
        self.synchronize()

    # --- computing ----------------------------------------------------------------------------
    @_one_thread
    def graph_compute(self, graph: Graph) -> None:
        """Compute `graph`; returns once every result is ready."""
        try:
            self.graph_compute_async(graph)
        finally:
            self.synchronize()

    @_one_thread
    def graph_compute_async(self, graph: Graph) -> None:
        """Submit `graph`; results are ready after `synchronize()`."""
        self.alloc_graph(graph)
        plan = self._plan
        st = self.stats
        st.n_graphs += 1
        st.n_splits = len(plan.splits)
        st.n_inputs_copied = st.n_callback_copies = st.bytes_copied = 0
        reset = getattr(self.copy_callback, "reset", None)
        if reset is not None:
            reset()
        c = self.cur_copy
        try:
            self._exec.run(plan, c, self.copy_callback, self.eval_callback)
        except BaseException:
            self._exec.drain()
            raise
        self.cur_copy = (c + 1) % self.n_copies

    @_one_thread
    def graph_prepare(self, graph: Graph) -> None:
        """Plan and place `graph` and let each split's backend bind it (`Backend.graph_prepare`),
        computing nothing: a later `graph_compute(graph)` starts at once, as long as the compute
        buffers are not grown in between (a larger graph's plan moves every tensor; `reserve` the
        largest graph first)."""
        self.alloc_graph(graph)
        for run in self._plan.runs:
            for split_graph in run.graphs:
                run.backend.graph_prepare(split_graph)

    @_one_thread
    def synchronize(self) -> None:
        """Wait for every backend; a failure of queued work surfaces here as SchedComputeError."""
        clones = self._plan.clones if self._plan is not None else {}
        first: GGXError | None = None
        for b in self.backends:
            try:
                self._exec.synchronize(b, clones)
            except GGXError as e:
                first = first or e
        if first is not None:
            raise first

    # --- inspection ---------------------------------------------------------------------------
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
        cause = self._plan.cause[p]
        return f"{tensor.describe()} -> {b.name} (pass {cause.code}: {cause.describe()})"

    @property
    def splits(self) -> list[SplitInfo]:
        plan = self._plan
        if plan is None or plan.graph is None:
            return []
        nodes, order = plan.graph.nodes, plan.order
        return [SplitInfo(self.backends[s.backend_id], nodes[s.i_start:s.i_end], [order[p] for p in s.inputs])
                for s in plan.splits]

    def copy_of(self, tensor: Tensor, backend: Backend) -> Tensor | None:
        """The copy of a split input made for `backend` in the current copy set (None if none)."""
        p = self._position(tensor)
        if p is None:
            return None
        copies = self._plan.copies.get((p, self.backends.index(backend)))
        return None if copies is None else copies[self.cur_copy]

    def _position(self, tensor: Tensor) -> int | None:
        plan = self._plan
        if plan is None or plan.graph is None:
            return None
        if self._pos is None:
            self._pos = {id(t): i for i, t in enumerate(plan.order)}
        return self._pos.get(id(tensor))

    # --- planning -----------------------------------------------------------------------------
    def _plan_key(self, graph: Graph) -> tuple:
        """Graph.key plus the buffer type of every preallocated leaf (None for scratch or no storage).

        The decode loop submits the same Graph object with its leafs in the same buffers: then
        the key of the last call is returned after one identity comparison of the leaf buffers
        (asking whether each buffer is scratch would cost more than the rest of plan reuse).
        """
        buffers = [(t.view_src or t).buffer for t in graph.leafs]
        last = self._last_key
        if last is not None and last[0] is graph and last[1] == buffers:
            return last[2]
        bufts = tuple(None if b is None or is_scratch(b) else id(b.buft) for b in buffers)
        key = (graph.key, bufts)
        self._last_key = (graph, buffers, key)
        return key

    def _make_plan(self, graph: Graph, key: tuple) -> SchedPlan:
        bid, cause = assign_backends(graph, self.backends, self.op_offload)
        order = graph.leafs + graph.nodes
        splits, copy_sources, copies = cut_splits(graph, bid, self.backends, self.bufts, self.n_copies)
        plan = SchedPlan(key, [bid[id(t)] for t in order], [cause[id(t)] for t in order], splits, copy_sources,
                         copies)
        materialize(plan, graph, self.backends, self.events, self.n_copies, planning=True)
        steps, pinned = alloc_order(plan, graph, self.n_copies)
        plan.alloc = self.alloc.plan(steps, graph.leafs, buft_resolver(plan, graph, self._buft_index), pinned)
        pos = {id(t): i for i, t in enumerate(order)}
        plan.record_pos = [pos.get(id(r.tensor), -1) for r in plan.alloc.records]
        plan.placed = [r.tensor for r in plan.alloc.records]
        self._pos = None
        return plan
