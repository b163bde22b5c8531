"""The graph allocator (ggml's ggml_gallocr): offsets for every tensor of a graph that needs memory.

One buffer per buffer type. Walking the allocation order, a tensor is placed when it is first
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
  written after the same input element was read; CPY is listed too, but as a view of its
  destination it never gets memory).

One API, in three steps, for the scheduler and for direct use:
`plan(steps, leafs)` computes offsets and sizes and touches nothing; `reserve(plan)` grows the
buffers to the plan's sizes (a worst-case plan sizes them once: later, smaller plans fit);
`place(plan)` points the tensors at their buffer and offset. A buffer that `reserve` replaces,
and every buffer at `free()`, is freed at once: whoever calls them must first synchronize every
stream that may still use those buffers (the scheduler does).
"""
from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .backend import Buffer, BufferType, BufferUsage
from .errors import GGXShapeError
from .graph import Graph
from .ops import INPLACE_OPS
from .tensor import Tensor, TensorFlag

__all__ = ["GraphAllocator", "Plan", "Record", "Step", "alloc_tensors", "graph_steps", "is_scratch", "layout_tensors"]


@dataclass(slots=True)
class Step:
    """One position of the allocation order: `tensor` is created here and reads `srcs`.

    `tensor` None is a pure dependency (it keeps `srcs` alive until this point: the scheduler
    uses it for "this input is copied at the start of the split").
    """

    tensor: Tensor | None
    srcs: tuple[Tensor, ...]


@dataclass(slots=True)
class Record:
    """Where one tensor was placed and for which steps it is alive (both inclusive)."""

    tensor: Tensor
    buft: int  # index into the allocator's buffer types
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


def layout_tensors(buft: BufferType, tensors: Sequence[Tensor], gap: int = 0, start: int = 0) -> tuple[list[int], int]:
    """(offsets, total size) of `tensors` placed back to back in one buffer of `buft`: each at an
    `alignment` boundary, taking `get_alloc_size` bytes (at least 1), with at least `gap` free bytes
    before the first, between any two and after the last (the conformance harness puts guards
    there). Nothing is allocated or touched."""
    align = max(1, buft.alignment)
    offsets: list[int] = []
    end = start + gap
    for t in tensors:
        off = (end + align - 1) // align * align
        offsets.append(off)
        end = off + max(buft.get_alloc_size(t), 1) + gap
    return offsets, end


def alloc_tensors(buft: BufferType, tensors: Sequence[Tensor], usage: BufferUsage = BufferUsage.ANY) -> Buffer:
    """One buffer of `buft` holding `tensors` back to back at aligned offsets, no reuse
    (ggml_backend_alloc_ctx_tensors_from_buft): for weights and for tensors that live across graphs."""
    offsets, size = layout_tensors(buft, tensors)
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


def _owns_memory(t: Tensor) -> bool:
    """Does the plan give `t` memory? Not a view, and no storage of its own outside a graph allocator."""
    return t.view_src is None and (t.buffer is None or t.buffer in _SCRATCH)


