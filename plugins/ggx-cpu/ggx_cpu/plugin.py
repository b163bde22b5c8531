"""The pluggy hooks of ggx-cpu (entry point `cpu` in the group "ggx.plugins").

Registering is all that happens here: no numba import, no compilation.
"""
from __future__ import annotations

import functools

from ggx.backend import BackendReg
from ggx.hookspecs import hookimpl

#: The ggx core API version this plugin was built against (the registry refuses another).
GGX_API_VERSION = 1


@functools.cache
def backend_reg() -> BackendReg:
    """The single CpuBackendReg of this process."""
    from .device import CpuBackendReg

    return CpuBackendReg()


@hookimpl
def ggx_backend_reg() -> BackendReg:
    return backend_reg()
