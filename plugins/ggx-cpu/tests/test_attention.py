"""FLASH_ATTN_EXT: ggml's recorded outputs bit for bit (AVX-512 form), ggml's choice of kernel,
results that do not depend on the thread count, and shapes the conformance cases leave out."""
import json
import math

import numpy as np
import pytest
from test_kernels import GOLDEN, golden, golden_input, nmse

import ggx
from ggx.host import tensor_array
from ggx.types import GType
from ggx_cpu import device
from ggx_cpu.isa.vmath import float_simd_form
from ggx_cpu.kernels.attention import SPLIT_KV_MIN, TILED_MIN_TOKENS, plan
from ggx_cpu.plugin import backend_reg

FA_GOLDENS = sorted(p.name[:-4] for p in GOLDEN.iterdir() if p.name.startswith("fa_") and p.name.endswith(".npz"))
AVX512, AVX2 = float_simd_form("avx512"), float_simd_form("avx2")


@pytest.fixture(scope="module")
def cpu():
    return backend_reg().devices()[0]


@pytest.mark.parametrize("name", FA_GOLDENS)
def test_equals_ggml_bit_for_bit(cpu, ggml_avx512_form, name):
    """ggml's CPU kernels (AVX-512 build) recorded these: the tiled path (64 query rows) and the
    one_chunk path (F16 Q, F16 accumulator) give the same float32 bits here."""
    z = golden(name)
    p = json.loads(str(z["params_json"]))
    ctx, inputs = ggx.Context(), {}
    x = {str(z[f"in{i}_name"]): golden_input(ctx, inputs, z, i) for i in range(int(z["n_inputs"]))}
    out = ctx.flash_attn_ext(x["q"], x["k"], x["v"], x.get("mask"), p["scale"], p["max_bias"], p["logit_softcap"])
    got = ggx.compute(out, inputs, device=cpu)[0].reshape(-1)
    assert np.array_equal(got.view(np.uint32), z["out_values"].astype(np.float32).reshape(-1).view(np.uint32))


def test_goldens_cover_both_kernels():
    tiled = [n for n in FA_GOLDENS if "tiled" in n]
    assert tiled and len(FA_GOLDENS) > len(tiled) and any("_t1_" in n for n in FA_GOLDENS)


# --- ggml's choice of kernel ------------------------------------------------------------------------
@pytest.mark.parametrize("fs", [AVX512, AVX2], ids=lambda f: f.form)
def test_plan_follows_ggml(fs):
    """Tiled from 64 query rows when K and V share a type and Dv is a multiple of the vector width;
    one chunk per thread for a decode token over >= 512 slots; heavy groups of heads per task."""
    q = (64, TILED_MIN_TOKENS, 9, 1)
    assert plan(q, 512, 3, 64, True, fs, 1).tiled
    assert not plan((64, TILED_MIN_TOKENS - 1, 9, 1), 512, 3, 64, True, fs, 1).tiled
    assert not plan(q, 512, 3, 64, False, fs, 1).tiled  # F16 K, F32 V: one_chunk, as ggml
    assert plan(q, 512, 3, 72, True, fs, 1).tiled == (72 % fs.lanes == 0)
    tiled = plan((256, 512, 4, 1), 512, 1, 256, True, fs, 2)
    assert tiled.gt == 4 and tiled.qt == 32 and tiled.rp % fs.tile_rows == 0 and tiled.rp >= 4 * tiled.qt
    assert plan((64, 512, 2, 1), 512, 2, 64, True, fs, 2).qt == 64  # one head per kv head: ggml's 64
    decode = plan((64, 1, 9, 1), SPLIT_KV_MIN, 3, 64, True, fs, 2)
    assert decode.n_chunks == 2 and decode.gt == 3 and decode.n_tasks == 6
    assert plan((64, 1, 9, 1), SPLIT_KV_MIN - 1, 3, 64, True, fs, 2).n_chunks == 1
    assert plan((64, 1, 9, 1), SPLIT_KV_MIN, 3, 64, True, fs, 1).n_chunks == 1
    assert plan((64, 1, 9, 2), SPLIT_KV_MIN, 3, 64, True, fs, 2).n_chunks == 1  # ggml: one batch only
    small = plan((64, 1, 9, 1), 300, 3, 64, True, fs, 2)  # 3 groups on 2 threads: single heads
    assert small.n_chunks == 1 and small.gt == 1 and small.n_tasks == 9


