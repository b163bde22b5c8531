"""Running a planned graph: per split, its input copies, then its graph; events between backends.

Per split, user inputs are copied at once (synchronously), other inputs next, weights in host
memory last (so a copy callback can read the split's other inputs, e.g. MoE ids); async copies
where the destination backend has them, else a synchronous copy after waiting for the source;
an event is recorded after each split and waited on by the next user of that backend's copies
instead of synchronizing whole devices. With `n_copies > 1` each graph uses the next copy set,
so the host can submit graph N+1 while graph N still runs.

A failure surfaces as SchedComputeError naming the node (a GGXError keeps its type and gets the
node as a note), when the split is submitted or, for queued work, at the next synchronize.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..backend import Backend, BufferUsage, Event
from ..errors import GGXError, GGXShapeError, SchedComputeError
from ..graph import Graph
from ..tensor import Tensor

if TYPE_CHECKING:
    from .split import InputRun, SchedPlan, SplitRun

CopyCallback = Callable[[Backend, Tensor, Tensor, Graph], bool]
EvalCallback = Callable[[Tensor, bool], bool]


@dataclass
class SchedStats:
    """What the last `graph_compute` did, plus running totals."""

    n_splits: int = 0
    n_inputs_copied: int = 0  # split inputs copied by the scheduler (callback-handled ones excluded)
    n_callback_copies: int = 0  # weight uploads taken over by the copy callback
    bytes_copied: int = 0
    plan_time_s: float = 0.0  # planning (or plan reuse) time of the last graph
    plan_reused: bool = False
    n_graphs: int = 0
    n_plans: int = 0  # graphs that needed a full plan
    n_realloc_waits: int = 0  # times every backend was waited for before memory was re-planned, grown or freed

    def __str__(self) -> str:
        return (f"{self.n_splits} splits, {self.n_inputs_copied} inputs copied ({self.bytes_copied} B), "
                f"{self.n_callback_copies} by callback, plan {self.plan_time_s * 1e6:.0f} us "
                f"({'reused' if self.plan_reused else 'new'})")


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


def _error(be: Backend, g: Graph, clones: dict[int, Tensor], e: Exception) -> Exception:
    """A SchedComputeError naming the node; a GGXError (a clear error already) keeps its type
    and gets the node as a note."""
    node = getattr(e, "node", None)
    if node is None and len(g.nodes) == 1:
        node = g.nodes[0]
    if node is not None:
        node = clones.get(id(node), node)
        where = f"node {node.describe()} ({node.op.name})"
    else:
        names = [clones.get(id(n), n) for n in g.nodes if not n.op.is_view]
        where = "one of nodes " + ", ".join(n.describe() for n in names[:8]) + (" ..." if len(names) > 8 else "")
    if isinstance(e, GGXError):
        e.add_note(f"(backend {be.name}, computing {where})")
        return e
    return SchedComputeError(f"backend {be.name} failed computing {where}: {type(e).__name__}: {e}", node, be)


class Executor:
    """Runs the splits of a materialized plan over `backends`; `events[b][c]` is backend b's
    event for copy set c (None where the device has no events). Counts into `stats`."""

    def __init__(self, backends: Sequence[Backend], events: Sequence[Sequence[Event | None]], stats: SchedStats):
        self.backends = backends
        self.events = events
        self.stats = stats

    # --- waiting ------------------------------------------------------------------------------
    def synchronize(self, be: Backend, clones: dict[int, Tensor]) -> None:
        """Wait for one backend; a failure of its queued work becomes a SchedComputeError naming the node."""
        try:
            be.synchronize()
        except GGXError:
            raise
        except Exception as e:
            node = getattr(e, "node", None)
            if node is not None:
                node = clones.get(id(node), node)
            where = f" computing node {node.describe()} ({node.op.name})" if node is not None else ""
            raise SchedComputeError(f"backend {be.name} failed{where}: {type(e).__name__}: {e}", node, be) from e

    def drain(self) -> None:
        """After a failure: wait for every backend, dropping their errors, so the next graph starts clean."""
        for b in self.backends:
            try:
                b.synchronize()
            except Exception:  # noqa: BLE001 - the first error is the one being raised
                pass

    def _sync_event(self, b: int, c: int, clones: dict[int, Tensor]) -> None:
        ev = self.events[b][c]
        if ev is not None:
            ev.synchronize()
        else:
            self.synchronize(self.backends[b], clones)

    def _wait_split_backend(self, be: Backend, ev: Event | None, clones: dict[int, Tensor]) -> bool:
        """The split backend must be done with the previous use of these copies before they are overwritten."""
        if ev is not None:
            be.event_wait(ev)
        else:
            self.synchronize(be, clones)
        return True

    # --- running ------------------------------------------------------------------------------
    def run(self, plan: SchedPlan, c: int, copy_callback: CopyCallback | None,
            eval_callback: EvalCallback | None) -> None:
        """Submit every split of `plan` with copy set `c`; stops early when the eval callback asks."""
        prev = -1
        clones = plan.clones
        for run in plan.runs:
            b = run.backend_id
            if run.inputs:
                self._copy_inputs(run, c, copy_callback, clones)
            elif prev >= 0 and prev != b:
                # the allocator may have reused the previous split's memory across backends
                self._sync_event(prev, c, clones)
            g = run.graphs[c]
            if eval_callback is None:
                self._compute(run.backend, g, clones)
            elif not self._compute_observed(run.backend, g, clones, eval_callback):
                return
            ev = run.events[c]
            if ev is not None:
                run.backend.event_record(ev)
            prev = b

    @staticmethod
    def _compute(be: Backend, g: Graph, clones: dict[int, Tensor]) -> None:
        try:
            be.graph_compute(g)
        except Exception as e:
            err = _error(be, g, clones, e)
            if err is e:
                raise
            raise err from e

    def _compute_observed(self, be: Backend, g: Graph, clones: dict[int, Tensor], cb: EvalCallback) -> bool:
        """Compute one split graph in pieces, each ending at a node the eval callback wants to see;
        False when the callback asked to stop."""
        nodes = g.nodes
        j0 = 0
        while j0 < len(nodes):
            j1 = j0
            t = clones.get(id(nodes[j1]), nodes[j1])
            need = cb(t, True)
            while not need and j1 < len(nodes) - 1:
                j1 += 1
                t = clones.get(id(nodes[j1]), nodes[j1])
                need = cb(t, True)
            self._compute(be, Graph(nodes[j0:j1 + 1], []), clones)
            self.synchronize(be, clones)
            if need and not cb(t, False):
                return False
            j0 = j1 + 1
        return True

    def _copy_inputs(self, run: SplitRun, c: int, copy_callback: CopyCallback | None,
                     clones: dict[int, Tensor]) -> None:
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
        weights: list[InputRun] = []
        for inp in run.inputs:
            if inp.user:
                # user data is copied at once: the caller may overwrite it as soon as we return
                if not host_synced:
                    self._sync_event(b, c, clones)
                    host_synced = True
                _copy_sync(inp.tensor, inp.dsts[c], inp.nbytes)
                st.n_inputs_copied += 1
                st.bytes_copied += inp.nbytes
                continue
            if is_host_weight(inp.tensor):  # last: a copy callback may read the other inputs
                weights.append(inp)
                continue
            if not waited:
                waited = self._wait_split_backend(be, ev, clones)
            host_synced = self._copy_async(run, inp, c, synced, host_synced, clones)
        for inp in weights:
            if not waited:
                waited = self._wait_split_backend(be, ev, clones)
            if copy_callback is not None and copy_callback(be, inp.tensor, inp.dsts[c], run.graphs[c]):
                st.n_callback_copies += 1
                continue
            host_synced = self._copy_async(run, inp, c, synced, host_synced, clones)

    def _copy_async(self, run: SplitRun, inp: InputRun, c: int, synced: set[int], host_synced: bool,
                    clones: dict[int, Tensor]) -> bool:
        """Copy one input with the destination's async copy, else synchronously; returns host_synced."""
        dst = inp.dsts[c]
        src_be = self.backends[inp.src_backend]
        if not run.backend.cpy_tensor_async(src_be, inp.tensor, dst):
            if inp.src_backend not in synced:
                self.synchronize(src_be, clones)
                synced.add(inp.src_backend)
            if not host_synced:
                self._sync_event(run.backend_id, c, clones)
                host_synced = True
            _copy_sync(inp.tensor, dst, inp.nbytes)
        st = self.stats
        st.n_inputs_copied += 1
        st.bytes_copied += inp.nbytes
        return host_synced
