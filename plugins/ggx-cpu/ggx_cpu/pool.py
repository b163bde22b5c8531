"""The worker pool: persistent threads that run the parts of jobs (`jobs.job`: a split kernel
`kernel(part, parts, *args)` stored in compiled form) with the caller, for work too small for
numba's OpenMP regions (a decode step's matrix-vector products and attention, ~150 of them a
token, each a few to a few hundred microseconds); and the compiled loops that run one job
(`run`) or a fused sequence of them (`run_all`).

A numba parallel region costs its launch (GNU OpenMP's fork and join, numba's scheduling) and,
worse, leaves memory idle between regions: the same 120 products read their weights at ~20 GB/s
as 120 regions and at ~28 GB/s as one (docs/perf-notes.md, "Worker threads and fused
launches"). ggml keeps its threads alive across a graph and hands them work through atomics;
this module does the same for jobs: persistent worker threads (Python threads running compiled,
GIL-free loops) spin on a shared control block, and a job is published with a release store and
claimed with a compare-and-swap.

A job runs on the caller's thread: part -1 (a prologue: quantizing the activations every part
reads), then it publishes the job, runs part 0, claims every part no worker has claimed yet and
waits for the ones a worker runs, then part `parts` (an epilogue: merging partial results). So a
job always completes on the caller's thread alone if no worker comes (none started yet, asleep,
or the pool busy with another thread's job): no call ever waits on a worker that has not started its part.

Workers spin (~0.2 ms), then yield the CPU a few hundred times, then sleep on a futex that the
next caller to publish a job wakes: a sleeping worker takes no CPU from the parallel regions of a
prompt, and a job published while it wakes up runs on the caller. `GGX_CPU_WORKERS=0` turns the
workers off (every job runs on the caller's thread; for comparisons).
"""
from __future__ import annotations

import atexit
import os
import threading

import numpy as np
from numba import njit

from .atomics import (
    SYS_FUTEX,
    compare_and_swap,
    fetch_add,
    futex_wait,
    futex_wake,
    load_acquire,
    load_seq_cst,
    pause,
    sched_yield,
    store_release,
)
from .jobs import JOB_FN, JOB_PARTS, address_of, call_job, job_word

#: slots of the control block (int64), shared by the caller and the workers, each on its own
#: 64-byte line: the published job's generation (a sequence lock: odd while the caller writes
#: JOB and NPARTS, the job's even generation after), its array and part count, the caller's lock,
#: stop, the sleeping workers' count and the futex word they sleep on. Each part's owner (the
#: generation that claimed it) and done (the generation it finished) share a line.
GEN, JOB, NPARTS, LOCK, STOP, SLEEPING, WAKE = 0, 8, 9, 16, 24, 32, 40
PART0 = 48
#: the most parts a job may have (a worker per part but the first)
MAX_PARTS = 64

SPIN_ROUNDS = 40000  # pause instructions (~25 ns each here, ~1 ms: the gap between decode steps) before yielding
YIELD_ROUNDS = 256  # sched_yield calls before it sleeps on the futex


# --- the two sides -------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _worker(ctrl, part):
    """Worker `part` (1..): run that part of every job published, until STOP."""
    last = load_acquire(ctrl, GEN)
    idle = 0
    owner = PART0 + 8 * part
    while load_acquire(ctrl, STOP) == 0:
        g = load_acquire(ctrl, GEN)
        if g == last or g % 2 == 1:
            idle += 1
            if idle < SPIN_ROUNDS:
                pause()
            elif idle < SPIN_ROUNDS + YIELD_ROUNDS:
                sched_yield()
            else:  # sleep until a caller publishes a job (it wakes sleepers) or SLEEP_NS pass
                seen = load_acquire(ctrl, WAKE)
                fetch_add(ctrl, SLEEPING, 1)
                if load_seq_cst(ctrl, GEN) == last and load_acquire(ctrl, STOP) == 0:
                    futex_wait(ctrl, WAKE, seen)
                fetch_add(ctrl, SLEEPING, -1)
            continue
        job = load_acquire(ctrl, JOB)
        parts = load_acquire(ctrl, NPARTS)
        if load_acquire(ctrl, GEN) != g:  # a newer job was being published meanwhile: read again
            continue
        last = g
        idle = 0
        # job and parts are generation g's. Part `part` is unclaimed while its owner is an older
        # generation, and g's caller does not finish (its job stays alive) before every one of
        # its parts is claimed: a claim that succeeds is of a live job. Nothing of the job is
        # read before that (it may be gone when g's caller ran every part itself).
        o = load_acquire(ctrl, owner)
        if part < parts and o < g and compare_and_swap(ctrl, owner, o, g):
            call_job(job_word(job, JOB_FN), job, part, parts)
            store_release(ctrl, owner + 1, g)
    return idle


