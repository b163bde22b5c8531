"""Fixtures for ggx.compare's tests: a tiny synthetic llama (tests/models/gguf_synth.py) and the
scheduler's asynchronous test device (tests/sched_device.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
for d in (TESTS, TESTS / "models", TESTS / "conformance"):
    sys.path.insert(0, str(d))

from gguf_synth import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("compare") / "tiny-llama.gguf")
