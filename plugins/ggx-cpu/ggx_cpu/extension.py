"""ggx-cpu's extension surface: what another plugin (an extra buffer type with its own kernels,
such as ggx-repack or ggx-amx) builds its numba kernels from. Import only from here; every
other module of ggx-cpu is internal and may change. Each name's docstring gives its semantics
and layout; docs/plugin-authoring.md ("Extending ggx-cpu") walks through a kernel.

Launches (`ggx_cpu.launch`)
    `launch(kernel, *args, n_threads=1)`: a numba kernel bound to its compiled entry point, as
    the zero-argument `Launch` that `ExtraBufferType.prepare_forward` returns. `in_order(*launches)`.
    `split(kernel, *args, parts=n)`: the launch of a *split kernel*, an njit `kernel(part, parts,
    *args)` written once: part -1 (a prologue) first, parts 0..parts-1 once each, part `parts`
    (an epilogue) last. ggx-cpu's backend decides how it runs: as jobs of its worker pool
    (parts claimed by whichever thread runs; with the workers off, one parallel region). `Deferred(fn,
    *args)`: a launch made at every compute by `fn(*args)` (data-dependent, as MUL_MAT_ID's),
    planned like the launches it makes.

ISA variants and dispatch
    `select(name=None)` / `available()` / `VARIANTS`: the variants ("avx512_vnni", "avx2",
    "portable") this host can run, checked against CPU flags and the OS-enabled register state.
    `token(name=None)`: the `isa` argument of a kernel; its numba type (`IsaType`, attribute
    `isa_name`) makes the kernel compile once per variant. The products `dot_u8s8`, `dot_s8s8`,
    `dot_u8s8_scaled` and the constant `u8s8_saturates` take the token first and specialize to
    the variant's instructions: one kernel source, no dispatch table of your own.
    `amx_support()`: (usable, reason) for AMX tiles, the OS permission requested once;
    `amx_status(features, xcr0, request_permission)`: the same decision as a pure function of
    its inputs (to exercise the refused paths without the hardware).

Compile-time tokens of your own
    Subclass `TokenType`, `register_token(YourClass, YourType)`; `@token_constant` turns a
    function of the token's type into a jit-callable constant.

Activation quantizers (ggml's vec_dot_types, as a structure of arrays: see `Q8Act`)
    `quantize_rows_q8` (Q8_0 / Q8_1) and `quantize_rows_q8_K`, callable inside kernels;
    `act_launch` / `quantize_act` from the host.

Extra buffer types (`ggx_cpu.traits`, ggml's ggml-cpu/traits.h; numba-free, so a plugin's
buffer module may import it from there at discovery)
    `CpuExtraBufferType(device)`: the base of an extra buffer type of the CPU device (CPU_REPACK,
    AMX): device, alignment, the size check, `why_not` (`matmul_problem`, then your `refusal(op)`)
    kept per op node, `supports_op`, and `prepare_forward` (refusal, empty node) calling your
    `bind(op, n_threads)`; you give `name`, `buffer_class`, `get_alloc_size`, `refusal`, `bind`.
    `expert_offsets(op, per_expert_nbytes)`: a MUL_MAT_ID's used experts' byte offsets and their
    `ExpertColumns`. `buft_of(tensor)`: the buffer type its data lives in.

Matrix products of an extra buffer type
    `matmul_problem(op, buft)`: why a MUL_MAT / MUL_MAT_ID node does not fit a kernel of `buft`
    reading host memory (weight in buft, activations, ids, destination), or None.
    `expert_columns(ids, n_expert, b_ne1)`: MUL_MAT_ID's columns grouped by expert
    (`ExpertColumns`: used experts, their column ranges, each column's activation row and
    output row), the ids checked.
    `token_experts(op, base, step)`: one token's MUL_MAT_ID as fixed columns and a launch that
    checks the ids and writes each slot's weight offset at every compute (`TokenExperts`), so
    that a decode step's product is bound once; None for more tokens.

SIMD vocabulary (LLVM vectors in numba; `ggx_cpu.isa.simd` conventions: element offsets,
unaligned, unchecked)
    types `Vec`, `I8x16`, `I8x32`, `I16x16`, `I32x8`, `F32x8`; loads, stores, splats, lane-wise
    arithmetic, horizontal sum, nibble expansion (and Q5_0's fifth bits), f16 conversion, prefetch; `make_shuffled_load`
    for loads that spread values over lanes; `llvm_type`, `elem_ptr`, `load_vector`,
    `declare` for writing intrinsics of your own.
"""
from __future__ import annotations

