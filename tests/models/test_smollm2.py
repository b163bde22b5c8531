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

import numpy as np
import pytest

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


def _margin(step: dict) -> float:
    top = step["top"]
    return top[0][1] - top[1][1]


def _logits_one_pass(model, case) -> np.ndarray:
    """Logits of every golden step from one forward pass over prompt + generated ids."""
    ids = case["prompt_ids"] + case["gen_ids"]
    logits = model.forward(ids)
    assert logits.shape == (len(ids), model.n_vocab) and logits.dtype == np.float32
    p = len(case["prompt_ids"])
    return logits[p - 1: p - 1 + len(case["steps"])]


def _logits_as_decoded(model, case) -> np.ndarray:
    """Logits of every golden step as llama.cpp made them: the prompt, then one golden token at a time."""
    model.reset()
    rows = [model.eval(case["prompt_ids"])[-1]]
    for token in case["gen_ids"][: len(case["steps"]) - 1]:
        rows.append(model.eval([token])[-1])
    return np.stack(rows)


def _teacher_forced(model, cases, flash_attn: bool, step_logits) -> tuple[float, float, int]:
    model.flash_attn = flash_attn
    diffs, checked = [], 0
    try:
        for case in cases:
            logits = step_logits(model, case)
            for s, step in enumerate(case["steps"]):
                row = logits[s]
                diffs.extend(abs(float(row[i]) - v) for i, v in step["top"])
                if _margin(step) >= MARGIN:
                    checked += 1
                    assert int(row.argmax()) == step["top"][0][0], f"{case['prompt']!r} step {s}"
    finally:
        model.flash_attn = True
    worst, mean = max(diffs), float(np.mean(diffs))
    print(f"\nteacher forcing on {[d.name for d in model.runner.devices]}, flash_attn={flash_attn}, "
          f"{step_logits.__name__}: max |diff| {worst:.3f}, mean {mean:.3f} over {len(diffs)} logits; "
          f"argmax checked at {checked}")
    return worst, mean, checked


def test_teacher_forced_logits_agree_with_llama_cpp(model, cases, record_property):
    worst, mean, checked = _teacher_forced(model, cases, False, _logits_one_pass)
    record_property("max_logit_diff", worst)
    record_property("mean_logit_diff", mean)
    assert worst <= MAX_DIFF and mean <= MEAN_DIFF
    assert checked > 20


def test_teacher_forced_flash_attention_as_decoded(model, cases, record_property):
    worst, mean, checked = _teacher_forced(model, cases, True, _logits_as_decoded)
    record_property("max_logit_diff_flash", worst)
    record_property("mean_logit_diff_flash", mean)
    assert worst <= MAX_DIFF and mean <= MEAN_DIFF
    assert checked > 20


def test_greedy_generation_matches_up_to_first_near_tie(model, cases):
    for case in cases:
        steps = case["steps"]
        n = max(1, next((s for s, st in enumerate(steps) if _margin(st) < NEAR_TIE), len(steps)))
        got = [t.id for t in model.generate(case["prompt_ids"], max_tokens=n, stop_at_eos=False)]
        assert got == case["gen_ids"][:n], case["prompt"]
        assert model.detokenize(got) == model.detokenize(case["gen_ids"][:n])
        if n == len(steps):
            assert model.detokenize(got) == case["text"]
