"""The tile instructions: the configuration bytes, the emulated model against numpy, the real
engine refused where AMX is not usable, and the real kernels' generated assembly, compiled in a
subprocess (LLVM aborts the whole process if AMX code is ever compiled without the AMX target
features, and running it here would raise SIGILL: it is never run)."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import njit

from ggx.errors import GGXUnsupported
from ggx_amx.tiles import (
    STATE_BYTES,
    STEP_2X2,
    TILE_CONFIG,
    emu_ldtilecfg,
    emu_tdpbssd,
    emu_tileloadd,
    emu_tilestored,
    engine,
    tile_begin,
    tile_config,
    tile_end,
    tile_step,
)


def test_tile_config_is_ggml_s():
    """palette 1; tiles 0-1: 8 rows x 64 B (B), 2-3: 16 x 32 B (A), 4-7: 16 x 64 B (C)."""
    cfg = tile_config()
    assert cfg.dtype == np.uint8 and cfg.size == 64 and bytes(cfg) == TILE_CONFIG
    assert cfg[0] == 1 and not cfg[1:16].any()
    colsb = cfg[16:48].view("<u2")
    assert list(colsb[:8]) == [64, 64, 32, 32, 64, 64, 64, 64] and not colsb[8:].any()
    assert list(cfg[48:56]) == [8, 8, 16, 16, 16, 16, 16, 16] and not cfg[56:].any()


def tdpbssd_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C [16, 16] int32 = A [16 rows, 32 int8] . B [8 rows, 64 int8] in VNNI order:
    C[m][n] = sum over k, i of A[m][4k+i] * B[k][4n+i]."""
    bb = b.reshape(8, 16, 4).transpose(1, 0, 2).reshape(16, 32)  # row n: B[k][4n+i] in k, i order
    return (a.astype(np.int64) @ bb.astype(np.int64).T).astype(np.int32)


@njit(cache=True)
def emulated_step(eng, a, a0, a1, lda, b, b0, b1, c, cfg):
    T = np.zeros(STATE_BYTES, np.uint8)
    tile_begin(eng, T, cfg)
    tile_step(eng, T, a, a0, a1, lda, b, b0, b1, 64, c)
    tile_end(eng, T)


def test_the_emulated_step_is_tdpbssd():
    """STEP_2X2 on the model: C q = A (q & 1) . B (q >> 1), the extremes of int8 included, A rows
    read `lda` bytes apart."""
    rng = np.random.default_rng(0)
    lda = 80
    a = rng.integers(-128, 128, 32 * lda, dtype=np.int8)
    a[:32] = -128  # row 0: every product at its extreme
    b = rng.integers(-128, 128, 2 * 512 + 7, dtype=np.int8)
    for k in range(8):  # column 0 (each B row's first dword) of the first B tile
        b[7 + 64 * k: 7 + 64 * k + 4] = -128
    c = np.full(4 * 256, -1, np.int32)
    emulated_step(engine("emulated"), a, 0, 16 * lda, lda, b, 7, 7 + 512, c, tile_config())
    A = [np.stack([a[r * lda: r * lda + 32] for r in range(16 * h, 16 * h + 16)]) for h in (0, 1)]
    B = [b[7 + 512 * h: 7 + 512 * h + 512].reshape(8, 64) for h in (0, 1)]
    for q in range(4):
        assert np.array_equal(c[256 * q: 256 * q + 256].reshape(16, 16), tdpbssd_ref(A[q & 1], B[q >> 1])), q
    assert c[0] == 32 * 128 * 128  # (-128) * (-128) over the 32 values of row 0 and column 0


