"""The llama architecture (llama.cpp's src/models/llama.cpp), dense or MoE.

Per layer: x += attn_output(attention(rms_norm(x) * attn_norm)), RoPE NORMAL with the file's
base (llama's GGUF converter permutes Q/K rows so that the adjacent-pair rotation applies) and,
in Llama 3.1+ files, the frequency factors of rope_freqs.weight (each layer its own copy, on its
device: llama.cpp's TENSOR_DUPLICATED);
x += ffn(rms_norm(x) * ffn_norm), a SwiGLU FFN or top-k routed experts; then the output norm
and the output matrix (or the tied token embedding).
"""
from __future__ import annotations

import numpy as np

from ..errors import GGXFormatError
from ..graph import Context
from ..ops import GluKind, RopeMode
from ..tensor import Tensor
from ..types import GType
from . import blocks
from .architectures import Architecture
from .blocks import BatchShape, ModelInputs
from .gguf_file import GGUFFile
from .hparams import HParams, MetadataReader, common_tensors
from .kv_cache import KVCache
from .weights import ROPE_FREQS


def read_hparams(f: GGUFFile) -> HParams:
    r = MetadataReader(f, "llama")
    hp = HParams(**r.common(), rope_mode=RopeMode.NORMAL, n_expert=r.count("expert_count", 0),
                 n_expert_used=r.count("expert_used_count", 0), rope_freqs=ROPE_FREQS in f.tensors)
    if hp.n_expert and not 1 <= hp.n_expert_used <= hp.n_expert:
        raise GGXFormatError(f"{f.path}: llama.expert_used_count {hp.n_expert_used} must be in "
                             f"1..{hp.n_expert} (llama.expert_count)")
    check_rope_freqs(f, hp)
    return hp


def check_rope_freqs(f: GGUFFile, hp: HParams) -> None:
    """Llama 3.1+ files scale RoPE by per-pair frequency factors (rope_freqs.weight, F32
    [n_rot / 2]: the angle of pair i is divided by factor i). A factor that is not a finite
    number > 0 would give NaN or constant angles: refused by name."""
    if not hp.rope_freqs:
        return
    t = f.tensor(ROPE_FREQS)
    if t.type is not GType.F32 or t.ne != (hp.n_rot // 2,):
        raise GGXFormatError(f"{f.path}: tensor {ROPE_FREQS!r} is {t.type.name} {list(t.ne)}, "
                             f"expected F32 [{hp.n_rot // 2}] (one factor per rotated pair)")
    factors = np.asarray(t.data).view(np.float32)
    bad = ~(np.isfinite(factors) & (factors > 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise GGXFormatError(f"{f.path}: tensor {ROPE_FREQS!r} holds {factors[i]!r} at pair {i}: RoPE frequency "
                             "factors must be finite numbers > 0")


def expected_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    e, ff = hp.n_embd, hp.n_ff
    want = common_tensors(hp)
    if hp.rope_freqs:
        want[ROPE_FREQS] = (hp.n_rot // 2,)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        if hp.n_expert:
            x = hp.n_expert
            want.update({b + "ffn_gate_inp.weight": (e, x), b + "ffn_gate_exps.weight": (e, ff, x),
                         b + "ffn_up_exps.weight": (e, ff, x), b + "ffn_down_exps.weight": (ff, e, x)})
        else:
            want.update({b + "ffn_gate.weight": (e, ff), b + "ffn_up.weight": (e, ff), b + "ffn_down.weight": (ff, e)})
    return want


def build(ctx: Context, hp: HParams, w: dict[str, Tensor], cache: KVCache, shape: BatchShape,
          flash_attn: bool = True) -> tuple[Tensor, ModelInputs]:
    """Logits [n_vocab, n_out] of a batch of `shape.n_tokens` over the cache."""
    inp = blocks.build_inputs(ctx, shape)
    x = blocks.embed(ctx, hp, w, inp)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        attn = blocks.self_attention(ctx, hp, w, il, blocks.norm(ctx, hp, x, w[b + "attn_norm.weight"]), inp, cache,
                                     shape, flash_attn)
        if il == hp.n_layer - 1:
            attn, x = blocks.output_rows(ctx, inp, attn, x)
        x = ctx.add(attn, x)
        cur = blocks.norm(ctx, hp, x, w[b + "ffn_norm.weight"])
        ffn = blocks.moe_ffn(ctx, hp, w, b, cur) if hp.n_expert else blocks.gated_ffn(ctx, w, b, cur, GluKind.SWIGLU)
        x = ctx.add(ffn, x)
    return blocks.logits(ctx, hp, w, x), inp


ARCH = Architecture("llama", read_hparams, expected_tensors, build)
