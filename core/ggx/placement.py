"""Weight placement (ggml's select_buft / make_cpu_buft_list): which buffer type holds each weight.

A model loader asks `buft_list(devices)` for the buffer types its weights may go to, in
priority order, and `select_buft(weight, op, bufts)` picks the first whose device (or extra
buffer type) says yes to a representative op reading the weight from that buffer type. Each
device brings its own buffer types, in the order of the devices: a device with memory of its
own brings that memory and its pinned host type, every device brings its extra buffer types
(`ggx.registry.extra_buffer_types(device)`: AMX before repack on the CPU device), and a host device brings
its plain memory. So installing ggx-repack moves Q4_0 weights into the repack buffer with no
other change, uninstalling it falls back to plain host memory, and another plugin's device in
the list adds its own types without hiding the CPU's. `alloc_weights` then makes one WEIGHTS
buffer per chosen buffer type, and `PlacementReport` says what each candidate got, or why it
got nothing.

A `BuftChooser` makes that choice for a model load (`select`): a user's override
(`--override-tensor REGEX=BUFT`, `buft_overrides`) forces a weight's buffer type; else, for a
matrix product's weight, a measured profile (`ggx.tune`, `MeasuredCosts`) may put a faster
candidate before the priority order's choice, when it wins by more than `MARGIN`; else the
priority order stands. It keeps the figures behind each choice for the report.

A model run on several devices splits its layers over them (llama.cpp's split mode LAYER):
`layer_split(n_layer, devices, tensor_split)` gives each device a contiguous range of layers,
in proportion to `tensor_split` or to the devices' free memory, and the output layer to the
device of the last layer. A layer's weights then choose from `buft_list([its device, host])`
and its KV cache lives in its device's memory, so the scheduler runs the layer there.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from . import registry
from .alloc import alloc_tensors
from .backend import Buffer, BufferType, BufferUsage, Device, DeviceType, ExtraBufferType
from .errors import GGXUnsupported, GGXValueError
from .graph import Context
from .ops import Op
from .tensor import Tensor

__all__ = ["MARGIN", "BufferTypeUse", "BuftChooser", "DeviceLayers", "LayerSplit", "MeasuredCosts",
           "PlacementReport", "alloc_weights", "buft_list", "check_tensor_split", "host_device", "layer_split",
           "parse_buft_overrides", "run_host", "select_buft", "split_fractions", "supports_weight_op"]

OpBuilder = Callable[[Context, Tensor], Tensor]

#: The devices that run every op, preferred in this order as the host: ggml's CPU device (the
#: ggx-cpu plugin's, named as in ggml), then the built-in reference device.
HOST_DEVICE_NAMES = ("CPU", "ref")


def _has_host_memory(d: Device) -> bool:
    return d.type == DeviceType.CPU and d.buffer_type().is_host


def host_device(devices: Iterable[Device] | None = None) -> Device:
    """The device whose backend runs what no other device can and whose memory is the fallback
    for weights (ggml's CPU device): the CPU-type host device named "CPU", else "ref", else the
    first CPU-type host device. Picked by name rather than by listing order, because another
    plugin's CPU-type device (which may run only a few ops) can be listed before it.
    """
    if devices is None:
        devices = registry.devices()
    cpus = [d for d in devices if _has_host_memory(d)]
    if not cpus:
        raise GGXUnsupported("no CPU device with host memory is available")
    for name in HOST_DEVICE_NAMES:
        for d in cpus:
            if d.name == name:
                return d
    return cpus[0]


def run_host(devices: Sequence[Device]) -> Device:
    """The host CPU device of a run on `devices`: the one of them that runs every op ("CPU",
    else "ref"), else `host_device()`, which the run then appends to its devices (so a plugin's
    device that runs only a few ops gets the CPU as fallback)."""
    for name in HOST_DEVICE_NAMES:
        for d in devices:
            if d.name == name and _has_host_memory(d):
                return d
    return host_device()


def buft_list(devices: Sequence[Device]) -> list[BufferType]:
    """Buffer types for the weights of a model run on `devices`, best first, duplicates removed.

    Per device, in the order given (the first is the main device; the host CPU comes last):
    a device that is not host memory brings its own memory and its pinned host type; each
    device brings its own extra buffer types; a host device brings its plain memory.
    """
    out: list[BufferType] = []
    for d in devices:
        host = _has_host_memory(d)
        if not host:
            out.append(d.buffer_type())
            pinned = d.host_buffer_type()
            if pinned is not None:
                out.append(pinned)
        out.extend(registry.extra_buffer_types(d))
        if host:
            out.append(d.buffer_type())
    uniq: list[BufferType] = []
    for b in out:
        if not any(b is u for u in uniq):
            uniq.append(b)
    return uniq


def _stand_in(weight: Tensor, op: Tensor, buffer: Buffer) -> Tensor:
    """A copy of `op` reading a copy of `weight` placed in `buffer` (the real tensors untouched)."""
    w = Tensor(weight.type, weight.ne, weight.nb, name=weight.name, ndim=weight.ndim)
    w.flags = weight.flags
    w.buffer, w.offset = buffer, 0
    src = tuple(w if s is weight else s for s in op.src)
    probe = Tensor(op.type, op.ne, op.nb, op=op.op, params=op.params, src=src, name=op.name, ndim=op.ndim)
    probe.flags = op.flags
    return probe


def supports_weight_op(buft: BufferType, weight: Tensor, op: Tensor) -> bool:
    """Would `op` (reading `weight`) run with the weight stored in `buft`? (ggml's weight_buft_supported)

    The question is put to a stand-in copy of the op over a stand-in weight in an empty buffer of
    `buft`, so the weight and the op themselves are never touched (the weight may be in use).
    """
    if weight not in op.src:
        raise GGXUnsupported(f"the representative op {op.op.name} does not read {weight.describe()}")
    return _why_refused(buft, weight, op) is None


def _why_refused(buft: BufferType, weight: Tensor, op: Tensor) -> str | None:
    """None when `buft` can hold `weight` for `op`, else why not."""
    try:
        probe = buft.alloc_buffer(0)  # empty: only its buffer type and usage matter to supports_op
    except Exception as e:  # noqa: BLE001 - a buffer type that cannot make an empty buffer is not usable here
        return f"cannot allocate a buffer ({type(e).__name__}: {e})"
    probe.usage = BufferUsage.WEIGHTS
    stand_in = _stand_in(weight, op, probe)
    ok = buft.supports_op(stand_in) if isinstance(buft, ExtraBufferType) else buft.device.supports_op(stand_in)
    return None if ok else f"refused {op.op.name} over {weight.describe()}"


def select_buft(weight: Tensor, op: Tensor | OpBuilder, bufts: Iterable[BufferType],
                refusals: dict[BufferType, str] | None = None) -> BufferType:
    """The first buffer type of `bufts` in which `op` over `weight` is supported.

    `op` is a representative op reading the weight, or a builder `op(ctx, weight) -> Tensor`.
    `refusals`, when given, keeps each buffer type's first refusal (for `PlacementReport`).
    Raises GGXUnsupported naming the weight when none fits.
    """
    if callable(op) and not isinstance(op, Tensor):
        op = op(Context(), weight)
    if weight not in op.src:
        raise GGXUnsupported(f"the representative op {op.op.name} does not read {weight.describe()}")
    bufts = list(bufts)
    for b in bufts:
        why = _why_refused(b, weight, op)
        if why is None:
            return b
        if refusals is not None:
            refusals.setdefault(b, why)
    names = ", ".join(b.name for b in bufts) or "none"
    raise GGXUnsupported(f"weight {weight.describe()}: no buffer type supports {op.op.name} over it "
                         f"(tried {names})")


#: A candidate chosen over the priority order's choice by a measured profile must be this much
#: faster on the reference workload (its time * (1 + MARGIN) < the priority choice's): timing
#: noise between two tunes then cannot flip a choice back and forth.
MARGIN = 0.10
#: The margin for a choice that costs a second copy of a weight: a tied output matrix leaves the
#: embedding's buffer type (where it is the embedding itself) only for one this much faster on
#: its workload (Gemma 3's copy would be 178 MB, ~30 % of its resident memory).
COPY_MARGIN = 0.5


class MeasuredCosts(Protocol):
    """What a `BuftChooser` asks of a measured profile (`ggx.tune.Profile`)."""

    #: what the figures are, for the report ("tune profile of 2026-12-05, 2 threads")
    basis: str

    def workload_seconds(self, buft: str, gtype: str, prompt: bool = True) -> float | None:
        """Seconds of the reference workload over one weight of type `gtype` in buffer type `buft`
        (one 512-token prompt and 128 decode steps; `prompt` False: a weight a prompt reads for
        one row only), or None when not measured."""

    def compare(self, buft: str, other: str, gtype: str, prompt: bool = True) -> str:
        """`buft`'s speed relative to `other` for `gtype` on the workload (`prompt` as in
        `workload_seconds`), for messages: "0.60x CPU_REPACK for Q6_K on this CPU (batch 1: 0.74x,
        a 512-token prompt: 0.55x)"."""


