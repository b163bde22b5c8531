"""AMX tile instructions for numba kernels: real ones, or a software model of them, by one token.

A kernel takes an *engine* token (`engine("amx")` or `engine("emulated")`); its numba type
picks, at compile time, what `tile_begin`, `tile_step` and `tile_end` compile to:

- "amx": calls to small LLVM functions that hold the AMX instructions (`ldtilecfg`,
  `tilezero`, `tileloadd`, `tdpbssd`, `tilestored`, `tilerelease`) and carry the function
  attribute "target-features"="+amx-tile,+amx-int8". LLVM selects AMX instructions only inside
  them (the rest of the kernel is compiled for the host as usual), so the module compiles on any
  x86-64 host; without that attribute LLVM aborts the process ("Cannot select"), and running
  the code without AMX raises SIGILL. `engine("amx")` therefore exists only where ggx-cpu's
  `amx_support()` says AMX is usable (the tile permission granted): nothing here compiles or
  runs AMX code anywhere else.
- "emulated": the same instruction sequence run by a model with the instructions' int32
  semantics on a per-thread tile register file (`new_tile_state`): for testing the layout and
  the tiling loop where no AMX exists. Slow by design; never a speed figure.

Both run the one instruction sequence `STEP_2X2` (ggml's 2-2-4 pattern: two A tiles, two B
tiles, four C tiles), read from the same table: its real form is generated from it
(`_amx_step`), its emulated form interprets it (`_emu_step`).

Tiles (the configuration `TILE_CONFIG`, ggml's `ggml_tile_config_init`): 0-1 B, 8 rows x 64
bytes (16 weight rows x 32 int8 values in VNNI order, `layout.py`); 2-3 A, 16 rows x 32 bytes
(16 activation rows x 32 int8 values); 4-7 C, 16 rows x 16 int32. `tdpbssd` C += A . B:
C[m][n] += sum over k < 8, i < 4 of A[m][4k+i] * B[k][4n+i], signed bytes, int32 wrapping.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic, overload

from ggx.errors import GGXUnsupported
from ggx_cpu.extension import TokenType, declare, elem_ptr, register_token, token_constant

# --- the configuration and the step ------------------------------------------------------------------
#: rows and bytes per row of tiles 0..7 (B, B, A, A, C, C, C, C)
TILE_SHAPES = ((8, 64), (8, 64), (16, 32), (16, 32), (16, 64), (16, 64), (16, 64), (16, 64))


def _config() -> bytes:
    cfg = bytearray(64)
    cfg[0] = 1  # palette 1
    for t, (rows, colsb) in enumerate(TILE_SHAPES):
        cfg[16 + 2 * t: 18 + 2 * t] = colsb.to_bytes(2, "little")
        cfg[48 + t] = rows
    return bytes(cfg)


#: the 64-byte tile configuration (ldtilecfg's operand): palette_id, start_row, 14 reserved,
#: colsb[16] as uint16, rows[16] as uint8
TILE_CONFIG = _config()


def tile_config() -> np.ndarray:
    """TILE_CONFIG as the uint8 array kernels take."""
    return np.frombuffer(TILE_CONFIG, np.uint8).copy()

# instructions and operands of STEP_2X2
ZERO, LOAD, DPBSSD, STORE = 0, 1, 2, 3
A0, A1, B0, B1 = 0, 1, 2, 3
#: One K step of a 32 x 32 output block: C tile q (4 + q) = A (q & 1) . B (q >> 1), stored as
#: 16 x 16 int32 at c[256 q:]. Rows: (instruction, tile, operand, operand); LOAD's operand names
#: the memory (A0, A1, B0, B1), STORE's the C slot.
STEP_2X2 = (
    (ZERO, 4, 0, 0), (ZERO, 5, 0, 0), (ZERO, 6, 0, 0), (ZERO, 7, 0, 0),
    (LOAD, 2, A0, 0), (LOAD, 3, A1, 0), (LOAD, 0, B0, 0), (LOAD, 1, B1, 0),
    (DPBSSD, 4, 2, 0), (DPBSSD, 5, 3, 0), (DPBSSD, 6, 2, 1), (DPBSSD, 7, 3, 1),
    (STORE, 4, 0, 0), (STORE, 5, 1, 0), (STORE, 6, 2, 0), (STORE, 7, 3, 0),
)
C_SLOT = 256  # int32 per C tile in the kernels' C scratch


# --- the engine token ---------------------------------------------------------------------------------
class Engine:
    """The `eng` argument of the AMX kernels: "amx" (real tiles) or "emulated"."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Engine({self.name!r})"


