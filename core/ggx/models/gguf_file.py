"""GGUF files: one bounded walk over the memory-mapped header reads and checks everything.

File layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor_count,
u64 kv_count; kv_count pairs (string key, u32 value type, value); tensor_count infos
(string name, u32 n_dims, u64 ne[n_dims] in ggml order, u32 ggml type, u64 offset); padding
to `general.alignment` (default 32); tensor data, each tensor at data_start + offset, where the
offsets follow the tensor order, each tensor starting where the one before ends, padded to the
alignment (ggml's gguf reader requires this; it also catches overlaps and mismatched types).

The `gguf` package's GGUFReader trusts the file (a huge array count makes it loop and allocate
for ever, a short file gives silently truncated arrays) and reads string arrays element by
element in slow Python. So `read_header` walks the header itself, bounding every count and
length by the bytes that remain before reading it (arrays of numbers with one numpy call, kept
as read-only numpy arrays; arrays of strings or arrays are lists), and every malformation
becomes a `GGXFormatError` naming what is wrong and where.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GGXFormatError, GGXStateError
from ..types import GType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# GGUF value types: id -> (name, fixed size in bytes or None for string/array)
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("u8", "<B"), 1: ("i8", "<b"), 2: ("u16", "<H"), 3: ("i16", "<h"), 4: ("u32", "<I"),
    5: ("i32", "<i"), 6: ("f32", "<f"), 7: ("bool", "<?"), 10: ("u64", "<Q"), 11: ("i64", "<q"),
    12: ("f64", "<d"),
}
_STRING, _ARRAY = 8, 9
#: the kinds of an array value (`GGUFFile.get(key, ARRAY)`): numbers come as a read-only numpy
#: array, strings and arrays as a list
ARRAY = (list, np.ndarray)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: ggml-order `ne`, its GType and its bytes (a read-only memmap view)."""

    name: str
    type: GType
    ne: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    data: np.ndarray  # uint8 view of the file's bytes, no copy


