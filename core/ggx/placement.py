"""Weight placement (ggml's select_buft / make_cpu_buft_list): which buffer type holds each weight.

A model loader asks `buft_list(device)` for the buffer types a layer's weights may go to, in
priority order — the accelerator's own memory, its pinned host type, the extra buffer types
(AMX before repack), plain host memory — and `select_buft(weight, op, bufts)` picks the first
whose device (or extra buffer type) says yes to a representative op reading the weight from
that buffer type. So installing ggx-repack moves Q4_0 weights into the repack buffer with no
other change, and uninstalling it falls back to plain host memory. `alloc_weights` then makes
one WEIGHTS buffer per chosen buffer type.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from .alloc import alloc_tensors
from .backend import Buffer, BufferType, BufferUsage, Device, DeviceType, ExtraBufferType
from .errors import GGXUnsupported
from .graph import Context
from .tensor import Tensor

__all__ = ["alloc_weights", "buft_list", "host_device", "select_buft", "supports_weight_op"]

OpBuilder = Callable[[Context, Tensor], Tensor]


def host_device(devices: Iterable[Device] | None = None) -> Device:
    """The device whose host memory is the fallback: the first CPU-type device with host memory.

    The registry lists the built-in reference device after any installed CPU plugin, so an
    installed CPU plugin is preferred and the reference device is the fallback.
    """
    if devices is None:
        from . import registry

        devices = registry.devices()
    cpus = [d for d in devices if d.type == DeviceType.CPU and d.buffer_type().is_host]
    if not cpus:
        raise GGXUnsupported("no CPU device with host memory is available")
    return cpus[0]


def buft_list(device: Device, host: Device | None = None,
              extra: Iterable[BufferType] | None = None) -> list[BufferType]:
    """Buffer types for weights used by `device`, best first (duplicates removed).

    `host` is the CPU device providing the extra buffer types and plain host memory (default:
    `host_device()`); `extra` overrides the registry's extra buffer types of that device.
    """
    if host is None:
        host = device if device.type == DeviceType.CPU and device.buffer_type().is_host else host_device()
    if extra is None:
        from . import registry

        extra = registry.extra_buffer_types(host)
    out: list[BufferType] = []
    if device is not host:
        out.append(device.buffer_type())
        hb = device.host_buffer_type()
        if hb is not None:
            out.append(hb)
    out.extend(extra)
    out.append(host.buffer_type())
    uniq: list[BufferType] = []
    for b in out:
        if not any(b is u for u in uniq):
            uniq.append(b)
    return uniq


def supports_weight_op(buft: BufferType, weight: Tensor, op: Tensor) -> bool:
    """Would `op` (reading `weight`) run with the weight stored in `buft`? (ggml's weight_buft_supported)"""
    if weight not in op.src:
        raise GGXUnsupported(f"the representative op {op.op.name} does not read {weight.describe()}")
    try:
        probe = buft.alloc_buffer(0)  # empty: only its buffer type and usage matter to supports_op
    except Exception:  # noqa: BLE001 - a buffer type that cannot make an empty buffer is not usable here
        return False
    probe.usage = BufferUsage.WEIGHTS
    saved = weight.buffer, weight.offset
    weight.buffer, weight.offset = probe, 0
    try:
        if isinstance(buft, ExtraBufferType):
            return bool(buft.supports_op(op))
        return bool(buft.device.supports_op(op))
    finally:
        weight.buffer, weight.offset = saved


def select_buft(weight: Tensor, op: Tensor | OpBuilder, bufts: Iterable[BufferType]) -> BufferType:
    """The first buffer type of `bufts` in which `op` over `weight` is supported.

    `op` is a representative op reading the weight, or a builder `op(ctx, weight) -> Tensor`.
    Raises GGXUnsupported naming the weight when none fits.
    """
    if callable(op) and not isinstance(op, Tensor):
        op = op(Context(), weight)
    bufts = list(bufts)
    for b in bufts:
        if supports_weight_op(b, weight, op):
            return b
    names = ", ".join(b.name for b in bufts) or "none"
    raise GGXUnsupported(f"weight {weight.describe()}: no buffer type supports {op.op.name} over it "
                         f"(tried {names})")


def alloc_weights(placement: Mapping[Tensor, BufferType] | Iterable[tuple[Tensor, BufferType]]) -> list[Buffer]:
    """One WEIGHTS buffer per buffer type, holding its tensors at aligned offsets (no data set).

    Tensors are placed back to back in the order given; `init_tensor` is called for each.
    """
    items = placement.items() if isinstance(placement, Mapping) else placement
    groups: dict[int, tuple[BufferType, list[Tensor]]] = {}
    for t, buft in items:
        if t.view_src is not None:
            raise GGXUnsupported(f"weight {t.describe()} is a view; place its source instead")
        groups.setdefault(id(buft), (buft, []))[1].append(t)
    return [alloc_tensors(buft, tensors, BufferUsage.WEIGHTS) for buft, tensors in groups.values()]
