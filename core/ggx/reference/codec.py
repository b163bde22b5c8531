"""Value <-> memory conversion for the reference backend: decode any ggx type to float64, encode back.

Layouts (see `ggx.host.tensor_array`): a tensor's memory is viewed as a numpy array of shape
(ne3, ne2, ne1, ne0 / block_size) whose elements are values (F32, F16, I32, I64), raw BF16 bits
(uint16) or quantized blocks (structured dtype). Decoded values have numpy shape (ne3, ne2, ne1, ne0).

Quantizing and rounding (F16, BF16, Q4_0, ...) go through `ggx.quants`, so the bytes are ggml's.
"""
from __future__ import annotations

import functools

import numpy as np

from ..errors import GGXUnsupported
from ..host import tensor_array
from ..quants import dequantize as _dequantize
from ..quants import quantize as _quantize
from ..tensor import Tensor
from ..types import GType

# Types held as plain numbers in memory: no codec needed.
_PLAIN = (GType.F32, GType.I32, GType.I64)
INDEX_TYPES = (GType.I32, GType.I64)


@functools.cache
def can_decode(gtype: GType) -> bool:
    """Can values of this type be read (dequantized)?"""
    if gtype in _PLAIN or gtype in (GType.F16, GType.BF16):
        return True
    try:
        _dequantize(np.zeros(gtype.type_size, np.uint8), gtype, gtype.block_size)
    except Exception:  # the quants module does not know this type
        return False
    return True


@functools.cache
def can_encode(gtype: GType) -> bool:
    """Can float values be written (rounded / quantized) in this type?"""
    if gtype in _PLAIN:
        return True
    try:
        _quantize(np.zeros((1, gtype.block_size), np.float32), gtype)
    except Exception:  # the quants module does not know this type
        return False
    return True


def decode_blocks(arr: np.ndarray, gtype: GType) -> np.ndarray:
    """Values of a memory view `arr` (last axis: elements or blocks) as float64, int64 for index types."""
    if gtype in INDEX_TYPES:
        return arr.astype(np.int64)
    if gtype in (GType.F32, GType.F16):
        return arr.astype(np.float64)
    if gtype is GType.BF16:  # bf16 bits are the top half of an f32
        return (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if not can_decode(gtype):
        raise GGXUnsupported(f"ref: cannot dequantize {gtype.name}")
    shape = arr.shape[:-1] + (arr.shape[-1] * gtype.block_size,)
    raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    n = int(np.prod(shape))
    return np.asarray(_dequantize(raw, gtype, n), dtype=np.float64).reshape(shape)


def decode(t: Tensor) -> np.ndarray:
    """The values of a host tensor, numpy shape (ne3, ne2, ne1, ne0), honouring its strides."""
    return decode_blocks(tensor_array(t), t.type)


def encode(values: np.ndarray, gtype: GType) -> np.ndarray:
    """Values (numpy shape (..., ne0)) in the memory form of `gtype` (shape (..., ne0 / block_size))."""
    values = np.asarray(values)
    if gtype in _PLAIN:
        return values.astype(gtype.block_dtype)
    if not can_encode(gtype):
        raise GGXUnsupported(f"ref: cannot convert values to {gtype.name}")
    ne0 = values.shape[-1]
    rows = values.reshape(-1, ne0).astype(np.float32)
    raw = np.asarray(_quantize(rows, gtype))
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    return raw.view(gtype.block_dtype).reshape(values.shape[:-1] + (ne0 // gtype.block_size,))


def store(t: Tensor, values: np.ndarray) -> None:
    """Write `values` (numpy shape (ne3, ne2, ne1, ne0)) into tensor t's memory, converting to t.type."""
    tensor_array(t)[...] = encode(np.reshape(values, (t.ne[3], t.ne[2], t.ne[1], t.ne[0])), t.type)
