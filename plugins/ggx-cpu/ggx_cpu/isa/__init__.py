"""ISA specialization of the quantized dot products (ggml's simd-mappings idea, in Python).

Variants, best first: `avx512_vnni` (vpdpbusd), `avx2` (vpmaddubsw + vpmaddwd), `portable`
(plain loops LLVM vectorizes on any target). The best one the host can execute is chosen from
`llvmlite.binding.get_host_cpu_features()`; `GGX_CPU_ISA=portable|avx2|avx512_vnni` forces
one, and asking for one the CPU lacks raises `GGXUnsupported` naming the missing features.

Kernels receive `token()` as their `isa` argument: its numba type selects the variant at
compile time (see `ggx_cpu.isa.simd`). The building blocks are importable per variant:
`ggx_cpu.isa.avx512_vnni.dot_u8s8` / `ggx_cpu.isa.avx2.dot_u8s8` (one 32-byte product),
`ggx_cpu.isa.vector` (row dots and 4x4 tiles for Q4_0/Q4_1/Q8_0 on any vector ISA) and
`ggx_cpu.isa.portable` (the same functions as plain loops, plus the K-quants).
"""
from __future__ import annotations

import functools
import os

from ggx.errors import GGXUnsupported

from .simd import IsaToken

VARIANTS = ("avx512_vnni", "avx2", "portable")  # best first
REQUIRES: dict[str, tuple[str, ...]] = {
    "avx512_vnni": ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
ENV_VAR = "GGX_CPU_ISA"


@functools.cache
def features() -> frozenset[str]:
    """The host CPU's feature names as LLVM reports them ('avx2', 'avx512vnni', ...)."""
    import llvmlite.binding as llb

    return frozenset(name for name, on in llb.get_host_cpu_features().items() if on)


def cpu_name() -> str:
    import llvmlite.binding as llb

    return llb.get_host_cpu_name()


def missing(variant: str) -> tuple[str, ...]:
    """The features `variant` needs that this CPU lacks (empty: it can run here)."""
    if variant not in REQUIRES:
        raise GGXUnsupported(f"unknown ISA variant {variant!r}; known: {', '.join(VARIANTS)}")
    have = features()
    return tuple(f for f in REQUIRES[variant] if f not in have)


def available() -> tuple[str, ...]:
    """Every variant this CPU can execute, best first."""
    return tuple(v for v in VARIANTS if not missing(v))


def select(name: str | None = None) -> str:
    """The variant to use: `name`, else $GGX_CPU_ISA, else the best available one."""
    return _select(name if name is not None else os.environ.get(ENV_VAR, ""), features())


@functools.cache
def _select(name: str, have: frozenset[str]) -> str:
    """select() for one requested name ('' = best available) on a CPU with features `have`;
    cached because every matmul call asks (a refusal raises, and exceptions are never cached)."""
    name = name.strip().lower()
    if not name:
        return available()[0]
    lack = missing(name)
    if lack:
        raise GGXUnsupported(f"{ENV_VAR}={name}: this CPU ({cpu_name()}) lacks {', '.join(lack)}; "
                             f"it can run {', '.join(available())}")
    return name


@functools.cache
def _token(name: str) -> IsaToken:
    return IsaToken(name)


def active() -> str:
    """The name of the variant the kernels use now (reads $GGX_CPU_ISA on every call)."""
    return select()


def token(name: str | None = None) -> IsaToken:
    """The `isa` argument for the kernels: the selected variant (or `name`, checked)."""
    return _token(select(name))
