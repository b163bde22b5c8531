"""Continuous batching (ggx.models.batched): several sequences in one cache, one decode graph per
step, each sequence's tokens and logits independent of its neighbours."""
from __future__ import annotations

import numpy as np
import pytest
from gguf_synth import write_tiny_gemma3

from ggx.errors import GGXContextOverflow, GGXStateError, GGXValueError
from ggx.models import load_model
from ggx.models.batched import Batcher


def serve(b: Batcher, prompts, max_tokens: int, join_every: int = 0, **kw):
    """Run prompts through `b` (all at once, or one joining every `join_every` steps): per prompt
    its tokens and the logits of each."""
    waiting, slots, logits = list(prompts), [], {}
    steps = 0
    while waiting or b.busy:
        if waiting and (not join_every or steps % join_every == 0):
            for p in (waiting if not join_every else waiting[:1]):
                slots.append(b.add(p, max_tokens, **kw))
            waiting = [] if not join_every else waiting[1:]
        for e in b.step():
            if e.token is not None:
                logits.setdefault(id(e.sequence), []).append(e.logits.copy())
        steps += 1
    return [s.generated for s in slots], [np.array(logits[id(s)]) for s in slots]


def _prompts(n_vocab: int, lengths, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, n_vocab, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return load_model(tiny_llama, devices=["ref"], n_ctx=512)


@pytest.mark.parametrize("flash_attn", [True, False])
def test_sequences_are_batch_invariant_and_match_one_sequence_runs(tiny, tiny_llama, flash_attn):
    if not flash_attn:  # the mul_mat + soft_max attention path, per sequence as well
        tiny = load_model(tiny_llama, devices=["ref"], n_ctx=512, flash_attn=False)
    prompts = _prompts(tiny.n_vocab, (5, 23, 9))
    b = Batcher(tiny, n_seq=3, n_ctx=3 * 256, n_chunk=8, decode_rows=3)
    together = serve(b, prompts, 6)
    staggered = serve(b, prompts, 6, join_every=2)
    for i, p in enumerate(prompts):
        alone = serve(b, [p], 6)
        assert together[0][i] == alone[0][0] == staggered[0][i]
        np.testing.assert_array_equal(together[1][i], alone[1][0])
        np.testing.assert_array_equal(staggered[1][i], alone[1][0])
        # and they are the logits of the sequence run through the one-sequence Model
        want = tiny.forward(p + together[0][i][:-1])[len(p) - 1:]
        np.testing.assert_allclose(together[1][i], want, rtol=0, atol=1e-4 * np.abs(want).max())
        assert [t.id for t in tiny.generate(p, 6, stop_at_eos=False)] == together[0][i]


def test_a_removed_sequence_frees_its_slot_and_leaves_the_others_alone(tiny):
    prompts = _prompts(tiny.n_vocab, (7, 12), seed=3)
    b = Batcher(tiny, n_seq=2, n_ctx=512, decode_rows=2)
    alone = serve(b, [prompts[1]], 8)
    s0, s1 = b.add(prompts[0], 8), b.add(prompts[1], 8)
    with pytest.raises(GGXStateError, match="all 2 sequences"):
        b.add(prompts[0], 1)
    for _ in range(3):
        b.step()
    b.remove(s0)
    assert s0.finish_reason == "removed" and b.n_free == 1
    s2 = b.add(prompts[0], 2)  # joins at the next step
    while b.busy:
        b.step()
    assert s1.generated == alone[0][0] and s1.finish_reason == "max_tokens" and len(s2.generated) == 2


def test_bad_requests_are_refused_before_anything_runs(tiny):
    b = Batcher(tiny, n_seq=2, n_ctx=64)
    with pytest.raises(GGXContextOverflow, match="context of 32"):
        b.add(list(range(1, 40)), 1)
    with pytest.raises(GGXValueError, match="temperature"):
        b.add([1, 2], 1, temperature=-1.0)
    with pytest.raises(GGXValueError, match="cannot be split"):
        Batcher(tiny, n_seq=8, n_ctx=4)
    assert not b.busy
    s = b.add([1, 2, 3], 100, stop_at_eos=False)
    while b.busy:
        b.step()
    assert s.finish_reason == "context_full" and len(s.generated) == 32 - 3 + 1


def test_sliding_window_sequences_wrap_their_own_rings(tmp_path):
    """Gemma 3's iSWA cache, one ring per sequence: past the ring's 256 slots each sequence's
    logits are still those of the one-sequence Model with a full cache."""
    path = write_tiny_gemma3(tmp_path / "g.gguf")
    m = load_model(path, devices=["ref"], n_ctx=600, n_batch=16, swa_full=True)
    b = Batcher(m, n_seq=2, n_ctx=1200, n_chunk=16, decode_rows=2)
    assert b.cache.swa.size < b.n_ctx_seq
    prompts = _prompts(m.n_vocab, (270, 250), seed=5)
    toks, logits = serve(b, prompts, 12, join_every=3)
    for p, t, lg in zip(prompts, toks, logits):
        want = m.forward(p + t[:-1])[len(p) - 1:]
        np.testing.assert_allclose(lg, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_smollm2_on_cpu_is_bit_identical_with_neighbours(smollm2_path):
    """The real model on the default devices: logits bit-identical whatever shares the steps,
    tokens equal to Model.generate's."""
    m = load_model(smollm2_path, n_ctx=256)
    # short prompts of one bucket, so that few graphs are made (each costs its first compute)
    prompts = [m.tokenize(t) for t in ("The capital of France is", "One, two, three,")]
    b = Batcher(m, n_seq=2, n_ctx=2 * 256, n_chunk=8, decode_rows=2)
    together = serve(b, prompts, 5)
    staggered = serve(b, prompts, 5, join_every=2)
    for i, p in enumerate(prompts):
        alone = serve(b, [p], 5)
        np.testing.assert_array_equal(together[1][i], alone[1][0])
        np.testing.assert_array_equal(staggered[1][i], alone[1][0])
        assert together[0][i] == [t.id for t in m.generate(p, 5)]


def test_one_slot(tiny):
    b = Batcher(tiny, n_seq=1, n_ctx=256)
    s = b.add([5, 6, 7], 3, stop_at_eos=False)
    while b.busy:
        b.step()
    assert s.generated == [t.id for t in tiny.generate([5, 6, 7], 3, stop_at_eos=False)]


def test_a_long_prompt_is_fed_in_chunks_while_the_others_keep_generating(tiny):
    prompts = _prompts(tiny.n_vocab, (4, 60), seed=9)
    b = Batcher(tiny, n_seq=2, n_ctx=512, n_chunk=8, decode_rows=2)
    a = b.add(prompts[0], 20, stop_at_eos=False)
    b.step()  # a's prompt, its first token
    long = b.add(prompts[1], 2, stop_at_eos=False)
    steps = 0
    while long.prefilling:
        events = b.step()
        steps += 1
        assert a in [e.sequence for e in events if e.token is not None]  # a token for a every step
    assert steps == 60 // 8 + 1 and long.n_fed == 60
