"""Worker threads for work too small for numba's OpenMP regions (a decode step's matrix-vector
products and attention, ~150 of them a token, each a few to a few hundred microseconds), and jobs:
kernel calls stored in compiled form, which a kept graph runs in one call (`SequenceLaunch`).

A numba parallel region costs its launch (GNU OpenMP's fork and join, numba's scheduling) and,
worse, leaves memory idle between regions: the same 120 products read their weights at ~20 GB/s
as 120 regions and at ~28 GB/s as one (docs/perf-notes.md, "Worker threads and fused
launches"). ggml keeps its threads alive across a graph and hands them work through atomics;
this module does the same for jobs: persistent worker threads (Python threads running compiled,
GIL-free loops) spin on a shared control block, and a job is published with a release store and
claimed with a compare-and-swap.

A *job* is a compiled kernel `kernel(part, parts, *args)` and its arguments, bound once
(`parallel_launch`): the arguments are stored in their compiled form (numba's native structs,
holding a reference to each array) and a `cfunc` made per kernel and argument types reads them
back, so a call unboxes nothing but the job. The launch runs on the caller's thread: part -1 (a
prologue: quantizing the activations every part reads), then it publishes the job, runs part 0,
claims every part no worker has claimed yet and waits for the ones a worker runs, then part
`parts` (an epilogue: merging partial results). So a job always completes on the caller's thread
alone if no worker comes (none started yet, asleep, or the pool busy with another thread's job):
no call ever waits on a worker that has not started its part.

Workers spin (~0.2 ms), then yield the CPU a few hundred times, then sleep on a futex that the
next caller to publish a job wakes: a sleeping worker takes no CPU from the parallel regions of a
prompt, and a job published while it wakes up runs on the caller. `GGX_CPU_WORKERS=0` turns the
workers off (every job runs on the caller's thread; for comparisons).
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import os
import platform
import sys
import threading
import types as pytypes
import weakref
from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.core import cgutils
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from ggx import progress
from ggx.errors import GGXStateError, GGXValueError

from . import isa
from .isa.codegen import I32, I64, declare, elem_ptr
from .kernels.common import _entry, _typeof

#: slots of the control block (int64), shared by the caller and the workers, each on its own
#: 64-byte line: the published job's generation (a sequence lock: odd while the caller writes
#: JOB and NPARTS, the job's even generation after), its array and part count, the caller's lock,
#: stop, the sleeping workers' count and the futex word they sleep on. Each part's owner (the
#: generation that claimed it) and done (the generation it finished) share a line.
GEN, JOB, NPARTS, LOCK, STOP, SLEEPING, WAKE = 0, 8, 9, 16, 24, 32, 40
PART0 = 48
MAX_PARTS = 64
#: a job array: the job function's address, the part count, the address of the stored arguments
JOB_FN, JOB_PARTS, JOB_ARGS = 0, 1, 2

SPIN_ROUNDS = 40000  # pause instructions (~25 ns each here, ~1 ms: the gap between decode steps) before yielding
YIELD_ROUNDS = 256  # sched_yield calls before it sleeps on the futex
SLEEP_NS = 50_000_000  # a sleeping worker looks again this often even if nobody wakes it
#: Linux's futex syscall number on this machine (None elsewhere: no workers, see `enabled`)
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if sys.platform == "linux" else None
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129


# --- primitives -------------------------------------------------------------------------------------
@intrinsic
def load_acquire(typingctx, arr, i):
    """arr[i] (int64) read with acquire ordering."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(elem_ptr(context, builder, sig.args[0], args[0], args[1]), "acquire", 8)

    return types.int64(arr, i), codegen


@intrinsic
def store_release(typingctx, arr, i, v):
    """arr[i] = v (int64) with release ordering."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        p = elem_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store_atomic(context.cast(builder, args[2], sig.args[2], types.int64), p, "release", 8)
        return context.get_dummy_value()

    return types.void(arr, i, v), codegen


@intrinsic
def compare_and_swap(typingctx, arr, i, old, new):
    """arr[i] = new if arr[i] == old, atomically; whether it did."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        p = elem_ptr(context, builder, sig.args[0], args[0], args[1])
        o = context.cast(builder, args[2], sig.args[2], types.int64)
        n = context.cast(builder, args[3], sig.args[3], types.int64)
        return builder.extract_value(builder.cmpxchg(p, o, n, "acq_rel", "acquire"), 1)

    return types.boolean(arr, i, old, new), codegen


