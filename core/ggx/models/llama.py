"""The llama graph (llama.cpp's llm_build_llama), dense or MoE, built with ggx.Context ops.

Shapes (ggml order, T = tokens in the batch, KV = cache slots visible to it, D = head size):
  tokens I32 [T] -> get_rows(token_embd) -> x F32 [n_embd, T]
  per layer: rms_norm * attn_norm; q/k/v = mul_mat(W, x); q, k reshaped [D, heads, T] and roped
  (mode NORMAL, the file's freq_base); k and v written into the F16 cache rows kv_idx with
  set_rows; attention over cache views [D, KV, n_head_kv] (flash_attn_ext with GQA, or
  mul_mat + soft_max + mul_mat); attn_output; residual; rms_norm * ffn_norm; SwiGLU FFN (or
  top-k routed experts through mul_mat_id); residual.
  final rms_norm * output_norm, rows out_ids kept, logits = mul_mat(output or token_embd) [n_vocab, n_out].

Every per-call value (token ids, positions, cache slots, the mask, which rows to output) is an
input tensor's *data*, never a shape: two batches of the same T and the same KV bucket give the
same graph key, so the scheduler reuses its plan (the decode loop).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..graph import Context
from ..ops import Prec, RopeMode
from ..tensor import Tensor, TensorFlag
from ..types import GType
from .hparams import LlamaHParams
from .kv_cache import KVCache


@dataclass
class LlamaInputs:
    """The input leaves of one batch's graph; their data is set before each compute."""

    tokens: Tensor  # I32 [T]
    pos: Tensor  # I32 [T]
    kv_idx: Tensor  # I64 [T]: cache slot of each token
    mask: Tensor  # F16 [KV, T]: 0 where token t may see slot j, -inf elsewhere
    out_ids: Tensor | None  # I32 [n_out]: which rows of the batch get logits (None: all)

    def all(self) -> list[Tensor]:
        return [t for t in (self.tokens, self.pos, self.kv_idx, self.mask, self.out_ids) if t is not None]


def build_llama(ctx: Context, hp: LlamaHParams, w: dict[str, Tensor], cache: KVCache, n_tokens: int, n_kv: int,
                n_out: int | None = None, flash_attn: bool = True) -> tuple[Tensor, LlamaInputs]:
    """Logits [n_vocab, n_out] of a batch of `n_tokens` attending over the first `n_kv` cache slots."""
    inp = LlamaInputs(
        tokens=ctx.tensor(GType.I32, [n_tokens], "inp_tokens"),
        pos=ctx.tensor(GType.I32, [n_tokens], "inp_pos"),
        kv_idx=ctx.tensor(GType.I64, [n_tokens], "inp_kv_idx"),
        mask=ctx.tensor(GType.F16, [n_kv, n_tokens], "inp_kq_mask"),
        out_ids=ctx.tensor(GType.I32, [n_out], "inp_out_ids") if n_out is not None and n_out != n_tokens else None,
    )
    for t in inp.all():
        t.set_flag(TensorFlag.INPUT)
    kq_scale = 1.0 / math.sqrt(hp.head_dim)
    x = ctx.get_rows(w["token_embd.weight"], inp.tokens)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        cur = ctx.mul(ctx.rms_norm(x, hp.rms_eps), w[b + "attn_norm.weight"])
        q, k, v = _qkv_roped(ctx, hp, w, b, cur, inp.pos, n_tokens)
        k_written = ctx.set_rows(cache.k[il], ctx.view(k, [hp.n_embd_kv, n_tokens], [k.nb[2]]), inp.kv_idx)
        v_written = ctx.set_rows(cache.v[il], v, inp.kv_idx)
        attn = _attention(ctx, hp, q, k_written, v_written, inp.mask, n_tokens, n_kv, kq_scale, flash_attn)
        x = ctx.add(ctx.mul_mat(w[b + "attn_output.weight"], attn), x)
        cur = ctx.mul(ctx.rms_norm(x, hp.rms_eps), w[b + "ffn_norm.weight"])
        ffn = _moe_ffn(ctx, hp, w, b, cur, n_tokens) if hp.n_expert else _ffn(ctx, w, b, cur)
        x = ctx.add(ffn, x)
    if inp.out_ids is not None:
        x = ctx.get_rows(x, inp.out_ids)
    x = ctx.mul(ctx.rms_norm(x, hp.rms_eps), w["output_norm.weight"])
    out_w = w["output.weight"]  # when tied: token_embd, or its copy placed for mul_mat (load_weights)
    logits = ctx.mul_mat(out_w, x)
    logits.name = "result_output"
    return logits, inp


