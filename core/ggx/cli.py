"""The `ggx` command: argparse with one subcommand per module of `ggx.commands`.

Adding a subcommand: write `ggx/commands/<name>.py` with `add_parser(subparsers)` (it creates its
parser with `subparsers.add_parser(...)` and sets `func=<callable(args) -> int | None>`), then
append `<name>` to COMMANDS. Command modules are imported to build the parser, so they import
their heavy dependencies inside `func`, not at module level. Option values are checked by the
parser (`ggx.commands.argtypes`), so a bad one is a usage error before anything loads.

Every way a command can end is one of: its own status; a usage error (argparse's message, 2);
`error: MESSAGE` on stderr for a GGXError or an OSError (2) or for an unexpected exception (1,
with a hint to report it: `ggx --debug ...` or GGX_DEBUG=1 prints the traceback first); a quiet
stop when stdout is a closed pipe (`ggx run | head`: 141, as a shell reports SIGPIPE; rich's
tables stop themselves there, with 1); and `interrupted` for Ctrl-C (130).
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import io
import os
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import TextIO

from . import progress
from ._version import __version__
from .errors import GGXError

#: Module names under ggx.commands, in the order `ggx --help` lists them.
COMMANDS: tuple[str, ...] = ("devices", "run", "chat", "serve", "bench", "compile", "tune", "test_ops",
                             "new_plugin", "graph", "compare")

DEBUG_ENV = "GGX_DEBUG"
EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 1, 2, 130, 141


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ggx", description="ggx: a tensor backend framework for Python.")
    parser.add_argument("--version", action="version", version=f"ggx {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of an error (also: {DEBUG_ENV}=1)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.commands.{name}").add_parser(subparsers)
    for sub in subparsers.choices.values():  # `ggx run --debug` works too; SUPPRESS keeps `ggx --debug run`
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


class CompileNotice:
    """The `ggx.progress` listener of the command line: once kernel compilation has gone on for
    `delay` seconds (a first run; loading compiled kernels from the disk cache takes less), one
    line on `stream`: "compiling CPU kernels for avx2, first run only"."""

    def __init__(self, stream: TextIO, delay: float = 0.5):
        self.stream = stream
        self.delay = delay
        self.shown = False
        self.seconds = 0.0
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def begin(self, what: str) -> None:
        if self.shown:
            return
        if self.seconds >= self.delay:
            self._show(what)
            return
        self._timer = threading.Timer(self.delay - self.seconds, self._show, (what,))
        self._timer.daemon = True
        self._timer.start()

    def end(self, what: str, seconds: float) -> None:
        self.seconds += seconds
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _show(self, what: str) -> None:
        with self._lock:
            if self.shown:
                return
            self.shown = True
        try:
            self.stream.write(f"compiling {what}, first run only\n")
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed: nothing to tell
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `ggx` command line; returns the exit status (see the module docstring)."""
    _tolerant_stdout()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version and usage errors: argparse has printed already
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_USAGE
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    previous = progress.set_listener(CompileNotice(sys.stderr))
    try:
        status = int(func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not as "Exception ignored" at exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        _error_line("interrupted")
        return EXIT_INTERRUPTED
    except GGXError as e:
        _error_line(f"error: {e}", debug)
        return EXIT_USAGE
    except OSError as e:
        _error_line(f"error: {e.filename}: {e.strerror}" if e.filename and e.strerror else f"error: {e}", debug)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - the last resort: one line, not a traceback
        where = "the traceback above" if debug else f"the traceback `ggx --debug ...` or {DEBUG_ENV}=1 prints"
        what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        _error_line(f"error: unexpected {what} (a bug in ggx or a plugin; please report it with {where})", debug)
        return EXIT_ERROR
    finally:
        progress.set_listener(previous)


def _error_line(line: str, debug: bool = False) -> None:
    try:
        if debug:
            traceback.print_exc()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed too
        pass


def _tolerant_stdout() -> None:
    """Text the terminal's encoding cannot take (a file name that is not UTF-8, a generated
    character under a Latin-1 locale) is printed escaped instead of raising."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")


def _silence_stdout() -> None:
    """stdout is a closed pipe: point it at /dev/null so the flush at exit does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass


def console() -> None:
    """The `ggx` executable: `main`, then an exit that skips the interpreter's teardown. The
    threads are joined and every exit handler runs as usual (this one, registered first, runs
    last), then the process ends with the status at once: freeing numba's and LLVM's objects one
    by one at teardown took ~0.5-1 s of every command, more than loading the default model. Files
    are written inside `with` blocks, and stdout and stderr are flushed here. Calling `main`
    from Python keeps the interpreter's normal exit."""
    status = [EXIT_ERROR]

    def end_now() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status[0])

    atexit.register(end_now)
    try:
        status[0] = main()
    except KeyboardInterrupt:
        status[0] = EXIT_INTERRUPTED
        raise
    sys.exit(status[0])


if __name__ == "__main__":
    console()
