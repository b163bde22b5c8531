"""The `ggx` command: argparse with one subcommand per module of `ggx.commands`.

Adding a subcommand: write `ggx/commands/<name>.py` with `add_parser(subparsers)` (it creates its
parser with `subparsers.add_parser(...)` and sets `func=<callable(args) -> int | None>`), then
append `<name>` to COMMANDS. Command modules are imported to build the parser, so they import
their heavy dependencies inside `func`, not at module level.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from . import __version__
from .errors import GGXError

#: Module names under ggx.commands, in the order `ggx --help` lists them.
COMMANDS: tuple[str, ...] = ("devices", "run", "bench", "test_ops", "new_plugin", "graph")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ggx", description="ggx: a tensor backend framework for Python.")
    parser.add_argument("--version", action="version", version=f"ggx {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `ggx` command line; returns the exit status (0 ok, 2 usage error or GGXError)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version and usage errors: argparse has printed already
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        status = func(args)
    except GGXError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
