"""Which device runs a compared model, and where its weights go: `CPU`, `CPU:CPU_REPACK`, `CUDA0`.

`DEVICE` alone keeps every weight in the device's own memory (its extra buffer types are left
out); `DEVICE:BUFT` offers the weights that extra buffer type of the device first, the device's
own memory taking what it refuses, as the model loader does. So `CPU` and `CPU:CPU_REPACK`
compare plain CPU kernels with repacked ones, whatever plugins are installed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import Backend, Buffer, BufferType, Device, Event, ExtraBufferType
from ..errors import GGXValueError
from ..ops import Op
from ..tensor import Tensor
from ..types import GType


@dataclass(frozen=True)
class BackendSpec:
    """`DEVICE[:BUFT]` as given on the command line."""

    device: str
    buft: str | None = None

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        name, _, buft = text.strip().partition(":")
        if not name or (_ and not buft):
            raise GGXValueError(f"backend {text!r}: expected DEVICE or DEVICE:BUFT, e.g. CPU or CPU:CPU_REPACK")
        return cls(name, buft or None)

    def __str__(self) -> str:
        return self.device + (f":{self.buft}" if self.buft else "")

    def resolve(self) -> Device:
        """The device, offering its weights only the chosen extra buffer type (or none)."""
        from .. import registry
        from ..conformance.runner import weight_buffer_type

        device = registry.get_device(self.device)
        extra = weight_buffer_type(device, self.buft) if self.buft else None
        return WeightsIn(device, extra)


class WeightsIn(Device):
    """`device` with its extra buffer types narrowed to `extra` (None: none). Everything else is
    the device's own: the backends it makes are the device's backends, so a model loaded on it
    runs the device's kernels; only where the loader may put weights changes."""

    def __init__(self, device: Device, extra: BufferType | None):
        self.device = device
        self.extra = extra
        self.name = device.name  # the runner finds its host device by name ("CPU", "ref")
        self.description = device.description
        self.type = device.type
        self.caps = device.caps
        # no registry: plugins offer their extra buffer types to the device itself, not to this
        # choice of them (its backends are the device's, with the device's registry)
        self.reg = None
        self.label = device.name + (f":{extra.name}" if extra is not None else "")

    def extra_buffer_types(self) -> list[ExtraBufferType]:
        return [self.extra] if isinstance(self.extra, ExtraBufferType) else []

    def memory(self) -> tuple[int, int]:
        return self.device.memory()

    def init_backend(self, **params) -> Backend:
        return self.device.init_backend(**params)

    def buffer_type(self) -> BufferType:
        return self.device.buffer_type()

    def supports_op(self, op: Tensor) -> bool:
        return self.device.supports_op(op)

    def host_buffer_type(self) -> BufferType | None:
        return self.device.host_buffer_type()

    def buffer_from_host_ptr(self, array: np.ndarray, max_tensor_size: int) -> Buffer:
        return self.device.buffer_from_host_ptr(array, max_tensor_size)

    def supports_buft(self, buft: BufferType) -> bool:
        return self.device.supports_buft(buft)

    def offload_op(self, op: Tensor) -> bool:
        return self.device.offload_op(op)

    def event_new(self) -> Event:
        return self.device.event_new()

    def max_nmse_err(self, op: Op, gtype: GType | None, default: float) -> tuple[float, str] | None:
        return self.device.max_nmse_err(op, gtype, default)
