"""`ggx tune [--budget S] [--types q4_0,...] [-t N] [--show]`: measure which buffer type of the CPU is
fastest for each weight type on this machine, and keep the profile (see `ggx.tune`).

It times a reference MUL_MAT in every candidate buffer type (plain CPU memory, CPU_REPACK, AMX,
any other plugin's; an emulated one never) at batch 1 and at a 512-token prompt batch, in about
`--budget` seconds of timing with a progress line, then prints per weight type what a model load
will choose and by how much. `ggx compile` runs it at set-up; `--show` prints the kept profile.
"""
from __future__ import annotations

import argparse
import sys

from .argtypes import finite_float, int_at_least


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..tune import BUDGET_S, TYPES

    p = subparsers.add_parser("tune", help="measure the fastest buffer type per weight type on this CPU",
                              description="Time every candidate buffer type of the CPU (plain memory, CPU_REPACK, "
                                          "AMX, ...) per weight type and keep the profile weight placement "
                                          "orders by.")
    p.add_argument("--budget", type=finite_float(0.0), default=BUDGET_S, metavar="S",
                   help=f"seconds of timing at most (default {BUDGET_S:g}; compiling a kernel is not counted)")
    p.add_argument("--types", default=",".join(TYPES), metavar="T,...",
                   help=f"weight types to time (default {','.join(TYPES)})")
    p.add_argument("-t", "--threads", type=int_at_least(1), default=None, help="CPU threads (default: the backend's)")
    p.add_argument("--show", action="store_true", help="print the kept profile (and whether it is stale); time nothing")
    p.set_defaults(func=run)


def run_tune(budget: float, types: list[str], threads: int | None, out=None) -> None:
    """Tune with a progress line on `out` (default stderr; a terminal: one line rewritten; else a
    line per type), save the profile and print the choices."""
    from .. import tune

    out = out or sys.stderr
    tty = out.isatty()
    last = [""]

    def progress(done: int, total: int, what: str) -> None:
        if tty:
            out.write(f"\r\x1b[Ktuning {done}/{total}: {what}")
            out.flush()
        elif what.split(" in ")[0] != last[0]:
            last[0] = what.split(" in ")[0]
            out.write(f"tuning {done}/{total}: {last[0]}\n")

    profile = tune.tune(types=types, budget_s=budget, n_threads=threads, progress=progress)
    if tty:
        out.write("\r\x1b[K")
    path = profile.save()
    out.write(f"tune profile: {path} ({profile.basis})\n")
    for line in choices(profile):
        out.write(line + "\n")


def choices(profile) -> list[str]:
    """Per weight type measured: the candidates' reference-workload times and what placement picks."""
    from ..graph import Context
    from ..placement import BuftChooser, host_device
    from ..tune import candidates
    from ..types import GType

    bufts = candidates(host_device())
    lines = []
    for gtype in dict.fromkeys(t for _, t, _ in profile.timings):
        times = [(b.name, profile.workload_seconds(b.name, gtype)) for b in bufts]
        shown = ", ".join(f"{n} {s * 1000:.1f} ms" for n, s in times if s is not None)
        ctx = Context()
        w = ctx.tensor(GType[gtype], profile.shape, "probe")
        chooser = BuftChooser(profile)
        picked = chooser.select(w, ctx.mul_mat(w, ctx.tensor(GType.F32, (profile.shape[0], 1))), bufts)
        why = "; ".join(chooser.notes.get(id(picked), [])) or "priority order"
        lines.append(f"  {gtype:5s} -> {picked.name} ({why}); one {profile.prompt}-token prompt + "
                     f"{profile.decode} steps: {shown}")
    for what, why in profile.not_timed.items():
        lines.append(f"  not timed: {what}: {why}")
    return lines


def run(args: argparse.Namespace) -> int:
    from .. import tune
    from ..errors import GGXValueError
    from ..placement import host_device
    from ..types import GType

    if args.show:
        path = tune.profile_path()
        if not path.exists():
            print(f"no tune profile at {path}: run `ggx tune`", file=sys.stderr)
            return 1
        profile = tune.Profile.load(path)
        stale = profile.stale(tune.machine(host_device()))
        print(f"tune profile: {path} ({profile.basis}){'; STALE: ' + stale if stale else ''}")
        for line in choices(profile):
            print(line)
        return 0
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    known = {g.name.upper(): g.name for g in GType}
    bad = [t for t in types if t.upper() not in known]
    if bad or not types:
        raise GGXValueError(f"--types: unknown weight type {bad[0] if bad else '(none)'!r}")
    run_tune(args.budget, [known[t.upper()] for t in types], args.threads)
    return 0
