"""The architectures ggx runs: a table from `general.architecture` to the module that runs it.

An architecture is three functions (llama.cpp's llama_model_<arch>: load_arch_hparams,
load_arch_tensors, the graph builder), written in its own module on the shared blocks of
ggx.models.blocks:

- `read_hparams(f)`: the file's metadata as HParams, checked (GGXFormatError names the key);
- `expected_tensors(hp)`: every tensor the graph reads, with its ggml-order ne;
- `build(ctx, hp, weights, cache, shape, flash_attn)`: the logits of one batch and its inputs.

Adding one: write models/<arch>.py defining `ARCH = Architecture(...)`, and list it in
`ARCHITECTURES` below (docs/architecture.md, "Model architectures").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import GGXFormatError
from ..graph import Context
from ..tensor import Tensor
from .blocks import BatchShape, ModelInputs
from .gguf_file import GGUFFile
from .hparams import HParams, check_tensors
from .kv_cache import KVCache

BuildGraph = Callable[[Context, HParams, dict[str, Tensor], KVCache, BatchShape, bool], tuple[Tensor, ModelInputs]]


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    read_hparams: Callable[[GGUFFile], HParams]
    expected_tensors: Callable[[HParams], dict[str, tuple[int, ...]]]
    build: BuildGraph


def _table() -> dict[str, Architecture]:
    from . import gemma3, llama, qwen2, qwen3, qwen3moe

    return {a.name: a for a in (llama.ARCH, gemma3.ARCH, qwen2.ARCH, qwen3.ARCH, qwen3moe.ARCH)}


ARCHITECTURES: dict[str, Architecture] = _table()


def architecture(name: str, where: str = "") -> Architecture:
    """The architecture called `name`; GGXFormatError naming it and the supported ones otherwise."""
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise GGXFormatError(f"{where + ': ' if where else ''}architecture {name!r} is not supported "
                             f"(ggx runs {', '.join(sorted(ARCHITECTURES))})")
    return arch


def read_hparams(f: GGUFFile) -> tuple[Architecture, HParams]:
    """The file's architecture and its hyper-parameters, checked against the file's tensors."""
    arch = architecture(f.get("general.architecture", str), str(f.path))
    hp = arch.read_hparams(f)
    check_tensors(f, arch.expected_tensors(hp))
    return arch, hp
