"""The op dispatch table (ggml-cuda's ggml_cuda_compute_forward): per op, what it supports and
how it is launched. One module per family of ops, each with its kernels in
ggx_cuda/kernels/<family>.cu; every module registers its ops here with `register`.

A *planner* turns one node into the launches computing it:

    plan(node: Tensor, ctx: PlanContext) -> list[Launch]

pure: it reads the node's types, shapes, strides (ggml's nb, in bytes) and parameters, takes
device addresses from `ctx.ptr(tensor)` and scratch memory from `ctx.scratch(nbytes)`, and
returns `KernelLaunch` / `GemmLaunch` values (ggx_cuda.driver). A *support* predicate says
whether the planner computes a node exactly with ggml's semantics; a node it cannot (a layout
or type the kernel does not take) is declined, never computed wrongly. Both run without a GPU,
so tests check them directly.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ggx.ops import Op
from ggx.tensor import Tensor

from ..driver import DeviceInfo, Kernel, KernelLaunch, Launch


class PlanContext(Protocol):
    device: DeviceInfo

    def ptr(self, t: Tensor) -> int:
        """The device address of t's first element (its buffer's base + data offset)."""

    def scratch(self, nbytes: int) -> int:
        """Device scratch memory of `nbytes`, valid until the node's launches are done (the
        stream runs them in order; a later node may reuse it)."""


Planner = Callable[[Tensor, PlanContext], list[Launch]]
Support = Callable[[Tensor], bool]


@dataclass(frozen=True)
class OpEntry:
    supports: Support
    plan: Planner


TABLE: dict[Op, OpEntry] = {}


def register(op: Op, supports: Support, plan: Planner) -> None:
    if op in TABLE:
        raise ValueError(f"{op.name} is registered twice")
    TABLE[op] = OpEntry(supports, plan)


def load_all() -> dict[Op, OpEntry]:
    """Import every family module (each registers its ops) and return the table."""
    import importlib
    import pkgutil

    for m in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{m.name}")
    return TABLE


def supports_op(node: Tensor) -> bool:
    """ggml-cuda's supports_op: leaves and views always; other ops when their family says so."""
    if node.op is Op.NONE or node.op.is_view:
        return True
    entry = load_all().get(node.op)
    return entry is not None and bool(entry.supports(node))


def plan(node: Tensor, ctx: PlanContext) -> list[Launch]:
    return load_all()[node.op].plan(node, ctx)


# --- helpers the families share -------------------------------------------------------------
MAX_GRID_X = 2**31 - 1  # grid.x limit (y and z: 65535)


def i64(*xs: int) -> tuple[np.int64, ...]:
    """Kernel arguments of type long long (counts, sizes, byte strides)."""
    return tuple(np.int64(x) for x in xs)


def flat_launch(source: str, kernel: str, n: int, ctx: PlanContext, args: tuple, warps: int = 8) -> list[Launch]:
    """The launch of a grid-stride kernel over n items, a thread each: blocks of `warps` warps, as
    many as cover n up to the grid.x limit (the kernel's loop takes the rest); none for n == 0."""
    if n == 0:
        return []
    block = ctx.device.warp_size * warps
    grid = min(MAX_GRID_X, (n + block - 1) // block)
    return [KernelLaunch(Kernel(source, kernel), (grid, 1, 1), (block, 1, 1), args)]


def grid_1d(n: int, block: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) covering n threads with `block` per block (at least one block)."""
    return (max(1, (n + block - 1) // block), 1, 1), (block, 1, 1)
