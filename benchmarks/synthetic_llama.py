"""Write a synthetic GGUF of a chosen architecture and size: random weights, a real vocabulary,
for speed comparisons at scale and for logit checks against llama.cpp (the weights are noise,
so the text it generates is too).

    python benchmarks/synthetic_llama.py OUT.gguf [--arch llama|qwen2|qwen3|qwen3moe] [--type q4_0]
        [--n-embd 2048] [--n-ff 8192] [--n-layer 16] [--n-head 32] [--n-head-kv 8] [--head-dim D]
        [--n-expert 0] [--n-expert-used 0] [--unit-scale] [--vocab-from FILE.gguf] [--seed 0]

The defaults are the dimensions of a 1B llama (~1.07 B parameters with the tied embedding).
Architectures: llama; qwen2 (Q/K/V biases); qwen3 (Q/K norms per head, a head size --head-dim
that need not be n_embd / n_head); qwen3moe (qwen3's attention, --n-expert experts of --n-ff
each, --n-expert-used per token). Qwen files get RoPE base 1e6, as the real ones.

The vocabulary and tokenizer metadata are copied from --vocab-from (default: the SmolLM2 file of
the default model). As llama-quantize does for such files, the tied token embedding is Q8_0,
every other matrix --type (q4_0, q4_1, q5_0, q8_0, q4_K, q6_K, f16 or f32), norms, biases and
routers F32; `--type f16` / `f32` give a source for llama-quantize (e.g. to Q4_K_M). Weights are
normal with std 0.02 (norm weights 1), or with `--unit-scale` of std 1/sqrt(fan-in) (the
embedding 1/sqrt(n_embd): logits of std ~1, and every layer changes them as much as the
embedding does, which a logit check needs), quantized with ggx's bit-exact quantizers and
written with `gguf.GGUFWriter`. The values depend only on the seed, the dimensions and the
vocabulary size: `write` with `types` remakes, byte for byte, a file llama-quantize made from
such a source. Needs ~1 GB of memory and about a minute for the default size.

The 1.07B-sized files of each architecture for benchmarks/vs_llamacpp.py (the same weight bytes
per token as the default llama: qwen3's 16 heads of 128 and 4 KV heads give llama's Q/K/V
widths; qwen3moe's 16 experts of 512 (4 used) hold the same FFN weights, a quarter of them read
per token), as F16 sources quantized by llama-quantize (Q4_0, Q4_K_M):

    python benchmarks/synthetic_llama.py llama-f16.gguf --type f16
    python benchmarks/synthetic_llama.py qwen2-f16.gguf --arch qwen2 --type f16
    python benchmarks/synthetic_llama.py qwen3-f16.gguf --arch qwen3 --type f16 --n-head 16 --n-head-kv 4 --head-dim 128
    python benchmarks/synthetic_llama.py qwen3moe-f16.gguf --arch qwen3moe --type f16 --n-head 16 --n-head-kv 4 \
        --head-dim 128 --n-expert 16 --n-expert-used 4 --n-ff 512
    llama-quantize X-f16.gguf X-q4_0.gguf Q4_0; llama-quantize X-f16.gguf X-q4_k_m.gguf Q4_K_M
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from ggx.quants import quantize
from ggx.types import GType

TYPES = {"q4_0": GType.Q4_0, "q4_1": GType.Q4_1, "q5_0": GType.Q5_0, "q8_0": GType.Q8_0, "q4_K": GType.Q4_K,
         "q6_K": GType.Q6_K, "f16": GType.F16, "f32": GType.F32}
#: llama.cpp's LLAMA_FTYPE of each weight type (general.file_type)
FILE_TYPE = {"q4_0": 2, "q4_1": 3, "q5_0": 8, "q8_0": 7, "q4_K": 15, "q6_K": 18, "f16": 1, "f32": 0}
ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")
#: metadata copied from the vocabulary's file
VOCAB_KEYS = ("tokenizer.", "general.quantization_version")
CHUNK_ROWS = 4096  # rows drawn and quantized at a time (bounds the float32 scratch)


@dataclass(frozen=True)
class Dims:
    arch: str = "llama"
    n_embd: int = 2048
    n_ff: int = 8192  # the experts' width for qwen3moe
    n_layer: int = 16
    n_head: int = 32
    n_head_kv: int = 8
    head_dim: int | None = None  # None: n_embd / n_head
    n_expert: int = 0
    n_expert_used: int = 0
    unit_scale: bool = False

    @property
    def d(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    def check(self, gtype: GType) -> None:
        if self.arch not in ARCHS:
            raise SystemExit(f"unknown architecture {self.arch!r} (one of {', '.join(ARCHS)})")
        moe = self.arch == "qwen3moe"
        if moe != (self.n_expert > 0) or (moe and not 1 <= self.n_expert_used <= self.n_expert):
            raise SystemExit("qwen3moe (and only it) needs --n-expert > 0 and 1 <= --n-expert-used <= --n-expert")
        if self.head_dim is None and self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise SystemExit(f"heads do not fit: n_embd {self.n_embd}, heads {self.n_head}/{self.n_head_kv}")
        if any(n % gtype.block_size for n in (self.n_embd, self.n_ff, self.d * self.n_head)):
            raise SystemExit(f"rows of {self.n_embd}, {self.n_ff} and {self.d * self.n_head} values do not fit "
                             f"{gtype.name} blocks of {gtype.block_size}")


#: what a tensor is: the embedding, a matrix (weight, expert stack), or a vector (norm, bias)
Spec = tuple[str, tuple[int, ...], str]


def tensor_specs(dims: Dims, n_vocab: int) -> list[Spec]:
    """Every tensor in file order: name, numpy shape (rows last-but-one, row length last), role."""
    e, ff, d = dims.n_embd, dims.n_ff, dims.d
    q, kv = d * dims.n_head, d * dims.n_head_kv
    specs: list[Spec] = [("token_embd.weight", (n_vocab, e), "embd"), ("output_norm.weight", (e,), "norm")]
    for il in range(dims.n_layer):
        b = f"blk.{il}."
        specs += [(b + "attn_norm.weight", (e,), "norm"), (b + "ffn_norm.weight", (e,), "norm")]
        specs += [(b + "attn_q.weight", (q, e), "weight"), (b + "attn_k.weight", (kv, e), "weight"),
                  (b + "attn_v.weight", (kv, e), "weight"), (b + "attn_output.weight", (e, q), "weight")]
        if dims.arch == "qwen2":
            specs += [(b + "attn_q.bias", (q,), "bias"), (b + "attn_k.bias", (kv,), "bias"),
                      (b + "attn_v.bias", (kv,), "bias")]
        if dims.arch in ("qwen3", "qwen3moe"):
            specs += [(b + "attn_q_norm.weight", (d,), "norm"), (b + "attn_k_norm.weight", (d,), "norm")]
        if dims.n_expert:
            x = dims.n_expert
            specs += [(b + "ffn_gate_inp.weight", (x, e), "router"), (b + "ffn_gate_exps.weight", (x, ff, e), "weight"),
                      (b + "ffn_up_exps.weight", (x, ff, e), "weight"),
                      (b + "ffn_down_exps.weight", (x, e, ff), "weight")]
        else:
            specs += [(b + "ffn_gate.weight", (ff, e), "weight"), (b + "ffn_up.weight", (ff, e), "weight"),
                      (b + "ffn_down.weight", (e, ff), "weight")]
    return specs


def default_type(name: str, role: str, wtype: GType) -> GType:
    """llama-quantize's choice for such a file with one weight type: Q8_0 embedding, F32 vectors
    and routers, `wtype` for the rest (a float source keeps its type everywhere)."""
    if role in ("norm", "bias", "router"):
        return GType.F32
    if role == "embd" and wtype not in (GType.F16, GType.F32):
        return GType.Q8_0
    return wtype


def values(rng: np.random.Generator, shape: tuple[int, ...], role: str, dims: Dims) -> Iterator[np.ndarray]:
    """The float32 values of one tensor, CHUNK_ROWS rows at a time (numpy order, last axis rows)."""
    if role == "norm":
        noise = 0.1 * rng.standard_normal(shape, dtype=np.float32) if dims.unit_scale else 0.0
        yield np.asarray(1.0 + noise, np.float32) * np.ones(shape, np.float32)
        return
    if role == "bias":
        yield rng.standard_normal(shape, dtype=np.float32) * np.float32(0.5 if dims.unit_scale else 0.02)
        return
    cols = shape[-1]
    std = np.float32(1.0 / np.sqrt(dims.n_embd if role == "embd" else cols) if dims.unit_scale else 0.02)
    rows = int(np.prod(shape[:-1]))
    for r in range(0, rows, CHUNK_ROWS):
        yield rng.standard_normal((min(CHUNK_ROWS, rows - r), cols), dtype=np.float32) * std


def _encoded(chunks: Iterator[np.ndarray], shape: tuple[int, ...],
             gtype: GType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The tensor's bytes in gtype (F32 and F16 as numbers, the rest as ggml blocks)."""
    if gtype is GType.F32:
        data = np.concatenate([c.reshape(-1) for c in chunks])
    elif gtype is GType.F16:
        data = np.concatenate([c.reshape(-1).astype(np.float16) for c in chunks])
    else:
        parts = [quantize(c.reshape(-1, shape[-1]), gtype) for c in chunks]
        return np.concatenate(parts).reshape(*shape[:-1], -1), GGMLQuantizationType[gtype.name]
    return data.reshape(shape), GGMLQuantizationType[gtype.name]


