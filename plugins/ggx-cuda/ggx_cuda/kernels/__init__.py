"""The CUDA C++ sources of ggx-cuda (compiled at run time with NVRTC through CuPy, lazily; what
they share is common.cuh, included from this folder) and, per source, every kernel instantiation
the planners launch (the name expressions NVRTC lowers). A family module adds its source's names
with `names(source, [...])`."""
from __future__ import annotations

NAME_EXPRESSIONS: dict[str, list[str]] = {}


def names(source: str, expressions: list[str]) -> None:
    NAME_EXPRESSIONS.setdefault(source, [])
    for e in expressions:
        if e not in NAME_EXPRESSIONS[source]:
            NAME_EXPRESSIONS[source].append(e)
