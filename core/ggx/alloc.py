"""The graph allocator (ggml's ggml_gallocr): offsets for every tensor of a graph that needs memory.

One buffer per buffer type. Walking the nodes in order, a tensor is placed when it is first
needed and its memory is given back after its last consumer ran, so later tensors reuse it.
Rules (see docs/architecture.md, "Allocation and scheduling"):

- views (VIEW/RESHAPE/PERMUTE/TRANSPOSE, and CPY/SET_ROWS which write into their destination)
  never get memory of their own; their root stays alive while any view of it is alive;
- tensors that already have storage (weights, a KV cache, leafs set by the user) are never
  touched;
- OUTPUT tensors are never freed, INPUT leafs are placed before any node runs and are never
  overwritten in place (so a graph can be run again without setting its inputs again);
- an op in `INPLACE_OPS` whose source has the same layout and dies at this node takes the
  source's memory (ADD, MUL, SCALE, SILU, GELU, DUP, CONT: elementwise, each output element is
  written after the same input element was read).

`reserve(graph)` sizes the buffers for a worst-case graph; later graphs of the same or smaller
size allocate without growing them. `peak_bytes` reports the measured peak per buffer type.
"""
from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .backend import Buffer, BufferType, BufferUsage
from .errors import GGXShapeError
from .graph import Graph
from .ops import INPLACE_OPS
from .tensor import Tensor, TensorFlag

__all__ = ["GraphAllocator", "Plan", "Record", "Step", "graph_steps", "is_scratch"]


@dataclass(slots=True)
class Step:
    """One position of the allocation order: `tensor` is created here and reads `srcs`.

    `tensor` None is a pure dependency (it keeps `srcs` alive until this point: the scheduler
    uses it for "this input is copied at the start of the split").
    """

    tensor: Tensor | None
    srcs: tuple[Tensor, ...]
    buft: int = 0  # index into the allocator's buffer types


@dataclass(slots=True)
class Record:
    """Where one tensor was placed and for which steps it is alive (both inclusive)."""

    tensor: Tensor
    buft: int
    offset: int
    size: int
    first: int
    last: int = -1  # -1: never freed (outputs, pinned, unused)
    inplace_of: Tensor | None = None


@dataclass
class Plan:
    """The result of planning one graph: a record per allocated tensor and the size per buffer type."""

    records: list[Record] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)

    def apply(self, buffers: Sequence[Buffer]) -> None:
        """Point every planned tensor at its buffer and offset."""
        for r in self.records:
            t = r.tensor
            buf = buffers[r.buft]
            t.buffer = buf
            t.offset = r.offset
            buf.init_tensor(t)