# --- threads ----------------------------------------------------------------------------------------
def _attention(D, Dv, H, Hk, T, n_kv, kv_type=GType.F16, window=None, seed=0):
    rng = np.random.default_rng(seed)
    ctx = ggx.Context()
    q = ctx.tensor(GType.F32, (D, T, H))
    k = ctx.tensor(kv_type, (D, n_kv, Hk))
    v = ctx.tensor(kv_type, (Dv, n_kv, Hk))
    m = ctx.tensor(GType.F16, (n_kv, T))
    pos = np.arange(T)[:, None] + (n_kv - T)
    keys = np.arange(n_kv)[None, :]
    hidden = (keys > pos) | ((keys <= pos - window) if window else False)
    out = ctx.flash_attn_ext(q, k, v, m, 1 / math.sqrt(D))
    inputs = {q: rng.standard_normal((H, T, D)), k: rng.standard_normal((Hk, n_kv, D)),
              v: rng.standard_normal((Hk, n_kv, Dv)), m: np.where(hidden, -np.inf, 0.0)}
    return out, inputs


@pytest.mark.parametrize("T,n_kv,window", [(100, 300, 80), (5, 70, None), (1, 200, None)])
def test_threads_do_not_change_the_bytes(cpu, T, n_kv, window):
    """Tasks go to threads by a counter, in whatever order: the bytes are the same for 1, 2 and 3
    threads (one query row's result never depends on another task)."""
    out, inputs = _attention(64, 64, 6, 2, T, n_kv, window=window)
    ggx.compute(out, inputs, device=cpu)
    runs = []
    for n in (1, 2, 3):
        device.kernel_for(out.op)(out, n)()
        runs.append(tensor_array(out).copy())
    assert runs[0].tobytes() == runs[1].tobytes() == runs[2].tobytes()
    assert np.abs(runs[0]).sum() > 0


def test_split_decode_merges_to_the_unsplit_result(cpu):
    """ggml's split-KV decode: each thread's chunk of slots gives (M, S, acc) partials, merged;
    the F16 accumulator's roundings then differ per chunk, so the result moves by F16 rounding
    only (and with the thread count, as ggml's does): within ggml's 5e-4 of the exact result,
    and as close to it as the unsplit one."""
    out, inputs = _attention(64, 64, 9, 3, 1, 1000)
    ggx.compute(out, inputs, device=cpu)
    results = []
    for n in (1, 2, 3):
        device.kernel_for(out.op)(out, n)()
        results.append(tensor_array(out).copy())
    ref = ggx.compute(out, inputs, device="ref")[0].reshape(-1)
    errors = [nmse(r.reshape(-1), ref) for r in results]
    assert max(errors) < 5e-4 and max(errors) < 2 * errors[0]
    assert not np.array_equal(results[0], results[1])  # the split path ran


@pytest.mark.parametrize("T,kv_type,Dv", [(80, GType.F16, 32), (80, GType.F32, 32), (6, GType.F16, 32),
                                          (6, GType.F16, 72), (6, GType.F32, 136)])
def test_value_head_size_differs_from_key_head_size(cpu, T, kv_type, Dv):
    """Dv != D = 64 (ggml allows Dv != Dk), on both kernels, against the reference; one_chunk's
    values 64 at a time and the rest (Dv % 64) key by key."""
    out, inputs = _attention(64, Dv, 4, 2, T, 150, kv_type=kv_type, window=40)
    got = ggx.compute(out, inputs, device=cpu)[0]
    ref = ggx.compute(out, inputs, device="ref")[0]
    assert got.shape == ref.shape and nmse(got, ref) < 1e-6


def test_a_nan_in_the_mask_is_not_masked(cpu):
    """ggml's one_chunk skips a key only where slope * mask is -inf: a row whose mask is -inf but
    for one NaN attends to that key and comes out NaN, not 0; a fully -inf row gives 0. (The tiled
    kernel's tile maximum lets a later -inf win over a NaN, as ggml's sequential MAX does.)"""
    out, inputs = _attention(64, 64, 2, 2, 3, 100)
    mask_leaf = next(t for t in inputs if t.ne == (100, 3, 1, 1))
    mask = np.zeros((3, 100))
    mask[0, :], mask[0, 70] = -np.inf, np.nan
    mask[2, :] = -np.inf
    inputs[mask_leaf] = mask
    got = ggx.compute(out, inputs, device=cpu)[0]  # numpy order [T, H, Dv]
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all() and not got[2].any()