@intrinsic
def _pause(typingctx):
    """x86's spin-wait hint (elsewhere nothing)."""
    def codegen(context, builder, sig, args):
        if platform.machine() in ("x86_64", "AMD64"):
            builder.call(declare(builder, "llvm.x86.sse2.pause", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _sched_yield(typingctx):
    def codegen(context, builder, sig, args):
        builder.call(declare(builder, "sched_yield", I32, []), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def fetch_add(typingctx, arr, i, v):
    """arr[i] += v (int64), atomically and sequentially consistent; the old value."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        p = elem_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.atomic_rmw("add", p, context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")

    return types.int64(arr, i, v), codegen


@intrinsic
def _load_seq_cst(typingctx, arr, i):
    def codegen(context, builder, sig, args):
        return builder.load_atomic(elem_ptr(context, builder, sig.args[0], args[0], args[1]), "seq_cst", 8)

    return types.int64(arr, i), codegen


def _futex(builder, context, arrty, arr, i, op, val, timeout):
    """syscall(SYS_futex, &arr[i] (its low 32 bits), op, val, timeout)."""
    syscall = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I64, [I64], var_arg=True), "syscall")
    word = builder.bitcast(elem_ptr(context, builder, arrty, arr, i), I32.as_pointer())
    nr = SYS_FUTEX if SYS_FUTEX is not None else -1  # never called there: no worker sleeps
    return builder.call(syscall, [ir.Constant(I64, nr), word, ir.Constant(I32, op),
                                  builder.trunc(val, I32), timeout])


@intrinsic
def _futex_wait(typingctx, arr, i, seen):
    """Sleep while arr[i]'s low 32 bits equal seen's, at most SLEEP_NS (FUTEX_WAIT)."""
    def codegen(context, builder, sig, args):
        ts = cgutils.alloca_once(builder, ir.LiteralStructType([I64, I64]))
        builder.store(ir.Constant(ir.LiteralStructType([I64, I64]), [SLEEP_NS // 10**9, SLEEP_NS % 10**9]), ts)
        _futex(builder, context, sig.args[0], args[0], args[1], FUTEX_WAIT_PRIVATE,
               context.cast(builder, args[2], sig.args[2], types.int64), ts)
        return context.get_dummy_value()

    return types.void(arr, i, seen), codegen


@intrinsic
def _futex_wake(typingctx, arr, i):
    """Wake every thread sleeping on arr[i] (FUTEX_WAKE)."""
    def codegen(context, builder, sig, args):
        _futex(builder, context, sig.args[0], args[0], args[1], FUTEX_WAKE_PRIVATE, ir.Constant(I64, 2**31 - 1),
               ir.Constant(ir.IntType(8).as_pointer(), None))
        return context.get_dummy_value()

    return types.void(arr, i), codegen


@intrinsic
def _call_job(typingctx, fn, job, part, parts):
    """fn(job, part, parts) for a function address fn of a `void(int64, int64, int64)`."""
    def codegen(context, builder, sig, args):
        f = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [I64, I64, I64]).as_pointer())
        builder.call(f, [context.cast(builder, v, t, types.int64) for v, t in zip(args[1:], sig.args[1:])])
        return context.get_dummy_value()

    return types.void(fn, job, part, parts), codegen


@intrinsic
def _address_of(typingctx, arr):
    """The address of an array's first element (int64)."""
    def codegen(context, builder, sig, args):
        return builder.ptrtoint(context.make_array(sig.args[0])(context, builder, args[0]).data, I64)

    return types.int64(arr), codegen


@intrinsic
def _store_args(typingctx, address, value):
    """Store `value` (any numba value: the arguments tuple) at `address` in its native form,
    with a new reference to each array in it (`_drop_args` releases them)."""
    def codegen(context, builder, sig, args):
        ty = sig.args[1]
        context.nrt.incref(builder, ty, args[1])
        builder.store(args[1], builder.inttoptr(args[0], context.get_value_type(ty).as_pointer()))
        return context.get_dummy_value()

    return types.void(address, value), codegen


def _loader(owned: bool):
    def load(typingctx, address, tyref):
        ty = tyref.instance_type if isinstance(tyref, types.TypeRef) else tyref

        def codegen(context, builder, sig, args):
            value = builder.load(builder.inttoptr(args[0], context.get_value_type(ty).as_pointer()))
            if not owned:  # a new reference, released when the caller's scope ends
                context.nrt.incref(builder, ty, value)
            return value

        return ty(address, tyref), codegen

    return intrinsic(load)


#: the arguments stored at an address, as a new reference (a job function's read)
_load_args = _loader(owned=False)
#: the same, taking over the stored references (the job's release)
_take_args = _loader(owned=True)


@njit(cache=True)
def _drop_args(stash, tyref):
    _take_args(_address_of(stash), tyref)


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
                _pause()
            elif idle < SPIN_ROUNDS + YIELD_ROUNDS:
                _sched_yield()
            else:  # sleep until a caller publishes a job (it wakes sleepers) or SLEEP_NS pass
                seen = load_acquire(ctrl, WAKE)
                fetch_add(ctrl, SLEEPING, 1)
                if _load_seq_cst(ctrl, GEN) == last and load_acquire(ctrl, STOP) == 0:
                    _futex_wait(ctrl, WAKE, seen)
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
            _call_job(_job_word(job, JOB_FN), job, part, parts)
            store_release(ctrl, owner + 1, g)
    return idle


@intrinsic
def _job_word(typingctx, job, i):
    """Word i of the job array at address `job`."""
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], I64.as_pointer())
        return builder.load(builder.gep(p, [context.cast(builder, args[1], sig.args[1], types.int64)]))

    return types.int64(job, i), codegen


@njit(cache=True)
def _run_job(ctrl, job):
    """Run the job at address `job` on this thread, split ones with the workers' help (see the
    module docstring)."""
    fn, parts = _job_word(job, JOB_FN), _job_word(job, JOB_PARTS)
    if parts == 0:  # a one-thread kernel: one call
        _call_job(fn, job, 0, 1)
        return
    _call_job(fn, job, -1, parts)
    if parts == 1 or not compare_and_swap(ctrl, LOCK, 0, 1):
        for k in range(parts):
            _call_job(fn, job, k, parts)
        _call_job(fn, job, parts, parts)
        return
    fetch_add(ctrl, GEN, 1)  # odd: publishing
    store_release(ctrl, JOB, job)
    store_release(ctrl, NPARTS, parts)
    g = fetch_add(ctrl, GEN, 1) + 1  # even: generation g is published
    if _load_seq_cst(ctrl, SLEEPING) > 0:  # a worker that went to sleep before seeing g
        _wake(ctrl)
    _call_job(fn, job, 0, parts)
    for k in range(1, parts):
        owner = PART0 + 8 * k
        o = load_acquire(ctrl, owner)
        if o < g and compare_and_swap(ctrl, owner, o, g):
            _call_job(fn, job, k, parts)
        else:
            while load_acquire(ctrl, owner + 1) != g:
                _pause()
    store_release(ctrl, LOCK, 0)
    _call_job(fn, job, parts, parts)


@njit(cache=True)
def _run(ctrl, job_array):
    _run_job(ctrl, _address_of(job_array))


@njit(cache=True)
def _run_all(ctrl, jobs, flags):
    """Run the jobs at the addresses in `jobs` in order, stopping after job i if flags[i] is the
    address of a word that is now nonzero (a failed check); returns that i, else -1."""
    for i in range(jobs.size):
        _run_job(ctrl, jobs[i])
        if flags[i] != 0 and _job_word(flags[i], 0) != 0:
            return i
    return -1


@njit(cache=True, nogil=True)
def _wake(ctrl):
    fetch_add(ctrl, WAKE, 1)
    _futex_wake(ctrl, WAKE)


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
        _wake(self.ctrl)
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
    """Whether jobs get workers and kept graphs run fused ($GGX_CPU_WORKERS=0 turns both off, for
    comparisons; read on every bind). Off where the workers' futex is unknown (not Linux on
    x86-64 or aarch64)."""
    return SYS_FUTEX is not None and os.environ.get("GGX_CPU_WORKERS", "1") != "0"


def _split_thunk(address, part, parts):  # noqa: F821 - KERNEL and ARGS_TYPE: the thunk's own globals
    KERNEL(part, parts, *_load_args(_job_word(address, JOB_ARGS), ARGS_TYPE))  # noqa: F821


def _plain_thunk(address, part, parts):  # noqa: F821
    KERNEL(*_load_args(_job_word(address, JOB_ARGS), ARGS_TYPE))  # noqa: F821


@functools.cache
def _job_function(kernel, args_type: types.Type, split: bool) -> int:
    """The address of a `void(int64 job, int64 part, int64 parts)` that calls
    `kernel(part, parts, *args)` (split) or `kernel(*args)` with the arguments stored for the job:
    a `cfunc` per kernel and argument types, compiled once, then loaded from numba's disk cache.

    The thunk is a copy of `_split_thunk` / `_plain_thunk` with the kernel and the arguments'
    type as its globals, and the kernel's file and a name of its own (the kernel's, with a digest
    of the types): numba keys a closure's cache by its pickled cells, which for a kernel hold a
    number drawn anew in every process, and keys a file's cache by the file, so this cache sits
    by the kernel's and is dropped when that file changes."""
    template = _split_thunk if split else _plain_thunk
    py = kernel.py_func
    digest = hashlib.sha1(f"{args_type}|{split}".encode()).hexdigest()[:16]
    name = f"ggx_job_{py.__name__}_{digest}"
    code = template.__code__.replace(co_filename=py.__code__.co_filename, co_name=name, co_qualname=name)
    thunk = pytypes.FunctionType(code, {**template.__globals__, "KERNEL": kernel, "ARGS_TYPE": args_type}, name)
    thunk.__module__ = py.__module__
    with progress.compiling(f"CPU kernels for {isa.active()}"):  # cfunc compiles (or loads) here
        job = cfunc(types.void(types.int64, types.int64, types.int64), cache=True)(thunk)
    _JOB_FUNCTIONS.append(job)  # its code lives as long as the process
    return job.address


_JOB_FUNCTIONS: list = []


def _job(kernel, args: tuple, parts: int) -> np.ndarray:
    """A job array: `kernel` and `args` stored (their references held until the array goes);
    parts 0 for a one-thread kernel's single call."""
    arg_types = tuple(map(_typeof, args))
    key = (id(kernel), parts > 0, *map(id, arg_types))  # numba's types are interned: ids name them
    known = _JOB_KINDS.get(key)
    if known is None:
        args_type = types.Tuple(arg_types)
        size = cpu_target.target_context.get_abi_sizeof(cpu_target.target_context.get_value_type(args_type))
        known = _JOB_KINDS[key] = (kernel, arg_types, args_type, _job_function(kernel, args_type, parts > 0),
                                   _entry(_store_args_at, (_STASH_TYPE, args_type)), -(-size // 8))
    _, _, args_type, fn, store, words = known
    stash = np.zeros(words, np.int64)
    store(stash, args)
    job = np.array([fn, parts, stash.ctypes.data], np.int64)
    weakref.finalize(job, _drop_args, stash, args_type)
    return job


#: (kernel id, split, argument type ids) -> (kernel, argument types: kept so no id is reused,
#: their tuple type, the job function's address, the entry storing them, the words they take)
_JOB_KINDS: dict[tuple, tuple] = {}
_STASH_TYPE = types.Array(types.int64, 1, "C")


class JobLaunch(functools.partial):
    """The launch of one job (`jobs`: its array) or of several in order (their arrays)."""

    jobs: list[np.ndarray]


def parallel_launch(kernel, *args, parts: int) -> JobLaunch:
    """The launch of `kernel(part, parts, *args)` (an njit function) split in `parts` parts run by
    the caller and the process's workers: part -1 first on the caller, then 0..parts-1 once
    each, then `parts` on the caller (see the module docstring). With the workers off
    ($GGX_CPU_WORKERS=0) the parts run on the caller's thread, one after another."""
    if not 1 <= parts <= MAX_PARTS:
        raise GGXValueError(f"a job has 1..{MAX_PARTS} parts, got {parts}")
    job = _job(kernel, args, parts)
    p = pool()
    if parts > 1 and enabled():
        p.ensure(parts)
    launch = JobLaunch(_entry(_run, (_typeof(p.ctrl), _typeof(job))), p.ctrl, job)
    launch.jobs = [job]
    return launch


def kernel_job(kernel, args: tuple) -> np.ndarray:
    """The job of a one-thread kernel's call `kernel(*args)` (for `SequenceLaunch`)."""
    return _job(kernel, args, 0)


class SequenceLaunch:
    """One launch running jobs in order in one compiled call, no Python between them. A job may
    come with a flag (a check's `failed` array): when the job sets it, the sequence stops there
    and calls that job's launch, whose Python form raises the error."""

    def __init__(self, jobs: list[np.ndarray], launches: list[Callable[[], None]],
                 flags: list[np.ndarray | None]):
        p = pool()
        self.jobs, self.launches, self.flags = jobs, launches, flags
        self.ctrl = p.ctrl
        self.addresses = np.array([j.ctypes.data for j in jobs], np.int64)
        self.flag_addresses = np.array([0 if f is None else f.ctypes.data for f in flags], np.int64)
        self.entry = _entry(_run_all, (_typeof(p.ctrl), _typeof(self.addresses), _typeof(self.flag_addresses)))

    def __call__(self) -> None:
        stopped = self.entry(self.ctrl, self.addresses, self.flag_addresses)
        if stopped >= 0:
            self.launches[stopped]()  # raises
            raise GGXStateError(f"a compiled check stopped the launches at {stopped}, but its Python form passed")


@njit(cache=True)
def _store_args_at(stash, args):
    _store_args(_address_of(stash), args)
