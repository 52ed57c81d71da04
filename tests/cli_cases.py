"""What every command's refusal of a bad input looks like, for the tests of each command."""

from __future__ import annotations

from tawpipe import cli


def refused(capsys, *argv: str) -> str:
    """Run `tawpipe ARGV` in-process: it must refuse with exit status 2 and exactly one line on
    stderr, which starts with the command's name; that line is returned."""
    capsys.readouterr()
    code = cli.main(list(argv))
    out = capsys.readouterr()
    assert code == 2, (code, out.err)
    prog = "tawpipe " + argv[0] if argv and not argv[0].startswith("-") else "tawpipe"
    assert out.err.count("\n") == 1 and out.err.startswith(prog), out.err
    return out.err.rstrip("\n")
