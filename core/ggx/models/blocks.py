"""The blocks architectures build their graphs from (llama.cpp's llm_graph_context helpers).

Shapes (ggml order, T = tokens in the batch, KV = cache slots visible to it, D = head size):
  tokens I32 [T] -> `embed`: get_rows(token_embd) (times hp.embd_scale) -> x F32 [n_embd, T]
  `self_attention`: q/k/v = mul_mat(W, x); q, k reshaped [D, heads, T], optionally RMS-normed per
  head (Q/K norms), roped (the layer's base); k and v written into the layer's F16 cache rows with
  set_rows; attention over cache views [D, KV, n_head_kv] under the layer's mask (flash_attn_ext
  with GQA, or mul_mat + soft_max + mul_mat); attn_output -> [n_embd, T]
  `gated_ffn`: down(act(gate(x)) * up(x)) with the activation a parameter (SwiGLU, GeGLU);
  `moe_ffn`: top-k routed experts through mul_mat_id
  `logits`: rms_norm * output_norm, mul_mat(output or token_embd) [n_vocab, n_out]

Every per-call value (token ids, positions, cache slots, the masks, which rows to output) is an
input tensor's *data*, never a shape: two batches of the same `BatchShape` give the same graph
key, so the scheduler reuses its plan (the decode loop).

A batch of several sequences (`BatchShape.seqs`, a multi-sequence KVCache: ggx.models.batched)
holds each sequence's tokens side by side. Everything but attention works on the whole batch
(row by row); attention runs once per sequence, over its own region of the cache under its own
mask, as the very op a batch of that sequence alone would run (same shapes, same slots), and the
per-sequence results are gathered back into one [n_embd_q, T] tensor with set_rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..graph import Context
from ..ops import GluKind, Prec
from ..tensor import Tensor, TensorFlag
from ..types import GType
from .hparams import HParams
from .kv_cache import CacheBatch, KVCache

F32_SIZE = 4


@dataclass(frozen=True)
class SeqShape:
    """One sequence's part of a multi-sequence batch: its id (the cache region), its tokens and
    the slots of its region that its attention reads."""

    seq: int
    n_tokens: int
    n_kv: int
    n_kv_swa: int = 0


@dataclass(frozen=True)
class BatchShape:
    """What a batch's graph depends on: everything else is input data."""

    n_tokens: int
    n_kv: int  # visible slots of the full-context layers (one-sequence batches)
    n_out: int  # rows that get logits: n_tokens, or 1 (the last)
    n_kv_swa: int = 0  # visible slots of the sliding-window layers (0: none)
    #: the sequences of a multi-sequence batch, in row order (empty: a one-sequence cache)
    seqs: tuple[SeqShape, ...] = ()

    @staticmethod
    def of_parts(parts: list[CacheBatch], n_out: int) -> BatchShape:
        """The shape of a multi-sequence batch planned as `parts` (KVCache.plan per sequence)."""
        seqs = tuple(SeqShape(p.seq, p.n_tokens, p.n_kv, p.n_kv_swa) for p in parts)
        return BatchShape(sum(s.n_tokens for s in seqs), 0, n_out, 0, seqs)


