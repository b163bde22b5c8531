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
  layout): a split kernel (`kernels.repack_mm`, or `tiles.tile_mm`) whose prologue quantizes
  the activations once (ggx-cpu's `quantize_rows_q8` / `quantize_rows_q8_K`, the weight's
  vec_dot_type) and whose parts run a register gemv for one column, gemm tiles for more.
"""
from __future__ import annotations

import functools
import weakref

import numpy as np

from ggx.backend import Device, Launch
from ggx.errors import GGXUnsupported
from ggx.host import TransformedBuffer, tensor_array
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx.types import GType
from ggx_cpu.traits import CpuExtraBufferType, expert_offsets

from .layouts import Layout, optimal_layout, repack_into

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
        out = np.empty(self.buft.get_alloc_size(tensor), np.uint8)
        self.transform_into(tensor, data, out)
        return out

    def transform_into(self, tensor: Tensor, data: np.ndarray, out: np.ndarray) -> None:
        lay = self.buft.layout_for(tensor)
        if lay is None:
            raise GGXUnsupported(f"{NAME}: {tensor.describe()} has no repacked layout on this CPU "
                                 f"(ISA {_isa()}); keep it in the plain CPU buffer")
        tensor.extra = lay
        repack_into(lay, data, tensor.ne, out)


class RepackBufferType(CpuExtraBufferType):
    """The CPU_REPACK extra buffer type of one CPU device.

    `forced` maps weight types to layouts that win over the selection table (testing any layout
    on any CPU); by default $GGX_REPACK_LAYOUTS is read instead.
    """

    name = NAME
    buffer_class = RepackBuffer

    def __init__(self, device: Device, forced: dict[GType, Layout] | None = None):
        super().__init__(device)
        self.forced = forced
        # per weight: (type, ne, its layout)
        self._layouts: weakref.WeakKeyDictionary[Tensor, tuple] = weakref.WeakKeyDictionary()

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
    def refusal(self, op: Tensor) -> str | None:
        if self.layout_for(op.src[0]) is None:
            return f"weight {op.src[0].describe()} has no repacked layout on this CPU (ISA {_isa()})"
        return None

    def bind(self, op: Tensor, n_threads: int) -> Launch:
        a = op.src[0]
        return _launch(op, self.layout_for(a), a.data_buffer.packed_bytes(), n_threads)


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
    wg, cols = expert_offsets(op, lay.packed_nbytes((a.ne[0], a.ne[1], 1, 1)))
    return wg, cols.cstart, cols.ycol, cols.slot


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


def _launch(op: Tensor, lay: Layout, w: np.ndarray, n_threads: int) -> Launch:
    """A MUL_MAT over contiguous activations and destination binds the kernel once (its columns
    do not depend on data), and so does one token's MUL_MAT_ID (`token_experts`: its experts'
    offsets written by a compiled step at every compute); MUL_MAT_ID of more tokens (columns
    grouped by the ids' values) and strided tensors are made again at every compute (`_made`)."""
    from ggx_cpu.extension import Deferred, in_order, token_experts

    a = op.src[0]
    K, M = a.ne[0], a.ne[1]
    x, rows = _f32_rows(op.src[1], K), _f32_rows(op, M)
    if x is None or rows is None:
        return Deferred(_made, op, lay, w, n_threads)
    if op.op is Op.MUL_MAT:
        return _bind(op, lay, w, x, rows.reshape(-1), n_threads)
    one = token_experts(op, a.data_offset, lay.packed_nbytes((a.ne[0], a.ne[1], 1, 1)))
    if one is None:
        return Deferred(_made, op, lay, w, n_threads)
    columns = (one.wg, one.cstart, one.ycol, one.ocol)
    return in_order(one.fill, _bind(op, lay, w, x, rows.reshape(-1), n_threads, columns))


@functools.lru_cache(maxsize=1024)
def _mul_mat_tiles(lay: Layout, n: int, K: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """`tiles.tile_plan` of a MUL_MAT's n columns, cached as `_mul_mat_plan`."""
    from .tiles import tile_plan

    return tile_plan(np.array([0, n], np.int64), lay.name, K)


def _bind(op: Tensor, lay: Layout, w: np.ndarray, x: np.ndarray, out: np.ndarray, n_threads: int,
          columns: tuple[np.ndarray, ...] | None = None) -> Launch:
    """The product of the activations x [n, K] with the repacked weight into out, as split
    kernels (ggx-cpu's `split`; its backend plans how they run: jobs of its worker pool with
    more than one thread): `tiles.tile_mm` (register tiles) where the ISA
    variant has it for this layout and some matrix multiplies more than one column or
    repack_mm has no register gemv for the layout (Q4_K, Q6_K: a one-column tile, its sums in
    registers), else `kernels.repack_mm` (its register gemv). The
    product's prologue quantizes the activations into the launch's scratch, or for a batch worth
    sharing out a split of its own does first (`tiles.tile_quant`, `kernels.quant_rows`).
    `columns` (wg, cstart, ycol, ocol) are the node's (`_columns`) unless given."""
    import numba

    from ggx_cpu.extension import in_order, select, split, token

    from .kernels import QUANT_PARALLEL_MIN, act_scratch, has_register_gemv, quant_rows, repack_mm
    from .tiles import has_tiles, tile_plan

    K, M = op.src[0].ne[0], op.src[0].ne[1]
    wg, cstart, ycol, ocol = _columns(op, lay) if columns is None else columns
    n = max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))
    nbk = K // lay.block_size
    rows = x.shape[0]
    if has_tiles(lay.name, select(), M) and (np.max(np.diff(cstart)) > 1 or not has_register_gemv(lay)):
        if op.op is Op.MUL_MAT:
            tiles, tstart, n_ya, n_sc = _mul_mat_tiles(lay, len(ycol), K)
        else:
            tiles, tstart, n_ya, n_sc = tile_plan(cstart, lay.name, K)
        from .tiles import tile_mm, tile_quant, tile_scratch

        scratch = tile_scratch(lay, n_ya, n_sc)
        nq = 1 if rows == 1 else max(1, min(n, tiles.shape[0]))
        mm = split(tile_mm, lay, w, wg, lay.group_bytes, nbk, K, M, x, tiles, tstart, ycol, ocol, out, *scratch,
                   nq == 1, parts=n)
        return mm if nq == 1 else in_order(split(tile_quant, lay, x, ycol, tiles, nbk, *scratch, parts=nq), mm)
    scratch = act_scratch(lay, rows, K)
    nq = min(rows, 4 * n) if rows * K >= QUANT_PARALLEL_MIN and n > 1 and rows > 1 else 1
    mm = split(repack_mm, token(), lay, w, wg, lay.group_bytes, nbk, K, M, x, cstart, ycol, ocol, _lane_rows(lay),
               out, *scratch, nq == 1, parts=n)
    return mm if nq == 1 else in_order(split(quant_rows, lay, x, *scratch, parts=nq), mm)


def _made(op: Tensor, lay: Layout, w: np.ndarray, n_threads: int) -> Launch:
    """The launch of a data-dependent or strided matmul, made at every compute: strided b is
    copied to contiguous rows, a strided destination computed into a copy and written through."""
    from ggx_cpu.extension import in_order

    b = op.src[1]
    K, M = op.src[0].ne[0], op.src[0].ne[1]
    x = _f32_rows(b, K)
    if x is None:  # strided b: one copy
        x = np.ascontiguousarray(tensor_array(b), dtype=np.float32).reshape(-1, K)
    rows = _f32_rows(op, M)
    if rows is not None:
        return _bind(op, lay, w, x, rows.reshape(-1), n_threads)
    view = tensor_array(op)
    out = np.empty(view.size, np.float32)
    return in_order(_bind(op, lay, w, x, out, n_threads), functools.partial(_write_through, view, out))


def _write_through(view: np.ndarray, out: np.ndarray) -> None:
    view[...] = out.reshape(view.shape)
