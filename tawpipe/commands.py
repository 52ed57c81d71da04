"""What the ``tawpipe`` subcommands share: one parser class, one error style, one vocabulary, and
subcommands whose module is imported only when they run.

``tawpipe train``, ``bench``, ``cluster`` and ``simulate``, and each ``tawpipe bench WHAT``, live in
modules of their own that may need optional dependencies (torch among them). Such a module defines
``DESCRIPTION`` (one paragraph for its ``--help``), ``add_arguments(parser)`` and
``main(args) -> int``, or registers further delegated subcommands in ``add_arguments``.

Every bad input ends the same way, whatever the command: ``PROG: MESSAGE`` on one line of stderr
and exit status 2, before anything is measured or started. A module raises ``UsageError`` for it;
argparse's own errors take the same road, with the closest flag suggested for a mistyped one and
the new name given for a flag that was renamed. The argparse types ``int_at_least``,
``positive_float``, ``nonnegative_float`` and ``prefetch_depth`` refuse a number out of its range
while the command line is read, ``writable`` an output that cannot be written, and
``env_timeout`` a bad ``$TAWPIPE_TIMEOUT``, before a run finds any of them.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import math
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from .plan.schedule import HOST, RESIDENT
from .runtime.timeout import default_timeout

# One name per concept across train, plan, simulate and bench (torchtitan's seq_len, Megatron's
# micro-batch size); a spelling used before is refused with the one to use now.
RENAMED = {
    "--seq": "--seq-len",
    "--acc": "--micro-batches",
    "--micro-batch": "--micro-batch-size",
    "--batch-size": "--micro-batch-size",
    "--preset": "--model",
    "--link-gbps": "--inter",
    "--no-recompute": "--recompute none",
}


# The library's keywords (in its messages) as the commands' flags.
FLAGS = {
    "num_layers": "--layers",
    "micro_batches": "--micro-batches",
    "mb_per_fetch": "--mb-per-fetch",
    "prefetch_depth": "--prefetch-depth",
    "reuse_weights": "--reuse-weights",
    "memory_budget": "--memory-budget",
    "MemoryPolicy.budget": "--memory-budget",
    "grad_route": "--grad-route",
    "replicas": "--replicas",
    "algo": "--algo",
    "recompute": "--recompute",
    "offload_activations": "--offload-activations",
    "offload_state": "--offload-state",
    "context_parallel": "--context-parallel",
    "Topology.nodes": "--nodes",
    "Topology.per_node": "--per-node",
}


def as_flags(message: str) -> str:
    """``message`` of the library with its keywords as the command's flags: ``mb_per_fetch=3`` as
    ``--mb-per-fetch 3``, ``reuse_weights=True`` as ``--reuse-weights``, a bare ``prefetch_depth``
    as ``--prefetch-depth``."""
    def value(m: re.Match) -> str:
        flag, text = FLAGS[m[1]], m[2].strip("'\"")
        if text in ("True", "False"):
            return flag if text == "True" else "--no-" + flag[2:]
        return f"{flag} {text}"

    names = "|".join(sorted(map(re.escape, FLAGS), key=len, reverse=True))
    message = re.sub(rf"\b({names})=('[^']*'|\"[^\"]*\"|[^\s,;:)]+)", value, message)
    bare = "|".join(re.escape(n) for n in FLAGS if "_" in n or "." in n)
    return re.sub(rf"(?<![-\w])({bare})\b", lambda m: FLAGS[m[1]], message)


def add_reuse_weights(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: object,
                      help: str) -> None:
    """``--reuse-weights`` (True), ``--reuse-weights host`` (and the fetched chunks the staging
    buffers cannot keep kept in host memory, design §3.2) and ``--no-reuse-weights`` (False): one
    ``reuse_weights``, as ``build_plan`` takes it; a string default ("auto") may be given as a value too."""
    values = (HOST, default) if isinstance(default, str) else (HOST,)

    def value(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"expected no value or one of {', '.join(map(repr, values))} ('host': "
                                             f"keep the fetched chunks in host memory), got {text!r}")
        return text

    parser.add_argument("--reuse-weights", nargs="?", const=True, default=default, type=value, metavar="host",
                        help=help)
    parser.add_argument("--no-reuse-weights", dest="reuse_weights", action="store_false",
                        help="fetch a chunk again for every use but a turnaround (the paper's schedule)")


def reuse_flag(reuse: bool | str) -> str:
    """``reuse_weights`` as the flag that asks for it."""
    return "--reuse-weights host" if reuse == HOST else "--reuse-weights" if reuse else "--no-reuse-weights"


class UsageError(ValueError):
    """A bad input found before anything runs: the command prints ``PROG: MESSAGE`` on one line
    and exits with status 2. The message names the flag or file and what to do instead; ``prog``:
    the (sub)command that found it, where that is not the one that prints it."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


