"""`tawpipe bench cluster`: TawPipe against its peers on an emulated multi-node cluster.

Every method (TawPipe with one weight fetch per micro-batch and with the best k, WeiPipe,
FSDP2 default, memory-matched and resharded to the node after forward, HSDP, DDP, 1F1B; with
``--replicas R``, TawPipe at both k as R replicas of G/R nodes too) trains the same model on the
same global batch with the same optimizer, on the same namespaces and rate-limited links
(``tawpipe.cluster``). Methods are interleaved in rounds — round r runs each once, the order
rotated by r — so slow phases of a shared machine hit all of them alike. Each run is a fresh set
of processes, so peak RSS is the method's own. ``--vocab`` and ``--loss`` set the model's
vocabulary and every method's head and loss (``tawpipe.bench.baselines.head_loss``).

Per method: median iteration time and its spread, tokens/s, inter-node bytes per iteration
measured on the veth links against the prediction (the engine's own plan for TawPipe/WeiPipe,
closed forms for the peers), the network floor (busiest link direction / rate), persistent and
peak memory per rank, and an exactness check in round 0: losses of the first two steps and the
first update of every parameter against single-process training on the global batch (with
replicas: every replica's parameters, each checked on its own).

Results go into ``--out`` (default ``tawpipe-results/`` in the current directory; the committed
results are rewritten only with ``--out benchmarks/results/cluster``).

This module is the command; its parts: ``method`` (the methods, the engine in a rank, the
predicted bytes), ``runs`` (the rounds on the cluster, a method's row), ``report`` (cluster.json
and cluster.md) and ``plots``.
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ...cluster import add_link_arguments, describe_compute, host, spec_from_args
from ...commands import UsageError, as_flags, env_timeout, int_at_least, positive_float, prefetch_depth, writable
from ...cost.memory import Savers
from ...cost.units import gib
from ...plan.schedule import build_plan
from .. import DEFAULT_OUT, baselines, check_memory, provenance
from ..baselines import RunConfig
from ..footprint import engine_rank_bytes, reference_bytes, replica_rank_bytes
from .method import Method, build_engine, compute_only, engine_rank, for_shape, methods, predicted_busiest
from .plots import plots, sweep_plots
from .report import by_cluster, crossover_seq, markdown, sweep_crossovers, write_results
from .runs import LOSS_TOL, UPDATE_TOL, add_bounds, run_shape, summarize

# ---------------------------------------------------------------------------------- command line

DESCRIPTION = (
    "TawPipe against its peers (WeiPipe, FSDP2, HSDP, DDP, 1F1B) on an emulated multi-node cluster on this machine "
    "(root: network namespaces, rate-limited links, a CPU quota per rank). Every method trains the same model on "
    "the same global batch; per method it reports the time per iteration, the bytes that crossed nodes against "
    "the prediction, memory, and an exactness check against single-process training."
)


# The long-context configuration at the paper's proportions (README, "Long context"; design §7.4):
# one layer per rank as in the official code's runs; tokens per micro-batch 1.8x (2x2) and 2.6x
# (3x2) TawPipe's byte crossover with 1F1B at k = 1, where the official code's 24-GPU run is at
# 2.7x; a layer's forward (0.37 s at 0.3 core) about 0.8x the time its float32 weights take
# on the link (0.46 s at 14 Mbit/s), as a 1024-wide layer's on an A100-class GPU against 10 GbE.
PRESETS: dict[str, dict[str, Any]] = {
    "long": dict(hidden=128, heads=4, layers_per_rank=1, seq_len=[4096], micro_batches=2, batch_size=1,
                 rate="14mbit", cpus_per_rank=0.3, rounds=1, steps=3,
                 methods=["tawpipe", "tawpipe-best", "weipipe", "fsdp", "fsdp-node", "hsdp", "ddp", "1f1b"],
                 compute_only=["tawpipe-best"]),
    # the same model and cluster on 2x2 over S, across the crossover of tawpipe's best with 1F1B
    "sweep": dict(hidden=128, heads=4, layers_per_rank=1, seq_len=[256, 512, 1024, 2048, 4096], micro_batches=2,
                  batch_size=1, rate="14mbit", cpus_per_rank=0.3, rounds=1, steps=2, nodes=[2],
                  methods=["tawpipe-best", "1f1b", "hsdp", "fsdp"]),
}


class _Preset(argparse.Action):
    """Sets every option of the preset that still has its default: options given win, wherever
    they stand on the command line (one given with exactly its default value does not)."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        setattr(namespace, self.dest, value)
        for key, v in PRESETS[value].items():
            if getattr(namespace, key) == parser.get_default(key):
                setattr(namespace, key, v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, count = RunConfig(), int_at_least(1)
    p.add_argument("--preset", choices=sorted(PRESETS), action=_Preset, default=None,
                   help="long: the long-context comparison at the paper's proportions (2x2 and 3x2, 31 "
                        "minutes); sweep: the same over S on 2x2 (README, 'Long context'); other options win")
    p.add_argument("--nodes", type=count, nargs="+", default=[2, 3], help="node counts to run, one cluster each")
    p.add_argument("--per-node", type=count, default=2, help="ranks per node")
    add_link_arguments(p)
    p.add_argument("--rounds", type=count, default=3, help="rounds; each runs every method once")
    p.add_argument("--steps", type=count, default=d.steps, help="timed steps per run (after one warm-up step)")
    p.add_argument("--methods", nargs="+", default=None,
                   help="subset of: tawpipe tawpipe-best tawpipe-host weipipe fsdp fsdp-mm fsdp-node hsdp ddp 1f1b, and with "
                        "--replicas tawpipe-rR tawpipe-best-rR (default: all)")
    p.add_argument("--replicas", type=int, nargs="+", default=[], metavar="R",
                   help="also run tawpipe and the best k as R replicas of nodes/R nodes each (tawpipe-rR, "
                        "tawpipe-best-rR; engine option replicas=R), on the node counts R divides")
    p.add_argument("--seq-len", type=count, nargs="+", default=[d.seq_len],
                   help="tokens per sequence; several: one run of every shape at each (a sweep)")
    p.add_argument("--hidden", type=count, default=d.hidden, help="hidden size of the LLaMA model")
    p.add_argument("--layers", type=count, default=d.layers, help="decoder layers")
    p.add_argument("--layers-per-rank", type=count, default=None, metavar="K",
                   help="K layers per rank on every shape (replaces --layers)")
    p.add_argument("--heads", type=count, default=d.heads, help="attention heads")
    p.add_argument("--vocab", type=int_at_least(256), default=d.vocab,
                   help="vocabulary of the model (>= 256; the byte corpus uses the first 256 ids)")
    p.add_argument("--loss", choices=baselines.LOSSES, default=d.loss,
                   help="head and cross-entropy of every method: plain (the whole float32 logits) or chunked "
                        "(tawpipe.models.llama.chunked_head_loss, never holding them)")
    p.add_argument("--micro-batches", type=count, default=d.micro_batches, help="per rank and step")
    p.add_argument("--micro-batch-size", dest="batch_size", type=count, default=d.batch_size,
                   help="sequences per micro-batch")
    p.add_argument("--prefetch-depth", type=prefetch_depth, default=1,
                   help="prefetch depth (slots ahead) of tawpipe at k=1; the best k keeps every chunk resident")
    p.add_argument("--compute-only", nargs="*", default=None, metavar="METHOD",
                   help="also run these tawpipe/WeiPipe methods (none named: all of them) with the links "
                        "unlimited, in the same rounds, and report each one's time over max(network floor, "
                        "compute-only time)")
    p.add_argument("--recompute", choices=("none", "chunk"), default="none",
                   help="tawpipe and WeiPipe: keep activations like the peers (none), or recompute each "
                        "chunk in its backward as the paper does (chunk)")
    p.add_argument("--timeout", type=positive_float, default=1800.0, help="seconds one method run may take")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"directory for cluster.json, cluster.md and the PNG plots (default: {DEFAULT_OUT}/ in the "
                        "current directory; the committed results: --out benchmarks/results/cluster)")


