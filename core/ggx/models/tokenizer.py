"""The tokenizer of a GGUF model, built with the `tokenizers` library from the file's vocabulary,
following llama.cpp's llama-vocab.cpp for every `tokenizer.ggml.*` key it reads.

Supported `tokenizer.ggml.model` values:

* ``"gpt2"``: byte-level BPE (tokens are byte-level strings, merges are "left right" strings in
  rank order). The pre-tokenizer regexes follow llama.cpp's for the file's `tokenizer.ggml.pre`.
* ``"llama"``: SentencePiece (llama.cpp's SPM vocabulary: tokens with scores). llama.cpp
  replaces spaces by U+2581 "▁", prepends a "▁" to every text fragment (the text between two
  special tokens, or before the first) when `tokenizer.ggml.add_space_prefix` is true (its
  default for SPM), splits the fragment into characters and repeatedly merges the adjacent pair
  whose concatenation is the highest-scoring token (the leftmost on ties); what is left that is
  no token becomes its bytes' `<0xXX>` tokens. That is BPE with byte fallback whose merges are
  all the splits of each token into two tokens, ranked by the whole token's score (the way HF's
  SentencePiece converters derive them), and that is how it is built here (`_spm_merges`).

Both: control, user-defined and unknown tokens (token_type 3, 4, 2), plus the tokens llama.cpp
makes control by their text (end-of-turn and fill-in-the-middle markers), are matched in the text
before the model runs ("special tokens parsed", as llama.cpp). `tokenize` prepends BOS when
`tokenizer.ggml.add_bos_token` is true (default true for SPM) and appends EOS when
`tokenizer.ggml.add_eos_token` is. `Tokenizer.eog_ids` are llama.cpp's end-of-generation tokens.
`detokenize(skip_special=True)` leaves out control and unknown tokens (user-defined ones stay),
as llama.cpp's detokenize without `unparse_special`; SPM tokens detokenize as llama.cpp's
token_to_piece gives them (`token_bytes`), not through `tokenizers`' decoders, which would also
rewrite "▁" inside special tokens.

Where SPM can differ from llama.cpp (none of it occurs with Gemma 3's vocabulary): two
characters that are no tokens but together are one merge in llama.cpp, while BPE gives each its
bytes at once; pairs of equal score merge leftmost first in llama.cpp but in rank (id) order
here, so a vocabulary without scores can split differently; overlapping special tokens are
matched leftmost-longest here, longest-first in llama.cpp; and a character whose `<0xXX>` tokens
are missing is dropped where llama.cpp fails.
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import GGXFormatError, GGXUnsupported
from ..host import trim_heap
from .gc_pause import gc_paused
from .gguf_file import ARRAY, GGUFFile

(TOKEN_TYPE_UNDEFINED, TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED,
 TOKEN_TYPE_UNUSED, TOKEN_TYPE_BYTE) = range(7)

#: the `tokenizer.ggml.model` values ggx builds, with what they are
SUPPORTED_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece (SPM)"}

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), applied in order, each splitting the
# pieces of the previous one; the last one is GPT-2's and is applied by ByteLevel itself.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 2 / 2.5 / 3 (pre "qwen2"): llama 3's split with single digits
_QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS: dict[str, list[str]] = {
    "default": [],
    "gpt-2": [],
    "smollm": [r"\p{N}"],  # digits one by one, then GPT-2 (llama.cpp groups smollm with starcoder)
    "starcoder": [r"\p{N}"],
    "refact": [r"\p{N}"],
    "llama-bpe": [_LLAMA3_REGEX],
    "llama3": [_LLAMA3_REGEX],
    "qwen2": [_QWEN2_REGEX],
}

# The token texts llama.cpp's load_vocab recognises when the file names no id for that role;
# the one it finds is made a control token. (llama.cpp takes whichever its hash map yields first
# when several match; here it is the first text of the list the vocabulary has.)
_ROLE_TEXTS: dict[str, tuple[str, ...]] = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
#: role -> GGUF key of its token id (llama-arch.cpp's LLM_KV_TOKENIZER_*_ID)
ROLE_KEYS = {role: f"tokenizer.ggml.{role}_token_id" for role in _ROLE_TEXTS}
# every token with one of these texts ends generation (llama.cpp's special_eog_ids), and is control
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_USER_DEFINED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: always rendered
_KNOWN_TEXTS = frozenset(t for texts in _ROLE_TEXTS.values() for t in texts) | set(_EOG_TEXTS) | set(
    _USER_DEFINED_TEXTS) | {"<|plamo:eos|>"}

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE, _ESCAPED_SPACE = " ", "\u2581"


class Tokenizer:
    """text <-> token ids for one model (wraps a `tokenizers.Tokenizer`).

    `from_gguf` reads the file's keys with llama.cpp's defaults; the constructor takes them as
    given. `model` is "gpt2" (give `merges`) or "llama" (give `scores`, or none: all 0 as in
    llama.cpp). `role_ids` maps roles of `ROLE_KEYS` ("eot", "fim_pad", ...) to the ids the file
    names; the roles it leaves out are found by token text, as llama.cpp does. Everything the
    file can get wrong is checked here; the `tokenizers` tables are built at the first use that
    needs them (tokenize, and a BPE vocabulary's detokenize): seconds and ~125 MB for a 262k SPM
    vocabulary, ~0.05 s and ~18 MB for SmolLM2's 49k BPE one, which a process that is given token
    ids (`ggx bench`, a server fed ids) does not pay.
    """

    def __init__(self, vocab: Sequence[str], merges: Sequence[str] = (), token_types: Sequence[int] | None = None,
                 pre: str = "default", bos_id: int | None = None, eos_id: int | None = None, add_bos: bool = False,
                 *, model: str = "gpt2", scores: Sequence[float] | None = None, add_eos: bool = False,
                 add_space_prefix: bool = False, role_ids: Mapping[str, int] | None = None):
        if model not in SUPPORTED_MODELS:
            raise GGXUnsupported(f"tokenizer model {model!r} is not supported ({_supported()})")
        if not set(map(type, vocab)) <= {str}:
            raise GGXFormatError("tokenizer.ggml.tokens must be an array of strings")
        # llama.cpp renames empty tokens, which its text -> id map could not tell apart
        vocab = [t or f"[EMPTY_{i}]" for i, t in enumerate(vocab)] if "" in vocab else list(vocab)
        n = len(vocab)
        if token_types is None:
            types = np.full(n, TOKEN_TYPE_NORMAL, np.int32)
        else:  # a copy: llama.cpp's special-token pass edits it
            types = _numbers(token_types, n, "token types", "token_type", "iu", "integers").astype(np.int32)
        role_ids = dict(role_ids or {})
        for what, tid in [("bos", bos_id), ("eos", eos_id)] + sorted(role_ids.items()):
            if tid is not None and not 0 <= tid < n:
                raise GGXFormatError(f"{what} token id {tid} outside the vocabulary of {n}")
        self.model = model
        self.n_vocab = n
        self.vocab = vocab
        self.bos_id, self.eos_id, self.add_bos, self.add_eos = bos_id, eos_id, add_bos, add_eos
        self.add_space_prefix = add_space_prefix and model == "llama"
        forced_control, self._eog, self.eot_id = _llama_cpp_specials(vocab, types, eos_id, role_ids)
        self._types = types
        # llama.cpp's token attributes: CONTROL/UNKNOWN render only when asked for, and these plus
        # USER_DEFINED are cut out of the text before the model sees it
        self._hidden = set(np.flatnonzero(np.isin(types, (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN))).tolist())
        self._hidden |= forced_control
        self.special_ids = self._hidden | set(np.flatnonzero(types == TOKEN_TYPE_USER_DEFINED).tolist())
        self._hf = None  # the `tokenizers.Tokenizer`, built by `_tok`
        #: seconds the first use spent building the vocabulary's tables (0 until then)
        self.build_s = 0.0
        self._build_lock = threading.Lock()
        # the file's mistakes are found here; the build waits for a first use
        if model == "llama":
            self._check_spm(scores)
        else:
            self._check_gpt2(merges, pre)

    @property
    def _tok(self):
        """The `tokenizers.Tokenizer`, built at its first use (see the class docstring)."""
        tok = self._hf
        if tok is None:
            with self._build_lock:
                if self._hf is None:
                    t0 = time.perf_counter()
                    self._hf = self._with_specials(self._build_spm() if self.model == "llama" else self._build_gpt2())
                    self.build_s = time.perf_counter() - t0
                    self._score = self._merges = None
                    trim_heap()  # the merges' garbage, given back
                tok = self._hf
        return tok

    def _with_specials(self, tok):
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(self.vocab[i], special=i in self._hidden, normalized=False)
                        for i in sorted(self.special_ids)])
        return tok

    def _check_gpt2(self, merges: Sequence[str], pre: str) -> None:
        """The BPE merges and pre-tokenizer, checked and kept as given for the build (`_merges`,
        `_pre`: the file's list, not a split copy of it, which would cost as much as the tables)."""
        if pre not in _PRE_SPLITS:
            raise GGXUnsupported(f"pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(_PRE_SPLITS))})")
        known = set(self.vocab)
        for m in merges:
            parts = m.split(" ") if isinstance(m, str) else []
            if len(parts) != 2:
                raise GGXFormatError(f"tokenizer merge {m!r} is not two space-separated tokens")
            if parts[0] not in known or parts[1] not in known or parts[0] + parts[1] not in known:
                raise GGXFormatError(f"tokenizer merge {m!r} names a token the vocabulary does not have: "
                                     "the vocabulary and merges do not form a BPE tokenizer")
        self._merges: Sequence[str] | None = merges
        self._pre = pre

    def _build_gpt2(self):
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        index: dict[str, int] = {}
        for i, tok in enumerate(self.vocab):
            index.setdefault(tok, i)  # a duplicated token keeps its first id
        try:
            bpe = models.BPE(vocab=index, merges=[tuple(m.split(" ")) for m in self._merges], fuse_unk=False)
        except Exception as e:  # tokenizers raises plain Exceptions
            raise GGXFormatError(f"the vocabulary and merges do not form a BPE tokenizer: {e}") from None
        tok = HFTokenizer(bpe)
        pre = self._pre
        splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_SPLITS[pre]]
        use_gpt2_regex = pre not in ("llama-bpe", "llama3", "qwen2")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_gpt2_regex)])
        tok.decoder = decoders.ByteLevel()
        return tok

    def _check_spm(self, scores: Sequence[float] | None) -> None:
        """The SPM vocabulary's scores and byte tokens, checked (`_score`, `_byte_value`)."""
        n = self.n_vocab
        score = np.zeros(n) if scores is None else _numbers(scores, n, "token scores", "scores", "iuf", "numbers")
        self._byte_value: dict[int, int] = {}
        for i in np.flatnonzero(self._types == TOKEN_TYPE_BYTE).tolist():
            m = _BYTE_TOKEN.fullmatch(self.vocab[i])
            if m is None:
                raise GGXFormatError(f"byte token {i} is {self.vocab[i]!r}, not <0xXX>")
            self._byte_value[i] = int(m.group(1), 16)
        self._score = score

    def _build_spm(self):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, normalizers

        score, n = self._score, self.n_vocab
        index = dict(zip(self.vocab, range(n)))  # a duplicated token keeps its last id, as llama.cpp's map
        # half a million merge tuples would set off the cycle collector again and again (0.3 s)
        with gc_paused():
            merges = _spm_merges(self.vocab, score, index)
        try:
            # llama.cpp looks the "<0xXX>" texts up for bytes of characters that are no token: byte fallback
            bpe = models.BPE(vocab=index, merges=merges, byte_fallback=True, fuse_unk=False)
        except Exception as e:  # tokenizers raises plain Exceptions
            raise GGXFormatError(f"the vocabulary does not form a BPE tokenizer: {e}") from None
        tok = HFTokenizer(bpe)
        escape = normalizers.Replace(_SPACE, _ESCAPED_SPACE)
        # normalizers run on each piece between added tokens: llama.cpp's prefix after every special token
        tok.normalizer = (normalizers.Sequence([normalizers.Prepend(_ESCAPED_SPACE), escape])
                          if self.add_space_prefix else escape)
        return tok

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Tokenizer:
        """The file's tokenizer; keys it leaves out take llama.cpp's defaults for its model."""
        model = f.get("tokenizer.ggml.model", str)
        if model not in SUPPORTED_MODELS:
            raise GGXUnsupported(f"{f.path}: tokenizer model {model!r} is not supported ({_supported()})")
        vocab = f.get("tokenizer.ggml.tokens", ARRAY)
        spm = model == "llama"
        n = len(vocab)

        def token_id(key: str, default: int | None = None) -> int | None:
            tid = f.get(key, int, None)
            if tid is None and default is not None and default < n:
                return default
            return tid

        role_ids = {role: tid for role, key in ROLE_KEYS.items() if (tid := token_id(key)) is not None}
        kwargs = dict(token_types=f.get("tokenizer.ggml.token_type", ARRAY, None),
                      bos_id=token_id("tokenizer.ggml.bos_token_id", 1 if spm else None),
                      eos_id=token_id("tokenizer.ggml.eos_token_id", 2 if spm else None),
                      add_bos=bool(f.get("tokenizer.ggml.add_bos_token", bool, spm)),
                      add_eos=bool(f.get("tokenizer.ggml.add_eos_token", bool, False)), model=model,
                      role_ids=role_ids)
        if spm:
            kwargs.update(scores=f.get("tokenizer.ggml.scores", ARRAY, None),
                          add_space_prefix=bool(f.get("tokenizer.ggml.add_space_prefix", bool, True)))
        else:
            kwargs.update(merges=f.get("tokenizer.ggml.merges", ARRAY), pre=f.get("tokenizer.ggml.pre", str, "default"))
        try:
            return cls(vocab, **kwargs)
        except GGXFormatError as e:
            raise GGXFormatError(f"{f.path}: {e}") from None

    @property
    def eog_ids(self) -> frozenset[int]:
        """The ids that end generation, as llama.cpp's special_eog_ids: EOS, EOT and EOM, the
        fill-in-the-middle pad/repo/separator tokens, and every token whose text is an
        end-of-turn marker ("<|im_end|>", "<end_of_turn>", "<|endoftext|>", "</s>", ...)."""
        return self._eog

    def tokenize(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`, special tokens parsed; BOS first / EOS last only when the file (or caller) asks."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids` (invalid UTF-8 replaced); `skip_special` leaves control and unknown tokens out.

        For SPM this is llama.cpp's detokenize (special tokens removed: no): the tokens' bytes
        joined, one leading space taken off the first token's when the vocabulary adds a space prefix.
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise GGXFormatError(f"token ids {bad[:5]} are outside the vocabulary of {self.n_vocab}")
        if self.model == "gpt2":
            return self._tok.decode(ids, skip_special_tokens=skip_special)
        out = []
        for n, i in enumerate(ids):
            if skip_special and i in self._hidden:
                continue
            piece = self._spm_bytes(i)
            if n == 0 and self.add_space_prefix and piece[:1] == b" ":
                piece = piece[1:]
            out.append(piece)
        return b"".join(out).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (special tokens as their text): for streaming partial UTF-8.

        SPM: "▁" is a space, `<0xXX>` byte tokens their byte, unused tokens nothing (llama.cpp's token_to_piece).
        """
        if not 0 <= token_id < self.n_vocab:
            raise GGXFormatError(f"token id {token_id} is outside the vocabulary of {self.n_vocab}")
        if self.model == "llama":
            return self._spm_bytes(token_id)
        if token_id in self.special_ids:
            return self.vocab[token_id].encode()
        return bytes(_BYTE_DECODER[ch] for ch in self.vocab[token_id] if ch in _BYTE_DECODER)

    def _spm_bytes(self, token_id: int) -> bytes:
        if token_id in self.special_ids:
            return self.vocab[token_id].encode()
        kind = self._types[token_id]
        if kind == TOKEN_TYPE_NORMAL:
            return self.vocab[token_id].replace(_ESCAPED_SPACE, _SPACE).encode()
        if kind == TOKEN_TYPE_BYTE:
            return bytes((self._byte_value[token_id],))
        return b""  # unused and undefined tokens: llama.cpp renders them as nothing


def _supported() -> str:
    return "ggx has " + ", ".join(f"{name!r} ({what})" for name, what in SUPPORTED_MODELS.items())


def _numbers(values: Sequence, n: int, what: str, key: str, kinds: str, noun: str) -> np.ndarray:
    """A GGUF array of n numbers (numpy kinds `kinds`) as a 1-D numpy array; GGXFormatError naming
    `tokenizer.ggml.<key>` for a wrong count, strings, or arrays of arrays (ragged or not)."""
    if len(values) != n:
        raise GGXFormatError(f"{len(values)} {what} for {n} tokens")
    try:
        arr = np.asarray(values)
    except ValueError:  # arrays of different lengths
        arr = None
    if arr is None or arr.ndim != 1 or (n and arr.dtype.kind not in kinds):
        found = f", not {arr.dtype}" if arr is not None and arr.ndim == 1 else ""
        raise GGXFormatError(f"tokenizer.ggml.{key} must be an array of {noun}{found}")
    return arr


def _llama_cpp_specials(vocab: list[str], types: np.ndarray, eos_id: int | None,
                        role_ids: dict[str, int]) -> tuple[set[int], frozenset[int], int | None]:
    """llama.cpp's load_vocab special-token pass, in its order: (ids made control by their text,
    end-of-generation ids, EOT id). Edits `types` where llama.cpp resets a token's attribute."""
    # the last id of each text, as llama.cpp's text -> id map
    found = _KNOWN_TEXTS.intersection(vocab)
    backwards = vocab[::-1] if found else []
    by_text = {t: len(vocab) - 1 - backwards.index(t) for t in found}
    control: set[int] = set()
    for role, texts in _ROLE_TEXTS.items():
        if role not in role_ids:
            tid = next((by_text[t] for t in texts if t in by_text), None)
            if tid is not None:
                role_ids[role] = tid
                control.add(tid)
    eog = {role_ids[r] for r in ("fim_pad", "fim_rep", "fim_sep") if r in role_ids}
    for t in _EOG_TEXTS:
        if t in by_text:
            eog.add(by_text[t])
            control.add(by_text[t])
    for t in _USER_DEFINED_TEXTS:
        if t in by_text:
            types[by_text[t]] = TOKEN_TYPE_USER_DEFINED
            control.discard(by_text[t])
    eog |= {i for i in (eos_id, role_ids.get("eot"), role_ids.get("eom")) if i is not None}

    def demote(text: str, kind: int) -> None:
        for i in [i for i in eog if vocab[i] == text]:
            eog.discard(i)
            control.discard(i)
            types[i] = kind

    texts = {vocab[i] for i in eog}
    # harmony and solar-open: <|end|> ends a message there, not the generation (llama.cpp's workaround)
    if "<|end|>" in texts and texts & {"<|call|>", "<|calls|>"} and texts & {"<|return|>", "<|flush|>"}:
        demote("<|end|>", TOKEN_TYPE_USER_DEFINED)
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:  # gemma4 and plamo: </s> is text
        demote("</s>", TOKEN_TYPE_NORMAL)
    return control, frozenset(eog), role_ids.get("eot")


# Polynomial hashes modulo two primes below 2**31 (a residue times a base stays below 2**62 in
# uint64), joined into one 62-bit key per string.
_HASH_MODS = (2147483647, 2147483629)
_HASH_BASES = (1000003, 911382323)
_BUCKET_BITS = 20  # about four buckets per key of a 262k vocabulary: most lookups read one
_VECTOR_WIDTH = 64  # tokens up to this many characters are split with numpy, the (rare) longer ones in Python


def _spm_merges(vocab: list[str], score: np.ndarray, index: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SPM bigram merging: every split of a token into two
    tokens, highest-scoring whole token first.

    A pair of adjacent symbols merges in llama.cpp exactly when its concatenation is a token, and
    the merged token's score decides the order; ranking the splits by that score lets BPE make the
    same merges. Splits are found for all tokens at once: every prefix and suffix is hashed with
    numpy and looked up among the tokens' hashes (a Python loop over the 1.5M splits of a 262k
    vocabulary took over 2 s). Hits are not compared character by character (that took a third
    of the time): equal lengths and two 31-bit hashes make a false one about as likely as 1 in
    10^10 for a whole vocabulary, and the worst it could do is rank one merge wrongly, which a
    file can do anyway through its scores (a merge whose halves make no token fails in BPE)."""
    n = len(vocab)
    lens = np.fromiter(map(len, vocab), dtype=np.int64, count=n)
    # all the tokens' code points end to end: one character is one UTF-32 unit
    chars = np.frombuffer("".join(vocab).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    offset = np.cumsum(lens) - lens
    canonical = np.zeros(n, dtype=bool)  # the id llama.cpp's text -> id map keeps for each text
    canonical[np.fromiter(index.values(), dtype=np.int64, count=len(index))] = True
    whole, left, right, at = [], [], [], []

    width = int(min(lens.max(initial=0), _VECTOR_WIDTH))
    short = np.flatnonzero(lens <= width)
    if width >= 2 and len(short):
        rows = short[np.argsort(-lens[short], kind="stable")]  # longest first: rows longer than k are a prefix
        rlen, roff = lens[rows], offset[rows]
        at_least = [int(np.count_nonzero(rlen >= k)) for k in range(width + 2)]
        hashes = [np.zeros(len(rows), dtype=np.uint64) for _ in _HASH_MODS]
        prefix: list[list[np.ndarray]] = [[] for _ in _HASH_MODS]  # [mod][k - 1]: hash of the first k characters
        for k in range(1, width + 1):
            a = at_least[k]
            col = chars[roff[:a] + (k - 1)].astype(np.uint64)
            for h, p, b, pre in zip(hashes, _HASH_MODS, _HASH_BASES, prefix):
                h[:a] = (h[:a] * np.uint64(b) + col) % np.uint64(p)
                pre.append(h[:a].copy())
        # each row stopped updating at its own length: `hashes` now hold the whole tokens' hashes
        powers = [np.array([pow(b, j, p) for j in range(width + 1)], dtype=np.uint64)
                  for p, b in zip(_HASH_MODS, _HASH_BASES)]
        find = _KeySet((hashes[0] << np.uint64(31)) | hashes[1]).find
        whole_ok = canonical[rows]
        for k in range(1, width):
            a = at_least[k + 1]  # rows with more than k characters
            if a == 0:
                break
            hit, lpos = find((prefix[0][k - 1][:a] << np.uint64(31)) | prefix[1][k - 1][:a])
            r = np.flatnonzero(hit & whole_ok[:a])
            lp = lpos[r]
            keep = rlen[lp] == k
            r, lp = r[keep], lp[keep]
            # the suffixes' hashes only where the prefix is a token: fewer lookups
            suf = []
            for h, p, pw, pre in zip(hashes, _HASH_MODS, powers, prefix):
                shifted = (pre[k - 1][r] * pw[rlen[r] - k]) % np.uint64(p)
                suf.append((h[r] + np.uint64(p) - shifted) % np.uint64(p))
            hit, rp = find((suf[0] << np.uint64(31)) | suf[1])
            keep = hit & (rlen[rp] == rlen[r] - k)
            whole.append(rows[r[keep]])
            left.append(rows[lp[keep]])
            right.append(rows[rp[keep]])
            at.append(np.full(np.count_nonzero(keep), k))
    extra: list[tuple[int, int, int, int]] = []
    for i in np.flatnonzero((lens > width) & canonical).tolist():
        t = vocab[i]
        for k in range(1, len(t)):
            a = index.get(t[:k])
            if a is not None and (b := index.get(t[k:])) is not None:
                extra.append((i, a, b, k))
    if extra:
        for dst, col in zip((whole, left, right, at), np.array(extra, dtype=np.int64).T):
            dst.append(col)
    if not whole:
        return []
    whole_ids, left_ids, right_ids, ks = (np.concatenate(x) for x in (whole, left, right, at))
    # rank: the whole token's score, highest first (as llama.cpp's queue), then by id, split point
    rank = np.lexsort((ks, whole_ids, -score[whole_ids].astype(np.float64)))
    # the pairs point at the vocabulary's own strings, picked through an object array: no list of
    # a million Python ints on the way (half a million merges of a 262k vocabulary)
    strings = np.empty(n, dtype=object)
    strings[:] = vocab
    return list(zip(strings[left_ids[rank]].tolist(), strings[right_ids[rank]].tolist()))


class _KeySet:
    """Membership of hash keys, vectorized: the keys, scrambled (times an odd constant, a bijection
    of uint64: polynomial hashes of short strings crowd together), sorted and split into buckets by
    their top bits, so a lookup reads a bucket or two instead of binary-searching."""

    _MIX = np.uint64(0x9E3779B97F4A7C15)

    def __init__(self, keys: np.ndarray):
        mixed = keys * self._MIX
        self.order = np.argsort(mixed, kind="stable")
        self.keys = mixed[self.order]
        self.shift = np.uint64(64 - _BUCKET_BITS)
        counts = np.bincount((self.keys >> self.shift).astype(np.int64), minlength=2 ** _BUCKET_BITS)
        self.starts = np.concatenate(([0], np.cumsum(counts)))

    def find(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, index of the key in the original array) for each query key."""
        query = query * self._MIX
        bucket = (query >> self.shift).astype(np.int64)
        pos, end = self.starts[bucket], self.starts[bucket + 1]
        found = np.zeros(len(query), dtype=bool)
        where = np.zeros(len(query), dtype=np.int64)
        todo = np.flatnonzero(pos < end)
        while len(todo):
            p = pos[todo]
            hit = self.keys[p] == query[todo]
            found[todo[hit]] = True
            where[todo[hit]] = self.order[p[hit]]
            todo = todo[~hit]
            pos[todo] += 1
            todo = todo[pos[todo] < end[todo]]
        return found, where


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
