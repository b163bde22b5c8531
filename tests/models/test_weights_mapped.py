"""Weights mapped from the file (ggml's CPU_Mapped): plain host weights are views of the GGUF map,
copied ones are not, the results are the same as with every weight copied, and a file changed
or truncated under a model is an error at the next evaluation, not a crash."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gguf_synth import write_tiny_llama

from ggx.errors import GGXStateError
from ggx.models import load_model
from ggx.models.weights import mappable

PROMPT = [5, 70, 71, 72, 3, 200, 33]


@pytest.fixture
def tiny_copy(tiny_llama, tmp_path) -> Path:
    """A copy of the tiny model that a test may change."""
    return Path(shutil.copy(tiny_llama, tmp_path / "tiny.gguf"))


def test_plain_host_weights_are_views_of_the_file(tiny_llama):
    m = load_model(tiny_llama, n_ctx=64, warmup=False)
    plain = {n for n, t in m.weights.items() if mappable(t.data_buffer.buft)}
    mapped = {n for n in plain if np.shares_memory(m.weights[n].data_buffer.host_view(), m.file.memory)}
    # the embedding (get_rows) and the norms stay in plain memory: mapped, at their bytes in the file
    assert {"token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight"} <= mapped
    assert mapped == plain and len(plain) < len(m.weights)  # the others are repacked copies
    assert m.mapped_nbytes == sum(m.weights[n].nbytes for n in mapped)
    emb = m.weights["token_embd.weight"]
    assert emb.data_offset == m.file.tensor("token_embd.weight").offset
    copied = load_model(tiny_llama, n_ctx=64, warmup=False, use_mmap=False)
    assert copied.mapped_nbytes == 0
    assert not any(np.shares_memory(t.data_buffer.host_view(), copied.file.memory)
                   for t in copied.weights.values() if mappable(t.data_buffer.buft))
    np.testing.assert_array_equal(m.forward(PROMPT), copied.forward(PROMPT))


def test_mapped_weights_on_the_reference_device_match(tiny_llama):
    """A device without buffer_from_host_ptr (ref) copies its weights; the CPU maps: same tokens."""
    ref = load_model(tiny_llama, devices=["ref"], n_ctx=64, warmup=False)
    cpu = load_model(tiny_llama, n_ctx=64, warmup=False)
    assert ref.mapped_nbytes == 0 and cpu.mapped_nbytes > 0
    want = [t.id for t in ref.generate(PROMPT, 4, stop_at_eos=False)]
    assert [t.id for t in cpu.generate(PROMPT, 4, stop_at_eos=False)] == want


def test_a_file_modified_in_place_is_refused(tiny_copy):
    m = load_model(tiny_copy, n_ctx=64, warmup=False)
    m.forward(PROMPT)
    st = os.stat(tiny_copy)
    off = m.file.tensor("output_norm.weight").offset
    with open(tiny_copy, "r+b") as fh:  # the same size, other bytes, a later modification time
        fh.seek(off)
        fh.write(b"\x00" * 16)
    os.utime(tiny_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(GGXStateError, match="changed since it was loaded .*modified"):
        m.forward(PROMPT)
    with pytest.raises(GGXStateError):  # every later evaluation too, generate included
        list(m.generate(PROMPT, 2))


def test_every_compute_of_the_model_checks_the_file(tiny_copy):
    """The check sits in the model's runner: a Batcher stepping the model's graphs is refused too."""
    from ggx.models.batched import Batcher

    m = load_model(tiny_copy, n_ctx=64, warmup=False)
    batcher = Batcher(m, n_seq=2)
    batcher.add(PROMPT, 3)
    batcher.step()
    st = os.stat(tiny_copy)
    os.utime(tiny_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(GGXStateError, match="changed since it was loaded"):
        batcher.step()


def test_a_file_replaced_by_rename_keeps_the_model_working(tiny_copy, tmp_path):
    """The model holds the file it opened: a new file renamed over its path changes nothing."""
    m = load_model(tiny_copy, n_ctx=64, warmup=False)
    want = m.forward(PROMPT)
    other = write_tiny_llama(tmp_path / "other.gguf", seed=5)
    os.replace(other, tiny_copy)
    np.testing.assert_array_equal(m.forward(PROMPT), want)


def test_copied_weights_survive_a_truncated_file(tiny_copy):
    m = load_model(tiny_copy, n_ctx=64, warmup=False, use_mmap=False)
    want = m.forward(PROMPT)
    os.truncate(tiny_copy, 1024)
    np.testing.assert_array_equal(m.forward(PROMPT), want)


_TRUNCATE = textwrap.dedent("""
    import os, sys
    from ggx.errors import GGXStateError
    from ggx.models import load_model
    path = sys.argv[1]
    m = load_model(path, n_ctx=64, warmup=False)
    m.forward([5, 70, 71])
    os.truncate(path, 1024)  # every tensor's pages now lie past the end of the file
    try:
        m.forward([5, 70, 71])
    except GGXStateError as e:
        print("refused:", e)
    m.reset()  # what does not compute still works
    print("alive")
""")


def test_a_truncated_file_is_refused_not_a_crash(tiny_copy):
    """In a child process: reading a truncated map would kill it with SIGBUS."""
    out = subprocess.run([sys.executable, "-c", _TRUNCATE, str(tiny_copy)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "refused:" in out.stdout and "size went from" in out.stdout and "1024 bytes" in out.stdout
    assert out.stdout.rstrip().endswith("alive")
