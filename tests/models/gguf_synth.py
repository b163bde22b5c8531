"""Tiny synthetic llama GGUF files (dense or MoE, random weights) written with gguf.GGUFWriter."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from ggx.models.tokenizer import _byte_decoder

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


def write_tiny_llama(path: Path, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                     n_ff: int = 96, n_expert: int = 0, n_expert_used: int = 0, wtype: str = "Q4_1",
                     tied: bool = True, seed: int = 0, n_ctx_train: int = 512) -> Path:
    """A random-weight llama GGUF (weights of type `wtype`, Q8_0 embedding, F32 norms and router)."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_vocab_size(n_vocab)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    qtype = gguf.GGMLQuantizationType[wtype]

    def add(name: str, ne: tuple[int, ...], kind: gguf.GGMLQuantizationType, scale: float = 0.5) -> None:
        values = (rng.standard_normal(tuple(reversed(ne))) * scale).astype(np.float32)
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, values)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    f32, e, kv = gguf.GGMLQuantizationType.F32, n_embd, n_embd // n_head * n_head_kv
    add("token_embd.weight", (e, n_vocab), gguf.GGMLQuantizationType.Q8_0, 1.0)
    for i in range(n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", (1.0 + 0.1 * rng.standard_normal(e)).astype(np.float32))
        add(b + "attn_q.weight", (e, e), qtype, 0.3)
        add(b + "attn_k.weight", (e, kv), qtype, 0.3)
        add(b + "attn_v.weight", (e, kv), qtype, 0.3)
        add(b + "attn_output.weight", (e, e), qtype, 0.2)
        w.add_tensor(b + "ffn_norm.weight", (1.0 + 0.1 * rng.standard_normal(e)).astype(np.float32))
        if n_expert:
            add(b + "ffn_gate_inp.weight", (e, n_expert), f32, 0.5)
            add(b + "ffn_gate_exps.weight", (e, n_ff, n_expert), qtype, 0.3)
            add(b + "ffn_up_exps.weight", (e, n_ff, n_expert), qtype, 0.3)
            add(b + "ffn_down_exps.weight", (n_ff, e, n_expert), qtype, 0.2)
        else:
            add(b + "ffn_gate.weight", (e, n_ff), qtype, 0.3)
            add(b + "ffn_up.weight", (e, n_ff), qtype, 0.3)
            add(b + "ffn_down.weight", (n_ff, e), qtype, 0.2)
    w.add_tensor("output_norm.weight", np.ones(e, dtype=np.float32))
    if not tied:
        add("output.weight", (e, n_vocab), qtype, 0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
