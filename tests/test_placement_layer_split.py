"""placement.layer_split: llama.cpp's split mode LAYER (contiguous layer ranges in proportion to
tensor_split or free memory, upper_bound on the cumulative shares, the output with the last
layer), and the bad tensor_split values it refuses."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ggx.errors import GGXValueError
from ggx.placement import LayerSplit, check_tensor_split, layer_split, split_fractions
from ggx.reference import RefDevice

GiB = 2**30


class Dev(RefDevice):
    """A device with a name and a free-memory figure (all layer_split reads of a device)."""

    def __init__(self, name: str, free: int = GiB):
        super().__init__()
        self.name = name
        self.free = free

    def memory(self) -> tuple[int, int]:
        return self.free, max(self.free, GiB)


def ranges(split: LayerSplit) -> dict[str, tuple[int, int, bool]]:
    return {p.device.name: (p.start, p.stop, p.output) for p in split.parts}


def test_equal_shares_split_an_even_count_in_halves():
    a, b = Dev("RAY0"), Dev("CPU")
    split = layer_split(30, [a, b], [1, 1])
    assert ranges(split) == {"RAY0": (0, 15, False), "CPU": (15, 30, True)}
    assert split.layers == (a,) * 15 + (b,) * 15 and split.output is b
    assert str(split) == "RAY0 layers 0-14, CPU layers 15-29 + output"
    assert split.device_of(0) is a and split.device_of(None) is b and split.n_layer == 30


def test_shares_are_proportions():
    a, b = Dev("A"), Dev("B")
    # layer il goes to the first device whose cumulative share exceeds il / n_layer: il / 30 < 3/4 -> A
    split = layer_split(30, [a, b], [3, 1])
    assert ranges(split) == {"A": (0, 23, False), "B": (23, 30, True)}
    assert split.fractions == (0.75, 0.25)
    assert ranges(layer_split(30, [a, b], [0.3, 0.1])) == ranges(split)  # only the ratio counts


def test_every_device_gets_its_share_within_one_layer_in_contiguous_ranges():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n_dev = int(rng.integers(1, 5))
        devs = [Dev(f"D{i}") for i in range(n_dev)]
        shares = [float(x) for x in rng.choice([0.0, 0.5, 1.0, 2.0, 7.0], n_dev)]
        if not any(shares):
            shares[0] = 1.0
        n_layer = int(rng.integers(1, 50))
        split = layer_split(n_layer, devs, shares)
        order = [devs.index(d) for d in split.layers]
        assert order == sorted(order)  # contiguous, in the order of the devices
        for p, share in zip(split.parts, shares):
            assert abs(p.n_layers - n_layer * share / sum(shares)) < 1
            assert share or not p.n_layers
        assert split.output is split.layers[-1]


def test_a_device_with_a_zero_share_gets_no_layers_nor_the_output():
    a, b, c = Dev("A"), Dev("B"), Dev("C")
    split = layer_split(12, [a, b, c], [0, 1, 0])
    assert ranges(split) == {"A": (0, 0, False), "B": (0, 12, True), "C": (0, 0, False)}
    assert str(split) == "B layers 0-11 + output" and [p.device for p in split.used] == [b]
    last_zero = layer_split(12, [a, b], [1, 0])  # the output stays with the last layer, not on B
    assert last_zero.output is a and str(last_zero) == "A layers 0-11 + output"
    assert str(last_zero.parts[1]) == "B no layers"


def test_one_device_takes_everything():
    a = Dev("A")
    for shares in (None, [5]):
        split = layer_split(30, [a], shares)
        assert split.layers == (a,) * 30 and split.output is a and str(split) == "A layers 0-29 + output"
    assert str(layer_split(1, [a])) == "A layer 0 + output"


def test_without_tensor_split_the_shares_follow_free_memory():
    a, b = Dev("A", 3 * GiB), Dev("B", 1 * GiB)
    assert ranges(layer_split(30, [a, b])) == ranges(layer_split(30, [a, b], [3, 1]))
    none_free = [Dev("A", 0), Dev("B", 0)]  # nothing reported: equal shares rather than a division by zero
    assert split_fractions(none_free) == [0.5, 0.5]


def test_no_layers_puts_the_output_on_the_last_device_with_a_share():
    a, b, c = Dev("A"), Dev("B"), Dev("C")
    split = layer_split(0, [a, b, c], [1, 1, 0])
    assert split.layers == () and split.output is b and str(split) == "B output"


@pytest.mark.parametrize("shares, match", [
    ([1], "1 shares for 2 split devices"),
    ([1, 2, 3], "3 shares for 2 split devices"),
    ([1, -1], "finite and non-negative, got -1"),
    ([0, 0], "all zero"),
    ([math.nan, 1], "finite and non-negative, got nan"),
    ([math.inf, 1], "finite and non-negative, got inf"),
    ([], "empty"),
    (["x", 1], "must be numbers"),
])
def test_bad_tensor_split_is_refused(shares, match):
    with pytest.raises(GGXValueError, match=match):
        layer_split(30, [Dev("A"), Dev("B")], shares)


def test_check_tensor_split_and_other_bad_arguments():
    assert check_tensor_split([3, 1]) == [3.0, 1.0]
    assert check_tensor_split((1, 0), 2) == [1.0, 0.0]
    with pytest.raises(GGXValueError, match="at least one device"):
        layer_split(4, [])
    with pytest.raises(GGXValueError, match="n_layer"):
        layer_split(-1, [Dev("A")])
