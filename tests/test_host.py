"""ggx.host: host memory as aligned numpy arrays, small ones numpy's, large ones maps of their own."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from ggx.host import MAPPED_MIN, aligned_empty


def _map_of(a: np.ndarray):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


@pytest.mark.parametrize("size, alignment", [(1, 64), (1000, 64), (MAPPED_MIN - 64, 64), (MAPPED_MIN, 64),
                                             (3 * MAPPED_MIN + 5, 4096)])
def test_aligned_empty(size, alignment):
    a = aligned_empty(size, alignment)
    assert a.dtype == np.uint8 and a.size == size and a.ctypes.data % alignment == 0
    assert a.flags.writeable and a.flags.c_contiguous
    a[:] = 7  # every byte is writable memory
    assert int(a[-1]) == 7
    assert isinstance(_map_of(a), mmap.mmap) == (size + alignment >= MAPPED_MIN and hasattr(mmap, "MAP_ANONYMOUS"))
