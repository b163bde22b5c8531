"""Fixtures for the model tests: tiny synthetic llama GGUF files (dense and MoE) written with
gguf.GGUFWriter, and the real SmolLM2 file with llama.cpp's golden outputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_synth import write_tiny_llama

DATA = Path(__file__).resolve().parent.parent / "data"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-moe.gguf", n_expert=4, n_expert_used=2,
                            wtype="Q4_0", seed=1)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from ggx.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The Gemma 3 270M Q4_K_M file, assembled once into the model cache (the package is
    installed by ./dev.sh test: a missing one fails here, it is not skipped)."""
    from ggx.models.catalog import KNOWN_MODELS

    return KNOWN_MODELS["gemma3"].path()


@pytest.fixture(scope="session")
def gemma3_golden_greedy() -> list[dict]:
    with open(DATA / "gemma3_q4_k_m_greedy.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="session")
def gemma3_golden_tokenize() -> list[dict]:
    return json.loads((DATA / "gemma3_tokenize.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def golden_greedy() -> list[dict]:
    with open(DATA / "smollm2_q4_1_greedy.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="session")
def golden_tokenize() -> list[dict]:
    return json.loads((DATA / "smollm2_tokenize.json").read_text(encoding="utf-8"))
