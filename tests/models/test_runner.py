"""Runner.lock (`YieldingLock`): background work takes it only between the calls of others."""
from __future__ import annotations

import threading

from ggx.models.runner import YieldingLock


def test_a_waiting_caller_goes_before_the_next_background_step():
    lock = YieldingLock()
    order: list[str] = []
    in_step, go_on = threading.Event(), threading.Event()

    def background():
        for i in range(3):
            assert lock.begin_step(0.0, threading.Event())
            order.append(f"step {i}")
            if i == 0:
                in_step.set()
                go_on.wait(10)
            lock.end_step()

    def caller():
        with lock:
            order.append("call")

    bg = threading.Thread(target=background)
    bg.start()
    assert in_step.wait(10)
    fg = threading.Thread(target=caller)
    fg.start()
    while not lock._waiting:  # the caller is queued behind the step under way
        threading.Event().wait(0.001)
    go_on.set()
    bg.join(10)
    fg.join(10)
    assert order == ["step 0", "call", "step 1", "step 2"]


def test_the_lock_is_reentrant_and_a_step_may_nest_it():
    lock = YieldingLock()
    with lock, lock:
        pass
    assert lock.begin_step(0.0, threading.Event())
    with lock:
        pass
    lock.end_step()
    got = []
    t = threading.Thread(target=lambda: got.append(lock._lock.acquire(timeout=5)))
    t.start()
    t.join()
    assert got == [True]  # released by every exit above


def test_no_step_while_callers_keep_the_lock_busy_and_a_stop_ends_the_wait():
    """A step waits for the lock to have been left alone `quiet_s`; a stop (with `wake`) ends
    that wait without taking the lock."""
    lock = YieldingLock()
    with lock:
        pass
    stop = threading.Event()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(lock.begin_step(30.0, stop)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # the lock was used just now: no step for 30 s
    stop.set()
    lock.wake()
    t.join(10)
    assert got == [False]
    with lock:  # not held by the stopped step
        pass
