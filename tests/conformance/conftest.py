"""Shared pieces for the conformance suite's own tests."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ggx.reference import RefBackendReg

# tests/sched_device.py (the scheduler's test device) lives one directory up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def ref_device():
    return RefBackendReg().devices()[0]
