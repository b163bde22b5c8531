"""Hyper-parameters of a llama-architecture GGUF model, read and checked against the file's tensors."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import GGXFormatError, GGXUnsupported
from ..types import GType
from .gguf_file import GGUFFile

SUPPORTED_ARCHS = ("llama",)


@dataclass(frozen=True)
class LlamaHParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    head_dim: int
    n_rot: int  # rope dimensions
    rope_freq_base: float
    rms_eps: float
    n_ctx_train: int
    n_expert: int = 0  # 0: dense feed-forward
    n_expert_used: int = 0
    tied_output: bool = True  # output matrix is token_embd (no output.weight in the file)

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> LlamaHParams:
        arch = f.get("general.architecture", str)
        if arch not in SUPPORTED_ARCHS:
            raise GGXUnsupported(f"{f.path}: architecture {arch!r} is not supported (ggx runs {SUPPORTED_ARCHS})")

        def u(key: str, default=..., least: int = 0) -> int:
            v = f.get(f"{arch}.{key}", int, default)
            if not isinstance(v, int) or v < least or v > 1 << 24:
                raise GGXFormatError(f"{f.path}: {arch}.{key} = {v!r} is not a sensible count"
                                     + (f" (at least {least})" if least else ""))
            return v

        def real(key: str, default: float, what: str, ok) -> float:
            v = float(f.get(f"{arch}.{key}", float, default))
            if not ok(v):
                raise GGXFormatError(f"{f.path}: {arch}.{key} = {v!r}: {what}")
            return v

        n_embd, n_head = u("embedding_length", least=1), u("attention.head_count", least=1)
        if n_embd % n_head:
            raise GGXFormatError(f"{f.path}: {arch}.embedding_length {n_embd} is not a multiple of "
                                 f"{arch}.attention.head_count {n_head}")
        n_head_kv = u("attention.head_count_kv", n_head, least=1)
        if n_head % n_head_kv:
            raise GGXFormatError(f"{f.path}: {arch}.attention.head_count {n_head} is not a multiple of "
                                 f"{arch}.attention.head_count_kv {n_head_kv}")
        head_dim = n_embd // n_head
        tokens = f.get("tokenizer.ggml.tokens", list, None)
        embd = f.tensor("token_embd.weight")
        n_vocab = u("vocab_size", len(tokens) if tokens is not None else embd.ne[1], least=1)
        hp = cls(
            n_vocab=n_vocab, n_embd=n_embd, n_layer=u("block_count", least=1), n_head=n_head, n_head_kv=n_head_kv,
            n_ff=u("feed_forward_length", least=1), head_dim=head_dim,
            n_rot=u("rope.dimension_count", head_dim, least=1),
            # ggml's rope takes base^(-2i/n_dims): a base that is not a finite number > 0 gives
            # NaN, inf or constant angles; rms_norm asserts eps >= 0 (NaN fails it too)
            rope_freq_base=real("rope.freq_base", 10000.0, "the RoPE base must be a finite number > 0",
                                lambda v: math.isfinite(v) and v > 0),
            rms_eps=real("attention.layer_norm_rms_epsilon", 1e-5, "the norm epsilon must be a finite number >= 0",
                         lambda v: math.isfinite(v) and v >= 0),
            n_ctx_train=u("context_length", 2048, least=1), n_expert=u("expert_count", 0),
            n_expert_used=u("expert_used_count", 0), tied_output="output.weight" not in f.tensors)
        if hp.n_rot % 2 or hp.n_rot > head_dim:
            raise GGXFormatError(f"{f.path}: {arch}.rope.dimension_count {hp.n_rot} must be even and at most "
                                 f"the head size {head_dim}")
        if hp.n_expert and not 1 <= hp.n_expert_used <= hp.n_expert:
            raise GGXFormatError(f"{f.path}: {arch}.expert_used_count {hp.n_expert_used} must be in "
                                 f"1..{hp.n_expert} ({arch}.expert_count)")
        if tokens is not None and len(tokens) != n_vocab:
            raise GGXFormatError(f"{f.path}: {len(tokens)} tokens in the vocabulary, vocab_size says {n_vocab}")
        hp.check_tensors(f)
        return hp

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the llama graph reads, with its ggml-order ne."""
        e, kv, ff = self.n_embd, self.n_embd_kv, self.n_ff
        want: dict[str, tuple[int, ...]] = {"token_embd.weight": (e, self.n_vocab), "output_norm.weight": (e,)}
        if not self.tied_output:
            want["output.weight"] = (e, self.n_vocab)
        for i in range(self.n_layer):
            b = f"blk.{i}."
            want.update({b + "attn_norm.weight": (e,), b + "attn_q.weight": (e, e), b + "attn_k.weight": (e, kv),
                         b + "attn_v.weight": (e, kv), b + "attn_output.weight": (e, e), b + "ffn_norm.weight": (e,)})
            if self.n_expert:
                x = self.n_expert
                want.update({b + "ffn_gate_inp.weight": (e, x), b + "ffn_gate_exps.weight": (e, ff, x),
                             b + "ffn_up_exps.weight": (e, ff, x), b + "ffn_down_exps.weight": (ff, e, x)})
            else:
                want.update({b + "ffn_gate.weight": (e, ff), b + "ffn_up.weight": (e, ff),
                             b + "ffn_down.weight": (ff, e)})
        return want

    def check_tensors(self, f: GGUFFile) -> None:
        """Every expected tensor is present with the shape the metadata implies; norms are F32."""
        for name, ne in self.expected_tensors().items():
            t = f.tensor(name)
            if t.ne != ne:
                raise GGXFormatError(f"{f.path}: tensor {name!r} has ne {list(t.ne)}, the metadata implies {list(ne)}")
            if name.endswith("norm.weight") and t.type is not GType.F32:
                raise GGXFormatError(f"{f.path}: norm tensor {name!r} is {t.type.name}, expected F32")
            if name.endswith("gate_inp.weight") and t.type is not GType.F32:
                raise GGXFormatError(f"{f.path}: router {name!r} is {t.type.name}, expected F32")
