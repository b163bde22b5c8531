"""What this host can execute: the CPU's features, the register state its OS enabled, AMX's permission.

A CPU flag alone does not make an instruction usable: the OS must also save and restore the
registers it uses on a context switch, which it says by setting bits of XCR0 (read with
`xgetbv`, legal only when CPUID reports OSXSAVE), as ggml's CPU feature detection checks:
bits 1-2 (SSE, AVX state) for any AVX instruction, bits 5-7 (opmask, ZMM_Hi256, Hi16_ZMM) as
well for AVX-512, bits 17-18 (XTILECFG, XTILEDATA) for AMX. Linux additionally gives a process
AMX's tile data only after it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`).

CPUID and XGETBV are run through a two-instruction function compiled by llvmlite (no numba
import). Where they cannot be run (not x86-64, or the compile fails) XCR0 reads as 0: no AVX
state, so only the portable variant is offered, which runs everywhere.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

XCR0_AVX = 0b110  # SSE and AVX (YMM) state: every AVX / AVX2 / FMA / F16C instruction
XCR0_AVX512 = XCR0_AVX | 0b1110_0000  # plus opmask, ZMM_Hi256, Hi16_ZMM
XCR0_AMX = (1 << 17) | (1 << 18)  # XTILECFG, XTILEDATA
AMX_FEATURES = ("amx-tile", "amx-int8", "amx-bf16")  # LLVM's names of Linux's amx_tile, amx_int8, amx_bf16

_OSXSAVE = 1 << 27  # CPUID leaf 1, ECX: the OS enabled XSAVE, so XGETBV may run
_SYS_ARCH_PRCTL = 158  # x86-64 Linux syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.cache
def features() -> frozenset[str]:
    """The host CPU's feature names as LLVM reports them ('avx2', 'avx512vnni', 'amx-int8', ...)."""
    import llvmlite.binding as llb

    return frozenset(name for name, on in llb.get_host_cpu_features().items() if on)


def cpu_name() -> str:
    """LLVM's name of the host CPU ('znver4', 'sapphirerapids', ...)."""
    import llvmlite.binding as llb

    return llb.get_host_cpu_name()


def missing_state(need: int, xcr0: int) -> int:
    """The XCR0 bits of `need` that `xcr0` lacks (0: the OS saves every register it needs)."""
    return need & ~xcr0


def describe_state(bits: int) -> str:
    """Names of XCR0 state components, for messages ('AVX (YMM), ZMM_Hi256')."""
    names = {1: "SSE", 2: "AVX (YMM)", 5: "opmask", 6: "ZMM_Hi256", 7: "Hi16_ZMM", 17: "XTILECFG", 18: "XTILEDATA"}
    return ", ".join(names.get(i, f"bit {i}") for i in range(64) if bits >> i & 1)


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def xcr0() -> int:
    """XCR0 as the OS set it: 0 where XGETBV may not run (no OSXSAVE), or cannot be run from here."""
    if not _is_x86_64():
        return 0
    try:
        return _read_xcr0()
    except (OSError, RuntimeError, ValueError):
        return 0


def _read_xcr0() -> int:
    """CPUID leaf 1, then (when it reports OSXSAVE) XGETBV(0), through a JIT-compiled module."""
    import llvmlite.binding as llb
    from llvmlite import ir

    llb.initialize_native_target()
    llb.initialize_native_asmprinter()
    llb.initialize_native_asmparser()  # inline assembly; without it LLVM aborts the process
    i32, i64 = ir.IntType(32), ir.IntType(64)
    mod = ir.Module("ggx_cpu_host_probes")
    mod.triple = llb.get_process_triple()

    def asm_function(name: str, asm: str, constraints: str, n_in: int, n_out: int, pick) -> None:
        fn = ir.Function(mod, ir.FunctionType(i64, [i32] * n_in), name)
        b = ir.IRBuilder(fn.append_basic_block())
        regs = b.asm(ir.FunctionType(ir.LiteralStructType([i32] * n_out), [i32] * n_in), asm, constraints,
                     list(fn.args), side_effect=True)
        b.ret(pick(b, [b.zext(b.extract_value(regs, k), i64) for k in range(n_out)]))

    asm_function("cpuid_ecx", "cpuid", "={eax},={ebx},={ecx},={edx},{eax},{ecx}", 2, 4, lambda b, r: r[2])
    asm_function("xgetbv", "xgetbv", "={eax},={edx},{ecx}", 1, 2,
                 lambda b, r: b.or_(r[0], b.shl(r[1], ir.Constant(i64, 32))))
    module = llb.parse_assembly(str(mod))
    module.verify()
    engine = llb.create_mcjit_compiler(module, llb.Target.from_default_triple().create_target_machine())
    engine.finalize_object()
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    cpuid_ecx = ctypes.CFUNCTYPE(u64, u32, u32)(engine.get_function_address("cpuid_ecx"))
    if not cpuid_ecx(1, 0) & _OSXSAVE:  # XGETBV would fault
        return 0
    return int(ctypes.CFUNCTYPE(u64, u32)(engine.get_function_address("xgetbv"))(0))  # engine alive here


# --- AMX ------------------------------------------------------------------------------------------
def amx_status(have: frozenset[str], xcr0_bits: int, request_permission) -> tuple[bool, str]:
    """(usable, reason) of AMX given the CPU's features, XCR0 and the OS permission request
    (`request_permission()` -> None when granted, else why not); a pure function of its inputs."""
    lack = [f for f in AMX_FEATURES if f not in have]
    if lack:
        return False, f"this CPU lacks {', '.join(lack)}"
    state = missing_state(XCR0_AMX, xcr0_bits)
    if state:
        return False, f"the OS has not enabled the AMX register state ({describe_state(state)} off in XCR0)"
    refused = request_permission()
    if refused:
        return False, refused
    return True, "AMX tiles enabled"


def _request_xtiledata() -> str | None:
    """Linux: ask for AMX's tile data (ggml's ggml_amx_init); None when granted, else why not."""
    if not sys.platform.startswith("linux") or not _is_x86_64():
        return f"requesting AMX tile permission is only implemented on x86-64 Linux, not {sys.platform}"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                      ctypes.c_long(_XFEATURE_XTILEDATA))
    if rc != 0:
        err = ctypes.get_errno()
        return f"arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: {os.strerror(err)}"
    return None


@functools.cache
def amx_support() -> tuple[bool, str]:
    """(usable, reason): whether AMX tile instructions (amx-tile, amx-int8, amx-bf16) can run in
    this process. Checks the CPU flags, XCR0's tile state, then (once per process, and only when
    both hold) asks Linux for the tile data permission."""
    return amx_status(features(), xcr0(), _request_xtiledata)