def parse_buft_overrides(overrides: Mapping[str, str] | Iterable[str | tuple[str | re.Pattern, str]] | None
                         ) -> list[tuple[re.Pattern, str]]:
    """(pattern, buffer type name) pairs from `{REGEX: BUFT}`, ("REGEX", "BUFT") pairs or
    "REGEX=BUFT" strings (llama.cpp's --override-tensor; a string may hold several, comma-separated).
    GGXValueError names a malformed item or a pattern that is not a regular expression."""
    if overrides is None:
        return []
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    out = []
    for item in items:
        pairs: list[tuple[str, str]] = []
        if isinstance(item, str):
            for part in item.split(","):
                pattern, eq, name = part.rpartition("=")
                if not eq or not pattern or not name.strip():
                    raise GGXValueError(f"buffer type override {part!r}: expected REGEX=BUFT, e.g. "
                                        "'ffn_.*=CPU' (the buffer type names are in `ggx devices`)")
                pairs.append((pattern, name))
        else:
            try:
                pattern, name = item
            except (TypeError, ValueError):
                raise GGXValueError(f"buffer type override {item!r}: expected (REGEX, BUFT)") from None
            pairs.append((pattern, name))
        for pattern, name in pairs:
            if not isinstance(pattern, str | re.Pattern) or not isinstance(name, str) or not name.strip():
                raise GGXValueError(f"buffer type override {pattern!r}={name!r}: both must be non-empty strings")
            try:
                out.append((re.compile(pattern), name.strip()))
            except re.error as e:
                raise GGXValueError(f"buffer type override {pattern!r}: not a regular expression ({e})") from None
    return out


