"""driver.py's rules that need no GPU."""
from __future__ import annotations

import pytest

from ggx_cuda.driver import driver_runs


@pytest.mark.parametrize("driver, runtime, runs", [
    (13000, 13020, True),   # an older minor version of the same major: CUDA's minor version compatibility
    (13020, 13020, True),
    (13000, 12080, True),   # a newer driver runs older runtimes
    (12080, 13000, False),  # an older major version does not
])
def test_driver_runs(driver, runtime, runs):
    assert driver_runs(driver, runtime) is runs
