"""Fixtures: the CPU device (with CPU_REPACK registered) and a 2-thread backend on it."""
from __future__ import annotations

import pytest

from ggx import registry


@pytest.fixture(scope="session")
def cpu():
    return registry.get_device("CPU")


@pytest.fixture(scope="session")
def cpu_backend(cpu):
    return cpu.init_backend(n_threads=2)
