"""Holding off Python's cycle collector while ggx makes many objects it keeps.

Building, planning and binding a batch graph makes some ten thousand objects, which sets the
collector off repeatedly; each full pass walks every object of the process (numba's and LLVM's
included), which doubled the time to get a prompt bucket ready. Nothing made there is cyclic
garbage, so the collector waits until the work is done and runs on its usual schedule after.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collection inside the block; the collector's previous state after it."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
