"""CPU_REPACK: the extra buffer type holding repacked weights (ggml's cpu repack buffer type).

- A weight's layout is chosen once (`layout_for`, the selection table for this CPU, kept per
  weight): `get_alloc_size` gives its bytes (Q4_K's is 2.8 % larger than ggml's),
  `init_tensor` records it in `tensor.extra`, and `set_tensor` repacks the whole tensor
  (offset 0, all of its ggml bytes, nothing else) into it.
- The layout is not ggml's, so the buffer type is not host memory (`is_host` False) and the
  buffer is write-only: `get_tensor` raises GGXUnsupported, `cpy_tensor` declines (False);
  `memset_tensor` fills raw bytes, as ggml's does, so allocators can clear and guard it.
- `supports_op`: MUL_MAT with a 2-D weight, MUL_MAT_ID with a 3-D expert weight, the weight
  (not a view of it) in this buffer type with a layout for this CPU (type in the selection
  table, rows divisible by the group), F32 activations in host memory with contiguous rows.
  Any other op is refused, which keeps it (and its weight) off this buffer type. The verdict
  is kept per op node (placement, the scheduler and prepare_forward all ask).
- `prepare_forward`: a launch for every op supports_op accepted (no CPU kernel can read the
  layout): one compiled call, `kernels.repack_mm`, which quantizes the activations once
  (ggx-cpu's `quantize_rows_q8` / `quantize_rows_q8_K`, the weight's vec_dot_type) and runs one parallel region:
  a register gemv for one column, gemm tiles for more.
"""
from __future__ import annotations

import functools
import weakref

import numpy as np

from ggx.backend import BufferType, Device, ExtraBufferType, Launch
from ggx.errors import GGXOutOfMemory, GGXUnsupported
from ggx.host import TransformedBuffer, tensor_array
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType

from .layouts import Layout, optimal_layout, repack

NAME = "CPU_REPACK"


def _isa() -> str:
    from ggx_cpu.extension import select

    return select()


class RepackBuffer(TransformedBuffer):
    """Host memory holding repacked weights; write-only (see the module docstring)."""

    transformed = "repacked"

    def init_tensor(self, tensor: Tensor) -> None:
        if tensor.view_src is None:
            tensor.extra = self.buft.layout_for(tensor)

    def transform(self, tensor: Tensor, data: np.ndarray) -> np.ndarray:
        lay = self.buft.layout_for(tensor)
        if lay is None:
            raise GGXUnsupported(f"{NAME}: {tensor.describe()} has no repacked layout on this CPU "
                                 f"(ISA {_isa()}); keep it in the plain CPU buffer")
        tensor.extra = lay
        return repack(lay, data, tensor.ne)


