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
reads), then it publishes the job; the caller and every awake worker claim its parts one at a
time from a shared counter (ggml's chunk counter) and run them, the caller waits for the parts a
worker claimed, then runs part `parts` (an epilogue: merging partial results). So a job always
completes on the caller's thread alone if no worker comes (none started yet, asleep, descheduled
by a busy machine, or the pool busy with another thread's job): no call ever waits on a worker
that has not started its part, and a job split in more parts than threads shares them out by
who is running.

Workers spin (~50 us), then poll yielding the CPU (~1 ms on a quiet machine), then sleep on a
futex that the next caller to publish a job wakes; a job published while a worker wakes up runs
on the caller. On a busy machine the yields hand the core to the caller or to the other program:
a worker spinning there would take the share of CPU the caller needs to publish the next job.
`GGX_CPU_WORKERS=0` turns the workers off (every job runs on the caller's thread; for comparisons).
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
#: JOB, NPARTS and NEXT, the job's even generation after), its array and part count, the caller's
#: lock, stop, the sleeping workers' count and the futex word they sleep on, the next unclaimed
#: part (tagged with its job's generation: `_claim`) and the count of parts done.
GEN, JOB, NPARTS, LOCK, STOP, SLEEPING, WAKE, NEXT, DONE = 0, 8, 9, 16, 24, 32, 40, 48, 56
CTRL_WORDS = 64
#: the most parts a job may have (a split in more runs as a region)
MAX_PARTS = 1 << 16
#: NEXT holds (generation & TAG_MASK) << PART_BITS | next part
PART_BITS = 24
TAG_MASK = (1 << 38) - 1

#: a worker between jobs spins SPIN_ROUNDS pauses (~50 us), then polls with sched_yield YIELD_ROUNDS
#: times before it sleeps on the futex: on a quiet machine a yield returns at once (~1 ms of
#: polling in all: the gap between decode steps), on a busy one it hands the core to the caller
#: or to another program instead of burning the share of CPU that the caller needs to go on
SPIN_ROUNDS = 2000
YIELD_ROUNDS = 2000
WAIT_SPINS = 4000  # pauses a caller spins on a worker's part (~0.1 ms) before yielding its core


# --- the two sides -------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def _claim(ctrl, g, parts):
    """Claim the next unclaimed part of generation g's job: its number, or -1 when every part is
    claimed or g's job is over (NEXT carries a newer tag). A claim that succeeds is of a live job:
    g's caller returns only after every part is claimed and done."""
    tag = (g & TAG_MASK) << PART_BITS
    while True:
        v = load_acquire(ctrl, NEXT)
        k = v & ((1 << PART_BITS) - 1)
        if v - k != tag or k >= parts:
            return -1
        if compare_and_swap(ctrl, NEXT, v, v + 1):
            return k


@njit(cache=True, nogil=True)
def _worker(ctrl, part):
    """Worker `part` (1..): run parts of every job published, until STOP."""
    last = load_acquire(ctrl, GEN)
    idle = 0
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
        # job and parts are generation g's; nothing of the job is read before a claim succeeds
        # (it may be gone when g's caller ran every part itself)
        k = _claim(ctrl, g, parts)
        while k >= 0:
            call_job(job_word(job, JOB_FN), job, k, parts)
            fetch_add(ctrl, DONE, 1)
            k = _claim(ctrl, g, parts)
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
    g = fetch_add(ctrl, GEN, 1) + 2  # odd: publishing generation g
    store_release(ctrl, JOB, job)
    store_release(ctrl, NPARTS, parts)
    store_release(ctrl, DONE, 0)
    store_release(ctrl, NEXT, (g & TAG_MASK) << PART_BITS)
    fetch_add(ctrl, GEN, 1)  # even: generation g is published
    if load_seq_cst(ctrl, SLEEPING) > 0:  # a worker that went to sleep before seeing g
        wake(ctrl)
    mine = 0
    k = _claim(ctrl, g, parts)
    while k >= 0:
        call_job(fn, job, k, parts)
        mine += 1
        k = _claim(ctrl, g, parts)
    fetch_add(ctrl, DONE, mine)
    waited = 0
    while load_acquire(ctrl, DONE) != parts:  # parts a worker claimed and runs
        waited += 1
        if waited < WAIT_SPINS:
            pause()
        else:  # that worker lost its core (a busy machine): give it ours rather than spin
            sched_yield()
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
    """The process's workers: each awake worker claims parts of every job published, as the
    caller does. Started on first use, stopped at exit, renewed after a fork."""

    def __init__(self) -> None:
        self.ctrl = np.zeros(CTRL_WORDS, np.int64)
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def ensure(self, threads: int) -> None:
        """Start workers 1..threads-1 that are not running."""
        if len(self.threads) + 1 >= threads:
            return
        with self._lock:
            while len(self.threads) + 1 < threads:
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
