"""ggx.compare.cut_layers: a GGUF file cut to its first layers still loads and runs."""
from __future__ import annotations

import gguf
import pytest

from ggx.compare import cut_layers
from ggx.errors import GGXValueError


def test_cut_keeps_the_first_layers(tiny_llama, tmp_path):
    out = cut_layers(tiny_llama, 1, tmp_path)
    r = gguf.GGUFReader(str(out))
    assert int(r.fields["llama.block_count"].contents()) == 1
    names = {t.name for t in r.tensors}
    assert "blk.0.attn_q.weight" in names and not any(n.startswith("blk.1.") for n in names)
    assert "token_embd.weight" in names and "output_norm.weight" in names
    assert cut_layers(tiny_llama, 1, tmp_path) == out  # reused
    assert cut_layers(tiny_llama, 2, tmp_path) == tiny_llama  # not fewer layers: the file itself
    from ggx.models import load_model

    m = load_model(out, devices=["ref"], warmup=False, n_ctx=32)
    assert m.hp.n_layer == 1 and m.forward([1, 2, 3]).shape == (3, m.n_vocab)
    with pytest.raises(GGXValueError, match="at least one layer"):
        cut_layers(tiny_llama, 0, tmp_path)
