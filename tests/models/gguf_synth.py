"""Tiny synthetic GGUF files (llama dense or MoE, gemma3; random weights) written with gguf.GGUFWriter."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from ggx.models.tokenizer import _byte_decoder
from ggx.quants import quantize
from ggx.types import GType

# a byte-level BPE vocabulary: the 256 byte stand-ins, a few merges, two special tokens
_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "a t", "e n"]


def _byte_chars() -> list[str]:
    """GPT-2's 256 byte stand-in characters, in byte order (the tokenizer's own table)."""
    table = _byte_decoder()
    return sorted(table, key=table.__getitem__)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = ["<s>", "</s>"] + _byte_chars() + [m.replace(" ", "") for m in _MERGES]
    types = [3, 3] + [1] * (len(tokens) - 2)
    return tokens, types, list(_MERGES)


class _Writer:
    """A GGUFWriter with the shared metadata (and the tiny BPE vocabulary) written, adding random tensors."""

    def __init__(self, path: Path, arch: str, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int,
                 seed: int, n_ctx_train: int, head_dim: int | None = None, rope_base: float = 10000.0,
                 rms_eps: float = 1e-5):
        self.rng = np.random.default_rng(seed)
        tokens, types, merges = tiny_vocab()
        self.n_vocab = len(tokens)
        w = self.w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(n_layer)
        w.add_context_length(n_ctx_train)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_freq_base(rope_base)
        w.add_layer_norm_rms_eps(rms_eps)
        if head_dim is not None:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim or n_embd // n_head)
        w.add_vocab_size(self.n_vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_add_bos_token(False)

    def add(self, name: str, ne: tuple[int, ...], kind: gguf.GGMLQuantizationType | str, scale: float = 0.5) -> None:
        kind = gguf.GGMLQuantizationType[kind] if isinstance(kind, str) else kind
        values = (self.rng.standard_normal(tuple(reversed(ne))) * scale).astype(np.float32)
        if kind == gguf.GGMLQuantizationType.F32:
            self.w.add_tensor(name, values)
        elif kind == gguf.GGMLQuantizationType.F16:
            self.w.add_tensor(name, values.astype(np.float16))
        elif kind == gguf.GGMLQuantizationType.Q5_K:  # gguf only dequantizes Q5_K: ggx's own quantizer
            self.w.add_tensor(name, quantize(values, GType.Q5_K), raw_dtype=kind)
        else:
            self.w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    def add_norm(self, name: str, n: int) -> None:
        self.w.add_tensor(name, (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32))

    def close(self, path: Path) -> Path:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return path


def write_tiny_llama(path: Path, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                     n_ff: int = 96, n_expert: int = 0, n_expert_used: int = 0, wtype: str = "Q4_1",
                     tied: bool = True, seed: int = 0, n_ctx_train: int = 512,
                     chat_template: str | None = None, rope_freqs: np.ndarray | None = None) -> Path:
    """A random-weight llama GGUF (weights of type `wtype`, Q8_0 embedding, F32 norms and router),
    with `chat_template` as tokenizer.chat_template and `rope_freqs` as rope_freqs.weight when given."""
    wr = _Writer(path, "llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                 seed=seed, n_ctx_train=n_ctx_train)
    if chat_template is not None:
        wr.w.add_chat_template(chat_template)
    if n_expert:
        wr.w.add_expert_count(n_expert)
        wr.w.add_expert_used_count(n_expert_used)
    add, e, kv = wr.add, n_embd, n_embd // n_head * n_head_kv
    add("token_embd.weight", (e, wr.n_vocab), "Q8_0", 1.0)
    for i in range(n_layer):
        b = f"blk.{i}."
        wr.add_norm(b + "attn_norm.weight", e)
        add(b + "attn_q.weight", (e, e), wtype, 0.3)
        add(b + "attn_k.weight", (e, kv), wtype, 0.3)
        add(b + "attn_v.weight", (e, kv), wtype, 0.3)
        add(b + "attn_output.weight", (e, e), wtype, 0.2)
        wr.add_norm(b + "ffn_norm.weight", e)
        if n_expert:
            add(b + "ffn_gate_inp.weight", (e, n_expert), "F32", 0.5)
            add(b + "ffn_gate_exps.weight", (e, n_ff, n_expert), wtype, 0.3)
            add(b + "ffn_up_exps.weight", (e, n_ff, n_expert), wtype, 0.3)
            add(b + "ffn_down_exps.weight", (n_ff, e, n_expert), wtype, 0.2)
        else:
            add(b + "ffn_gate.weight", (e, n_ff), wtype, 0.3)
            add(b + "ffn_up.weight", (e, n_ff), wtype, 0.3)
            add(b + "ffn_down.weight", (n_ff, e), wtype, 0.2)
    wr.w.add_tensor("output_norm.weight", np.ones(e, dtype=np.float32))
    if not tied:
        add("output.weight", (e, wr.n_vocab), wtype, 0.5)
    if rope_freqs is not None:
        wr.w.add_tensor("rope_freqs.weight", rope_freqs)
    return wr.close(path)


def write_tiny_gemma3(path: Path, *, n_layer: int = 3, n_embd: int = 64, n_head: int = 2, n_head_kv: int = 1,
                      head_dim: int = 48, n_ff: int = 64, n_swa: int = 6, swa_pattern: int = 3, wtype: str = "Q8_0",
                      seed: int = 2, n_ctx_train: int = 2048, rope_base: float = 1e6) -> Path:
    """A random-weight gemma3 GGUF: head size `head_dim` (not n_embd / n_head), Q/K norms, post
    norms, a sliding window of `n_swa` on layers il % swa_pattern < swa_pattern - 1."""
    wr = _Writer(path, "gemma3", n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                 seed=seed, n_ctx_train=n_ctx_train, head_dim=head_dim, rope_base=rope_base, rms_eps=1e-6)
    if n_swa:
        wr.w.add_sliding_window(n_swa)
        wr.w.add_uint32("gemma3.attention.sliding_window_pattern", swa_pattern)
    add, e, q, kv = wr.add, n_embd, head_dim * n_head, head_dim * n_head_kv
    add("token_embd.weight", (e, wr.n_vocab), "Q8_0", 0.2)
    for i in range(n_layer):
        b = f"blk.{i}."
        wr.add_norm(b + "attn_norm.weight", e)
        add(b + "attn_q.weight", (e, q), wtype, 0.3)
        add(b + "attn_k.weight", (e, kv), wtype, 0.3)
        add(b + "attn_v.weight", (e, kv), wtype, 0.3)
        wr.add_norm(b + "attn_q_norm.weight", head_dim)
        wr.add_norm(b + "attn_k_norm.weight", head_dim)
        add(b + "attn_output.weight", (q, e), wtype, 0.2)
        wr.add_norm(b + "post_attention_norm.weight", e)
        wr.add_norm(b + "ffn_norm.weight", e)
        add(b + "ffn_gate.weight", (e, n_ff), wtype, 0.3)
        add(b + "ffn_up.weight", (e, n_ff), wtype, 0.3)
        add(b + "ffn_down.weight", (n_ff, e), wtype, 0.2)
        wr.add_norm(b + "post_ffw_norm.weight", e)
    wr.w.add_tensor("output_norm.weight", np.ones(e, dtype=np.float32))
    return wr.close(path)


def write_tiny_qwen(path: Path, arch: str, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                    head_dim: int | None = None, n_ff: int = 64, n_expert: int = 4, n_expert_used: int = 2,
                    wtype: str = "Q8_0", seed: int = 3, drop: tuple[str, ...] = (),
                    replace: dict[str, tuple[tuple[int, ...], str]] | None = None,
                    metadata: dict[str, int | float | str | None] | None = None) -> Path:
    """A random-weight qwen2 (Q/K/V biases), qwen3 (per-head Q/K norms, head size `head_dim`) or
    qwen3moe (qwen3 attention, `n_expert` experts of `n_ff`) GGUF with RoPE base 1e6. For
    validation tests: `drop` leaves tensors out, `replace` gives tensors another ne and type,
    `metadata` sets (or, with None, leaves out) `{arch}.*` keys."""
    moe = arch == "qwen3moe"
    wr = _Writer(path, arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                 seed=seed, n_ctx_train=1024, head_dim=head_dim, rope_base=1e6, rms_eps=1e-6)
    keys = {f"{arch}.expert_count": n_expert, f"{arch}.expert_used_count": n_expert_used,
            f"{arch}.expert_feed_forward_length": n_ff} if moe else {}
    keys.update({f"{arch}.{k}": v for k, v in (metadata or {}).items()})
    for k, v in keys.items():
        if isinstance(v, str):
            wr.w.add_string(k, v)
        elif isinstance(v, float):
            wr.w.add_float32(k, v)
        elif v is not None:
            wr.w.add_uint32(k, v)
    d = head_dim or n_embd // n_head
    e, q, kv = n_embd, d * n_head, d * n_head_kv
    replace = replace or {}

    def add(name, ne, kind, scale=0.3):
        if name in drop:
            return
        ne, kind = replace.get(name, (ne, kind))
        if kind == "norm":
            wr.add_norm(name, ne[0])
        else:
            wr.add(name, ne, kind, scale)

    add("token_embd.weight", (e, wr.n_vocab), "Q8_0", 1.0)
    for i in range(n_layer):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (e,), "norm")
        add(b + "attn_q.weight", (e, q), wtype)
        add(b + "attn_k.weight", (e, kv), wtype)
        add(b + "attn_v.weight", (e, kv), wtype)
        if arch == "qwen2":
            add(b + "attn_q.bias", (q,), "F32", 0.5)
            add(b + "attn_k.bias", (kv,), "F32", 0.5)
            add(b + "attn_v.bias", (kv,), "F32", 0.5)
        else:
            add(b + "attn_q_norm.weight", (d,), "norm")
            add(b + "attn_k_norm.weight", (d,), "norm")
        add(b + "attn_output.weight", (q, e), wtype, 0.2)
        add(b + "ffn_norm.weight", (e,), "norm")
        if moe:
            add(b + "ffn_gate_inp.weight", (e, n_expert), "F32", 0.5)
            add(b + "ffn_gate_exps.weight", (e, n_ff, n_expert), wtype)
            add(b + "ffn_up_exps.weight", (e, n_ff, n_expert), wtype)
            add(b + "ffn_down_exps.weight", (n_ff, e, n_expert), wtype, 0.2)
        else:
            add(b + "ffn_gate.weight", (e, n_ff), wtype)
            add(b + "ffn_up.weight", (e, n_ff), wtype)
            add(b + "ffn_down.weight", (n_ff, e), wtype, 0.2)
    add("output_norm.weight", (e,), "norm")
    return wr.close(path)
