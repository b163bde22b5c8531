"""Compiled forms of a kernel call, made once when a launch is bound: the only module of ggx-cpu
that reaches into numba's internals.

- `entry(kernel, sig)`: the kernel's compiled entry point for argument types `sig` (a C-level
  call that skips numba's per-call dispatch), typed with `typeof` (numba's C fingerprint of a
  value, ~0.1 us against ~6.6 us for numba.typeof).
- `job(kernel, args, parts)`: a *job*, an int64 array [function, parts, stash] that compiled
  code runs (`pool`): the arguments stored once in their compiled form (numba's native structs,
  holding a reference to each array: the *stash*) and a `cfunc` thunk per kernel and argument
  types that reads them back (lending the arrays uncounted: `_borrowed`) and calls
  `kernel(part, parts, *args)` (a split kernel) or `kernel(*args)` (parts 0: a one-thread
  kernel). A call unboxes nothing.
- `row_split(kernel, n_args)`: the split kernel of a row kernel `kernel(r0, r1, *args)`.
- `region(kernel, n_args)`: a split kernel's parts as one numba parallel region: part -1, then
  parts 0..parts-1 over the region's threads (`prange`), then part `parts`;
  `set_region_threads(n)` before it runs.

The thunks and regions are functions of the kernel's file with the kernel as a global and a
name of their own: numba keys a closure's disk cache by its pickled cells (for a kernel, a
number drawn anew in every process) and a file's cache by the file, so these caches sit by the
kernel's and are dropped when that file changes.
"""
from __future__ import annotations

import functools
import hashlib
import types as pytypes
import weakref

import numba
import numpy as np
from llvmlite import ir
from numba import cfunc, njit, prange, types
from numba._dispatcher import compute_fingerprint
from numba.core.registry import cpu_target
from numba.extending import intrinsic
from numba.np.ufunc import parallel as _numba_parallel

from ggx import progress

from . import isa
from .isa.codegen import I64

#: words of a job array: the job function's address, the part count (0: a one-thread kernel's
#: single call), the address of the stored arguments
JOB_FN, JOB_PARTS, JOB_ARGS = 0, 1, 2


# --- entry points ---------------------------------------------------------------------------------------
_TYPES_BY_FINGERPRINT: dict[bytes, object] = {}
#: (kernel id, ids of the argument types) -> (kernel, types, entry point). numba's types are
#: interned, so their ids name them; hashing the types themselves (as `overloads` does) costs
#: ~1.5 us a launch, a fifth of binding a new graph. The value holds the kernel and the types,
#: so no id is reused while its key is here.
_ENTRIES: dict[tuple, tuple] = {}


def typeof(value):
    """numba's type of a kernel argument, remembered by numba's own C fingerprint of the value
    (a new graph binds some 7000 arguments). Values without a fingerprint (tokens) and unaligned
    arrays (numba types those apart) ask numba."""
    if isinstance(value, np.ndarray) and not value.flags.aligned:
        return numba.typeof(value)
    try:
        fp = compute_fingerprint(value)
    except (NotImplementedError, TypeError, ValueError):
        return numba.typeof(value)
    t = _TYPES_BY_FINGERPRINT.get(fp)
    if t is None:
        t = _TYPES_BY_FINGERPRINT[fp] = numba.typeof(value)
    return t


def entry(kernel, sig: tuple):
    """The compiled entry point of `kernel` for the argument types `sig` (loaded or compiled once)."""
    key = (id(kernel), *map(id, sig))
    known = _ENTRIES.get(key)
    if known is not None:
        return known[2]
    cres = kernel.overloads.get(sig)
    if cres is not None:
        fn = cres.entry_point
    else:  # compiled now, or loaded from numba's disk cache: one-off time the CLI shows and leaves out
        with progress.compiling(f"CPU kernels for {isa.active()}"):
            fn = kernel.compile(sig)
    _ENTRIES[key] = (kernel, sig, fn)
    return fn


def entry_for(kernel, args: tuple):
    """`entry` for the types of `args`."""
    return entry(kernel, tuple(map(typeof, args)))


# --- parallel regions -----------------------------------------------------------------------------------
def set_region_threads(n: int) -> None:
    """Run the next numba parallel region of this thread on n threads (~0.3 us)."""
    _numba_parallel._set_num_threads(n)


