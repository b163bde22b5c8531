"""The Gemma 3 architecture (llama.cpp's src/models/gemma3.cpp).

The token embedding is scaled by sqrt(n_embd). Per layer: attention with Q/K RMS norms (per
head), NEOX RoPE, Q scaled by 1/sqrt(head_dim) (1/sqrt(n_embd / n_head) on the 27B) and the
attention itself unscaled; an RMS norm after the attention and after the FFN as well as before
(the file's norm weights already hold Gemma's 1 + w); a GeGLU FFN (tanh GELU). Five of every six
layers (il % 6 < 5, or `{arch}.attention.sliding_window_pattern`) attend over a sliding window of
`{arch}.attention.sliding_window` positions with RoPE base 10000 (`rope.freq_base_swa`); the
others see the whole context with the file's base. The output matrix is the tied embedding
unless the file has output.weight; a final logit softcap is refused (this file has none, and
ggx has no tanh op yet).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import GGXFormatError
from ..graph import Context
from ..ops import GluKind, RopeMode
from ..tensor import Tensor
from . import blocks
from .architectures import Architecture
from .blocks import BatchShape, ModelInputs
from .gguf_file import GGUFFile
from .hparams import HParams, MetadataReader, common_tensors
from .kv_cache import KVCache

SWA_PATTERN = 6  # llama.cpp's load_swa_pattern(ml, 6): every sixth layer is global
N_LAYER_27B = 62


def read_hparams(f: GGUFFile) -> HParams:
    arch = "gemma3"
    r = MetadataReader(f, arch)
    common = r.common()
    n_layer = common["n_layer"]
    n_swa = r.count("attention.sliding_window", 0)
    swa_layers: tuple[bool, ...] = ()
    if n_swa:
        pattern = f.get(f"{arch}.attention.sliding_window_pattern", (int, np.ndarray), SWA_PATTERN)
        if isinstance(pattern, np.ndarray):  # one flag per layer
            if pattern.shape != (n_layer,) or pattern.dtype.kind not in "biu":
                raise GGXFormatError(f"{f.path}: {arch}.attention.sliding_window_pattern must hold "
                                     f"{n_layer} flags, one per layer")
            swa_layers = tuple(bool(p) for p in pattern)
        elif isinstance(pattern, int) and pattern >= 0:
            swa_layers = tuple(pattern == 0 or il % pattern < pattern - 1 for il in range(n_layer))
        else:
            raise GGXFormatError(f"{f.path}: {arch}.attention.sliding_window_pattern = {pattern!r} "
                                 "is neither a count nor per-layer flags")
    softcap = r.real("final_logit_softcapping", 0.0, "must be a finite number >= 0",
                     lambda v: math.isfinite(v) and v >= 0)
    if softcap:
        raise GGXFormatError(f"{f.path}: {arch}.final_logit_softcapping = {softcap}: final logit "
                             "softcapping is not supported yet")
    n_embd, n_head = common["n_embd"], common["n_head"]
    q_scale = 1.0 / math.sqrt(n_embd / n_head if n_layer == N_LAYER_27B else common["head_dim"])
    return HParams(**common, rope_mode=RopeMode.NEOX, n_swa=n_swa, swa_layers=swa_layers,
                   rope_freq_base_swa=r.rope_base("rope.freq_base_swa", 10000.0),
                   embd_scale=math.sqrt(n_embd), q_scale=q_scale)


def expected_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    e, ff, d = hp.n_embd, hp.n_ff, hp.head_dim
    want = common_tensors(hp)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        want.update({
            b + "attn_q_norm.weight": (d,), b + "attn_k_norm.weight": (d,), b + "post_attention_norm.weight": (e,),
            b + "ffn_gate.weight": (e, ff), b + "ffn_up.weight": (e, ff), b + "ffn_down.weight": (ff, e),
            b + "post_ffw_norm.weight": (e,)})
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
        x = ctx.add(blocks.norm(ctx, hp, attn, w[b + "post_attention_norm.weight"]), x)
        ffn = blocks.gated_ffn(ctx, w, b, blocks.norm(ctx, hp, x, w[b + "ffn_norm.weight"]), GluKind.GEGLU)
        x = ctx.add(blocks.norm(ctx, hp, ffn, w[b + "post_ffw_norm.weight"]), x)
    return blocks.logits(ctx, hp, w, x), inp


ARCH = Architecture("gemma3", read_hparams, expected_tensors, build)