@dataclass
class BuftChooser:
    """Chooses each weight's buffer type for one model load (see the module docstring).

    `costs`: a measured profile for the host's buffer types, or None (the priority order;
    `basis` then says why there is none). `overrides`: see `parse_buft_overrides`; the first
    pattern that matches a weight's name (`re.search`, as llama.cpp) forces its buffer type, found
    by name among the weight's candidates. `notes` keeps, per buffer type, the figures behind the
    choices that involved it; `losses` why a measured candidate lost (for a type left unused)."""

    costs: MeasuredCosts | None = None
    overrides: Mapping[str, str] | Iterable[str | tuple[str | re.Pattern, str]] | None = ()
    basis: str = "priority order"
    notes: dict[int, list[str]] = field(default_factory=dict)
    losses: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.overrides = parse_buft_overrides(self.overrides)
        if self.costs is not None:
            self.basis = self.costs.basis

    def _note(self, buft: BufferType, text: str) -> None:
        kept = self.notes.setdefault(id(buft), [])
        if text not in kept:
            kept.append(text)

    def select(self, weight: Tensor, op: Tensor | OpBuilder, bufts: Iterable[BufferType],
               refusals: dict[BufferType, str] | None = None, margin: float = MARGIN) -> BufferType:
        """The buffer type of `weight` (read by `op`) among `bufts` (in priority order); a measured
        one replaces the priority choice when faster by `margin`."""
        if callable(op) and not isinstance(op, Tensor):
            op = op(Context(), weight)
        bufts = list(bufts)
        for pattern, name in self.overrides:
            if pattern.search(weight.name or ""):
                return self._forced(weight, op, bufts, pattern, name)
        first = select_buft(weight, op, bufts, refusals)
        if self.costs is None or op.op not in (Op.MUL_MAT, Op.MUL_MAT_ID):
            return first
        gtype = weight.type.name
        b_ne = op.src[1].ne
        prompt = b_ne[1] * b_ne[2] * b_ne[3] > 1  # the representative op's rows: 1 for the output matrix
        base = self.costs.workload_seconds(first.name, gtype, prompt)
        if base is None:  # the priority choice was not measured (a device's own memory, emulation)
            return first
        timed = [(s, b) for b in bufts if b is not first
                 for s in [self.costs.workload_seconds(b.name, gtype, prompt)] if s is not None
                 and _why_refused(b, weight, op) is None]
        best_s, best = min(timed, key=lambda x: x[0], default=(base, first))
        if best is not first and best_s * (1 + margin) < base:
            self._note(best, f"{gtype} {base / best_s:.2f}x {first.name}")
            self.losses.setdefault(id(first),
                                   f"{first.name} {self.costs.compare(first.name, best.name, gtype, prompt)}")
            return best
        for s, b in timed:
            if b is not first:
                self._note(first, f"{gtype} {s / base:.2f}x {b.name}")
                if s >= base:
                    self.losses.setdefault(id(b), f"{b.name} {self.costs.compare(b.name, first.name, gtype, prompt)}")
                else:
                    self.losses.setdefault(id(b), f"{b.name} {base / s:.2f}x {first.name} for {gtype} on this "
                                                  f"CPU, within the {margin:.0%} margin: the priority order stands")
        return first

    def _forced(self, weight: Tensor, op: Tensor, bufts: list[BufferType], pattern: re.Pattern,
                name: str) -> BufferType:
        found = [b for b in bufts if b.name.upper() == name.upper()]
        if not found:
            names = ", ".join(b.name for b in bufts) or "none"
            raise GGXValueError(f"buffer type override {pattern.pattern}={name}: weight {weight.name!r} has no "
                                f"candidate buffer type {name!r} (its candidates: {names})")
        why = _why_refused(found[0], weight, op)
        if why is not None:
            raise GGXUnsupported(f"buffer type override {pattern.pattern}={name}: {found[0].name} cannot hold "
                                 f"{weight.describe()}: {why}")
        self._note(found[0], f"forced by {pattern.pattern}={name}")
        return found[0]


