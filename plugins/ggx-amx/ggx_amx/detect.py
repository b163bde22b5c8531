"""Whether this process may use AMX, and in which mode: real tiles, the emulation, or not at all.

Real AMX needs the CPU flags amx-tile, amx-int8 and amx-bf16, the tile state enabled by the OS
(XCR0 bits 17-18) and, on Linux, the tile-data permission granted to the process
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` through ctypes). ggx-cpu's
`amx_support()` checks the three in that order and asks for the permission once per process,
before anything here compiles or runs an AMX instruction (ggml's `ggml_amx_init`).

`GGX_AMX_EMULATE=1` makes the buffer type available on any CPU with the tile instructions
replaced by a model of their int32 semantics (`ggx_amx.tiles`): for testing the layout and the
tiling loop where no AMX exists. It is labeled "emulated" wherever it shows, never real AMX.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

#: Set to 1 to use the emulated tile instructions (testing only; slow; correct on any CPU).
ENV_EMULATE = "GGX_AMX_EMULATE"


@dataclass(frozen=True)
class AmxMode:
    """What the plugin offers in this process: `engine` is "amx" (real tiles), "emulated", or
    None (nothing is registered); `reason` says why, for `ggx devices`."""

    engine: str | None
    reason: str

    @property
    def note(self) -> str:
        """The plugin's line in `ggx devices`."""
        if self.engine == "amx":
            return f"AMX: {self.reason}"
        if self.engine == "emulated":
            return f"AMX emulated ({ENV_EMULATE}=1, for testing only): {self.reason}"
        return f"AMX not available: {self.reason}"


def _emulate_requested() -> bool:
    return os.environ.get(ENV_EMULATE, "").strip() not in ("", "0")


def amx_mode(support: Callable[[], tuple[bool, str]] | None = None) -> AmxMode:
    """The mode for this process: emulated when $GGX_AMX_EMULATE asks for it, else real AMX when
    `support()` (default: ggx-cpu's `amx_support`, which requests the tile permission) says it
    is usable, else none, with its reason."""
    if support is None:
        from ggx_cpu.extension import amx_support as support
    usable, why = support()
    if _emulate_requested():
        real = "this CPU could run real AMX" if usable else f"real AMX is not available here: {why}"
        return AmxMode("emulated", f"tile instructions modeled in software; {real}")
    return AmxMode("amx" if usable else None, why)
