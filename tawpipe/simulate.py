"""``tawpipe simulate``: what TawPipe and its peers would do on a cluster you describe (design §9).

Every method plays one iteration on a model of the cluster: TawPipe and WeiPipe from the plan the
engine would run, DDP, FSDP2 (also with intra-node reshard), HSDP and 1F1B from their schedules.
Per method it prints the time per iteration, tokens/s per device, MFU, exposed communication,
bytes per link, memory per device, whether it fits, and what sets the time; a method it cannot
play gets a row saying why; a verdict ends the run. ``--calibrate`` measures this machine's device
instead of a preset; ``--validate`` compares the simulator with ``tawpipe bench cluster`` results.

Every bad input is a ``UsageError`` raised before anything is measured or written (``_check``,
and the readers of the device and results files); a run in which nothing could be simulated is
one too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cluster import shaper_burst
from .commands import UsageError
from .models.shape import ModelDims
from .plan.schedule import RESIDENT, prefetch_depth_arg
from .sim import compare
from .models.presets import PRESETS
from .sim.hardware import DEVICES, LINKS, Cluster, Device, Link, device, link
from .sim.workload import Workload, model

DESCRIPTION = (
    "Predict one training iteration of TawPipe and its peers (DDP, FSDP2, HSDP, 1F1B, WeiPipe) on a "
    "cluster you describe: nodes, devices per node, the device, the links, the model and the batch. Per "
    "method it prints the time per iteration, tokens/s per device, MFU, exposed communication, bytes per "
    "link, memory per device, whether it fits and what sets the time, and it ends with a verdict: the "
    "fastest method that fits and TawPipe's margin. --advise also searches TawPipe's settings; "
    "--calibrate measures this machine's device instead of a preset; --validate compares the simulator "
    "with the results of tawpipe bench cluster; --paper and --map play the paper's setup and the map of "
    "which method wins where."
)

GiB = 2**30
EMULATED_EFFICIENCY = 0.994  # payload per byte the shaper meters (GSO packets: ~0.5% headers, measured)
LOOPBACK = "8gbit@50"  # inside an emulated node: loopback TCP between two rank processes


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
    m.add_argument("--recompute", choices=("chunk", "none"), default="chunk",
                   help="chunk: run each layer's forward again in backward; none: keep its activations")
    t = p.add_argument_group("methods")
    t.add_argument("--methods", nargs="+", choices=compare.methods(), default=list(compare.methods()),
                   metavar="METHOD", help=f"the methods to play, of {', '.join(compare.methods())} (default: all)")
    t.add_argument("--mb-per-fetch", type=int, help="TawPipe k (default: --micro-batches)")
    t.add_argument("--prefetch-depth", type=prefetch_depth_arg, help="TawPipe depth (default: resident)")
    t.add_argument("--reuse-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="TawPipe reuse (default: on)")
    t.add_argument("--replicas", type=int, default=1, help="TawPipe replicas R, each over nodes/R nodes (default: 1)")
    t.add_argument("--stages", type=int, help="1F1B stages per pipeline (default: one per device)")
    t.add_argument("--advise", action="store_true", help="try TawPipe's settings and name the fastest that fits")
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
        from .sim.atlas import main_map  # matplotlib, only here

        return main_map(args.map)
    if args.paper:
        return _paper(args)
    if args.validate:
        return _validate(args)
    dims = _model(args)
    if args.calibrate:
        return _calibrate(args, dims)
    return _simulate(args, dims)


# ------------------------------------------------------------------------------ checks, before anything runs

_MODES = ("--paper", "--map", "--validate", "--calibrate")  # each a run of its own instead of the table


def _check(args: argparse.Namespace) -> None:
    """UsageError for a flag whose value cannot work, naming it, before anything is measured or
    written: every number in its range, the flags that must agree, the outputs writable."""
    modes = [flag for flag in _MODES if getattr(args, flag[2:])]
    if len(modes) > 1:
        raise UsageError(f"{modes[0]} and {modes[1]} are runs of their own: give one of them")
    for flag, low in (("--nodes", 1), ("--per-node", 1), ("--seq-len", 1), ("--micro-batch-size", 1),
                      ("--micro-batches", 1), ("--dtype-bytes", 1), ("--grad-bytes", 1), ("--replicas", 1),
                      ("--mb-per-fetch", 1), ("--prefetch-depth", 1), ("--stages", 2), ("--threads", 1)):
        value = getattr(args, flag[2:].replace("-", "_"))
        if isinstance(value, int) and value < low:
            raise UsageError(f"{flag} {value}: must be at least {low}")
    if args.quota is not None and not args.quota > 0:
        raise UsageError(f"--quota {args.quota:g}: must be a number of cores above 0, such as 0.5")
    if not 0 < args.link_efficiency <= 1:
        raise UsageError(f"--link-efficiency {args.link_efficiency:g}: must be above 0 and at most 1")
    _check_tawpipe(args)
    if args.timeline and "tawpipe" not in args.methods:
        raise UsageError("--timeline writes TawPipe's iteration: add tawpipe to --methods")
    if args.out and not args.validate:
        raise UsageError("--out is where --validate writes its table: give it with --validate")
    for flag, directory in (("--timeline", False), ("--calibrate", False), ("--paper", True), ("--map", True),
                            ("--out", True)):
        if getattr(args, flag[2:]):
            _writable(getattr(args, flag[2:]), flag, directory=directory)


def _check_tawpipe(args: argparse.Namespace) -> None:
    """UsageError where TawPipe's settings do not fit the cluster or the batch."""
    if args.nodes % args.replicas:
        raise UsageError(f"--replicas {args.replicas} does not divide --nodes {args.nodes}: every replica is the same "
                         f"number of whole nodes; use one of {', '.join(map(str, _divisors(args.nodes)))}")
    if args.mb_per_fetch and args.micro_batches % args.mb_per_fetch:
        raise UsageError(f"--mb-per-fetch {args.mb_per_fetch} does not divide --micro-batches {args.micro_batches}: "
                         f"each fetch serves the same number of micro-batches; use one of "
                         f"{', '.join(map(str, _divisors(args.micro_batches)))}")
    if args.reuse_weights is False and args.prefetch_depth in (None, RESIDENT):
        default = " (the default)" if args.prefetch_depth is None else ""
        raise UsageError(f"--no-reuse-weights: --prefetch-depth resident{default} keeps fetched chunks only to reuse "
                         f"them; give --prefetch-depth a number of slots")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _writable(path: Path, flag: str, *, directory: bool) -> None:
    """UsageError unless ``path`` can be written (``directory``: made, then filled), found by
    creating a scratch file where it would go."""
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