@dataclass(frozen=True)
class BufferTypeUse:
    """One candidate buffer type of a placement: what it holds, or why it holds nothing."""

    name: str  # the buffer type's name ("CPU_REPACK", "CPU")
    device: str  # the name of the device it belongs to
    n_tensors: int
    nbytes: int  # bytes of the tensors placed there (their ggml size)
    skipped: str = ""  # for a candidate that got nothing: why (its first refusal); "" when used
    #: the measured figures (or override) behind choices that involved it ("Q4_0 1.80x AMX")
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """"CPU_REPACK 52.1 MiB (182 tensors; Q4_0 1.80x AMX)": a used one, with its figures."""
        notes = "; " + ", ".join(self.notes) if self.notes else ""
        return f"{self.name} {self.nbytes / 2**20:.1f} MiB ({self.n_tensors} tensors{notes})"


@dataclass(frozen=True)
class PlacementReport:
    """Where a model's weights went: every candidate buffer type, in priority order, and what the
    choice was based on (`basis`: "priority order", or the measured profile)."""

    bufts: tuple[BufferTypeUse, ...]
    basis: str = "priority order"

    @classmethod
    def of(cls, placed: Iterable[tuple[Tensor, BufferType]], candidates: Sequence[BufferType],
           refusals: Mapping[BufferType, str] | None = None,
           chooser: BuftChooser | None = None) -> PlacementReport:
        """The report of `placed` (tensor, buffer type) pairs over the `candidates` list; a buffer
        type placed but not a candidate (chosen by the loader directly) is listed after them.
        `chooser` adds its figures and the reason a measured candidate got nothing."""
        refusals = dict(refusals or {})
        if chooser is not None:  # a measured loss says more than the refusal of some weight's op
            for b in candidates:
                if id(b) in chooser.losses:
                    refusals[b] = chooser.losses[id(b)]
        order = list(candidates)
        counts: dict[int, list[int]] = {}
        for t, b in placed:
            if not any(b is c for c in order):
                order.append(b)
            n = counts.setdefault(id(b), [0, 0])
            n[0] += 1
            n[1] += t.nbytes
        uses = []
        for b in order:
            n_tensors, nbytes = counts.get(id(b), (0, 0))
            skipped = "" if n_tensors else refusals.get(b, "not needed: every weight fitted an earlier buffer type")
            notes = tuple(chooser.notes.get(id(b), ())) if chooser is not None and n_tensors else ()
            uses.append(BufferTypeUse(b.name, b.device.name, n_tensors, nbytes, skipped, notes))
        return cls(tuple(uses), chooser.basis if chooser is not None else "priority order")

    @property
    def used(self) -> list[BufferTypeUse]:
        return [u for u in self.bufts if u.n_tensors]

    @property
    def skipped(self) -> list[BufferTypeUse]:
        return [u for u in self.bufts if not u.n_tensors]

    def __str__(self) -> str:
        used = ", ".join(u.describe() for u in self.used)
        skipped = "; ".join(f"{u.name}: {u.skipped}" for u in self.skipped)
        return used + (f"; skipped {skipped}" if skipped else "") + f" (by {self.basis})"


