"""`ggx tune`: which of the CPU's buffer types is fastest for each weight type on this machine.

ggml picks an extra buffer type by a fixed priority (AMX before repack before plain memory), and
whether a path pays depends on the CPU (Ollama dropped its AMX build for that). ggx measures:
`tune(device)` times a MUL_MAT of a reference shape (`SHAPE`) for each weight type (`TYPES`) in
every candidate buffer type of the CPU device (plain memory, each extra buffer type a plugin
offers: CPU_REPACK, AMX, a third party's), at batch 1 (a decode step) and at a prompt batch of
`PROMPT` columns, and keeps the figures as a `Profile`. A weight's cost is the reference
workload over it: one `PROMPT`-token prompt and `DECODE` decode steps
(`Profile.workload_seconds`); `ggx.placement.BuftChooser` puts a candidate before the priority
order's choice only when its cost is lower by more than `placement.MARGIN`.

The profile belongs to one machine (`machine`: CPU model and flags, the ISA variant, the loaded
plugins' versions, ggx's version): kept in ggx's cache folder (`profile_path`), it is stale when
any of those changes, and a stale or missing profile leaves the priority order, saying why.
An emulated buffer type (`BufferType.emulated`, e.g. AMX_EMULATED) is never timed: its speed
means nothing. `GGX_TUNE_PROFILE` names another profile file, or "off" for the priority order.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import registry
from ._version import __version__
from .backend import BufferType, BufferUsage, Device
from .errors import GGXValueError
from .placement import BuftChooser, buft_list, supports_weight_op
from .progress import compile_seconds
from .types import GType

PROFILE_ENV = "GGX_TUNE_PROFILE"
CACHE_ENV = "GGX_CACHE_DIR"
FORMAT = 1  # the profile file's format version
#: weight types timed, most common first (a budget that runs out leaves the last ones unmeasured)
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_K", "F16")
SHAPE = (2048, 512)  # (K, M) of the reference weight: rows a multiple of 32, K of 256
PROMPT = 512  # columns of the prompt batch, and the reference workload's prompt length
DECODE = 128  # decode steps of the reference workload
BUDGET_S = 30.0

Progress = Callable[[int, int, str], None]  # (done, total, what is being timed)


def cache_dir() -> Path:
    """ggx's cache folder: $GGX_CACHE_DIR, else ~/.cache/ggx."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "ggx"


def profile_path() -> Path:
    """Where `ggx tune` keeps this machine's profile."""
    return cache_dir() / "tune" / "profile.json"


def machine(device: Device) -> dict:
    """What a profile measured on `device` is valid for: the CPU model and flags and the ISA
    variant (the device reg's "get_features"), the loaded plugins' versions and ggx's version."""
    get = device.reg.get_proc_address("get_features") if device.reg is not None else None
    feats = get() if get is not None else {}
    plugins = {(p.distribution or p.name): p.version or "" for p in registry.plugins() if p.status == registry.LOADED}
    return {"cpu": str(feats.get("cpu", device.description)), "isa": str(feats.get("isa", "")),
            "features": sorted(str(f) for f in feats.get("features", [])), "plugins": dict(sorted(plugins.items())),
            "ggx": __version__}


def _changed(old: dict, new: dict) -> str | None:
    """What differs between two `machine` records, in words (None: nothing)."""
    what = {"cpu": "the CPU model", "isa": "the ISA variant", "features": "the CPU flags",
            "plugins": "the plugin versions", "ggx": "ggx's version"}
    for key, words in what.items():
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if key == "plugins":
            diffs = [f"{n} {a.get(n, 'absent')} -> {b.get(n, 'absent')}" for n in sorted(set(a or {}) | set(b or {}))
                     if (a or {}).get(n) != (b or {}).get(n)]
            return f"{words} changed ({', '.join(diffs)})"
        if key == "features":
            gone, added = sorted(set(a or []) - set(b or [])), sorted(set(b or []) - set(a or []))
            return f"{words} changed ({' '.join(['-' + f for f in gone] + ['+' + f for f in added])})"
        return f"{words} changed ({a} -> {b})"
    return None


