"""A GGUF file cut to its first N layers: the same tokenizer, embedding, output and metadata,
`{arch}.block_count` set to N and the tensors of later blocks left out. A model to compare
backends on in seconds (CI runs the default model's 2-layer cut); its text is no longer the
model's, but every kernel the full model runs still runs, on the full model's shapes.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import GGXValueError

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def cut_path(path: str | os.PathLike, n_layer: int, directory: str | os.PathLike | None = None) -> Path:
    """Where the cut of `path` to `n_layer` layers lives: next to the model cache's files."""
    from ..models.catalog import model_cache

    src = Path(path)
    return Path(directory or model_cache()) / f"{src.stem}.{n_layer}-layers{src.suffix or '.gguf'}"


def cut_layers(path: str | os.PathLike, n_layer: int, directory: str | os.PathLike | None = None) -> Path:
    """The GGUF file `path` cut to its first `n_layer` layers (written once, then reused; a file
    newer than the cut replaces it). `n_layer` at least the model's own gives `path` itself."""
    import gguf

    from ..models.gguf_file import GGUFFile

    if n_layer < 1:
        raise GGXValueError(f"a cut needs at least one layer, got {n_layer}")
    src = Path(path)
    meta = GGUFFile(str(src))
    arch = meta.get("general.architecture", str, None)
    key = f"{arch}.block_count"
    block_count = meta.get(key, int, None)
    if block_count is None:
        raise GGXValueError(f"{src}: no {key} in the metadata; cannot cut its layers")
    if n_layer >= block_count:
        return src
    out = cut_path(src, n_layer, directory)
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    reader = gguf.GGUFReader(str(src))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = n_layer if name == key else field.contents()
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub)
    for t in reader.tensors:
        m = _BLOCK.match(t.name)
        if m and int(m.group(1)) >= n_layer:
            continue
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
