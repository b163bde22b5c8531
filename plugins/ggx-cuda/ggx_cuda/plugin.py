"""The pluggy hook of ggx-cuda (entry point `cuda` in the group "ggx.plugins").

Importing this touches no driver: `ggx_backend_reg` builds the registration, and its
`devices()` (called when the registry loads) asks the driver which GPUs are usable; with none it
lists no device and says why (`ggx devices`).
"""
from __future__ import annotations

import functools

from ggx.backend import BackendReg
from ggx.hookspecs import hookimpl

#: The ggx core API version this plugin was built against (the registry refuses another).
GGX_API_VERSION = 1


@functools.cache
def backend_reg() -> BackendReg:
    """The single CudaBackendReg of this process (on the CuPy driver)."""
    from .device import CudaBackendReg

    return CudaBackendReg()


@hookimpl
def ggx_backend_reg() -> BackendReg:
    return backend_reg()
