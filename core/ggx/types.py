"""GType: the tensor element types of ggx, bit-exact with ggml/GGUF block layouts."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from .errors import GGXShapeError


@dataclass(frozen=True)
class TypeTraits:
    block_size: int  # values per block
    type_size: int  # bytes per block
    block_dtype: np.dtype  # numpy (structured) dtype of one block
    ggml_id: int  # the ggml_type / GGUF type id
    vec_dot: str | None  # name of the type the activations are converted to in mul_mat


_f16 = "<f2"
_TRAITS: dict[str, TypeTraits] = {
    "F32": TypeTraits(1, 4, np.dtype("<f4"), 0, "F32"),
    "F16": TypeTraits(1, 2, np.dtype("<f2"), 1, "F16"),
    "BF16": TypeTraits(1, 2, np.dtype("<u2"), 30, "BF16"),
    "I32": TypeTraits(1, 4, np.dtype("<i4"), 26, None),
    "I64": TypeTraits(1, 8, np.dtype("<i8"), 27, None),
    "Q4_0": TypeTraits(32, 18, np.dtype([("d", _f16), ("qs", "u1", 16)]), 2, "Q8_0"),
    "Q4_1": TypeTraits(32, 20, np.dtype([("d", _f16), ("m", _f16), ("qs", "u1", 16)]), 3, "Q8_1"),
    # ggml's block_q5_0 declares qh as uint8_t[4] and reads it with memcpy: a little-endian uint32
    "Q5_0": TypeTraits(32, 22, np.dtype([("d", _f16), ("qh", "<u4"), ("qs", "u1", 16)]), 6, "Q8_0"),
    "Q8_0": TypeTraits(32, 34, np.dtype([("d", _f16), ("qs", "i1", 32)]), 8, "Q8_0"),
    "Q8_1": TypeTraits(32, 36, np.dtype([("d", _f16), ("s", _f16), ("qs", "i1", 32)]), 9, "Q8_1"),
    "Q4_K": TypeTraits(
        256, 144,
        np.dtype([("d", _f16), ("dmin", _f16), ("scales", "u1", 12), ("qs", "u1", 128)]), 12, "Q8_K"),
    "Q5_K": TypeTraits(
        256, 176,
        np.dtype([("d", _f16), ("dmin", _f16), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)]),
        13, "Q8_K"),
    "Q6_K": TypeTraits(
        256, 210,
        np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", _f16)]), 14, "Q8_K"),
    "Q8_K": TypeTraits(
        256, 292, np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)]), 15, "Q8_K"),
}


class GType(enum.Enum):
    """A tensor element type. Quantized types store blocks of `block_size` values."""

    F32 = "F32"
    F16 = "F16"
    BF16 = "BF16"
    I32 = "I32"
    I64 = "I64"
    Q4_0 = "Q4_0"
    Q4_1 = "Q4_1"
    Q5_0 = "Q5_0"
    Q8_0 = "Q8_0"
    Q8_1 = "Q8_1"
    Q4_K = "Q4_K"
    Q5_K = "Q5_K"
    Q6_K = "Q6_K"
    Q8_K = "Q8_K"

    @property
    def traits(self) -> TypeTraits:
        return _TRAITS[self.value]

    @property
    def block_size(self) -> int:
        return _TRAITS[self.value].block_size

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return _TRAITS[self.value].type_size

    @property
    def block_dtype(self) -> np.dtype:
        return _TRAITS[self.value].block_dtype

    @property
    def ggml_id(self) -> int:
        return _TRAITS[self.value].ggml_id

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1

    @property
    def is_float(self) -> bool:
        return self in (GType.F32, GType.F16, GType.BF16)

    @property
    def vec_dot_type(self) -> GType | None:
        name = _TRAITS[self.value].vec_dot
        return GType(name) if name else None

    def row_size(self, n: int, what: str = "row") -> int:
        """Bytes of `n` consecutive values; `n` must be a whole number of blocks."""
        if n % self.block_size:
            raise GGXShapeError(
                f"{what}: {n} values of {self.name} is not a multiple of its block size {self.block_size}")
        return n // self.block_size * self.type_size

    @classmethod
    def from_ggml_id(cls, ggml_id: int) -> GType:
        for t in cls:
            if t.ggml_id == ggml_id:
                return t
        raise KeyError(ggml_id)

    @classmethod
    def parse(cls, name: str | GType) -> GType:
        """Accept a GType or a case-insensitive name ('q4_0', 'F32')."""
        if isinstance(name, GType):
            return name
        for t in cls:
            if t.name.lower() == str(name).lower():
                return t
        raise ValueError(f"unknown type {name!r}; known: {', '.join(t.name for t in cls)}")

    def __repr__(self) -> str:
        return f"GType.{self.name}"