@dataclass
class ModelInputs:
    """The input leaves of one batch's graph; their data is set before each compute (`data`)."""

    tokens: Tensor  # I32 [T]
    pos: Tensor  # I32 [T]
    kv_idx: Tensor  # I64 [T]: cache slot of each token, full-context layers
    mask: Tensor | None  # F16 [KV, T]: 0 where token t may see slot j, -inf elsewhere (one sequence)
    out_ids: Tensor | None  # I32 [n_out]: which rows of the batch get logits (None: all)
    kv_idx_swa: Tensor | None = None  # the same for the sliding-window layers
    mask_swa: Tensor | None = None
    #: a multi-sequence batch: each sequence's masks F16 [KV_s, T_s] (full, sliding-window)
    seq_masks: list[Tensor] = field(default_factory=list)
    seq_masks_swa: list[Tensor] = field(default_factory=list)
    rows: Tensor | None = None  # I32 [T] = 0..T-1: where set_rows gathers each sequence's attention

    def all(self) -> list[Tensor]:
        return [t for t in (self.tokens, self.pos, self.kv_idx, self.mask, self.out_ids, self.kv_idx_swa,
                            self.mask_swa, *self.seq_masks, *self.seq_masks_swa, self.rows) if t is not None]

    def data(self, tokens: np.ndarray, batch: CacheBatch | list[CacheBatch],
             last: int | None = None) -> dict[Tensor, np.ndarray]:
        """Each input's data for `tokens` planned as `batch` (one sequence's CacheBatch, or a list
        of them for a multi-sequence batch; the F16 masks as their raw bytes: no round trip
        through float32 and back); `last`: the row that gets logits when only one does (default
        the batch's last: a padded batch names its last real token)."""
        parts = batch if isinstance(batch, list) else [batch]
        one = parts[0] if len(parts) == 1 else None
        n_tokens = sum(p.n_tokens for p in parts)
        data: dict[Tensor, np.ndarray] = {
            self.tokens: tokens.astype(np.int32),
            self.pos: one.pos if one else np.concatenate([p.pos for p in parts]),
            self.kv_idx: one.full.kv_idx if one else np.concatenate([p.full.kv_idx for p in parts])}
        if self.mask is not None:
            data[self.mask] = parts[0].full.mask.view(np.uint8)
        if self.out_ids is not None:
            data[self.out_ids] = np.array([n_tokens - 1 if last is None else last], dtype=np.int32)
        if self.kv_idx_swa is not None:
            data[self.kv_idx_swa] = one.swa.kv_idx if one else np.concatenate([p.swa.kv_idx for p in parts])
        if self.mask_swa is not None:
            data[self.mask_swa] = parts[0].swa.mask.view(np.uint8)
        for t, p in zip(self.seq_masks, parts):
            data[t] = p.full.mask.view(np.uint8)
        for t, p in zip(self.seq_masks_swa, parts):
            data[t] = p.swa.mask.view(np.uint8)
        if self.rows is not None:
            data[self.rows] = np.arange(n_tokens, dtype=np.int32)
        return data


def build_inputs(ctx: Context, shape: BatchShape) -> ModelInputs:
    t, out = shape.n_tokens, shape.n_out
    inp = ModelInputs(
        tokens=ctx.tensor(GType.I32, [t], "inp_tokens"),
        pos=ctx.tensor(GType.I32, [t], "inp_pos"),
        kv_idx=ctx.tensor(GType.I64, [t], "inp_kv_idx"),
        mask=None if shape.seqs else ctx.tensor(GType.F16, [shape.n_kv, t], "inp_kq_mask"),
        out_ids=ctx.tensor(GType.I32, [out], "inp_out_ids") if out != t else None)
    if shape.n_kv_swa:
        inp.kv_idx_swa = ctx.tensor(GType.I64, [t], "inp_kv_idx_swa")
        inp.mask_swa = ctx.tensor(GType.F16, [shape.n_kv_swa, t], "inp_kq_mask_swa")
    if shape.seqs:
        inp.seq_masks = [ctx.tensor(GType.F16, [s.n_kv, s.n_tokens], f"inp_kq_mask_s{i}")
                         for i, s in enumerate(shape.seqs)]
        if shape.seqs[0].n_kv_swa:
            inp.kv_idx_swa = ctx.tensor(GType.I64, [t], "inp_kv_idx_swa")
            inp.seq_masks_swa = [ctx.tensor(GType.F16, [s.n_kv_swa, s.n_tokens], f"inp_kq_mask_swa_s{i}")
                                 for i, s in enumerate(shape.seqs)]
        if len(shape.seqs) > 1:
            inp.rows = ctx.tensor(GType.I32, [t], "inp_seq_rows")
    for x in inp.all():
        x.set_flag(TensorFlag.INPUT)
    return inp


