"""Teacher-forced comparison with llama.cpp's golden outputs (../data/*_greedy.jsonl), shared by
the real-model tests: feed prompt_ids + gen_ids, compare the logits of llama.cpp's listed top-10
ids at every generated position, and check ggx's argmax wherever llama.cpp's top-2 margin is
at least `margin`."""
from __future__ import annotations

import numpy as np


def margin(step: dict) -> float:
    top = step["top"]
    return top[0][1] - top[1][1]


def logits_one_pass(model, case) -> np.ndarray:
    """Logits of every golden step from one forward pass over prompt + generated ids."""
    ids = case["prompt_ids"] + case["gen_ids"]
    logits = model.forward(ids)
    assert logits.shape == (len(ids), model.n_vocab) and logits.dtype == np.float32
    p = len(case["prompt_ids"])
    return logits[p - 1: p - 1 + len(case["steps"])]


def logits_as_decoded(model, case) -> np.ndarray:
    """Logits of every golden step as llama.cpp made them: the prompt, then one golden token at a time."""
    model.reset()
    rows = [model.eval(case["prompt_ids"])[-1]]
    for token in case["gen_ids"][: len(case["steps"]) - 1]:
        rows.append(model.eval([token])[-1])
    return np.stack(rows)


def teacher_forced(model, cases, flash_attn: bool, step_logits, min_margin: float) -> tuple[float, float, int]:
    """(max |diff|, mean |diff|, argmaxes checked) over `cases`; asserts each checked argmax."""
    model.flash_attn = flash_attn
    diffs, checked = [], 0
    try:
        for case in cases:
            logits = step_logits(model, case)
            for s, step in enumerate(case["steps"]):
                row = logits[s]
                diffs.extend(abs(float(row[i]) - v) for i, v in step["top"])
                if margin(step) >= min_margin:
                    checked += 1
                    assert int(row.argmax()) == step["top"][0][0], f"{case['prompt'][:60]!r} step {s}"
    finally:
        model.flash_attn = True
    worst, mean = max(diffs), float(np.mean(diffs))
    print(f"\nteacher forcing on {[d.name for d in model.runner.devices]}, flash_attn={flash_attn}, "
          f"{step_logits.__name__}: max |diff| {worst:.3f}, mean {mean:.3f} over {len(diffs)} logits; "
          f"argmax checked at {checked}")
    return worst, mean, checked


def greedy_prefix_matches(model, cases, near_tie: float) -> None:
    """Greedy generation gives llama.cpp's tokens up to the first near-tie (top-2 margin below
    `near_tie`), where a correct implementation may pick the other token."""
    for case in cases:
        steps = case["steps"]
        n = max(1, next((s for s, st in enumerate(steps) if margin(st) < near_tie), len(steps)))
        got = [t.id for t in model.generate(case["prompt_ids"], max_tokens=n, stop_at_eos=False)]
        assert got == case["gen_ids"][:n], case["prompt"][:60]
        assert model.detokenize(got) == model.detokenize(case["gen_ids"][:n])
        if n == len(steps):
            assert model.detokenize(got) == case["text"]
