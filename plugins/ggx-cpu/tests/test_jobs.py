"""ggx_cpu.jobs: a job lends its stored arrays to the kernel without reference counting (two
threads running parts of one job would otherwise contend on the same counts at every call inside
the kernel), and still holds them until the job goes."""
from __future__ import annotations

import gc
import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ggx_cpu import jobs, pool
from ggx_cpu.extension import split


@intrinsic
def _meminfo_of(typingctx, arr):
    """The address of an array's meminfo (0: borrowed, nothing counted)."""
    def codegen(context, builder, sig, args):
        m = context.make_array(sig.args[0])(context, builder, args[0]).meminfo
        return builder.ptrtoint(m, ir.IntType(64))

    return types.int64(arr), codegen


@njit
def _inner(a, seen, part):
    seen[part] = _meminfo_of(a)
    a[part] += 1


@njit
def _lend(part, parts, a, seen):
    if 0 <= part < parts:
        _inner(a, seen, part)  # a call passing the arrays on, as kernels do


def test_a_job_lends_its_arrays_uncounted():
    a, seen = np.zeros(2, np.int64), np.full(2, -1, np.int64)
    run = split(_lend, a, seen, parts=2).planned(2)
    run()
    assert seen.tolist() == [0, 0]
    assert a.tolist() == [1, 1]


def test_a_one_thread_job_lends_them_too():
    a, seen = np.zeros(2, np.int64), np.full(2, -1, np.int64)
    job = jobs.job(_inner, (a, seen, 1), 0)
    pool.run(pool.pool().ctrl, job)
    assert seen[1] == 0 and a[1] == 1


def test_the_job_holds_its_arrays_until_it_goes():
    a, seen = np.zeros(2, np.int64), np.zeros(2, np.int64)
    before = sys.getrefcount(a)
    job = jobs.job(_inner, (a, seen, 0), 0)
    for _ in range(3):
        pool.run(pool.pool().ctrl, job)
    assert sys.getrefcount(a) == before + 1  # the stash's reference, not one per run
    del job
    gc.collect()
    assert sys.getrefcount(a) == before
