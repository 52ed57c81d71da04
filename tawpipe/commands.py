"""What the ``tawpipe`` subcommands share: a subcommand whose module is imported only when it runs.

``tawpipe train``, ``bench`` and ``cluster``, and each ``tawpipe bench WHAT``, live in modules of
their own that may need optional dependencies. Such a module defines ``add_arguments(parser)``
and ``main(args) -> int``, or registers further delegated subcommands in ``add_arguments``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from types import ModuleType


def delegate(subparsers: argparse._SubParsersAction, prog: str, name: str, module: str, help: str) -> None:
    """Register ``name`` under ``subparsers``: its arguments are parsed by ``module``, imported when
    the subcommand runs (so listing the subcommands imports nothing)."""
    p = subparsers.add_parser(name, help=help, add_help=False)
    p.set_defaults(run=lambda _args, rest: run(f"{prog} {name}", module, rest))


def run(prog: str, module: str, argv: Sequence[str]) -> int:
    """Import ``module``, parse ``argv`` with its arguments and run it (or its chosen subcommand)."""
    mod = load(prog, module)
    parser = argparse.ArgumentParser(prog=prog, description=mod.__doc__)
    if hasattr(mod, "add_arguments"):
        mod.add_arguments(parser)
    args, rest = parser.parse_known_args(list(argv))
    if hasattr(args, "run"):  # a further delegated subcommand was chosen
        return args.run(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(mod.main(args) or 0)


def load(prog: str, module: str) -> ModuleType:
    """``module``, or a clear exit where this installation lacks it (an optional part)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise SystemExit(f"{prog}: not available in this installation ({module} is missing)") from None
