"""Gemma 3 270M Q4_K_M end to end against llama.cpp's golden outputs (tests/data/gemma3_*).

The file's weights are Q5_0, Q8_0, Q4_K and Q6_K; its long prompt (877 tokens) is longer than
the 512-token sliding window, so the window mask and the sliding-window cache matter there.
Teacher forcing as for SmolLM2 (golden_compare): the soft_max path in one forward pass, and the
flash-attention path the way llama.cpp produced the goldens (the prompt as one batch, then one
golden token at a time).

Thresholds (the issue's): over llama.cpp's listed top-10 ids at every position |diff| <= 2.5
and mean <= 0.35; argmax equal wherever llama.cpp's top-2 margin >= 0.5. For scale: an exact
float64 forward differs from llama.cpp by up to 1.36 (mean 0.19), llama.cpp's own activation
rounding amplified through the layers; the wrong RoPE base on sliding layers gives 10+, no
sliding window on the long prompt 7.5.
"""
from __future__ import annotations

import numpy as np
import pytest
from golden_compare import greedy_prefix_matches, logits_as_decoded, logits_one_pass, teacher_forced

from ggx.models import load_model

MAX_DIFF, MEAN_DIFF, MARGIN = 2.5, 0.35, 0.5
NEAR_TIE = MARGIN
LONG = 512  # the sliding window: prompts longer than it test the window


@pytest.fixture(scope="module")
def model(gemma3_path):
    return load_model(gemma3_path)


@pytest.fixture(scope="module")
def cases(model, gemma3_golden_greedy):
    assert any(len(c["prompt_ids"]) > LONG for c in gemma3_golden_greedy)
    on_ref = all(d.name == "ref" for d in model.runner.devices)
    return gemma3_golden_greedy[:1] if on_ref else gemma3_golden_greedy


def test_hparams_are_gemma3s(model):
    hp = model.hp
    assert model.arch.name == "gemma3" and (hp.n_layer, hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv) == \
        (18, 640, 256, 4, 1)
    assert [il for il in range(hp.n_layer) if not hp.is_swa(il)] == [5, 11, 17] and hp.n_swa == 512
    assert (hp.rope_base(0), hp.rope_base(5)) == (10000.0, 1e6)
    assert hp.q_scale == pytest.approx(1 / 16) and hp.embd_scale == pytest.approx(640 ** 0.5) and hp.tied_output


def test_teacher_forced_logits_agree_with_llama_cpp(model, cases, record_property):
    worst, mean, checked = teacher_forced(model, cases, False, logits_one_pass, MARGIN)
    record_property("max_logit_diff", worst)
    record_property("mean_logit_diff", mean)
    assert worst <= MAX_DIFF and mean <= MEAN_DIFF
    assert checked > 20


def test_teacher_forced_flash_attention_as_decoded(model, cases, record_property):
    worst, mean, checked = teacher_forced(model, cases, True, logits_as_decoded, MARGIN)
    record_property("max_logit_diff_flash", worst)
    record_property("mean_logit_diff_flash", mean)
    assert worst <= MAX_DIFF and mean <= MEAN_DIFF
    assert checked > 20


def test_long_prompt_through_the_sliding_window_cache_equals_a_full_cache(gemma3_path, model, cases):
    """The sliding layers keep n_swa + n_batch slots whatever the context; the long prompt's
    logits are those of a cache that keeps everything (swa_full)."""
    long = next(c for c in cases if len(c["prompt_ids"]) > LONG)
    ids = long["prompt_ids"] + long["gen_ids"]
    full = load_model(gemma3_path, n_ctx=model.n_ctx, swa_full=True)
    swa_layer, global_layer = 0, 5
    assert model.cache.k[swa_layer].ne[1] == 1024 and model.cache.k[global_layer].ne[1] == model.n_ctx
    assert full.cache.k[swa_layer].ne[1] == model.n_ctx
    a, b = model.forward(ids), full.forward(ids)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * np.abs(b).max())


def test_greedy_generation_matches_up_to_first_near_tie(model, cases):
    greedy_prefix_matches(model, cases, NEAR_TIE)


def test_chat_prompt_uses_the_files_turn_tokens(model):
    prompt = model.chat_prompt("What is the capital of France?")
    assert prompt == "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    ids = model.encode_prompt(prompt)
    turn = model.tokenizer.vocab.index("<start_of_turn>")
    assert ids[0] == model.tokenizer.bos_id and ids[1] == turn and ids.count(turn) == 2
    # this file is the pretrained model, not the instruction-tuned one: it continues the turn
    # rather than answering it, so only the run itself is checked here
    out = list(model.generate(prompt, max_tokens=8))
    assert out and "".join(t.text for t in out).strip()
    assert model.stats.stop_reason in ("eos", "max_tokens")
    assert {1, 106} <= model.eog_ids  # <eos>, <end_of_turn>