def alloc_weights(placement: Mapping[Tensor, BufferType] | Iterable[tuple[Tensor, BufferType]]) -> list[Buffer]:
    """One WEIGHTS buffer per buffer type, holding its tensors at aligned offsets (no data set).

    Tensors are placed back to back in the order given; `init_tensor` is called for each.
    """
    items = placement.items() if isinstance(placement, Mapping) else placement
    groups: dict[int, tuple[BufferType, list[Tensor]]] = {}
    for t, buft in items:
        if t.view_src is not None:
            raise GGXUnsupported(f"weight {t.describe()} is a view; place its source instead")
        groups.setdefault(id(buft), (buft, []))[1].append(t)
    return [alloc_tensors(buft, tensors, BufferUsage.WEIGHTS) for buft, tensors in groups.values()]


# --- layer split ------------------------------------------------------------------------------
def check_tensor_split(tensor_split: Sequence[float], n_devices: int | None = None) -> list[float]:
    """`tensor_split` as floats, checked: finite, non-negative, not all zero, and (when
    `n_devices` is given) one per split device. Raises GGXValueError saying what is wrong,
    so a bad `--tensor-split` is refused before any weight is loaded."""
    try:
        values = [float(v) for v in tensor_split]
    except (TypeError, ValueError):
        raise GGXValueError(f"tensor_split must be numbers, got {tensor_split!r}") from None
    if not values:
        raise GGXValueError("tensor_split is empty: give one share per split device")
    bad = [v for v in values if not math.isfinite(v) or v < 0]
    if bad:
        raise GGXValueError(f"tensor_split shares must be finite and non-negative, got {bad[0]:g} in {values}")
    if not any(values):
        raise GGXValueError(f"tensor_split shares are all zero ({values}): at least one device must take layers")
    if n_devices is not None and len(values) != n_devices:
        raise GGXValueError(f"tensor_split has {len(values)} shares for {n_devices} split device"
                            f"{'s' if n_devices != 1 else ''}: give one per device")
    return values


def split_fractions(devices: Sequence[Device], tensor_split: Sequence[float] | None = None) -> list[Fraction]:
    """Each split device's share of the layers, normalized to sum to 1 (exact fractions).

    From `tensor_split` when given, else from each device's free memory (`Device.memory()[0]`,
    as llama.cpp does); equal shares when no device reports free memory.
    """
    if not devices:
        raise GGXValueError("a layer split needs at least one device")
    if tensor_split is not None:
        # by the shortest decimal of each share: 0.3,0.1 is exactly 3,1
        raw = [Fraction(repr(v)) for v in check_tensor_split(tensor_split, len(devices))]
    else:
        raw = [Fraction(max(int(d.memory()[0]), 0)) for d in devices]
        if not any(raw):
            raw = [Fraction(1)] * len(devices)
    total = sum(raw)
    return [r / total for r in raw]