@njit(cache=True)
def _run_job(ctrl, job):
    """Run the job at address `job` on this thread, split ones with the workers' help (see the
    module docstring)."""
    fn, parts = job_word(job, JOB_FN), job_word(job, JOB_PARTS)
    if parts == 0:  # a one-thread kernel: one call
        call_job(fn, job, 0, 1)
        return
    call_job(fn, job, -1, parts)
    if parts == 1 or not compare_and_swap(ctrl, LOCK, 0, 1):
        for k in range(parts):
            call_job(fn, job, k, parts)
        call_job(fn, job, parts, parts)
        return
    fetch_add(ctrl, GEN, 1)  # odd: publishing
    store_release(ctrl, JOB, job)
    store_release(ctrl, NPARTS, parts)
    g = fetch_add(ctrl, GEN, 1) + 1  # even: generation g is published
    if load_seq_cst(ctrl, SLEEPING) > 0:  # a worker that went to sleep before seeing g
        wake(ctrl)
    call_job(fn, job, 0, parts)
    for k in range(1, parts):
        owner = PART0 + 8 * k
        o = load_acquire(ctrl, owner)
        if o < g and compare_and_swap(ctrl, owner, o, g):
            call_job(fn, job, k, parts)
        else:
            while load_acquire(ctrl, owner + 1) != g:
                pause()
    store_release(ctrl, LOCK, 0)
    call_job(fn, job, parts, parts)


@njit(cache=True)
def run(ctrl, jobs):
    """Run the job whose array is `jobs` (a 1-D int64 job array)."""
    _run_job(ctrl, address_of(jobs))


@njit(cache=True)
def run_all(ctrl, jobs, flags):
    """Run the jobs at the addresses in `jobs` in order, stopping after job i if flags[i] is the
    address of a word that is now nonzero (a failed check); returns that i, else -1."""
    for i in range(jobs.size):
        _run_job(ctrl, jobs[i])
        if flags[i] != 0 and job_word(flags[i], 0) != 0:
            return i
    return -1


@njit(cache=True, nogil=True)
def wake(ctrl):
    """Wake the workers sleeping on the futex."""
    fetch_add(ctrl, WAKE, 1)
    futex_wake(ctrl, WAKE)


# --- the pool ------------------------------------------------------------------------------------------
class WorkerPool:
    """The process's workers: part k of every job runs on worker k (1 <= k < parts) when it is
    awake, else on the caller. Started on first use, stopped at exit, renewed after a fork."""

    def __init__(self) -> None:
        self.ctrl = np.zeros(PART0 + 8 * MAX_PARTS, np.int64)
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def ensure(self, parts: int) -> None:
        """Start workers 1..parts-1 that are not running."""
        parts = min(parts, MAX_PARTS)
        if len(self.threads) + 1 >= parts:
            return
        with self._lock:
            while len(self.threads) + 1 < parts:
                t = threading.Thread(target=_worker_main, args=(self.ctrl, len(self.threads) + 1), daemon=True,
                                     name=f"ggx-cpu worker {len(self.threads) + 1}")
                t.start()
                self.threads.append(t)

    def stop(self) -> None:
        self.ctrl[STOP] = 1
        wake(self.ctrl)
        for t in self.threads:
            t.join(timeout=1.0)
        self.threads = []


def _worker_main(ctrl: np.ndarray, part: int) -> None:
    # A thread starts with its creator's CPU mask: with OMP_PROC_BIND set, OpenMP has pinned the
    # caller's thread to one core, and a worker sharing it would run nothing in parallel.
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # no affinity calls here, or a mask the system refuses
        pass
    _worker(ctrl, part)


_pool: WorkerPool | None = None


def pool() -> WorkerPool:
    """The process's pool (made on first use)."""
    global _pool
    if _pool is None:
        _pool = WorkerPool()
    return _pool


def _forget_pool() -> None:  # after fork: the child has the control block but not the threads
    global _pool
    _pool = None


def _stop_pool() -> None:
    if _pool is not None:
        _pool.stop()


os.register_at_fork(after_in_child=_forget_pool)
atexit.register(_stop_pool)


def enabled() -> bool:
    """Whether jobs get workers and prepared graphs run fused ($GGX_CPU_WORKERS=0 turns both off,
    for comparisons; read on every bind). Off where the workers' futex is unknown (not Linux on
    x86-64 or aarch64)."""
    return SYS_FUTEX is not None and os.environ.get("GGX_CPU_WORKERS", "1") != "0"
