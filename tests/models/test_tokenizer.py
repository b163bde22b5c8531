"""The tokenizer built from the GGUF vocabulary agrees with llama.cpp's on every golden string."""
from __future__ import annotations

import pytest

from ggx.errors import GGXFormatError
from ggx.models import GGUFFile, Tokenizer


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_path))


def test_golden_strings(smollm2_tok, golden_tokenize):
    assert len(golden_tokenize) >= 10
    for case in golden_tokenize:
        assert smollm2_tok.tokenize(case["text"]) == case["ids"], case["text"]
        assert smollm2_tok.detokenize(case["ids"]) == case["text"]


def test_golden_prompts_and_generations(smollm2_tok, golden_greedy):
    for case in golden_greedy:
        assert smollm2_tok.tokenize(case["prompt"]) == case["prompt_ids"]
        assert smollm2_tok.detokenize(case["gen_ids"]) == case["text"]


def test_no_bos_special_tokens_parsed(smollm2_tok):
    assert not smollm2_tok.add_bos and smollm2_tok.bos_id == 1
    assert smollm2_tok.tokenize("Hi")[0] != smollm2_tok.bos_id
    ids = smollm2_tok.tokenize("<|im_start|>assistant<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids[1:-1] == smollm2_tok.tokenize("assistant")
    assert smollm2_tok.detokenize(ids, skip_special=True) == "assistant"
    assert smollm2_tok.tokenize("Hi", add_bos=True)[0] == 1


def test_token_bytes_stream_utf8(smollm2_tok):
    ids = smollm2_tok.tokenize("日本語 🙂")
    assert b"".join(smollm2_tok.token_bytes(i) for i in ids).decode("utf-8") == "日本語 🙂"


def test_out_of_range_ids(smollm2_tok):
    with pytest.raises(GGXFormatError, match="outside the vocabulary"):
        smollm2_tok.detokenize([49152])


def test_bad_merges():
    with pytest.raises(GGXFormatError, match="BPE"):
        Tokenizer(["a", "b"], ["a c"], None)
    with pytest.raises(GGXFormatError, match="BPE"):  # the merged token is missing
        Tokenizer(["a", "b"], ["a b"], None)
    with pytest.raises(GGXFormatError, match="two space-separated"):
        Tokenizer(["a", "b"], ["ab"], None)


def test_bpe_tables_are_built_at_the_first_tokenize():
    """A process given token ids never pays the `tokenizers` build; the first tokenize does."""
    tok = Tokenizer(["a", "b", "ab", "Ġ"], ["a b"], None)
    assert tok.build_s == 0.0
    assert tok.token_bytes(2) == b"ab" and tok.eog_ids == frozenset()
    assert tok.build_s == 0.0
    assert tok.tokenize("ab") == [2]
    assert tok.build_s > 0.0
