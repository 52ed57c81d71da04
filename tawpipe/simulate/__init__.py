"""``tawpipe simulate``: what TawPipe and its peers would do on a cluster you describe (design §9).

Every method plays one iteration on a model of the cluster: TawPipe and WeiPipe from the plan the
engine would run, DDP, FSDP2 (also with intra-node reshard), HSDP and 1F1B from their schedules.
Per method it prints the time per iteration, tokens/s per device, MFU, exposed communication,
bytes per link, memory per device, whether it fits, and what sets the time; a method it cannot
play gets a row saying why; a verdict ends the run. ``--calibrate`` measures this machine's device
instead of a preset; ``--validate`` compares the simulator with ``tawpipe bench cluster`` results.

Every bad input is a ``UsageError`` raised before anything is measured or written (``_check``,
and the readers of the device and results files); so is a flag given where nothing reads it (a
run of its own's flag without it, a flag of the table with one, a method's setting without that
method), and a run in which nothing could be simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..atomic import write_atomic
from ..commands import Parser, UsageError, add_reuse_weights, as_flags, prefetch_depth, reuse_flag, writable
from ..models.presets import PRESETS
from ..models.shape import ModelDims
from ..plan.schedule import HOST, RESIDENT, compute_actions
from ..plan.topology import Topology, divisors
from ..cost.memory import Savers, savers_ladder
from ..sim import compare
from ..sim.peers import CONTEXT_PARALLEL, OFFLOADING
from ..sim.hardware import DEVICES, LINKS, Cluster, Device
from ..sim.workload import Workload, model
from .inputs import EMULATED_EFFICIENCY, link_arg, load_device, model_arg

DESCRIPTION = (
    "Predict one training iteration of TawPipe and its peers (DDP, FSDP2, HSDP, 1F1B, WeiPipe) on a "
    "cluster you describe: nodes, devices per node, the device, the links, the model and the batch. Per "
    "method it prints the time per iteration, tokens/s per device, MFU, exposed communication, bytes per "
    "link, memory per device, whether it fits and what sets the time, and it ends with a verdict: the "
    "fastest method that fits and TawPipe's margin. --advise also searches TawPipe's settings; "
    "--calibrate measures this machine's device instead of a preset; --validate compares the simulator "
    "with the results of tawpipe bench cluster; --paper and --map play the paper's setup and the map of "
    "which method wins where; --published replays training runs published by others."
)

GiB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=3, help="nodes (default: 3, the paper's)")
    c.add_argument("--per-node", type=int, default=8, help="devices per node (default: 8)")
    c.add_argument("--device", default="h100",
                   help=f"a preset ({', '.join(DEVICES)}), optionally name:memory=GiB; cpu[:quota=CORES], this "
                        f"machine's CPU measured now (one thread under that quota, an emulated rank); or a JSON "
                        f"file written by --calibrate (default: h100)")
    c.add_argument("--intra", default="nvlink", help=f"intra-node link: {', '.join(LINKS)} or a rate like 100gbit")
    c.add_argument("--inter", default="10gbe", help=f"inter-node link per node: {', '.join(LINKS)} or a rate like "
                                                     f"25gbit, 14mbit@300 (latency us), 10gbit*0.9 (efficiency)")
    c.add_argument("--rails", action="store_true", help="one inter-node link per device (rail) instead of per node")
    c.add_argument("--host", action="store_true",
                   help="play the CPU executor (gloo, one thread per rank), as on the emulated cluster; with a "
                        "device that has a transfer rate (a calibration by tawpipe bench cluster), transfers take "
                        "the ranks' compute")
    m = p.add_argument_group("model and batch")
    m.add_argument("--model", default="paper",
                   help=f"a built-in model ({', '.join(PRESETS)}) or a Hugging Face config.json")
    m.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    m.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    m.add_argument("--micro-batches", type=int, default=2, help="micro-batches per device per iteration")
    m.add_argument("--dtype-bytes", type=int, default=2, help="bytes per weight and activation (2: bf16/fp16)")
    m.add_argument("--grad-bytes", type=int, default=2, help="bytes per gradient on the wire")
    m.add_argument("--recompute", choices=("chunk", "block", "layer", "none"),
                   help="TawPipe's (design §6.2): chunk, from each chunk's input (the default); block, from each "
                        "layer's input (the peers checkpoint every block with any of these); layer, a layer at a time "
                        "after the chunk again; none: keep every activation; given, --advise keeps it")
    m.add_argument("--context-parallel", type=int, default=1, metavar="C",
                   help="TawPipe, DDP, FSDP2 and HSDP with context parallelism over C ranks of a node (each a 1/C "
                        "slice of every sequence, C times the micro-batches, so every method runs the same tokens per "
                        "device; keys and values all-gathered over the C ranks), the peers as torchtitan runs them, "
                        "TawPipe as tawpipe train --context-parallel does; WeiPipe and 1F1B as they are")
    m.add_argument("--offload-activations", action="store_true",
                   help="what the forwards keep goes to host memory: TawPipe's beside compute, DDP's, FSDP2's and "
                        "HSDP's through torch's save_on_cpu, in line with it")
    m.add_argument("--offload-state", action="store_true",
                   help="TawPipe's own chunk's weights, gradients and AdamW state in host memory, stepped there")
    m.add_argument("--loss", choices=("plain", "chunked"), default="chunked",
                   help="every method's head and loss: chunked, a slice of tokens at a time (the default); plain, "
                        "the whole float32 logits")
    t = p.add_argument_group("methods")
    t.add_argument("--methods", nargs="+", choices=compare.methods(), default=list(compare.methods()),
                   metavar="METHOD", help=f"the methods to play, of {', '.join(compare.methods())} (default: all)")
    t.add_argument("--mb-per-fetch", type=int, help="TawPipe k (default: auto, the engine's choice within the device's memory)")
    t.add_argument("--prefetch-depth", type=prefetch_depth, help="TawPipe depth (default: auto)")
    add_reuse_weights(t, default=None, help="TawPipe reuse; 'host': the fetched chunks kept in host memory "
                                            "(default: auto)")
    t.add_argument("--replicas", type=int, help="TawPipe replicas R, each over nodes/R nodes (default: 1)")
    t.add_argument("--stages", type=int, help="1F1B stages per pipeline (default: one per device)")
    t.add_argument("--advise", action="store_true",
                   help="try TawPipe's settings and name the fastest that fits; those of --replicas, --mb-per-fetch, "
                        "--prefetch-depth, --reuse-weights, --recompute, --offload-activations and --offload-state "
                        "given are kept as given")
    _modes(p)


def _modes(p: argparse.ArgumentParser) -> None:
    """The output flags, and the runs of their own instead of the table (design §9.5, §9.6)."""
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument("--timeline", type=Path, help="write TawPipe's iteration as a Chrome trace to this file")
    o.add_argument("--paper", type=Path, metavar="OUT",
                   help="instead: the paper's 24-GPU setup (3 x 8, 10 GbE, H=1024, 24 layers, S = 4k/8k/16k, "
                        "micro-batch 2, 2 micro-batches, 16-bit, recompute) against its reported margins "
                        "(paper.json, paper.md in OUT)")
    o.add_argument("--map", type=Path, metavar="OUT",
                   help="instead: the map of which method wins from 24 to 1,024 GPUs, models of 1B to 70B, S from "
                        "4k to 128k, over 10 GbE to 400 Gb (map.json, map.md, map.png in OUT)")
    o.add_argument("--jobs", type=int,
                   help="with --map: processes that play its cells (default: this machine's cores)")
    o.add_argument("--published", type=Path, metavar="OUT",
                   help="instead: training runs published by others (torchtitan's Llama 3.1 8B on H100s, FSDP and "
                        "FSDP + context parallelism) replayed, predicted tokens/s per GPU against theirs "
                        "(published.json, published.md in OUT)")
    k = p.add_argument_group("calibration")
    k.add_argument("--calibrate", type=Path, metavar="OUT",
                   help="instead: measure this machine's device at the model's shapes and write it to OUT (JSON); "
                        "--device OUT then uses it")
    k.add_argument("--calibrate-on", choices=("cpu", "cuda"), default="cpu", help="the device --calibrate measures")
    k.add_argument("--threads", type=int, help="CPU threads while calibrating")
    k.add_argument("--quota", type=float, help="CPU cores of quota per rank (the emulated cluster's)")
    v = p.add_argument_group("validation against the emulated cluster")
    v.add_argument("--validate", type=Path, nargs="+", metavar="CLUSTER_JSON",
                   help="instead: predict every row of these results of tawpipe bench cluster (cluster.json) with "
                        "the rates their ranks measured (else calibrating this machine's CPU at each shape and quota "
                        "now), and compare")
    v.add_argument("--link-efficiency", type=float, default=EMULATED_EFFICIENCY,
                   help="with --validate: the share of the shaped rate that gloo's payload reaches "
                        f"(default {EMULATED_EFFICIENCY}: the veth counters' headers over payload, 0.4-0.8%%)")
    v.add_argument("--out", type=Path, help="with --validate: write validation.json and validation.md here")


def main(args: argparse.Namespace) -> int:
    _check(args)
    if args.map:
        from ..sim.atlas_report import main_map  # matplotlib, only here

        return main_map(args.map, jobs=args.jobs or os.cpu_count() or 1)
    if args.paper:
        return _paper(args)
    if args.published:
        from .published import main_published

        return main_published(args)
    if args.validate:
        from .validate import validate  # calibrates with torch where the results do not say

        return validate(args)
    dims = model_arg(args)
    if args.calibrate:
        return _calibrate(args, dims)
    return _simulate(args, dims)


# ------------------------------------------------------------------------------ checks, before anything runs

# The runs of their own instead of the table: what each is, and the only other flags it reads (any
# other given with it would be ignored, so it is refused).
_MODES = {
    "--paper": ("plays the paper's own 24-GPU setup (its cluster, model, batch and methods)",
                ("--device", "--intra", "--inter", "--rails")),
    "--map": ("plays its own grid of clusters, models and methods", ("--jobs",)),
    "--published": ("replays published runs as their authors describe them", ()),
    "--validate": ("plays the clusters, models and rates its results files name", ("--link-efficiency", "--out")),
    "--calibrate": ("measures this machine's device at the model's shapes",
                    ("--model", "--seq-len", "--micro-batch-size", "--dtype-bytes", "--calibrate-on", "--threads",
                     "--quota")),
}
# The flags that only a run of its own reads: that run, and what the flag is.
_MODE_FLAGS = {
    "--jobs": ("--map", "is how many processes play the map's cells"),
    "--out": ("--validate", "is where --validate writes its table"),
    "--link-efficiency": ("--validate", "is the share of a shaped link's rate that --validate plays"),
    "--calibrate-on": ("--calibrate", "is the device --calibrate measures"),
    "--threads": ("--calibrate", "is how many CPU threads --calibrate measures with"),
    "--quota": ("--calibrate", "is the CPU quota per rank --calibrate measures under (the table takes it as "
                               "--device cpu:quota=CORES)"),
}
# The settings of one method's row: the methods that read each.
_SETTINGS_OF = {"--mb-per-fetch": ("tawpipe",), "--prefetch-depth": ("tawpipe",), "--reuse-weights": ("tawpipe",),
                "--no-reuse-weights": ("tawpipe",), "--replicas": ("tawpipe", "tawpipe-paper"), "--stages": ("1f1b",)}


def _check(args: argparse.Namespace) -> None:
    """UsageError for a flag whose value cannot work, naming it, before anything is measured or
    written: every flag where something reads it, every number in its range, the flags that must
    agree, the outputs writable."""
    _check_scope(args)
    for flag, low in (("--nodes", 1), ("--per-node", 1), ("--seq-len", 1), ("--micro-batch-size", 1),
                      ("--micro-batches", 1), ("--dtype-bytes", 1), ("--grad-bytes", 1), ("--replicas", 1),
                      ("--mb-per-fetch", 1), ("--stages", 2), ("--threads", 1), ("--jobs", 1)):
        value = getattr(args, flag[2:].replace("-", "_"))
        if isinstance(value, int) and value < low:
            raise UsageError(f"{flag} {value}: must be at least {low}")
    c = args.context_parallel
    if c < 1 or args.per_node % c or args.seq_len % c:
        raise UsageError(f"--context-parallel {c}: must divide --per-node {args.per_node} (it runs inside a node) and "
                         f"--seq-len {args.seq_len} (each rank a slice); use one of "
                         f"{', '.join(str(d) for d in divisors(args.per_node) if args.seq_len % d == 0)}")
    if args.quota is not None and not args.quota > 0:
        raise UsageError(f"--quota {args.quota:g}: must be a number of cores above 0, such as 0.5")
    if not 0 < args.link_efficiency <= 1:
        raise UsageError(f"--link-efficiency {args.link_efficiency:g}: must be above 0 and at most 1")
    _check_tawpipe(args)
    if args.timeline and "tawpipe" not in args.methods:
        raise UsageError("--timeline writes TawPipe's iteration: add tawpipe to --methods")
    for flag, directory in (("--timeline", False), ("--calibrate", False), ("--paper", True), ("--map", True),
                            ("--published", True), ("--out", True)):
        if getattr(args, flag[2:]):
            writable(getattr(args, flag[2:]), flag, directory=directory)


def _check_scope(args: argparse.Namespace) -> None:
    """UsageError for a flag given where nothing would read it (it would be ignored): with a run of
    its own, any flag that run does not read; without it, that run's own flags; a method's setting
    without that method among --methods."""
    modes = [flag for flag in _MODES if getattr(args, flag[2:])]
    if len(modes) > 1:
        raise UsageError(f"{modes[0]} and {modes[1]} are runs of their own: give one of them")
    for flag in _given(args):
        name = flag.split()[0]  # --reuse-weights host
        if name in _MODES:
            continue
        if modes:
            what, takes = _MODES[modes[0]]
            if name not in takes:
                only = "with it give only " + ", ".join(takes) if takes else "give it alone"
                raise UsageError(f"{flag} does not apply to {modes[0]}, which {what}: {only}")
        elif name in _MODE_FLAGS:
            mode, what = _MODE_FLAGS[name]
            raise UsageError(f"{flag} {what}: give it with {mode}")
        elif name in _SETTINGS_OF and not set(_SETTINGS_OF[name]) & {*args.methods, *["tawpipe"] * args.advise}:
            methods = _SETTINGS_OF[name]  # --advise searches TawPipe's settings, keeping those given
            rows = f"the {' and '.join(methods)} row{'s' * (len(methods) > 1)}"
            advise = ", or give --advise" * ("tawpipe" in methods)
            raise UsageError(f"{flag} sets {rows}, which --methods leaves out: add {' or '.join(methods)} to "
                             f"--methods{advise}")


def _given(args: argparse.Namespace) -> list[str]:
    """The flags given, in the parser's order (``Parser.given``: one given with exactly its default
    value is not told apart from one left out); reuse as the flag that asks for it."""
    parser = Parser(add_help=False)
    add_arguments(parser)
    return [reuse_flag(args.reuse_weights) if flag.endswith("reuse-weights") else flag for flag in parser.given(args)]


def _check_tawpipe(args: argparse.Namespace) -> None:
    """UsageError where TawPipe's settings do not fit the cluster or the batch."""
    if args.replicas and args.nodes % args.replicas:
        raise UsageError(f"--replicas {args.replicas} does not divide --nodes {args.nodes}: every replica is the same "
                         f"number of whole nodes; use one of {', '.join(map(str, divisors(args.nodes)))}")
    if args.mb_per_fetch and args.micro_batches % args.mb_per_fetch:
        raise UsageError(f"--mb-per-fetch {args.mb_per_fetch} does not divide --micro-batches {args.micro_batches}: "
                         f"each fetch serves the same number of micro-batches; use one of "
                         f"{', '.join(map(str, divisors(args.micro_batches)))}")
    if args.reuse_weights is False and args.prefetch_depth in (None, RESIDENT):
        default = " (the default)" if args.prefetch_depth is None else ""
        raise UsageError(f"--no-reuse-weights: --prefetch-depth resident{default} keeps fetched chunks only to reuse "
                         f"them; give --prefetch-depth a number of slots")


