"""llama's rope_freqs.weight (Llama 3.1+ RoPE scaling): the factors divide each pair's RoPE
angle in every layer, as the independent float64 numpy model says and as llama.cpp computes
(its logits of the tiny scaled llama, kept in tests/data/llama_rope_freqs.npz: remake them with
`python tests/models/test_llama_rope_freqs.py PATH/TO/llama-logits`), on ref and on ggx-cpu;
all-ones factors change nothing; a wrong tensor is refused by name."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_modules import load_benchmark
from gguf_synth import write_tiny_llama
from numpy_model import numpy_logits

from ggx.errors import GGXFormatError
from ggx.models import GGUFFile, load_model, read_hparams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sched_device import TestDevice  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "data" / "llama_rope_freqs.npz"
N_PAIRS = 8  # n_rot / 2 of the tiny llama (64 / 4 heads = 16 dims)


def llama3_factors() -> np.ndarray:
    """Llama 3.1's shape of factors: 1 for the high frequencies, 8 for the low, a ramp between
    (one factor below 1 too: nothing assumes factors >= 1)."""
    return np.array([1.0, 1.0, 0.75, 1.5, 2.5, 4.0, 8.0, 8.0], np.float32)


@pytest.fixture(scope="module")
def scaled_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "scaled.gguf", rope_freqs=llama3_factors())


IDS = [5, 6, 7, 8, 9, 10, 11, 3, 40, 41, 42, 17, 2, 60, 61, 9, 9, 30, 31, 32, 33, 34, 35, 36, 37]
#: the prompt of the llama.cpp comparison: 48 positions, past the angles where the factors matter
LLAMACPP_IDS = np.random.default_rng(31).integers(2, 268, 48).tolist()


@pytest.mark.parametrize("flash_attn", [True, False], ids=["flash_attn", "soft_max"])
def test_factors_match_the_numpy_model(scaled_llama, tiny_llama, flash_attn):
    got = load_model(scaled_llama, devices=["ref"], flash_attn=flash_attn, warmup=False).forward(IDS)
    want = numpy_logits(scaled_llama, IDS)
    # ggx rounds K/V to F16 in the cache; everything else is float64 on ref
    tol = 3e-3 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    # the factors matter here: the same weights without them are far from these logits (the
    # first position is not rotated, so it is the same)
    plain = load_model(tiny_llama, devices=["ref"], flash_attn=flash_attn, warmup=False).forward(IDS)
    np.testing.assert_allclose(plain[0], got[0], rtol=0, atol=tol)
    assert np.abs(plain[1:] - got[1:]).max() > 30 * tol


def test_model_reads_each_layers_copy(scaled_llama):
    m = load_model(scaled_llama, devices=["ref"], warmup=False)
    for il in range(m.hp.n_layer):
        t = m.weights[f"blk.{il}.rope_freqs.weight"]
        assert t.ne[0] == N_PAIRS
    assert "rope_freqs.weight" not in m.weights


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sum((got - want) ** 2) / np.sum(want ** 2))


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_cpu_matches_ref(scaled_llama, tiny_llama, fuse):
    """ggx-cpu's ROPE kernel with the factors (one rope over the fused Q|K heads, or two), in a
    batch and one token at a time through the KV cache. ggx-cpu quantizes activations for its
    products (NMSE ~1.5e-3 against ref on this file with or without factors), so the check is
    the architecture tests' bound, and that the result is far closer to ref with the factors
    than to ref without them."""
    ids = IDS[:17]
    want = load_model(scaled_llama, devices=["ref"], warmup=False).forward(ids)
    unscaled = load_model(tiny_llama, devices=["ref"], warmup=False).forward(ids)
    cpu = load_model(scaled_llama, devices=["CPU"], fuse=fuse, warmup=False)
    got = cpu.forward(ids)
    assert nmse(got, want) < 1e-2
    assert nmse(got, unscaled) > 10 * nmse(got, want)
    cpu.reset()
    steps = np.concatenate([cpu.eval([t]) for t in ids])
    assert nmse(steps, want) < 1e-2
    assert nmse(steps, unscaled) > 10 * nmse(steps, want)


def test_a_layer_split_gives_each_layer_the_factors_on_its_device(scaled_llama):
    """Layer 0 on a device with memory of its own, layer 1 on ref: each layer's ROPE reads the
    copy in its device's memory (no copy of the factors between devices), and the logits are
    ref's. Without mmap the copies are loaded too."""
    dev = TestDevice("rope-freqs-split")  # not host memory; reference kernels
    m = load_model(scaled_llama, devices=[dev, "ref"], n_ctx=64, tensor_split=[1, 1], use_mmap=False)
    assert m.weights["blk.0.rope_freqs.weight"].data_buffer.buft.name == "rope-freqs-split_mem"
    assert m.weights["blk.1.rope_freqs.weight"].data_buffer.buft.name == "ref"
    alone = load_model(scaled_llama, devices=["ref"], n_ctx=64)
    np.testing.assert_allclose(m.forward(IDS), alone.forward(IDS), rtol=1e-5, atol=1e-5)


