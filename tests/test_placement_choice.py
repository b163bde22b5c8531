"""placement.BuftChooser: overrides, the measured order and its margin, the messages. Every profile
here is made up (no timing): the tests check the ordering logic, not a machine's speed."""
import re

import pytest
from test_placement import HostWithExtra

from ggx.errors import GGXUnsupported, GGXValueError
from ggx.graph import Context
from ggx.placement import MARGIN, BuftChooser, PlacementReport, buft_list, parse_buft_overrides
from ggx.tune import DECODE, Profile
from ggx.types import GType


def profile(figures: dict[tuple[str, str], tuple[float, float]]) -> Profile:
    """A profile whose (buft, type) -> (seconds at batch 1, seconds at a 512-token prompt)."""
    timings = {}
    for (buft, t), (tg, pp) in figures.items():
        timings[(buft, t, 1)] = tg
        timings[(buft, t, 512)] = pp
    return Profile({"cpu": "made up"}, 2, timings, created="today")


def matmul(t: GType, name: str = "blk.0.ffn_down.weight"):
    ctx = Context()
    w = ctx.tensor(t, (256, 32), name)
    return w, ctx.mul_mat(w, ctx.tensor(GType.F32, (256, 4)))


@pytest.fixture
def dev():
    return HostWithExtra()


def test_no_profile_keeps_the_priority_order(dev):
    bufts = buft_list([dev])
    assert [b.name for b in bufts] == ["q4only", "hostx"]
    w, op = matmul(GType.Q4_0)
    chooser = BuftChooser()
    assert chooser.select(w, op, bufts) is dev.extra
    assert chooser.basis == "priority order" and not chooser.notes and not chooser.losses


def test_a_candidate_faster_by_more_than_the_margin_wins(dev):
    bufts = buft_list([dev])
    # the workload: one 512-token prompt + DECODE steps
    slow, fast = (1e-3, 0.2), (0.4e-3, 0.1)
    chooser = BuftChooser(profile({("q4only", "Q4_0"): slow, ("hostx", "Q4_0"): fast}))
    w, op = matmul(GType.Q4_0)
    assert chooser.select(w, op, bufts) is dev.buffer_type()
    ratio = (0.2 + DECODE * 1e-3) / (0.1 + DECODE * 0.4e-3)
    assert chooser.notes[id(dev.buffer_type())] == [f"Q4_0 {ratio:.2f}x q4only"]
    loss = chooser.losses[id(dev.extra)]
    assert loss.startswith(f"q4only {1 / ratio:.2f}x hostx for Q4_0 on this CPU (batch 1: 0.40x, "
                           "a 512-token prompt: 0.50x)")
    # the report: the winner's figures on its line, the loser unused with the reason
    report = PlacementReport.of([(w, dev.buffer_type())], bufts, {}, chooser)
    (used,) = report.used
    assert used.name == "hostx" and used.notes == (f"Q4_0 {ratio:.2f}x q4only",)
    (skipped,) = report.skipped
    assert skipped.name == "q4only" and skipped.skipped == loss
    assert "by tune profile of today, 2 threads" in str(report) and f"Q4_0 {ratio:.2f}x q4only" in str(report)


@pytest.mark.parametrize("gain", [1.0, 1.05, 1 + MARGIN * 0.99])
def test_within_the_margin_the_priority_order_stands(dev, gain):
    """Noise cannot flip a choice: a candidate up to MARGIN faster does not displace the first."""
    bufts = buft_list([dev])
    base = (1e-3, 0.2)
    chooser = BuftChooser(profile({("q4only", "Q4_0"): base, ("hostx", "Q4_0"): (1e-3 / gain, 0.2 / gain)}))
    w, op = matmul(GType.Q4_0)
    assert chooser.select(w, op, bufts) is dev.extra
    if gain > 1:
        assert "within the 10% margin: the priority order stands" in chooser.losses[id(dev.buffer_type())]


