"""What every command's refusal of a bad input looks like, for the tests of each command."""

from __future__ import annotations

import importlib
import itertools

from tawpipe import cli

# What each `tawpipe bench WHAT` calls first once its checks have passed: its ranks, its cluster or
# its measurement.
BENCH_STARTS = (("tawpipe.bench.overlap", "run_local"), ("tawpipe.bench.comm", "run_local"),
                ("tawpipe.bench.prefetch", "measure"), ("tawpipe.bench.context", "Cluster"),
                ("tawpipe.bench.cluster", "run_shape"))


def refused(capsys, *argv: str, prog: str | None = None) -> str:
    """Run `tawpipe ARGV` in-process: it must refuse with exit status 2 and exactly one line on
    stderr, which starts with ``prog`` (default: `tawpipe` and the (sub)command ARGV begins with);
    that line is returned."""
    capsys.readouterr()
    code = cli.main(list(argv))
    out = capsys.readouterr()
    assert code == 2, (code, out.err)
    words = list(itertools.takewhile(lambda a: not a.startswith("-"), argv))
    prog = prog or " ".join(["tawpipe", *words])
    assert out.err.count("\n") == 1 and out.err.startswith(prog + ": "), out.err
    return out.err.rstrip("\n")


def nothing_starts(monkeypatch) -> None:
    """Every bench's first step of a run fails the test: a refusal must come before it."""
    def started(*args, **kwargs):
        raise AssertionError("the bench started before it refused its input")

    for module, name in BENCH_STARTS:
        monkeypatch.setattr(importlib.import_module(module), name, started)
