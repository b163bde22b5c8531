"""ggx.tune: the profile's file, its staleness, which profile a load uses and why; one tiny real tune
(checked for a valid profile, never for its figures)."""
import json

import pytest

from ggx import registry, tune
from ggx.errors import GGXValueError
from ggx.tune import Profile


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tune.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(tune.PROFILE_ENV, raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def host():
    from ggx.placement import host_device

    return host_device()


def made_up(machine: dict) -> Profile:
    return Profile(machine, 2, {("CPU_REPACK", "Q4_0", 1): 1e-4, ("CPU_REPACK", "Q4_0", 512): 1e-2,
                                ("CPU", "Q4_0", 1): 2e-4, ("CPU", "Q4_0", 512): 3e-2},
                   {"AMX_EMULATED": "emulated (its speed means nothing)"}, created="2026-01-02 03:04 UTC")


def test_the_file_round_trips(cache, host):
    p = made_up(tune.machine(host))
    path = p.save()
    assert path == cache / "tune" / "profile.json" == tune.profile_path()
    back = Profile.load(path)
    assert back == p and back.workload_seconds("CPU", "Q4_0") == pytest.approx(3e-2 + tune.DECODE * 2e-4)
    assert back.workload_seconds("CPU", "Q6_K") is None
    assert back.compare("CPU", "CPU_REPACK", "Q4_0").startswith(
        f"{(1e-2 + 128e-4) / (3e-2 + 256e-4):.2f}x CPU_REPACK for Q4_0 on this CPU (batch 1: 0.50x")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format=99), "format 99"),
    (lambda d: d.pop("timings"), "malformed"),
    (lambda d: d["timings"][0].update(seconds=-1), "not a positive number"),
    (lambda d: d["timings"][0].update(seconds="fast"), "malformed"),
])
def test_a_broken_file_is_a_clear_error(cache, host, edit, message):
    data = made_up(tune.machine(host)).to_json()
    edit(data)
    path = cache / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(GGXValueError, match=message):
        Profile.load(path)
    path.write_text("{not json")
    with pytest.raises(GGXValueError, match="cannot read tune profile"):
        Profile.load(path)


@pytest.mark.parametrize("field, value, words", [
    ("cpu", "Another CPU", "the CPU model changed"),
    ("isa", "portable", "the ISA variant changed"),
    ("features", ["avx2"], "the CPU flags changed"),
    ("ggx", "0.0.1", "ggx's version changed"),
])
def test_a_profile_of_another_machine_is_stale(cache, host, field, value, words):
    m = tune.machine(host)
    assert made_up(m).stale(m) is None
    other = dict(m, **{field: value})
    why = made_up(other).stale(m)
    assert why is not None and why.startswith(words)


def test_another_plugin_version_makes_it_stale(cache, host):
    m = tune.machine(host)
    assert m["plugins"], "the loaded plugins' versions are part of the machine"
    name = next(iter(m["plugins"]))
    old = dict(m, plugins=dict(m["plugins"], **{name: "0.0.0-old"}))
    assert f"{name} 0.0.0-old -> {m['plugins'][name]}" in made_up(old).stale(m)
    gone = dict(m, plugins={n: v for n, v in m["plugins"].items() if n != name})
    assert f"{name} absent -> " in made_up(gone).stale(m)