@dataclass(frozen=True)
class DeviceLayers:
    """One split device's part of a layer split: layers [start, stop) and maybe the output."""

    device: Device
    start: int
    stop: int  # one past its last layer; start == stop when it has none
    output: bool  # holds the output layer (output_norm, output.weight)
    fraction: float  # its normalized share

    @property
    def n_layers(self) -> int:
        return self.stop - self.start

    def __str__(self) -> str:
        if not self.n_layers:
            return f"{self.device.name} {'output' if self.output else 'no layers'}"
        span = f"layer {self.start}" if self.n_layers == 1 else f"layers {self.start}-{self.stop - 1}"
        return f"{self.device.name} {span}{' + output' if self.output else ''}"


@dataclass(frozen=True)
class LayerSplit:
    """Which device each layer of a model runs on (llama.cpp's split mode LAYER).

    `layers[il]` is the device of layer il, `output` the device of the output layer, `devices`
    the split devices in the order given and `fractions` their normalized shares. Built by
    `layer_split`; `str()` reads e.g. "RAY0 layers 0-14, CPU layers 15-29 + output".
    """

    devices: tuple[Device, ...]
    fractions: tuple[float, ...]
    layers: tuple[Device, ...]
    output: Device

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    def device_of(self, il: int | None) -> Device:
        """The device of layer `il`; None is the output layer."""
        return self.output if il is None else self.layers[il]

    @property
    def parts(self) -> tuple[DeviceLayers, ...]:
        """Per split device, in order, its layer range and whether it holds the output."""
        out = []
        for d, frac in zip(self.devices, self.fractions):
            mine = [il for il, ld in enumerate(self.layers) if ld is d]
            start, stop = (mine[0], mine[-1] + 1) if mine else (0, 0)
            out.append(DeviceLayers(d, start, stop, self.output is d, frac))
        return tuple(out)

    @property
    def used(self) -> tuple[DeviceLayers, ...]:
        """The parts holding a layer or the output."""
        return tuple(p for p in self.parts if p.n_layers or p.output)

    def __str__(self) -> str:
        return ", ".join(str(p) for p in self.used)


def layer_split(n_layer: int, devices: Sequence[Device], tensor_split: Sequence[float] | None = None) -> LayerSplit:
    """Split `n_layer` layers over `devices` in contiguous ranges, in their order (llama.cpp's
    llm_load_tensors with split mode LAYER).

    The shares come from `split_fractions` (`tensor_split`, else free memory). With the
    cumulative shares c_0 <= c_1 <= ... = 1, layer il goes to the first device whose c_i exceeds
    il / n_layer (upper_bound), so device i gets about fraction_i * n_layer layers and a device
    whose share is 0 gets none. The output layer goes to the device of the last layer (the token
    embedding is not split: the model keeps it in host memory, as llama.cpp keeps tok_embd on the
    CPU, its get_rows reading one row per token). Shares are compared exactly (fractions), so
    equal shares of an even layer count split it in equal halves.
    """
    if n_layer < 0:
        raise GGXValueError(f"n_layer must be 0 or more, got {n_layer}")
    fractions = split_fractions(devices, tensor_split)
    cum: list[Fraction] = []
    acc = Fraction(0)
    for f in fractions:
        acc += f
        cum.append(acc)
    last = max(i for i, f in enumerate(fractions) if f)  # the last device taking a share: its c_i is 1
    layers = []
    for il in range(n_layer):
        x = Fraction(il, n_layer)
        i = next((j for j, c in enumerate(cum) if c > x), last)
        layers.append(devices[i])
    output = layers[-1] if layers else devices[last]
    return LayerSplit(tuple(devices), tuple(float(f) for f in fractions), tuple(layers), output)
