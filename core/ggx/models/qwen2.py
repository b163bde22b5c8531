"""The Qwen 2 architecture (Qwen2, Qwen2.5; llama.cpp's src/models/qwen2.cpp).

llama's graph with biases on the Q, K and V projections and NEOX RoPE (the Qwen converters do
not permute Q/K rows): per layer x += attn_output(attention(rms_norm(x) * attn_norm)), then
x += SwiGLU FFN(rms_norm(x) * ffn_norm); the output matrix is the tied token embedding unless
the file has output.weight.
"""
from __future__ import annotations

from ..ops import RopeMode
from . import llama
from .architectures import Architecture
from .gguf_file import GGUFFile
from .hparams import HParams, MetadataReader, common_tensors


def read_hparams(f: GGUFFile) -> HParams:
    return HParams(**MetadataReader(f, "qwen2").common(), rope_mode=RopeMode.NEOX)


def expected_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    e, ff = hp.n_embd, hp.n_ff
    want = common_tensors(hp)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        want.update({b + "attn_q.bias": (hp.n_embd_q,), b + "attn_k.bias": (hp.n_embd_kv,),
                     b + "attn_v.bias": (hp.n_embd_kv,),
                     b + "ffn_gate.weight": (e, ff), b + "ffn_up.weight": (e, ff), b + "ffn_down.weight": (ff, e)})
    return want


# the layer loop is llama's: the blocks add the biases the weights hold
ARCH = Architecture("qwen2", read_hparams, expected_tensors, llama.build)
