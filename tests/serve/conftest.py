"""Fixtures: the default model (SmolLM2) served by an app started in this process, for the tests
that talk to it with the real `openai` client."""
from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from serve_helpers import CTX_PER_SLOT, Server, start_server

from ggx.models import load_model


@pytest.fixture(scope="session")
def serve_model():
    return load_model(None, n_ctx=CTX_PER_SLOT)


@pytest.fixture(scope="module")
def server(serve_model) -> Iterator[Server]:
    srv, stop = start_server(serve_model)
    yield srv
    stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
