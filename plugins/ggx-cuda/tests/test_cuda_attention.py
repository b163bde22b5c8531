"""FLASH_ATTN_EXT (ggx_cuda/ops/attention.py, kernels/attention.cu) without a GPU: the name
expressions compile and lower, launches match the kernel signature, every conformance case
passes on a numpy model driven by the launch arguments and (a selection, plus cases the suite
lacks: several key chunks, a masked first chunk, mixed K/V types, Dv != D, batches, per-head
masks) on the kernel itself compiled for the host."""
from __future__ import annotations

import math

import cuda_testing as ct
import numpy as np
import pytest

from ggx.conformance.case import Builder
from ggx.conformance.cases import case
from ggx.graph import Context, build_graph
from ggx.ops import FlashAttnParams, Op
from ggx.tensor import Tensor
from ggx.types import GType
from ggx_cuda.kernels import NAME_EXPRESSIONS
from ggx_cuda.ops import attention

F32, F16 = GType.F32, GType.F16
SOURCE = attention.SOURCE
CASES = ct.cases_for((Op.FLASH_ATTN_EXT,))


@pytest.mark.parametrize("arch", ct.ARCHS)
def test_names_compile_and_lower(arch):
    lowered = ct.check_compiles(SOURCE, arch)  # and the PTX parameters are the parsed signature's
    assert set(lowered) == set(NAME_EXPRESSIONS[SOURCE]) == {
        attention.kernel(k, v).name for k in (F16, F32) for v in (F16, F32)}


def test_conformance_cases_supported():
    assert len(CASES) > 30
    declined = [c.name for c in CASES for n in build_graph(c.make().out).nodes
                if n.op is Op.FLASH_ATTN_EXT and not attention.supports(n)]
    assert declined == []


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_cases_on_model(c):
    ct.check_case(c, attention.supports, attention.plan)


def _small(c) -> bool:
    v = dict(c.vars)
    return v["n_head"] * v["n_tokens"] <= 24


@pytest.mark.parametrize("c", [c for c in CASES if _small(c)], ids=lambda c: c.name)
def test_cases_on_host_kernel(c, host_cc):
    ct.check_case(c, attention.supports, attention.plan, host=True)


def _extra(name, d, dv, k_t, v_t, n_tokens, n_kv, n_head, n_head_kv, batch=1, batch_kv=1, mask_heads=1,
           mask_batch=1, max_bias=0.0, softcap=0.0, masked_rows=True, rising=False):
    def build(b: Builder):
        q = b.uniform(F32, (d, n_tokens, n_head, batch), "q")
        k = b.uniform(k_t, (d, n_kv, n_head_kv, batch_kv), "k")
        v = b.uniform(v_t, (dv, n_kv, n_head_kv, batch_kv), "v")
        mv = b.rng.uniform(-1, 1, (mask_batch, mask_heads, n_tokens + 2, n_kv)).astype(np.float32)
        if rising:  # the running max moves on at every chunk: the rescaling by exp(M - M') matters
            mv += np.linspace(0.0, 8.0, n_kv, dtype=np.float32)
        if masked_rows:
            mv[..., 0, :200] = -np.inf  # the first chunk(s) masked: the running max starts later
            mv[..., 1, :] = -np.inf  # every key masked: zeros
            mv[..., 2, :-1] = -np.inf  # only the last key
        mask = b.leaf(F16, (n_kv, n_tokens + 2, mask_heads, mask_batch), "mask", mv)
        return b.ctx.flash_attn_ext(q, k, v, mask, 1 / math.sqrt(d), max_bias, softcap)
    return case(Op.FLASH_ATTN_EXT, build, (k_t,), name=name)


EXTRA = [
    _extra("chunks", 64, 64, F16, F16, 4, 300, 2, 1),
    _extra("chunks_rising", 64, 64, F32, F16, 4, 300, 2, 1, rising=True),
    _extra("mixed_kv_dv_wider", 80, 256, F32, F16, 3, 260, 2, 2),
    _extra("dv_narrower", 256, 40, F16, F32, 3, 129, 1, 1, softcap=30.0),
    _extra("batches_alibi", 32, 32, F16, F16, 3, 140, 6, 3, batch=2, batch_kv=1, mask_heads=6, mask_batch=2,
           max_bias=8.0),
    _extra("batch_kv", 32, 48, F32, F32, 2, 17, 4, 2, batch=4, batch_kv=2, mask_heads=2, masked_rows=False),
]


@pytest.mark.parametrize("c", EXTRA, ids=lambda c: dict(c.vars)["name"])
def test_more_shapes_on_host_kernel(c, host_cc):
    ct.check_case(c, attention.supports, attention.plan, host=True)


