"""Scratch sizing (no CUDA here): how much temporary device memory a backend keeps for planners.

ggml-cuda gives kernels temporary memory from a per-device pool (ggml_cuda_pool_leg: a few
buffers, each allocated with look-ahead headroom and reused; or a VMM pool that only grows). ggx
keeps one scratch allocation per backend instead: the planners of one node take regions of it
(`PlanContext.scratch`, bump-allocated and reset per node, since the stream runs one node's
launches before the next node's), so a graph needs the largest node's total.

The growth rule: when a request does not fit, grow to the next multiple of 1 MiB at or above the
request plus 25% headroom (so a graph whose needs creep up by a few bytes a call does not
reallocate every call). The scratch never shrinks on its own; `trim` releases excess only when no
captured CUDA graph still holds the scratch's address.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

MIB = 1 << 20
HEADROOM = 0.25
#: alignment of each region a node takes (ggml-cuda's device alignment)
ALIGNMENT = 128


def grow_size(nbytes: int, granularity: int = MIB, headroom: float = HEADROOM) -> int:
    """The size to allocate for a request of `nbytes`: nbytes plus headroom, rounded up to a
    multiple of `granularity` (0 for 0)."""
    if nbytes < 0:
        raise ValueError(f"a scratch request of {nbytes} bytes")
    want = nbytes + math.ceil(nbytes * headroom)
    return -(-want // granularity) * granularity


def node_scratch(requests: Iterable[int], alignment: int = ALIGNMENT) -> int:
    """Bytes one node's scratch requests take, bump-allocated in order at `alignment`."""
    used = 0
    for n in requests:
        used = -(-used // alignment) * alignment + n
    return used


def scratch_bytes(node_requests: Iterable[Iterable[int]], alignment: int = ALIGNMENT) -> int:
    """The scratch a backend needs for a graph: per node on that backend its planners' requests
    (`ctx.scratch(nbytes)` calls, in order); regions are reused from node to node, so the graph
    needs the largest node's total. Size a backend's ScratchPool with `need(scratch_bytes(...))`."""
    return max((node_scratch(r, alignment) for r in node_requests), default=0)


class ScratchPool:
    """One backend's scratch size. `size` is what should be allocated (0: nothing yet)."""

    def __init__(self, granularity: int = MIB, headroom: float = HEADROOM):
        self.granularity, self.headroom = granularity, headroom
        self.size = 0
        self.peak = 0  # the largest request seen
        self.grows = 0  # how many times `need` grew the size (each one a reallocation)
        self.graph_live = False  # set while a captured CUDA graph holds the scratch address

    def need(self, nbytes: int) -> bool:
        """True when `nbytes` does not fit: `size` has then grown (grow_size) and the caller must
        reallocate (dropping plans and captured graphs that hold the old address). Never shrinks."""
        if nbytes < 0:
            raise ValueError(f"a scratch request of {nbytes} bytes")
        self.peak = max(self.peak, nbytes)
        if nbytes <= self.size:
            return False
        self.size = max(self.size, grow_size(nbytes, self.granularity, self.headroom))
        self.grows += 1
        return True

    def trim(self, nbytes: int) -> bool:
        """True when the scratch was shrunk to what `nbytes` needs: only when it is more than
        twice that, and never while a captured graph is live (it holds the current address)."""
        target = grow_size(nbytes, self.granularity, self.headroom)
        if self.graph_live or self.size <= 2 * target:
            return False
        self.size, self.peak = target, nbytes
        return True