def region_threads(n_threads: int) -> int:
    """n_threads clamped to numba's pool (started here once per process)."""
    _numba_parallel._launch_threads()
    return max(1, min(int(n_threads), numba.config.NUMBA_NUM_THREADS))


@functools.cache
def region(kernel, n_args: int):
    """The njit `region(parts, *args)` running split kernel `kernel`'s parts as one parallel region
    (for `n_args` arguments: written out one by one, as numba's parallel regions take a tuple
    only as an argument of their own)."""
    name = f"ggx_region_{kernel.py_func.__name__}_{n_args}"
    args = ", ".join(f"a{i}" for i in range(n_args))
    source = (f"def {name}(parts, {args}):\n"
              f"    KERNEL(-1, parts, {args})\n"
              f"    for p in prange(parts):\n"
              f"        KERNEL(p, parts, {args})\n"
              f"    KERNEL(parts, parts, {args})\n")
    namespace = {"KERNEL": kernel, "prange": prange}
    exec(compile(source, kernel.py_func.__code__.co_filename, "exec"), namespace)
    fn = namespace[name]
    fn.__module__ = kernel.py_func.__module__
    return njit(cache=True, parallel=True)(fn)


@functools.cache
def row_split(kernel, n_args: int):
    """The split kernel `split(part, parts, r0, r1, *args)` (for `n_args` arguments) of a row
    kernel `kernel(r0, r1, *args)` (rows r0..r1-1): part p runs its contiguous share of the rows,
    no prologue or epilogue. One row kernel then serves one thread, the worker pool and a region."""
    name = f"ggx_rows_{kernel.py_func.__name__}_{n_args}"
    args = ", ".join(f"a{i}" for i in range(n_args))
    source = (f"def {name}(part, parts, r0, r1, {args}):\n"
              f"    if 0 <= part < parts:\n"
              f"        n = r1 - r0\n"
              f"        KERNEL(r0 + part * n // parts, r0 + (part + 1) * n // parts, {args})\n")
    namespace = {"KERNEL": kernel}
    exec(compile(source, kernel.py_func.__code__.co_filename, "exec"), namespace)
    fn = namespace[name]
    fn.__module__ = kernel.py_func.__module__
    return njit(cache=True)(fn)


def _copy(template, kernel, name: str, globals_: dict):
    """`template` as a function of the kernel's file named `name`, with `globals_` added."""
    py = kernel.py_func
    code = template.__code__.replace(co_filename=py.__code__.co_filename, co_name=name, co_qualname=name)
    fn = pytypes.FunctionType(code, {**template.__globals__, **globals_}, name)
    fn.__module__ = py.__module__
    return fn


# --- jobs -----------------------------------------------------------------------------------------------
@intrinsic
def call_job(typingctx, fn, job, part, parts):
    """fn(job, part, parts) for a function address fn of a `void(int64, int64, int64)`."""
    def codegen(context, builder, sig, args):
        f = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [I64, I64, I64]).as_pointer())
        builder.call(f, [context.cast(builder, v, t, types.int64) for v, t in zip(args[1:], sig.args[1:])])
        return context.get_dummy_value()

    return types.void(fn, job, part, parts), codegen


@intrinsic
def job_word(typingctx, job, i):
    """Word i of the job array at address `job`."""
    def codegen(context, builder, sig, args):
        p = builder.inttoptr(args[0], I64.as_pointer())
        return builder.load(builder.gep(p, [context.cast(builder, args[1], sig.args[1], types.int64)]))

    return types.int64(job, i), codegen


@intrinsic
def address_of(typingctx, arr):
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


def _borrowed(context, builder, ty, value):
    """`value` of type `ty` with each array in it borrowed: its meminfo pointer null, so the
    kernel's reference counting of it does nothing. Two threads running parts of one job would
    otherwise increment and decrement the same arrays' counts at every call inside the kernel
    (numba counts references atomically), a cache line bouncing between the cores at each of
    thousands of calls a product. The job holds the references while any part runs."""
    if isinstance(ty, types.Array):
        arr = context.make_array(ty)(context, builder, value=value)
        arr.meminfo = context.get_constant_null(types.MemInfoPointer(ty.dtype))
        return arr._getvalue()
    if isinstance(ty, types.BaseTuple):
        for i, t in enumerate(ty):
            value = builder.insert_value(value, _borrowed(context, builder, t, builder.extract_value(value, i)), i)
        return value
    context.nrt.incref(builder, ty, value)  # another counted type: a new reference, released by the caller's scope
    return value