# What playing the data-parallel peers takes the simulator, measured on a 2-core machine (paper
# model, 2 nodes): milliseconds per layer of a micro-batch at a few ranks per node, DDP's and
# FSDP2's and HSDP's (whose every layer gathers and reduces), and what context parallelism's K/V
# exchanges add to any of them; each grows by (per_node / 20)^2 with the ranks of a node, whose
# ring flows share its ports (FSDP2 at 256 ranks: 64 ms, at 8: 0.44).
_PEER_MS = {"ddp": 0.05, "fsdp": 0.5, "fsdp-mm": 0.5, "fsdp-node": 0.5, "hsdp": 0.5}
_CONTEXT_MS = 0.5
MOST_PEER_SECONDS = 60  # the peers' share of a run, as compare.MOST_COMPUTE_ACTIONS is a pipeline's
MOST_ADVICE_ACTIONS = 2 * compare.MOST_COMPUTE_ACTIONS  # --advise's settings together (about two minutes)


def _check_size(args: argparse.Namespace, dims: ModelDims, settings: Sequence[dict[str, Any]]) -> None:
    """UsageError, naming the flag and how far to go, for a run too large to play in about a minute
    or two: the data-parallel peers' iteration (it grows with the micro-batches, the layers and the
    ranks of a node squared), or the settings --advise would try (the pipelines' rows have a limit
    of their own, ``compare.MOST_COMPUTE_ACTIONS``: the row says why)."""
    peers = [m for m in dict.fromkeys(args.methods) if m in _PEER_MS]
    c, acc = args.context_parallel, args.micro_batches

    def seconds(micro_batches: int, per_node: int) -> float:
        passes = micro_batches * c * (dims.layers + 1)
        return sum(passes * (_PEER_MS[m] + _CONTEXT_MS * (c > 1)) for m in peers) * (1 + (per_node / 20) ** 2) / 1e3

    if peers and seconds(acc, args.per_node) > MOST_PEER_SECONDS:
        names, took = ", ".join(peers), _duration(seconds(acc, args.per_node))
        most = int(MOST_PEER_SECONDS // seconds(1, args.per_node))
        if most >= 1:
            sliced = f" in {c} slices" if c > 1 else ""
            raise UsageError(f"--micro-batches {acc}: the data-parallel peers ({names}) play each micro-batch's "
                             f"{dims.layers} layers{sliced} on the {args.per_node} ranks of a node, which would take "
                             f"the simulator {took}; give at most --micro-batches {most} (about a minute), or leave "
                             f"{names} out of --methods")
        fits = max((p for p in range(1, args.per_node) if seconds(1, p) <= MOST_PEER_SECONDS), default=None)
        way = f"give at most --per-node {fits}, or leave" if fits else "leave"
        raise UsageError(f"--per-node {args.per_node}: the data-parallel peers ({names}) gather and reduce over the "
                         f"ranks of a node, and even one micro-batch would take the simulator "
                         f"{_duration(seconds(1, args.per_node))}; {way} {names} out of --methods")
    actions = sum(compute_actions(Topology(args.nodes, args.per_node), acc * c, s["replicas"]) for s in settings)
    if actions > MOST_ADVICE_ACTIONS:
        raise UsageError(f"--advise: its {len(settings)} settings at --micro-batches {acc} hold {actions:,} forwards "
                         f"and backwards in all, more than the {MOST_ADVICE_ACTIONS:,} it plays in about two minutes; "
                         f"give fewer --micro-batches, or --replicas or --mb-per-fetch to try fewer settings")


def _duration(seconds: float) -> str:
    """``seconds`` roughly, in the unit a person would say it."""
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 2 * size:
            return f"about {seconds / size:,.0f} {unit}"
    return f"about {seconds:,.0f} seconds"


# ------------------------------------------------------------------------------ the table and the verdict


def _simulate(args: argparse.Namespace, dims: ModelDims) -> int:
    pinned = _pinned(args)  # before the defaults fill in what was not given
    args.recompute, args.replicas = args.recompute or "chunk", args.replicas or 1
    ladder = _advice_ladder(args, pinned) if args.advise else ()
    settings = _advice_settings(args, dims, pinned) if args.advise else []
    _check_size(args, dims, settings)
    intra, inter = link_arg("--intra", args.intra), link_arg("--inter", args.inter)
    dev = load_device(args.device, dims)
    cluster = Cluster(args.nodes, args.per_node, dev, intra, inter, args.rails)
    work = Workload(dims, dev, recompute=args.recompute != "none")
    rows = [_row(method, cluster, work, args) for method in dict.fromkeys(args.methods)]  # one row per method named
    advice = _advise(cluster, work, args, ladder, settings) if args.advise else []
    played = [r for r in rows if isinstance(r, compare.Row)]
    if not played and not advice:
        raise UsageError(f"nothing was simulated: {_reasons(rows, _no_advice(pinned) if args.advise else None)}")
    if args.timeline:
        taw = next(r for r in rows if r.method == "tawpipe")
        if not isinstance(taw, compare.Row):
            raise UsageError(f"--timeline: TawPipe was not simulated: {taw.reason}")
        write_atomic(args.timeline, taw.result.chrome_trace())
    judged = compare.verdict([*played, *advice])
    said = _verdict_text(judged, rows, advice, dev)
    if args.json:
        print(json.dumps({"cluster": _describe(cluster), "model": dataclasses.asdict(dims),
                          "micro_batches": args.micro_batches, "rows": [r.to_json() for r in rows],
                          "advice": [r.to_json() for r in advice[:ADVICE_SHOWN]], "advice_tried": len(advice),
                          "verdict": _verdict_json(judged, said)},
                         indent=1))
        return 0
    print(f"{cluster.nodes} x {cluster.per_node} {dev.name}, intra {cluster.intra.name}, inter "
          f"{cluster.inter.name}{' per rail' if cluster.rails else ' per node'}; {args.model}: H={dims.hidden} "
          f"L={dims.layers} S={dims.seq} B={dims.micro_batch}, {args.micro_batches} micro-batches per device, "
          f"recompute {args.recompute}{', activations on the host' * args.offload_activations}"
          f"{f', context parallelism over {args.context_parallel}' * (args.context_parallel > 1)}"
          f"{', optimizer state on the host' * args.offload_state}, {args.loss} loss")
    print(table(rows))
    if args.advise and not advice:
        print(f"\n{_no_advice(pinned)}")
    if advice:
        shown = f"the fastest {ADVICE_SHOWN} shown" if len(advice) > ADVICE_SHOWN else "fastest first"
        kept = f" with {_pinned_flags(pinned)} as given" if pinned else ""
        print(f"\nTawPipe settings tried{kept}: {len(advice)}, {shown}:")
        print(table(advice[:ADVICE_SHOWN]))
        best = advice[0]
        print(f"advice: {_setting_flags(best.settings)} ({best.time_s:.3f} s/iteration"
              f"{'' if best.fits else ', does not fit'})")
    print(said)
    return 0


def _row(method: str, cluster: Cluster, work: Workload, args: argparse.Namespace) -> compare.Row | compare.Refusal:
    """``method``'s row with the settings the flags give it, or why it could not be played."""
    settings = {"tawpipe": _settings(args), "tawpipe-paper": {**compare.PAPER, "replicas": args.replicas},
                "1f1b": {"stages": args.stages} if args.stages else None}.get(method)
    work, acc = _sliced(method, work, args)
    try:  # the peers checkpoint as work.recompute says; save_on_cpu is their only saver here
        savers = _savers(args) if compare.schedule_of(method) else \
            Savers(offload_activations=True) if method in OFFLOADING and args.offload_activations else None
        row = compare.run(method, cluster, work, acc, host=args.host, settings=settings, savers=savers,
                          chunked_loss=args.loss == "chunked")
    except ValueError as e:  # the library's keywords (recompute='none') as the flags that set them
        return compare.Refusal(method, as_flags(str(e)))
    if work.context > 1:
        row.settings["context_parallel"] = work.context
    return row


def _sliced(method: str, work: Workload, args: argparse.Namespace) -> tuple[Workload, int]:
    """The work and the micro-batches per device ``method`` plays: under --context-parallel C, C
    slices of S/C per sequence for a method that splits them (the same tokens per device)."""
    c, acc = args.context_parallel, args.micro_batches
    if c > 1 and method in CONTEXT_PARALLEL:
        return work.sliced(c), acc * c
    return work, acc


def _savers(args: argparse.Namespace) -> Savers:
    return Savers(args.recompute, args.offload_state, args.offload_activations)


# ------------------------------------------------------------------------------ the advice

ADVICE_SHOWN = 5  # the fastest settings --advise prints (the JSON gives as many)
_PINNABLE = ("replicas", "mb_per_fetch", "prefetch_depth", "reuse_weights", "recompute")  # None: not given


def _pinned(args: argparse.Namespace) -> dict[str, Any]:
    """TawPipe's settings the flags give: --advise keeps them and searches the others."""
    return {k: getattr(args, k) for k in _PINNABLE if getattr(args, k) is not None} | \
        {k: True for k in ("offload_activations", "offload_state") if getattr(args, k)}


def _pinned_flags(pinned: dict[str, Any]) -> str:
    """``pinned`` as the flags that gave them."""
    flags = []
    for key, value in pinned.items():
        flag = "--" + key.replace("_", "-")
        flags.append(reuse_flag(value) if key == "reuse_weights" else flag if value is True else f"{flag} {value}")
    return " ".join(flags)


def _no_advice(pinned: dict[str, Any]) -> str:
    """Why --advise has nothing to show: no setting (with those given) the simulator plays."""
    kept = f" with {_pinned_flags(pinned)}" if pinned else ""
    return f"--advise: no TawPipe setting{kept} gives pipelines the simulator plays"


def _advice_ladder(args: argparse.Namespace, pinned: dict[str, Any]) -> tuple[Savers, ...]:
    """The memory savers --advise tries: the offloads given in each, the --recompute given only;
    a UsageError where the ones given do not go together."""
    ladder = savers_ladder(offload_state=args.offload_state, offload_activations=args.offload_activations)
    if "recompute" in pinned:
        try:
            Savers(pinned["recompute"], args.offload_state, args.offload_activations)
        except ValueError as e:
            raise UsageError(f"--advise: {as_flags(str(e))}") from None
        ladder = tuple(s for s in ladder if s.recompute == pinned["recompute"])
    return ladder


def _advise(cluster: Cluster, work: Workload, args: argparse.Namespace, ladder: Sequence[Savers],
            settings: Sequence[dict[str, Any]]) -> list[compare.Row]:
    """``settings`` with the memory savers of ``ladder`` tried, fastest first (``compare.advise``),
    on the work of TawPipe's row (context parallelism included)."""
    work, acc = _sliced("tawpipe", work, args)
    rows = compare.advise(cluster, work, acc, host=args.host, chunked_loss=args.loss == "chunked", ladder=ladder,
                          settings=settings)
    for row in rows if work.context > 1 else ():
        row.settings["context_parallel"] = work.context
    return rows


def _advice_settings(args: argparse.Namespace, dims: ModelDims, pinned: dict[str, Any]) -> list[dict[str, Any]]:
    """``compare.taw_settings`` with the settings given kept: the replicas and k it tries narrowed
    to those given, its depth and reuse replaced by those given (each setting once; the resident
    depth only with reuse). Its k divide --micro-batches (the plan's are C times as many under
    context parallelism, ``_sliced``), so that --mb-per-fetch can ask for the one advised."""
    acc = args.micro_batches * args.context_parallel  # TawPipe's row's, as _sliced gives them
    out: list[dict[str, Any]] = []
    for s in compare.taw_settings(args.nodes, args.per_node, dims.layers, acc):
        if args.micro_batches % s["mb_per_fetch"] or \
                any(s[k] != pinned.get(k, s[k]) for k in ("replicas", "mb_per_fetch")):
            continue
        s = {**s, **{k: pinned[k] for k in ("prefetch_depth", "reuse_weights") if k in pinned}}
        if (s["prefetch_depth"] != RESIDENT or s["reuse_weights"]) and s not in out:
            out.append(s)
    return out


def _reasons(rows: Sequence[compare.Row | compare.Refusal], advice: str | None) -> str:
    """Why the refused rows were refused: the methods that share a reason, then the reason; and
    why --advise found nothing (``advice``), where it was asked."""
    by_reason: dict[str, list[str]] = {}
    for r in rows:
        if isinstance(r, compare.Refusal):
            by_reason.setdefault(r.reason, []).append(r.method)
    said = [f"{', '.join(methods)}: {reason}" for reason, methods in by_reason.items()]
    if advice:
        said.append(advice)
    return "; ".join(said)


def table(rows: Sequence[compare.Row | compare.Refusal]) -> str:
    """One line per row; a method that was not simulated says why."""
    head = (f"{'method':<14} {'settings':<28} {'time/iter':>10} {'tok/s/dev':>10} {'MFU':>6} {'exposed':>9} "
            f"{'inter/node':>11} {'intra/dev':>10} {'memory':>10} {'fits':>4}  bottleneck")
    lines = [head, "-" * len(head)]
    for r in rows:
        if isinstance(r, compare.Refusal):
            lines.append(f"{r.method:<14} not simulated: {r.reason}")
            continue
        mem = f"{r.memory.total / GiB:.2f} GiB"
        lines.append(f"{r.method:<14} {_flags(r.settings):<28} {r.time_s:>9.3f}s {r.tokens_per_s_per_device:>10,.0f} "
                     f"{r.mfu:>6.1%} {r.exposed_comm_s:>8.3f}s {r.inter_bytes / 1e9:>8.3f} GB {r.intra_bytes / 1e9:>7.3f} GB "
                     f"{mem:>10} {'yes' if r.fits else 'no':>4}  {r.bottleneck}")
    return "\n".join(lines)


def _verdict_text(v: compare.Verdict, rows: Sequence[compare.Row | compare.Refusal], advice: Sequence[compare.Row],
                 dev: Device) -> str:
    """One line: the fastest method that fits and what sets its time, and TawPipe's margin over
    the fastest peer that fits (or its lead), with ``advice``'s best setting where it was asked."""
    if v.winner is None:
        played = [r for r in [*rows, *advice] if isinstance(r, compare.Row)]
        lean = min(played, key=lambda r: r.memory.total)
        return (f"verdict: no method fits a device's {dev.memory / GiB:.1f} GiB; the leanest, {_who(lean, advice)}, "
                f"needs {lean.memory.total / GiB:.1f} GiB")
    w, taw = v.winner, v.tawpipe
    said = (f"verdict: {_who(w, advice)} is the fastest that fits, {w.time_s:.3f} s/iteration, bottleneck: "
            f"{w.bottleneck}; ")
    if w.method in compare.TAWPIPE:
        played = any(isinstance(r, compare.Row) and r.method not in compare.TAWPIPE for r in rows)
        said += (f"the fastest peer that fits, {_who(v.peer, advice)}, {_longer(v.peer, w)}" if v.peer else
                 "no peer fits" if played else "no peer was simulated")
    elif taw is None:
        asked = any(r.method in compare.TAWPIPE for r in rows)
        said += "TawPipe was not simulated (its row says why)" if asked else "TawPipe was not among --methods"
    elif not taw.fits:
        said += f"{_who(taw, advice)} does not fit ({taw.memory.total / GiB:.1f} GiB per device)"
    else:
        said += f"{_who(taw, advice)} {_longer(taw, w)}"
    if v.margin is not None and abs(v.margin - 1) < compare.TIE:
        said += f", a tie within {compare.TIE:.0%}"
    return said


def _longer(slower: compare.Row, winner: compare.Row) -> str:
    """How much longer ``slower`` takes than ``winner``: a percentage, or a factor from twice on."""
    ratio = slower.time_s / winner.time_s
    how = f"{ratio - 1:.1%} longer" if ratio < 2 else f"{ratio:.1f} times as long"
    return f"takes {how} ({slower.time_s:.3f} s)"


def _who(r: compare.Row, advice: Sequence[compare.Row]) -> str:
    """A row's method as the verdict names it, with TawPipe's or 1F1B's settings."""
    if r.method in compare.TAWPIPE:
        return f"TawPipe's {'advised setting' if advice and r is advice[0] else 'setting'} ({_flags(r.settings)})"
    return compare.title(r.method) + (f" ({r.settings['stages']} stages)" if r.settings.get("stages") else "")


def _verdict_json(v: compare.Verdict, text: str) -> dict[str, Any]:
    def brief(r: compare.Row | None) -> dict[str, Any] | None:
        return r and {"method": r.method, "settings": r.settings, "time_s": r.time_s, "fits": r.fits,
                      "bottleneck": r.bottleneck}

    return {"winner": brief(v.winner), "tawpipe": brief(v.tawpipe), "best_peer": brief(v.peer),
            "tawpipe_margin": v.margin, "text": text}


def _settings(args: argparse.Namespace) -> dict:
    """TawPipe's row: the settings given, "auto" (the engine's choice) for the others."""
    s = dict(compare.AUTO_SETTINGS)
    for key in ("mb_per_fetch", "prefetch_depth", "reuse_weights"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    s["replicas"] = args.replicas
    return s


def _flags(s: dict) -> str:
    """A row's settings, short, for the table."""
    parts = [f"{s['stages']} stages"] if "stages" in s else []
    if "mb_per_fetch" in s or "replicas" in s:
        parts += [f"k={s.get('mb_per_fetch', 1)}", f"depth {s.get('prefetch_depth', 1)}"]
        parts += ["reuse" + " host" * (s.get("reuse_weights") == HOST)] * bool(s.get("reuse_weights"))
        parts += [f"R={s['replicas']}"] if s.get("replicas", 1) > 1 else []
    parts += [f"recompute {s['recompute']}"] if "recompute" in s else []
    parts += [f"CP {s['context_parallel']}"] if "context_parallel" in s else []
    return ", ".join(parts + ["activations on host"] * bool(s.get("offload_activations"))
                     + ["state on host"] * bool(s.get("offload_state")))


def _setting_flags(s: dict) -> str:
    """TawPipe's settings as the flags that ask for them."""
    savers = (f" --recompute {s['recompute']}" + " --offload-activations" * s.get("offload_activations", False)
              + " --offload-state" * s.get("offload_state", False)) if "recompute" in s else ""
    return (f"--replicas {s.get('replicas', 1)} --mb-per-fetch {s.get('mb_per_fetch', 1)} --prefetch-depth "
            f"{s.get('prefetch_depth', 1)} {reuse_flag(s.get('reuse_weights', False))}"
            f"{savers}")


def _describe(c: Cluster) -> dict:
    return {"nodes": c.nodes, "per_node": c.per_node, "device": dataclasses.asdict(c.device),
            "intra": dataclasses.asdict(c.intra), "inter": dataclasses.asdict(c.inter), "rails": c.rails}


def _calibrate(args: argparse.Namespace, dims: ModelDims) -> int:
    from ..sim.calibrate import calibrate  # needs torch; the rest of the simulator does not

    if args.calibrate_on == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--calibrate-on cuda: this machine has no CUDA device that torch can use")
    dev = calibrate(dims, device=args.calibrate_on, threads=args.threads, quota=args.quota)
    write_atomic(args.calibrate, json.dumps(dataclasses.asdict(dev), indent=1))
    print(f"{dev.name}: matmul {dev.matmul_flops / 1e9:,.1f} GFLOP/s, attention {dev.attention_flops / 1e9:,.1f} "
          f"GFLOP/s, memory {dev.memory_bandwidth / 1e9:,.2f} GB/s, {dev.memory / GiB:,.1f} GiB; written to "
          f"{args.calibrate}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------ the paper's setup

PAPER_MARGINS = {"weipipe": 0.118, "1f1b": 0.236, "fsdp": 0.441}  # TawPipe's throughput over each, 24 GPUs


def _paper(args: argparse.Namespace) -> int:
    """The official code's 24-GPU run on the simulator: TawPipe's throughput over WeiPipe, 1F1B
    and FSDP at each S, beside the margins the paper reports (S = 16384). The device is
    ``--device`` (the paper names none; design §9.5 gives the A100-class estimate)."""
    intra, inter = link_arg("--intra", args.intra), link_arg("--inter", args.inter)
    dev = load_device(args.device, model("paper", seq=16384, micro_batch=2))
    cluster = Cluster(3, 8, dev, intra, inter, args.rails)
    methods = ("tawpipe-paper", "tawpipe", "weipipe", "1f1b", "fsdp", "fsdp-node", "hsdp", "ddp")
    doc: dict = {"cluster": _describe(cluster), "model": "paper", "micro_batch": 2, "acc": 2, "dtype_bytes": 2,
                 "grad_bytes": 2, "recompute": True, "paper_margins_at_16384": PAPER_MARGINS, "rows": []}
    lines = [f"3 x 8 {dev.name}, {cluster.intra.name} inside a node, {cluster.inter.name} between nodes; H = 1024, "
             f"24 layers, 32 heads, micro-batch 2, 2 micro-batches per GPU, 16-bit weights and gradients, recompute",
             "", "| S | method | s/iter | tokens/s/GPU | TawPipe (paper's k=1) faster by | bottleneck | memory GiB |",
             "|---|---|---|---|---|---|---|"]
    for seq in (4096, 8192, 16384):
        dims = model("paper", seq=seq, micro_batch=2, dtype_bytes=2, grad_bytes=2)
        work = Workload(dims, dev, recompute=True)
        rows = {m: compare.run(m, cluster, work, 2, settings=compare.BEST if m == "tawpipe" else None)
                for m in methods}
        taw = rows["tawpipe-paper"].time_s
        for m, r in rows.items():
            gain = r.time_s / taw - 1
            doc["rows"].append({"seq": seq, **r.to_json(), "tawpipe_paper_gain": gain})
            lines.append(f"| {seq} | {m} | {r.time_s:.3f} | {r.tokens_per_s_per_device:,.0f} | "
                         f"{'' if m == 'tawpipe-paper' else f'{gain:+.1%}'} | {r.bottleneck} | "
                         f"{r.memory.total / GiB:.1f} |")
    claims = {m: g for m, g in PAPER_MARGINS.items()}
    last = {r["method"]: r["tawpipe_paper_gain"] for r in doc["rows"] if r["seq"] == 16384}
    lines += ["", "At S = 16384, TawPipe's gain (throughput, the paper's schedule) over each peer the paper reports:", "",
              "| over | paper | simulated |", "|---|---|---|"]
    lines += [f"| {m} | +{claims[m]:.1%} | {last[m]:+.1%} |" for m in claims]
    md = "\n".join(lines)
    print(md)
    args.paper.mkdir(parents=True, exist_ok=True)
    write_atomic(args.paper / "paper.json", json.dumps(doc, indent=1))
    write_atomic(args.paper / "paper.md", md + "\n")
    return 0