class _Walk:
    """One `GraphAllocator.plan` walk: an arena per buffer type, the records, and per tensor the
    consumers still to run and the live views of each root."""

    def __init__(self, bufts: Sequence[BufferType], steps: Sequence[Step], buft_of: Callable[[Tensor], int],
                 pinned: Iterable[Tensor]):
        self.bufts = bufts
        self.buft_of = buft_of
        self.arenas = [_Arena(b.alignment) for b in bufts]
        self.records: list[Record] = []
        self.rec: dict[int, Record] = {}
        self.children: dict[int, int] = {}  # consumers left, per tensor
        self.n_views: dict[int, int] = {}  # live views, per root
        self.keep: set[int] = {id(t) for t in pinned}  # roots that must never be freed
        self.view_ids: set[int] = set()  # views created by a step (they hold their root alive)
        self._count(steps)

    def _count(self, steps: Sequence[Step]) -> None:
        children, n_views = self.children, self.n_views
        for s in steps:
            for src in s.srcs:
                children[id(src)] = children.get(id(src), 0) + 1
            t = s.tensor
            if t is not None and t.view_src is not None and id(t) not in self.view_ids:
                self.view_ids.add(id(t))
                n_views[id(t.view_src)] = n_views.get(id(t.view_src), 0) + 1
                if t.flags & TensorFlag.OUTPUT:
                    self.keep.add(id(t.view_src))

    def _place(self, t: Tensor, step: int, b: int) -> None:
        size = self.bufts[b].get_alloc_size(t)
        self.rec[id(t)] = r = Record(t, b, self.arenas[b].alloc(size), size, step)
        self.records.append(r)

    def _ensure_root(self, t: Tensor, step: int) -> None:
        root = t.root
        if _owns_memory(root) and id(root) not in self.rec:
            self._place(root, step, self.buft_of(root))

    def _release_root(self, root: Tensor, step: int) -> None:
        r = self.rec.get(id(root))
        if r is None or r.last >= 0 or id(root) in self.keep or root.flags & TensorFlag.OUTPUT:
            return
        if self.children.get(id(root), 0) == 0 and self.n_views.get(id(root), 0) == 0:
            r.last = step
            self.arenas[r.buft].free(r.offset, r.size)

    def inputs(self, leafs: Iterable[Tensor]) -> None:
        """Graph inputs first: their data is set before any node runs, and never overwritten."""
        for leaf in leafs:
            if leaf.flags & TensorFlag.INPUT:
                self._ensure_root(leaf, 0)
                self.keep.add(id(leaf.root))

    def step(self, i: int, s: Step) -> None:
        for src in s.srcs:
            self._ensure_root(src, i)
        t = s.tensor
        if t is not None:
            if t.view_src is not None:
                self._ensure_root(t, i)
            elif _owns_memory(t) and id(t) not in self.rec:
                self._place_node(t, s, i)
        for src in s.srcs:
            self._consumed(src, i)
        if t is not None and id(t) in self.view_ids and self.children.get(id(t), 0) == 0 \
                and not t.flags & TensorFlag.OUTPUT:
            # a view nobody reads (e.g. a CPY into a scratch tensor): its root may go now
            self.n_views[id(t.view_src)] -= 1
            self._release_root(t.view_src, i)

    def _place_node(self, t: Tensor, s: Step, i: int) -> None:
        b = self.buft_of(t)
        parent = self._inplace_parent(t, s, b)
        if parent is None:
            self._place(t, i, b)
            return
        # the parent ends here (its last reader is this node) and the node continues in its
        # memory; releasing the parent afterwards sees last >= 0 and frees nothing
        pr = self.rec[id(parent)]
        pr.last = i
        self.rec[id(t)] = r = Record(t, b, pr.offset, pr.size, i, inplace_of=parent)
        self.records.append(r)

    def _consumed(self, src: Tensor, i: int) -> None:
        n = self.children[id(src)] = self.children[id(src)] - 1
        if n:
            return
        if id(src) in self.view_ids:
            self.n_views[id(src.view_src)] -= 1
            self._release_root(src.view_src, i)
        elif src.view_src is None:
            self._release_root(src, i)

    def _inplace_parent(self, t: Tensor, s: Step, b: int) -> Tensor | None:
        if t.op not in INPLACE_OPS:
            return None
        for p in s.srcs:
            r = self.rec.get(id(p))
            if (r is None or r.last >= 0 or r.buft != b or p.view_src is not None or id(p) in self.keep
                    or p.flags & (TensorFlag.OUTPUT | TensorFlag.INPUT)):
                continue
            if self.children.get(id(p), 0) == s.srcs.count(p) == 1 and self.n_views.get(id(p), 0) == 0 \
                    and _same_layout(p, t) and r.size >= t.nbytes:
                return p
        return None