def test_all_ones_factors_change_nothing(tmp_path, tiny_llama):
    path = write_tiny_llama(tmp_path / "ones.gguf", rope_freqs=np.ones(N_PAIRS, np.float32))
    ids = [5, 6, 7, 8, 9, 10]
    got = load_model(path, devices=["ref"], warmup=False).forward(ids)
    want = load_model(tiny_llama, devices=["ref"], warmup=False).forward(ids)
    np.testing.assert_array_equal(got, want)


def test_wrong_shape_is_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "bad.gguf", rope_freqs=np.ones(N_PAIRS + 1, np.float32))
    with pytest.raises(GGXFormatError, match=r"'rope_freqs.weight' is F32 \[9\], expected F32 \[8\]"):
        read_hparams(GGUFFile(path))


@pytest.mark.parametrize("value", [0.0, -2.0, np.inf, np.nan])
def test_factors_that_are_not_positive_numbers_are_refused(tmp_path, value):
    factors = llama3_factors()
    factors[5] = value
    path = write_tiny_llama(tmp_path / "bad.gguf", rope_freqs=factors)
    with pytest.raises(GGXFormatError, match=r"'rope_freqs.weight' holds .* at pair 5: RoPE frequency factors "
                                             r"must be finite numbers > 0"):
        read_hparams(GGUFFile(path))


def test_logits_match_llama_cpp(scaled_llama, tiny_llama):
    """ggx-cpu on the scaled file against llama.cpp's logits of the same file (issue 32's bounds);
    the same weights without the factors break those bounds (the data can tell)."""
    lc = load_benchmark("llamacpp_logits")
    ref, digests = lc.load(DATA)
    assert ref.ids.tolist() == LLAMACPP_IDS
    f = GGUFFile(str(scaled_llama))
    assert {n: hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest() for n, t in f.tensors.items()} == \
        {n: h for n, (_, h) in digests.items()}, "the tiny llama changed: remake tests/data/llama_rope_freqs.npz"
    for n_threads in (1, 2):
        got = load_model(scaled_llama, devices=["CPU"], n_threads=n_threads, warmup=False).forward(LLAMACPP_IDS)
        assert lc.check(got, ref) == [], n_threads
    unscaled = load_model(tiny_llama, devices=["CPU"], warmup=False).forward(LLAMACPP_IDS)
    assert lc.check(unscaled, ref) != []


def make_reference(llama_logits: str) -> None:
    """llama.cpp's logits of the tiny scaled llama (written as the test writes it), kept in DATA."""
    import tempfile

    lc = load_benchmark("llamacpp_logits")
    with tempfile.TemporaryDirectory() as d:
        path = write_tiny_llama(Path(d) / "scaled.gguf", rope_freqs=llama3_factors())
        out = Path(d) / "logits.f32"
        subprocess.run([llama_logits, str(path), str(out), "1", *map(str, LLAMACPP_IDS)], check=True)
        logits = np.fromfile(out, np.float32).reshape(len(LLAMACPP_IDS), -1)
        lc.save(DATA, lc.Reference.of(np.array(LLAMACPP_IDS), logits), lc.tensor_digests(path))


if __name__ == "__main__":
    make_reference(sys.argv[1])