class _Arena:
    """Offsets inside one growing region: best-fit over free blocks, merged when they touch."""

    def __init__(self, alignment: int):
        self.alignment = alignment
        self.starts: list[int] = []  # free blocks, sorted by start
        self.sizes: list[int] = []
        self.top = 0  # end of the used region
        self.peak = 0

    def alloc(self, size: int) -> int:
        a = self.alignment
        size = max((size + a - 1) // a * a, a)
        best = -1
        for i, s in enumerate(self.sizes):
            if s >= size and (best < 0 or s < self.sizes[best]):
                best = i
        if best >= 0:
            off = self.starts[best]
            if self.sizes[best] == size:
                del self.starts[best], self.sizes[best]
            else:
                self.starts[best] += size
                self.sizes[best] -= size
            return off
        if self.starts and self.starts[-1] + self.sizes[-1] == self.top:
            off = self.starts.pop()  # grow the last free block instead of leaving a hole
            self.sizes.pop()
        else:
            off = self.top
        self.top = off + size
        self.peak = max(self.peak, self.top)
        return off

    def free(self, off: int, size: int) -> None:
        a = self.alignment
        size = max((size + a - 1) // a * a, a)
        i = bisect.bisect_left(self.starts, off)
        self.starts.insert(i, off)
        self.sizes.insert(i, size)
        if i + 1 < len(self.starts) and off + self.sizes[i] == self.starts[i + 1]:
            self.sizes[i] += self.sizes.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == off:
            self.sizes[i - 1] += self.sizes.pop(i)
            self.starts.pop(i)
            i -= 1
        if self.starts[i] + self.sizes[i] == self.top:  # the end of the region is free again
            self.top = self.starts.pop(i)
            self.sizes.pop(i)


# Every buffer any GraphAllocator made: tensors found there are scratch from an earlier plan (of
# this or another allocator), never "preallocated" storage to keep.
_SCRATCH: weakref.WeakSet[Buffer] = weakref.WeakSet()


def alloc_tensors(buft: BufferType, tensors: Sequence[Tensor], usage: BufferUsage = BufferUsage.ANY) -> Buffer:
    """One buffer of `buft` holding `tensors` back to back at aligned offsets, no reuse
    (ggml_backend_alloc_ctx_tensors_from_buft): for weights and for tensors that live across graphs."""
    align = buft.alignment
    offsets, size = [], 0
    for t in tensors:
        size = (size + align - 1) // align * align
        offsets.append(size)
        size += max(buft.get_alloc_size(t), 1)
    buf = buft.alloc_buffer(size)
    buf.usage = usage
    for t, off in zip(tensors, offsets):
        t.buffer, t.offset = buf, off
        buf.init_tensor(t)
    return buf


def is_scratch(buffer: Buffer | None) -> bool:
    """Is `buffer` a compute buffer made by a graph allocator (so its tensors may be re-placed)?"""
    return buffer is not None and buffer in _SCRATCH


def graph_steps(graph: Graph) -> list[Step]:
    """The allocation order of a plain graph: its nodes, each reading its sources."""
    return [Step(t, t.src) for t in graph.nodes]


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.type is b.type and a.ne == b.ne and a.nb == b.nb


class GraphAllocator:
    """Plans and places the intermediate tensors of graphs in one buffer per buffer type.

    `GraphAllocator(buft)` serves one buffer type; `GraphAllocator([buft_a, buft_b])` several,
    and `alloc_graph(graph, buft_of=...)` then says which one each tensor goes to (a
    BufferType or its index; the default is the first).
    """

    def __init__(self, bufts: BufferType | Sequence[BufferType] | Mapping[object, BufferType]):
        if isinstance(bufts, BufferType):
            bufts = [bufts]
        elif isinstance(bufts, Mapping):
            bufts = list(bufts.values())
        self.bufts: list[BufferType] = []
        for b in bufts:  # one buffer per distinct buffer type, in first-seen order
            if not any(b is x for x in self.bufts):
                self.bufts.append(b)
        if not self.bufts:
            raise GGXShapeError("GraphAllocator needs at least one buffer type")
        self.buffers: list[Buffer | None] = [None] * len(self.bufts)
        self._peak = [0] * len(self.bufts)
        self.n_grows = 0  # how many times a buffer had to be (re)allocated bigger
        self.last_plan: Plan | None = None

    # --- public API -------------------------------------------------------------------------
    @property
    def peak_bytes(self) -> dict[BufferType, int]:
        """The largest size each buffer type needed over every graph planned so far."""
        return {b: p for b, p in zip(self.bufts, self._peak)}

    @staticmethod
    def owns(buffer: Buffer | None) -> bool:
        """Is `buffer` scratch made by a graph allocator? Its tensors are re-planned, not kept."""
        return is_scratch(buffer)

    def buffer_size(self, buft: BufferType | int = 0) -> int:
        buf = self.buffers[self._index(buft)]
        return 0 if buf is None else buf.size

    def reserve(self, graph: Graph, buft_of: Callable[[Tensor], BufferType | int] | None = None) -> Plan:
        """Size the buffers for `graph` (a worst case) without placing its tensors."""
        return self.reserve_steps(graph_steps(graph), graph.leafs, self._resolver(buft_of))

    def alloc_graph(self, graph: Graph, buft_of: Callable[[Tensor], BufferType | int] | None = None) -> Plan:
        """Plan `graph`, grow buffers if it needs more than reserved, and place its tensors."""
        return self.alloc_steps(graph_steps(graph), graph.leafs, self._resolver(buft_of))

    # --- the step-level API the scheduler uses ------------------------------------------------
    def reserve_steps(self, steps: Sequence[Step], leafs: Iterable[Tensor] = (),
                      buft_of: Callable[[Tensor], int] | None = None, pinned: Iterable[Tensor] = ()) -> Plan:
        plan = self.plan(steps, leafs, buft_of, pinned)
        self._ensure(plan.sizes)
        return plan

    def alloc_steps(self, steps: Sequence[Step], leafs: Iterable[Tensor] = (),
                    buft_of: Callable[[Tensor], int] | None = None, pinned: Iterable[Tensor] = ()) -> Plan:
        plan = self.reserve_steps(steps, leafs, buft_of, pinned)
        plan.apply(self.buffers)
        return plan

    def ensure_sizes(self, sizes: Sequence[int]) -> None:
        """Make the buffers at least `sizes` bytes (used when a plan is reused)."""
        self._ensure(sizes)

    def plan(self, steps: Sequence[Step], leafs: Iterable[Tensor] = (),
             buft_of: Callable[[Tensor], int] | None = None, pinned: Iterable[Tensor] = ()) -> Plan:
        """Compute offsets without touching any tensor. `pinned` tensors are never freed."""
        buft_of = buft_of or (lambda t: 0)
        arenas = [_Arena(b.alignment) for b in self.bufts]
        pinned_ids = {id(t) for t in pinned}
        plan = Plan(sizes=[0] * len(self.bufts))
        rec: dict[int, Record] = {}
        children: dict[int, int] = {}  # consumers left, per tensor
        n_views: dict[int, int] = {}  # live views, per root
        keep: set[int] = set(pinned_ids)  # roots that must never be freed
        view_ids: set[int] = set()  # views created by a step (they hold their root alive)

        def own(t: Tensor) -> bool:
            return t.view_src is None and (t.buffer is None or t.buffer in _SCRATCH)

        for s in steps:
            for src in s.srcs:
                children[id(src)] = children.get(id(src), 0) + 1
            t = s.tensor
            if t is not None and t.view_src is not None and id(t) not in view_ids:
                view_ids.add(id(t))
                n_views[id(t.view_src)] = n_views.get(id(t.view_src), 0) + 1
                if t.flags & TensorFlag.OUTPUT:
                    keep.add(id(t.view_src))

        def place(t: Tensor, step: int, b: int) -> None:
            size = self.bufts[b].get_alloc_size(t)
            rec[id(t)] = r = Record(t, b, arenas[b].alloc(size), size, step)
            plan.records.append(r)

        def ensure_root(t: Tensor, step: int) -> None:
            root = t.root
            if own(root) and id(root) not in rec:
                place(root, step, buft_of(root))

        def release_root(root: Tensor, step: int) -> None:
            r = rec.get(id(root))
            if r is None or r.last >= 0 or id(root) in keep or root.flags & TensorFlag.OUTPUT:
                return
            if children.get(id(root), 0) == 0 and n_views.get(id(root), 0) == 0:
                r.last = step
                arenas[r.buft].free(r.offset, r.size)

        # graph inputs first: their data is set before any node runs
        for leaf in leafs:
            if leaf.flags & TensorFlag.INPUT:
                ensure_root(leaf, 0)
                keep.add(id(leaf.root))

        for i, s in enumerate(steps):
            for src in s.srcs:
                ensure_root(src, i)
            t = s.tensor
            if t is not None:
                if t.view_src is not None:
                    ensure_root(t, i)
                elif own(t) and id(t) not in rec:
                    b = buft_of(t)
                    parent = self._inplace_parent(t, s, b, rec, children, n_views, keep)
                    if parent is not None:
                        # the parent ends here (its last reader is this node) and the node
                        # continues in its memory; release_root below sees last >= 0 and frees nothing
                        pr = rec[id(parent)]
                        pr.last = i
                        rec[id(t)] = r = Record(t, b, pr.offset, pr.size, i, inplace_of=parent)
                        plan.records.append(r)
                    else:
                        place(t, i, b)
            for src in s.srcs:
                n = children[id(src)] = children[id(src)] - 1
                if n == 0:
                    if id(src) in view_ids:
                        n_views[id(src.view_src)] -= 1
                        release_root(src.view_src, i)
                    elif src.view_src is None:
                        release_root(src, i)
            if t is not None and id(t) in view_ids and children.get(id(t), 0) == 0 \
                    and not t.flags & TensorFlag.OUTPUT:
                # a view nobody reads (e.g. a CPY into a scratch tensor): its root may go now
                n_views[id(t.view_src)] -= 1
                release_root(t.view_src, i)

        for b, a in enumerate(arenas):
            plan.sizes[b] = a.peak
            self._peak[b] = max(self._peak[b], a.peak)
        self.last_plan = plan
        return plan

    # --- internals ----------------------------------------------------------------------------
    @staticmethod
    def _inplace_parent(t: Tensor, s: Step, b: int, rec: dict[int, Record], children: dict[int, int],
                        n_views: dict[int, int], keep: set[int]) -> Tensor | None:
        if t.op not in INPLACE_OPS:
            return None
        for p in s.srcs:
            r = rec.get(id(p))
            if (r is None or r.last >= 0 or r.buft != b or p.view_src is not None or id(p) in keep
                    or p.flags & (TensorFlag.OUTPUT | TensorFlag.INPUT)):
                continue
            if children.get(id(p), 0) == s.srcs.count(p) == 1 and n_views.get(id(p), 0) == 0 \
                    and _same_layout(p, t) and r.size >= t.nbytes:
                return p
        return None

    def _index(self, buft: BufferType | int) -> int:
        if isinstance(buft, int):
            return buft
        for i, b in enumerate(self.bufts):
            if b is buft:
                return i
        raise GGXShapeError(f"buffer type {buft.name} is not one of this allocator's "
                            f"({', '.join(b.name for b in self.bufts)})")

    def _resolver(self, buft_of) -> Callable[[Tensor], int] | None:
        if buft_of is None:
            return None
        return lambda t: self._index(buft_of(t))

    def _ensure(self, sizes: Sequence[int]) -> None:
        for i, need in enumerate(sizes):
            buf = self.buffers[i]
            if need > 0 and (buf is None or buf.size < need):
                self.buffers[i] = buf = self.bufts[i].alloc_buffer(need)
                buf.usage = BufferUsage.COMPUTE
                _SCRATCH.add(buf)
                self.n_grows += 1

