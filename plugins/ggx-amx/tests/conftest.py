"""Fixtures: the session's CPU device, and a second ggx-cpu CPU device whose extra buffer types were
asked with GGX_AMX_EMULATE=1, so it holds AMX_EMULATED (the session's own CPU device never sees
that variable: its list is made first, and the variable is set only while the second one's is).

With ggx-amx disabled (GGX_DISABLE_PLUGINS), as for a machine without it installed, its own
tests are skipped, saying so; every other test of the suite runs."""
from __future__ import annotations

from pathlib import Path

import pytest

from ggx import registry
from ggx_amx.buffer import AmxBufferType
from ggx_amx.detect import ENV_EMULATE


def amx_disabled() -> bool:
    """Whether ggx-amx's entry point was left out of the registry by the environment."""
    return any(p.distribution == "ggx-amx" and p.status == registry.DISABLED for p in registry.plugins())


def pytest_collection_modifyitems(items) -> None:
    if not amx_disabled():
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="ggx-amx is disabled by GGX_DISABLE_PLUGINS: these tests are the plugin's own")
    for item in items:
        if here in item.path.parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cpu():
    return registry.get_device("CPU")


@pytest.fixture(scope="session")
def amx_cpu(cpu):
    registry.extra_buffer_types(cpu)
    dev = type(cpu)(cpu.reg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_EMULATE, "1")
        bufts = registry.extra_buffer_types(dev)
    assert [b.name for b in bufts][:1] == ["AMX_EMULATED"], bufts
    return dev


@pytest.fixture(scope="session")
def amx_buft(amx_cpu) -> AmxBufferType:
    return registry.extra_buffer_types(amx_cpu)[0]


@pytest.fixture(scope="session")
def amx_backend(amx_cpu):
    return amx_cpu.init_backend(n_threads=2)