def main(args: argparse.Namespace) -> int:
    rate = args.rate
    try:
        per_rank = args.layers_per_rank
        cfgs = [RunConfig(nodes=g, per_node=args.per_node, hidden=args.hidden,
                          layers=args.layers if per_rank is None else per_rank * g * args.per_node,
                          heads=args.heads, seq_len=seq, vocab=args.vocab, loss=args.loss,
                          micro_batches=args.micro_batches, batch_size=args.batch_size, steps=args.steps)
                for g in args.nodes for seq in args.seq_len]
        bad_r = [r for r in args.replicas if r < 2 or not any(g % r == 0 for g in args.nodes)]
        if bad_r:
            raise ValueError(f"--replicas {bad_r}: each R must be >= 2 and divide one of the node counts "
                             f"{args.nodes} (R = 1 is tawpipe itself)")
        known = methods(args.micro_batches, args.prefetch_depth, args.recompute,
                        tuple(dict.fromkeys(args.replicas)))
        names = args.methods or list(known)
        bad = [n for n in names if n not in known]
        if bad:
            raise ValueError(f"unknown method(s) {bad}; choose from {list(known)}")
        specs = [spec_from_args(args, c.nodes, c.per_node) for c in cfgs]
        free = names if args.compute_only == [] else args.compute_only or []
        bad = [n for n in free if n not in names or known[n].engine_options is None]
        if bad:
            raise ValueError(f"--compute-only {bad}: name tawpipe/WeiPipe methods that run ({names})")
        chosen = [v for m in (known[n] for n in names)
                  for v in ((m, compute_only(m)) if m.name in free and m.engine_options is not None else (m,))]
        _check_runs(cfgs, chosen)
    except ValueError as e:
        raise UsageError(as_flags(str(e))) from None
    writable(Path(args.out), "--out", directory=True)
    env_timeout()  # what the ranks' engines wait, read in every rank
    reason = host.unavailable_reason(specs[0])
    if reason:
        raise UsageError(reason)
    rate_bits = specs[0].rate_bits
    result: dict[str, Any] = {
        "benchmark": "cluster", "rate": rate, "rounds": args.rounds, "machine": provenance(),
        "engine": {"prefetch_depth": args.prefetch_depth, "recompute": args.recompute, "replicas": args.replicas},
        "pin_cpus": args.pin_cpus, "compute": describe_compute(specs[0]), "preset": args.preset,
        "shapes": [], "notes": [],
    }
    for cfg, spec in zip(cfgs, specs):
        here = [f for f in (for_shape(m, cfg.nodes, cfg.per_node) for m in chosen) if f is not None]
        print(f"tawpipe bench cluster: {cfg.nodes} nodes x {cfg.per_node} ranks, S = {cfg.seq_len}, "
              f"{rate or 'unlimited'} links, {describe_compute(spec)}, {args.rounds} rounds of {len(here)} methods",
              flush=True)
        raw = run_shape(cfg, here, spec, args.rounds, args.timeout,
                        log=functools.partial(print, flush=True))
        rows = [summarize(cfg, m, raw["runs"].get(m.name, []), raw["checks"].get(m.name), rate_bits,
                          raw["failures"].get(m.name)) for m in here]
        add_bounds(rows)
        shape = {"config": asdict(cfg), "rows": rows, "reference_losses": raw["reference_losses"],
                 "compute": describe_compute(spec), "raw": raw["runs"]}
        if raw.get("calibration"):
            shape["calibration"] = raw["calibration"]
        result["shapes"].append(shape)
        md = write_results(result, args.out)  # after every shape: a run stopped later keeps this one
    print(md)
    for path in plots(result, args.out):
        print(f"wrote {path}")
    print(f"wrote {os.path.join(args.out, 'cluster.json')} and cluster.md")
    failed = [(s["config"]["nodes"], r["method"]) for s in result["shapes"] for r in s["rows"]
              if r.get("check") and not r["check"]["ok"]]
    if failed:
        print(f"tawpipe bench cluster: these runs did NOT compute the reference update: {failed}")
        return 1
    return 0


