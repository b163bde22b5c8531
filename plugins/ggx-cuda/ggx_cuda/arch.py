"""Compute capability as ggml-cuda encodes it (common.cuh: 100 * major + 10 * minor) and the
hardware predicates its dispatch rules test. ggml asks `ggml_cuda_highest_compiled_arch(cc)`, the
newest architecture its binary was built for at or below the device's; ggx compiles every kernel
with NVRTC for the device's own architecture, so that is the device's cc itself. NVIDIA only
(ggx-cuda has no HIP / MUSA build)."""
from __future__ import annotations

PASCAL = 600
DP4A = 610  # __dp4a, the byte-wise dot product of MMVQ / MMQ
VOLTA = 700
TURING = 750
AMPERE = 800
ADA_LOVELACE = 890
HOPPER = 900
BLACKWELL = 1200
DGX_SPARK = 1210


def cc_int(cc: tuple[int, int]) -> int:
    """(major, minor) -> ggml's integer compute capability: (9, 0) -> 900."""
    return 100 * cc[0] + 10 * cc[1]


def fp16_mma_hardware_available(cc: int) -> bool:
    return cc >= VOLTA


def volta_mma_available(cc: int) -> bool:
    """Volta's tensor cores only (its mma shapes): the highest compiled arch is Volta's."""
    return VOLTA <= cc < TURING


def turing_mma_available(cc: int) -> bool:
    """Turing's tensor-core mma.sync and later (ggml's MMA kernels; ggx's int8 m16n8k16 MMQ path
    needs Ampere: `ampere_mma_available`)."""
    return cc >= TURING


def ampere_mma_available(cc: int) -> bool:
    return cc >= AMPERE
