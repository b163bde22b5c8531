"""Scratch sizing (ggx_cuda.pool)."""
from __future__ import annotations

import pytest

from ggx_cuda.pool import MIB, ScratchPool, grow_size, node_scratch, scratch_bytes


@pytest.mark.parametrize("nbytes, size", [(0, 0), (1, MIB), (MIB * 4 // 5, MIB), (MIB * 4 // 5 + 1, 2 * MIB),
                                          (MIB, 2 * MIB), (8 * MIB, 10 * MIB), (10 * MIB, 13 * MIB)])
def test_grow_size(nbytes, size):
    assert grow_size(nbytes) == size
    assert size % MIB == 0 and size >= nbytes * 1.25


def test_need_grows_with_headroom_and_never_shrinks():
    p = ScratchPool()
    assert p.size == 0 and not p.need(0)
    assert p.need(1000) and p.size == MIB and p.grows == 1
    assert not p.need(MIB)  # fits
    assert not p.need(10)  # smaller: never shrinks
    assert p.size == MIB
    assert p.need(MIB + 1) and p.size == 2 * MIB and p.grows == 2
    assert p.peak == MIB + 1
    with pytest.raises(ValueError):
        p.need(-1)


def test_need_creeping_requests_rarely_reallocate():
    p = ScratchPool()
    grows = sum(p.need(n) for n in range(MIB, 4 * MIB, 4096))  # 768 requests, each larger
    assert grows == 3 and p.size == 4 * MIB


def test_trim_only_without_a_live_graph():
    p = ScratchPool()
    p.need(40 * MIB)
    assert p.size == 50 * MIB
    p.graph_live = True
    assert not p.trim(MIB) and p.size == 50 * MIB
    p.graph_live = False
    assert not p.trim(30 * MIB) and p.size == 50 * MIB  # not more than twice what is needed
    assert p.trim(MIB) and p.size == 2 * MIB


def test_custom_granularity():
    p = ScratchPool(granularity=4096, headroom=0.0)
    assert p.need(5000) and p.size == 8192


def test_node_and_graph_scratch():
    assert node_scratch([]) == 0
    assert node_scratch([100]) == 100
    assert node_scratch([100, 10]) == 138  # the second region starts at 128
    assert node_scratch([128, 1, 1], alignment=128) == 257
    assert scratch_bytes([]) == 0
    assert scratch_bytes([[100, 10], [], [200], [64, 64]]) == 200
    assert scratch_bytes([[100, 10], [1, 1, 1]]) == 257
