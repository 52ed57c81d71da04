"""`tawpipe bench WHAT`: the measurements behind tawpipe's claims, one per WHAT.

Results go to ``--out DIR`` (default: ``tawpipe-results/`` in the current directory); the
committed results in ``benchmarks/results/`` are rewritten only when ``--out`` names them.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from ..commands import UsageError, delegate, writable
from ..cost.units import gib
from ..engine.auto import host_available
from ..version import __version__

DESCRIPTION = (
    "The measurements behind tawpipe's claims, one per subcommand: TawPipe against its peers on an emulated "
    "cluster, communication primitives, overlap, and the host offload's streaming. Results go to --out "
    "(default: tawpipe-results/ in the current directory)."
)
DEFAULT_OUT = "tawpipe-results"  # every `tawpipe bench WHAT` writes here unless --out says otherwise

# Each module defines add_arguments(parser) and main(args) -> int, and is imported only when its
# measurement runs (tawpipe.commands): a bench that needs an optional dependency, or a GPU, costs
# nothing to the others.
_BENCHES = {
    "overlap": ("tawpipe.bench.overlap", "overlapped vs serial communication under an injected delay"),
    "cluster": ("tawpipe.bench.cluster", "tawpipe vs its peers on an emulated multi-node cluster"),
    "comm": ("tawpipe.bench.comm", "communication primitives, nccl-tests style (time, algbw, busbw)"),
    "prefetch": ("tawpipe.bench.prefetch", "pinned double-buffered host offload: bandwidth and overlap"),
    "context": ("tawpipe.bench.context", "tawpipe with and without context parallelism on an emulated cluster"),
}


def provenance() -> dict[str, Any]:
    """What produced a result file: versions, cores, and the git commit when tawpipe runs from a
    checkout, so a figure can be traced to its code."""
    return {"tawpipe": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), **checkout(Path(__file__).resolve().parent.parent)}


def checkout(package: Path) -> dict[str, Any]:
    """``commit`` and ``dirty`` (tracked files differ from it) of the git checkout whose top level
    holds ``package``; nothing for an installed copy, even one inside some other work tree."""

    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(package), *cmd], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() / package.name != package.resolve():
            return {}
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {}  # no git, or not a work tree


def result_file(out: str, name: str) -> Path:
    """Where a bench writes its JSON: ``--out`` itself where it ends in .json, else ``name`` in
    the directory ``--out``; a UsageError naming --out, before anything runs, where that cannot be
    written (an existing file given as the directory, a folder that cannot be made)."""
    if out.endswith(".json"):
        writable(Path(out), "--out", directory=False)
        return Path(out)
    writable(Path(out), "--out", directory=True)
    return Path(out) / name


def check_memory(need: float, what: str, fix: str) -> None:
    """A UsageError where ``need`` bytes of host memory are more than this host has available
    (``host_available``: MemAvailable, or a cgroup's limit), before anything is allocated or any
    rank spawned: a bench that asks for too much is refused, not killed by the kernel's OOM killer
    or the host's swap. ``what``: the flags that ask for it and how it adds up; ``fix``: what to do."""
    available = host_available()
    if available is not None and need > available[0]:
        raise UsageError(f"{what}: the bench needs about {gib(need)} ({need:,.0f} bytes) of host memory, but "
                         f"{gib(available[0])} is available ({available[1]}): {fix}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    for name, (module, help) in _BENCHES.items():
        delegate(sub, "tawpipe bench", name, module, help)
