"""`tawpipe cluster run` and `tawpipe cluster down`, and the link options every command that builds
a cluster shares (``add_link_arguments``, ``spec_from_args``)."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..commands import UsageError, int_at_least, positive_float
from . import host
from .counters import network_floor
from .spec import ClusterError, ClusterSpec, describe_compute, parse_rate
from .supervise import Cluster, sweep

DESCRIPTION = (
    "An emulated multi-node cluster on this machine (root): one network namespace per node, rate-limited links "
    "between them, a CPU quota per rank. 'run' starts a function or a command on every rank with torchrun's "
    "environment and prints the bytes that crossed each node's link; 'down' removes what dead launchers left."
)


def rate_arg(text: str) -> str | None:
    """The argparse type of every ``--rate``: a tc rate, or None for 'none' (no limit); refused
    naming the flag while the command line is read, not when the cluster is built."""
    if text.lower() == "none":
        return None
    try:
        parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    """The options of every command that builds a cluster: ``ClusterSpec``'s rate (None for
    'none'), queue, pinning and compute (see :func:`spec_from_args`)."""
    p.add_argument("--rate", default="100mbit", type=rate_arg,
                   help="link rate per direction, tc syntax; 'none': no limit")
    p.add_argument("--queue-ms", type=int_at_least(1), default=400,
                   help="bulk queue length in ms (acknowledgements bypass it)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="pin each rank to one core, round-robin (default: the kernel places them)")
    p.add_argument("--compute", choices=("fixed", "shared"), default="fixed",
                   help="fixed (default): each rank gets a CPU quota of its own (a cgroup), so time it spends "
                        "waiting is lost as on a GPU; shared: ranks lend each other idle cores, and waiting "
                        "looks nearly free")
    p.add_argument("--cpus-per-rank", type=float, default=None, metavar="CORES",
                   help="fixed compute: cores of quota per rank (default: this machine's cores / ranks)")


def spec_from_args(args: argparse.Namespace, nodes: int, per_node: int) -> ClusterSpec:
    """The cluster of ``nodes`` x ``per_node`` that the options of :func:`add_link_arguments` ask for."""
    return ClusterSpec(nodes, per_node, args.rate, args.queue_ms, pin_cpus=args.pin_cpus, compute=args.compute,
                       cpus_per_rank=args.cpus_per_rank)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    r = sub.add_parser("run", help="run a function or a command on every rank of an emulated cluster",
                       description="Build the cluster, run TARGET on every rank, print each node's "
                                   "inter-node bytes, tear everything down.")
    r.add_argument("--nodes", type=int, default=2, help="emulated nodes (network namespaces)")
    r.add_argument("--per-node", type=int, default=2, help="ranks per node")
    add_link_arguments(r)
    r.add_argument("--timeout", type=positive_float, default=600.0, help="seconds before the ranks are stopped")
    r.add_argument("target", nargs=argparse.REMAINDER, metavar="-- TARGET ...",
                   help="'module:function [ARG ...]' (called as function(rank, *ARGs) after "
                        "torch.distributed is initialised; returns JSON) or a command, e.g. "
                        "'python -m tawpipe train --steps 2'")
    d = sub.add_parser("down", help="remove namespaces (and their processes) left by dead launchers")
    d.add_argument("--all", action="store_true", help="also those of launchers still running")


def _resolve(target: Sequence[str]) -> Callable[..., Any] | None:
    """The function named by 'module:function', or None when ``target`` is a command."""
    if len(target) == 0 or not re.fullmatch(r"[\w.]+:\w+", target[0]):
        return None
    module, name = target[0].split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"cannot import {target[0]}: {e}") from None


def main(args: argparse.Namespace) -> int:
    if args.action == "down":
        namespaces, groups, errors = sweep(everything=args.all)
        print(f"tawpipe cluster down: removed {namespaces} namespace(s) and {groups} cgroup(s)"
              + "".join(f"\n  {e}" for e in errors))
        return 1 if errors else 0
    target = [a for a in args.target if a != "--"] if args.target[:1] == ["--"] else list(args.target)
    if not target:
        raise UsageError("nothing to run; give '-- module:function' or '-- command'")
    try:
        spec = spec_from_args(args, args.nodes, args.per_node)
    except ValueError as e:
        raise UsageError(str(e)) from None
    fn = _resolve(target)
    reason = host.unavailable_reason(spec)
    if reason:
        raise UsageError(reason)
    try:
        return _run(spec, fn, target, args.timeout)
    except ClusterError as e:  # a rank that failed or timed out, a link tc refused: the message, not a traceback
        print(f"tawpipe cluster run: {e}", file=sys.stderr)
        return 1


def _run(spec: ClusterSpec, fn: Callable[..., Any] | None, target: Sequence[str], timeout: float) -> int:
    with Cluster(spec) as c:
        print(f"tawpipe cluster: {spec.nodes} nodes x {spec.per_node} ranks, links {spec.rate or 'unlimited'} "
              f"each way, {describe_compute(spec)}, namespaces {spec.run_id}-*", flush=True)
        before = c.link_bytes()
        t0 = time.perf_counter()
        results = c.run(fn, *target[1:], timeout=timeout, quiet=False) if fn else \
            c.run(target, timeout=timeout, quiet=False)
        seconds = time.perf_counter() - t0
        moved = [b - a for a, b in zip(before, c.link_bytes())]
    if fn:
        for rank, value in enumerate(results):
            print(f"rank {rank}: {json.dumps(value)}")
    print(f"done in {seconds:.1f} s; inter-node bytes per node (sent / received, veth counters):")
    for g, b in enumerate(moved):
        print(f"  node {g}: {b.tx / 1e6:.3f} MB / {b.rx / 1e6:.3f} MB")
    if spec.rate_bits:
        print(f"network floor of the whole run: {network_floor(moved, spec.rate_bits):.2f} s")
    return 0