def test_the_model_accumulates_and_follows_the_configuration():
    """tdpbssd adds to C (tilezero is the step's job), loads/stores take `stride`, and the
    shapes come from the configuration loaded (here: A with 8 of its 32 bytes per row)."""
    T = np.zeros(STATE_BYTES, np.uint8)
    cfg = tile_config()
    cfg[16 + 2 * 2] = 8  # A tile 2: 8 bytes (2 dwords) per row
    emu_ldtilecfg(T, cfg)
    rng = np.random.default_rng(1)
    a = rng.integers(-128, 128, 16 * 40, dtype=np.int8)
    b = rng.integers(-128, 128, 8 * 64, dtype=np.int8)
    emu_tileloadd(T, 2, a, 0, 40)
    emu_tileloadd(T, 0, b, 0, 64)
    c0 = rng.integers(-1000, 1000, 256, dtype=np.int32)
    emu_tileloadd(T, 4, c0.view(np.int8), 0, 64)
    emu_tdpbssd(T, 4, 2, 0)
    out = np.zeros(16 * 20, np.int32)
    emu_tilestored(T, 4, out, 0, 80)  # rows 80 bytes (20 int32) apart
    A = np.zeros((16, 32), np.int8)
    A[:, :8] = a.reshape(16, 40)[:, :8]
    want = c0.reshape(16, 16) + tdpbssd_ref(A, np.concatenate([b[:128], np.zeros(384, np.int8)]).reshape(8, 64))
    assert np.array_equal(out.reshape(16, 20)[:, :16], want)


def test_the_step_is_the_2_2_4_pattern():
    loads = [(t, src) for op, t, src, _ in STEP_2X2 if op == 1]
    dots = [(c, a, b) for op, c, a, b in STEP_2X2 if op == 2]
    assert loads == [(2, 0), (3, 1), (0, 2), (1, 3)]  # A0, A1 -> tiles 2, 3; B0, B1 -> tiles 0, 1
    assert dots == [(4, 2, 0), (5, 3, 0), (6, 2, 1), (7, 3, 1)]


def test_the_real_engine_needs_usable_amx():
    with pytest.raises(GGXUnsupported, match="cannot run here: arch_prctl"):
        engine("amx", support=lambda: (False, "arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed"))
    with pytest.raises(GGXUnsupported, match="unknown engine"):
        engine("avx")
    assert engine("amx", support=lambda: (True, "AMX tiles enabled")).name == "amx"  # a token only: nothing runs


# --- the real kernels' assembly ----------------------------------------------------------------------
ASM_SCRIPT = textwrap.dedent("""
    import json, sys
    import numba, numpy as np
    from ggx.types import GType
    from ggx_cpu.extension import token
    from ggx_amx.kernels import amx_mm
    from ggx_amx.layout import FORMATS
    from ggx_amx.tiles import Engine, tile_config

    out = {}
    for name in sys.argv[1:]:
        z = np.zeros(2, np.int64)
        args = (0, 1, token(), Engine("amx"), FORMATS[GType[name]], np.zeros(64, np.uint8), z, 256, 32,
                np.zeros(64, np.int8), np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.int32),
                z, z, z, True, tile_config(), np.zeros(4, np.float32), z, z, z)
        sig = tuple(numba.typeof(a) for a in args)
        amx_mm.compile(sig)  # compiled only: never called
        out[name] = amx_mm.inspect_asm(sig)
    print(json.dumps(out))
""")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="AMX code is x86-64 only: this host cannot compile it")
def test_the_real_kernels_emit_amx_instructions(tmp_path):
    """Each format's real kernel (engine "amx"): compiled, never run, in a subprocess with a
    numba cache of its own (a kernel loaded from the disk cache has no assembly to show; the
    tile code lives in the callees, compiled here from source). Its assembly holds ldtilecfg,
    tilezero, tileloadd, tdpbssd (the 2-2-4 dots: tmm4 += tmm2 . tmm0, ...), tilestored and
    tilerelease. (The emulated kernels hold none: they run on this CPU, which would fault on one.)"""
    names = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", ASM_SCRIPT, *names], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    asm = json.loads(run.stdout.strip().splitlines()[-1])
    for name in names:
        real = asm[name]
        for mnemonic in ("ldtilecfg", "tilezero", "tileloadd", "tdpbssd", "tilestored", "tilerelease"):
            assert mnemonic in real, (name, mnemonic)
        for c, a, b in ((4, 2, 0), (5, 3, 0), (6, 2, 1), (7, 3, 1)):  # AT&T order: src2, src1, dst
            assert f"tdpbssd\t%tmm{b}, %tmm{a}, %tmm{c}" in real, (name, c, a, b)
