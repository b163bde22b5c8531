"""Which buffer types a model's weights may go to, for tests that must mean the same on every
machine: the host CPU's extra buffer types differ (CPU_REPACK everywhere ggx-repack is installed,
AMX before it on a CPU with AMX, AMX_EMULATED with GGX_AMX_EMULATE=1), and placement takes the
first that accepts a weight."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ggx import placement, registry
from ggx.backend import ExtraBufferType
from ggx.errors import GGXError


def host_extra_bufts() -> list[str]:
    """The names of the CPU device's extra buffer types here, best first ([] without ggx-cpu)."""
    return [b for b in host_weight_bufts() if b not in (None, "CPU")]


def host_weight_bufts() -> list[str | None]:
    """Every way this machine can hold a model's weights on the CPU: "CPU" (plain memory, ggx-cpu's
    own kernels) and each extra buffer type, best first; [None] (the default devices) without
    ggx-cpu."""
    try:
        cpu = registry.get_device("CPU")
    except GGXError:
        return [None]
    return ["CPU", *(b.name for b in registry.extra_buffer_types(cpu))]


@contextmanager
def only_weight_bufts(name: str | None) -> Iterator[None]:
    """Models loaded inside keep their weights in plain memory or in the extra buffer type `name`
    (no extra buffer type for "CPU"; nothing pinned for None): the other extra buffer types are
    left out of the weights' candidates."""
    if name is None:
        yield
        return
    every = placement.buft_list

    def pinned(devices):
        return [b for b in every(devices) if not isinstance(b, ExtraBufferType) or b.name == name]

    mp = pytest.MonkeyPatch()
    mp.setattr(placement, "buft_list", pinned)
    try:
        yield
    finally:
        mp.undo()
