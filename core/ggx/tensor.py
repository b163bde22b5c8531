"""Tensor: ggml's tensor descriptor (type, ne, nb, op, params, sources, flags, storage)."""
from __future__ import annotations

import enum
import math
from typing import Any

from .errors import GGXShapeError
from .ops import Op
from .types import GType

MAX_DIMS = 4


class TensorFlag(enum.IntFlag):
    NONE = 0
    INPUT = 1  # data set from outside before compute (copied first by the scheduler)
    OUTPUT = 2  # read after compute: never freed or reused by the allocator
    PARAM = 4  # a weight


def contiguous_strides(gtype: GType, ne: tuple[int, ...]) -> tuple[int, int, int, int]:
    """Byte strides of a contiguous tensor (ggml_new_tensor's nb)."""
    nb0 = gtype.type_size
    nb1 = nb0 * (ne[0] // gtype.block_size)
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


def pad_ne(ne: tuple[int, ...] | list[int] | int, what: str = "tensor") -> tuple[int, int, int, int]:
    if isinstance(ne, int):
        ne = (ne,)
    ne = tuple(int(x) for x in ne)
    if not 1 <= len(ne) <= MAX_DIMS:
        raise GGXShapeError(f"{what}: {len(ne)} dims given, ggx tensors have 1 to {MAX_DIMS}")
    if any(x < 0 for x in ne):
        raise GGXShapeError(f"{what}: negative size in ne={ne}")
    return ne + (1,) * (MAX_DIMS - len(ne))  # type: ignore[return-value]


class Tensor:
    """One tensor of a graph. `ne[0]` is the contiguous (row) dimension; `nb` are byte strides.

    A leaf has op NONE. A view (VIEW/RESHAPE/PERMUTE/TRANSPOSE, and the results of CPY and
    SET_ROWS, which write into their destination) has `view_src`, the root tensor owning the
    memory, and `view_offs`, its byte offset there. Storage is `buffer` + `offset`, set by an
    allocator; a view's storage is its root's.
    """

    __slots__ = ("type", "ne", "nb", "op", "params", "src", "flags", "name", "ndim",
                 "buffer", "offset", "view_src", "view_offs", "extra", "__weakref__")

    def __init__(self, gtype: GType, ne: tuple[int, ...], nb: tuple[int, ...] | None = None, *,
                 op: Op = Op.NONE, params: Any = None, src: tuple[Tensor, ...] = (), name: str = "",
                 view_src: Tensor | None = None, view_offs: int = 0, ndim: int | None = None):
        self.type = gtype
        self.ne = pad_ne(ne, name or "tensor")
        if gtype.is_quantized and self.ne[0] % gtype.block_size:
            raise GGXShapeError(
                f"tensor {name or '?'}: row of {self.ne[0]} values is not a multiple of the "
                f"{gtype.name} block size {gtype.block_size}")
        self.nb = tuple(nb) if nb is not None else contiguous_strides(gtype, self.ne)
        self.op = op
        self.params = params
        self.src = tuple(src)
        self.flags = TensorFlag.NONE
        self.name = name
        # never fewer dims than ne spans: `shape` trims to ndim and must keep every element
        self.ndim = max(ndim if ndim is not None else 1, n_dims(self.ne))
        self.buffer = None
        self.offset = 0
        if view_src is not None and view_src.view_src is not None:
            view_offs += view_src.view_offs
            view_src = view_src.view_src
        self.view_src = view_src
        self.view_offs = view_offs
        self.extra = None  # backend-private data (e.g. a repacked layout's description)

    # --- sizes --------------------------------------------------------------------------
    @property
    def nelements(self) -> int:
        return math.prod(self.ne)

    @property
    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def row_bytes(self) -> int:
        return self.ne[0] // self.type.block_size * self.type.type_size

    @property
    def nbytes(self) -> int:
        """Bytes spanned in memory (ggml_nbytes): covers strided views too."""
        if any(x == 0 for x in self.ne):
            return 0
        bs = self.type.block_size
        if bs == 1:
            n = self.type.type_size
            for i in range(MAX_DIMS):
                n += (self.ne[i] - 1) * self.nb[i]
            return n
        n = self.ne[0] * self.nb[0] // bs
        for i in range(1, MAX_DIMS):
            n += (self.ne[i] - 1) * self.nb[i]
        return n

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order: ne reversed, trimmed to `ndim` dimensions."""
        return tuple(reversed(self.ne[: self.ndim]))

    # --- layout predicates (ggml's) -------------------------------------------------------
    def is_contiguous(self) -> bool:
        next_nb = self.type.type_size
        if self.ne[0] != self.type.block_size and self.nb[0] != next_nb:
            return False
        next_nb *= self.ne[0] // self.type.block_size
        for i in range(1, MAX_DIMS):
            if self.ne[i] != 1:
                if self.nb[i] != next_nb:
                    return False
                next_nb *= self.ne[i]
        return True

    def has_contiguous_rows(self) -> bool:
        return self.ne[0] == self.type.block_size or self.nb[0] == self.type.type_size

    def is_transposed(self) -> bool:
        return self.nb[0] > self.nb[1]

    def is_permuted(self) -> bool:
        return not (self.nb[0] <= self.nb[1] <= self.nb[2] <= self.nb[3])

    @property
    def is_view(self) -> bool:
        return self.view_src is not None

    @property
    def is_leaf(self) -> bool:
        return self.op is Op.NONE

    # --- storage --------------------------------------------------------------------------
    @property
    def root(self) -> Tensor:
        """The tensor that owns this tensor's memory (itself unless a view)."""
        return self.view_src if self.view_src is not None else self

    @property
    def data_buffer(self):
        return self.root.buffer

    @property
    def data_offset(self) -> int:
        """Byte offset of element (0,0,0,0) inside `data_buffer`."""
        return self.root.offset + self.view_offs if self.view_src is not None else self.offset

    @property
    def has_storage(self) -> bool:
        return self.root.buffer is not None

    def set_flag(self, flag: TensorFlag) -> Tensor:
        self.flags |= flag
        return self

    def describe(self) -> str:
        """Short text for error messages: name, type and ne."""
        label = f"'{self.name}'" if self.name else f"<{self.op.name.lower()}>"
        return f"{label} {self.type.name}{list(self.ne)}"

    def __repr__(self) -> str:
        return f"Tensor({self.describe()}, op={self.op.name})"


def n_dims(ne: tuple[int, ...]) -> int:
    """ggml_n_dims: index of the last dimension larger than 1, plus one."""
    for i in range(MAX_DIMS - 1, 0, -1):
        if ne[i] > 1:
            return i + 1
    return 1