def _model(args: argparse.Namespace) -> ModelDims:
    try:
        return model(args.model, seq=args.seq_len, micro_batch=args.micro_batch_size, dtype_bytes=args.dtype_bytes,
                     grad_bytes=args.grad_bytes)
    except ValueError as e:  # the model registry's errors name --model themselves
        raise UsageError(str(e) if "--model" in str(e) else f"--model: {e}") from None


def _link(flag: str, spec: str) -> Link:
    try:
        return link(spec)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def _read_json(path: Path, flag: str) -> Any:
    """The JSON in ``path``, or a UsageError naming the flag, the file and what is wrong with it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{flag} {path}: is a directory; name the JSON file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {path}: cannot read it as text ({getattr(e, 'strerror', None) or e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag} {path}: not JSON, or cut short ({e.msg} at line {e.lineno}, column {e.colno})"
                         ) from None


_DEVICE_FIELDS = {f.name: f.default is dataclasses.MISSING for f in dataclasses.fields(Device)}  # name: required


def _device_from(doc: Any, where: str) -> Device:
    """The ``Device`` a calibration wrote (``dataclasses.asdict``), or a UsageError naming
    ``where`` it came from and what is wrong with it."""
    required = [k for k, needed in _DEVICE_FIELDS.items() if needed]
    if not isinstance(doc, dict) or not set(required) <= doc.keys():
        raise UsageError(f"{where}: not a device written by --calibrate (it needs {', '.join(required)})")
    unknown = sorted(doc.keys() - _DEVICE_FIELDS.keys())
    if unknown:
        raise UsageError(f"{where}: not a device written by --calibrate (it has {', '.join(unknown)})")
    numbers = [k for k, v in doc.items() if k != "name" and v is not None
               and (isinstance(v, bool) or not isinstance(v, (int, float)))]
    if numbers or not isinstance(doc["name"], str):
        raise UsageError(f"{where}: {', '.join(numbers) or 'name'} must be a {'number' if numbers else 'string'}")
    try:
        return Device(**doc)
    except ValueError as e:
        raise UsageError(f"{where}: {e}") from None


def load_device(spec: str, dims: ModelDims) -> Device:
    """A preset, a device JSON written by ``--calibrate``, or ``cpu[:quota=CORES]``: this
    machine's CPU measured now at ``dims``' shapes, one thread under that quota (an emulated rank)."""
    if spec == "cpu" or spec.startswith("cpu:"):
        quota = _cpu_quota(spec)
        from .sim.calibrate import calibrate  # needs torch; the rest of the simulator does not

        return calibrate(dims, threads=1, quota=quota)
    path = Path(spec)
    if path.suffix == ".json":
        if not path.exists():
            raise UsageError(f"--device {spec}: no such file (write one with --calibrate {spec})")
        return _device_from(_read_json(path, "--device"), f"--device {spec}")
    try:
        return device(spec)
    except ValueError as e:
        raise UsageError(f"--device: {e}") from None


def _cpu_quota(spec: str) -> float | None:
    """The quota in ``cpu[:quota=CORES]``."""
    _, _, opt = spec.partition(":")
    if not opt:
        return None
    key, _, value = opt.partition("=")
    try:
        quota = float(value) if key == "quota" else 0.0
    except ValueError:
        quota = 0.0
    if not quota > 0:
        raise UsageError(f"--device {spec}: expected cpu or cpu:quota=CORES, CORES a number above 0 such as 0.5")
    return quota


# ------------------------------------------------------------------------------ the table and the verdict


def _simulate(args: argparse.Namespace, dims: ModelDims) -> int:
    intra, inter = _link("--intra", args.intra), _link("--inter", args.inter)
    dev = load_device(args.device, dims)
    cluster = Cluster(args.nodes, args.per_node, dev, intra, inter, args.rails)
    work = Workload(dims, dev, recompute=args.recompute == "chunk")
    rows = [_row(method, cluster, work, args) for method in args.methods]
    advice = compare.advise(cluster, work, args.micro_batches, host=args.host) if args.advise else []
    played = [r for r in rows if isinstance(r, compare.Row)]
    if not played and not advice:
        raise UsageError(f"nothing was simulated: {_reasons(rows, args.advise)}")
    if args.timeline:
        taw = next(r for r in rows if r.method == "tawpipe")
        if not isinstance(taw, compare.Row):
            raise UsageError(f"--timeline: TawPipe was not simulated: {taw.reason}")
        args.timeline.write_text(taw.result.chrome_trace())
    judged = compare.verdict([*played, *advice])
    said = _verdict_text(judged, rows, advice, dev)
    if args.json:
        print(json.dumps({"cluster": _describe(cluster), "model": dataclasses.asdict(dims),
                          "micro_batches": args.micro_batches, "rows": [r.to_json() for r in rows],
                          "advice": [r.to_json() for r in advice[:5]], "verdict": _verdict_json(judged, said)},
                         indent=1))
        return 0
    print(f"{cluster.nodes} x {cluster.per_node} {dev.name}, intra {cluster.intra.name}, inter "
          f"{cluster.inter.name}{' per rail' if cluster.rails else ' per node'}; {args.model}: H={dims.hidden} "
          f"L={dims.layers} S={dims.seq} B={dims.micro_batch}, {args.micro_batches} micro-batches per device, "
          f"{'recompute' if args.recompute == 'chunk' else 'no recompute'}")
    print(table(rows))
    if advice:
        print(f"\nTawPipe settings tried ({len(advice)}), fastest first:")
        print(table(advice[:5]))
        best = advice[0]
        print(f"advice: {_setting_flags(best.settings)} ({best.time_s:.3f} s/iteration"
              f"{'' if best.fits else ', does not fit'})")
    print(said)
    return 0


def _row(method: str, cluster: Cluster, work: Workload, args: argparse.Namespace) -> compare.Row | compare.Refusal:
    """``method``'s row with the settings the flags give it, or why it could not be played."""
    settings = {"tawpipe": _settings(args), "tawpipe-paper": {**compare.PAPER, "replicas": args.replicas},
                "1f1b": {"stages": args.stages} if args.stages else None}.get(method)
    try:
        return compare.run(method, cluster, work, args.micro_batches, host=args.host, settings=settings)
    except ValueError as e:
        return compare.Refusal(method, str(e))


