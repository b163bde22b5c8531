"""Kernel checks without a GPU, for every kernel family's tests (one harness, as ggml's
test-backend-ops is):

- NVRTC: `compile_source(source, arch)` compiles a kernels/*.cu file as CupyDriver does (the
  low-level binding needs no device) with every declared name expression, and `check_compiles`
  asserts what a family's compile test asserts (every expression lowers, to distinct names, with
  the parameters the parsed signature says);
- kernel signatures: `kernel_params(source, name)`, parsed from the source (and the headers it
  includes), `bind(launch)` checks a launch's arguments against them, `check_geometry` its grid,
  block and shared memory;
- fake device memory: `Memory` (numpy regions at their real host addresses, bounds-checked
  views, a guard after each region) and `StubCtx`, a PlanContext over it;
- numpy models of the kernels (row operations: norm, rope, softmax, sort; products and attention:
  conversions, MUL_MAT_ID, flash attention, the cuBLAS call) executing planned launches from their
  arguments bound by parameter name;
- host builds: `host_build(source)`, the .cu file itself compiled with g++ over
  host_cuda_shim.h, so launches run on host memory;
- conformance cases: `emulate` / `check_case` plan a case's nodes on a `StubCtx` and run them on
  the models or the host build, against the reference backend's values; `check_emulated` runs
  them through the host build on the reference backend's own buffers and compares bytes.

So a planner's argument order, strides, grids and blocks, and the kernels' index math and
integer / float recipes are checked against the reference. The host build checks the recipes of
conversions and quantizers bit for bit; CUDA's own math functions (expf, erfcf) are glibc's there.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pytest

from ggx.conformance import harness, op_cases
from ggx.graph import build_graph
from ggx.ops import Op
from ggx.quants import dequantize, fp32_to_fp16
from ggx.reference.device import RefDevice
from ggx.tensor import Tensor
from ggx.tensor_data import get_tensor_data
from ggx.types import GType
from ggx_cuda.driver import KERNEL_DIR, NVRTC_OPTIONS, DeviceInfo, GemmLaunch, KernelLaunch, headers_digest, source_text
from ggx_cuda.kernels import NAME_EXPRESSIONS

H100 = DeviceInfo(0, "fake H100", (9, 0), 132, 48 * 1024, 227 * 1024, 32, 80 << 30)
ARCHS = ("sm_80", "sm_90")
F32 = np.float32


# === NVRTC ========================================================================================
def cuda_include_dirs() -> list[str]:
    """Folders that may hold the CUDA headers: the nvidia-cuda-runtime wheel's (CUDA 12 layout,
    then CUDA 13's nvidia/cu13), then the toolkit CuPy finds (CUDA_PATH, nvcc's, /usr/local/cuda)."""
    out = []
    try:
        import nvidia

        for root in nvidia.__path__:
            out += [os.path.join(root, "cuda_runtime", "include"), os.path.join(root, "cu13", "include")]
    except ImportError:
        pass
    try:
        import cupy

        path = cupy.cuda.get_cuda_path()
        if path:
            out.append(os.path.join(path, "include"))
    except Exception:  # noqa: BLE001 - a CuPy that cannot load: no toolkit from it
        pass
    return out


def nvrtc_or_skip():
    """(the nvrtc binding, the CUDA include folder), or skip: NVRTC or the headers are missing."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as e:  # noqa: BLE001 - any failure to import means: cannot compile here
        pytest.skip(f"NVRTC (cupy_backends.cuda.libs.nvrtc) is not importable: {type(e).__name__}: {e}")
    found = [d for d in cuda_include_dirs() if os.path.isfile(os.path.join(d, "cuda_fp16.h"))]
    if not found:
        pytest.skip(f"the CUDA headers are missing: no cuda_fp16.h in {cuda_include_dirs()} "
                    "(pip install nvidia-cuda-runtime-cu12)")
    return nvrtc, found[0]


class Compiled(NamedTuple):
    lowered: dict[str, str]  # name expression -> lowered (mangled) name; "" where it does not lower
    ptx: str


@functools.cache
def compile_source(source: str, arch: str) -> Compiled:
    """Compile kernels/<source> for `arch` ("sm_80") as CupyDriver does (its NVRTC options: the
    kernels folder as an include directory) with every declared name expression."""
    nvrtc, inc = nvrtc_or_skip()
    exprs = NAME_EXPRESSIONS[source]
    prog = nvrtc.createProgram(source_text(source), source, [], [])
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", "-I" + inc, *NVRTC_OPTIONS])
        except Exception as e:
            raise AssertionError(f"{source} ({arch}) does not compile:\n{nvrtc.getProgramLog(prog)}") from e
        ptx = nvrtc.getPTX(prog)
        lowered = {}
        for e in exprs:
            try:
                lowered[e] = nvrtc.getLoweredName(prog, e) or ""
            except Exception:  # noqa: BLE001 - NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID
                lowered[e] = ""
        return Compiled(lowered, ptx.decode() if isinstance(ptx, bytes) else ptx)
    finally:
        nvrtc.destroyProgram(prog)


def ptx_params(ptx: str, lowered: str) -> list[str]:
    """The PTX parameter types (.u64, .u32, .f32, ...) of entry `lowered`."""
    m = re.search(r"\.entry\s+" + re.escape(lowered) + r"\s*\(([^)]*)\)", ptx)
    assert m, f"{lowered} is not an entry of the PTX"
    return re.findall(r"\.param\s+(\.\w+)", m.group(1))


