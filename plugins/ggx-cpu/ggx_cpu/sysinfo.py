"""What ggx-cpu tells about the host: the CPU's name, the ISA variant the kernels use and the
CPU's features, the default thread count, and the "get_features" capability. (The host's
memory figures are the core's `ggx.host.host_memory`.)

Only `isa_info` imports the ISA layer (and so numba); the rest reads the system.
"""
from __future__ import annotations

import functools
import os

from ggx.errors import GGXUnsupported

#: The features worth a word in the device description, in this order.
KEY_FEATURES = ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "avx512bf16",
                "avxvnni", "amx-tile", "amx-int8", "neon", "sve")


@functools.cache
def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo), else LLVM's name for it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import llvmlite.binding as llb

    return llb.get_host_cpu_name()


def isa_info() -> tuple[str, list[str]]:
    """(the ISA variant the kernels use, the CPU's features). A $GGX_CPU_ISA naming a variant
    this CPU cannot run shows as "unavailable (why)": listing devices must not fail on it."""
    from . import isa

    try:
        active = isa.active()
    except GGXUnsupported as e:
        active = f"unavailable ({e})"
    return active, sorted(isa.features())


def description() -> str:
    """The device description: the CPU's name, the ISA variant and the key features."""
    active, feats = isa_info()
    shown = " ".join(f.upper() for f in KEY_FEATURES if f in feats)
    return f"{cpu_model()} ({active}{': ' + shown if shown else ''})"


def default_threads() -> int:
    return os.cpu_count() or 1


def get_features() -> dict:
    """The CPU's identity and what the kernels use on it (the "get_features" capability)."""
    active, feats = isa_info()
    return {"cpu": cpu_model(), "isa": active, "features": feats, "n_threads_default": default_threads(),
            "threading_layer": os.environ.get("NUMBA_THREADING_LAYER", "default")}
