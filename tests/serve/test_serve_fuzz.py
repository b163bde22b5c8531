"""A bounded fuzz test of the request schema (hypothesis): bodies built from the fields of the
server's own OpenAPI document, each given a value of a random JSON type (or the right type with
random contents), plus unknown fields and bodies that are not JSON. Every answer is 200 or a 4xx
in OpenAI's error shape, never a 5xx, and the server keeps serving."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import Reply, request

json_scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | \
    st.text(max_size=40)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                           "content": st.text(max_size=60) | json_values}), max_size=3)
#: values that often pass validation, so the generation path is fuzzed too (few tokens each)
plausible = {
    "max_tokens": st.integers(-1, 3), "temperature": st.floats(-0.5, 2.5, allow_nan=False),
    "top_p": st.floats(-0.1, 1.1, allow_nan=False), "seed": st.integers(-5, 2**64), "stream": st.booleans(),
    "stop": st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5),
    "logprobs": st.booleans() | st.integers(-1, 6), "top_logprobs": st.integers(-1, 21),
    "prompt": st.text(max_size=80) | st.lists(st.integers(-3, 60000), max_size=6), "messages": messages,
}


def _fields(server, path: str) -> list[str]:
    doc = request(server.url + "/openapi.json").json()
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return sorted(doc["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])


def _bodies(fields: list[str]) -> st.SearchStrategy:
    def value(name: str) -> st.SearchStrategy:
        return (plausible[name] | json_values) if name in plausible else json_values
    known = st.lists(st.sampled_from(fields), unique=True, max_size=len(fields)).flatmap(
        lambda names: st.fixed_dictionaries({n: value(n) for n in names}))
    extra = st.dictionaries(st.text(min_size=1, max_size=8), json_values, max_size=2)
    return st.tuples(known, extra).map(lambda kv: {**kv[0], **kv[1]}) | json_values


def _check(r: Reply) -> None:
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
    assert "Traceback" not in r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_random_requests_get_answers_not_crashes(server, path):
    fields = _fields(server, path)
    assert "max_tokens" in fields
    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(body=_bodies(fields))
    def check(body) -> None:
        if isinstance(body, dict):  # keep each generation short: the fuzzing is of the schema
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(key), int) and body[key] > 3:
                    body[key] = 3
            if "max_completion_tokens" not in body:
                body.setdefault("max_tokens", 2)
        _check(request(server.url + path, "POST", json.dumps(body)))

    @settings(max_examples=20, deadline=None, derandomize=True)
    @given(raw=st.binary(max_size=200))
    def check_raw(raw: bytes) -> None:
        _check(request(server.url + path, "POST", raw))

    check()
    check_raw()
    assert request(server.url + "/health").json()["status"] == "ok"