#: per vocabulary file, its tokenizer metadata (GGUFReader reads a 49k-token vocabulary in seconds)
_VOCABS: dict[str, list[tuple[str, object, GGUFValueType, GGUFValueType | None]]] = {}
#: encoded token embeddings by (seed, shape, scale, type): the first tensor drawn from a fresh
#: generator, so files of other architectures with the same seed share it
_EMBEDDINGS: dict[tuple, tuple[np.ndarray, GGMLQuantizationType]] = {}


def _copy_vocab(vocab_from: str, w: GGUFWriter) -> int:
    """Copy the tokenizer metadata; returns the vocabulary size."""
    if vocab_from not in _VOCABS:
        src = GGUFReader(vocab_from)
        _VOCABS[vocab_from] = [(name, f.contents(), f.types[0], f.types[1] if f.types[0] == GGUFValueType.ARRAY
                                else None) for name, f in src.fields.items() if name.startswith(VOCAB_KEYS)]
    n_vocab = 0
    for name, value, vtype, sub_type in _VOCABS[vocab_from]:
        w.add_key_value(name, value, vtype, sub_type=sub_type)
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    return n_vocab


def write(out: str, dims: Dims, vocab_from: str, seed: int, wtype: str = "q4_0",
          types: Callable[[str, str], GType] | None = None, progress: bool = True) -> None:
    """Write the file; `types(name, role)` overrides the type of each tensor (default
    `default_type` with --type)."""
    gtype = TYPES[wtype]
    dims.check(gtype)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(out, dims.arch)
    w.add_name(f"synthetic {dims.arch} {dims.n_layer}x{dims.n_embd}")
    w.add_block_count(dims.n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(dims.n_embd)
    w.add_feed_forward_length(dims.n_ff)
    w.add_head_count(dims.n_head)
    w.add_head_count_kv(dims.n_head_kv)
    if dims.head_dim is not None:
        w.add_key_length(dims.head_dim)
        w.add_value_length(dims.head_dim)
    if dims.n_expert:
        w.add_expert_count(dims.n_expert)
        w.add_expert_used_count(dims.n_expert_used)
        w.add_expert_feed_forward_length(dims.n_ff)
    w.add_rope_freq_base(10000.0 if dims.arch == "llama" else 1e6)
    w.add_rope_dimension_count(dims.d)
    w.add_layer_norm_rms_eps(1e-6 if dims.arch != "llama" else 1e-5)
    w.add_file_type(FILE_TYPE[wtype])
    n_vocab = _copy_vocab(vocab_from, w)
    w.add_vocab_size(n_vocab)
    started = time.perf_counter()
    for i, (name, shape, role) in enumerate(specs := tensor_specs(dims, n_vocab)):
        t = types(name, role) if types is not None else default_type(name, role, gtype)
        if i == 0:  # the embedding: drawn all the same (the generator moves on), encoded once
            key = (seed, shape, dims.unit_scale, t)
            chunks = list(values(rng, shape, role, dims))
            if key not in _EMBEDDINGS:
                if len(_EMBEDDINGS) >= 2:  # a 1B file's is 100 MB
                    _EMBEDDINGS.pop(next(iter(_EMBEDDINGS)))
                _EMBEDDINGS[key] = _encoded(iter(chunks), shape, t)
            data, raw = _EMBEDDINGS[key]
        else:
            data, raw = _encoded(values(rng, shape, role, dims), shape, t)
        w.add_tensor(name, data, raw_dtype=raw)
        if progress:
            print(f"\rtensor {i + 1}/{len(specs)} ({time.perf_counter() - started:.0f} s)", end="", file=sys.stderr,
                  flush=True)
    if progress:
        print(file=sys.stderr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--arch", default="llama", choices=ARCHS)
    ap.add_argument("--type", default="q4_0", choices=sorted(TYPES))
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-ff", type=int, default=8192, help="the FFN width (each expert's for qwen3moe)")
    ap.add_argument("--n-layer", type=int, default=16)
    ap.add_argument("--n-head", type=int, default=32)
    ap.add_argument("--n-head-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=None, help="head size (default n_embd / n_head)")
    ap.add_argument("--n-expert", type=int, default=0)
    ap.add_argument("--n-expert-used", type=int, default=0)
    ap.add_argument("--unit-scale", action="store_true", help="weights of std 1/sqrt(fan-in) (logit checks)")
    ap.add_argument("--vocab-from", default=None, help="GGUF file whose vocabulary to copy (default: SmolLM2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    vocab_from = args.vocab_from
    if vocab_from is None:
        from ggx.models.model import default_model_path

        vocab_from = str(default_model_path())
    dims = Dims(args.arch, args.n_embd, args.n_ff, args.n_layer, args.n_head, args.n_head_kv, args.head_dim,
                args.n_expert, args.n_expert_used, args.unit_scale)
    write(args.out, dims, vocab_from, args.seed, args.type)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
