"""Every CUDA source in ggx_cuda/kernels/ compiles with NVRTC for sm_80 and sm_90 with all the
name expressions its family declares, as CupyDriver compiles it: the source with the CUDA headers
and the kernels folder as include directories (where its #include "..." headers must be), and
sources and declarations match one to one. No GPU needed."""
from __future__ import annotations

from pathlib import Path

import cuda_testing as ct
import pytest

import ggx_cuda.kernels

KERNEL_DIR = Path(ggx_cuda.kernels.__file__).parent
SOURCES = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))


@pytest.fixture(scope="module")
def names() -> dict[str, list[str]]:
    from ggx_cuda.ops import load_all

    load_all()
    return ggx_cuda.kernels.NAME_EXPRESSIONS


def test_sources_and_name_expressions_match(names):
    undeclared = [s for s in SOURCES if not names.get(s)]
    missing = sorted(s for s in names if s not in SOURCES)
    assert not undeclared, f"sources no family declares a name expression of: {undeclared}"
    assert not missing, f"name expressions declared for sources that do not exist in {KERNEL_DIR}: {missing}"


def _quoted_includes(source: str) -> list[tuple[str, str]]:
    """(file, header) for every #include "header" of source and of the headers it includes."""
    found, todo, seen = [], [source], set()
    while todo:
        f = todo.pop()
        if f in seen or not (KERNEL_DIR / f).is_file():
            continue
        seen.add(f)
        for h in ct.includes((KERNEL_DIR / f).read_text(encoding="utf-8")):
            found.append((f, h))
            todo.append(h)
    return found


@pytest.mark.parametrize("arch", ct.ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles(source, arch, names):
    outside = [(f, h) for f, h in _quoted_includes(source) if not (KERNEL_DIR / h).is_file() or "/" in h]
    assert not outside, f"{source}: #include \"...\" of files that are not headers of {KERNEL_DIR}: {outside}"
    exprs = names.get(source)
    if not exprs:
        pytest.fail(f"{source}: no name expressions declared (ggx_cuda.kernels.names)")
    lowered, ptx = ct.compile_source(source, arch)
    assert ptx
    unlowered = [e for e in exprs if not lowered.get(e)]
    assert not unlowered, f"{source} ({arch}): name expressions that do not lower: {unlowered}"