def _qkv_roped(ctx: Context, hp: LlamaHParams, w: dict[str, Tensor], b: str, cur: Tensor, pos: Tensor,
               n_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """Roped q [D, n_head, T] and k [D, n_head_kv, T] (rows contiguous, maybe strided), v [n_embd_kv, T].

    With the fused weight (rows q | k | v) one product gives all three; q and k are adjacent
    heads of its result, so one rope over [D, n_head + n_head_kv, T] rotates both.
    """
    D = hp.head_dim
    qkv_w = w.get(b + "attn_qkv.weight")
    if qkv_w is None:
        q = ctx.reshape(ctx.mul_mat(w[b + "attn_q.weight"], cur), [D, hp.n_head, n_tokens])
        k = ctx.reshape(ctx.mul_mat(w[b + "attn_k.weight"], cur), [D, hp.n_head_kv, n_tokens])
        return _rope(ctx, hp, q, pos), _rope(ctx, hp, k, pos), ctx.mul_mat(w[b + "attn_v.weight"], cur)
    qkv = ctx.mul_mat(qkv_w, cur)  # [n_embd + 2 n_embd_kv, T]
    f32 = 4
    qk = _rope(ctx, hp, ctx.view(qkv, [D, hp.n_head + hp.n_head_kv, n_tokens], [D * f32, qkv.nb[1]], 0), pos)
    q = ctx.view(qk, [D, hp.n_head, n_tokens], [D * f32, qk.nb[2]], 0)
    k = ctx.view(qk, [D, hp.n_head_kv, n_tokens], [D * f32, qk.nb[2]], hp.n_embd * f32)
    v = ctx.view(qkv, [hp.n_embd_kv, n_tokens], [qkv.nb[1]], (hp.n_embd + hp.n_embd_kv) * f32)
    return q, k, v


def _rope(ctx: Context, hp: LlamaHParams, t: Tensor, pos: Tensor) -> Tensor:
    # llama's GGUF converter permutes Q/K rows so that the adjacent-pair (NORMAL) rotation applies
    return ctx.rope(t, pos, hp.n_rot, RopeMode.NORMAL, freq_base=hp.rope_freq_base, n_ctx_orig=hp.n_ctx_train)


def _attention(ctx: Context, hp: LlamaHParams, q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor,
               n_tokens: int, n_kv: int, scale: float, flash_attn: bool) -> Tensor:
    """Attention of q [D, n_head, T] over cache rows 0..n_kv; returns [n_embd, T]."""
    D, row = hp.head_dim, k_cache.nb[1]
    # the cache row of one slot holds n_head_kv heads of D values: view it as [D, KV, n_head_kv]
    k = ctx.view(k_cache, [D, n_kv, hp.n_head_kv], [row, D * k_cache.type.type_size])
    v = ctx.view(v_cache, [D, n_kv, hp.n_head_kv], [row, D * v_cache.type.type_size])
    q = ctx.permute(q, 0, 2, 1, 3)  # [D, T, n_head]
    if flash_attn:
        # F32 accumulation, as llama.cpp asks for every model (backends may honour it or not)
        out = ctx.flash_attn_ext(q, k, v, mask, scale, prec=Prec.F32)  # [D, n_head, T]
        return ctx.reshape(out, [hp.n_embd, n_tokens])
    kq = ctx.soft_max(ctx.mul_mat(k, q), mask, scale)  # [KV, T, n_head]
    v_t = ctx.cont(ctx.transpose(v))  # [KV, D, n_head_kv]: rows over slots for the second product
    kqv = ctx.mul_mat(v_t, kq)  # [D, T, n_head]
    return ctx.cont(ctx.permute(kqv, 0, 2, 1, 3), [hp.n_embd, n_tokens])


def _ffn(ctx: Context, w: dict[str, Tensor], b: str, cur: Tensor) -> Tensor:
    gate_up = w.get(b + "ffn_gate_up.weight")
    if gate_up is not None:  # fused: rows gate | up, swiglu over the halves of each column
        return ctx.mul_mat(w[b + "ffn_down.weight"], ctx.swiglu(ctx.mul_mat(gate_up, cur)))
    gate = ctx.mul_mat(w[b + "ffn_gate.weight"], cur)
    up = ctx.mul_mat(w[b + "ffn_up.weight"], cur)
    return ctx.mul_mat(w[b + "ffn_down.weight"], ctx.swiglu(gate, up))


def _moe_ffn(ctx: Context, hp: LlamaHParams, w: dict[str, Tensor], b: str, cur: Tensor, n_tokens: int) -> Tensor:
    """Mixtral-style experts: softmax over the top-k router logits weighs the k chosen experts.

    softmax over all experts restricted to the top k and renormalized equals a softmax over the
    top-k logits alone, which needs no division op.
    """
    k, n_exp = hp.n_expert_used, hp.n_expert
    logits = ctx.mul_mat(w[b + "ffn_gate_inp.weight"], cur)  # [n_expert, T]
    chosen = ctx.argsort_top_k(logits, k)  # I32 [k, T]
    picked = ctx.get_rows(ctx.reshape(logits, [1, n_exp, n_tokens]), chosen)  # [1, k, T]
    weights = ctx.reshape(ctx.soft_max(ctx.reshape(picked, [k, n_tokens])), [1, k, n_tokens])
    x3 = ctx.reshape(cur, [hp.n_embd, 1, n_tokens])
    gate = ctx.mul_mat_id(w[b + "ffn_gate_exps.weight"], x3, chosen)  # [n_ff, k, T]
    up = ctx.mul_mat_id(w[b + "ffn_up_exps.weight"], x3, chosen)
    experts = ctx.mul_mat_id(w[b + "ffn_down_exps.weight"], ctx.swiglu(gate, up), chosen)  # [n_embd, k, T]
    experts = ctx.mul(experts, weights)
    out = None
    for i in range(k):  # sum over the k slots: strided views [n_embd, T], one add each (as llama.cpp)
        part = ctx.view(experts, [hp.n_embd, n_tokens], [experts.nb[2]], i * experts.nb[1])
        out = part if out is None else ctx.add(out, part)
    if k == 1:
        out = ctx.cont(out)
    return out