def _reasons(rows: Sequence[compare.Row | compare.Refusal], advise: bool) -> str:
    """Why the refused rows were refused: the methods that share a reason, then the reason."""
    by_reason: dict[str, list[str]] = {}
    for r in rows:
        if isinstance(r, compare.Refusal):
            by_reason.setdefault(r.reason, []).append(r.method)
    said = [f"{', '.join(methods)}: {reason}" for reason, methods in by_reason.items()]
    if advise:
        said.append("--advise: no TawPipe setting gives pipelines the simulator plays")
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
    if not s:
        return ""
    if "stages" in s:
        return f"{s['stages']} stages"
    parts = [f"k={s.get('mb_per_fetch', 1)}", f"depth {s.get('prefetch_depth', 1)}"]
    if s.get("reuse_weights"):
        parts.append("reuse")
    if s.get("replicas", 1) > 1:
        parts.append(f"R={s['replicas']}")
    return ", ".join(parts)


def _setting_flags(s: dict) -> str:
    """TawPipe's settings as the flags that ask for them."""
    return (f"--replicas {s.get('replicas', 1)} --mb-per-fetch {s.get('mb_per_fetch', 1)} --prefetch-depth "
            f"{s.get('prefetch_depth', 1)} {'--reuse-weights' if s.get('reuse_weights') else '--no-reuse-weights'}")


