"""The Qwen 3 mixture-of-experts architecture (llama.cpp's src/models/qwen3moe.cpp).

Qwen 3's attention (per-head Q/K norms, NEOX RoPE, head size from key_length) and, in every
layer, `expert_count` SwiGLU experts of `expert_feed_forward_length` (default
feed_forward_length / expert_used_count, as llama.cpp) behind a router: softmax over all
experts' logits, the top `expert_used_count` taken and their weights renormalized to sum 1
(llama.cpp's build_moe_ffn with norm_w), which is the softmax over the chosen logits alone
(blocks.moe_ffn). No shared expert.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import GGXFormatError
from ..ops import RopeMode
from . import llama
from .architectures import Architecture
from .gguf_file import GGUFFile
from .hparams import HParams, MetadataReader
from .qwen3 import attention_tensors

ARCH_NAME = "qwen3moe"


def read_hparams(f: GGUFFile) -> HParams:
    r = MetadataReader(f, ARCH_NAME)
    n_expert = r.count("expert_count", least=1)
    n_used = r.count("expert_used_count", least=1)
    if n_used > n_expert:
        raise GGXFormatError(f"{f.path}: {ARCH_NAME}.expert_used_count {n_used} is more than "
                             f"{ARCH_NAME}.expert_count {n_expert}")
    hp = HParams(**r.common(n_ff_default=0), rope_mode=RopeMode.NEOX, n_expert=n_expert, n_expert_used=n_used)
    # the experts' width is the only FFN width the graph uses
    n_ff_exp = r.count("expert_feed_forward_length", hp.n_ff // n_used)
    if n_ff_exp < 1:
        raise GGXFormatError(f"{f.path}: {ARCH_NAME}.expert_feed_forward_length is missing and "
                             f"{ARCH_NAME}.feed_forward_length {hp.n_ff} gives no expert width")
    return replace(hp, n_ff=n_ff_exp)


def expected_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    e, ff, x = hp.n_embd, hp.n_ff, hp.n_expert
    want = attention_tensors(hp)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        want.update({b + "ffn_gate_inp.weight": (e, x), b + "ffn_gate_exps.weight": (e, ff, x),
                     b + "ffn_up_exps.weight": (e, ff, x), b + "ffn_down_exps.weight": (ff, e, x)})
    return want


# the layer loop is llama's MoE one
ARCH = Architecture(ARCH_NAME, read_hparams, expected_tensors, llama.build)