class RepackBufferType(ExtraBufferType):
    """The CPU_REPACK extra buffer type of one CPU device.

    `forced` maps weight types to layouts that win over the selection table (testing any layout
    on any CPU); by default $GGX_REPACK_LAYOUTS is read instead.
    """

    name = NAME

    def __init__(self, device: Device, forced: dict[GType, Layout] | None = None):
        self._device = device
        self.forced = forced
        # per weight: (type, ne, its layout); per op node: (its sources' buffer types, why_not)
        self._layouts: weakref.WeakKeyDictionary[Tensor, tuple] = weakref.WeakKeyDictionary()
        self._verdicts: weakref.WeakKeyDictionary[Tensor, tuple] = weakref.WeakKeyDictionary()

    @property
    def device(self) -> Device:
        return self._device

    @property
    def alignment(self) -> int:
        return 64

    def alloc_buffer(self, size: int) -> RepackBuffer:
        if size < 0 or size > self.max_size:
            raise GGXOutOfMemory(f"{NAME}: {size} bytes is more than max_size {self.max_size}")
        return RepackBuffer(self, size)

    def layout_for(self, t: Tensor) -> Layout | None:
        """The layout weight `t` gets here, or None (not a repackable weight on this CPU).

        Chosen once per weight and kept: the choice reads $GGX_CPU_ISA and $GGX_REPACK_LAYOUTS,
        and a weight's bytes must stay in the layout its size was computed for."""
        if t.view_src is not None or not t.type.is_quantized or t.ne[3] != 1:
            return None
        kept = self._layouts.get(t)
        if kept is not None and kept[0] is t.type and kept[1] == t.ne:
            return kept[2]
        lay = optimal_layout(t.type, t.ne[1], _isa(), self.forced)
        self._layouts[t] = (t.type, t.ne, lay)
        return lay

    def get_alloc_size(self, tensor: Tensor) -> int:
        lay = self.layout_for(tensor)
        return max(tensor.nbytes, lay.packed_nbytes(tensor.ne)) if lay is not None else tensor.nbytes

    # --- ops ------------------------------------------------------------------------------------
    def why_not(self, op: Tensor) -> str | None:
        """Why `op` cannot run on this buffer type (None: it can).

        Kept per op node with the buffer types of its sources: a node's type, shape and sources
        are fixed once built, but their storage is not (placement asks with the weight in a
        temporary buffer, before the activations have any)."""
        storage = tuple(_buft_of(s) for s in op.src)
        kept = self._verdicts.get(op)
        if kept is not None and kept[0] == storage:
            return kept[1]
        why = self._why_not(op)
        self._verdicts[op] = (storage, why)
        return why

    def _why_not(self, op: Tensor) -> str | None:
        from ggx_cpu.extension import matmul_problem

        why = matmul_problem(op, self)
        if why is None and self.layout_for(op.src[0]) is None:
            return f"weight {op.src[0].describe()} has no repacked layout on this CPU (ISA {_isa()})"
        return why

    def supports_op(self, op: Tensor) -> bool:
        return self.why_not(op) is None

    def prepare_forward(self, op: Tensor, n_threads: int = 1) -> Launch:
        """The launch of an op supports_op accepted; GGXUnsupported naming why for any other."""
        why = self.why_not(op)
        if why is not None:
            raise GGXUnsupported(f"{NAME}: cannot compute {op.describe()}: {why}")
        if op.nelements == 0:
            return _nothing
        a = op.src[0]
        return _launch(op, self.layout_for(a), a.data_buffer.packed_bytes(), n_threads)


def _buft_of(t: Tensor | None) -> BufferType | None:
    buf = t.data_buffer if t is not None else None
    return buf.buft if buf is not None else None


# --- compute ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _mul_mat_plan(off: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(wg, cstart, cols) of a MUL_MAT with its weight at byte `off` and n columns: a pure
    function of its key, cached because every decode step asks again (kernels never write them)."""
    cols = np.arange(n, dtype=np.int64)
    return np.array([off], np.int64), np.array([0, n], np.int64), cols


def _columns(op: Tensor, lay: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(wg, cstart, ycol, ocol) of `kernels.repack_mm` for a MUL_MAT or MUL_MAT_ID node."""
    a, b = op.src[0], op.src[1]
    off = a.data_offset
    if op.op is Op.MUL_MAT:  # one matrix for every column of b (b's dims 2/3 broadcast over it)
        wg, cstart, cols = _mul_mat_plan(off, b.ne[1] * b.ne[2] * b.ne[3])
        return wg, cstart, cols, cols
    from ggx_cpu.extension import expert_columns

    ids = op.src[2]
    experts = np.ascontiguousarray(tensor_array(ids)).reshape(ids.ne[1], ids.ne[0])
    cols = expert_columns(experts, a.ne[2], b.ne[1])
    per_expert = lay.packed_nbytes((a.ne[0], a.ne[1], 1, 1))
    return (off + cols.used * per_expert).astype(np.int64), cols.cstart, cols.ycol, cols.slot


def _f32_rows(t: Tensor, k: int) -> np.ndarray | None:
    """A contiguous F32 tensor's values as a [rows, k] view of its host memory (numpy refuses a
    view past the buffer's end), or None when t is strided or not in host memory."""
    buf = t.data_buffer
    ne, nb = t.ne, t.nb  # contiguity spelled out for F32: Tensor.is_contiguous is slower
    if (buf is None or not buf.buft.is_host or nb[0] != 4 or nb[1] != 4 * ne[0] or nb[2] != nb[1] * ne[1]
            or nb[3] != nb[2] * ne[2]):
        return None
    return np.ndarray((ne[1] * ne[2] * ne[3], k), np.float32, buf.host_view(), t.data_offset)


@functools.cache
def _lane_rows(lay: Layout) -> np.ndarray:
    from .kernels import lane_rows

    return lane_rows(lay)


def _nothing() -> None:
    """The launch of an empty matmul."""


