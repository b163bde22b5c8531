"""The llama graph on tiny synthetic GGUF files, run on the reference backend ("ref")."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf_synth import write_tiny_llama

from ggx.errors import GGXShapeError
from ggx.models import GGUFFile, load_model, read_hparams

PROMPT = [5, 70, 71, 72, 3, 200, 33, 101, 9, 44, 45]


def numpy_llama(path, ids: list[int]) -> np.ndarray:
    """An independent float64 llama (dequantized weights, causal attention, NORMAL rope): logits (T, n_vocab)."""
    f = GGUFFile(path)
    _, hp = read_hparams(f)

    def W(name):
        t = f.tensor(name)
        qt = gguf.GGMLQuantizationType(t.type.ggml_id)
        return gguf.quants.dequantize(np.asarray(t.data), qt).astype(np.float64).reshape(tuple(reversed(t.ne)))

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + hp.rms_eps) * w

    def rope(x, pos):  # x (T, H, D): rotate adjacent pairs
        d = hp.n_rot
        theta = pos[:, None] * hp.rope_freq_base ** (-np.arange(0, d, 2) / d)
        c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        x0, x1 = x[..., 0:d:2].copy(), x[..., 1:d:2].copy()
        out = x.copy()
        out[..., 0:d:2], out[..., 1:d:2] = x0 * c - x1 * s, x0 * s + x1 * c
        return out

    T, D, H, Hkv = len(ids), hp.head_dim, hp.n_head, hp.n_head_kv
    emb = W("token_embd.weight")
    x = emb[ids]
    pos = np.arange(T, dtype=np.float64)
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        h = rms(x, W(b + "attn_norm.weight"))
        q = rope((h @ W(b + "attn_q.weight").T).reshape(T, H, D), pos)
        k = rope((h @ W(b + "attn_k.weight").T).reshape(T, Hkv, D), pos)
        v = (h @ W(b + "attn_v.weight").T).reshape(T, Hkv, D)
        out = np.zeros((T, H, D))
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(D) + causal
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(T, H * D) @ W(b + "attn_output.weight").T
        h = rms(x, W(b + "ffn_norm.weight"))
        g, u = h @ W(b + "ffn_gate.weight").T, h @ W(b + "ffn_up.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ W(b + "ffn_down.weight").T
    x = rms(x, W("output_norm.weight"))
    return x @ (emb if hp.tied_output else W("output.weight")).T


@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    m = load_model(tiny_llama, devices=["ref"])
    assert m.wait_prepared(120)  # the scheduler's statistics the tests read are their graphs only
    return m


def test_forward_matches_numpy_llama(tiny_model, tiny_llama):
    got = tiny_model.forward(PROMPT)
    assert got.shape == (len(PROMPT), tiny_model.n_vocab) and got.dtype == np.float32
    want = numpy_llama(tiny_llama, PROMPT)
    # ggx rounds K/V to F16 in the cache; everything else is float64 on ref
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_incremental_decode_equals_one_batch(tiny_model):
    full = tiny_model.forward(PROMPT)
    tiny_model.reset()
    first = tiny_model.eval(PROMPT[:4], all_logits=True)
    rows = [first] + [tiny_model.eval([t]) for t in PROMPT[4:]]
    np.testing.assert_allclose(np.concatenate(rows), full, atol=1e-4)
    assert tiny_model.cache.n_past == len(PROMPT)


def test_small_batches_and_softmax_path(tiny_llama, tiny_model):
    full = tiny_model.forward(PROMPT)
    m = load_model(tiny_llama, devices=["ref"], n_batch=4, flash_attn=False)
    np.testing.assert_allclose(m.forward(PROMPT), full, atol=1e-3)


def test_decode_reuses_the_scheduler_plan(tiny_model):
    tiny_model.reset()
    tiny_model.eval(PROMPT)
    sched = tiny_model.runner.sched
    tiny_model.eval([7])
    plans = sched.stats.n_plans
    for t in (8, 9, 10, 11):
        tiny_model.eval([t])
        assert sched.stats.plan_reused
    assert sched.stats.n_plans == plans


@pytest.mark.parametrize("background", [False, True])
def test_prompt_buckets_are_ready_after_load(tiny_llama, background):
    """Loading builds and plans every prompt bucket up to PREPARED_PROMPT_TOKENS on an empty
    cache (in the background: once `wait_prepared` returns), so a first prompt of any such length
    builds and plans nothing; a longer one does."""
    from ggx.models.model import PREPARED_PROMPT_TOKENS, prompt_bucket

    m = load_model(tiny_llama, devices=["ref"], n_ctx=PREPARED_PROMPT_TOKENS + 64, background=background)
    assert m.wait_prepared(120) and m.background_error is None
    assert (m.background_s is not None) == background
    sched, timings = m.runner.sched, m.runner.timings
    plans, built = sched.stats.n_plans, timings["build graph"]
    rng = np.random.default_rng(0)
    for n in sorted({prompt_bucket(n) for n in range(2, PREPARED_PROMPT_TOKENS + 1)}):
        m.reset()
        m.eval(rng.integers(0, m.n_vocab, n - 1))
    assert sched.stats.n_plans == plans and timings["build graph"] == built
    m.reset()
    m.eval(rng.integers(0, m.n_vocab, PREPARED_PROMPT_TOKENS + 1))
    assert sched.stats.n_plans == plans + 1 and timings["build graph"] > built
    unprepared = load_model(tiny_llama, devices=["ref"], warmup=False)
    assert unprepared.runner.sched.stats.n_plans == 0


def test_untied_output(tmp_path):
    p = write_tiny_llama(tmp_path / "untied.gguf", tied=False, wtype="Q8_0", seed=3)
    m = load_model(p, devices=["ref"])
    assert not m.hp.tied_output
    want = numpy_llama(p, PROMPT[:5])
    got = m.forward(PROMPT[:5])
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


def test_generate_greedy_is_argmax_chain(tiny_model):
    toks = list(tiny_model.generate(PROMPT, max_tokens=6, stop_at_eos=False))
    assert len(toks) == 6
    seq = list(PROMPT)
    for t in toks:
        assert t.id == int(tiny_model.forward(seq)[-1].argmax())
        seq.append(t.id)
    a = [t.id for t in tiny_model.generate(PROMPT, 6, temperature=0.9, seed=5, stop_at_eos=False)]
    b = [t.id for t in tiny_model.generate(PROMPT, 6, temperature=0.9, seed=5, stop_at_eos=False)]
    assert a == b


def test_bad_inputs(tiny_model):
    with pytest.raises(GGXShapeError, match="outside the vocabulary"):
        tiny_model.forward([1, tiny_model.n_vocab])
    with pytest.raises(GGXShapeError, match="no tokens"):
        tiny_model.forward([])
    with pytest.raises(GGXShapeError, match="do not fit"):
        tiny_model.forward([3] * (tiny_model.n_ctx + 1))


def test_fused_qkv_and_gate_up_change_nothing(tiny_llama, tiny_model):
    from ggx.graph import Context, build_graph
    from ggx.models.blocks import BatchShape
    from ggx.ops import Op

    assert "blk.0.attn_qkv.weight" in tiny_model.weights and "blk.0.attn_q.weight" not in tiny_model.weights
    plain = load_model(tiny_llama, devices=["ref"], fuse=False)
    assert "blk.0.attn_q.weight" in plain.weights and "blk.0.ffn_gate_up.weight" not in plain.weights
    np.testing.assert_allclose(tiny_model.forward(PROMPT), plain.forward(PROMPT), rtol=1e-6, atol=1e-5)

    def n_mul_mat(m):
        logits, _ = m.arch.build(Context(), m.hp, m.weights, m.cache, BatchShape(1, 256, 1))
        return sum(n.op is Op.MUL_MAT for n in build_graph(logits).nodes)

    assert n_mul_mat(plain) - n_mul_mat(tiny_model) == 3 * tiny_model.hp.n_layer


@pytest.mark.parametrize("flash_attn", [True, False])
def test_stale_or_garbage_cache_bytes_never_leak(tiny_llama, flash_attn):
    """The cache is zeroed lazily (slots as they become visible), not at load or reset: NaN bytes
    left in it before a reset must not reach the logits on either attention path."""
    m = load_model(tiny_llama, devices=["ref"], n_ctx=512, flash_attn=flash_attn)
    clean = m.forward(PROMPT)
    m.cache.buffer.clear(0xFF)  # every F16 cache value becomes NaN
    again = m.forward(PROMPT)
    np.testing.assert_array_equal(again, clean)
    m.eval([i % 200 for i in range(300 - len(PROMPT))])  # crosses into the second 256-slot bucket: zeroed on the way
    assert m.cache.full.n_zeroed == 512 and np.isfinite(m.eval([3])).all()