def _describe(c: Cluster) -> dict:
    return {"nodes": c.nodes, "per_node": c.per_node, "device": dataclasses.asdict(c.device),
            "intra": dataclasses.asdict(c.intra), "inter": dataclasses.asdict(c.inter), "rails": c.rails}


def _calibrate(args: argparse.Namespace, dims: ModelDims) -> int:
    from .sim.calibrate import calibrate  # needs torch; the rest of the simulator does not

    if args.calibrate_on == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--calibrate-on cuda: this machine has no CUDA device that torch can use")
    dev = calibrate(dims, device=args.calibrate_on, threads=args.threads, quota=args.quota)
    args.calibrate.write_text(json.dumps(dataclasses.asdict(dev), indent=1))
    print(f"{dev.name}: matmul {dev.matmul_flops / 1e9:,.1f} GFLOP/s, attention {dev.attention_flops / 1e9:,.1f} "
          f"GFLOP/s, memory {dev.memory_bandwidth / 1e9:,.2f} GB/s, {dev.memory / GiB:,.1f} GiB; written to "
          f"{args.calibrate}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------ validation

# tawpipe bench cluster's methods, by the simulator's names: its "tawpipe" is the paper's schedule
# (k = 1, depth 1), "tawpipe-best" k = acc with every chunk resident
_BENCH_METHODS = {"tawpipe": "tawpipe-paper", "tawpipe-best": "tawpipe",
                  **{m: m for m in ("weipipe", "fsdp", "fsdp-mm", "fsdp-node", "hsdp", "ddp", "1f1b")}}
_CONFIG = ("nodes", "per_node", "hidden", "layers", "heads", "vocab", "seq_len", "batch_size", "micro_batches")


def shape_dims(config: dict[str, Any]) -> ModelDims:
    """A `tawpipe bench cluster` shape's model as the simulator counts it: float32, the embedding
    and the untied head (twice the vocabulary's rows)."""
    return ModelDims(hidden=config["hidden"], layers=config["layers"], heads=config["heads"],
                     vocab=2 * config["vocab"], seq=config["seq_len"], micro_batch=config["batch_size"],
                     dtype_bytes=4, grad_bytes=4)


@dataclasses.dataclass
class _Shape:
    """One shape of a results file, read and checked before anything is measured."""

    path: Path
    rate: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    dims: ModelDims
    quota: float
    threads: int
    shaped: Link  # the emulated inter-node link
    recompute: bool
    device: Device | None  # recorded with the run or cached in --out; None: measured at validation
    calibrated: str


def _validate(args: argparse.Namespace) -> int:
    """Every measured row of the given results against its simulation on the emulated cluster's
    model: ranks play the CPU executor (``host``), each with the measured rates of this machine's
    CPU at the row's shape under the run's quota (and, where the ranks measured it, what their
    transfers cost them), the shaped link at ``--link-efficiency``."""
    shapes = [s for path in args.validate for s in _read_results(path, args)]  # every file checked first
    out, measured = [], {}
    for s in shapes:
        # the rates `bench cluster` measured right after the shape's runs, else measured now (once
        # per shape and quota): a CPU's rate drifts by tens of percent from one day to the next
        key = (s.dims, s.threads, s.quota)
        if s.device is None and key not in measured:
            measured[key] = _measure(s.dims, s.threads, s.quota, args.out)
        dev = s.device or measured[key]
        for row in s.rows:
            base = row["method"].removesuffix("-compute")
            if row.get("status") != "ok" or base not in _BENCH_METHODS:
                continue
            method = _BENCH_METHODS[base]
            inter = link(LOOPBACK) if row.get("unlimited") else s.shaped
            cluster = Cluster(s.config["nodes"], s.config["per_node"], dev, link(LOOPBACK), inter)
            work = Workload(s.dims, dev, recompute=s.recompute if method.startswith(("tawpipe", "weipipe")) else False)
            try:
                sim = compare.run(method, cluster, work, s.config["micro_batches"], host=True,
                                  settings=compare.BEST if method == "tawpipe" else None)  # as tawpipe-best ran
            except (ValueError, KeyError) as e:
                print(f"{s.path}: {row['label']}: not simulated ({e})", file=sys.stderr)
                continue
            out.append({"results": str(s.path), "cluster": f"{s.config['nodes']}x{s.config['per_node']}",
                        "seq": s.config["seq_len"], "rate": s.rate, "method": row["method"], "label": row["label"],
                        "calibrated": s.calibrated, "measured_s": row["time_median_s"], "predicted_s": sim.time_s,
                        "time_ratio": sim.time_s / row["time_median_s"],
                        "measured_bytes": row.get("measured_busiest_bytes"), "predicted_bytes": sim.inter_bytes,
                        "bytes_ratio": (sim.inter_bytes / row["measured_busiest_bytes"]
                                        if row.get("measured_busiest_bytes") else None)})
            print(_validation_line(out[-1]), flush=True)
    md = _validation_markdown(out, args)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "validation.json").write_text(json.dumps({"rows": out, "link_efficiency": args.link_efficiency,
                                                              "intra": LOOPBACK}, indent=1))
        (args.out / "validation.md").write_text(md + "\n")
    return 0


