"""Notices of slow one-off work (kernel compilation), for whoever shows progress: the `ggx` command.

A plugin wraps work that happens once per machine (compiling a kernel; loading it from a disk
cache on later runs) in `compiling(what)`. The seconds spent there accumulate in
`compile_seconds()`, so speed figures can leave them out, and the listener the application set
hears when each piece begins and ends: `ggx` sets one that prints "compiling CPU kernels for
avx512_vnni, first run only" when compilation goes on for a while. A library user sets none and
sees nothing.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

__all__ = ["CompileListener", "compile_seconds", "compiles", "compiling", "set_listener"]


class CompileListener(Protocol):
    def begin(self, what: str) -> None:
        """A compilation starts; `what` says what is compiled, e.g. "CPU kernels for avx2"."""

    def end(self, what: str, seconds: float) -> None:
        """The compilation begun last with `what` ended after `seconds`."""


_lock = threading.Lock()
_listener: CompileListener | None = None
_seconds = 0.0
_count = 0


def set_listener(listener: CompileListener | None) -> CompileListener | None:
    """Make `listener` hear every compilation from now on (None: nobody); returns the previous one."""
    global _listener
    with _lock:
        previous, _listener = _listener, listener
    return previous


def compile_seconds() -> float:
    """Seconds spent inside `compiling` so far in this process (summed over threads)."""
    return _seconds


def compiles() -> int:
    """How many `compiling` blocks have ended so far in this process."""
    return _count


@contextmanager
def compiling(what: str) -> Iterator[None]:
    """Wrap one compilation: its time is counted and the listener told (it must not raise)."""
    global _seconds, _count
    listener = _listener
    if listener is not None:
        listener.begin(what)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        with _lock:
            _seconds += dt
            _count += 1
        if listener is not None:
            listener.end(what, dt)
