"""The SentencePiece ("llama") tokenizer agrees with llama.cpp: on the Gemma 3 golden strings, on a
port of llama.cpp's SPM merge loop (the reference below), and on small synthetic vocabularies."""
from __future__ import annotations

import heapq
import json
import random
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggx.errors import GGXFormatError, GGXUnsupported
from ggx.models import GGUFFile, Tokenizer
from ggx.models.tokenizer import _spm_merges

_GEMMA_GOLDEN = json.loads((Path(__file__).resolve().parent.parent / "data" / "gemma3_tokenize.json")
                           .read_text(encoding="utf-8"))


def llama_cpp_spm(text: str, index: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's llm_tokenizer_spm_session.tokenize on one fragment (spaces already escaped):
    the reference the tokenizers-built BPE is checked against."""
    syms = list(text)
    nxt = list(range(1, len(syms))) + [-1]
    prv = list(range(-1, len(syms) - 1))
    queue: list[tuple[float, int, int, int]] = []
    rev_merge: dict[str, tuple[int, int]] = {}

    def try_add(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        merged = syms[left] + syms[right]
        if merged in index:
            # highest score first, then the leftmost pair, as llama.cpp's comparator
            heapq.heappush(queue, (-scores[index[merged]], left, right, len(merged)))
            rev_merge[merged] = (left, right)

    for i in range(1, len(syms)):
        try_add(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
            continue
        syms[left] += syms[right]
        syms[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        try_add(prv[left], left)
        try_add(left, nxt[left])
    # rev_merge keeps symbol indices, but text alone decides the pieces in this port: a symbol's
    # final text is a token unless it is a lone character that is none
    out: list[int] = []
    i = 0 if syms else -1
    while i != -1:
        piece = syms[i]
        if piece in index:
            out.append(index[piece])
        else:
            out.extend(index[f"<0x{b:02X}>"] for b in piece.encode())
        i = nxt[i]
    return out


# a small SPM vocabulary: unknown/control/user-defined tokens, the 256 byte tokens, then pieces
_PIECES = {"▁": -1.0, "a": -2.0, "b": -3.0, "c": -4.0, "d": -5.0, "x": -6.0, "y": -7.0, "z": -8.0,
           "ab": -20.0, "bc": -10.0, "abc": -9.0, "cd": -30.0, "bcd": -11.0, "▁a": -12.0, "▁ab": -13.0,
           "▁b": -14.0, "aa": -15.0, "aaa": -16.0, "▁▁": -17.0, "da": -18.0, "xy": -40.0, "yz": -35.0,
           "▁x": -50.0}
_SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<end_of_turn>", 3), ("<tag>", 4), ("<|im_end|>", 1),
             ("<unused_piece>", 5)]


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = [t for t, _ in _SPECIALS] + [f"<0x{b:02X}>" for b in range(256)] + list(_PIECES)
    scores = [0.0] * (len(_SPECIALS) + 256) + list(_PIECES.values())
    types = [k for _, k in _SPECIALS] + [6] * 256 + [1] * len(_PIECES)
    return tokens, scores, types


def write_spm(path: Path, *, tokens: list | None = None, scores: list | None = None, types: list | None = None,
              model: str = "llama", keys: dict | None = None) -> Path:
    """A vocabulary-only GGUF file (no tensors) holding an SPM tokenizer."""
    base_tokens, base_scores, base_types = _spm_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_array("tokenizer.ggml.tokens", base_tokens if tokens is None else tokens)
    w.add_array("tokenizer.ggml.scores", base_scores if scores is None else scores)
    w.add_array("tokenizer.ggml.token_type", base_types if types is None else types)
    for key, value in (keys or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> Tokenizer:
    """The synthetic vocabulary with llama.cpp's SPM defaults: space prefix, BOS 1 added, EOS 2."""
    return Tokenizer.from_gguf(GGUFFile(write_spm(tmp_path_factory.mktemp("spm") / "spm.gguf")))


def _id(tok: Tokenizer, text: str) -> int:
    return tok.vocab.index(text)


def test_synthetic_defaults(spm):
    assert spm.model == "llama" and spm.add_bos and spm.add_space_prefix and not spm.add_eos
    assert (spm.bos_id, spm.eos_id) == (1, 2)


def test_space_prefix_and_score_order(spm):
    # "bc" outscores "ab", so "abc" is a+bc -> abc; "xyz": yz beats xy and xyz is no token
    assert spm.tokenize("abc") == [1, _id(spm, "▁"), _id(spm, "abc")]
    assert spm.tokenize("xyz", add_bos=False) == [_id(spm, "▁x"), _id(spm, "yz")]
    assert spm.tokenize("ab ab", add_bos=False) == [_id(spm, "▁ab"), _id(spm, "▁ab")]
    # the prefix goes before every fragment that follows a special token, as in llama.cpp
    assert spm.tokenize("a<tag>b</s>ab", add_bos=False) == [
        _id(spm, "▁a"), _id(spm, "<tag>"), _id(spm, "▁b"), 2, _id(spm, "▁ab")]
    assert spm.tokenize("", add_bos=True) == [1]


def test_byte_fallback(spm):
    ids = spm.tokenize("aé", add_bos=False)
    assert ids == [_id(spm, "▁a"), _id(spm, "<0xC3>"), _id(spm, "<0xA9>")]
    assert spm.detokenize(ids) == "aé"
    # text that spells a byte token is merged like any other text, not read as that byte
    assert spm.detokenize(spm.tokenize("<0x41>", add_bos=False)) == "<0x41>"


def test_token_bytes(spm):
    assert spm.token_bytes(_id(spm, "<0x0A>")) == b"\n"
    assert spm.token_bytes(_id(spm, "<0xC3>")) == b"\xc3"
    assert spm.token_bytes(_id(spm, "▁ab")) == b" ab"
    assert spm.token_bytes(1) == b"<s>" and spm.token_bytes(_id(spm, "<tag>")) == b"<tag>"
    assert spm.token_bytes(_id(spm, "<unused_piece>")) == b""  # llama.cpp renders unused tokens as nothing
    with pytest.raises(GGXFormatError, match="outside the vocabulary"):
        spm.token_bytes(spm.n_vocab)


def test_detokenize_like_llama_cpp(spm):
    ids = spm.tokenize("ab c")
    # the first token's leading space goes only when no BOS comes first (llama.cpp's detokenize)
    assert spm.detokenize(ids[1:]) == "ab c"
    assert spm.detokenize(ids) == "<s> ab c"
    assert spm.detokenize(ids, skip_special=True) == " ab c"
    # control tokens are left out, user-defined ones are not
    assert spm.detokenize(spm.tokenize("a<tag>b</s>"), skip_special=True) == " a<tag> b"


def test_eog_and_control_by_text(spm):
    eot, im_end = _id(spm, "<end_of_turn>"), _id(spm, "<|im_end|>")
    assert spm.eog_ids == {2, eot, im_end}
    assert spm.eot_id == im_end  # the first of llama.cpp's end-of-turn texts the vocabulary has
    # "<|im_end|>" is typed normal, but llama.cpp makes it control: parsed, and skipped on request
    assert spm.tokenize("a<|im_end|>", add_bos=False) == [_id(spm, "▁a"), im_end]
    assert spm.detokenize([im_end], skip_special=True) == ""


def test_named_ids_and_flags(tmp_path):
    eot = [t for t, _ in _SPECIALS].index("<end_of_turn>")
    tok = Tokenizer.from_gguf(GGUFFile(write_spm(tmp_path / "k.gguf", keys={
        "tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.eot_token_id": eot,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2})))
    assert tok.eot_id == eot
    assert tok.tokenize("ab c") == [_id(tok, "ab"), _id(tok, "▁"), _id(tok, "c"), 2]
    assert tok.tokenize("ab", add_eos=False) == [_id(tok, "ab")]
    assert tok.detokenize(tok.tokenize("ab c")[:-1]) == "ab c"


def test_matches_llama_cpp_merge_loop(spm):
    index = {t: i for i, t in enumerate(spm.vocab)}
    scores = _spm_vocab()[1]
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("aabbcdxyz é<0x") for _ in range(rng.randrange(0, 14)))
        want = [] if not text else llama_cpp_spm(("▁" + text).replace(" ", "▁"), index, scores)
        assert spm.tokenize(text, add_bos=False) == want, text