def _read_results(path: Path, args: argparse.Namespace) -> list[_Shape]:
    """The shapes of one ``tawpipe bench cluster`` results file, or a UsageError naming the file
    and what it lacks."""
    where = f"--validate {path}"
    doc = _read_json(path, "--validate")
    if not isinstance(doc, dict) or not isinstance(doc.get("shapes"), list) or not isinstance(doc.get("rate"), str):
        raise UsageError(f"{where}: not the cluster.json of tawpipe bench cluster (it needs 'rate' and 'shapes')")
    nominal = _link(f"{where}: its rate", doc["rate"])
    shaped = dataclasses.replace(nominal, latency=100e-6, efficiency=args.link_efficiency,
                                 burst=shaper_burst(nominal.rate))
    cpus = doc.get("machine", {}).get("cpus") or os.cpu_count()
    recompute = doc.get("engine", {}).get("recompute", "none") != "none"
    shapes = []
    for i, shape in enumerate(doc["shapes"], 1):
        at = f"{where}: shape {i}"
        c, rows = (shape.get("config"), shape.get("rows")) if isinstance(shape, dict) else (None, None)
        if not isinstance(c, dict) or not isinstance(rows, list) or \
                not all(isinstance(c.get(k), int) and c[k] >= 1 for k in _CONFIG):
            raise UsageError(f"{at}: needs 'rows' and a 'config' of whole numbers >= 1: {', '.join(_CONFIG)}")
        bad = next((r for r in rows if not _measured_row(r)), None)
        if bad is not None:
            raise UsageError(f"{at}: a row without a method, or an ok one without a label and a time_median_s > 0: "
                             f"{json.dumps(bad)[:80]}")
        quota, threads = _quota(shape.get("compute") or doc.get("compute"), path)
        # a quota the machine cannot give every rank is what the machine gives (older results
        # name the first shape's quota only; the default is the machine's cores over the ranks)
        quota = min(quota, cpus / (c["nodes"] * c["per_node"]))
        dims = shape_dims(c)
        recorded = shape.get("calibration")
        if recorded:
            dev = _device_from(recorded, f"{at}: its calibration")
            calibrated = "by the ranks with the run" if recorded.get("transfer_rate") else "with the run"
        else:
            cached = _calibration_file(dims, quota, args.out)
            dev = _device_from(_read_json(cached, "--out"), f"--out {cached}") if cached and cached.is_file() else None
            calibrated = "at validation"
        shapes.append(_Shape(path, doc["rate"], c, rows, dims, quota, threads, shaped, recompute, dev, calibrated))
    return shapes