class EngineType(TokenType):
    """numba type of an `Engine`; `engine_name` is "amx" or "emulated"."""

    def __init__(self, eng: Engine):
        self.engine_name = eng.name
        super().__init__(name=f"AmxEngine({eng.name})")


register_token(Engine, EngineType)
_ENGINES: dict[str, Engine] = {}


def engine(name: str, support=None) -> Engine:
    """The engine token `name`. "amx" only where AMX is usable (`support()`, default ggx-cpu's
    `amx_support`, which has requested the tile permission); GGXUnsupported otherwise, before
    anything is compiled."""
    if name not in ("amx", "emulated"):
        raise GGXUnsupported(f"AMX: unknown engine {name!r} (amx, emulated)")
    if name == "amx":
        if support is None:
            from ggx_cpu.extension import amx_support as support
        usable, why = support()
        if not usable:
            raise GGXUnsupported(f"AMX: real tile instructions cannot run here: {why}")
    eng = _ENGINES.get(name)
    if eng is None:
        eng = _ENGINES[name] = Engine(name)
    return eng


# --- the model: each instruction's semantics on the tile state --------------------------------------
#: Bytes of the emulated engine's tile register file, a uint8 array a kernel allocates per thread:
#: 8 tiles of up to 16 rows x 64 bytes, then the loaded configuration. The real engine ignores
#: it (its tiles are the CPU's).
STATE_BYTES = 8 * 1024 + 64
_CFG = 8 * 1024  # where the state keeps the configuration


@token_constant
def state_bytes(eng):
    """Bytes of the tile state array a kernel allocates per thread for `eng`: the model's
    register file (emulated), or none (real tiles are the CPU's)."""
    return STATE_BYTES if eng.engine_name == "emulated" else 0


@njit(cache=True, inline="always")
def _rows(T, t):
    return np.int64(T[_CFG + 48 + t])


@njit(cache=True, inline="always")
def _colsb(T, t):
    return np.int64(T[_CFG + 16 + 2 * t]) | (np.int64(T[_CFG + 17 + 2 * t]) << 8)


@njit(cache=True)
def emu_ldtilecfg(T, cfg):
    """ldtilecfg: load the configuration, zero every tile."""
    T[:_CFG] = 0
    for j in range(64):
        T[_CFG + j] = cfg[j]


@njit(cache=True)
def emu_tilezero(T, t):
    """tilezero: every byte of tile t to 0."""
    T[1024 * t: 1024 * (t + 1)] = 0


@njit(cache=True)
def emu_tileloadd(T, t, mem, off, stride):
    """tileloadd: row r of tile t = colsb bytes of `mem` (a byte array) at off + r * stride."""
    for r in range(_rows(T, t)):
        for j in range(_colsb(T, t)):
            T[1024 * t + 64 * r + j] = np.uint8(mem[off + r * stride + j])


@njit(cache=True, inline="always")
def _s8(x):
    v = np.int32(x)
    return v - 256 if v >= 128 else v


