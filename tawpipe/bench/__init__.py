"""`tawpipe bench WHAT`: measurements that back the library's claims, one module per measurement.

Each module in ``_BENCHES`` defines ``add_arguments(parser)`` and ``main(args) -> int`` and is
imported only when its measurement runs (so a bench that needs an optional dependency, or a GPU,
costs nothing to the others).
"""

from __future__ import annotations

import argparse
import importlib

_BENCHES = {
    "overlap": ("tawpipe.bench.overlap", "overlapped vs serial communication under an injected delay"),
    "cluster": ("tawpipe.bench.cluster", "tawpipe vs its peers on an emulated multi-node cluster"),
    "comm": ("tawpipe.bench.comm", "communication primitives, nccl-tests style (time, algbw, busbw)"),
    "prefetch": ("tawpipe.bench.prefetch", "pinned double-buffered host offload: bandwidth and overlap"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    for name, (module, help) in _BENCHES.items():
        q = sub.add_parser(name, help=help, description=help)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            q.set_defaults(bench_main=_missing(name, module))
            continue
        mod.add_arguments(q)
        q.set_defaults(bench_main=mod.main)


def _missing(name: str, module: str):
    def main(_args: argparse.Namespace) -> int:
        raise SystemExit(f"tawpipe bench {name}: not available in this installation ({module} is missing)")

    return main


def main(args: argparse.Namespace) -> int:
    return int(args.bench_main(args) or 0)
