"""The pluggy hook of ggx-ray (entry point `ray` in the group "ggx.plugins").

Importing this never starts or joins a Ray cluster: `ggx_backend_reg` builds the registration,
and its `devices()` (called when the registry loads) joins only a cluster the user named with
GGX_RAY_ADDRESS or already joined with ray.init.
"""
from __future__ import annotations

import functools

from ggx.backend import BackendReg
from ggx.hookspecs import hookimpl

#: The ggx core API version this plugin was built against (the registry refuses another).
GGX_API_VERSION = 1


@functools.cache
def backend_reg() -> BackendReg:
    """The single RayBackendReg of this process."""
    from .device import RayBackendReg

    return RayBackendReg()


@hookimpl
def ggx_backend_reg() -> BackendReg:
    return backend_reg()