def _measured_row(r: Any) -> bool:
    """Whether ``r`` is a row ``_validate`` can read: a method, and for a row that ran, its label
    and median time."""
    if not isinstance(r, dict) or not isinstance(r.get("method"), str):
        return False
    t = r.get("time_median_s")
    return r.get("status") != "ok" or (isinstance(r.get("label"), str) and isinstance(t, (int, float)) and t > 0)


def _calibration_file(dims: ModelDims, quota: float, out: Path | None) -> Path | None:
    """Where a validation keeps what it measured at ``dims``' shapes under ``quota`` (so a table
    can be remade on a busy machine): in ``out``, if given."""
    return out / f"cpu_H{dims.hidden}_S{dims.seq}_B{dims.micro_batch}_q{quota:.3f}.json" if out else None


def _measure(dims: ModelDims, threads: int, quota: float, out: Path | None) -> Device:
    """This machine's CPU at ``dims``' shapes under ``quota``, kept in ``out``."""
    from .sim.calibrate import calibrate

    dev = calibrate(dims, threads=threads, quota=quota)
    path = _calibration_file(dims, quota, out)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(dev), indent=1))
    return dev


def _quota(text: str | None, path: Path) -> tuple[float, int]:
    """(cores, threads) per rank from a results file's description of its compute."""
    m = re.search(r"([0-9.]+) core\(s\) per rank \(([0-9]+) thread", text if isinstance(text, str) else "")
    if not m:
        raise UsageError(f"--validate {path}: not a fixed-compute run (its compute is {text!r}); the simulator models "
                         f"a device whose compute is its own")
    try:
        cores = float(m.group(1))
    except ValueError:
        cores = 0.0
    if not cores > 0 or int(m.group(2)) < 1:
        raise UsageError(f"--validate {path}: its compute, {text!r}, names no cores or threads per rank")
    return cores, int(m.group(2))


def _validation_line(r: dict) -> str:
    b = f"{r['bytes_ratio']:.3f}" if r["bytes_ratio"] else "-"
    return (f"| {r['cluster']} | {r['seq']} | {r['rate']} | {r['label']} | {r['measured_s']:.2f} | "
            f"{r['predicted_s']:.2f} | {r['time_ratio']:.2f} | {b} |")


def _validation_markdown(rows: list[dict], args: argparse.Namespace) -> str:
    head = ["| cluster | S | link | method | measured s | predicted s | time pred/meas | inter bytes pred/meas |",
            "|---|---|---|---|---|---|---|---|"]
    within = [r for r in rows if abs(r["time_ratio"] - 1) <= 0.2]
    bytes_ok = [r for r in rows if r["bytes_ratio"] is None or abs(r["bytes_ratio"] - 1) <= 0.02]
    by_ranks = sum(r["calibrated"] == "by the ranks with the run" for r in rows)
    with_run = sum(r["calibrated"] == "with the run" for r in rows)
    summary = (f"{len(within)} of {len(rows)} rows within ±20% in time, {len(bytes_ok)} of {len(rows)} within ±2% in "
               f"inter-node bytes (link efficiency {args.link_efficiency:.3f}, intra-node {LOOPBACK}). CPU rates: "
               f"{by_ranks} of {len(rows)} rows from the ranks' own calibration `bench cluster` recorded with the run "
               f"(under their quotas, with what their transfers cost them), {with_run} from one measured outside the "
               f"cluster with the run, {len(rows) - by_ranks - with_run} measured at validation (outside, no transfer "
               f"cost).")
    return "\n".join(head + [_validation_line(r) for r in rows] + ["", summary])


# ------------------------------------------------------------------------------ the paper's setup

PAPER_MARGINS = {"weipipe": 0.118, "1f1b": 0.236, "fsdp": 0.441}  # TawPipe's throughput over each, 24 GPUs


def _paper(args: argparse.Namespace) -> int:
    """The official code's 24-GPU run on the simulator: TawPipe's throughput over WeiPipe, 1F1B
    and FSDP at each S, beside the margins the paper reports (S = 16384). The device is
    ``--device`` (the paper names none; design §9.5 gives the A100-class estimate)."""
    intra, inter = _link("--intra", args.intra), _link("--inter", args.inter)
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
    (args.paper / "paper.json").write_text(json.dumps(doc, indent=1))
    (args.paper / "paper.md").write_text(md + "\n")
    return 0