class GraphAllocator:
    """Plans and places the intermediate tensors of graphs in one buffer per buffer type.

    `GraphAllocator(buft)` serves one buffer type; `GraphAllocator([buft_a, buft_b])` several,
    and `plan(..., buft_of=...)` then says which one each tensor goes to (an index into `bufts`,
    see `buft_index`; the default is the first).
    """

    def __init__(self, bufts: BufferType | Sequence[BufferType]):
        if isinstance(bufts, BufferType):
            bufts = [bufts]
        self.bufts: list[BufferType] = []
        for b in bufts:  # one buffer per distinct buffer type, in first-seen order
            if not any(b is x for x in self.bufts):
                self.bufts.append(b)
        if not self.bufts:
            raise GGXShapeError("GraphAllocator needs at least one buffer type")
        self.buffers: list[Buffer | None] = [None] * len(self.bufts)
        self._peak = [0] * len(self.bufts)
        self.n_grows = 0  # how many times a buffer had to be (re)allocated bigger

    @property
    def peak_bytes(self) -> dict[BufferType, int]:
        """The largest size each buffer type needed over every graph planned so far."""
        return {b: p for b, p in zip(self.bufts, self._peak)}

    def buft_index(self, buft: BufferType) -> int:
        """The index of `buft` in `bufts` (what `buft_of` returns and `Record.buft` holds)."""
        for i, b in enumerate(self.bufts):
            if b is buft:
                return i
        raise GGXShapeError(f"buffer type {buft.name} is not one of this allocator's "
                            f"({', '.join(b.name for b in self.bufts)})")

    def buffer_size(self, buft: BufferType) -> int:
        buf = self.buffers[self.buft_index(buft)]
        return 0 if buf is None else buf.size

    def plan(self, steps: Sequence[Step], leafs: Iterable[Tensor] = (),
             buft_of: Callable[[Tensor], int] | None = None, pinned: Iterable[Tensor] = ()) -> Plan:
        """Offsets for every tensor of `steps` that needs memory, touching no tensor and no buffer.
        `leafs`: the graph's leafs (its INPUT leafs are placed first); `pinned` are never freed."""
        walk = _Walk(self.bufts, steps, buft_of or (lambda t: 0), pinned)
        walk.inputs(leafs)
        for i, s in enumerate(steps):
            walk.step(i, s)
        sizes = [a.peak for a in walk.arenas]
        self._peak = [max(p, s) for p, s in zip(self._peak, sizes)]
        return Plan(walk.records, sizes)

    def fits(self, plan: Plan) -> bool:
        """Do the current buffers hold `plan` (no `reserve` needed)?"""
        for need, buf in zip(plan.sizes, self.buffers):
            if need and (buf is None or buf.size < need):
                return False
        return True

    def reserve(self, plan: Plan) -> None:
        """Grow the buffers to `plan`'s sizes. A replaced buffer is freed at once: the caller must
        first synchronize every stream that may still use it."""
        for i, need in enumerate(plan.sizes):
            old = self.buffers[i]
            if need > 0 and (old is None or old.size < need):
                buf = self.bufts[i].alloc_buffer(need)
                buf.usage = BufferUsage.COMPUTE
                _SCRATCH.add(buf)
                self.buffers[i] = buf
                self.n_grows += 1
                if old is not None:
                    old.free()

    def place(self, plan: Plan, tensors: Sequence[Tensor] | None = None) -> None:
        """Point each planned tensor at its buffer and offset; `tensors` (in record order) place
        the tensors of another graph of the same shape instead. Only tensors not already there are
        touched (`init_tensor` runs for them)."""
        records = plan.records
        if tensors is None:
            tensors = [r.tensor for r in records]
        elif len(tensors) != len(records):
            raise GGXShapeError(f"place: the plan has {len(records)} tensors, {len(tensors)} given")
        if not self.fits(plan):
            need = ", ".join(f"{b.name} {n} B" for b, n in zip(self.bufts, plan.sizes))
            raise GGXShapeError(f"place: the plan needs {need}, more than the buffers hold: reserve(plan) first")
        buffers = self.buffers
        for t, r in zip(tensors, records):
            buf = buffers[r.buft]
            if t.buffer is not buf or t.offset != r.offset:
                t.buffer = buf
                t.offset = r.offset
                buf.init_tensor(t)

    def free(self) -> None:
        """Free every buffer now; the next `reserve` allocates again. The caller must first
        synchronize every stream that may still use them."""
        for i, buf in enumerate(self.buffers):
            if buf is not None:
                buf.free()
                self.buffers[i] = None