def test_merges_are_all_splits():
    """The vectorized derivation finds exactly the splits a plain loop does, longest tokens included."""
    rng = random.Random(1)
    vocab = sorted({"".join(rng.choice("abcé▁") for _ in range(rng.randrange(1, 9))) for _ in range(3000)})
    vocab += ["ab" * 40, "ab" * 39 + "a", "b"]  # longer than the numpy width: the Python path
    index = dict(zip(vocab, range(len(vocab))))
    scores = np.array([-float(i) for i in range(len(vocab))])
    got = _spm_merges(vocab, scores, index)
    want = {(t[:k], t[k:]) for t in vocab for k in range(1, len(t)) if t[:k] in index and t[k:] in index}
    assert set(got) == want and len(got) == len(want)
    rank = [index[a + b] for a, b in got]
    assert rank == sorted(rank)  # scores fall with the id here, so the whole tokens come in id order


# --- the error paths


def test_unsupported_model(tmp_path):
    with pytest.raises(GGXUnsupported, match=r"'bert'.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf(GGUFFile(write_spm(tmp_path / "bert.gguf", model="bert")))


def test_malformed_vocabularies(tmp_path):
    tokens, scores, types = _spm_vocab()
    cases = {
        "scores for": dict(scores=scores[:-1]),
        "scores must be an array of numbers": dict(scores=["x"] * len(tokens)),
        "token types for": dict(types=types[:-1]),
        "must be an array of strings": dict(tokens=list(range(len(tokens)))),
        "not <0xXX>": dict(tokens=tokens[:len(_SPECIALS)] + ["<0xZZ>"] + tokens[len(_SPECIALS) + 1:]),
    }
    for i, (message, kwargs) in enumerate(cases.items()):
        path = write_spm(tmp_path / f"bad{i}.gguf", **kwargs)
        with pytest.raises(GGXFormatError, match=message):
            Tokenizer.from_gguf(GGUFFile(path))
    # arrays of arrays where numbers belong, of different lengths or not: a format error, not numpy's
    ragged = [[1] * (1 + i % 2) for i in range(len(tokens))]
    for message, kwargs in [("token_type must be an array of integers", dict(token_types=ragged)),
                            ("token_type must be an array of integers", dict(token_types=[[1, 1]] * len(tokens))),
                            ("scores must be an array of numbers", dict(scores=ragged))]:
        with pytest.raises(GGXFormatError, match=message):
            Tokenizer(tokens, model="llama", **kwargs)
    path = write_spm(tmp_path / "eot.gguf", keys={"tokenizer.ggml.eot_token_id": len(tokens)})
    with pytest.raises(GGXFormatError, match="eot token id"):
        Tokenizer.from_gguf(GGUFFile(path))


# --- Gemma 3 (262,144 tokens, no space prefix, BOS 2 added)


@pytest.fixture(scope="module")
def gemma(gemma3_path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(gemma3_path))


@pytest.mark.parametrize("case", _GEMMA_GOLDEN, ids=[c["text"][:24] for c in _GEMMA_GOLDEN])
def test_gemma_golden(gemma, case):
    assert gemma.tokenize(case["text"]) == case["ids"]
    assert gemma.detokenize(case["ids"][1:]) == case["text"]
    assert gemma.detokenize(case["ids"]) == "<bos>" + case["text"]
    assert b"".join(gemma.token_bytes(i) for i in case["ids"][1:]) == case["text"].encode()


def test_gemma_golden_prompts_and_generations(gemma, gemma3_golden_greedy):
    for case in gemma3_golden_greedy:
        assert gemma.tokenize(case["prompt"]) == case["prompt_ids"]
        assert gemma.detokenize(case["gen_ids"]) == case["text"]


def test_gemma_flags_and_token_bytes(gemma):
    assert (gemma.bos_id, gemma.eos_id, gemma.add_bos, gemma.add_space_prefix) == (2, 1, True, False)
    assert gemma.token_bytes(gemma.vocab.index("<0x0A>")) == b"\n"
    assert gemma.token_bytes(236743) == b" "  # "▁"
    assert gemma.token_bytes(105) == b"<start_of_turn>" and gemma.token_bytes(107) == b"\n"
    ids = gemma.tokenize("<start_of_turn>user\nHi<end_of_turn>")
    assert gemma.detokenize(ids, skip_special=True) == "user\nHi"


def test_gemma_eog(gemma):
    assert {1, 106} <= gemma.eog_ids and gemma.eot_id == 106
    # llama.cpp also lists "</s>" (for paddleocr) and only drops it for gemma4/plamo vocabularies:
    # Gemma 3's user-defined "</s>" (212) ends generation there too
    assert gemma.eog_ids == {1, 106, 212}


def test_gemma_byte_fallback_and_merge_loop(gemma, gemma3_path):
    rare = "\U0010fffd"  # a private-use character: no token of its own
    assert rare not in gemma.vocab
    ids = gemma.tokenize(rare, add_bos=False)
    assert ids == [gemma.vocab.index(f"<0x{b:02X}>") for b in rare.encode()]
    assert gemma.detokenize(ids) == rare
    index = dict(zip(gemma.vocab, range(gemma.n_vocab)))
    scores = GGUFFile(gemma3_path).get("tokenizer.ggml.scores")
    rng = random.Random(2)
    alphabet = "".join(sorted({ch for c in _GEMMA_GOLDEN for ch in c["text"] if ch not in "\n\t<>"})) + rare
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        if any(gemma.vocab[i] in text for i in gemma.special_ids if len(gemma.vocab[i]) > 1):
            continue  # runs of spaces are user-defined tokens: those texts are not one fragment
        assert gemma.tokenize(text, add_bos=False) == llama_cpp_spm(text.replace(" ", "▁"), index, scores), text


def test_smollm2_eog(smollm2_path):
    tok = Tokenizer.from_gguf(GGUFFile(smollm2_path))
    # <|endoftext|>, <|im_end|> (EOS), and <reponame>, which llama.cpp takes for the FIM repo token
    assert tok.eog_ids == {0, 2, 4}


def test_the_tables_are_built_at_the_first_tokenize(tmp_path):
    """Loading checks the vocabulary but builds no `tokenizers` tables (seconds for Gemma's 262k
    tokens); detokenizing needs none; the first tokenize builds them once, also when several
    threads ask at the same time."""
    import threading

    eager = Tokenizer.from_gguf(GGUFFile(write_spm(tmp_path / "eager.gguf")))
    want = eager.tokenize("the cat sat")
    tok = Tokenizer.from_gguf(GGUFFile(write_spm(tmp_path / "lazy.gguf")))
    assert tok._hf is None
    assert tok.detokenize(want) == eager.detokenize(want) and tok.eog_ids == eager.eog_ids
    assert tok._hf is None and tok.build_s == 0
    results, built = [], set()

    def go():
        results.append(tok.tokenize("the cat sat"))
        built.add(id(tok._hf))

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 4 and len(built) == 1 and want and tok.build_s > 0
