"""`ggx.host.TransformedBuffer`, the write-only host memory of a transforming extra buffer type
(repack, AMX): whole tensors only, stored as `transform` gives them, never read back."""
from __future__ import annotations

import numpy as np
import pytest

from ggx.errors import GGXError, GGXShapeError, GGXUnsupported
from ggx.graph import Context
from ggx.host import HostBufferType, TransformedBuffer
from ggx.types import GType


class Reversed(TransformedBuffer):
    """Stores each weight's bytes in reverse order."""

    transformed = "reversed"

    def transform(self, tensor, data):
        if tensor.type is not GType.F32:
            raise GGXUnsupported(f"{self.buft.name}: only F32 here")
        return data[::-1].copy()


@pytest.fixture
def weight():
    t = Context().tensor(GType.F32, (4, 2), "w")
    buf = Reversed(HostBufferType(None, name="REV"), 64)
    t.buffer, t.offset = buf, 8
    return t, buf


def test_set_tensor_stores_the_transform_at_the_tensor(weight):
    t, buf = weight
    data = np.arange(32, dtype=np.uint8)
    buf.set_tensor(t, data)
    assert np.array_equal(buf.packed_bytes()[8:40], data[::-1])


def test_only_whole_tensors_and_never_read_back(weight):
    t, buf = weight
    with pytest.raises(GGXUnsupported, match="set whole"):
        buf.set_tensor(t, np.zeros(16, np.uint8))
    with pytest.raises(GGXUnsupported, match="set whole"):
        buf.set_tensor(t, np.zeros(32, np.uint8), offset=4)
    with pytest.raises(GGXUnsupported, match="write-only: .* was reversed"):
        buf.get_tensor(t)
    assert buf.cpy_tensor(t, t) is False


def test_a_refused_weight_and_one_past_the_end(weight):
    t, buf = weight
    q = Context().tensor(GType.Q8_0, (32, 1), "q")
    q.buffer, q.offset = buf, 0
    with pytest.raises(GGXUnsupported, match="only F32"):
        buf.set_tensor(q, np.zeros(q.nbytes, np.uint8))
    t.offset = 40
    with pytest.raises(GGXShapeError, match="needs bytes 40..72 of a 64-byte buffer"):
        buf.set_tensor(t, np.zeros(32, np.uint8))


def test_memset_fills_raw_bytes_within_the_buffer_and_free_releases(weight):
    t, buf = weight
    buf.clear(0)
    buf.memset_tensor(t, 7, 4, 8)
    assert np.flatnonzero(buf.packed_bytes()).tolist() == list(range(12, 20))
    with pytest.raises(GGXShapeError, match="outside"):
        buf.memset_tensor(t, 0, 0, 100)
    buf.clear(3)
    assert (buf.packed_bytes() == 3).all()
    buf.free()
    with pytest.raises(GGXError, match="freed"):
        buf.packed_bytes()
