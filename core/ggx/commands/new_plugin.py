"""`ggx new-plugin NAME [--dir D]`: write a complete third-party plugin package to start from.

The package (D/ggx-NAME/) holds a pyproject with the `ggx.plugins` entry point, a device, backend
and buffer type built on ggx's host buffer type with a few numpy kernels (the other ops are
refused, so they run elsewhere), a README and a test that runs the conformance suite. A name
that an installed or built-in plugin, or one of their devices, already has is refused (the
registry would fail the new plugin).
"""
from __future__ import annotations

import argparse

from .argtypes import existing_dir


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("new-plugin", help="write a new plugin package to start from",
                              description="Write a complete third-party plugin package (device, backend, "
                                          "entry point, README, conformance test).")
    p.add_argument("name", help="plugin name, e.g. 'mydev' (gives device 'mydev', distribution 'ggx-mydev')")
    p.add_argument("--dir", type=existing_dir, default=".",
                   help="directory to create the package in; it must exist (default: current)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..scaffold import names, write_plugin

    root = write_plugin(args.name, args.dir)
    n = names(args.name)
    print(f"wrote {root}")
    print(f"next: pip install -e {root} && ggx devices && ggx test-ops -b {n['device']}")
    return 0
