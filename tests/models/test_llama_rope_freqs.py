"""llama's rope_freqs.weight (Llama 3.1+ RoPE scaling): all-ones factors run as before, others
are refused by name (ggx's ROPE has no frequency factors yet) instead of giving wrong logits."""
from __future__ import annotations

import numpy as np
import pytest
from gguf_synth import write_tiny_llama

from ggx.errors import GGXFormatError
from ggx.models import GGUFFile, load_model, read_hparams

N_PAIRS = 8  # n_rot / 2 of the tiny llama (64 / 4 heads = 16 dims)


def test_all_ones_factors_change_nothing(tmp_path, tiny_llama):
    path = write_tiny_llama(tmp_path / "ones.gguf", rope_freqs=np.ones(N_PAIRS, np.float32))
    ids = [5, 6, 7, 8, 9, 10]
    got = load_model(path, devices=["ref"], warmup=False).forward(ids)
    want = load_model(tiny_llama, devices=["ref"], warmup=False).forward(ids)
    np.testing.assert_array_equal(got, want)


def test_scaling_factors_are_refused_by_name(tmp_path):
    factors = np.ones(N_PAIRS, np.float32)
    factors[4:] = 8.0  # llama 3's low-frequency pairs
    path = write_tiny_llama(tmp_path / "scaled.gguf", rope_freqs=factors)
    with pytest.raises(GGXFormatError, match=r"'rope_freqs.weight' holds RoPE frequency factors .* from 1 to 8"):
        read_hparams(GGUFFile(path))


def test_wrong_shape_is_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "bad.gguf", rope_freqs=np.ones(N_PAIRS + 1, np.float32))
    with pytest.raises(GGXFormatError, match=r"'rope_freqs.weight' is F32 \[9\], expected F32 \[8\]"):
        read_hparams(GGUFFile(path))