def _loader(owned: bool):
    def load(typingctx, address, tyref):
        ty = tyref.instance_type if isinstance(tyref, types.TypeRef) else tyref

        def codegen(context, builder, sig, args):
            value = builder.load(builder.inttoptr(args[0], context.get_value_type(ty).as_pointer()))
            return value if owned else _borrowed(context, builder, ty, value)

        return ty(address, tyref), codegen

    return intrinsic(load)


#: the arguments stored at an address, borrowed (a job function's read: `_borrowed`)
_load_args = _loader(owned=False)
#: the same, taking over the stored references (the job's release)
_take_args = _loader(owned=True)


@njit(cache=True)
def _drop_args(stash, tyref):
    _take_args(address_of(stash), tyref)


@njit(cache=True)
def _store_args_at(stash, args):
    _store_args(address_of(stash), args)


def _split_thunk(address, part, parts):  # noqa: F821 - KERNEL and ARGS_TYPE: the thunk's own globals
    KERNEL(part, parts, *_load_args(job_word(address, JOB_ARGS), ARGS_TYPE))  # noqa: F821


def _plain_thunk(address, part, parts):  # noqa: F821
    KERNEL(*_load_args(job_word(address, JOB_ARGS), ARGS_TYPE))  # noqa: F821


@functools.cache
def _job_function(kernel, args_type: types.Type, split: bool) -> int:
    """The address of a `void(int64 job, int64 part, int64 parts)` that calls
    `kernel(part, parts, *args)` (split) or `kernel(*args)` with the arguments stored for the job:
    a `cfunc` per kernel and argument types, compiled once, then loaded from numba's disk cache
    (named after the kernel with a digest of the types: one cfunc has one signature)."""
    digest = hashlib.sha1(f"{args_type}|{split}|{THUNK_FORM}".encode()).hexdigest()[:16]
    thunk = _copy(_split_thunk if split else _plain_thunk, kernel, f"ggx_job_{kernel.py_func.__name__}_{digest}",
                  {"KERNEL": kernel, "ARGS_TYPE": args_type})
    with progress.compiling(f"CPU kernels for {isa.active()}"):  # cfunc compiles (or loads) here
        fn = cfunc(types.void(types.int64, types.int64, types.int64), cache=True)(thunk)
    _JOB_FUNCTIONS.append(fn)  # its code lives as long as the process
    return fn.address


#: the thunks' form, part of their cache names: numba keys a cache by the kernel's file alone, so a
#: thunk whose code here changed would otherwise load the old one from disk
THUNK_FORM = 2
_JOB_FUNCTIONS: list = []
#: (kernel id, split, argument type ids) -> (kernel, argument types: kept so no id is reused,
#: their tuple type, the job function's address, the entry storing them, the words they take)
_JOB_KINDS: dict[tuple, tuple] = {}
_STASH_TYPE = types.Array(types.int64, 1, "C")


def job(kernel, args: tuple, parts: int) -> np.ndarray:
    """A job array running `kernel` on `args` (their references held until the array goes):
    `kernel(part, parts, *args)` split in `parts` parts, or for parts 0 a one-thread kernel's
    single call `kernel(*args)`."""
    arg_types = tuple(map(typeof, args))
    key = (id(kernel), parts > 0, *map(id, arg_types))  # numba's types are interned: ids name them
    known = _JOB_KINDS.get(key)
    if known is None:
        args_type = types.Tuple(arg_types)
        size = cpu_target.target_context.get_abi_sizeof(cpu_target.target_context.get_value_type(args_type))
        known = _JOB_KINDS[key] = (kernel, arg_types, args_type, _job_function(kernel, args_type, parts > 0),
                                   entry(_store_args_at, (_STASH_TYPE, args_type)), -(-size // 8))
    _, _, args_type, fn, store, words = known
    stash = np.zeros(words, np.int64)
    store(stash, args)
    array = np.array([fn, parts, stash.ctypes.data], np.int64)
    weakref.finalize(array, _drop_args, stash, args_type)
    return array
