"""Atomic int64 operations and the futex, as numba intrinsics: what the worker pool (`pool`)
synchronizes with. Each takes an int64 array and an element index; orderings are C++'s."""
from __future__ import annotations

import platform
import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .isa.codegen import I32, I64, declare, elem_ptr

#: a sleeping thread looks again this often even if nobody wakes it (FUTEX_WAIT's timeout)
SLEEP_NS = 50_000_000
#: Linux's futex syscall number on this machine (None elsewhere: nothing may sleep on a futex)
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if sys.platform == "linux" else None
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129


def _int64_array(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.int64


@intrinsic
def load_acquire(typingctx, arr, i):
    """arr[i] (int64) read with acquire ordering."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(elem_ptr(context, builder, sig.args[0], args[0], args[1]), "acquire", 8)

    return types.int64(arr, i), codegen


@intrinsic
def load_seq_cst(typingctx, arr, i):
    """arr[i] (int64) read sequentially consistent (ordered with `fetch_add`s of other slots)."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(elem_ptr(context, builder, sig.args[0], args[0], args[1]), "seq_cst", 8)

    return types.int64(arr, i), codegen


@intrinsic
def store_release(typingctx, arr, i, v):
    """arr[i] = v (int64) with release ordering."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        p = elem_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store_atomic(context.cast(builder, args[2], sig.args[2], types.int64), p, "release", 8)
        return context.get_dummy_value()

    return types.void(arr, i, v), codegen


@intrinsic
def compare_and_swap(typingctx, arr, i, old, new):
    """arr[i] = new if arr[i] == old, atomically; whether it did."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        p = elem_ptr(context, builder, sig.args[0], args[0], args[1])
        o = context.cast(builder, args[2], sig.args[2], types.int64)
        n = context.cast(builder, args[3], sig.args[3], types.int64)
        return builder.extract_value(builder.cmpxchg(p, o, n, "acq_rel", "acquire"), 1)

    return types.boolean(arr, i, old, new), codegen


@intrinsic
def fetch_add(typingctx, arr, i, v):
    """arr[i] += v (int64), atomically and sequentially consistent; the old value."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        p = elem_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.atomic_rmw("add", p, context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")

    return types.int64(arr, i, v), codegen


@intrinsic
def pause(typingctx):
    """x86's spin-wait hint (elsewhere nothing)."""
    def codegen(context, builder, sig, args):
        if platform.machine() in ("x86_64", "AMD64"):
            builder.call(declare(builder, "llvm.x86.sse2.pause", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def sched_yield(typingctx):
    """Give the CPU to another runnable thread (sched_yield)."""
    def codegen(context, builder, sig, args):
        builder.call(declare(builder, "sched_yield", I32, []), [])
        return context.get_dummy_value()

    return types.void(), codegen


def _futex(builder, context, arrty, arr, i, op, val, timeout):
    """syscall(SYS_futex, &arr[i] (its low 32 bits), op, val, timeout)."""
    syscall = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I64, [I64], var_arg=True), "syscall")
    word = builder.bitcast(elem_ptr(context, builder, arrty, arr, i), I32.as_pointer())
    nr = SYS_FUTEX if SYS_FUTEX is not None else -1  # never called there: no thread sleeps
    return builder.call(syscall, [ir.Constant(I64, nr), word, ir.Constant(I32, op),
                                  builder.trunc(val, I32), timeout])


@intrinsic
def futex_wait(typingctx, arr, i, seen):
    """Sleep while arr[i]'s low 32 bits equal seen's, at most SLEEP_NS (FUTEX_WAIT)."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        ts = cgutils.alloca_once(builder, ir.LiteralStructType([I64, I64]))
        builder.store(ir.Constant(ir.LiteralStructType([I64, I64]), [SLEEP_NS // 10**9, SLEEP_NS % 10**9]), ts)
        _futex(builder, context, sig.args[0], args[0], args[1], FUTEX_WAIT_PRIVATE,
               context.cast(builder, args[2], sig.args[2], types.int64), ts)
        return context.get_dummy_value()

    return types.void(arr, i, seen), codegen


@intrinsic
def futex_wake(typingctx, arr, i):
    """Wake every thread sleeping on arr[i] (FUTEX_WAKE)."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        _futex(builder, context, sig.args[0], args[0], args[1], FUTEX_WAKE_PRIVATE, ir.Constant(I64, 2**31 - 1),
               ir.Constant(ir.IntType(8).as_pointer(), None))
        return context.get_dummy_value()

    return types.void(arr, i), codegen