def test_which_profile_a_load_uses_and_why(cache, host, monkeypatch):
    assert tune.profile_for(host) == (None, "priority order (no tune profile for this machine: run `ggx tune`)")
    made_up(dict(tune.machine(host), isa="portable")).save()
    p, why = tune.profile_for(host)
    assert p is None and why.startswith("priority order (the tune profile is stale: the ISA variant changed")
    fresh = made_up(tune.machine(host))
    fresh.save()
    assert tune.profile_for(host) == (fresh, "tune profile of 2026-01-02 03:04 UTC, 2 threads")
    assert tune.profile_for(host, False)[0] is None
    given = made_up({"cpu": "anything"})  # an object is used as it is (tests, notebooks)
    assert tune.profile_for(host, given)[0] is given
    monkeypatch.setenv(tune.PROFILE_ENV, "off")
    assert tune.profile_for(host) == (None, f"priority order ({tune.PROFILE_ENV}=off)")
    other = cache / "elsewhere.json"
    fresh.save(other)
    monkeypatch.setenv(tune.PROFILE_ENV, str(other))
    assert tune.profile_for(host)[0] == fresh
    other.write_text("{broken")  # the machine's own file unreadable: the priority order, saying why
    p, why = tune.profile_for(host)
    assert p is None and why.startswith("priority order (cannot read tune profile")
    with pytest.raises(GGXValueError, match="cannot read tune profile"):  # a file the caller named
        tune.profile_for(host, other)
    fresh.save(other)
    chooser = tune.chooser(host, None, {"ffn": "CPU"})
    assert chooser.costs == fresh and [(p.pattern, n) for p, n in chooser.overrides] == [("ffn", "CPU")]


def test_a_tiny_real_tune_gives_a_valid_profile(cache, host):
    """Timing only proves the figures exist and are positive; which path wins is the machine's."""
    got = []
    p = tune.tune(host, types=["Q4_0", "F32"], shape=(256, 32), prompt=4, budget_s=60,
                  progress=lambda done, total, what: got.append((done, total, what)))
    names = [b.name for b in tune.candidates(host) if not b.emulated]
    takers = [n for n in names if n != "CPU"]
    if takers:  # two candidates take Q4_0: both measured at both batches
        for n in names:
            assert p.seconds(n, "Q4_0", 1) > 0 and p.seconds(n, "Q4_0", 4) > 0
    assert not [k for k in p.timings if k[1] == "F32"]  # one candidate takes F32: nothing to choose
    assert got[-1][0] == got[-1][1] and got[-1][2] == "done" and len(got) >= 2
    assert p.stale(tune.machine(host)) is None and p.n_threads >= 1
    assert Profile.load(p.save()) == p
    assert all(b.name not in {k[0] for k in p.timings} for b in registry.extra_buffer_types(host) if b.emulated)


def test_emulated_types_are_never_timed(cache, host):
    from ggx.host import HostBufferType

    class Emulated(HostBufferType):
        emulated = True

    fake = Emulated(host, name="EMU")
    real = tune.candidates

    def with_emulated(device):
        return [fake, *real(device)]

    mp = pytest.MonkeyPatch()
    mp.setattr(tune, "candidates", with_emulated)
    try:
        p = tune.tune(host, types=["Q4_0"], shape=(256, 32), prompt=4, budget_s=0)
    finally:
        mp.undo()
    assert p.not_timed["EMU"] == "emulated (its speed means nothing)"
    assert p.not_timed["Q4_0"].startswith("out of time") and not p.timings


def test_the_command_saves_and_shows_a_profile(cache, capsys):
    from ggx.cli import main

    assert main(["tune", "--show"]) == 1 and "no tune profile" in capsys.readouterr().err
    assert main(["tune", "--types", "q4_0", "--budget", "0"]) == 0  # nothing timed: out of time
    err = capsys.readouterr().err
    assert f"tune profile: {tune.profile_path()}" in err and "not timed: Q4_0: out of time" in err
    assert main(["tune", "--show"]) == 0
    assert "not timed: Q4_0: out of time" in capsys.readouterr().out
    assert main(["tune", "--types", "q9_9"]) == 2 and "unknown weight type 'q9_9'" in capsys.readouterr().err


def test_devices_says_what_placement_goes_by(cache, host):
    from ggx.commands.devices import collect

    assert collect()["weight_placement"] == "priority order (no tune profile for this machine: run `ggx tune`)"
    made_up(tune.machine(host)).save()
    assert collect()["weight_placement"] == "tune profile of 2026-01-02 03:04 UTC, 2 threads"
    (cache / "tune" / "profile.json").write_text("{broken")
    assert collect()["weight_placement"].startswith("priority order (cannot read tune profile")
