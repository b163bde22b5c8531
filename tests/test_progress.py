"""ggx.progress: compilation is counted and timed, and the listener hears each begin and end."""
from __future__ import annotations

import time

import pytest

from ggx import progress


class Recorder:
    def __init__(self):
        self.events = []

    def begin(self, what):
        self.events.append(("begin", what))

    def end(self, what, seconds):
        self.events.append(("end", what, seconds))


def test_compiling_is_counted_timed_and_heard():
    rec = Recorder()
    previous = progress.set_listener(rec)
    n0, s0 = progress.compiles(), progress.compile_seconds()
    try:
        with progress.compiling("CPU kernels for avx2"):
            time.sleep(0.05)
        with pytest.raises(RuntimeError), progress.compiling("CPU kernels for avx2"):
            raise RuntimeError("the compiler failed")  # still counted, still heard, and re-raised
    finally:
        assert progress.set_listener(previous) is rec
    assert progress.compiles() == n0 + 2
    assert progress.compile_seconds() - s0 >= 0.05
    assert [e[:2] for e in rec.events] == [("begin", "CPU kernels for avx2"), ("end", "CPU kernels for avx2")] * 2
    assert rec.events[1][2] >= 0.05


def test_without_a_listener_nothing_is_told():
    previous = progress.set_listener(None)
    try:
        n0 = progress.compiles()
        with progress.compiling("kernels"):
            pass
        assert progress.compiles() == n0 + 1
    finally:
        progress.set_listener(previous)
