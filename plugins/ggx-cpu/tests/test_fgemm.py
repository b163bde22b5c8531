"""ggx_cpu.isa.fgemm: the register-tiled F32 GEMM (ggml's simd_gemm order, bit for bit), the 8x8
transposed packing, and the micro-kernel's machine code (FMAs on full vectors, no spills)."""
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest
from numba import njit

from ggx_cpu.isa import vmath
from ggx_cpu.isa.fgemm import gemm, micro_kernel, pack_transposed_8x8

FORMS = [vmath.float_simd_form("avx512"), vmath.float_simd_form("avx2")]


@njit(cache=True)
def _gemm(fs, c, co, ldc, a, ao, lda, b, bo, ldb, m, n, k):
    gemm(fs, c, co, ldc, a, ao, lda, b, bo, ldb, m, n, k)


def simd_gemm_model(c, a, b):
    """C += A B with each element summed over k in order, one FMA per step (ggml's simd_gemm)."""
    acc = c.astype(np.float32)
    for kk in range(a.shape[1]):
        acc = (np.float64(a[:, kk: kk + 1]) * np.float64(b[kk: kk + 1, :]) + np.float64(acc)).astype(np.float32)
    return acc


@pytest.mark.parametrize("fs", FORMS, ids=lambda f: f.form)
@pytest.mark.parametrize("n,k", [(64, 64), (80, 17), (256, 1), (16, 0)])
def test_gemm_sums_in_ggmls_order(fs, n, k):
    """Full tiles and narrow column tiles; C accumulates (+=), also with strides and offsets."""
    rng = np.random.default_rng(n + k)
    m = 3 * fs.tile_rows
    lda, ldb, ldc = k + 3, n + 8, n + 5
    a = rng.standard_normal(7 + m * lda).astype(np.float32)
    b = rng.standard_normal(5 + max(k, 1) * ldb).astype(np.float32)
    c = rng.standard_normal(2 + m * ldc).astype(np.float32)
    am = a[7: 7 + m * lda].reshape(m, lda)[:, :k]
    bm = b[5: 5 + k * ldb].reshape(k, ldb)[:, :n]
    want = simd_gemm_model(c[2: 2 + m * ldc].reshape(m, ldc)[:, :n], am, bm)
    _gemm(fs, c, 2, ldc, a, 7, lda, b, 5, ldb, m, n, k)
    got = c[2: 2 + m * ldc].reshape(m, ldc)[:, :n]
    assert np.array_equal(got, want)


@njit(cache=True)
def _pack(dst, src):
    pack_transposed_8x8(dst, 3, 11, src, 5, 13)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pack_transposed_8x8(dtype):
    src = (np.arange(5 + 13 * 8 + 8) * 0.25 - 20).astype(dtype)
    dst = np.full(3 + 11 * 8 + 8, -1.0, np.float32)
    _pack(dst, src.view(np.uint16) if dtype == np.float16 else src)
    rows = np.array([[src[5 + j * 13 + i] for i in range(8)] for j in range(8)], np.float32)
    got = np.array([[dst[3 + i * 11 + j] for j in range(8)] for i in range(8)])
    assert np.array_equal(got, rows.T)
    assert (dst[:3] == -1).all() and dst[3 + 8] == -1  # nothing written outside the block


def loop_body(asm: str) -> list[str]:
    """The instructions of the loop holding the first FMA: from its label to the branch back."""
    lines = asm.splitlines()
    first = next(i for i, line in enumerate(lines) if "vfmadd" in line)
    start = max(i for i in range(first) if lines[i].split("#")[0].rstrip().endswith(":"))
    label = lines[start].split(":")[0].strip()
    end = next(i for i in range(first, len(lines))
               if lines[i].strip().startswith("j") and lines[i].split()[-1] == label)
    return lines[start: end + 1]


@njit
def _tile(fs, c, a, b, k):
    micro_kernel(fs, c, 0, 64, a, 0, k, b, 0, 64, k)


@pytest.mark.parametrize("fs", FORMS, ids=lambda f: f.form)
def test_micro_kernel_keeps_accumulators_in_registers(fs):
    """On this host: the K loop is FMAs on full vectors (zmm for the AVX-512 form, ymm for AVX2)
    with broadcasts and B loads, and no stack traffic."""
    x = np.zeros(64 * 64, np.float32)
    _tile(fs, x.copy(), x, x, 64)
    body = loop_body(_tile.inspect_asm(next(s for s in _tile.signatures if s[0] == numba.typeof(fs))))
    reg = "zmm" if fs.lanes == 16 else "ymm"
    fmas = [line for line in body if "vfmadd" in line]
    assert len(fmas) >= fs.tile_rows * fs.tile_vectors and all(reg in line for line in fmas)
    assert not [line for line in body if "rsp" in line]


def test_avx2_tile_fits_sixteen_registers():
    """Compiled for a CPU with 16 vector registers (Haswell), the AVX2 form's 6 x 2 tile still
    needs no spill: what an AVX2-only machine runs (this host has 32 registers)."""
    code = textwrap.dedent(f"""
        import sys
        import numpy as np
        from numba import njit
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_fgemm import FORMS, loop_body
        from ggx_cpu.isa.fgemm import micro_kernel

        @njit
        def tile(fs, c, a, b, k):
            micro_kernel(fs, c, 0, 64, a, 0, k, b, 0, 64, k)

        x = np.zeros(64 * 64, np.float32)
        tile(FORMS[1], x.copy(), x, x, 64)
        body = loop_body(tile.inspect_asm(tile.signatures[0]))
        assert len([line for line in body if "vfmadd" in line and "ymm" in line]) >= 12
        assert not [line for line in body if "rsp" in line or "zmm" in line or "mm16" in line], body
        print("ok")
    """)
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CACHE_DIR=os.environ.get("NUMBA_CACHE_DIR", ""))
    if not env["NUMBA_CACHE_DIR"]:
        del env["NUMBA_CACHE_DIR"]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