#: the PTX type each numpy argument type becomes
PTX_TYPE = {np.uint64: ".u64", np.int64: ".u64", np.int32: ".u32", np.uint32: ".u32", np.float32: ".f32"}


def check_compiles(source: str, arch: str) -> dict[str, str]:
    """A family's compile test: every declared name expression lowers, to distinct names, and each
    entry's PTX parameters are the parsed signature's (what launches are checked against).
    Returns {expression: lowered name}."""
    lowered, ptx = compile_source(source, arch)
    unlowered = [e for e, name in lowered.items() if not name]
    assert not unlowered, f"{source} ({arch}): name expressions that do not lower: {unlowered}"
    assert len(set(lowered.values())) == len(lowered), f"{source} ({arch}): two expressions, one kernel"
    for expr, name in lowered.items():
        want = [PTX_TYPE[p.dtype] for p in kernel_params(source, expr)]
        assert ptx_params(ptx, name) == want, expr
    return lowered


# === kernel signatures ============================================================================
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def includes(text: str) -> list[str]:
    """The files a source names in #include "..." (the kernels folder's headers)."""
    return INCLUDE.findall(text)


@functools.cache
def expanded_text(name: str) -> str:
    """kernels/<name> with its #include "..." headers inlined (each once), comments removed."""
    seen: set[str] = set()

    def expand(n: str) -> str:
        if n in seen:
            return ""
        seen.add(n)
        return INCLUDE.sub(lambda m: expand(m.group(1)), source_text(n))

    return re.sub(r"//[^\n]*", "", expand(name))


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str
    dtype: type  # the numpy scalar type a launch passes


def _dtype(ctype: str, typedefs: dict[str, str]) -> type:
    if "*" in ctype:
        return np.uint64
    words = [w for w in ctype.split() if w not in ("const", "__restrict__")]
    base = " ".join(typedefs.get(w, w) for w in words)
    return {"int": np.int32, "unsigned int": np.uint32, "float": np.float32, "long long": np.int64}[base]


@functools.cache
def kernel_params(source: str, name: str) -> tuple[Param, ...]:
    """The parameters of the __global__ function of name expression `name` ("k<float>") in source."""
    text = expanded_text(source)
    typedefs = {m.group(2): m.group(1) for m in re.finditer(r"typedef\s+([\w ]+?)\s+(\w+)\s*;", text)}
    base = name.split("<")[0].strip()
    m = re.search(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?" + re.escape(base) + r"\s*\(([^)]*)\)",
                  text)
    assert m, f"{base} not found in {source}"
    params = []
    for p in m.group(1).split(","):
        p = " ".join(p.split())
        pm = re.match(r"(.*?)(\w+)$", p)
        assert pm, p
        params.append(Param(pm.group(2), pm.group(1).strip(), _dtype(pm.group(1), typedefs)))
    return tuple(params)


def bind(launch: KernelLaunch) -> dict[str, object]:
    """The launch's arguments by parameter name, after checking their count and numpy types."""
    params = kernel_params(launch.kernel.source, launch.kernel.name)
    assert len(launch.args) == len(params), (launch.kernel.name, len(launch.args), len(params))
    for p, a in zip(params, launch.args):
        assert type(a) is p.dtype, f"{launch.kernel.name}: {p.name} ({p.ctype}) got {type(a).__name__}"
    return {p.name: a for p, a in zip(params, launch.args)}


def check_geometry(launch: KernelLaunch, device: DeviceInfo) -> None:
    gx, gy, gz = launch.grid
    bx, by, bz = launch.block
    assert 1 <= gx <= 2**31 - 1 and 1 <= gy <= 65535 and 1 <= gz <= 65535, launch.grid
    threads = bx * by * bz
    assert 1 <= threads <= 1024 and threads % device.warp_size == 0, launch.block
    assert bz == 1 and by <= 1024
    assert 0 <= launch.shared <= device.smem_per_block_optin, launch.shared  # the driver opts in past 48 KiB
    assert launch.kernel.name in NAME_EXPRESSIONS[launch.kernel.source], launch.kernel


# === fake device memory ===========================================================================
GUARD = 256  # bytes of GUARD_BYTE after each region, checked after a kernel ran on the host
GUARD_BYTE = 0xA5


@dataclass
class Region:
    base: int
    data: np.ndarray  # uint8
    what: str
    raw: np.ndarray  # data and its guard


class Memory:
    """Separate regions, each a numpy buffer at its own (host) address, 256-aligned, with a guard
    after it; every view is bounds-checked against its region. The addresses are real, so the
    kernels built for the host (host_build) run on the same memory."""

    def __init__(self) -> None:
        self.regions: list[Region] = []

    def alloc(self, size: int, what: str, fill: int = 0xFF) -> int:
        raw = np.full(size + 2 * GUARD, GUARD_BYTE, np.uint8)
        start = -raw.ctypes.data % GUARD
        data = raw[start: start + size]
        data[:] = fill
        self.regions.append(Region(raw.ctypes.data + start, data, what, raw[start:]))
        return raw.ctypes.data + start

    def region(self, addr: int) -> Region:
        for r in self.regions:
            if r.base <= addr < r.base + max(r.data.size, 1):
                return r
        raise AssertionError(f"address {addr:#x} is in no allocation")

    def check_guards(self) -> None:
        for r in self.regions:
            assert np.all(r.raw[r.data.size: r.data.size + GUARD] == GUARD_BYTE), f"write past the end of {r.what}"

    def view(self, addr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype) -> np.ndarray:
        addr = int(addr)
        r = self.region(addr)
        off = addr - r.base
        itemsize = np.dtype(dtype).itemsize
        assert off % min(itemsize, 4) == 0, f"misaligned {np.dtype(dtype)} at {addr:#x}"
        assert all(int(s) >= 0 for s in strides)
        if all(n > 0 for n in shape):
            extent = off + itemsize + sum((n - 1) * int(s) for n, s in zip(shape, strides))
            assert extent <= r.data.size, f"access past the end of {r.what} ({extent} > {r.data.size})"
        return np.ndarray(shape, dtype, buffer=r.data, offset=off, strides=tuple(int(s) for s in strides))


