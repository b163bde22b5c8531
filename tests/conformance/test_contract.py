"""The contract checks on host memory, free() and extra buffer types catch devices that break them."""
from __future__ import annotations

import numpy as np
import pytest

from ggx.backend import Buffer, ExtraBufferType
from ggx.conformance.contract import (
    ContractFailure,
    check_extra_buffer_types,
    check_free,
    check_host_view,
)
from ggx.errors import GGXUnsupported
from ggx.host import HostBuffer, HostBufferType
from ggx.ops import Op
from ggx.reference import RefDevice
from ggx.types import GType


class NoViewBuffer(Buffer):
    """Host memory (its buffer type says is_host) that offers no host view: CPU kernels would
    accept its tensors and then fail on them."""

    def __init__(self, buft, size: int):
        super().__init__(buft, size)
        self._bytes = np.zeros(size, np.uint8)

    def set_tensor(self, tensor, data, offset=0) -> None:
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        start = tensor.data_offset + offset
        self._bytes[start: start + data.size] = data

    def get_tensor(self, tensor, offset=0, size=None) -> np.ndarray:
        size = tensor.nbytes - offset if size is None else size
        start = tensor.data_offset + offset
        return self._bytes[start: start + size].copy()

    def clear(self, value: int = 0) -> None:
        self._bytes[:] = value


class KeepsMemoryBuffer(HostBuffer):
    """free() that marks the buffer freed but keeps serving its bytes."""

    def free(self) -> None:
        self._freed = True


class BufferTypeOf(HostBufferType):
    def __init__(self, device, buffer_class):
        super().__init__(device, name=buffer_class.__name__)
        self.buffer_class = buffer_class

    def alloc_buffer(self, size: int) -> Buffer:
        return self.buffer_class(self, size)


class DeviceWith(RefDevice):
    def __init__(self, buffer_class=HostBuffer, extra=()):
        super().__init__()
        self._buft = BufferTypeOf(self, buffer_class)
        self.extra = list(extra)

    def extra_buffer_types(self) -> list[ExtraBufferType]:
        return self.extra


class Declining(ExtraBufferType):
    """A transforming extra buffer type (not host memory) that accepts MUL_MAT, then gives no launch."""

    name = "DECLINING"

    def __init__(self, device):
        self._device = device

    @property
    def device(self):
        return self._device

    def alloc_buffer(self, size: int):
        class WriteOnly(HostBuffer):
            def get_tensor(self, tensor, offset=0, size=None):
                raise GGXUnsupported("write-only")
        return WriteOnly(self, size)

    def supports_op(self, op) -> bool:
        return op.op is Op.MUL_MAT and op.src[0].type is GType.Q4_0

    def prepare_forward(self, op, n_threads: int = 1):
        return None


def test_the_checks_pass_on_plain_host_memory():
    dev = DeviceWith()
    assert "host_view agrees" in check_host_view(dev, dev.init_backend())
    assert "every access after free() raises" in check_free(dev, dev.init_backend())


def test_host_memory_without_a_host_view_fails():
    dev = DeviceWith(NoViewBuffer)
    with pytest.raises(ContractFailure, match="offers no host_view"):
        check_host_view(dev, dev.init_backend())


def test_a_free_that_keeps_the_memory_fails():
    dev = DeviceWith(KeepsMemoryBuffer)
    with pytest.raises(ContractFailure, match="after free.. did not raise"):
        check_free(dev, dev.init_backend())


def test_a_transforming_extra_type_without_a_launch_fails():
    dev = DeviceWith()
    dev.extra = [Declining(dev)]
    with pytest.raises(ContractFailure, match="DECLINING accepted .* no launch"):
        check_extra_buffer_types(dev, dev.init_backend())
