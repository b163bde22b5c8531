"""`ggx serve`'s API with the real `openai` client: chat, completion, streaming, stop sequences,
concurrent clients, a client that goes away, and every kind of bad input answered in OpenAI's
error shape without stopping the server."""
from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from serve_helpers import CTX_PER_SLOT, MAX_BODY, N_SLOTS, Reply, Stream, request, start_server

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def greedy_text(model, prompt_ids, n: int) -> str:
    """What the one-sequence Model generates greedily (the reference for the server)."""
    return "".join(t.text for t in model.generate(prompt_ids, n))


def test_chat_completion_is_the_models_greedy_answer(server, client):
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6, temperature=0)
    ids = server.model.tokenize(server.model.chat_template.render(CHAT))
    assert r.choices[0].message.content == greedy_text(server.model, ids, 6)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 6
    assert r.usage.total_tokens == len(ids) + 6 and r.object == "chat.completion"


def test_completion_with_logprobs(server, client):
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2)
    ids = server.model.tokenize("The capital of France is")
    c = r.choices[0]
    assert c.text == greedy_text(server.model, ids, 4) and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == 4 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
    # greedy: the chosen token is the likeliest of the top alternatives
    for tok, lp, top in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(lp) and tok in top
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 4


def test_streaming_equals_the_whole_answer(client):
    whole = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    done = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=5, temperature=0, stream=True))
    assert done == client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=5,
                                             temperature=0).choices[0].text


def test_stop_sequences_end_the_text_before_them(server, client):
    cancelled = server.engine.counters.requests_cancelled
    full = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    want = text[:text.index(stop)]
    r = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                  stop=[stop, "never appears"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert server.engine.counters.requests_cancelled == cancelled  # a stop is not a client going away


def test_concurrent_clients_get_their_one_at_a_time_answers(client):
    prompts = [[{"role": "user", "content": "Name a fruit."}], [{"role": "user", "content": "Say hello in French."}]]
    alone = [client.chat.completions.create(model="smollm2", messages=p, max_tokens=8, temperature=0)
             .choices[0].message.content for p in prompts]
    got: dict[int, str] = {}
    barrier = threading.Barrier(len(prompts))

    def ask(i: int) -> None:
        barrier.wait()
        got[i] = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2", messages=prompts[i], max_tokens=8, temperature=0, stream=True) if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got.get(i) for i in range(len(prompts))] == alone


def test_seeded_sampling_repeats(client):
    kw = dict(model="smollm2", prompt="My favourite colour is", max_tokens=6, temperature=0.9, top_p=0.95, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def _wait(pred, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_a_client_that_disconnects_frees_its_slot(server):
    engine = server.engine
    cancelled = engine.counters.requests_cancelled
    body = {"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0,
            "stream": True}
    s = Stream(server.url + "/v1/completions", body)
    try:
        assert s.status_code == 200
        assert any(line.startswith("data: ") for line in s.lines(4))
        assert engine.slots_busy == 1
    finally:
        s.close()
    assert _wait(lambda: engine.slots_busy == 0)
    assert engine.counters.requests_cancelled == cancelled + 1
    assert engine.counters.generated_tokens < 400 + 100  # it did not run to the end
    assert request(server.url + "/health").json()["slots_idle"] == N_SLOTS


def test_too_many_requests_are_queued_then_refused_with_retry_after(server):
    body = {"model": "smollm2", "prompt": "Count to one hundred:", "max_tokens": 300, "temperature": 0,
            "stream": True}
    streams = []
    try:
        for _ in range(N_SLOTS + 1):  # every slot, and one more waiting in the queue (MAX_QUEUE = 1)
            streams.append(Stream(server.url + "/v1/completions", body))
            assert streams[-1].status_code == 200
        r = request(server.url + "/v1/completions", "POST", json.dumps(body))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_busy"
    finally:
        for s in streams:
            s.close()
    assert _wait(lambda: server.engine.slots_busy == 0 and server.engine.queued == 0)
    assert request(server.url + "/health").json()["status"] == "ok"


def _post(server, path: str, content: bytes | str) -> Reply:
    return request(server.url + path, "POST", content)


def _is_error(r: Reply, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in r.text
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    return err


BAD_BODIES = [
    ('{"model": "x", "prompt": "hi"', 400, None),  # malformed JSON
    ("[1, 2]", 400, None),
    ('{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),  # wrong type, not coerced
    ('{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    ('{"prompt": "hi", "unknown_field": 1}', 400, "unknown_field"),
    ('{"prompt": "hi", "n": 2}', 400, "n"),
    ('{"prompt": ""}', 400, "prompt"),  # empty
    ('{"prompt": [-1]}', 400, None),
    ('{"prompt": [999999999]}', 400, "prompt"),  # outside the vocabulary
    ('{"prompt": "hi", "max_tokens": 100000}', 400, "max_tokens"),  # beyond the context
    ('{"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop"),
]


@pytest.mark.parametrize("body,status,param", BAD_BODIES)
def test_bad_completion_requests_get_openai_errors(server, body, status, param):
    _is_error(_post(server, "/v1/completions", body), status, param)


def test_bad_chat_requests_and_routes(server):
    _is_error(_post(server, "/v1/chat/completions", '{"messages": []}'), 400, "messages")
    _is_error(_post(server, "/v1/chat/completions", '{"messages": [{"role": "robot", "content": "x"}]}'), 400)
    _is_error(_post(server, "/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}'), 400)
    long = json.dumps({"messages": [{"role": "user", "content": "word " * (CTX_PER_SLOT * 2)}]})
    assert len(long) < MAX_BODY
    assert _is_error(_post(server, "/v1/chat/completions", long), 400)["code"] == "context_length_exceeded"
    _is_error(_post(server, "/v1/completions", json.dumps({"prompt": "x" * (MAX_BODY + 1)})), 413)
    _is_error(request(server.url + "/v1/nothing"), 404)
    _is_error(request(server.url + "/v1/completions"), 405)
    # and it still serves
    assert request(server.url + "/health").json()["status"] == "ok"


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    health = request(server.url + "/health").json()
    assert health["status"] == "ok" and health["slots_idle"] + health["slots_processing"] == N_SLOTS
    text = request(server.url + "/metrics").text
    values = dict(line.split() for line in text.splitlines() if line and not line.startswith("#"))
    assert float(values["ggx_requests_total"]) >= 1 and float(values["ggx_generated_tokens_total"]) >= 1
    assert float(values["ggx_slots_total"]) == N_SLOTS and float(values["ggx_decode_tokens_per_second"]) > 0
    assert float(values["ggx_prompt_tokens_per_second"]) > 0


def test_api_key_guards_every_route_but_health(serve_model, server):
    srv, stop = start_server(serve_model, api_key="sekret")
    try:
        anon = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anon.models.list()
        _is_error(request(srv.url + "/metrics"), 401)
        _is_error(_post(srv, "/v1/completions", "{not json"), 401)  # the key is checked first
        assert request(srv.url + "/health").status_code == 200
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model="m", prompt="Hi", max_tokens=1, temperature=0).usage.completion_tokens == 1
    finally:
        stop()
