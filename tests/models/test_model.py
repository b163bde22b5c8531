"""The Model API on a tiny synthetic llama (reference backend): one sequence per model (stale
generators raise), calls from threads, why generation stopped, prompts that do not fit, sampling
settings."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ggx.errors import GGXContextOverflow, GGXStateError, GGXValueError
from ggx.models import STOP_REASONS, load_model

PROMPT = [5, 70, 71, 72, 3, 200, 33]


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(tiny_llama, devices=["ref"], n_ctx=256)


def greedy(model, prompt, n):
    return [t.id for t in model.generate(prompt, n, stop_at_eos=False)]


def test_a_second_generator_makes_the_first_stale(model):
    want = greedy(model, PROMPT, 4)
    first = model.generate(PROMPT, 4, stop_at_eos=False)
    assert next(first).id == want[0]
    second = model.generate([9, 8, 7], 4, stop_at_eos=False)
    next(second)
    with pytest.raises(GGXStateError, match="stale: another generate"):
        next(first)
    assert [t.id for t in second] != []  # the second one goes on undisturbed
    again = model.generate(PROMPT, 4, stop_at_eos=False)
    assert [t.id for t in again] == want


@pytest.mark.parametrize("use", ["eval", "forward", "reset"])
def test_eval_forward_or_reset_make_an_open_generator_stale(model, use):
    gen = model.generate(PROMPT, 4, stop_at_eos=False)
    next(gen)
    {"eval": lambda: model.eval([3, 4]), "forward": lambda: model.forward([3]), "reset": model.reset}[use]()
    with pytest.raises(GGXStateError, match=rf"{use}\(\)"):
        next(gen)


def test_a_finished_generator_does_not_raise(model):
    gen = model.generate(PROMPT, 1, stop_at_eos=False)
    next(gen)
    model.eval([3])
    assert list(gen) == []


@pytest.mark.parametrize("device", ["ref", "CPU"])
def test_calls_from_threads_are_serialized(tiny_llama, device):
    model = load_model(tiny_llama, devices=[device], n_ctx=256)
    seqs = [PROMPT, [9, 8, 7, 6], [100, 101], [44] * 5]
    want = [model.forward(s) for s in seqs]
    got: list = [None] * 8
    errors = []

    def work(i):
        try:
            for _ in range(3):
                got[i] = model.forward(seqs[i % 4])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(8):
        np.testing.assert_array_equal(got[i], want[i % 4])


def test_stop_reasons(model):
    st = model.stats
    gen = greedy(model, PROMPT, 3)
    assert st.stop_reason == "max_tokens" and st.generated == len(gen) == 3 and st.gen_tokens == 2
    list(model.generate(PROMPT, 0))
    assert st.stop_reason == "max_tokens" and st.generated == 0
    model.eog_ids = {gen[1]}
    try:
        assert [t.id for t in model.generate(PROMPT, 3)] == gen[:1]
        assert st.stop_reason == "eos" and st.generated == 1
    finally:
        model.eog_ids = {model.tokenizer.eos_id}
    full = [3] * (model.n_ctx - 2)
    out = greedy(model, full, 10)
    assert len(out) == 3 and st.stop_reason == "context_full"  # 2 evaluated + the last one sampled
    gen = model.generate(PROMPT, 3)
    next(gen)
    assert st.stop_reason is None and set(STOP_REASONS) == {"eos", "max_tokens", "context_full"}


def test_a_prompt_longer_than_the_context_is_refused_before_anything_runs(model):
    model.forward(PROMPT)
    n_past = model.cache.n_past
    too_long = [3] * (model.n_ctx + 1)
    with pytest.raises(GGXContextOverflow, match=f"{model.n_ctx + 1} tokens.*{model.n_ctx}") as e:
        model.generate(too_long)  # raised by the call, not by the first next()
    assert (e.value.n_tokens, e.value.n_ctx) == (model.n_ctx + 1, model.n_ctx)
    with pytest.raises(GGXContextOverflow):
        model.encode_prompt(too_long)
    assert model.cache.n_past == n_past
    assert model.encode_prompt([3] * model.n_ctx) == [3] * model.n_ctx
    with pytest.raises(GGXContextOverflow) as e:
        model.eval([3] * (model.n_ctx - n_past + 1))
    assert (e.value.n_past, e.value.n_ctx) == (n_past, model.n_ctx)


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"), ({"max_tokens": -5}, "max_tokens"),
])
def test_bad_sampling_settings_are_refused_at_the_call(model, kwargs, match):
    with pytest.raises(GGXValueError, match=match):
        model.generate(PROMPT, **kwargs)


def test_token_ids_must_be_integers(model):
    from ggx.errors import GGXShapeError

    with pytest.raises(GGXShapeError, match="integers"):
        model.eval(np.array([1.5, 2.0]))
    with pytest.raises(GGXValueError, match="n_ctx"):
        load_model(model.path, devices=["ref"], n_ctx=-4)


@pytest.mark.parametrize("idle_s", [0.0, None])
def test_prompts_and_a_batcher_while_buckets_are_prepared_in_the_background(tiny_llama, monkeypatch, idle_s):
    """Right after the load (the prompt buckets still being prepared by a thread, one slowed
    step at a time, as soon as the runner is free or only once it was left alone a while: the
    default), prompts of every bucket from two threads and a Batcher's steps run between the
    steps and give what a model prepared at load gives; afterwards every bucket is kept and
    nothing failed."""
    from ggx.models import model as model_module
    from ggx.models.batched import Batcher
    from ggx.models.model import Model, prompt_bucket

    if idle_s is not None:
        monkeypatch.setattr(model_module, "PREPARE_WHEN_IDLE_S", idle_s)

    want_model = load_model(tiny_llama, devices=["CPU"], n_ctx=256, background=False)
    seqs = [list(range(3, 3 + n)) for n in (2, 7, 13, 30, 61, 100, 127)]
    want = [want_model.forward(s) for s in seqs]
    steps: list[bool] = []  # per background step: whether a prompt had already run
    prompts_run = threading.Event()
    prepare = Model._prepare_bucket

    def slow_prepare(self, n):
        prepare(self, n)
        steps.append(prompts_run.is_set())
        threading.Event().wait(0.01)  # inside the step: callers queue behind it

    monkeypatch.setattr(Model, "_prepare_bucket", slow_prepare)
    m = load_model(tiny_llama, devices=["CPU"], n_ctx=256)
    got: list = [None] * len(seqs)
    errors: list = []

    def work(first):
        try:
            for i in range(first, len(seqs), 2):
                got[i] = m.forward(seqs[i])
                prompts_run.set()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher = Batcher(m, n_seq=2, n_ctx=128)
    batcher.add(seqs[1], 3)
    while batcher.busy:
        batcher.step()
    assert not errors
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert m.wait_prepared(120) and m.background_error is None and m.background_s is not None
    assert True in steps, "some bucket was prepared after a prompt had run"
    kept = {shape.n_tokens for shape, _ in m._graphs}
    assert {prompt_bucket(n) for n in range(2, 129)} <= kept


def test_stopped_preparation_leaves_the_rest_to_the_first_use(tiny_llama):
    m = load_model(tiny_llama, devices=["CPU"], n_ctx=256)
    m.stop_preparing()
    assert m.wait_prepared(0)
    want = load_model(tiny_llama, devices=["CPU"], n_ctx=256, background=False)
    np.testing.assert_array_equal(m.forward(list(range(3, 60))), want.forward(list(range(3, 60))))


def test_the_interpreter_exits_cleanly_while_buckets_are_prepared(tiny_llama):
    """The load returns with the preparation under way; exiting at once stops it first (a
    thread left inside LLVM while the process tears it down could crash the exit)."""
    import subprocess
    import sys

    code = ("import sys; from ggx.models import load_model; "
            "m = load_model(sys.argv[1], devices=['CPU'], n_ctx=256); "
            "print('running' if not m.wait_prepared(0) else 'done')")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_llama)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() in ("running", "done")