from .isa import VARIANTS, amx_support, available, select, token
from .isa.codegen import declare, elem_ptr, load_vector
from .isa.dispatch import dot_s8s8, dot_u8s8, dot_u8s8_scaled, u8s8_saturates
from .isa.host import amx_status
from .isa.simd import (
    F32x8,
    I8x16,
    I8x32,
    I16x16,
    I32x8,
    Vec,
    add_f32x8,
    add_i32x8,
    at,
    bits_to_f32,
    f16_at,
    f16_bits_to_f32,
    fma_f32x8,
    fma_i32x8_f32x8,
    hsum_f32x8,
    i32x8_to_f32x8,
    lane,
    llvm_type,
    load_bf16x8,
    load_f16x8,
    load_f32x8,
    load_i8x16,
    load_i8x32,
    load_i16x16,
    load_i32x8,
    make_shuffled_load,
    mul_f32x8,
    mul_i32x8,
    nibbles_at,
    nibbles_i8x32,
    or_bits16_at,
    prefetch,
    splat_f16_at,
    splat_f32x8,
    splat_i32x8,
    split_nibbles_i8x32,
    store_f32x8,
    store_i32x8,
    sub_f32x8,
    sub_i32x8,
    xor80_i8x32,
    zero_f32x8,
    zero_i32x8,
)
from .isa.tokens import IsaType, TokenType, register_token, token_constant
from .kernels.extra_matmul import ExpertColumns, expert_columns, matmul_problem
from .kernels.matmul import TokenExperts, token_experts
from .kernels.quantize_act import Q8Act, act_launch, quantize_act, quantize_rows_q8, quantize_rows_q8_K
from .launch import Deferred, in_order, launch, split
from .traits import CpuExtraBufferType, buft_of, expert_offsets

__all__ = [
    # launches
    "launch", "in_order", "split", "Deferred",
    # ISA variants and dispatch
    "VARIANTS", "available", "select", "token", "IsaType", "amx_support", "amx_status",
    "dot_u8s8", "dot_s8s8", "dot_u8s8_scaled", "u8s8_saturates",
    # tokens
    "TokenType", "register_token", "token_constant",
    # activation quantizers
    "Q8Act", "act_launch", "quantize_act", "quantize_rows_q8", "quantize_rows_q8_K",
    # extra buffer types
    "CpuExtraBufferType", "buft_of", "expert_offsets",
    # matrix products of an extra buffer type
    "matmul_problem", "ExpertColumns", "expert_columns", "TokenExperts", "token_experts",
    # SIMD vocabulary: types
    "Vec", "I8x16", "I8x32", "I16x16", "I32x8", "F32x8",
    # loads and stores
    "load_i8x16", "load_i8x32", "load_i16x16", "load_i32x8", "load_f32x8", "load_f16x8", "load_bf16x8",
    "make_shuffled_load", "store_f32x8", "store_i32x8", "at", "f16_at", "prefetch",
    # constants, splats, lane-wise arithmetic, reductions
    "zero_i32x8", "zero_f32x8", "splat_i32x8", "splat_f32x8", "splat_f16_at",
    "add_i32x8", "sub_i32x8", "mul_i32x8", "add_f32x8", "sub_f32x8", "mul_f32x8",
    "fma_f32x8", "fma_i32x8_f32x8", "i32x8_to_f32x8", "hsum_f32x8", "lane", "xor80_i8x32",
    # nibbles and scalar conversions
    "nibbles_i8x32", "nibbles_at", "split_nibbles_i8x32", "or_bits16_at", "f16_bits_to_f32", "bits_to_f32",
    # writing intrinsics
    "llvm_type", "elem_ptr", "load_vector", "declare",
]
