"""SmolLM2-135M-Instruct Q4_1 end to end against llama.cpp's golden outputs.

Runs on the default devices (the CPU plugin when installed; the reference backend otherwise,
then on two prompts only, as ref is slow). Teacher forcing on prompt_ids + gen_ids, the logits of
llama.cpp's top-10 ids compared at every generated position, two ways:

- the soft_max attention path, all tokens in one forward pass;
- the flash-attention path (the model's default) the way llama.cpp produced the golden file: the
  prompt as one batch, then each golden token fed alone through the KV cache. ggml's CPU flash
  attention rounds Q and the V accumulator to F16 below 64 tokens, and so does ggx-cpu's; fed the
  same batches, the two round alike.

Thresholds (the issue's): |diff| <= 1.0 and mean <= 0.25 over those logits, argmax equal
wherever llama.cpp's top-2 margin is >= 0.5.
"""
from __future__ import annotations

import pytest
from golden_compare import greedy_prefix_matches, logits_as_decoded, logits_one_pass, teacher_forced

from ggx.models import load_model

MAX_DIFF, MEAN_DIFF, MARGIN = 1.0, 0.25, 0.5
# greedy generation must match up to the first near-tie: a step whose top-2 margin is below the
# margin at which the argmax is checked (ref flips a 0.26 margin, llama.cpp moves margins by 0.27)
NEAR_TIE = MARGIN


@pytest.fixture(scope="module")
def model(smollm2_path):
    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def cases(model, golden_greedy):
    on_ref = all(d.name == "ref" for d in model.runner.devices)
    return golden_greedy[:2] if on_ref else golden_greedy


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


def test_greedy_generation_matches_up_to_first_near_tie(model, cases):
    greedy_prefix_matches(model, cases, NEAR_TIE)