def embed(ctx: Context, hp: HParams, w: dict[str, Tensor], inp: ModelInputs) -> Tensor:
    x = ctx.get_rows(w["token_embd.weight"], inp.tokens)
    return ctx.scale(x, hp.embd_scale) if hp.embd_scale != 1.0 else x


def norm(ctx: Context, hp: HParams, x: Tensor, weight: Tensor) -> Tensor:
    return ctx.mul(ctx.rms_norm(x, hp.rms_eps), weight)


def output_rows(ctx: Context, inp: ModelInputs, *xs: Tensor) -> list[Tensor]:
    """Only the rows that get logits, as llama.cpp does before the last layer's remaining work."""
    return list(xs) if inp.out_ids is None else [ctx.get_rows(x, inp.out_ids) for x in xs]


def logits(ctx: Context, hp: HParams, w: dict[str, Tensor], x: Tensor) -> Tensor:
    # when tied, output.weight is token_embd or its copy placed for mul_mat (load_weights)
    out = ctx.mul_mat(w["output.weight"], norm(ctx, hp, x, w["output_norm.weight"]))
    out.name = "result_output"
    return out


def self_attention(ctx: Context, hp: HParams, w: dict[str, Tensor], il: int, cur: Tensor, inp: ModelInputs,
                   cache: KVCache, shape: BatchShape, flash_attn: bool) -> Tensor:
    """Layer il's attention of `cur` [n_embd, T], through its cache, projected back: [n_embd, T].

    Q/K norms apply when the file has blk.{il}.attn_q_norm / attn_k_norm (Gemma, Qwen 3).
    """
    b = f"blk.{il}."
    q, k, v = _qkv_roped(ctx, hp, w, il, cur, inp.pos, shape.n_tokens)
    if hp.q_scale is not None:
        q = ctx.scale(q, hp.q_scale)
    swa = hp.is_swa(il) and inp.kv_idx_swa is not None
    kv_idx, mask, n_kv = (inp.kv_idx_swa, inp.mask_swa, shape.n_kv_swa) if swa else (inp.kv_idx, inp.mask, shape.n_kv)
    k_written = ctx.set_rows(cache.k[il], ctx.view(k, [hp.n_embd_kv, shape.n_tokens], [k.nb[2]]), kv_idx)
    v_written = ctx.set_rows(cache.v[il], v, kv_idx)
    scale = 1.0 if hp.q_scale is not None else 1.0 / math.sqrt(hp.head_dim)
    if shape.seqs:
        attn = _attend_per_seq(ctx, hp, q, k_written, v_written, inp, shape, swa, cache, scale, flash_attn)
    else:
        attn = _attend(ctx, hp, q, k_written, v_written, mask, shape.n_tokens, n_kv, scale, flash_attn)
    return ctx.mul_mat(w[b + "attn_output.weight"], attn)


def _attend_per_seq(ctx: Context, hp: HParams, q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: ModelInputs,
                    shape: BatchShape, swa: bool, cache: KVCache, scale: float, flash_attn: bool) -> Tensor:
    """Attention of a multi-sequence batch: each sequence's rows of q over its own region of the
    cache (the op a batch of that sequence alone runs), gathered into [n_embd_q, T]."""
    group = cache.swa if swa else cache.full
    masks = inp.seq_masks_swa if swa else inp.seq_masks
    outs, row = [], 0
    for s, mask in zip(shape.seqs, masks):
        q_s = q if len(shape.seqs) == 1 else ctx.view(q, [hp.head_dim, hp.n_head, s.n_tokens], [q.nb[1], q.nb[2]],
                                                      row * q.nb[2])
        n_kv = s.n_kv_swa if swa else s.n_kv
        outs.append((row, _attend(ctx, hp, q_s, k_cache, v_cache, mask, s.n_tokens, n_kv, scale, flash_attn,
                                  group.base(s.seq))))
        row += s.n_tokens
    if len(outs) == 1:
        return outs[0][1]
    # gather: set_rows into a [n_embd_q, T] tensor (every row is overwritten; q's copy gives its shape)
    acc = ctx.cont(q, [hp.n_embd_q, shape.n_tokens])
    for row, out in outs:
        ids = ctx.view(inp.rows, [out.ne[1]], None, row * inp.rows.nb[0])
        acc = ctx.set_rows(acc, out, ids)
    return acc


