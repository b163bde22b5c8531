"""HostKernelDriver: the driver double (fake_driver.py) with ggx-cuda's real kernels: allocations at
real host addresses, each launch run by its kernels/*.cu source compiled for the host
(cuda_testing.host_build over host_cuda_shim.h), a cuBLAS GEMM by its numpy model. Streams,
events, copies, capture and replay are the fake's. So a whole model runs through the backend and
the very kernel code a GPU runs (compiled by g++, not NVRTC: no fused multiply-adds, no real
`mma.sync`, one thread at a time), e.g. against the reference with ggx.compare."""
from __future__ import annotations

import bisect
import weakref
from collections.abc import Sequence

import cuda_testing as ct
import numpy as np
from fake_driver import ALIGN, FILL, FakeDriver, FakeStream, _Block, _release

from ggx.errors import GGXOutOfMemory
from ggx.host import aligned_empty
from ggx.tensor import Tensor
from ggx_cuda.driver import Allocation, GemmLaunch, Launch


class _Memory:
    """cuda_testing's Memory.view over the driver's allocations (for the GEMM model)."""

    def __init__(self, drv: HostKernelDriver):
        self.drv = drv

    def view(self, addr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        extent = itemsize + sum((n - 1) * int(s) for n, s in zip(shape, strides))
        arr, off = self.drv.resolve(int(addr), extent)
        return np.ndarray(shape, dtype, buffer=arr, offset=off, strides=tuple(int(s) for s in strides))


class HostKernelDriver(FakeDriver):
    def __init__(self, **kwargs):
        kwargs.setdefault("cc", (9, 0))
        super().__init__(**kwargs)

    def alloc(self, device: int, size: int) -> Allocation:
        self._device(device)
        used = self.used(device)
        if self.oom_above is not None and used + size > self.oom_above:
            raise GGXOutOfMemory(f"CUDA{device}: cannot allocate {size} bytes")
        arr = aligned_empty(max(size, 1), ALIGN)
        arr[:] = FILL
        block = _Block(device, arr.ctypes.data, size, arr[:size])
        # the host may hand a freed block's memory out again: forget freed blocks it overlaps
        keep = [b for b in self._blocks if b.array is not None or b.base + b.size <= block.base
                or b.base >= block.base + max(size, 1)]
        self._blocks, self._bases = keep, [b.base for b in keep]
        i = bisect.bisect_right(self._bases, block.base)
        self._bases.insert(i, block.base)
        self._blocks.insert(i, block)
        a = Allocation(block.base, size, arr)
        self._finalizers[block.base] = weakref.finalize(a, _release, block)
        return a

    def run(self, stream: FakeStream, node: Tensor, launches: Sequence[Launch]) -> None:
        launches = tuple(launches)
        what = f"{node.op.name} {node.describe()}"
        for launch in launches:
            self._check_launch(stream, launch, what)
        self.launched.append((node.op.name, launches))
        info, mem = self.infos[stream.device], _Memory(self)

        def op() -> None:
            for launch in launches:
                if isinstance(launch, GemmLaunch):
                    ct.model_gemm(launch, mem)
                else:
                    ct.host_build(launch.kernel.source).run(launch, None, info)
            self.nodes_computed += 1

        self._enqueue(stream, f"run {node.op.name}", op)
