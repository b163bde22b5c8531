"""ggx_cpu.pool: a split kernel's job (ggx_cpu.launch: `split(...)` planned onto the workers):
its parts each run exactly once, after its prologue and before its epilogue, whether workers
help or not, from several Python threads, and in a forked child; the arguments it holds are
released with it. The same split as a parallel region runs each part once too."""
from __future__ import annotations

import gc
import multiprocessing
import sys
import threading
import time

import numpy as np
import pytest
from numba import njit

from ggx.errors import GGXValueError
from ggx_cpu import atomics, pool
from ggx_cpu.extension import split
from ggx_cpu.launch import JobLaunch


def parallel_launch(kernel, *args, parts: int):
    """The split kernel as a job of the worker pool (what the backend plans for one token)."""
    return split(kernel, *args, parts=parts).planned(parts)


@njit
def _count(part, parts, a, seen, step):
    """The prologue sets seen[0] to `step`; part p adds it to its share of `a`; the epilogue
    records in seen[1] whether every value was reached (a part run twice, or before the
    prologue, or after the epilogue, leaves another value)."""
    if part < 0:
        seen[0] = step
    elif part == parts:
        seen[1] = (a == a[0]).all()
    else:
        n = a.size
        for i in range(part * n // parts, (part + 1) * n // parts):
            a[i] += seen[0]


def _launch(parts: int, n: int = 1000):
    a, seen = np.zeros(n, np.int64), np.zeros(2, np.int64)
    return a, seen, parallel_launch(_count, a, seen, 7, parts=parts)


def _check(a, seen, times=1):
    assert seen.tolist() == [7, 1]
    np.testing.assert_array_equal(a, np.full(a.size, 7 * times))


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_every_part_runs_once(parts):
    for _ in range(200):  # many launches, so a worker races the caller for parts many times
        a, seen, run = _launch(parts)
        run()
        _check(a, seen)


def test_short_jobs_among_more_workers():
    """Jobs of 2 parts while 7 workers run, each job released right after its launch: a worker
    that wakes late must not run (or read) a finished job, whatever its memory now holds."""
    a, seen, run = _launch(8)
    run()
    _check(a, seen)
    for k in range(2000):
        a, seen, run = _launch(2 + k % 3, n=64)
        run()
        _check(a, seen)
        del run


def test_a_launch_runs_again():
    a, seen, run = _launch(2)
    for k in range(1, 50):
        run()
        _check(a, seen, k)


@njit
def _meet(part, parts, a):
    """Part 1 sets a[0]; part 0 waits for it (a bounded spin) and writes in a[1] whether it came:
    whether part 1 ran on another thread at the same time."""
    if part == 1:
        atomics.store_release(a, 0, 1)
    elif part == 0:
        for _ in range(200_000_000):
            if atomics.load_acquire(a, 0) == 1:
                a[1] = 1
                return


def test_a_worker_runs_a_part_alongside_the_caller():
    a = np.zeros(2, np.int64)
    parallel_launch(_meet, a, parts=2)()
    assert a.tolist() == [1, 1]


def test_idle_workers_sleep_and_a_job_wakes_them():
    a = np.zeros(2, np.int64)
    run = parallel_launch(_meet, a, parts=2)
    run()
    ctrl = pool.pool().ctrl
    for _ in range(100):  # they spin, yield, then sleep on the futex
        if ctrl[pool.SLEEPING] == len(pool.pool().threads):
            break
        time.sleep(0.05)
    assert ctrl[pool.SLEEPING] == len(pool.pool().threads) >= 1
    a[:] = 0
    run()
    assert a.tolist() == [1, 1]


def test_workers_off(monkeypatch):
    monkeypatch.setenv("GGX_CPU_WORKERS", "0")
    a, seen, run = _launch(4)
    run()
    _check(a, seen)


def test_callers_on_several_threads():
    errors = []

    def caller():
        try:
            for _ in range(100):
                a, seen, run = _launch(2)
                run()
                _check(a, seen)
        except AssertionError as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors


def _child(q):
    a, seen, run = _launch(2)
    run()
    q.put((a.tolist(), seen.tolist()))


def test_forked_child():
    _, _, run = _launch(2)
    run()  # the parent's workers are running
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    a, seen = q.get(timeout=120)
    p.join(timeout=30)
    assert p.exitcode == 0
    _check(np.array(a), np.array(seen))


def test_the_job_holds_its_arrays_until_released():
    a, seen, run = _launch(2)
    held = sys.getrefcount(a)
    del run
    gc.collect()
    assert sys.getrefcount(a) < held


@pytest.mark.parametrize("parts", [3, 8, 33])
def test_more_parts_than_threads_each_run_once(parts):
    """Parts are claimed from one counter by whoever runs: a job of many parts on two threads."""
    for _ in range(200):
        a, seen = np.zeros(1000, np.int64), np.zeros(2, np.int64)
        split(_count, a, seen, 7, parts=parts).planned(2)()
        _check(a, seen)


def test_parts_out_of_range():
    with pytest.raises(GGXValueError, match="at least 1 part"):
        split(_count, np.zeros(1, np.int64), np.zeros(2, np.int64), 7, parts=0)
    with pytest.raises(GGXValueError, match="parts"):
        JobLaunch(_count, (np.zeros(1, np.int64), np.zeros(2, np.int64), 7), pool.MAX_PARTS + 1)
    a, seen = np.zeros(100, np.int64), np.zeros(2, np.int64)
    split(_count, a, seen, 7, parts=pool.MAX_PARTS + 1).planned(2)()  # more parts than slots: a region
    _check(a, seen)


@pytest.mark.parametrize("parts", [1, 2, 5])
def test_the_same_split_as_a_parallel_region(parts):
    """Planned for a batch (or called outside a backend), a split kernel runs its parts in one
    numba parallel region: prologue, each part once, epilogue."""
    for workers in (0, None):
        a, seen = np.zeros(100, np.int64), np.zeros(2, np.int64)
        f = split(_count, a, seen, 7, parts=parts)
        (f if workers is None else f.planned(workers))()
        _check(a, seen)