@dataclass
class StubCtx:
    """A PlanContext: tensors get regions of Memory (roots once; views at their offsets)."""

    device: DeviceInfo = H100
    mem: Memory = field(default_factory=Memory)
    roots: dict[int, int] = field(default_factory=dict)
    scratches: list[tuple[int, int]] = field(default_factory=list)

    def place(self, t: Tensor) -> int:
        root = t.root
        if id(root) not in self.roots:
            self.roots[id(root)] = self.mem.alloc(root.nbytes, root.describe())
        return self.roots[id(root)]

    def ptr(self, t: Tensor) -> int:
        return self.place(t) + (t.view_offs if t.view_src is not None else 0)

    def scratch(self, nbytes: int) -> int:
        addr = self.mem.alloc(nbytes, f"scratch of {nbytes} bytes", fill=0x5A)
        self.scratches.append((addr, nbytes))
        return addr

    def array(self, t: Tensor, dtype) -> np.ndarray:
        """t's elements in numpy order (ne3, ne2, ne1, ne0), through its strides."""
        return self.mem.view(self.ptr(t), tuple(reversed(t.ne)), tuple(reversed(t.nb)), dtype)


# === kernel models: row operations (norm.cu, rope.cu, softmax.cu, sort.cu) =========================
def _rows(r: int, ne1: int, ne2: int) -> tuple[int, int, int]:
    return r % ne1, (r // ne1) % ne2, r // (ne1 * ne2)


def _row(mem: Memory, base, i: tuple[int, int, int], nb: tuple, n: int, dtype=F32) -> np.ndarray:
    addr = int(base) + i[0] * int(nb[1]) + i[1] * int(nb[2]) + i[2] * int(nb[3])
    return mem.view(addr, (n,), (int(nb[0]),), dtype)


def model_norm(launch: KernelLaunch, a: dict, ctx: StubCtx) -> None:
    rms = launch.kernel.name == "k_norm_f32<true>"
    n = int(a["ncols"])
    xb = (a["nb00"], a["nb01"], a["nb02"], a["nb03"])
    db = (a["nb0"], a["nb1"], a["nb2"], a["nb3"])
    for r in range(launch.grid[0]):
        i = _rows(r, int(a["ne1"]), int(a["ne2"]))
        x = _row(ctx.mem, a["x"], i, xb, n).copy()
        if rms:
            scale = F32(1.0) / np.sqrt(F32(np.sum(x * x, dtype=F32) / F32(n)) + a["eps"])
            y = scale * x
        else:
            mean = F32(np.sum(x, dtype=F32) / F32(n))
            d = x - mean
            y = d * (F32(1.0) / np.sqrt(F32(np.sum(d * d, dtype=F32) / F32(n)) + a["eps"]))
        _row(ctx.mem, a["dst"], i, db, n)[:] = y


def model_rope(launch: KernelLaunch, a: dict, ctx: StubCtx) -> None:
    mem = ctx.mem
    neox = launch.kernel.name.endswith("<true>")
    ne0, nd = int(a["ne0"]), int(a["n_dims"])
    half = nd // 2
    xb = (a["nb00"], a["nb01"], a["nb02"], a["nb03"])
    db = (a["nb0"], a["nb1"], a["nb2"], a["nb3"])
    t = np.arange(half)
    j0, j1 = (t, t + half) if neox else (2 * t, 2 * t + 1)
    for bx in range(launch.grid[0]):
        for ty in range(launch.block[1]):
            r = bx * launch.block[1] + ty
            if r >= a["nrows"]:
                continue
            i = _rows(r, int(a["ne1"]), int(a["ne2"]))
            p = F32(mem.view(int(a["pos"]) + i[1] * int(a["nb_pos"]), (1,), (4,), np.int32)[0])
            theta_extrap = p * np.power(a["theta_scale"], t.astype(F32))
            if int(a["ff"]):
                theta_extrap = theta_extrap / mem.view(int(a["ff"]), (half,), (4,), np.float32)
            theta = a["freq_scale"] * theta_extrap
            mscale = a["attn_factor"]
            if a["ext_factor"] != 0:
                y = (t.astype(F32) - a["corr0"]) / max(F32(0.001), F32(a["corr1"] - a["corr0"]))
                ramp_mix = (F32(1) - np.minimum(F32(1), np.maximum(F32(0), y))) * a["ext_factor"]
                theta = theta * (F32(1) - ramp_mix) + theta_extrap * ramp_mix
                mscale = mscale * (F32(1) + F32(0.1) * F32(np.log(F32(1) / a["freq_scale"])))
            c = np.cos(theta).astype(F32) * mscale
            s = np.sin(theta).astype(F32) * mscale
            x = _row(mem, a["x"], i, xb, ne0).copy()
            y = _row(mem, a["dst"], i, db, ne0)
            y[j0] = x[j0] * c - x[j1] * s
            y[j1] = x[j0] * s + x[j1] * c
            y[nd:] = x[nd:]


def _alibi_slope(h: int, a: dict) -> float:
    """common.cuh's ggx_alibi_slope from a launch's max_bias, m0, m1, n_head_log2."""
    if a["max_bias"] <= 0:
        return 1.0
    nl2 = int(a["n_head_log2"])
    return float(a["m0"]) ** (h + 1) if h < nl2 else float(a["m1"]) ** (2 * (h - nl2) + 1)


def model_softmax(launch: KernelLaunch, a: dict, ctx: StubCtx) -> None:
    mem = ctx.mem
    half = launch.kernel.name.endswith("<__half>")
    n = int(a["ncols"])
    if a["use_shared"]:
        assert launch.shared >= (32 + n) * 4, "the row does not fit the dynamic shared memory given"
    assert launch.shared >= 32 * 4 or launch.block[0] <= 32
    xb = (a["nb00"], a["nb01"], a["nb02"], a["nb03"])
    mb = (a["nb10"], a["nb11"], a["nb12"], a["nb13"])
    db = (a["nb0"], a["nb1"], a["nb2"], a["nb3"])
    for r in range(launch.grid[0]):
        i = _rows(r, int(a["ne01"]), int(a["ne02"]))
        v = _row(mem, a["x"], i, xb, n) * a["scale"]
        if int(a["mask"]):
            slope = F32(1)
            if a["max_bias"] > 0:
                h, nl2 = i[1], int(a["n_head_log2"])
                base, exph = (a["m0"], h + 1) if h < nl2 else (a["m1"], 2 * (h - nl2) + 1)
                slope = F32(base) ** F32(exph)
            mi = (i[0], i[1] % int(a["ne12"]), i[2] % int(a["ne13"]))
            m = _row(mem, a["mask"], mi, mb, n, np.float16 if half else F32).astype(F32)
            v = v + slope * m
        mx = np.max(v)  # NaN propagates here, ignored by fmaxf: both give NaN rows below
        e = np.exp(v - mx).astype(F32)
        _row(mem, a["dst"], i, db, n)[:] = e * (F32(1) / np.sum(e, dtype=F32))


def _after(x: np.ndarray, ncols: int, desc: bool, ia: np.ndarray, ib: np.ndarray) -> np.ndarray:
    """sort.cu's sort_after over arrays of (row, index) pairs; x is (rows, ncols)."""
    rows = np.arange(x.shape[0])[:, None]
    pa, pb = ia >= ncols, ib >= ncols
    xa = x[rows, np.minimum(ia, ncols - 1)]
    xb = x[rows, np.minimum(ib, ncols - 1)]
    na, nb = np.isnan(xa), np.isnan(xb)
    by_value = (xa < xb) if desc else (xa > xb)
    numbers = np.where(xa != xb, by_value, ia > ib)
    nans = na & (~nb | (ia > ib))
    values = np.where(na | nb, nans, numbers)
    padding = pa & (~pb | (ia > ib))
    return np.where(pa | pb, padding, values)


def model_sort(launch: KernelLaunch, a: dict, ctx: StubCtx) -> None:
    mem = ctx.mem
    desc = launch.kernel.name.endswith("<true>")
    n, pad, n_out = int(a["ncols"]), int(a["ncols_pad"]), int(a["n_out"])
    assert pad >= n and pad & (pad - 1) == 0 and 1 <= n_out <= n
    rows = launch.grid[0]
    if int(a["scratch"]):
        assert any(s <= int(a["scratch"]) and int(a["scratch"]) + rows * pad * 4 <= s + size
                   for s, size in ctx.scratches), "scratch too small for the launch's rows"
        mem.view(int(a["scratch"]), (rows, pad), (pad * 4, 4), np.int32)[:] = 0  # touched: bounds-checked
    else:
        assert launch.shared >= pad * 4
    xb = (a["nb00"], a["nb01"], a["nb02"], a["nb03"])
    db = (a["nb0"], a["nb1"], a["nb2"], a["nb3"])
    idx_rows = [_rows(int(a["row0"]) + r, int(a["ne1"]), int(a["ne2"])) for r in range(rows)]
    x = np.stack([_row(mem, a["x"], i, xb, n) for i in idx_rows])
    idx = np.tile(np.arange(pad), (rows, 1))
    c = np.arange(pad)
    k = 2
    while k <= pad:
        j = k >> 1
        while j > 0:
            p = c ^ j
            sel = p > c
            cs, ps = c[sel], p[sel]
            ia, ib = idx[:, cs], idx[:, ps]
            swap = np.where((cs & k) == 0, _after(x, n, desc, ia, ib), _after(x, n, desc, ib, ia))
            idx[:, cs] = np.where(swap, ib, ia)
            idx[:, ps] = np.where(swap, ia, ib)
            j >>= 1
        k <<= 1
    for r, i in enumerate(idx_rows):
        _row(mem, a["dst"], i, db, n_out, np.int32)[:] = idx[r, :n_out]


# === kernel models: products and attention (dequant.cu, attention.cu, cuBLAS) =====================
TRAIT_TYPES = {"mm_f32": GType.F32, "mm_f16": GType.F16, "mm_bf16": GType.BF16, "mm_q4_0": GType.Q4_0,
               "mm_q4_1": GType.Q4_1, "mm_q5_0": GType.Q5_0, "mm_q8_0": GType.Q8_0, "mm_q4_K": GType.Q4_K,
               "mm_q5_K": GType.Q5_K, "mm_q6_K": GType.Q6_K}
CTYPES = {"float": np.float32, "__half": np.float16, "__nv_bfloat16": "bf16"}


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """__float2bfloat16_rn: round to nearest even; NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(F32)


def random_blocks(rng: np.random.Generator, t: GType, nblocks: int) -> np.ndarray:
    """Random block bytes (every scale and quant bit pattern) with finite F16 scales."""
    raw = rng.integers(0, 256, (nblocks, t.type_size), dtype=np.uint8)
    blocks = raw.view(t.block_dtype).reshape(nblocks)
    for name in ("d", "dmin", "m"):
        if name in t.block_dtype.names:
            blocks[name] = rng.uniform(-2, 2, nblocks).astype(np.float16)
    return raw


def read_rows(mem: Memory, addr: int, gtype: GType, ne0: int, rows: list[tuple[int, int, int]],
              nb: tuple[int, int, int]) -> np.ndarray:
    """float32 values of the rows (i1, i2, i3) of a gtype tensor at addr with strides nb[1:]."""
    nbytes = gtype.row_size(ne0)
    out = np.empty((len(rows), ne0), F32)
    for r, (i1, i2, i3) in enumerate(rows):
        raw = mem.view(addr + i1 * nb[0] + i2 * nb[1] + i3 * nb[2], (nbytes,), (1,), np.uint8)
        out[r] = dequantize(raw.copy(), gtype, ne0) if nbytes else 0
    return out


def store_values(mem: Memory, addr: int, values: np.ndarray, ctype: str) -> None:
    flat = values.reshape(-1)
    if CTYPES[ctype] == "bf16":
        mem.view(addr, (flat.size,), (2,), np.uint16)[:] = to_bf16_bits(flat)
    elif CTYPES[ctype] is np.float16:
        mem.view(addr, (flat.size,), (2,), np.float16)[:] = fp32_to_fp16(flat)
    else:
        mem.view(addr, (flat.size,), (4,), F32)[:] = flat


def _template_args(name: str) -> list[str]:
    return [x.strip() for x in name[name.index("<") + 1: name.rindex(">")].split(",")]


def model_convert(launch: KernelLaunch, a: dict, ctx: StubCtx) -> None:
    assert launch.block == (256, 1, 1), "k_mm_convert assumes MM_CVT_BLOCK threads"
    src, dst = _template_args(launch.kernel.name)
    gtype = TRAIT_TYPES[src]
    ne0, ne1, ne2, nrows = int(a["ne0"]), int(a["ne1"]), int(a["ne2"]), int(a["nrows"])
    rows = [(r % ne1, r // ne1 % ne2, r // (ne1 * ne2)) for r in range(nrows)]
    values = read_rows(ctx.mem, int(a["src"]), gtype, ne0, rows, (int(a["nb1"]), int(a["nb2"]), int(a["nb3"])))
    store_values(ctx.mem, int(a["dst"]), values, dst)


def model_zero(launch: KernelLaunch, a: dict, ctx: StubCtx) -> None:
    ctx.mem.view(int(a["dst"]), (int(a["n"]),), (4,), F32)[:] = 0


def model_mm_id(launch: KernelLaunch, a: dict, ctx: StubCtx) -> None:
    mem = ctx.mem
    assert launch.block == (128, 1, 1), "k_mm_id assumes MM_ID_WARPS warps"
    gtype = TRAIT_TYPES[_template_args(launch.kernel.name)[0]]
    K, M, n_expert = int(a["K"]), int(a["M"]), int(a["n_expert"])
    n_used, n_tokens, b_ne1 = int(a["n_used"]), int(a["n_tokens"]), int(a["b_ne1"])
    ms = [m for m in range(launch.grid[0] * 4) if m < M]  # blocks loop over (e, t) by grid y / z
    assert len(ms) == M, "the grid does not cover every row"
    for t in range(n_tokens):
        for e in range(n_used):
            i = int(mem.view(int(a["ids"]) + e * int(a["nb_ids0"]) + t * int(a["nb_ids1"]), (1,), (4,), np.int32)[0])
            out = mem.view(int(a["dst"]) + e * int(a["nb_dst1"]) + t * int(a["nb_dst2"]), (M,), (4,), F32)
            if not 0 <= i < n_expert:
                out[:] = np.nan
                continue
            w = read_rows(mem, int(a["as"]), gtype, K, [(m, i, 0) for m in ms], (int(a["nb_as1"]), int(a["nb_as2"]), 0))
            y = mem.view(int(a["b"]) + (e % b_ne1) * int(a["nb_b1"]) + t * int(a["nb_b2"]), (K,), (4,), F32)
            out[:] = (w.astype(np.float64) @ y.astype(np.float64)).astype(F32)


def model_flash_attn(launch: KernelLaunch, a: dict, ctx: StubCtx) -> None:
    mem = ctx.mem
    assert launch.block == (128, 1, 1), "k_flash_attn_ext assumes FA_BLOCK threads"
    kt, vt = (np.float16 if x == "__half" else F32 for x in _template_args(launch.kernel.name))
    D, Dv, KV, gqa, r3 = (int(a[x]) for x in ("D", "Dv", "KV", "gqa", "r3"))
    assert D <= 256 and Dv <= 256
    T, H, B = launch.grid
    for b in range(B):
        for h in range(H):
            q = mem.view(int(a["q"]) + h * int(a["nbq2"]) + b * int(a["nbq3"]), (T, D), (int(a["nbq1"]), 4), F32)
            hk, bk = h // gqa, b // r3
            k = mem.view(int(a["k"]) + hk * int(a["nbk2"]) + bk * int(a["nbk3"]), (KV, D),
                         (int(a["nbk1"]), np.dtype(kt).itemsize), kt)
            v = mem.view(int(a["v"]) + hk * int(a["nbv2"]) + bk * int(a["nbv3"]), (KV, Dv),
                         (int(a["nbv1"]), np.dtype(vt).itemsize), vt)
            s = (q.astype(np.float64) @ k.astype(np.float64).T) * float(a["scale"])
            if a["softcap"] != 0:
                s = float(a["softcap"]) * np.tanh(s / float(a["softcap"]))
            if int(a["has_mask"]):
                m = mem.view(int(a["mask"]) + (h % int(a["mask_ne2"])) * int(a["nbm2"])
                             + (b % int(a["mask_ne3"])) * int(a["nbm3"]), (T, KV), (int(a["nbm1"]), 2), np.float16)
                s = s + _alibi_slope(h, a) * m.astype(np.float64)
            mx = np.max(s, axis=1, keepdims=True, initial=-np.inf)
            e = np.exp(s - np.where(mx == -np.inf, 0.0, mx))
            total = e.sum(axis=1, keepdims=True)
            w = np.divide(e, total, out=np.zeros_like(e), where=total != 0)
            o = w @ v.astype(np.float64)
            out = mem.view(int(a["dst"]) + h * int(a["nbd1"]) + b * int(a["nbd3"]), (T, Dv), (int(a["nbd2"]), 4), F32)
            out[:] = o


def _gemm_operand(mem: Memory, addr: int, rows: int, k: int, ld: int, dtype: str) -> np.ndarray:
    es = 4 if dtype == "f32" else 2
    view = mem.view(addr, (rows, k), (ld * es, es), {"f32": F32, "f16": np.float16, "bf16": np.uint16}[dtype])
    return (bf16_to_f32(view) if dtype == "bf16" else view).astype(np.float64)


def model_gemm(g: GemmLaunch, mem: Memory) -> None:
    """cublasGemmStridedBatchedEx(OP_T, OP_N, m, n, k, A lda, B ldb, C ldc, batch) as driver.py calls
    it, with cuBLAS's argument rules checked."""
    assert min(g.m, g.n, g.k, g.batch) >= 1, g
    assert g.lda >= g.k and g.ldb >= g.k and g.ldc >= g.m, g
    assert max(g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.batch) <= 2**31 - 1, g
    assert g.a_dtype == g.b_dtype and g.a_dtype in ("f32", "f16", "bf16"), g
    es = 4 if g.a_dtype == "f32" else 2
    c_span = (g.n - 1) * g.ldc + g.m
    assert g.batch == 1 or g.stride_c >= c_span, "output matrices of a batch overlap"
    for i in range(g.batch):
        A = _gemm_operand(mem, g.a + i * g.stride_a * es, g.m, g.k, g.lda, g.a_dtype)
        B = _gemm_operand(mem, g.b + i * g.stride_b * es, g.n, g.k, g.ldb, g.b_dtype)
        C = mem.view(g.c + i * g.stride_c * 4, (g.n, g.m), (g.ldc * 4, 4), F32)
        C[:] = B @ A.T


#: the model of each kernel, by base name: model(launch, arguments by parameter name, ctx)
MODELS: dict[str, Callable[[KernelLaunch, dict, StubCtx], None]] = {
    "k_norm_f32": model_norm, "k_rope_f32": model_rope,
    "k_soft_max_f32": model_softmax, "k_argsort_f32_i32": model_sort,
    "k_mm_convert": model_convert, "k_mm_zero": model_zero, "k_mm_id": model_mm_id,
    "k_flash_attn_ext": model_flash_attn,
}


# === host builds ==================================================================================
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_cuda_shim.h")
HOST_FLAGS = ("-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-w")


def have_host_compiler() -> bool:
    return shutil.which("g++") is not None


def _slot(v) -> int:
    if type(v) is np.float32:
        return int(np.array(v, dtype=np.float32).view(np.uint32))
    return int(v) & 0xFFFFFFFFFFFFFFFF


class HostBuild:
    """kernels/<source> built for the host with every declared name expression launchable."""

    def __init__(self, source: str, lib: ctypes.CDLL):
        self.source = source
        self.lib = lib
        self.launchers = {}
        for i, e in enumerate(NAME_EXPRESSIONS[source]):
            fn = getattr(lib, f"hc_launch_{i}")
            fn.argtypes = [ctypes.c_uint] * 7 + [ctypes.POINTER(ctypes.c_ulonglong)]
            fn.restype = None
            self.launchers[e] = fn

    def run(self, launch: KernelLaunch, mem: Memory | None = None, device: DeviceInfo = H100) -> None:
        """Run the launch's kernel (its arguments checked against the signature) as compiled for
        `device`'s architecture; with `mem`, check the guards of its regions afterwards."""
        bind(launch)
        self.lib.hc_set_arch(100 * device.cc[0] + 10 * device.cc[1])
        slots = (ctypes.c_ulonglong * max(1, len(launch.args)))(*[_slot(v) for v in launch.args])
        self.launchers[launch.kernel.name](*launch.grid, *launch.block, launch.shared, slots)
        if mem is not None:
            mem.check_guards()

    def coords(self, i: int, ne: tuple[int, int, int], bound: int) -> tuple[int, ...]:
        """common.cuh's ggx_coords as this source's kernels compile it."""
        out = (ctypes.c_longlong * 4)()
        self.lib.hc_coords(ctypes.c_longlong(i), *(ctypes.c_longlong(x) for x in ne), ctypes.c_longlong(bound), out)
        return tuple(out)


@functools.cache
def host_build(source: str) -> HostBuild | None:
    """kernels/<source> compiled with g++ over host_cuda_shim.h, or None without g++. Built once
    per text (source, headers, shim; cached in the temp dir)."""
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    wrappers = "\n".join(
        f'extern "C" void hc_launch_{i}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, '
        f'unsigned bz, unsigned sh, const unsigned long long * s) {{ hc_launch(&{e}, dim3{{gx, gy, gz}}, '
        f'dim3{{bx, by, bz}}, sh, s); }}'
        for i, e in enumerate(NAME_EXPRESSIONS[source]))
    probe = ""
    if "common.cuh" in includes(source_text(source)):
        probe = ('extern "C" void hc_coords(long long i, long long ne0, long long ne1, long long ne2, long long bound, '
                 'long long * out) { ggx_coords(i, ne0, ne1, ne2, bound, out[0], out[1], out[2], out[3]); }\n')
    with open(SHIM, encoding="utf-8") as f:
        shim = f.read()
    full = f"{shim}\n#line 1 \"{source}\"\n{source_text(source)}\n{wrappers}\n{probe}"
    key = hashlib.sha256(f"{full}\n{headers_digest()}\n{HOST_FLAGS}".encode()).hexdigest()[:16]
    so = os.path.join(tempfile.gettempdir(), f"ggx_cuda_host_{os.getuid()}_{source.replace('.', '_')}_{key}.so")
    if not os.path.exists(so):
        cpp = so[:-3] + ".cpp"
        with open(cpp, "w", encoding="utf-8") as f:
            f.write(full)
        tmp = f"{so}.{os.getpid()}"
        r = subprocess.run([gxx, *HOST_FLAGS, "-I", KERNEL_DIR, "-o", tmp, cpp], capture_output=True, text=True)
        assert r.returncode == 0, f"host build of {source} failed:\n{r.stderr[-4000:]}"
        os.replace(tmp, so)
    return HostBuild(source, ctypes.CDLL(so))


def check_flat_index(build: HostBuild) -> None:
    """ggx_coords: the 32-bit path (element counts under 2^32) and the 64-bit one agree."""
    for i, ne in ((0, (5, 7, 3)), (104, (5, 7, 3)), (2**31 + 12345, (3, 2**20, 5)), (2**32 - 1, (2**16, 2**8, 2**8))):
        small = build.coords(i, ne, 2**32 - 1)
        assert small == build.coords(i, ne, 2**40)
        i0, i1, i2, i3 = small
        assert i == i0 + ne[0] * (i1 + ne[1] * (i2 + ne[2] * i3))
    # past 2^32 only the 64-bit path is right
    i, ne = 2**33 + 7, (2**20, 2**10, 3)
    i0, i1, i2, i3 = build.coords(i, ne, 2**40)
    assert i == i0 + ne[0] * (i1 + ne[1] * (i2 + ne[2] * i3))


# === running launches =============================================================================
def run_launches(launches: Iterable, ctx: StubCtx, host: bool = False) -> None:
    """Execute launches on ctx's memory: GemmLaunches on the cuBLAS model, kernels on their numpy
    models, or with `host` on the kernels built for the host."""
    with np.errstate(all="ignore"):
        for launch in launches:
            if isinstance(launch, GemmLaunch):
                model_gemm(launch, ctx.mem)
                continue
            assert isinstance(launch, KernelLaunch)
            check_geometry(launch, ctx.device)
            a = bind(launch)
            for v in a.values():  # every non-null pointer lies in an allocation
                if type(v) is np.uint64 and int(v):
                    ctx.mem.region(int(v))
            if host:
                host_build(launch.kernel.source).run(launch, ctx.mem, ctx.device)
            else:
                MODELS[launch.kernel.name.split("<")[0]](launch, a, ctx)


def one_launch(launches: list, source: str, names: Iterable[str]) -> KernelLaunch:
    """The single launch of a flat (one thread per element or block) planner, its arguments
    checked against the signature and its geometry one-dimensional in whole warps."""
    assert len(launches) == 1
    launch = launches[0]
    bind(launch)
    assert launch.kernel.source == source and launch.kernel.name in names
    assert launch.grid[1:] == (1, 1) and launch.block[1:] == (1, 1) and launch.block[0] % 32 == 0
    return launch


def covers(launch: KernelLaunch, n: int) -> None:
    """The grid has just enough threads for n items (one more block would be idle)."""
    assert (launch.grid[0] - 1) * launch.block[0] < n <= launch.grid[0] * launch.block[0]


# === conformance cases ============================================================================
def cases_for(ops: Iterable[Op]) -> list:
    """The conformance cases of these ops that build a graph (not the refused-at-build ones)."""
    ops = set(ops)
    return [c for c in op_cases() if c.op in ops and c.expect_error is None]


def compute_nodes(case) -> list:
    """The nodes of a case's graph that reach a kernel (views never do)."""
    return [n for n in build_graph(case.make().out).nodes if not n.op.is_view]


def declined_cases(ops: Iterable[Op]) -> set[str]:
    """The names of the cases of these ops with a compute node the backend declines."""
    from ggx_cuda.ops import supports_op

    return {c.name for c in cases_for(ops) if not all(supports_op(n) for n in compute_nodes(c))}


def oracle(case) -> np.ndarray:
    b = case.make()
    ref = RefDevice()
    run = harness.execute(ref, ref.init_backend(), b.out, b.inputs)
    assert not run.problems, run.problems
    return run.values


def emulate(case, supports: Callable[[Tensor], bool], plan, device: DeviceInfo = H100,
            host: bool = False) -> np.ndarray:
    """Build the case, check supports on its compute nodes, plan and run them on a StubCtx's
    memory: on the models, or with `host` on the kernels built for the host."""
    b = case.make()
    graph = build_graph(b.out)
    ctx = StubCtx(device)
    for t in list(graph.leafs) + [n for n in graph.nodes if n.view_src is None]:
        ctx.place(t)
    for leaf, raw in b.inputs.items():
        ctx.mem.view(ctx.ptr(leaf), (raw.size,), (1,), np.uint8)[:] = raw
    for node in graph.nodes:
        if node.op.is_view:
            continue
        assert supports(node), f"{case.name}: declined {node.describe()}"
        run_launches(plan(node, ctx), ctx, host)
    for leaf, raw in b.inputs.items():
        assert np.array_equal(ctx.mem.view(ctx.ptr(leaf), (raw.size,), (1,), np.uint8), raw), "input modified"
    out = b.out
    return ctx.array(out, np.int32 if out.type is GType.I32 else F32).copy()


def check_case(case, supports, plan, device: DeviceInfo = H100, host: bool = False) -> float | None:
    got = emulate(case, supports, plan, device, host)
    ok, err, msg = harness.compare(got, oracle(case), case.tol)
    assert ok, f"{case.name}: {msg}"
    return err


@dataclass
class HostContext:
    """A PlanContext over host memory: the address of a tensor's first byte in its HostBuffer."""

    device: DeviceInfo = H100

    def ptr(self, t) -> int:
        return t.data_buffer.host_view().ctypes.data + t.data_offset

    def scratch(self, nbytes: int) -> int:
        raise AssertionError("these kernels take no scratch memory")


def run_case(case, one_block: bool = False):
    """Run one conformance case's graph through the planners and the host-built kernels on the
    reference backend's buffers, and through the reference backend. Returns (out values, ref
    values, out bytes, ref bytes, problems). `one_block`: launch each kernel on a grid of one
    block (the grid-stride loops cover the rest)."""
    from ggx_cuda.ops import plan, supports_op

    dev = RefDevice()
    b = case.make()
    graph, placement = harness.prepare(dev, b.out, b.inputs)
    ctx = HostContext()
    for node in graph.nodes:
        if node.op.is_view:
            continue
        assert supports_op(node), f"{case.name}: {node.op.name} declined"
        for launch in plan(node, ctx):
            if one_block:
                launch = dataclasses.replace(launch, grid=(1, 1, 1))
            host_build(launch.kernel.source).run(launch)
    out = get_tensor_data(_readable(b.out))
    problems = harness.check_guards(placement) + harness.check_inputs(b.out, b.inputs, placement)
    out_bytes = _root_bytes(b.out)

    r = case.make()
    backend = dev.init_backend()
    harness.prepare(dev, r.out, r.inputs)
    backend.graph_compute(build_graph(r.out))
    backend.synchronize()
    return out, get_tensor_data(_readable(r.out)), out_bytes, _root_bytes(r.out), problems


def _readable(t):
    """t, or the root it views when t is a strided quantized view (whose values cannot be read)."""
    return t.root if t.type.is_quantized and not t.is_contiguous() else t


def _root_bytes(t) -> np.ndarray:
    root = t.root
    return root.data_buffer.get_tensor(root)


def check_emulated(case, exact: bool, one_block: bool = False) -> None:
    """Run `case` on the host-built kernels; its result must pass the case's tolerance, and with
    `exact` match the reference's bytes (the whole destination: rows or gaps not written too)."""
    out, ref, out_bytes, ref_bytes, problems = run_case(case, one_block)
    assert not problems, problems
    ok, err, msg = harness.compare(out, ref, case.tol)
    assert ok, f"{case.name}: {msg}"
    if exact:
        bad = np.flatnonzero(out_bytes != ref_bytes)
        assert bad.size == 0, f"{case.name}: {bad.size} bytes differ from the reference (first at {bad[:1]})"


# the models of the integer products and of the flash-attention kernels live in their own modules
# (they import this one's helpers)
from fattn_models import MODELS as _FATTN_MODELS  # noqa: E402
from int_models import MODELS as _INT_MODELS  # noqa: E402

MODELS.update(_INT_MODELS)
MODELS.update(_FATTN_MODELS)
