"""The Qwen 3 architecture, dense (llama.cpp's src/models/qwen3.cpp).

llama's graph with RMS norms of Q and K per head (attn_q_norm / attn_k_norm, applied before
RoPE), NEOX RoPE, and a head size from `qwen3.attention.key_length` that need not be
n_embd / n_head (Qwen3-0.6B: 16 heads of 128 over n_embd 1024); the attention scales by
1/sqrt(head size). The output matrix is the tied token embedding unless the file has
output.weight.
"""
from __future__ import annotations

from ..ops import RopeMode
from . import llama
from .architectures import Architecture
from .gguf_file import GGUFFile
from .hparams import HParams, MetadataReader, common_tensors


def read_hparams(f: GGUFFile) -> HParams:
    return HParams(**MetadataReader(f, "qwen3").common(), rope_mode=RopeMode.NEOX)


def attention_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    """What every Qwen 3 reads: the shared tensors and each layer's Q/K norms (one weight per head
    element, shared by the heads)."""
    want = common_tensors(hp)
    for i in range(hp.n_layer):
        want.update({f"blk.{i}.attn_q_norm.weight": (hp.head_dim,), f"blk.{i}.attn_k_norm.weight": (hp.head_dim,)})
    return want


def expected_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    e, ff = hp.n_embd, hp.n_ff
    want = attention_tensors(hp)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        want.update({b + "ffn_gate.weight": (e, ff), b + "ffn_up.weight": (e, ff), b + "ffn_down.weight": (ff, e)})
    return want


# the layer loop is llama's: the blocks apply the Q/K norms the weights hold
ARCH = Architecture("qwen3", read_hparams, expected_tensors, llama.build)