def _check_runs(cfgs: list[RunConfig], chosen: list[Method]) -> None:
    """The plan of every TawPipe/WeiPipe run, built here first: a schedule the engine would refuse
    in its ranks (fewer layers than ranks) is refused before any cluster starts; so is a shape whose
    heaviest method's ranks, or the single-process reference on the whole global batch that runs
    before them, need more memory than this host has."""
    for cfg in cfgs:
        dims = cfg.model_config().dims(seq=cfg.seq_len, micro_batch=cfg.batch_size, dtype_bytes=4, grad_bytes=4,
                                       scores=False)
        chunked, heaviest = cfg.loss == "chunked", 0.0
        for m in (for_shape(m, cfg.nodes, cfg.per_node) for m in chosen):
            if m is None:
                continue
            if m.engine_options is None:
                heaviest = max(heaviest, replica_rank_bytes(dims, cfg.micro_batches, chunked_loss=chunked))
                continue
            options = dict(m.engine_options)
            savers = Savers(options.pop("recompute"))
            plan = build_plan(cfg.topology, cfg.layers, cfg.micro_batches, layer_numel=dims.layer_numel, weight_bytes=4,
                              grad_bytes=4, replicated_numel=dims.replicated_numel, **options)
            heaviest = max(heaviest, engine_rank_bytes(dims, plan, cfg.micro_batches, savers, chunked_loss=chunked))
        batch = cfg.world_size * cfg.micro_batches * cfg.batch_size
        reference = reference_bytes(dims, batch)
        check_memory(max(cfg.world_size * heaviest, reference),
                     f"{cfg.nodes} x {cfg.per_node} ranks of {cfg.layers} layers of width {cfg.hidden} at --seq-len "
                     f"{cfg.seq_len:,}, --micro-batches {cfg.micro_batches} of --micro-batch-size {cfg.batch_size}: "
                     f"each rank up to {gib(heaviest)}, the single-process reference on the {batch} sequences of a "
                     f"step {gib(reference)}", "use fewer or smaller --nodes, a smaller --hidden, --layers or "
                     "--seq-len, or fewer --micro-batches")


__all__ = ["DESCRIPTION", "LOSS_TOL", "PRESETS", "UPDATE_TOL", "Method", "add_arguments", "add_bounds", "build_engine",
           "by_cluster", "compute_only", "crossover_seq", "engine_rank", "for_shape", "main", "markdown", "methods",
           "plots", "predicted_busiest", "run_shape", "summarize", "sweep_crossovers", "sweep_plots", "write_results"]
