"""Scripts of benchmarks/ imported by the tests that share their code (the file generators, the
kept references' format and bounds)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module. Its sibling imports (synthetic_llama) resolve while it
    loads only: benchmarks/ stays off sys.path afterwards, since its ray.py would shadow Ray's
    package for every later `import ray` in the session."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return mod
