"""The architecture table: every entry is complete, and an unknown architecture is refused by name."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from ggx.errors import GGXFormatError
from ggx.models import ARCHITECTURES, GGUFFile, load_model, read_hparams


def test_table_lists_llama_and_gemma3():
    assert {"llama", "gemma3"} <= set(ARCHITECTURES)
    for name, arch in ARCHITECTURES.items():
        assert arch.name == name
        assert callable(arch.read_hparams) and callable(arch.expected_tensors) and callable(arch.build)


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGXFormatError, match=r"architecture 'mamba' is not supported \(ggx runs gemma3, llama"):
        read_hparams(GGUFFile(path))
    with pytest.raises(GGXFormatError, match="mamba"):
        load_model(path, devices=["ref"])
