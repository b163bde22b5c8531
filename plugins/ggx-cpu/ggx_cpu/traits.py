"""What every extra buffer type of the CPU device shares (ggml's ggml-cpu/traits.h,
`ggml::cpu::extra_buffer_type`): `CpuExtraBufferType`, the base ggx-repack's CPU_REPACK and
ggx-amx's AMX derive from, and the helpers of their MUL_MAT_ID.

The base holds the skeleton: the device it belongs to (the CPU device decides support by
`buft.device is self`), the alignment, the size check of `alloc_buffer`, the verdict of
`why_not` kept per op node (placement, the scheduler and `prepare_forward` all ask), and the
start of `prepare_forward` (refuse what `why_not` refused, nothing to run for an empty node).
A subclass keeps what is its own: its layout (`buffer_class`, `get_alloc_size`), its refusals
(`refusal`) and its binding (`bind`).

Numba-free: a plugin imports this when its buffer type is made, during device discovery.
"""
from __future__ import annotations

import weakref
from abc import abstractmethod

import numpy as np

from ggx.backend import Buffer, BufferType, Device, ExtraBufferType, Launch
from ggx.errors import GGXOutOfMemory, GGXUnsupported
from ggx.host import tensor_array
from ggx.tensor import Tensor

from .kernels.extra_matmul import ExpertColumns, expert_columns, matmul_problem


def buft_of(t: Tensor | None) -> BufferType | None:
    """The buffer type `t`'s data lives in (a view's: its source's), or None."""
    buf = t.data_buffer if t is not None else None
    return buf.buft if buf is not None else None


def nothing() -> None:
    """The launch of an empty node."""


def expert_offsets(op: Tensor, per_expert_nbytes: int) -> tuple[np.ndarray, ExpertColumns]:
    """A MUL_MAT_ID's ids read now (checked: GGXShapeError naming a bad id) and grouped by expert:
    (byte offset of each used expert's matrix in the weight's buffer, the `ExpertColumns`), where
    each expert's matrix takes `per_expert_nbytes` in the buffer type's layout."""
    a, b, ids = op.src[0], op.src[1], op.src[2]
    experts = np.ascontiguousarray(tensor_array(ids)).reshape(ids.ne[1], ids.ne[0])
    cols = expert_columns(experts, a.ne[2], b.ne[1])
    return (a.data_offset + cols.used * per_expert_nbytes).astype(np.int64), cols


class CpuExtraBufferType(ExtraBufferType):
    """An extra buffer type of one CPU device computing MUL_MAT / MUL_MAT_ID from weights in a
    layout of its own (see the module docstring). Subclasses set `name` and `buffer_class` and
    implement `refusal` and `bind`."""

    #: The buffer class its `alloc_buffer` makes: `buffer_class(buft, size)`.
    buffer_class: type[Buffer]

    def __init__(self, device: Device):
        self._device = device
        # per op node: (its sources' buffer types, why_not)
        self._verdicts: weakref.WeakKeyDictionary[Tensor, tuple] = weakref.WeakKeyDictionary()

    @property
    def device(self) -> Device:
        return self._device

    @property
    def alignment(self) -> int:
        return 64

    def alloc_buffer(self, size: int) -> Buffer:
        if size < 0 or size > self.max_size:
            raise GGXOutOfMemory(f"{self.name}: {size} bytes is more than max_size {self.max_size}")
        return self.buffer_class(self, size)

    def why_not(self, op: Tensor) -> str | None:
        """Why `op` cannot run on this buffer type (None: it can): not a matmul this type's kernel
        can read from host memory (`matmul_problem`), or the subclass's `refusal`.

        Kept per op node with the buffer types of its sources: a node's type, shape and sources
        are fixed once built, but their storage is not (placement asks with the weight in a
        temporary buffer, before the activations have any)."""
        storage = tuple(buft_of(s) for s in op.src)
        kept = self._verdicts.get(op)
        if kept is not None and kept[0] == storage:
            return kept[1]
        why = matmul_problem(op, self) or self.refusal(op)
        self._verdicts[op] = (storage, why)
        return why

    @abstractmethod
    def refusal(self, op: Tensor) -> str | None:
        """Why this type refuses `op`, a MUL_MAT / MUL_MAT_ID over host memory whose weight is in
        it (its types, shapes and layouts), or None."""

    def supports_op(self, op: Tensor) -> bool:
        return self.why_not(op) is None

    def prepare_forward(self, op: Tensor, n_threads: int = 1) -> Launch:
        """The launch of an op supports_op accepted; GGXUnsupported naming why for any other."""
        why = self.why_not(op)
        if why is not None:
            raise GGXUnsupported(f"{self.name}: cannot compute {op.describe()}: {why}")
        if op.nelements == 0:
            return nothing
        return self.bind(op, n_threads)

    @abstractmethod
    def bind(self, op: Tensor, n_threads: int) -> Launch:
        """The launch computing `op` (accepted, not empty) on `n_threads` threads."""