@pytest.mark.parametrize("c", EXTRA, ids=lambda c: dict(c.vars)["name"])
def test_more_shapes_on_model(c):
    ct.check_case(c, attention.supports, attention.plan)


def test_launch_arguments():
    ctx = Context()
    q = ctx.permute(ctx.tensor(F32, (64, 8, 5)), 0, 2, 1, 3)  # [64, 5, 8]
    k, v = ctx.tensor(F16, (64, 33, 2)), ctx.tensor(F16, (64, 33, 2))
    mask = ctx.tensor(F16, (33, 8))
    node = ctx.flash_attn_ext(q, k, v, mask, 0.125, 8.0, 20.0)
    sc = ct.StubCtx()
    launch, = attention.plan_generic(node, sc)
    assert launch.kernel == attention.kernel(F16, F16)
    assert launch.grid == (5, 8, 1) and launch.block == (128, 1, 1) and launch.shared == 0
    a = ct.bind(launch)
    assert [int(a[x]) for x in ("q", "k", "v", "mask", "dst")] == [sc.ptr(t) for t in (q, k, v, mask, node)]
    assert [int(a[x]) for x in ("D", "Dv", "KV", "gqa", "r3", "has_mask")] == [64, 64, 33, 4, 1, 1]
    assert [int(a[x]) for x in ("nbq1", "nbq2", "nbd1", "nbd2")] == [q.nb[1], q.nb[2], node.nb[1], node.nb[2]]
    assert int(a["n_head_log2"]) == 8 and a["m0"] == np.float32(2.0 ** -1) and a["m1"] == np.float32(2.0 ** -0.5)
    assert a["softcap"] == np.float32(20.0) and a["scale"] == np.float32(0.125)


def test_no_mask_passes_null():
    ctx = Context()
    node = ctx.flash_attn_ext(ctx.tensor(F32, (64, 3, 2)), ctx.tensor(F32, (64, 9, 1)), ctx.tensor(F16, (64, 9, 1)))
    launch, = attention.plan_generic(node, ct.StubCtx())
    a = ct.bind(launch)
    assert launch.kernel == attention.kernel(F32, F16)
    assert int(a["mask"]) == 0 and int(a["has_mask"]) == 0 and int(a["mask_ne2"]) == 1


def test_declines_wide_heads_and_other_types():
    ctx = Context()
    q, k, v = ctx.tensor(F32, (512, 2, 2)), ctx.tensor(F16, (512, 8, 2)), ctx.tensor(F16, (512, 8, 2))
    assert not attention.supports(ctx.flash_attn_ext(q, k, v))  # D 512 > 256
    q2, k2 = ctx.tensor(F32, (64, 2, 2)), ctx.tensor(F16, (64, 8, 2))
    assert not attention.supports(ctx.flash_attn_ext(q2, k2, ctx.tensor(F16, (320, 8, 2))))  # Dv 320
    assert attention.supports(ctx.flash_attn_ext(q2, k2, ctx.tensor(F16, (256, 8, 2))))
    # hand-made nodes with types the graph refuses
    params = FlashAttnParams(1.0)
    bad_q = Tensor(F32, (64, 2, 2), op=Op.FLASH_ATTN_EXT, params=params,
                   src=(ctx.tensor(F16, (64, 2, 2)), k2, k2))
    assert not attention.supports(bad_q)
    bad_mask = Tensor(F32, (64, 2, 2), op=Op.FLASH_ATTN_EXT, params=params,
                      src=(q2, k2, k2, ctx.tensor(F32, (8, 2))))
    assert not attention.supports(bad_mask)
    bf16_kv = Tensor(F32, (64, 2, 2), op=Op.FLASH_ATTN_EXT, params=params,
                     src=(q2, ctx.tensor(GType.BF16, (64, 8, 2)), k2))
    assert not attention.supports(bf16_kv)


def test_empty_output_plans_nothing():
    ctx = Context()
    node = ctx.flash_attn_ext(ctx.tensor(F32, (64, 0, 2)), ctx.tensor(F16, (64, 8, 2)), ctx.tensor(F16, (64, 8, 2)))
    assert attention.plan(node, ct.StubCtx()) == []


def test_alibi_matches_reference_slopes():
    from ggx.reference.ops import alibi_slopes

    for n_head in (1, 6, 8, 12):
        m0, m1, nl2 = attention.alibi(n_head, 8.0)
        got = [m0 ** (h + 1) if h < nl2 else m1 ** (2 * (h - nl2) + 1) for h in range(n_head)]
        np.testing.assert_allclose(got, alibi_slopes(n_head, 8.0))