def _qkv_roped(ctx: Context, hp: HParams, w: dict[str, Tensor], il: int, cur: Tensor, pos: Tensor,
               n_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """Roped q [D, n_head, T] and k [D, n_head_kv, T] (rows contiguous, maybe strided), v [n_embd_kv, T].

    With the fused weight (rows q | k | v) one product gives all three as views of its result;
    without Q/K norms and biases q and k are adjacent heads of it, so one rope over
    [D, n_head + n_head_kv, T] rotates both. Biases (Qwen 2: blk.{il}.attn_{q,k,v}.bias) are
    added to the products, before the heads are roped.
    """
    D, b = hp.head_dim, f"blk.{il}."
    qkv_w = w.get(b + "attn_qkv.weight")
    qk_norm = b + "attn_q_norm.weight" in w
    bias = b + "attn_q.bias" in w
    if qkv_w is None:
        q = ctx.mul_mat(w[b + "attn_q.weight"], cur)
        k = ctx.mul_mat(w[b + "attn_k.weight"], cur)
        v = ctx.mul_mat(w[b + "attn_v.weight"], cur)
        if bias:
            q, k, v = (ctx.add(x, w[b + f"attn_{n}.bias"]) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        q = ctx.reshape(q, [D, hp.n_head, n_tokens])
        k = ctx.reshape(k, [D, hp.n_head_kv, n_tokens])
    else:
        qkv = ctx.mul_mat(qkv_w, cur)  # [n_embd_q + 2 n_embd_kv, T]
        v = ctx.view(qkv, [hp.n_embd_kv, n_tokens], [qkv.nb[1]], (hp.n_embd_q + hp.n_embd_kv) * F32_SIZE)
        if not qk_norm and not bias:
            heads = ctx.view(qkv, [D, hp.n_head + hp.n_head_kv, n_tokens], [D * F32_SIZE, qkv.nb[1]])
            qk = _rope(ctx, hp, w, il, heads, pos)
            q = ctx.view(qk, [D, hp.n_head, n_tokens], [D * F32_SIZE, qk.nb[2]], 0)
            k = ctx.view(qk, [D, hp.n_head_kv, n_tokens], [D * F32_SIZE, qk.nb[2]], hp.n_embd_q * F32_SIZE)
            return q, k, v
        q = ctx.view(qkv, [D, hp.n_head, n_tokens], [D * F32_SIZE, qkv.nb[1]], 0)
        k = ctx.view(qkv, [D, hp.n_head_kv, n_tokens], [D * F32_SIZE, qkv.nb[1]], hp.n_embd_q * F32_SIZE)
        if bias:  # over the strided views: the bias of a head's D values repeats over the tokens
            q = ctx.add(q, ctx.reshape(w[b + "attn_q.bias"], [D, hp.n_head]))
            k = ctx.add(k, ctx.reshape(w[b + "attn_k.bias"], [D, hp.n_head_kv]))
            v = ctx.add(v, w[b + "attn_v.bias"])
    if qk_norm:  # per head: rms_norm normalizes each row of D values
        q = norm(ctx, hp, q, w[b + "attn_q_norm.weight"])
        k = norm(ctx, hp, k, w[b + "attn_k_norm.weight"])
    return _rope(ctx, hp, w, il, q, pos), _rope(ctx, hp, w, il, k, pos), v


def _rope(ctx: Context, hp: HParams, w: dict[str, Tensor], il: int, t: Tensor, pos: Tensor) -> Tensor:
    """RoPE of q or k heads; the layer's frequency factors (blk.{il}.rope_freqs.weight, the layer's
    copy of the file's rope_freqs.weight) when the model has them (llama.cpp's rope_factors)."""
    return ctx.rope(t, pos, hp.n_rot, hp.rope_mode, freq_base=hp.rope_base(il), n_ctx_orig=hp.n_ctx_train,
                    freq_factors=w.get(f"blk.{il}.rope_freqs.weight"))


def _attend(ctx: Context, hp: HParams, q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor,
            n_tokens: int, n_kv: int, scale: float, flash_attn: bool, base: int = 0) -> Tensor:
    """Attention of q [D, n_head, T] over cache rows base..base + n_kv; returns [n_embd_q, T]."""
    D, row = hp.head_dim, k_cache.nb[1]
    # the cache row of one slot holds n_head_kv heads of D values: view it as [D, KV, n_head_kv]
    k = ctx.view(k_cache, [D, n_kv, hp.n_head_kv], [row, D * k_cache.type.type_size], base * row)
    v = ctx.view(v_cache, [D, n_kv, hp.n_head_kv], [row, D * v_cache.type.type_size], base * row)
    q = ctx.permute(q, 0, 2, 1, 3)  # [D, T, n_head]
    if flash_attn:
        # F32 accumulation, as llama.cpp asks for every model (backends may honour it or not)
        out = ctx.flash_attn_ext(q, k, v, mask, scale, prec=Prec.F32)  # [D, n_head, T]
        return ctx.reshape(out, [hp.n_embd_q, n_tokens])
    kq = ctx.soft_max(ctx.mul_mat(k, q), mask, scale)  # [KV, T, n_head]
    v_t = ctx.cont(ctx.transpose(v))  # [KV, D, n_head_kv]: rows over slots for the second product
    kqv = ctx.mul_mat(v_t, kq)  # [D, T, n_head]
    return ctx.cont(ctx.permute(kqv, 0, 2, 1, 3), [hp.n_embd_q, n_tokens])


def gated_ffn(ctx: Context, w: dict[str, Tensor], b: str, cur: Tensor, act: GluKind) -> Tensor:
    """down(act(gate(cur)) * up(cur)); the fused weight (rows gate | up) needs one product."""
    gate_up = w.get(b + "ffn_gate_up.weight")
    if gate_up is not None:  # the gated unit over the halves of each column
        return ctx.mul_mat(w[b + "ffn_down.weight"], ctx.glu(ctx.mul_mat(gate_up, cur), kind=act))
    gate = ctx.mul_mat(w[b + "ffn_gate.weight"], cur)
    up = ctx.mul_mat(w[b + "ffn_up.weight"], cur)
    return ctx.mul_mat(w[b + "ffn_down.weight"], ctx.glu(gate, up, kind=act))


def moe_ffn(ctx: Context, hp: HParams, w: dict[str, Tensor], b: str, cur: Tensor) -> Tensor:
    """Mixtral-style experts: softmax over the top-k router logits weighs the k chosen experts.

    softmax over all experts restricted to the top k and renormalized equals a softmax over the
    top-k logits alone, which needs no division op.
    """
    k, n_exp, n_tokens = hp.n_expert_used, hp.n_expert, cur.ne[1]
    router = ctx.mul_mat(w[b + "ffn_gate_inp.weight"], cur)  # [n_expert, T]
    chosen = ctx.argsort_top_k(router, k)  # I32 [k, T]
    picked = ctx.get_rows(ctx.reshape(router, [1, n_exp, n_tokens]), chosen)  # [1, k, T]
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