def _launch(op: Tensor, lay: Layout, w: np.ndarray, n_threads: int) -> Launch:
    """A MUL_MAT over contiguous activations and destination binds the kernel once (its columns
    do not depend on data); MUL_MAT_ID (columns grouped by the ids' values) and strided
    tensors go through `_run` every time."""
    if op.op is not Op.MUL_MAT:
        return functools.partial(_run, op, lay, w, n_threads)
    K, M = op.src[0].ne[0], op.src[0].ne[1]
    x, rows = _f32_rows(op.src[1], K), _f32_rows(op, M)
    if x is None or rows is None:
        return functools.partial(_run, op, lay, w, n_threads)
    return _bind(op, lay, w, x, rows.reshape(-1), n_threads)


@functools.lru_cache(maxsize=1024)
def _mul_mat_tiles(lay: Layout, n: int, K: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """`tiles.tile_plan` of a MUL_MAT's n columns, cached as `_mul_mat_plan`."""
    from .tiles import tile_plan

    return tile_plan(np.array([0, n], np.int64), lay.name, K)


def _bind(op: Tensor, lay: Layout, w: np.ndarray, x: np.ndarray, out: np.ndarray, n_threads: int) -> Launch:
    """One compiled call that quantizes the activations x [n, K], then runs a parallel kernel over
    (matrix, row group) into out: `tiles.tile_mm` (register tiles) where the ISA variant has it
    for this layout and some matrix multiplies more than one column (or repack_mm has no kernel
    for the layout), else `kernels.repack_mm` (its register gemv), or for one activation row on
    more than one thread its chunks as a job of ggx-cpu's worker threads (`repack_mm_part`)."""
    import numba

    from ggx_cpu.extension import launch, parallel_launch, select, token, workers_enabled

    from .kernels import act_scratch, repack_mm, repack_mm_part, runs_in_repack_mm
    from .tiles import has_tiles, tile_plan

    K, M = op.src[0].ne[0], op.src[0].ne[1]
    wg, cstart, ycol, ocol = _columns(op, lay)
    n = max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))
    nbk = K // lay.block_size
    if has_tiles(lay.name, select(), M) and (np.max(np.diff(cstart)) > 1 or not runs_in_repack_mm(lay)):
        if op.op is Op.MUL_MAT:
            tiles, tstart, n_ya, n_sc = _mul_mat_tiles(lay, len(ycol), K)
        else:
            tiles, tstart, n_ya, n_sc = tile_plan(cstart, lay.name, K)
        from .tiles import tile_mm, tile_mm_part, tile_scratch

        if n > 1 and x.shape[0] == 1 and workers_enabled():  # one token, as below
            return parallel_launch(tile_mm_part, lay, w, wg, lay.group_bytes, nbk, K, M, x, tiles, tstart, ycol, ocol,
                                   out, *tile_scratch(lay, n_ya, n_sc), parts=n)
        return launch(tile_mm, lay, w, wg, lay.group_bytes, nbk, K, M, x, tiles, tstart, n_ya, n_sc,
                      ycol, ocol, out, n, n_threads=n)
    if n > 1 and x.shape[0] == 1 and workers_enabled():
        # one token: a parallel region each would cost more than ggx-cpu's worker threads
        # (docs/perf-notes.md, "Worker threads and fused launches")
        return parallel_launch(repack_mm_part, token(), lay, w, wg, lay.group_bytes, nbk, K, M, x, cstart, ycol,
                               ocol, _lane_rows(lay), out, *act_scratch(lay, 1, K), parts=n)
    return launch(repack_mm, token(), lay, w, wg, lay.group_bytes, nbk, K, M,
                  x, cstart, ycol, ocol, _lane_rows(lay), out, n, n_threads=n)


def _run(op: Tensor, lay: Layout, w: np.ndarray, n_threads: int) -> None:
    """The launch of a data-dependent or strided matmul, made and run now: strided b is copied
    to contiguous rows, a strided destination computed into a copy and written through."""
    b = op.src[1]
    K, M = op.src[0].ne[0], op.src[0].ne[1]
    x = _f32_rows(b, K)
    if x is None:  # strided b: one copy
        x = np.ascontiguousarray(tensor_array(b), dtype=np.float32).reshape(-1, K)
    rows = _f32_rows(op, M)
    if rows is not None:
        _bind(op, lay, w, x, rows.reshape(-1), n_threads)()
        return
    view = tensor_array(op)
    out = np.empty(view.size, np.float32)
    _bind(op, lay, w, x, out, n_threads)()
    view[...] = out.reshape(view.shape)
