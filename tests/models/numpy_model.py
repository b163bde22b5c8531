"""An independent float64 numpy model of the transformer architectures (llama, qwen2, qwen3,
qwen3moe) read straight from a GGUF file: what the tests compare ggx's graphs against."""
from __future__ import annotations

import gguf
import numpy as np

from ggx.models import GGUFFile


def numpy_logits(path, ids: list[int]) -> np.ndarray:
    """An independent float64 llama / Qwen 2 / 3 / 3 MoE (dequantized weights): logits (T, n_vocab)."""
    f = GGUFFile(path)
    md = f.metadata
    arch = md["general.architecture"]
    n_layer, n_embd = md[f"{arch}.block_count"], md[f"{arch}.embedding_length"]
    H, Hkv = md[f"{arch}.attention.head_count"], md[f"{arch}.attention.head_count_kv"]
    D = md.get(f"{arch}.attention.key_length", n_embd // H)
    eps = md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    base = md.get(f"{arch}.rope.freq_base", 10000.0)
    k_used = md.get(f"{arch}.expert_used_count", 0)

    def W(name):
        t = f.tensor(name)
        qt = gguf.GGMLQuantizationType(t.type.ggml_id)
        return gguf.quants.dequantize(np.asarray(t.data), qt).astype(np.float64).reshape(tuple(reversed(t.ne)))

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    # llama's rope_freqs.weight (Llama 3.1+): pair i's angle is divided by factor i
    factors = W("rope_freqs.weight") if "rope_freqs.weight" in f.tensors else np.ones(D // 2)

    def rope(x, pos):  # llama: rotate (x[2i], x[2i+1]); Qwen (NEOX): (x[i], x[i + D/2])
        half = D // 2
        theta = pos[:, None] * base ** (-np.arange(half) * 2 / D) / factors
        c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        x0, x1 = (x[..., 0::2], x[..., 1::2]) if arch == "llama" else (x[..., :half], x[..., half:])
        y0, y1 = x0 * c - x1 * s, x0 * s + x1 * c
        if arch == "llama":
            return np.stack([y0, y1], axis=-1).reshape(x.shape)
        return np.concatenate([y0, y1], axis=-1)

    def silu(x):
        return x / (1 + np.exp(-x))

    T = len(ids)
    emb = W("token_embd.weight")
    x = emb[ids]
    pos = np.arange(T, dtype=np.float64)
    causal = np.where(np.arange(T)[None, :] <= np.arange(T)[:, None], 0.0, -np.inf)
    for il in range(n_layer):
        b = f"blk.{il}."
        h = rms(x, W(b + "attn_norm.weight"))
        q, k, v = (h @ W(b + f"attn_{n}.weight").T for n in "qkv")
        if b + "attn_q.bias" in f.tensors:  # Qwen 2
            q, k, v = q + W(b + "attn_q.bias"), k + W(b + "attn_k.bias"), v + W(b + "attn_v.bias")
        q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        if b + "attn_q_norm.weight" in f.tensors:  # Qwen 3
            q, k = rms(q, W(b + "attn_q_norm.weight")), rms(k, W(b + "attn_k_norm.weight"))
        q, k = rope(q, pos), rope(k, pos)
        out = np.zeros((T, H, D))
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(D) + causal
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(T, H * D) @ W(b + "attn_output.weight").T
        h = rms(x, W(b + "ffn_norm.weight"))
        if k_used:
            router = h @ W(b + "ffn_gate_inp.weight").T  # (T, n_expert)
            probs = np.exp(router - router.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            gate, up, down = (W(b + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
            ffn = np.zeros_like(x)
            for t in range(T):
                top = np.argsort(-probs[t])[:k_used]
                wts = probs[t, top] / probs[t, top].sum()  # renormalized over the chosen (llama.cpp's norm_w)
                for e, wt in zip(top, wts):
                    ffn[t] += wt * (down[e] @ (silu(gate[e] @ h[t]) * (up[e] @ h[t])))
        else:
            ffn = (silu(h @ W(b + "ffn_gate.weight").T) * (h @ W(b + "ffn_up.weight").T)) @ W(b + "ffn_down.weight").T
        x = x + ffn
    out_w = W("output.weight") if "output.weight" in f.tensors else emb
    return rms(x, W("output_norm.weight")) @ out_w.T
