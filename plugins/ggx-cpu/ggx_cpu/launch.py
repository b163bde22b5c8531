"""What a launch of ggx-cpu is: the zero-argument callable (ggx's `Launch`) that runs one node's
kernels, bound once (validation, layout checks and numba's argument typing paid at bind time).

- `launch(kernel, *args)`: a one-thread kernel's call (`KernelLaunch`), or for a kernel
  compiled `parallel=True` its numba parallel region on n_threads (`RegionLaunch`).
- `IndexCheck`: the check that an index tensor holds only values in range (its data is known
  only when the graph runs, so this runs before the kernel, every time).
- `in_order(*launches)`: one launch running others one after the other (`InOrder`).
- `split(kernel, *args, parts=n)`: a *split kernel* `kernel(part, parts, *args)`, written once:
  part -1 is its prologue (quantizing the activations every part reads), parts 0..parts-1 its
  work, part `parts` its epilogue (merging partial results). It does not say how it runs: the
  backend decides, per node, in one place (`CpuBackend.plan_for`), and `planned(launch,
  threads)` binds it either as a job of the worker pool on `threads` threads (`JobLaunch`: the
  parts claimed by the caller and threads - 1 workers, `pool`) or, for threads 0, as one
  compiled region over the parts (a `RegionLaunch` of `jobs.region(kernel)`). A split of one
  part is always a job (one call on the caller's thread, no region to start).
- `Deferred(fn, *args)`: a launch made anew at every compute (MUL_MAT_ID's columns depend on
  the ids' values), planned like the launches it makes.

For fusion every launch answers one question, `steps()` (`steps_of` for any callable): the
compiled jobs it is, in order, each with the launch to call for it alone; a step without a job
runs as it is (Python, or a parallel region, which `Step.region` says). `prepared.fuse` turns each
run of consecutive jobs into one compiled call (`SequenceLaunch`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numba
import numpy as np

from ggx.backend import Launch
from ggx.errors import GGXShapeError, GGXStateError, GGXValueError
from ggx.tensor import Tensor

from . import jobs, pool
from .jobs import entry, entry_for, typeof


class Step(NamedTuple):
    """One step of a launch: its compiled job (None: `launch` runs as it is), a check's failed
    word (a fused sequence stops after the job when it is set, and calls `launch` to raise), and
    whether it runs a numba parallel region."""

    job: np.ndarray | None
    flag: np.ndarray | None
    launch: Launch
    region: bool = False


def steps_of(f: Launch) -> list[Step]:
    """`f.steps()`, or for a callable made elsewhere (another plugin's launch) one step run as it is."""
    steps = getattr(f, "steps", None)
    return steps() if steps is not None else [Step(None, None, f)]


def planned(f: Launch, threads: int) -> Launch:
    """`f` with its split kernels bound as jobs of the worker pool on `threads` threads (the
    caller's included), or for 0 as parallel regions (the backend's choice, `CpuBackend.plan_for`);
    other launches as they are."""
    plan = getattr(f, "planned", None)
    return plan(threads) if plan is not None else f


# --- one-thread kernels and parallel regions -------------------------------------------------------------
class KernelLaunch:
    """A one-thread kernel's launch: `kernel(*args)` through its compiled entry point, a C-level
    call. The entry point is looked up at the first call: inside a fused sequence only the job
    runs (`steps`), and loading the kernel's own compiled form as well costs each kernel some
    milliseconds and half a MiB at start-up."""

    __slots__ = ("kernel", "args", "_entry")

    def __init__(self, kernel, args: tuple):
        self.kernel, self.args, self._entry = kernel, args, None

    def __call__(self) -> None:
        fn = self._entry
        if fn is None:
            fn = self._entry = entry_for(self.kernel, self.args)
        fn(*self.args)

    def steps(self) -> list[Step]:
        return [Step(jobs.job(self.kernel, self.args, 0), None, self)]


class RegionLaunch:
    """A numba parallel region: `entry(*args)` on n threads."""

    __slots__ = ("n", "entry", "args")

    def __init__(self, n: int, entry_point, args: tuple):
        self.n, self.entry, self.args = n, entry_point, args

    def __call__(self) -> None:
        jobs.set_region_threads(self.n)
        self.entry(*self.args)

    def steps(self) -> list[Step]:
        return [Step(None, None, self, True)]


def launch(kernel, *args, n_threads: int = 1) -> Launch:
    """kernel(*args) as a launch bound to the compiled entry point for these arguments' types,
    typed once (the entry point skips numba's per-call dispatch, ~0.1 us an argument, several
    us for the ISA token): a one-thread kernel at its first call or as its job (`steps`). A
    kernel compiled parallel=True runs its region on n_threads (ggx-cpu's own threaded kernels
    are split kernels instead: `split`)."""
    if kernel.targetoptions.get("parallel"):
        return RegionLaunch(jobs.region_threads(n_threads), entry_for(kernel, args), args)
    return KernelLaunch(kernel, args)


def nothing() -> None:
    """The launch of a node with no work (zero elements)."""


# --- index checks ---------------------------------------------------------------------------------------
@numba.njit(cache=True)
def check_indices(failed, arr, off, st, ne, bound):
    """Set failed[0] to 1 if the index tensor (arr, off, st, ne in elements) holds a value
    outside [0, bound)."""
    for i3 in range(ne[3]):
        for i2 in range(ne[2]):
            for i1 in range(ne[1]):
                for i0 in range(ne[0]):
                    v = arr[off + i0 * st[0] + i1 * st[1] + i2 * st[2] + i3 * st[3]]
                    if v < 0 or v >= bound:
                        failed[0] = 1
                        return


class IndexCheck:
    """The check that an I32/I64 index tensor holds only values in [0, bound). Called, it checks
    in Python and raises GGXShapeError naming the value; its step is the same check compiled
    (`check_indices`, setting `failed[0]`), at which a fused sequence stops to call this."""

    def __init__(self, t: Tensor, role: str, op: str, bound: int, arr: np.ndarray, off: int, st, ne):
        self.failed = np.zeros(1, np.int64)
        self.args = (self.failed, arr, off, st, ne, bound)
        self.what = f"{op}: {role} {t.describe()}"
        self.bound = bound
        self.view = np.lib.stride_tricks.as_strided(arr[off:], shape=ne[::-1],
                                                    strides=tuple(s * arr.itemsize for s in st[::-1]))
        self.one = int(off) if ne == (1, 1, 1, 1) else -1  # one token's row: read it directly
        self.arr = arr

    def __call__(self) -> None:
        self.failed[0] = 0
        if self.one >= 0:
            lo = hi = int(self.arr[self.one])
        else:
            lo, hi = int(self.view.min()), int(self.view.max())
        if lo < 0 or hi >= self.bound:
            raise GGXShapeError(f"{self.what} holds index {lo if lo < 0 else hi}, outside 0..{self.bound - 1}")

    def steps(self) -> list[Step]:
        return [Step(jobs.job(check_indices, self.args, 0), self.failed, self)]


# --- groups ---------------------------------------------------------------------------------------------
class InOrder:
    """One launch running `launches` one after the other (a check, then its kernel)."""

    __slots__ = ("launches",)

    def __init__(self, launches: tuple[Launch, ...]):
        self.launches = launches

    def __call__(self) -> None:
        for f in self.launches:
            f()

    def steps(self) -> list[Step]:
        return [s for f in self.launches for s in steps_of(f)]

    def planned(self, threads: int) -> InOrder:
        return InOrder(tuple(planned(f, threads) for f in self.launches))


def in_order(*launches: Launch) -> Launch:
    """One launch running `launches` one after the other."""
    return InOrder(launches)


class Deferred:
    """A launch made at every compute, `fn(*args)` (a data-dependent one: MUL_MAT_ID's columns
    grouped by the ids' values), then run, planned as the backend planned this one."""

    __slots__ = ("fn", "args", "threads")

    def __init__(self, fn: Callable[..., Launch], *args, threads: int = 0):
        self.fn, self.args, self.threads = fn, args, threads

    def __call__(self) -> None:
        planned(self.fn(*self.args), self.threads)()

    def planned(self, threads: int) -> Deferred:
        return Deferred(self.fn, *self.args, threads=threads)


# --- split kernels --------------------------------------------------------------------------------------
class SplitLaunch:
    """`kernel(part, parts, *args)` in `parts` parts, not yet planned: `planned(threads)` binds it
    as a job of the worker pool or as one parallel region over its parts (see the module
    docstring). Called unplanned (outside a backend) it runs as the region."""

    __slots__ = ("kernel", "args", "parts", "_region")

    def __init__(self, kernel, args: tuple, parts: int):
        if parts < 1:
            raise GGXValueError(f"a split kernel has at least 1 part, got {parts}")
        self.kernel, self.args, self.parts = kernel, args, parts
        self._region: Launch | None = None

    def planned(self, threads: int) -> Launch:
        """A job of the pool on `threads` threads (or of one part), else (0) the region (also for
        more parts than a job takes: pool.MAX_PARTS)."""
        if self.parts == 1 or (threads > 0 and self.parts <= pool.MAX_PARTS):
            return JobLaunch(self.kernel, self.args, self.parts, threads)
        region = jobs.region(self.kernel, len(self.args))
        args = (self.parts, *self.args)
        return RegionLaunch(jobs.region_threads(self.parts), entry_for(region, args), args)

    def __call__(self) -> None:
        if self._region is None:
            self._region = self.planned(0)
        self._region()

    def steps(self) -> list[Step]:
        return steps_of(self.planned(0))


def split(kernel, *args, parts: int) -> SplitLaunch:
    """The launch of split kernel `kernel(part, parts, *args)` (an njit function) in `parts` parts."""
    return SplitLaunch(kernel, args, parts)


class JobLaunch:
    """A split kernel as a job of the worker pool: part -1 on the caller, parts 0..parts-1 claimed
    by the caller and the pool's workers (at least threads - 1 of them started), part `parts` on
    the caller (`pool`). With the workers off ($GGX_CPU_WORKERS=0) every part runs on the
    caller's thread."""

    __slots__ = ("job", "ctrl", "entry")

    def __init__(self, kernel, args: tuple, parts: int, threads: int = 1):
        if not 1 <= parts <= pool.MAX_PARTS:
            raise GGXValueError(f"a job has 1..{pool.MAX_PARTS} parts, got {parts}")
        p = pool.pool()
        if parts > 1 and threads > 1 and pool.enabled():
            p.ensure(min(parts, threads))
        self.job = jobs.job(kernel, args, parts)
        self.ctrl = p.ctrl
        self.entry = entry(pool.run, (typeof(self.ctrl), typeof(self.job)))

    def __call__(self) -> None:
        self.entry(self.ctrl, self.job)

    def steps(self) -> list[Step]:
        return [Step(self.job, None, self)]


# --- fused sequences ------------------------------------------------------------------------------------
class SequenceLaunch:
    """Jobs run in order in one compiled call, no Python between them (`prepared.fuse`). A job
    may come with a flag (a check's failed word): when the job sets it, the sequence stops there
    and calls that step's launch, whose Python form raises the error."""

    def __init__(self, steps: list[Step]):
        p = pool.pool()
        self.steps_ = steps
        self.ctrl = p.ctrl
        self.addresses = np.array([s.job.ctypes.data for s in steps], np.int64)
        self.flag_addresses = np.array([0 if s.flag is None else s.flag.ctypes.data for s in steps], np.int64)
        self.entry = entry(pool.run_all, (typeof(p.ctrl), typeof(self.addresses), typeof(self.flag_addresses)))

    def __call__(self) -> None:
        self._stopped(self.entry(self.ctrl, self.addresses, self.flag_addresses))

    def run_step(self, i: int) -> None:
        """Step i alone, through the same compiled loop (for timing each step)."""
        self._stopped(self.entry(self.ctrl, self.addresses[i:i + 1], self.flag_addresses[i:i + 1]), i)

    def _stopped(self, at: int, first: int = 0) -> None:
        if at >= 0:
            self.steps_[first + at].launch()  # raises
            raise GGXStateError(f"a compiled check stopped the launches at {first + at}, but its Python form passed")
