"""Fixtures of the ggx-cuda tests (their helpers are in cuda_testing.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def host_cc() -> None:
    """Skips a test that runs kernels built for the host (cuda_testing.host_build) without g++."""
    from cuda_testing import have_host_compiler

    if not have_host_compiler():
        pytest.skip("no g++: the kernels cannot be compiled for the host")
