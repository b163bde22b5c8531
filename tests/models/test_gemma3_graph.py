"""The gemma3 architecture on tiny synthetic GGUF files, run on the reference backend ("ref"):
against an independent float64 numpy Gemma 3, and the sliding-window cache against a full one."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf_synth import write_tiny_gemma3

from ggx.models import GGUFFile, load_model, read_hparams
from ggx.models.kv_cache import KV_PAD


def numpy_gemma3(path, ids: list[int]) -> np.ndarray:
    """An independent float64 Gemma 3 (dequantized weights): logits (T, n_vocab)."""
    f = GGUFFile(path)
    md = f.metadata
    n_layer, n_embd = md["gemma3.block_count"], md["gemma3.embedding_length"]
    H, Hkv = md["gemma3.attention.head_count"], md["gemma3.attention.head_count_kv"]
    D = md["gemma3.attention.key_length"]
    eps, base = md["gemma3.attention.layer_norm_rms_epsilon"], md["gemma3.rope.freq_base"]
    n_swa, pattern = md.get("gemma3.attention.sliding_window", 0), md.get("gemma3.attention.sliding_window_pattern", 6)

    def W(name):
        t = f.tensor(name)
        qt = gguf.GGMLQuantizationType(t.type.ggml_id)
        return gguf.quants.dequantize(np.asarray(t.data), qt).astype(np.float64).reshape(tuple(reversed(t.ne)))

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, pos, b):  # x (T, heads, D): NEOX, rotate (x[i], x[i + D/2])
        half = D // 2
        theta = pos[:, None] * b ** (-np.arange(half) * 2 / D)
        c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        x0, x1 = x[..., :half], x[..., half:]
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    T = len(ids)
    emb = W("token_embd.weight")
    x = emb[ids] * np.sqrt(n_embd)
    pos = np.arange(T, dtype=np.float64)
    qpos, kpos = np.arange(T)[:, None], np.arange(T)[None, :]
    for il in range(n_layer):
        swa = n_swa > 0 and il % pattern < pattern - 1
        allowed = (kpos <= qpos) & ((qpos - kpos < n_swa) if swa else True)
        bias = np.where(allowed, 0.0, -np.inf)
        b = f"blk.{il}."
        h = rms(x, W(b + "attn_norm.weight"))
        q = rms((h @ W(b + "attn_q.weight").T).reshape(T, H, D), W(b + "attn_q_norm.weight"))
        k = rms((h @ W(b + "attn_k.weight").T).reshape(T, Hkv, D), W(b + "attn_k_norm.weight"))
        v = (h @ W(b + "attn_v.weight").T).reshape(T, Hkv, D)
        q, k = rope(q, pos, 10000.0 if swa else base), rope(k, pos, 10000.0 if swa else base)
        q = q / np.sqrt(D)
        out = np.zeros((T, H, D))
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = q[:, hh] @ k[:, kv].T + bias
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
        attn = out.reshape(T, H * D) @ W(b + "attn_output.weight").T
        x = x + rms(attn, W(b + "post_attention_norm.weight"))
        h = rms(x, W(b + "ffn_norm.weight"))
        ffn = (gelu(h @ W(b + "ffn_gate.weight").T) * (h @ W(b + "ffn_up.weight").T)) @ W(b + "ffn_down.weight").T
        x = x + rms(ffn, W(b + "post_ffw_norm.weight"))
    return rms(x, W("output_norm.weight")) @ emb.T


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return write_tiny_gemma3(tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf")


def _prompt(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(2, n_vocab, size=n).tolist()


def test_hparams(tiny_gemma3):
    arch, hp = read_hparams(GGUFFile(tiny_gemma3))
    assert arch.name == "gemma3" and hp.head_dim == 48 and hp.n_embd_q == 96 and hp.n_head_kv == 1
    assert hp.swa_layers == (True, True, False) and hp.n_swa == 6
    assert [hp.rope_base(il) for il in range(3)] == [10000.0, 10000.0, 1e6]
    assert hp.q_scale == pytest.approx(1 / np.sqrt(48)) and hp.embd_scale == pytest.approx(np.sqrt(64))


@pytest.mark.parametrize("flash_attn", [True, False], ids=["flash_attn", "soft_max"])
def test_forward_matches_numpy_gemma3(tiny_gemma3, flash_attn):
    m = load_model(tiny_gemma3, devices=["ref"], flash_attn=flash_attn)
    ids = _prompt(40, m.n_vocab)
    got, want = m.forward(ids), numpy_gemma3(tiny_gemma3, ids)
    # ggx rounds K/V to F16 in the cache; everything else is float64 on ref
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    # without the window (or with llama's rope base on the sliding layers) rows past 6 differ far more
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_sliding_window_cache_holds_the_window_only(tiny_gemma3):
    small = load_model(tiny_gemma3, devices=["ref"], n_ctx=1024, n_batch=16)
    large = load_model(tiny_gemma3, devices=["ref"], n_ctx=2048, n_batch=16)
    full = load_model(tiny_gemma3, devices=["ref"], n_ctx=2048, n_batch=16, swa_full=True)
    # sliding layers (0, 1) keep n_swa + n_batch slots rounded up to KV_PAD, whatever the context
    for m in (small, large):
        assert [k.ne[1] for k in m.cache.k] == [KV_PAD, KV_PAD, m.n_ctx]
    assert [k.ne[1] for k in full.cache.k] == [2048] * 3
    assert large.cache.nbytes - small.cache.nbytes == 2 * 1024 * 48 * 2  # only the global layer grew (K and V)


def test_sliding_window_ring_wraps_without_changing_results(tiny_gemma3):
    """Past the ring's 256 slots the oldest are overwritten: logits stay those of a full cache
    and of the numpy model, in batches and in decode steps."""
    ring = load_model(tiny_gemma3, devices=["ref"], n_ctx=600, n_batch=16)
    full = load_model(tiny_gemma3, devices=["ref"], n_ctx=600, n_batch=16, swa_full=True)
    ids = _prompt(300, ring.n_vocab, seed=1)
    a, b = ring.forward(ids[:290]), full.forward(ids[:290])
    steps_a = [ring.eval([t]) for t in ids[290:]]
    steps_b = [full.eval([t]) for t in ids[290:]]
    assert ring.cache.swa.cell_pos.max() == 299 and ring.cache.swa.size == KV_PAD
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())
    np.testing.assert_allclose(np.concatenate(steps_a), np.concatenate(steps_b), rtol=0, atol=1e-6 * np.abs(b).max())
    want = numpy_gemma3(tiny_gemma3, ids)
    got = np.concatenate([a] + steps_a)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


def test_a_batch_larger_than_the_ring_allows_is_refused(tiny_gemma3):
    from ggx.errors import GGXShapeError

    m = load_model(tiny_gemma3, devices=["ref"], n_ctx=600, n_batch=16)
    with pytest.raises(GGXShapeError, match="sliding-window ring"):
        m.cache.plan(300)