def int_at_least(low: int) -> Callable[[str], int]:
    """The argparse ``type`` of a count that cannot be below ``low`` (ranks, sizes, steps): a value
    below it is refused while the command line is read, naming the flag, not deep in a run."""

    def value(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {number}")
        return number

    return value


def positive_float(text: str) -> float:
    """The argparse ``type`` of a finite number above 0 (seconds to wait, a ratio)."""
    return _finite(text, zero=False)


def nonnegative_float(text: str) -> float:
    """The argparse ``type`` of a finite number >= 0, for a flag whose help says what 0 means."""
    return _finite(text, zero=True)


def _finite(text: str, *, zero: bool) -> float:
    bound = ">= 0" if zero else "> 0"
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}") from None
    if not (math.isfinite(number) and (number >= 0 if zero else number > 0)):
        raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text}")
    return number


def prefetch_depth(text: str) -> int | str:
    """The argparse ``type`` of every command's ``--prefetch-depth``: a number of slots or 'resident',
    a depth below 1 refused while the command line is read: weights for slot t + d are fetched
    during slot t into one of d + 1 staging buffers, so no plan has one (design §2; the planner
    refused it later, or the engine in every rank)."""
    if text == RESIDENT:
        return text
    try:
        depth = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of slots or {RESIDENT!r}, got {text!r}") from None
    if depth < 1:
        raise argparse.ArgumentTypeError(f"expected a number of slots >= 1 or {RESIDENT!r}, got {depth}")
    return depth


def env_timeout() -> float:
    """``$TAWPIPE_TIMEOUT`` (300 s when unset), read by a command whose waits (or its ranks') use it:
    a UsageError saying what to set where it is not a number of seconds > 0, before anything starts
    rather than in every rank."""
    try:
        return default_timeout()
    except ValueError as e:
        raise UsageError(str(e)) from None


def writable(path: Path, flag: str, *, directory: bool) -> None:
    """UsageError unless ``path`` can be written (``directory``: made, then filled), found by
    creating a scratch file where it would go; nothing is made."""
    if directory and path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: is a file; it needs a directory")
    if not directory and path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; name a file")
    where = path
    if directory:
        while not where.exists():  # made with its parents: the deepest one there must take it
            where = where.parent
    else:
        where = path.parent
    if not where.is_dir():
        raise UsageError(f"{flag} {path}: {where} {'is not a directory' if where.exists() else 'does not exist'}")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {where} ({e.strerror})") from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown where there is one worth showing (not None, False or a list of them)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default" in text or _nothing_to_show(action.default):
            return text
        if action.option_strings and action.nargs != 0:
            return text + " (default: %(default)s)"
        return text