def test_unmeasured_types_and_ops_keep_the_priority_order(dev):
    bufts = buft_list([dev])
    only_q8 = BuftChooser(profile({("q4only", "Q8_0"): (1.0, 1.0), ("hostx", "Q8_0"): (1e-6, 1e-6)}))
    w, op = matmul(GType.Q4_0)
    assert only_q8.select(w, op, bufts) is dev.extra  # Q4_0 not measured
    half = BuftChooser(profile({("hostx", "Q4_0"): (1e-6, 1e-6)}))  # the priority choice not measured
    assert half.select(w, op, bufts) is dev.extra
    ctx = Context()  # a weight no matmul reads (get_rows): never reordered
    emb = ctx.tensor(GType.Q4_0, (256, 32), "token_embd.weight")
    faster = BuftChooser(profile({("q4only", "Q4_0"): (1.0, 1.0), ("hostx", "Q4_0"): (1e-6, 1e-6)}))
    assert faster.select(emb, ctx.get_rows(emb, ctx.tensor(GType.I32, (4,))), bufts) is dev.buffer_type()
    assert faster.select(w, op, bufts) is dev.buffer_type()


def test_a_measured_candidate_that_refuses_the_weight_is_not_chosen(dev):
    bufts = buft_list([dev])
    chooser = BuftChooser(profile({("hostx", "Q8_0"): (1.0, 1.0), ("q4only", "Q8_0"): (1e-6, 1e-6)}))
    w, op = matmul(GType.Q8_0)  # q4only takes Q4_0 only, however fast it was measured
    assert chooser.select(w, op, bufts) is dev.buffer_type()


def test_overrides_force_a_buffer_type(dev):
    bufts = buft_list([dev])
    fast = profile({("q4only", "Q4_0"): (1e-6, 1e-6), ("hostx", "Q4_0"): (1.0, 1.0)})
    chooser = BuftChooser(fast, ["attn_.*=HOSTX", "ffn_down=q4only"])
    w, op = matmul(GType.Q4_0, "blk.3.attn_qkv.weight")
    assert chooser.select(w, op, bufts) is dev.buffer_type()  # forced, against the profile
    assert chooser.notes[id(dev.buffer_type())] == ["forced by attn_.*=HOSTX"]
    w2, op2 = matmul(GType.Q4_0, "blk.3.ffn_down.weight")
    assert chooser.select(w2, op2, bufts) is dev.extra
    w3, op3 = matmul(GType.Q4_0, "blk.3.ffn_up.weight")  # no pattern matches: the profile decides
    assert chooser.select(w3, op3, bufts) is dev.extra


def test_an_override_that_cannot_hold_the_weight_is_an_error(dev):
    bufts = buft_list([dev])
    w, op = matmul(GType.Q8_0)
    with pytest.raises(GGXUnsupported, match="override ffn=q4only: q4only cannot hold .*Q8_0.*refused MUL_MAT"):
        BuftChooser(None, {"ffn": "q4only"}).select(w, op, bufts)
    with pytest.raises(GGXValueError, match="no candidate buffer type 'AMX' \\(its candidates: q4only, hostx\\)"):
        BuftChooser(None, {"ffn": "AMX"}).select(w, op, bufts)


@pytest.mark.parametrize("bad, message", [
    (["ffn_down"], "expected REGEX=BUFT"),
    (["=CPU"], "expected REGEX=BUFT"),
    (["ffn=  "], "expected REGEX=BUFT"),
    (["(ffn=CPU"], "not a regular expression"),
    ([("ffn",)], "expected \\(REGEX, BUFT\\)"),
    ([(3, "CPU")], "non-empty strings"),
])
def test_malformed_overrides_are_refused(bad, message):
    with pytest.raises(GGXValueError, match=message):
        parse_buft_overrides(bad)


def test_override_forms():
    """A mapping, pairs, or "REGEX=BUFT" strings (several per string, comma-separated, as -ot)."""
    want = [("a.*", "CPU"), ("b=c", "X")]
    for given in ({"a.*": "CPU", "b=c": "X"}, [("a.*", "CPU"), ("b=c", "X")], ["a.*=CPU,b=c=X"],
                  ["a.*=CPU", "b=c=X"]):
        got = parse_buft_overrides(given)
        assert [(p.pattern, n) for p, n in got] == want and all(isinstance(p, re.Pattern) for p, _ in got)
    assert parse_buft_overrides(None) == []
