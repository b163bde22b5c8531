"""Input values for tensors: shapes (not sizes) are checked, dtypes and index ranges too, raw bytes
keep working, zero-size tensors compute; every refusal is a GGXShapeError naming the tensor."""
import re

import numpy as np
import pytest

from ggx.eager import compute
from ggx.errors import GGXShapeError
from ggx.graph import Context
from ggx.tensor_data import from_raw, to_raw

DEVICES = ["ref", "CPU"]


def test_the_numpy_shape_is_ne_reversed_leading_ones_optional():
    t = Context().tensor("F32", (3, 2), name="w")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for ok in (x, x[None], x[None, None], x.astype(np.float64), x.astype(np.int64), x.reshape(-1)):
        np.testing.assert_array_equal(from_raw(t, to_raw(t, ok), 0), x)
    row = Context().tensor("F32", (4, 1, 1), name="row")
    for ok in (np.ones(4), np.ones((1, 4)), np.ones((1, 1, 1, 4))):
        assert to_raw(row, ok).size == 16


@pytest.mark.parametrize("bad", [np.zeros((3, 2)), np.zeros((6, 1)), np.zeros((2, 3, 1)), np.zeros((1, 6)),
                                 np.zeros((2, 2)), np.zeros(5)])
def test_same_size_other_shape_is_refused_naming_both_shapes(bad):
    t = Context().tensor("F32", (3, 2), name="w")
    want = f"'w' F32[3, 2, 1, 1]: got an array of numpy shape {bad.shape}, the tensor's numpy shape is (2, 3)"
    with pytest.raises(GGXShapeError, match=re.escape(want)):
        to_raw(t, bad)


@pytest.mark.parametrize("bad, what", [
    (np.zeros((2, 3), np.complex64), "complex64"), (np.array([["a"] * 3] * 2), "<U1"),
    (np.zeros((2, 3), object), "object"), (np.zeros((2, 3), bool), "bool"),
])
def test_arrays_that_are_not_numbers_are_refused(bad, what):
    with pytest.raises(GGXShapeError, match=f"'w'.*{what}"):
        to_raw(Context().tensor("F32", (3, 2), name="w"), bad)


@pytest.mark.parametrize("gtype", ["I32", "I64"])
def test_index_values_must_be_integers_in_range(gtype):
    t = Context().tensor(gtype, (3,), name="ids")
    assert to_raw(t, np.array([1.0, 2.0, 3.0])).view(t.type.block_dtype).tolist() == [1, 2, 3]
    for bad in (np.array([1.0, np.nan, 2.0]), np.array([1.5, 2.0, 3.0]), np.array([np.inf, 0, 0])):
        with pytest.raises(GGXShapeError, match="'ids'.*not integers"):
            to_raw(t, bad)
    big = np.array([0, 1, 2**40 if gtype == "I32" else 2**64 - 1], dtype=np.uint64)
    with pytest.raises(GGXShapeError, match="'ids'.*outside the range"):
        to_raw(t, big)


def test_raw_bytes_flat_or_as_rows():
    t = Context().tensor("F16", (4, 2), name="m")
    x = np.arange(8, dtype=np.float16).reshape(2, 4)
    for raw in (x.view(np.uint8), x.view(np.uint8).reshape(-1)):
        np.testing.assert_array_equal(from_raw(t, to_raw(t, raw), 0), x)
    q = Context().tensor("Q8_0", (64, 2), name="q")
    assert to_raw(q, np.zeros(q.nbytes, np.uint8)).size == q.nbytes
    with pytest.raises(GGXShapeError, match="'m'.*raw bytes"):
        to_raw(t, x.view(np.uint8).reshape(4, 4))  # 16 bytes, but not the tensor's rows
    with pytest.raises(GGXShapeError, match="'ids'.*raw bytes"):
        to_raw(Context().tensor("I32", (3,), name="ids"), np.array([1, 2, 3], np.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_a_transposed_input_is_refused_before_anything_runs(device):
    ctx = Context()
    a, b = ctx.tensor("F32", (3, 2), name="a"), ctx.tensor("F32", (3, 2), name="b")
    out = ctx.add(a, b)
    good = np.ones((2, 3), np.float32)
    with pytest.raises(GGXShapeError, match="'b'.*\\(3, 2\\).*\\(2, 3\\)"):
        compute(out, {a: good, b: np.ones((3, 2))}, device=device)
    assert a.buffer is None  # nothing was placed: every input is checked first
    np.testing.assert_array_equal(compute(out, {a: good, b: good}, device=device)[0], 2 * good)


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_and_foreign_tensors_as_inputs(device):
    ctx, other = Context(), Context()
    a = ctx.tensor("F32", (4,), name="a")
    b = other.tensor("F32", (4,), name="b")  # another Context's tensor: fine, as in ggml
    out = ctx.mul(a, b)
    with pytest.raises(GGXShapeError, match="computed by this graph"):
        compute(out, {a: np.ones(4), b: np.ones(4), out: np.ones(4)}, device=device)
    np.testing.assert_array_equal(compute(out, {a: np.full(4, 2.0), b: np.full(4, 3.0)}, device=device)[0],
                                  np.full(4, 6.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ne", [(8, 0), (0, 4)])
def test_zero_size_tensors_compute_nothing(device, ne):
    """ggml allows a 0 in ne: the op computes nothing, the result has no elements."""
    ctx = Context()
    a = ctx.tensor("F32", ne, name="a")
    shape = tuple(reversed(ne))
    outs = compute([ctx.scale(a, 2.0), ctx.rms_norm(a, 1e-5), ctx.soft_max(a)], {a: np.zeros(shape)}, device=device)
    assert [o.shape for o in outs] == [shape] * 3
    with pytest.raises(GGXShapeError, match="'a'"):
        compute(ctx.scale(a, 2.0), {a: np.zeros(shape[::-1] if ne[1] else (5,))}, device=device)