@dataclass
class Profile:
    """Measured seconds of one reference MUL_MAT per (buffer type, weight type, batch columns) on
    one machine (`machine`), with `n_threads` threads; `not_timed`: a buffer type or weight type
    that was not timed -> why not."""

    machine: dict
    n_threads: int
    timings: dict[tuple[str, str, int], float]
    not_timed: dict[str, str] = field(default_factory=dict)
    shape: tuple[int, int] = SHAPE
    prompt: int = PROMPT
    decode: int = DECODE
    created: str = ""

    @property
    def basis(self) -> str:
        return f"tune profile of {self.created or 'unknown date'}, {self.n_threads} threads"

    def seconds(self, buft: str, gtype: str, n: int) -> float | None:
        return self.timings.get((buft, gtype, n))

    def workload_seconds(self, buft: str, gtype: str, prompt: bool = True) -> float | None:
        """Seconds of one `prompt`-token prompt and `decode` decode steps over the reference
        weight of `gtype` in `buft` (None: not measured at both batches). `prompt` False: a weight
        a prompt reads for one row only (the output matrix: a prompt's logits are its last
        token's), so the prompt costs one more step at batch 1."""
        pp, tg = self.seconds(buft, gtype, self.prompt), self.seconds(buft, gtype, 1)
        if tg is None or (prompt and pp is None):
            return None
        return (pp if prompt else tg) + self.decode * tg

    def compare(self, buft: str, other: str, gtype: str, prompt: bool = True) -> str:
        """"0.60x CPU_REPACK for Q6_K on this CPU (batch 1: 0.74x, a 512-token prompt: 0.55x)":
        `buft`'s speed relative to `other` on the workload (`prompt` as in `workload_seconds`)
        and per batch."""
        def ratio(a: float | None, b: float | None) -> str:
            return f"{b / a:.2f}x" if a and b else "?"
        workload = ratio(self.workload_seconds(buft, gtype, prompt), self.workload_seconds(other, gtype, prompt))
        batch1 = ratio(self.seconds(buft, gtype, 1), self.seconds(other, gtype, 1))
        return (f"{workload} {other} for {gtype} on this CPU (batch 1: {batch1}, a {self.prompt}-token prompt: "
                f"{ratio(self.seconds(buft, gtype, self.prompt), self.seconds(other, gtype, self.prompt))})")

    def stale(self, current: dict) -> str | None:
        """Why this profile does not describe the machine `current` (a `machine` record), or None."""
        return _changed(self.machine, current)

    # --- the file ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "machine": self.machine, "n_threads": self.n_threads, "created": self.created,
                "shape": list(self.shape), "prompt": self.prompt, "decode": self.decode,
                "timings": [{"buft": b, "type": t, "n": n, "seconds": s} for (b, t, n), s in self.timings.items()],
                "not_timed": self.not_timed}

    @classmethod
    def from_json(cls, data: Mapping) -> Profile:
        """A profile from its JSON form; GGXValueError naming what is wrong."""
        try:
            if data.get("format") != FORMAT:
                raise GGXValueError(f"tune profile format {data.get('format')!r}, this ggx reads {FORMAT}")
            timings = {(str(r["buft"]), str(r["type"]), int(r["n"])): float(r["seconds"]) for r in data["timings"]}
            if any(not (s > 0 and np.isfinite(s)) for s in timings.values()):
                raise GGXValueError("tune profile has a time that is not a positive number")
            return cls(dict(data["machine"]), int(data["n_threads"]), timings, dict(data.get("not_timed", {})),
                       tuple(data["shape"]), int(data["prompt"]), int(data["decode"]), str(data.get("created", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise GGXValueError(f"tune profile is malformed ({type(e).__name__}: {e}); run `ggx tune` again") from None

    def save(self, path: Path | str | None = None) -> Path:
        path = Path(path) if path is not None else profile_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)  # a reader never sees half a file
        return path

    @classmethod
    def load(cls, path: Path | str) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise GGXValueError(f"cannot read tune profile {path}: {e}") from None
        return cls.from_json(data)


# --- the choice of a model load --------------------------------------------------------------------
def profile_for(host: Device, given: Profile | str | Path | bool | None = None) -> tuple[Profile | None, str]:
    """The profile a model load on `host` orders its weights by, or (None, why the priority order
    stands). `given`: a Profile (used as it is), a profile file, False (none), or None: the file
    $GGX_TUNE_PROFILE names ("off": none), else this machine's in the cache folder. A profile
    read from a file must describe this machine (`Profile.stale`); an unreadable one is an error
    when the caller named it, else the priority order with the reason (a load never fails for the
    cache's sake)."""
    if given is False:
        return None, "priority order (measured choice turned off)"
    if isinstance(given, Profile):
        return given, given.basis
    if given is None or given is True:
        env = os.environ.get(PROFILE_ENV, "").strip()
        if env.lower() in ("off", "0", "none"):
            return None, f"priority order ({PROFILE_ENV}={env})"
        path = Path(env) if env else profile_path()
    else:
        path = Path(given)
    if not path.exists():
        return None, "priority order (no tune profile for this machine: run `ggx tune`)"
    try:
        profile = Profile.load(path)
    except GGXValueError as e:
        if isinstance(given, str | Path):  # a file the caller named: their mistake to hear about
            raise
        return None, f"priority order ({e})"
    why = profile.stale(machine(host))
    if why is not None:
        return None, f"priority order (the tune profile is stale: {why}; run `ggx tune`)"
    return profile, profile.basis


def chooser(host: Device, tune_profile: Profile | str | Path | bool | None = None,
            buft_overrides: object = None) -> BuftChooser:
    """The `BuftChooser` of a model load on `host` (see `profile_for`, `placement.parse_buft_overrides`)."""
    profile, basis = profile_for(host, tune_profile)
    return BuftChooser(profile, buft_overrides, basis)


# --- measuring ----------------------------------------------------------------------------------------
def candidates(device: Device) -> list[BufferType]:
    """The buffer types a weight may take on `device` alone, best first (`placement.buft_list`)."""
    return buft_list([device])


def _weight_bytes(gtype: GType, K: int, M: int) -> np.ndarray:
    from .quants import quantize

    rows = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
    return quantize(rows, gtype).reshape(-1)


def _timer(device: Device, backend, buft: BufferType, gtype: GType, raw: np.ndarray, K: int, M: int, n: int):
    """A zero-argument call computing MUL_MAT(weight [K, M] in `buft`, x [K, n]), or the reason
    `buft` refuses it."""
    from .alloc import alloc_tensors
    from .graph import Context, build_graph
    from .host import tensor_array

    ctx = Context()
    w = ctx.tensor(gtype, (K, M), "tune.weight")
    x = ctx.tensor(GType.F32, (K, n), "tune.x")
    out = ctx.mul_mat(w, x)
    if not supports_weight_op(buft, w, out):
        return f"{buft.name} refuses MUL_MAT over {w.describe()}"
    alloc_tensors(buft, [w], BufferUsage.WEIGHTS)  # the graph's tensors keep their buffers
    alloc_tensors(device.buffer_type(), [x, out])
    w.buffer.set_tensor(w, raw, 0)
    tensor_array(x)[...] = np.random.default_rng(1).standard_normal((n, K)).astype(np.float32)
    graph = build_graph(out)

    def run() -> None:
        backend.graph_compute(graph)
        backend.synchronize()
    return run


def _median_seconds(run: Callable[[], None], min_calls: int, min_time: float) -> float:
    run()  # warm-up: compiles on a cold cache, binds the launches
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times)


def tune(device: Device | None = None, types: Sequence[str] = TYPES, shape: tuple[int, int] = SHAPE,
         prompt: int = PROMPT, budget_s: float = BUDGET_S, n_threads: int | None = None,
         progress: Progress | None = None) -> Profile:
    """Time every candidate buffer type of `device` (default: the host CPU device) on each weight
    type of `types` that at least two of them take, at batch 1 and at `prompt` columns, within
    about `budget_s` seconds of timing (compiling a kernel the first time is not counted; what is
    left when it runs out is not measured: those types keep the priority order). Emulated buffer
    types are listed in `not_timed`, never timed."""
    from .placement import host_device

    device = device or host_device()
    backend = device.init_backend(**({"n_threads": n_threads} if n_threads else {}))
    threads = int(getattr(backend, "n_threads", n_threads or 1))
    K, M = shape
    bufts = candidates(device)
    not_timed = {b.name: "emulated (its speed means nothing)" for b in bufts if b.emulated}
    timed = [b for b in bufts if not b.emulated]
    jobs = [(GType[t], b, n) for t in types for n in (1, prompt) for b in timed]
    # the budget is for timing: compiling a kernel the first time (kept in numba's disk cache)
    # moves the deadline by as long as it took
    compiled0 = compile_seconds()
    start = time.perf_counter()
    timings: dict[tuple[str, str, int], float] = {}
    raws: dict[GType, np.ndarray] = {}
    for i, (gtype, buft, n) in enumerate(jobs):
        what = f"{gtype.name} in {buft.name}, {'batch 1' if n == 1 else f'{n}-token prompt'}"
        if progress is not None:
            progress(i, len(jobs), what)
        if time.perf_counter() - start - (compile_seconds() - compiled0) > budget_s:
            not_timed.setdefault(f"{gtype.name}", f"out of time (budget {budget_s:g} s)")
            continue
        if gtype not in raws:
            takers = [b for b in timed if _takes(b, gtype, K, M)]
            raws[gtype] = _weight_bytes(gtype, K, M) if len(takers) >= 2 else np.empty(0, np.uint8)
        if not raws[gtype].size:
            continue  # one candidate or none: nothing to choose
        run = _timer(device, backend, buft, gtype, raws[gtype], K, M, n)
        if isinstance(run, str):
            continue
        timings[(buft.name, gtype.name, n)] = _median_seconds(run, 5 if n == 1 else 2, 0.05 if n == 1 else 0.0)
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    created = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return Profile(machine(device), threads, timings, not_timed, (K, M), prompt, DECODE, created)


def _takes(buft: BufferType, gtype: GType, K: int, M: int) -> bool:
    from .graph import Context

    ctx = Context()
    w = ctx.tensor(gtype, (K, M))
    return supports_weight_op(buft, w, ctx.mul_mat(w, ctx.tensor(GType.F32, (K, 1))))
