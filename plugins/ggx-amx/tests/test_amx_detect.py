"""Detection and registration: this host's answer, a CPU without the AMX flags (never asked for
the permission), a refused tile permission, a usable AMX (registration only: nothing runs), the
emulation switch, and what `ggx devices` shows in each case."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ggx_cpu.extension as cpu_ext
from ggx import registry
from ggx.errors import GGXUnsupported
from ggx_amx import plugin
from ggx_amx.detect import ENV_EMULATE, amx_mode
from ggx_amx.tiles import engine

AMX_FLAGS = frozenset({"amx-tile", "amx-int8", "amx-bf16"})
TILE_STATE = (1 << 17) | (1 << 18) | 0b111  # XCR0: XTILECFG, XTILEDATA, x87/SSE/AVX
REFUSED = "arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: Operation not permitted"


@pytest.fixture
def no_emulation(monkeypatch):
    monkeypatch.delenv(ENV_EMULATE, raising=False)


def status(have: frozenset[str], xcr0: int, asked: list):
    """A `support` callable: ggx-cpu's decision for a host with these flags and XCR0, whose
    permission request is refused (and recorded in `asked`)."""
    def refuse():
        asked.append(1)
        return REFUSED
    return lambda: cpu_ext.amx_status(have, xcr0, refuse)


def test_this_host(no_emulation):
    usable, why = cpu_ext.amx_support()
    mode = amx_mode()
    assert mode.engine == ("amx" if usable else None) and mode.reason == why
    assert mode.note == (f"AMX: {why}" if usable else f"AMX not available: {why}")


def test_a_cpu_without_amx_is_never_asked_for_the_permission(no_emulation):
    asked = []
    mode = amx_mode(status(frozenset({"avx512f", "avx512vnni"}), TILE_STATE, asked))
    assert (mode.engine, mode.reason) == (None, "this CPU lacks amx-tile, amx-int8, amx-bf16") and not asked
    mode = amx_mode(status(AMX_FLAGS, 0b111, asked))  # the OS left the tile state off
    assert mode.engine is None and "XTILECFG, XTILEDATA off in XCR0" in mode.reason and not asked


def test_a_refused_permission_registers_nothing(no_emulation, monkeypatch, cpu):
    asked = []
    monkeypatch.setattr(cpu_ext, "amx_support", status(AMX_FLAGS, TILE_STATE, asked))
    assert amx_mode().engine is None and asked
    assert plugin.ggx_extra_buffer_types(cpu) is None
    assert plugin.backend_reg().note == f"AMX not available: {REFUSED}"
    with pytest.raises(GGXUnsupported, match="cannot run here: arch_prctl"):
        engine("amx")  # nothing can compile or run a tile instruction


def test_usable_amx_registers_the_amx_type_first(no_emulation, monkeypatch, cpu):
    monkeypatch.setattr(cpu_ext, "amx_support", lambda: (True, "AMX tiles enabled"))
    ((prio, buft),) = plugin.ggx_extra_buffer_types(cpu)
    assert (prio, buft.name, buft.engine) == (plugin.PRIORITY_AMX, "AMX", "amx")
    assert plugin.backend_reg().note == "AMX: AMX tiles enabled"
    assert plugin.ggx_extra_buffer_types(registry.get_device("ref")) is None  # ggx-cpu's CPU device only
    assert plugin.backend_reg().devices() == []


def test_the_emulation_says_so(monkeypatch, cpu):
    monkeypatch.setenv(ENV_EMULATE, "1")
    monkeypatch.setattr(cpu_ext, "amx_support", lambda: (False, "this CPU lacks amx-tile, amx-int8, amx-bf16"))
    mode = amx_mode()
    assert mode.engine == "emulated"
    assert mode.note.startswith("AMX emulated (GGX_AMX_EMULATE=1, for testing only)") and "lacks amx-tile" in mode.note
    ((_, buft),) = plugin.ggx_extra_buffer_types(cpu)
    assert buft.name == "AMX_EMULATED"
    monkeypatch.setenv(ENV_EMULATE, "0")
    assert amx_mode().engine is None


def devices(emulate: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_EMULATE}
    if emulate:
        env[ENV_EMULATE] = "1"
    run = subprocess.run([sys.executable, "-m", "ggx.cli", "devices", "--json"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_ggx_devices_shows_the_state():
    usable, why = cpu_ext.amx_support()
    for emulate in (False, True):
        report = devices(emulate)
        (amx,) = [p for p in report["plugins"] if p["name"] == "amx"]
        (cpu,) = [d for d in report["devices"] if d["name"] == "CPU"]
        extra = [b["name"] for b in cpu["extra_buffer_types"]]
        assert amx["status"] == "loaded" and amx["distribution"] == "ggx-amx"
        if emulate:
            assert amx["reason"].startswith("AMX emulated (GGX_AMX_EMULATE=1, for testing only)")
            assert extra[0] == "AMX_EMULATED"
        elif usable:
            assert amx["reason"] == f"AMX: {why}" and extra[0] == "AMX"
        else:
            assert amx["reason"] == f"AMX not available: {why}"
            assert not any(name.startswith("AMX") for name in extra)
