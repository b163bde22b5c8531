"""The tokenizer of a GGUF model, built with the `tokenizers` library from the file's vocabulary.

Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE: tokens are byte-level strings,
merges are "left right" strings in rank order). The pre-tokenizer regexes follow llama.cpp's
for the file's `tokenizer.ggml.pre`. Control and user-defined tokens (token_type 3 and 4) are
special: they are matched in the text before BPE ("special tokens parsed", as llama.cpp) and
left out when detokenizing with `skip_special=True`.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..errors import GGXFormatError, GGXUnsupported
from .gguf_file import GGUFFile

TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 2, 3, 4

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), applied in order, each splitting the
# pieces of the previous one; the last one is GPT-2's and is applied by ByteLevel itself.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS: dict[str, list[str]] = {
    "default": [],
    "gpt-2": [],
    "smollm": [r"\p{N}"],  # digits one by one, then GPT-2 (llama.cpp groups smollm with starcoder)
    "starcoder": [r"\p{N}"],
    "refact": [r"\p{N}"],
    "llama-bpe": [_LLAMA3_REGEX],
    "llama3": [_LLAMA3_REGEX],
}


class Tokenizer:
    """text <-> token ids for one model (wraps a `tokenizers.Tokenizer`)."""

    def __init__(self, vocab: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None,
                 pre: str = "default", bos_id: int | None = None, eos_id: int | None = None,
                 add_bos: bool = False):
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        if pre not in _PRE_SPLITS:
            raise GGXUnsupported(f"pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(_PRE_SPLITS))})")
        self.n_vocab = len(vocab)
        self.vocab = list(vocab)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        index: dict[str, int] = {}
        for i, tok in enumerate(vocab):
            index.setdefault(tok, i)  # a duplicated token keeps its first id
        pairs = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                raise GGXFormatError(f"tokenizer merge {m!r} is not two space-separated tokens")
            pairs.append((parts[0], parts[1]))
        try:
            bpe = models.BPE(vocab=index, merges=pairs, fuse_unk=False)
        except Exception as e:  # tokenizers raises plain Exceptions for merges naming unknown tokens
            raise GGXFormatError(f"the vocabulary and merges do not form a BPE tokenizer: {e}") from None
        tok = HFTokenizer(bpe)
        splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_SPLITS[pre]]
        use_gpt2_regex = pre not in ("llama-bpe", "llama3")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_gpt2_regex)])
        tok.decoder = decoders.ByteLevel()
        types = list(token_types) if token_types is not None else [TOKEN_TYPE_NORMAL] * len(vocab)
        self.special_ids = {i for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
        tok.add_special_tokens([AddedToken(vocab[i], special=True, normalized=False) for i in sorted(self.special_ids)])
        self._tok = tok

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Tokenizer:
        model = f.get("tokenizer.ggml.model", str)
        if model != "gpt2":
            raise GGXUnsupported(f"{f.path}: tokenizer model {model!r} is not supported (ggx has 'gpt2' BPE)")
        vocab = f.get("tokenizer.ggml.tokens", list)
        merges = f.get("tokenizer.ggml.merges", list)
        for key, items in (("tokens", vocab), ("merges", merges)):
            if not all(isinstance(x, str) for x in items):
                raise GGXFormatError(f"{f.path}: tokenizer.ggml.{key} must be an array of strings")
        types = f.get("tokenizer.ggml.token_type", list, None)
        if types is not None and len(types) != len(vocab):
            raise GGXFormatError(f"{f.path}: {len(types)} token types for {len(vocab)} tokens")
        bos = f.get("tokenizer.ggml.bos_token_id", int, None)
        eos = f.get("tokenizer.ggml.eos_token_id", int, None)
        for key, tid in (("bos", bos), ("eos", eos)):
            if tid is not None and not 0 <= tid < len(vocab):
                raise GGXFormatError(f"{f.path}: {key} token id {tid} outside the vocabulary of {len(vocab)}")
        add_bos = bool(f.get("tokenizer.ggml.add_bos_token", bool, False))
        return cls(vocab, merges, types, f.get("tokenizer.ggml.pre", str, "default"), bos, eos, add_bos)

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`, special tokens parsed; BOS first only when the file (or caller) asks."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        bad = [i for i in ids if not 0 <= int(i) < self.n_vocab]
        if bad:
            raise GGXFormatError(f"token ids {bad[:5]} are outside the vocabulary of {self.n_vocab}")
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (special tokens as their text): for streaming partial UTF-8."""
        if token_id in self.special_ids:
            return self.vocab[token_id].encode()
        return bytes(_BYTE_DECODER[ch] for ch in self.vocab[token_id] if ch in _BYTE_DECODER)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()