class _Cursor:
    """Reads little-endian values from `buf`, raising GGXFormatError instead of running past its end."""

    def __init__(self, buf: np.ndarray, path: str):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def fail(self, what: str) -> GGXFormatError:
        return GGXFormatError(f"{self.path}: {what} (at byte {self.pos} of {self.size})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated file: {what} needs {n} bytes, {self.size - self.pos} remain")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """Read one value of GGUF type `vtype`, checking every length against the file size.

        Scalars become Python numbers/bools, strings str, arrays lists (as gguf's
        `ReaderField.contents()` gives them); arrays of numbers are read with one numpy call.
        """
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][1], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what}: unknown value type {vtype}")
        if depth > 2:
            raise self.fail(f"{what}: arrays nested more than 2 deep")
        itype = self.unpack("<I", f"element type of {what}")
        count = self.unpack("<Q", f"element count of {what}")
        if itype in _SCALARS:
            name, fmt = _SCALARS[itype]
            size = struct.calcsize(fmt)
            self.need(count * size, f"{what}: {count} elements of {name}")
            # a read-only numpy copy: a vocabulary's scores as Python floats would take 32 bytes a
            # number (8 MB for 262k tokens), a view would read the file after it may have changed
            values = np.frombuffer(self.buf, np.dtype(fmt), count, self.pos).copy()
            values.flags.writeable = False
            self.pos += count * size
            return values
        if itype not in (_STRING, _ARRAY):
            raise self.fail(f"{what}: unknown array element type {itype}")
        # every element takes at least 8 bytes (a length or a header): bound the count first
        self.need(count * 8, f"{what}: {count} elements")
        if itype == _STRING:
            return self._strings(count, what)
        return [self.value(_ARRAY, f"element of {what}", depth + 1) for _ in range(count)]

    def _strings(self, count: int, what: str) -> list[str]:
        """`count` strings (u64 length + UTF-8 bytes each): the vocabulary's hot loop, kept tight."""
        mv, size, pos = memoryview(self.buf), self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = [""] * count
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"length of element {i} of {what}")
            (n,) = unpack(mv, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.need(n, f"element {i} of {what} ({n} bytes)")
            try:
                out[i] = str(mv[pos: pos + n], "utf-8")
            except UnicodeDecodeError as e:
                self.pos = pos
                raise self.fail(f"element {i} of {what} is not valid UTF-8 ({e.reason})") from None
            pos += n
        self.pos = pos
        return out


_U64 = struct.Struct("<Q")


def check_header(buf: np.ndarray, path: str = "<gguf>") -> list[TensorInfo]:
    """Validate the whole GGUF structure in `buf` (uint8) and return its tensors' descriptions."""
    return read_header(buf, path)[1]


def read_header(buf: np.ndarray, path: str = "<gguf>") -> tuple[dict[str, Any], list[TensorInfo]]:
    """Validate the whole GGUF structure in `buf` (uint8): (metadata key -> value, tensor descriptions)."""
    c = _Cursor(buf, path)
    c.need(4, "the magic")
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise c.fail(f"bad magic {magic!r}: not a GGUF file (expected {GGUF_MAGIC!r})")
    c.pos = 4
    version = c.unpack("<I", "the version")
    if version not in (2, 3):
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in (2, 3):
            raise c.fail("big-endian GGUF files are not supported")
        raise c.fail(f"unsupported GGUF version {version} (ggx reads 2 and 3)")
    n_tensors = c.unpack("<Q", "the tensor count")
    n_kv = c.unpack("<Q", "the key/value count")
    # a kv takes at least 8 (key length) + 4 (type) bytes, a tensor info at least 8 + 4 + 4 + 8
    if n_kv * 12 > c.size - c.pos:
        raise c.fail(f"absurd key/value count {n_kv} or truncated file: {c.size - c.pos} bytes remain")
    if n_tensors * 24 > c.size - c.pos:
        raise c.fail(f"absurd tensor count {n_tensors} or truncated file: {c.size - c.pos} bytes remain")
    alignment = DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = c.string(f"key #{i}")
        if key in metadata:
            raise c.fail(f"duplicate key {key!r}")
        vtype = c.unpack("<I", f"value type of {key!r}")
        metadata[key] = c.value(vtype, f"value of {key!r}")
        if key == "general.alignment":
            if vtype != 4:
                raise c.fail("general.alignment must be a u32")
            alignment = metadata[key]
            if alignment == 0 or alignment & (alignment - 1):
                raise c.fail(f"general.alignment {alignment} is not a power of two")
    raw_infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = c.string(f"name of tensor #{i}")
        if name in names:
            raise c.fail(f"duplicate tensor {name!r}")
        names.add(name)
        n_dims = c.unpack("<I", f"dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        ne = tuple(c.unpack("<Q", f"dimension {d} of {name!r}") for d in range(n_dims))
        type_id = c.unpack("<I", f"type of {name!r}")
        offset = c.unpack("<Q", f"data offset of {name!r}")
        raw_infos.append((name, ne, type_id, offset))
    data_start = (c.pos + alignment - 1) // alignment * alignment
    infos = []
    expected = 0  # ggml's rule (gguf.cpp): each tensor starts where the one before ends, padded
    previous = "the data section starts"
    for name, ne, type_id, offset in raw_infos:
        try:
            gtype = GType.from_ggml_id(type_id)
        except KeyError:
            raise GGXFormatError(f"{path}: tensor {name!r} has unknown or unsupported ggml type id {type_id}") from None
        if any(x > 2**40 for x in ne) or math.prod(ne) > 2**50:
            raise GGXFormatError(f"{path}: tensor {name!r} has absurd dimensions {list(ne)}")
        if ne[0] % gtype.block_size:
            raise GGXFormatError(f"{path}: tensor {name!r}: row of {ne[0]} values is not a whole number of "
                                 f"{gtype.name} blocks of {gtype.block_size}")
        nbytes = math.prod(ne) // gtype.block_size * gtype.type_size
        if offset % alignment:
            raise GGXFormatError(f"{path}: tensor {name!r}: data offset {offset} is not {alignment}-aligned")
        if offset != expected:
            raise GGXFormatError(f"{path}: tensor {name!r}: data offset {offset}, expected {expected} where "
                                 f"{previous}: tensor data out of order or overlapping, or a type or shape that "
                                 "does not match the bytes")
        expected += (nbytes + alignment - 1) // alignment * alignment
        previous = f"{name!r} ({gtype.name}{list(ne)}, {nbytes} bytes) ends"
        start = data_start + offset
        if start + nbytes > c.size:
            raise GGXFormatError(f"{path}: truncated file: tensor {name!r} ({gtype.name}{list(ne)}) needs bytes "
                                 f"{start}..{start + nbytes}, the file has {c.size}")
        infos.append(TensorInfo(name, gtype, ne, start, nbytes, buf[start: start + nbytes]))
    if raw_infos and c.size - (data_start + expected) > 0:
        raise GGXFormatError(f"{path}: {c.size - data_start - expected} bytes follow the data of the last tensor, "
                             f"where {previous}: a type or shape that does not match the bytes")
    return metadata, infos


class GGUFFile:
    """A GGUF file opened memory-mapped: `metadata` (key -> python value) and `tensors` (name -> TensorInfo).

    `read_header` checks the header and reads the metadata in the same bounded walk (gguf's
    GGUFReader is not used: it trusts the file, and its per-element Python loops over a 49k-token
    vocabulary took ~2 s). Tensor data stays in the file's memory map: a loader copies what it
    transforms, and plain host weights are views of `memory` (ggml's CPU_Mapped).

    The file stays open while the object lives. The map is private (copy-on-write), so a write
    through a view never reaches the file, and the views are writable numpy arrays like any host
    buffer's. A file truncated under a map faults (SIGBUS) where its pages are read, so whoever
    computes from the map calls `check_unchanged` first: the file's size, modification time and
    inode, taken when it was opened, are compared with the open file's now.
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - held open for the map's lifetime
        except FileNotFoundError:
            raise GGXFormatError(f"{self.path}: no such file") from None
        except OSError as e:
            raise GGXFormatError(f"{self.path}: cannot open the file ({e.strerror or e})") from None
        try:
            self._stat = os.fstat(self._file.fileno())
            self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        except (ValueError, OSError) as e:  # an empty file cannot be mapped
            self._file.close()
            raise GGXFormatError(f"{self.path}: cannot map the file ({e})") from None
        #: the whole file, mapped copy-on-write (page-aligned start): what mapped weights view
        self.memory = np.frombuffer(self._mmap, dtype=np.uint8)
        header = self.memory.view()
        header.flags.writeable = False  # TensorInfo.data: read-only views
        self.metadata, infos = read_header(header, self.path)
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in infos}

    def check_unchanged(self) -> None:
        """GGXStateError when the file was written, truncated or touched since it was opened
        (its size, modification time or inode differ): its mapped bytes can no longer be
        trusted, and reading a truncated page would kill the process."""
        try:
            now = os.fstat(self._file.fileno())
        except (OSError, ValueError) as e:
            raise GGXStateError(f"{self.path}: the model file cannot be checked any more ({e}); "
                                "load the model again") from None
        was = self._stat
        if (now.st_size, now.st_mtime_ns, now.st_ino, now.st_dev) != \
                (was.st_size, was.st_mtime_ns, was.st_ino, was.st_dev):
            change = f"its size went from {was.st_size} to {now.st_size} bytes" if now.st_size != was.st_size \
                else "it was modified"
            raise GGXStateError(f"{self.path}: the model file changed since it was loaded ({change}); the weights "
                                "mapped from it are no longer valid: load the model again (a file that may change "
                                "under a running model is better loaded with use_mmap=False)")

    def release(self, start: int, nbytes: int) -> None:
        """Let the process's resident memory go of the file's pages inside bytes
        [start, start + nbytes) (madvise DONTNEED; whole pages inside the range only). They stay
        in the page cache, and a mapped view that reads them again faults them back in: for
        bytes a loader has copied, so that they do not count twice."""
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo and hasattr(self._mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def get(self, key: str, kind: type | tuple[type, ...] | None = None, default: Any = ...) -> Any:
        """Metadata value of `key`; GGXFormatError when it is missing (and no default) or of the wrong kind."""
        if key not in self.metadata:
            if default is ...:
                raise GGXFormatError(f"{self.path}: missing metadata key {key!r}")
            return default
        value = self.metadata[key]
        if kind is not None:
            kinds = kind if isinstance(kind, tuple) else (kind,)
            ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
            if float in kinds and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                names = "/".join(k.__name__ for k in kinds)
                raise GGXFormatError(f"{self.path}: metadata {key!r} is {type(value).__name__} {value!r:.60}, "
                                     f"expected {names}")
        return value

    def tensor(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise GGXFormatError(f"{self.path}: missing tensor {name!r}")
        return t

    @property
    def file_size(self) -> int:
        return len(self.memory)