def _nothing_to_show(default: object) -> bool:
    """None, False, SUPPRESS or an empty list, by identity: a default of 0 is worth showing, though
    ``0 == False``."""
    return default is None or default is False or default is argparse.SUPPRESS or default == []


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with tawpipe's error style: no prefix abbreviations (a prefix of
    a renamed flag must not slip through), and every error a ``UsageError``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = re.findall(r"'([^']*)'", choice[2])
            message += _did_you_mean(choice[1], options, quote=True)
        raise UsageError(message, prog=self.prog)

    def refuse_unknown(self, rest: Sequence[str]) -> None:
        """UsageError for arguments ``parse_known_args`` left over, naming the first: its new name
        where it was renamed, else the closest flag of this parser."""
        if not rest:
            return
        first = rest[0]
        flag = first.split("=", 1)[0]
        if flag in RENAMED:
            raise UsageError(f"{flag} is now {RENAMED[flag]}; see {self.prog} --help")
        if flag.startswith("-"):
            raise UsageError(f"unrecognized argument {first}{_did_you_mean(flag, self.flags())}; "
                             f"see {self.prog} --help")
        raise UsageError(f"unrecognized argument {first!r}; see {self.prog} --help")

    def flags(self) -> list[str]:
        """Every long option string of this parser."""
        return [o for a in self._actions for o in a.option_strings if o.startswith("--")]

    def given(self, args: argparse.Namespace, dests: Iterable[str] | None = None) -> list[str]:
        """The flags among ``dests`` (None: every flag's, in the parser's order) whose value is not
        their default (a string default compared as the flag's type reads it, as argparse does), in
        the order of ``dests``: those the user gave, but for a default given again."""
        actions: dict[str, argparse.Action] = {}
        for a in self._actions:  # the first of a dest's flags sets its default, as in parse_args
            if a.option_strings and a.default is not argparse.SUPPRESS:
                actions.setdefault(a.dest, a)
        out = []
        for dest in actions if dests is None else dests:
            action = actions[dest]
            default = action.default
            if isinstance(default, str) and action.type is not None:
                default = action.type(default)
            if getattr(args, dest) != default:
                out.append(max(action.option_strings, key=len))
        return out


def _did_you_mean(word: str, options: Iterable[str], quote: bool = False) -> str:
    """`` (did you mean X?)`` for the option closest to ``word``, compared without leading dashes;
    nothing where none is close."""
    names = {o.lstrip("-"): o for o in options}
    close = difflib.get_close_matches(word.lstrip("-"), list(names), n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {names[close[0]]!r}?)" if quote else f" (did you mean {names[close[0]]}?)"


def delegate(subparsers: argparse._SubParsersAction, prog: str, name: str, module: str, help: str) -> None:
    """Register ``name`` under ``subparsers``: its arguments are parsed by ``module``, imported when
    the subcommand runs (so listing the subcommands imports nothing)."""
    p = subparsers.add_parser(name, help=help, add_help=False)
    p.set_defaults(run=lambda _args, rest: run(f"{prog} {name}", module, rest))


def run(prog: str, module: str, argv: Sequence[str]) -> int:
    """Import ``module``, parse ``argv`` with its arguments and run it (or its chosen subcommand).
    A ``UsageError`` on the way is printed as one line; the exit status is then 2."""
    try:
        mod = load(prog, module)
        parser = Parser(prog=prog, description=getattr(mod, "DESCRIPTION", None))
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(parser)
        args, rest = parser.parse_known_args(list(argv))
        if hasattr(args, "run"):  # a further delegated subcommand was chosen
            return args.run(args, rest)
        parser.refuse_unknown(rest)
        return int(mod.main(args) or 0)
    except UsageError as e:
        return refuse(prog, e)


def refuse(prog: str, error: BaseException) -> int:
    """Print ``error`` as ``PROG: MESSAGE`` on one line of stderr (the prog of the subcommand that
    found it, where it says); the exit status of a bad input."""
    print(f"{getattr(error, 'prog', None) or prog}: {' '.join(str(error).split())}", file=sys.stderr)
    return 2


def load(prog: str, module: str) -> ModuleType:
    """``module``, or a clear exit where this installation lacks it (an optional part)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise SystemExit(f"{prog}: not available in this installation ({module} is missing)") from None