@njit(cache=True)
def emu_tdpbssd(T, c, a, b):
    """tdpbssd: C[m][n] += sum_k sum_i A[m][4k+i] * B[k][4n+i], every byte signed, int32 wrapping
    (k < colsb(A) / 4, n < colsb(C) / 4, m < rows(C))."""
    for m in range(_rows(T, c)):
        for n in range(_colsb(T, c) // 4):
            o = 1024 * c + 64 * m + 4 * n
            acc = np.int32(T[o]) | (np.int32(T[o + 1]) << 8) | (np.int32(T[o + 2]) << 16) | (np.int32(T[o + 3]) << 24)
            for k in range(_colsb(T, a) // 4):
                for i in range(4):
                    acc += _s8(T[1024 * a + 64 * m + 4 * k + i]) * _s8(T[1024 * b + 64 * k + 4 * n + i])
            for i in range(4):
                T[o + i] = np.uint8((acc >> (8 * i)) & 255)


@njit(cache=True)
def emu_tilestored(T, t, out, off, stride):
    """tilestored of a C tile: row r's int32 values to `out` (an int32 array) at element
    off + r * stride / 4."""
    for r in range(_rows(T, t)):
        for n in range(_colsb(T, t) // 4):
            o = 1024 * t + 64 * r + 4 * n
            out[off + r * (stride // 4) + n] = (np.int32(T[o]) | (np.int32(T[o + 1]) << 8)
                                                | (np.int32(T[o + 2]) << 16) | (np.int32(T[o + 3]) << 24))


@njit(cache=True)
def _emu_step(T, a, a0, a1, lda, b, b0, b1, ldb, c):
    """STEP_2X2 interpreted on the model."""
    for ins in STEP_2X2:
        op, t = ins[0], ins[1]
        if op == ZERO:
            emu_tilezero(T, t)
        elif op == LOAD:
            src = ins[2]
            if src == A0:
                emu_tileloadd(T, t, a, a0, lda)
            elif src == A1:
                emu_tileloadd(T, t, a, a1, lda)
            elif src == B0:
                emu_tileloadd(T, t, b, b0, ldb)
            else:
                emu_tileloadd(T, t, b, b1, ldb)
        elif op == DPBSSD:
            emu_tdpbssd(T, t, ins[2], ins[3])
        else:
            emu_tilestored(T, t, c, C_SLOT * ins[2], 64)


# --- the real instructions ------------------------------------------------------------------------------
AMX_FEATURES = '"target-features"="+amx-tile,+amx-int8"'
_I8, _I64 = ir.IntType(8), ir.IntType(64)
_PTR = _I8.as_pointer()


def _amx_function(module: ir.Module, name: str, args: list[ir.Type]) -> tuple[ir.Function, ir.IRBuilder | None]:
    """The internal function `name` of `module` carrying the AMX target features, and a builder
    for its body (None when the module already has it). Internal linkage: each module that
    calls it holds its own copy, so linked modules never clash; LLVM never inlines it into code
    compiled without those features."""
    fn = module.globals.get(name)
    if fn is not None:
        return fn, None
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), args), name)
    fn.linkage = "internal"
    # llvmlite's FunctionAttributes only accepts a fixed list of names; the string attribute is
    # added to the underlying set and printed as it is
    set.add(fn.attributes, AMX_FEATURES)
    set.add(fn.attributes, "nounwind")
    return fn, ir.IRBuilder(fn.append_basic_block())


def _i8(v: int) -> ir.Constant:
    return ir.Constant(_I8, v)


def _define_step(module: ir.Module) -> ir.Function:
    """`ggx_amx_step(a0, a1, lda, b0, b1, ldb, c)`: STEP_2X2 as AMX instructions."""
    fn, b = _amx_function(module, "ggx_amx_step", [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR])
    if b is None:
        return fn
    a0, a1, lda, b0, b1, ldb, c = fn.args
    mem = {A0: (a0, lda), A1: (a1, lda), B0: (b0, ldb), B1: (b1, ldb)}
    zero = declare(b, "llvm.x86.tilezero", ir.VoidType(), [_I8])
    load = declare(b, "llvm.x86.tileloadd64", ir.VoidType(), [_I8, _PTR, _I64])
    dp = declare(b, "llvm.x86.tdpbssd", ir.VoidType(), [_I8, _I8, _I8])
    store = declare(b, "llvm.x86.tilestored64", ir.VoidType(), [_I8, _PTR, _I64])
    for op, t, x, y in STEP_2X2:
        if op == ZERO:
            b.call(zero, [_i8(t)])
        elif op == LOAD:
            b.call(load, [_i8(t), *mem[x]])
        elif op == DPBSSD:
            b.call(dp, [_i8(t), _i8(x), _i8(y)])
        else:
            b.call(store, [_i8(t), b.gep(c, [ir.Constant(_I64, 4 * C_SLOT * x)]), ir.Constant(_I64, 64)])
    b.ret_void()
    return fn


def _bytes_ptr(context, builder, arrty, arr, off):
    return builder.bitcast(elem_ptr(context, builder, arrty, arr, off), _PTR)


@intrinsic
def _amx_step(typingctx, a, a0, a1, lda, bm, b0, b1, ldb, c):
    """STEP_2X2 on AMX: A tiles at bytes a0, a1 of `a` (rows lda bytes apart), B tiles at b0, b1
    of `bm` (rows ldb apart), the four C tiles to the int32 array c."""
    def codegen(context, builder, sig, args):
        fn = _define_step(builder.module)
        ta, tb, tc = sig.args[0], sig.args[4], sig.args[8]
        i64 = [context.cast(builder, args[k], sig.args[k], types.int64) for k in (1, 2, 3, 5, 6, 7)]
        builder.call(fn, [_bytes_ptr(context, builder, ta, args[0], i64[0]),
                          _bytes_ptr(context, builder, ta, args[0], i64[1]), i64[2],
                          _bytes_ptr(context, builder, tb, args[4], i64[3]),
                          _bytes_ptr(context, builder, tb, args[4], i64[4]), i64[5],
                          _bytes_ptr(context, builder, tc, args[8], ir.Constant(_I64, 0))])
        return context.get_dummy_value()

    return types.void(a, types.intp, types.intp, types.intp, bm, types.intp, types.intp, types.intp, c), codegen


@intrinsic
def _amx_config(typingctx, cfg):
    """ldtilecfg from the 64 bytes of the uint8 array cfg."""
    def codegen(context, builder, sig, args):
        fn, b = _amx_function(builder.module, "ggx_amx_config", [_PTR])
        if b is not None:
            b.call(declare(b, "llvm.x86.ldtilecfg", ir.VoidType(), [_PTR]), [fn.args[0]])
            b.ret_void()
        builder.call(fn, [_bytes_ptr(context, builder, sig.args[0], args[0], ir.Constant(_I64, 0))])
        return context.get_dummy_value()

    return types.void(cfg), codegen


@intrinsic
def _amx_release(typingctx):
    """tilerelease: the tile state back to its initial (unused) state."""
    def codegen(context, builder, sig, args):
        fn, b = _amx_function(builder.module, "ggx_amx_release", [])
        if b is not None:
            b.call(declare(b, "llvm.x86.tilerelease", ir.VoidType(), []), [])
            b.ret_void()
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


# --- what kernels call --------------------------------------------------------------------------------
def tile_begin(eng, T, cfg):
    """Load the tile configuration cfg (TILE_CONFIG) for this thread."""


def tile_step(eng, T, a, a0, a1, lda, b, b0, b1, ldb, c):
    """STEP_2X2: C q = A (q & 1) . B (q >> 1) for the A tiles at a0, a1 of byte array a (rows lda
    bytes apart) and the B tiles at b0, b1 of byte array b (rows ldb apart), stored to the int32
    array c (tile q at c[256 q:], 16 x 16 row-major)."""


def tile_end(eng, T):
    """Release this thread's tiles."""


def _is(eng, name: str) -> bool:
    return isinstance(eng, EngineType) and eng.engine_name == name


@overload(tile_begin, inline="always")
def _ol_begin(eng, T, cfg):
    if _is(eng, "amx"):
        return lambda eng, T, cfg: _amx_config(cfg)
    if _is(eng, "emulated"):
        return lambda eng, T, cfg: emu_ldtilecfg(T, cfg)


@overload(tile_step, inline="always")
def _ol_step(eng, T, a, a0, a1, lda, b, b0, b1, ldb, c):
    if _is(eng, "amx"):
        return lambda eng, T, a, a0, a1, lda, b, b0, b1, ldb, c: _amx_step(a, a0, a1, lda, b, b0, b1, ldb, c)
    if _is(eng, "emulated"):
        return lambda eng, T, a, a0, a1, lda, b, b0, b1, ldb, c: _emu_step(T, a, a0, a1, lda, b, b0, b1, ldb, c)


@overload(tile_end, inline="always")
def _ol_end(eng, T):
    if _is(eng, "amx"):
        return lambda eng, T: _amx_release()
    if _is(eng, "emulated"):
        return lambda eng, T: None
