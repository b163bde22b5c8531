"""ISA specialization of the quantized dot products (ggml's simd-mappings idea, in Python).

Variants, best first: `avx512_vnni` (vpdpbusd), `avx2` (vpmaddubsw + vpmaddwd), `portable`
(plain loops LLVM vectorizes on any target). A variant is offered where the CPU has its
features (`REQUIRES`, LLVM's host feature names) *and* the OS enabled its register state
(`STATE`, bits of XCR0; see `ggx_cpu.isa.host`). The best one offered is the default;
`GGX_CPU_ISA=portable|avx2|avx512_vnni` forces one, and asking for one the host cannot run
raises `GGXUnsupported` naming what is missing.

Kernels receive `token()` as their `isa` argument: its numba type selects the variant at
compile time (`ggx_cpu.isa.tokens`); `ggx_cpu.isa.dispatch` maps the ISA-generic 8-bit products
to each variant's module (`avx512_vnni`, `avx2`, `portable`). Kernels built on them:
`vector` (Q4_0/Q4_1/Q5_0/Q8_0), `vector_kquants` (Q4_K/Q6_K), `vector_avx512` (512-bit row quads)
and `portable` (plain loops). Other plugins use all this through `ggx_cpu.extension`.

This module imports no numba: `token()` loads it on first use.
"""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from ggx.errors import GGXUnsupported

from .host import XCR0_AVX, XCR0_AVX512, amx_support, cpu_name, describe_state, features, missing_state, xcr0

if TYPE_CHECKING:
    from .tokens import IsaToken

__all__ = ["VARIANTS", "REQUIRES", "STATE", "ENV_VAR", "features", "cpu_name", "xcr0", "amx_support",
           "missing", "available", "select", "active", "token"]

VARIANTS = ("avx512_vnni", "avx2", "portable")  # best first
#: CPU features each variant's code uses (the AVX-512 kernels use AVX2's byte shuffles and products too)
REQUIRES: dict[str, tuple[str, ...]] = {
    "avx512_vnni": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
#: XCR0 bits (register state the OS must save) each variant needs
STATE: dict[str, int] = {"avx512_vnni": XCR0_AVX512, "avx2": XCR0_AVX, "portable": 0}
ENV_VAR = "GGX_CPU_ISA"


def missing(variant: str, have: frozenset[str] | None = None, xcr0_bits: int | None = None) -> tuple[str, ...]:
    """What `variant` needs that this host (or the given features and XCR0) lacks: CPU feature
    names, then "OS state: ..." for register state the OS left disabled (empty: it can run)."""
    if variant not in REQUIRES:
        raise GGXUnsupported(f"unknown ISA variant {variant!r}; known: {', '.join(VARIANTS)}")
    have = features() if have is None else have
    lack = tuple(f for f in REQUIRES[variant] if f not in have)
    state = missing_state(STATE[variant], xcr0() if xcr0_bits is None else xcr0_bits)
    return lack + ((f"OS state: {describe_state(state)}",) if state else ())


def available() -> tuple[str, ...]:
    """Every variant this host can execute, best first."""
    return tuple(v for v in VARIANTS if not missing(v))


def select(name: str | None = None) -> str:
    """The variant to use: `name`, else $GGX_CPU_ISA, else the best available one."""
    return _select(name if name is not None else os.environ.get(ENV_VAR, ""), features(), xcr0())


@functools.cache
def _select(name: str, have: frozenset[str], xcr0_bits: int) -> str:
    """select() for one requested name ('' = best available) on a host with features `have` and
    XCR0 `xcr0_bits`; cached because every matmul call asks (a refusal raises, and exceptions
    are never cached)."""
    name = name.strip().lower()
    if not name:
        return next(v for v in VARIANTS if not missing(v, have, xcr0_bits))
    lack = missing(name, have, xcr0_bits)
    if lack:
        can = ", ".join(v for v in VARIANTS if not missing(v, have, xcr0_bits))
        raise GGXUnsupported(f"{ENV_VAR}={name}: this host ({cpu_name()}) lacks {', '.join(lack)}; it can run {can}")
    return name


def active() -> str:
    """The name of the variant the kernels use now (reads $GGX_CPU_ISA on every call)."""
    return select()


@functools.cache
def _token(name: str) -> IsaToken:
    from .tokens import IsaToken

    return IsaToken(name)


def token(name: str | None = None) -> IsaToken:
    """The `isa` argument for the kernels (an `IsaToken`): the selected variant (or `name`, checked)."""
    return _token(select(name))
