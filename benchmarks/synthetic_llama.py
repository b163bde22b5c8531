"""Write a synthetic llama GGUF of a chosen size: random weights, a real vocabulary, for speed
comparisons at scale (the weights are noise, so the text it generates is too).

    python benchmarks/synthetic_llama.py OUT.gguf [--type q4_0] [--n-embd 2048] [--n-ff 8192]
        [--n-layer 16] [--n-head 32] [--n-head-kv 8] [--vocab-from FILE.gguf] [--seed 0]

The defaults are the dimensions of a 1B llama (~1.07 B parameters with the tied embedding).
The vocabulary and tokenizer metadata are copied from --vocab-from (default: the SmolLM2 file of
the default model). As llama-quantize does for such files, the tied token embedding is Q8_0,
every other matrix --type (q4_0, q4_1, q5_0, q8_0, q4_K, q6_K or f16), the norms F32. Weights are
normal with std 0.02 (norm weights 1), quantized with ggx's bit-exact quantizers and written
with `gguf.GGUFWriter`. Needs ~1 GB of memory and about a minute for the default size.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from ggx.quants import quantize
from ggx.types import GType

TYPES = {"q4_0": GType.Q4_0, "q4_1": GType.Q4_1, "q5_0": GType.Q5_0, "q8_0": GType.Q8_0, "q4_K": GType.Q4_K,
         "q6_K": GType.Q6_K, "f16": GType.F16}
#: llama.cpp's LLAMA_FTYPE of each weight type (general.file_type)
FILE_TYPE = {"q4_0": 2, "q4_1": 3, "q5_0": 8, "q8_0": 7, "q4_K": 15, "q6_K": 18, "f16": 1}
#: metadata copied from the vocabulary's file
VOCAB_KEYS = ("tokenizer.", "general.quantization_version")
CHUNK_ROWS = 4096  # rows quantized at a time (bounds the float32 scratch)


def _matrix(rng: np.random.Generator, rows: int, cols: int, gtype: GType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A [rows, cols] weight (numpy order) of random values in gtype: raw block bytes, or F16."""
    if gtype is GType.F16:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16), \
            GGMLQuantizationType.F16
    parts = []
    for r in range(0, rows, CHUNK_ROWS):
        x = rng.standard_normal((min(CHUNK_ROWS, rows - r), cols), dtype=np.float32) * np.float32(0.02)
        parts.append(quantize(x, gtype).reshape(x.shape[0], -1))
    return np.concatenate(parts), GGMLQuantizationType[gtype.name]


def _copy_vocab(src: GGUFReader, w: GGUFWriter) -> int:
    """Copy the tokenizer metadata; returns the vocabulary size."""
    for name, field in src.fields.items():
        if not name.startswith(VOCAB_KEYS):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), vtype, sub_type=field.types[1])
        else:
            w.add_key_value(name, field.contents(), vtype)
    return len(src.fields["tokenizer.ggml.tokens"].contents())


def write(out: str, wtype: str, n_embd: int, n_ff: int, n_layer: int, n_head: int, n_head_kv: int,
          vocab_from: str, seed: int) -> None:
    gtype = TYPES[wtype]
    head_dim = n_embd // n_head
    if n_embd % n_head or n_head % n_head_kv or n_embd % gtype.block_size or n_ff % gtype.block_size:
        raise SystemExit(f"dimensions do not fit: n_embd {n_embd}, n_ff {n_ff}, heads {n_head}/{n_head_kv}, "
                         f"{wtype} blocks of {gtype.block_size}")
    rng = np.random.default_rng(seed)
    w = GGUFWriter(out, "llama")
    w.add_name(f"synthetic llama {n_layer}x{n_embd}")
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(FILE_TYPE[wtype])
    n_vocab = _copy_vocab(GGUFReader(vocab_from), w)
    w.add_vocab_size(n_vocab)
    kv = n_embd // n_head * n_head_kv
    started = time.perf_counter()
    data, raw = _matrix(rng, n_vocab, n_embd, GType.Q8_0)
    w.add_tensor("token_embd.weight", data, raw_dtype=raw)
    ones = np.ones(n_embd, np.float32)
    w.add_tensor("output_norm.weight", ones)
    for il in range(n_layer):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", ones)
        w.add_tensor(b + "ffn_norm.weight", ones)
        for name, rows, cols in (("attn_q", n_embd, n_embd), ("attn_k", kv, n_embd), ("attn_v", kv, n_embd),
                                 ("attn_output", n_embd, n_embd), ("ffn_gate", n_ff, n_embd),
                                 ("ffn_up", n_ff, n_embd), ("ffn_down", n_embd, n_ff)):
            data, raw = _matrix(rng, rows, cols, gtype)
            w.add_tensor(b + name + ".weight", data, raw_dtype=raw)
        took = time.perf_counter() - started
        print(f"\rlayer {il + 1}/{n_layer} ({took:.0f} s)", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--type", default="q4_0", choices=sorted(TYPES))
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-ff", type=int, default=8192)
    ap.add_argument("--n-layer", type=int, default=16)
    ap.add_argument("--n-head", type=int, default=32)
    ap.add_argument("--n-head-kv", type=int, default=8)
    ap.add_argument("--vocab-from", default=None, help="GGUF file whose vocabulary to copy (default: SmolLM2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    vocab_from = args.vocab_from
    if vocab_from is None:
        from ggx.models.model import default_model_path

        vocab_from = str(default_model_path())
    write(args.out, args.type, args.n_embd, args.n_ff, args.n_layer, args.n_head, args.n_head_kv, vocab_from,
          args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
