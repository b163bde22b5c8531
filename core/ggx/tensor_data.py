"""Tensor data as numpy: values to the bytes ggml stores (`to_raw`) and back (`from_raw`),
and reading/writing a placed tensor's memory through its buffer."""
from __future__ import annotations

import numpy as np

from .errors import GGXShapeError, GGXUnsupported
from .tensor import Tensor
from .types import GType

__all__ = ["from_raw", "get_tensor_data", "set_tensor_data", "to_raw"]


#: numpy dtype kinds taken as numbers: float, signed and unsigned integers
_NUMBER_KINDS = "fiu"


def _strip_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape without its leading size-1 dimensions."""
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return shape[i:]


def to_raw(t: Tensor, value: np.ndarray) -> np.ndarray:
    """Bytes for tensor `t` in ggml layout, checked against the tensor (GGXShapeError naming it).

    Numbers (float or integer arrays) must have the tensor's numpy shape, ne reversed, where
    leading size-1 dimensions may be left out or added (a (K, N) array for a [N, K, 1, 1]
    tensor), or be flat: one dimension holding the values in memory order (ne0 fastest, as
    ggml stores them). Any other shape is refused even when the element count matches (a
    transposed (N, K) array, a (K*N, 1) column). Float tensors take floats and integers (quantized types are
    quantized on the way in); index tensors (I32, I64) take integers, or floats holding
    integers, within the type's range. A uint8 array for any type but F32 is raw bytes as ggml
    stores them: flat, or shaped as the rows (numpy shape with the last dimension in bytes).
    """
    from .quants import quantize

    value = np.asarray(value)
    numpy_shape = (t.ne[3], t.ne[2], t.ne[1], t.ne[0])
    if value.dtype == np.uint8 and t.type is not GType.F32:
        rows = numpy_shape[:3] + (t.row_bytes,)
        if value.size != t.nbytes or not (value.ndim == 1 or (t.is_contiguous()
                                                             and _strip_ones(value.shape) == _strip_ones(rows))):
            raise GGXShapeError(f"{t.describe()}: uint8 arrays are raw bytes, and {value.size} bytes of numpy "
                                f"shape {value.shape} do not fit it: it holds {t.nbytes} bytes, flat or as "
                                f"rows of shape {_strip_ones(rows) or (1,)}")
        return value.reshape(-1)
    if value.dtype.kind not in _NUMBER_KINDS:
        raise GGXShapeError(f"{t.describe()}: an array of {value.dtype} is not numbers it can hold "
                            "(give floats or integers)")
    flat = value.ndim == 1 and value.size == t.nelements
    if not flat and _strip_ones(value.shape) != _strip_ones(numpy_shape):
        raise GGXShapeError(f"{t.describe()}: got an array of numpy shape {value.shape}, the tensor's numpy "
                            f"shape is {t.shape} (ne reversed; leading size-1 dimensions may be left out; or "
                            f"flat, {t.nelements} values in memory order)")
    if t.type in (GType.I32, GType.I64):
        return _index_bytes(t, value)
    if t.nelements == 0:
        return np.zeros(0, np.uint8)
    rows = value.reshape(-1, t.ne[0])
    return quantize(rows.astype(np.float32, copy=False), t.type, name=t.name or "input").reshape(-1)


#: (lowest, highest) value of each index type
_INDEX_RANGE = {GType.I32: (-(2**31), 2**31 - 1), GType.I64: (-(2**63), 2**63 - 1)}


def _index_bytes(t: Tensor, value: np.ndarray) -> np.ndarray:
    """I32/I64 bytes of integer values; floats must hold integers, every value must fit the type."""
    dtype = t.type.block_dtype
    flat = value.reshape(-1)
    if flat.dtype == dtype or flat.size == 0:  # nothing to check (a decode step's positions and ids)
        return np.ascontiguousarray(flat, dtype=dtype).view(np.uint8)
    if value.dtype.kind == "f":
        bad = ~np.isfinite(flat) | (flat != np.round(flat))
        if bad.any():
            raise GGXShapeError(f"{t.describe()}: {int(bad.sum())} values are not integers "
                                f"(first: {flat[bad][0]!r} at flat index {int(np.flatnonzero(bad)[0])})")
    lowest, highest = _INDEX_RANGE[t.type]
    lo, hi = flat.min(), flat.max()
    if lo < lowest or hi > highest:
        first = flat[(flat < lowest) | (flat > highest)][0]
        raise GGXShapeError(f"{t.describe()}: value {first!r} is outside the range of {t.type.name} "
                            f"({lowest}..{highest})")
    return np.ascontiguousarray(flat, dtype=dtype).view(np.uint8)


def from_raw(t: Tensor, raw: np.ndarray, base_offset: int) -> np.ndarray:
    """Values of `t` from the bytes of its memory starting `base_offset` bytes before its data."""
    from .quants import dequantize

    if t.type.is_quantized:
        if not t.is_contiguous():
            raise GGXUnsupported(f"{t.describe()}: reading a strided quantized tensor is not supported")
        data = raw[base_offset: base_offset + t.nbytes]
        return dequantize(data, t.type, t.nelements).reshape(t.shape)
    dt = t.type.block_dtype
    shape = (t.ne[3], t.ne[2], t.ne[1], t.ne[0])
    strides = (t.nb[3], t.nb[2], t.nb[1], t.nb[0])
    arr = np.ndarray(shape, dt, raw, base_offset, strides)
    if t.type is GType.BF16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    elif t.type is GType.F16:
        arr = arr.astype(np.float32)
    return np.array(arr).reshape(t.shape)


def _fresh_values(t: Tensor, raw: np.ndarray) -> np.ndarray:
    """from_raw for bytes nobody else holds (just read back): a plain contiguous F32/int tensor
    is returned as a view of them instead of a second copy (decode reads 200 KB of logits a step)."""
    if raw.flags.owndata and t.type in (GType.F32, GType.I32, GType.I64) and t.is_contiguous() \
            and raw.size == t.nbytes:  # owndata: a copy, not a view of the buffer's memory
        return raw.view(t.type.block_dtype).reshape(t.shape)
    return from_raw(t, raw, 0)


def set_tensor_data(t: Tensor, value: np.ndarray) -> None:
    """Write `value` (numbers or raw block bytes) into the tensor's memory."""
    t.data_buffer.set_tensor(t, to_raw(t, value), 0)


def get_tensor_data(t: Tensor) -> np.ndarray:
    """Read a tensor back as numpy: float32 for float/quantized types, int for index types."""
    first = t.data_offset
    span = t.nbytes
    root = t.root
    raw = root.data_buffer.get_tensor(root, first - root.offset, span) if t.is_view else \
        t.data_buffer.get_tensor(t, 0, span)
    return _fresh_values(t, raw)
