"""Hyper-parameters of a GGUF model, whatever its architecture, and the checked reading of them.

`HParams` holds what the shared graph blocks (ggx.models.blocks) need; each architecture module
(llama.py, gemma3.py) fills it from the file's `{arch}.*` keys with a `MetadataReader`, which
refuses values that would compute garbage with a GGXFormatError naming the key.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import GGXFormatError
from ..ops import RopeMode
from ..types import GType
from .gguf_file import ARRAY, GGUFFile


@dataclass(frozen=True)
class HParams:
    arch: str  # general.architecture: the key of ggx.models.architectures.ARCHITECTURES
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    head_dim: int  # {arch}.attention.key_length (= value_length), default n_embd / n_head
    n_rot: int  # rope dimensions
    rope_freq_base: float
    rms_eps: float
    n_ctx_train: int
    rope_mode: RopeMode = RopeMode.NORMAL
    n_expert: int = 0  # 0: dense feed-forward
    n_expert_used: int = 0
    tied_output: bool = True  # output matrix is token_embd (no output.weight in the file)
    #: sliding-window attention: a layer il with swa_layers[il] lets a query at position p see
    #: keys at positions p - n_swa < k <= p only (llama.cpp's LLAMA_SWA_TYPE_STANDARD)
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_freq_base_swa: float = 10000.0  # the RoPE base of sliding-window layers
    embd_scale: float = 1.0  # the token embedding is multiplied by this (Gemma: sqrt(n_embd))
    #: Q is multiplied by this before attention, which then scales by 1 (Gemma); None: the
    #: attention scales by 1/sqrt(head_dim) itself (llama)
    q_scale: float | None = None
    #: Llama 3.1+: the file holds rope_freqs.weight, F32 [n_rot / 2] frequency factors the RoPE of
    #: Q and K divides each pair's angle by (ggml_rope_ext's c)
    rope_freqs: bool = False

    @property
    def n_embd_q(self) -> int:
        """Width of the attention's Q and output: head_dim * n_head (Gemma's differs from n_embd)."""
        return self.head_dim * self.n_head

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv

    @property
    def has_swa(self) -> bool:
        return self.n_swa > 0 and any(self.swa_layers)

    def is_swa(self, il: int) -> bool:
        return self.n_swa > 0 and bool(self.swa_layers) and self.swa_layers[il]

    def rope_base(self, il: int) -> float:
        return self.rope_freq_base_swa if self.is_swa(il) else self.rope_freq_base


class MetadataReader:
    """Checked reads of a file's `{arch}.{key}` values."""

    def __init__(self, f: GGUFFile, arch: str):
        self.f, self.arch = f, arch

    def count(self, key: str, default=..., least: int = 0) -> int:
        v = self.f.get(f"{self.arch}.{key}", int, default)
        if not isinstance(v, int) or v < least or v > 1 << 24:
            raise GGXFormatError(f"{self.f.path}: {self.arch}.{key} = {v!r} is not a sensible count"
                                 + (f" (at least {least})" if least else ""))
        return v

    def real(self, key: str, default: float, what: str, ok: Callable[[float], bool]) -> float:
        v = float(self.f.get(f"{self.arch}.{key}", float, default))
        if not ok(v):
            raise GGXFormatError(f"{self.f.path}: {self.arch}.{key} = {v!r}: {what}")
        return v

    def rope_base(self, key: str, default: float) -> float:
        # ggml's rope takes base^(-2i/n_dims): a base that is not a finite number > 0 gives
        # NaN, inf or constant angles
        return self.real(key, default, "the RoPE base must be a finite number > 0",
                         lambda v: math.isfinite(v) and v > 0)

    def common(self, n_ff_default: int | None = None) -> dict:
        """The fields every transformer shares, checked, as HParams keyword arguments
        (`n_ff_default`: feed_forward_length may be left out, a MoE's experts having their own)."""
        f, arch, u = self.f, self.arch, self.count
        n_embd, n_head = u("embedding_length", least=1), u("attention.head_count", least=1)
        if f.get(f"{arch}.attention.key_length", int, None) is None and n_embd % n_head:
            raise GGXFormatError(f"{f.path}: {arch}.embedding_length {n_embd} is not a multiple of "
                                 f"{arch}.attention.head_count {n_head}")
        n_head_kv = u("attention.head_count_kv", n_head, least=1)
        if n_head % n_head_kv:
            raise GGXFormatError(f"{f.path}: {arch}.attention.head_count {n_head} is not a multiple of "
                                 f"{arch}.attention.head_count_kv {n_head_kv}")
        head_dim = u("attention.key_length", n_embd // n_head, least=1)
        head_dim_v = u("attention.value_length", head_dim, least=1)
        if head_dim_v != head_dim:
            raise GGXFormatError(f"{f.path}: {arch}.attention.value_length {head_dim_v} differs from "
                                 f"{arch}.attention.key_length {head_dim} (ggx needs equal K and V head sizes)")
        tokens = f.get("tokenizer.ggml.tokens", ARRAY, None)
        embd = f.tensor("token_embd.weight")
        n_vocab = u("vocab_size", len(tokens) if tokens is not None else embd.ne[1], least=1)
        if tokens is not None and len(tokens) != n_vocab:
            raise GGXFormatError(f"{f.path}: {len(tokens)} tokens in the vocabulary, vocab_size says {n_vocab}")
        self.check_no_rope_scaling()
        n_rot = u("rope.dimension_count", head_dim, least=1)
        if n_rot % 2 or n_rot > head_dim:
            raise GGXFormatError(f"{f.path}: {arch}.rope.dimension_count {n_rot} must be even and at most "
                                 f"the head size {head_dim}")
        return dict(
            arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=u("block_count", least=1), n_head=n_head,
            n_head_kv=n_head_kv,
            n_ff=u("feed_forward_length", ..., least=1) if n_ff_default is None
            else u("feed_forward_length", n_ff_default), head_dim=head_dim, n_rot=n_rot,
            rope_freq_base=self.rope_base("rope.freq_base", 10000.0),
            # rms_norm asserts eps >= 0 (NaN fails it too)
            rms_eps=self.real("attention.layer_norm_rms_epsilon", 1e-5,
                              "the norm epsilon must be a finite number >= 0", lambda v: math.isfinite(v) and v >= 0),
            n_ctx_train=u("context_length", 2048, least=1), tied_output="output.weight" not in f.tensors)


    def check_no_rope_scaling(self) -> None:
        """RoPE context scaling (`rope.scaling.type` linear / yarn / longrope with a factor other than
        1, or `rope.scale_linear`) is refused by name: ggx does not apply it yet, and running
        without it computes other angles than the model was made for."""
        f, arch = self.f, self.arch
        kind = f.get(f"{arch}.rope.scaling.type", str, "none")
        factor = float(f.get(f"{arch}.rope.scaling.factor", float, 0.0))
        linear = float(f.get(f"{arch}.rope.scale_linear", float, 1.0))
        if (kind != "none" and factor not in (0.0, 1.0)) or linear not in (0.0, 1.0):
            what = f"{arch}.rope.scale_linear = {linear:g}" if linear not in (0.0, 1.0) else \
                f"{arch}.rope.scaling.type = {kind!r} with {arch}.rope.scaling.factor = {factor:g}"
            raise GGXFormatError(f"{f.path}: {what}: RoPE context scaling is not supported yet")


def common_tensors(hp: HParams) -> dict[str, tuple[int, ...]]:
    """The tensors every architecture here reads, with their ggml-order ne: the embedding, the
    output norm and matrix (unless tied), and each layer's attention projections and pre-norms."""
    e, q, kv = hp.n_embd, hp.n_embd_q, hp.n_embd_kv
    want: dict[str, tuple[int, ...]] = {"token_embd.weight": (e, hp.n_vocab), "output_norm.weight": (e,)}
    if not hp.tied_output:
        want["output.weight"] = (e, hp.n_vocab)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        want.update({b + "attn_norm.weight": (e,), b + "attn_q.weight": (e, q), b + "attn_k.weight": (e, kv),
                     b + "attn_v.weight": (e, kv), b + "attn_output.weight": (q, e), b + "ffn_norm.weight": (e,)})
    return want


def check_tensors(f: GGUFFile, expected: dict[str, tuple[int, ...]]) -> None:
    """Every expected tensor is present with the shape the metadata implies; norms and routers are F32."""
    for name, ne in expected.items():
        t = f.tensor(name)
        if t.ne != ne:
            raise GGXFormatError(f"{f.path}: tensor {name!r} has ne {list(t.ne)}, the metadata implies {list(ne)}")
        if name.endswith("norm.weight") and t.type is not GType.F32:
            raise GGXFormatError(f"{f.path}: norm tensor {name!r} is {t.type.name}, expected F32")
        if name.endswith("gate_inp.weight") and t.type is not GType.F32:
            raise GGXFormatError(f"{f.path}: router {name!r} is {t.type.name}, expected F32")
        if name.endswith(".bias") and t.type is not GType.F32:
            raise GGXFormatError(f"{f.path}: bias {name!r} is {t.type.name}, expected F32")
