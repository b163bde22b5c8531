"""argparse value types the subcommands share: a bad value is a usage error naming the option.

Each is a callable `type=` takes: it returns the parsed value or raises ArgumentTypeError, which
argparse prints as `ggx CMD: error: argument -t/--threads: ...` with exit status 2.
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path


def int_at_least(low: int, meaning: str = "") -> Callable[[str], int]:
    """An integer >= low; `meaning` explains a special value in the message (e.g. "-1: no limit")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            extra = f" ({meaning})" if meaning else ""
            raise argparse.ArgumentTypeError(f"must be at least {low}{extra}, got {value}")
        return value
    return parse


def int_list_at_least(low: int) -> Callable[[str], list[int]]:
    """Comma-separated integers, each >= low (llama-bench's `-t 1,2,4`)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        bad = [v for v in values if v < low]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be at least {low}, got {bad[0]} in {text!r}")
        return values
    return parse


def finite_float(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high] (or (low, high] with low_open); nan and inf are refused."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        too_low = value <= low if low_open else value < low
        if too_low or value > high:
            lo = f"({low:g}" if low_open else f"[{low:g}"
            hi = f"{high:g}]" if math.isfinite(high) else "inf)"
            raise argparse.ArgumentTypeError(f"must be in {lo}, {hi}, got {text!r}")
        return value
    return parse


def utf8_text(text: str) -> str:
    """Text that is valid UTF-8: argv bytes that are not reach Python as lone surrogates, which
    no tokenizer or terminal can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(text)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise argparse.ArgumentTypeError(f"is not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start})") \
                from None
        raise argparse.ArgumentTypeError("is not valid UTF-8") from None
    return text


def output_file(text: str) -> Path:
    """A file to write: its directory must exist (nothing is created behind the user's back)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {parent} does not exist")
    return path


def existing_dir(text: str) -> Path:
    """A directory that exists."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory" if path.exists()
                                         else f"directory {text} does not exist")
    return path


def tensor_split(text: str) -> list[float]:
    """`--tensor-split 3,1`: one non-negative share per split device, not all zero (llama.cpp's
    -ts; "/" separates as well). How many devices there are is checked once they are known."""
    parts = [x.strip() for x in text.replace("/", ",").split(",")]
    try:
        values = [float(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 3,1, got {text!r}") from None
    bad = [x for x, v in zip(parts, values) if not math.isfinite(v) or v < 0]
    if bad:
        raise argparse.ArgumentTypeError(f"every share must be a finite number of 0 or more, "
                                         f"got {bad[0]!r} in {text!r}")
    if not any(values):
        raise argparse.ArgumentTypeError(f"the shares are all zero in {text!r}: at least one device must take layers")
    return values
