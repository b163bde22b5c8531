"""load_model's weights by override, by a (made-up) measured profile, or by priority: the placement
report says which and names the figures. No timing: the profiles are made up."""
import pytest

from ggx import registry
from ggx.errors import GGXUnsupported, GGXValueError
from ggx.models import load_model
from ggx.tune import Profile


def _cpu_bufts() -> list[str]:
    try:
        cpu = registry.get_device("CPU")
    except Exception:  # noqa: BLE001 - without ggx-cpu there is no CPU device to choose for
        return []
    return [b.name for b in registry.extra_buffer_types(cpu) if not b.emulated]


def _placed(m) -> dict[str, str]:
    return {n: t.buffer.buft.name for n, t in m.weights.items()}


@pytest.fixture(scope="module")
def repack_first():
    bufts = _cpu_bufts()
    if "CPU_REPACK" not in bufts:
        pytest.skip("needs ggx-cpu with ggx-repack installed (the CPU's extra buffer type)")
    if bufts[0] != "CPU_REPACK":
        pytest.skip(f"{bufts[0]} comes before CPU_REPACK on this machine")


def _profile(repack_s: float, cpu_s: float) -> Profile:
    """Q4_1 (the tiny model's matrices) timed made-up: CPU_REPACK and plain CPU at both batches."""
    timings = {}
    for buft, s in (("CPU_REPACK", repack_s), ("CPU", cpu_s)):
        timings[(buft, "Q4_1", 1)] = s
        timings[(buft, "Q4_1", 512)] = 100 * s
    return Profile({"cpu": "made up"}, 2, timings, created="test")


def test_no_profile_is_the_priority_order(tiny_llama, repack_first):
    m = load_model(tiny_llama, devices=["CPU"], n_ctx=64, warmup=False, tune_profile=False)
    assert _placed(m)["blk.0.ffn_down.weight"] == "CPU_REPACK"
    assert m.placement.basis == "priority order (measured choice turned off)"


def test_a_profile_where_plain_memory_is_faster_moves_the_weights(tiny_llama, repack_first):
    m = load_model(tiny_llama, devices=["CPU"], n_ctx=64, warmup=False, tune_profile=_profile(3e-4, 1e-4))
    placed = _placed(m)
    q41 = [n for n, t in m.weights.items() if t.type.name == "Q4_1"]
    assert q41 and all(placed[n] == "CPU" for n in q41)
    cpu = next(u for u in m.placement.bufts if u.name == "CPU")
    assert "Q4_1 3.00x CPU_REPACK" in cpu.notes and "Q4_1 3.00x CPU_REPACK" in cpu.describe()
    repack = next(u for u in m.placement.bufts if u.name == "CPU_REPACK")
    if not repack.n_tensors:  # nothing else went there: unused, with the measured reason
        assert repack.skipped.startswith("CPU_REPACK 0.33x CPU for Q4_1 on this CPU (batch 1: 0.33x")
    assert m.placement.basis == "tune profile of test, 2 threads"
    assert len([t.id for t in m.generate("Hello", 3, stop_at_eos=False)]) == 3


def test_a_profile_inside_the_margin_changes_nothing(tiny_llama, repack_first):
    m = load_model(tiny_llama, devices=["CPU"], n_ctx=64, warmup=False, tune_profile=_profile(1.05e-4, 1e-4))
    assert _placed(m)["blk.0.ffn_down.weight"] == "CPU_REPACK"


def test_overrides_win_over_the_profile(tiny_llama, repack_first):
    m = load_model(tiny_llama, devices=["CPU"], n_ctx=64, warmup=False, tune_profile=_profile(3e-4, 1e-4),
                   buft_overrides={r"blk\.1\.ffn_down": "CPU_REPACK"})
    placed = _placed(m)
    assert placed["blk.1.ffn_down.weight"] == "CPU_REPACK" and placed["blk.0.ffn_down.weight"] == "CPU"
    repack = next(u for u in m.placement.bufts if u.name == "CPU_REPACK")
    assert repack.notes == (r"forced by blk\.1\.ffn_down=CPU_REPACK",)


def test_bad_overrides_are_refused_before_loading(tiny_llama, repack_first):
    with pytest.raises(GGXValueError, match="no candidate buffer type 'NOPE'"):
        load_model(tiny_llama, devices=["CPU"], n_ctx=64, warmup=False, buft_overrides=["ffn_down=NOPE"])
    with pytest.raises(GGXUnsupported, match="CPU_REPACK cannot hold .*attn_norm"):
        load_model(tiny_llama, devices=["CPU"], n_ctx=64, warmup=False, buft_overrides=["attn_norm=CPU_REPACK"])


def test_run_names_the_override_and_the_basis(tiny_llama, repack_first, capsys):
    from ggx.cli import main

    assert main(["run", str(tiny_llama), "--device", "CPU", "-p", "hi", "-n", "2",
                 "-ot", r"blk\.0\.ffn_down=CPU"]) == 0
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("weights in:")]
    assert "CPU " in line and r"forced by blk\.0\.ffn_down=CPU" in line
    assert line.endswith("(by priority order (GGX_TUNE_PROFILE=off))")  # the tests' setting (conftest.py)
    assert main(["run", str(tiny_llama), "--device", "CPU", "-ot", "(=CPU"]) == 2
    assert "not a regular expression" in capsys.readouterr().err


def _q8_profile(repack_s: float, cpu_s: float, repack_prompt_s: float, cpu_prompt_s: float) -> Profile:
    """Q8_0 (the tiny model's embedding, so its tied output matrix) timed made-up at both batches."""
    return Profile({"cpu": "made up"}, 2, {("CPU_REPACK", "Q8_0", 1): repack_s, ("CPU", "Q8_0", 1): cpu_s,
                                           ("CPU_REPACK", "Q8_0", 512): repack_prompt_s,
                                           ("CPU", "Q8_0", 512): cpu_prompt_s}, created="test")


@pytest.mark.parametrize("batch1_ratio, copied", [(1.3, False), (2.0, True)])
def test_a_tied_output_is_held_once_unless_a_copy_is_much_faster(tiny_llama, repack_first, batch1_ratio, copied):
    """The output matrix is the embedding itself (in its plain buffer type) unless another buffer
    type computes it COPY_MARGIN faster; a prompt reads it for one row, so only batch 1 counts
    (a 10x faster 512-row product changes nothing)."""
    m = load_model(tiny_llama, devices=["CPU"], n_ctx=64, warmup=False,
                   tune_profile=_q8_profile(1e-4, batch1_ratio * 1e-4, 1e-3, 1e-2))
    out, embd = m.weights["output.weight"], m.weights["token_embd.weight"]
    assert (out is not embd) == copied
    assert out.buffer.buft.name == ("CPU_REPACK" if copied else embd.buffer.buft.name)
    assert len(list(m.generate("Hello", 2, stop_at_eos=False))) == 2


def test_without_a_profile_the_tied_output_follows_the_priority_order(tiny_llama, repack_first):
    m = load_model(tiny_llama, devices=["CPU"], n_ctx=64, warmup=False, tune_profile=False)
    assert m.weights["output.weight"].buffer.buft.name == "CPU_REPACK"
