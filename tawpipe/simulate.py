"""``tawpipe simulate``: what TawPipe and its peers would do on a cluster you describe (design §9).

Every method plays one iteration on a model of the cluster: TawPipe and WeiPipe from the plan the
engine would run, DDP, FSDP2 (also with intra-node reshard), HSDP and 1F1B from their schedules.
Per method it prints the time per iteration, tokens/s per device, MFU, exposed communication,
bytes per link, memory per device, whether it fits, and what sets the time. ``--calibrate``
measures this machine's device instead of a preset; ``--validate`` compares the simulator with
``tawpipe bench cluster`` results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from .cluster import shaper_burst
from .cost.traffic import ModelDims
from .plan.schedule import prefetch_depth_arg
from .sim import compare
from .sim.hardware import DEVICES, LINKS, Cluster, Device, device, link
from .models.presets import PRESETS
from .sim.workload import Workload, model

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
                        "device that has a transfer rate (a `bench cluster` calibration), transfers take the ranks' "
                        "compute")
    m = p.add_argument_group("model and batch")
    m.add_argument("--model", default="paper", help=f"a built-in model ({', '.join(PRESETS)}) or a Hugging Face config.json")
    m.add_argument("--seq", type=int, default=4096, help="sequence length S")
    m.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch B")
    m.add_argument("--acc", type=int, default=2, help="micro-batches per device per iteration")
    m.add_argument("--dtype-bytes", type=int, default=2, help="bytes per weight and activation (2: bf16/fp16)")
    m.add_argument("--grad-bytes", type=int, default=2, help="bytes per gradient on the wire")
    m.add_argument("--no-recompute", dest="recompute", action="store_false",
                   help="keep activations instead of recomputing each layer (chunk) in backward")
    t = p.add_argument_group("methods")
    t.add_argument("--methods", nargs="+", choices=compare.METHODS, default=list(compare.METHODS))
    t.add_argument("--mb-per-fetch", type=int, help="TawPipe k (default: acc)")
    t.add_argument("--prefetch-depth", type=prefetch_depth_arg, help="TawPipe depth (default: resident)")
    t.add_argument("--reuse-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="TawPipe reuse (default: on)")
    t.add_argument("--replicas", type=int, default=1, help="TawPipe replicas R (default: 1)")
    t.add_argument("--advise", action="store_true", help="try TawPipe's settings and name the fastest that fits")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument("--timeline", type=Path, help="write TawPipe's iteration as a Chrome trace to this file")
    o.add_argument("--paper", type=Path, metavar="OUT",
                   help="instead: the paper's 24-GPU setup (3 x 8, 10 GbE, H=1024, 24 layers, S = 4k/8k/16k, "
                        "micro-batch 2, acc 2, 16-bit, recompute) against its reported margins (paper.json, paper.md)")
    o.add_argument("--map", type=Path, metavar="OUT",
                   help="instead: the map of which method wins from 24 to 1,024 GPUs, models of 1B to 70B, S from "
                        "4k to 128k, over 10 GbE to 400 Gb (map.json, map.md, map.png in OUT)")
    k = p.add_argument_group("calibration")
    k.add_argument("--calibrate", type=Path, metavar="OUT",
                   help="measure this machine's device at the model's shapes and write it to OUT (JSON); "
                        "--device OUT then uses it")
    k.add_argument("--calibrate-on", default="cpu", help="cpu or cuda (default: cpu)")
    k.add_argument("--threads", type=int, help="CPU threads while calibrating")
    k.add_argument("--quota", type=float, help="CPU cores of quota per rank (the emulated cluster's)")
    v = p.add_argument_group("validation against the emulated cluster")
    v.add_argument("--validate", type=Path, nargs="+", metavar="CLUSTER_JSON",
                   help="predict every row of these `tawpipe bench cluster` results (cluster.json) with the rates "
                        "their ranks measured (else calibrating this machine's CPU at each shape and quota now), "
                        "and compare")
    v.add_argument("--link-efficiency", type=float, default=EMULATED_EFFICIENCY,
                   help="with --validate: the share of the shaped rate that gloo's payload reaches "
                        f"(default {EMULATED_EFFICIENCY}: the veth counters' headers over payload, 0.4-0.8%%)")
    v.add_argument("--out", type=Path, help="with --validate: write validation.json and validation.md here")


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except ValueError as e:  # a bad cluster, model, device or link: named, without a traceback
        raise SystemExit(f"tawpipe simulate: {e}") from None


def _main(args: argparse.Namespace) -> int:
    dims = model(args.model, seq=args.seq, micro_batch=args.micro_batch, dtype_bytes=args.dtype_bytes,
                 grad_bytes=args.grad_bytes)
    if args.paper:
        return _paper(args)
    if args.map:
        from .sim.atlas import main_map  # matplotlib, only here

        return main_map(args.map)
    if args.validate:
        return _validate(args)
    if args.calibrate:
        return _calibrate(args, dims)
    dev = load_device(args.device, dims)
    cluster = Cluster(args.nodes, args.per_node, dev, link(args.intra), link(args.inter), args.rails)
    work = Workload(dims, dev, recompute=args.recompute)
    settings = _settings(args)
    rows = []
    for method in args.methods:
        try:
            rows.append(compare.run(method, cluster, work, args.acc, host=args.host,
                                    settings=settings if method == "tawpipe" else None))
        except ValueError as e:
            rows.append(e)
    advice = compare.advise(cluster, work, args.acc, host=args.host) if args.advise else []
    if args.timeline:
        taw = next((r for r in rows if isinstance(r, compare.Row) and r.method == "tawpipe"), None)
        if taw is None or taw.result is None:
            raise SystemExit("--timeline needs the tawpipe method, which did not run")
        args.timeline.write_text(taw.result.chrome_trace())
    if args.json:
        print(json.dumps({"cluster": _describe(cluster), "model": dataclasses.asdict(dims), "acc": args.acc,
                          "rows": [r.to_json() if isinstance(r, compare.Row) else {"error": str(r)} for r in rows],
                          "advice": [r.to_json() for r in advice[:5]]}, indent=1))
        return 0
    print(f"{cluster.nodes} x {cluster.per_node} {dev.name}, intra {cluster.intra.name}, inter "
          f"{cluster.inter.name}{' per rail' if cluster.rails else ' per node'}; {args.model}: H={dims.hidden} "
          f"L={dims.layers} S={dims.seq} B={dims.micro_batch} acc={args.acc}, "
          f"{'recompute' if args.recompute else 'no recompute'}")
    print(table(rows))
    if advice:
        best = advice[0]
        print(f"\nTawPipe settings tried ({len(advice)}), fastest first:")
        print(table(advice[:5]))
        print(f"advice: {_flags(best.settings)} ({best.time_s:.3f} s/iteration{'' if best.fits else ', does not fit'})")
    return 0


def table(rows: list) -> str:
    head = (f"{'method':<14} {'settings':<28} {'time/iter':>10} {'tok/s/dev':>10} {'MFU':>6} {'exposed':>9} "
            f"{'inter/node':>11} {'intra/dev':>10} {'memory':>10} {'fits':>4}  bottleneck")
    lines = [head, "-" * len(head)]
    for r in rows:
        if not isinstance(r, compare.Row):
            lines.append(f"{'':<14} not simulated: {r}")
            continue
        mem = f"{r.memory.total / GiB:.2f} GiB"
        lines.append(f"{r.method:<14} {_flags(r.settings):<28} {r.time_s:>9.3f}s {r.tokens_per_s_per_device:>10,.0f} "
                     f"{r.mfu:>6.1%} {r.exposed_comm_s:>8.3f}s {r.inter_bytes / 1e9:>8.3f} GB {r.intra_bytes / 1e9:>7.3f} GB "
                     f"{mem:>10} {'yes' if r.fits else 'no':>4}  {r.bottleneck}")
    return "\n".join(lines)


def load_device(spec: str, dims: ModelDims) -> Device:
    """A preset, a device JSON written by ``--calibrate``, or ``cpu[:quota=CORES]``: this
    machine's CPU measured now at ``dims``' shapes, one thread under that quota (an emulated rank)."""
    if spec == "cpu" or spec.startswith("cpu:"):
        from .sim.calibrate import calibrate  # needs torch; the rest of the simulator does not

        _, _, opt = spec.partition(":")
        key, _, value = opt.partition("=")
        if opt and key != "quota":
            raise SystemExit(f"--device {spec}: only cpu:quota=CORES is known")
        return calibrate(dims, threads=1, quota=float(value) if opt else None)
    path = Path(spec)
    if path.suffix == ".json":
        if not path.is_file():
            raise SystemExit(f"--device {spec}: no such file (write one with --calibrate {spec})")
        return Device(**json.loads(path.read_text()))
    return device(spec)


def _calibrate(args: argparse.Namespace, dims: ModelDims) -> int:
    from .sim.calibrate import calibrate  # needs torch; the rest of the simulator does not

    dev = calibrate(dims, device=args.calibrate_on, threads=args.threads, quota=args.quota)
    args.calibrate.write_text(json.dumps(dataclasses.asdict(dev), indent=1))
    print(f"{dev.name}: matmul {dev.matmul_flops / 1e9:,.1f} GFLOP/s, attention {dev.attention_flops / 1e9:,.1f} "
          f"GFLOP/s, memory {dev.memory_bandwidth / 1e9:,.2f} GB/s, {dev.memory / GiB:,.1f} GiB; written to "
          f"{args.calibrate}", file=sys.stderr)
    return 0


def _settings(args: argparse.Namespace) -> dict:
    s = dict(compare.BEST)
    for key in ("mb_per_fetch", "prefetch_depth", "reuse_weights"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    s["replicas"] = args.replicas
    return s


def _flags(s: dict) -> str:
    if not s:
        return ""
    parts = [f"k={s.get('mb_per_fetch', 1)}", f"depth {s.get('prefetch_depth', 1)}"]
    if s.get("reuse_weights"):
        parts.append("reuse")
    if s.get("replicas", 1) > 1:
        parts.append(f"R={s['replicas']}")
    return ", ".join(parts)


def _describe(c: Cluster) -> dict:
    return {"nodes": c.nodes, "per_node": c.per_node, "device": dataclasses.asdict(c.device),
            "intra": dataclasses.asdict(c.intra), "inter": dataclasses.asdict(c.inter), "rails": c.rails}


# ------------------------------------------------------------------------------ validation

# tawpipe bench cluster's methods, by the simulator's names: its "tawpipe" is the paper's schedule
# (k = 1, depth 1), "tawpipe-best" k = acc with every chunk resident
_BENCH_METHODS = {"tawpipe": "tawpipe-paper", "tawpipe-best": "tawpipe",
                  **{m: m for m in ("weipipe", "fsdp", "fsdp-mm", "fsdp-node", "hsdp", "ddp", "1f1b")}}


def shape_dims(config: dict[str, Any]) -> ModelDims:
    """A `tawpipe bench cluster` shape's model as the simulator counts it: float32, the embedding
    and the untied head (twice the vocabulary's rows)."""
    return ModelDims(hidden=config["hidden"], layers=config["layers"], heads=config["heads"],
                     vocab=2 * config["vocab"], seq=config["seq_len"], micro_batch=config["batch_size"],
                     dtype_bytes=4, grad_bytes=4)


def _validate(args: argparse.Namespace) -> int:
    """Every measured row of the given results against its simulation on the emulated cluster's
    model: ranks play the CPU executor (``host``), each with the measured rates of this machine's
    CPU at the row's shape under the run's quota (and, where the ranks measured it, what their
    transfers cost them), the shaped link at ``--link-efficiency``."""
    out = []
    for path in args.validate:
        doc = json.loads(path.read_text())
        cpus = doc.get("machine", {}).get("cpus") or os.cpu_count()
        recompute = doc.get("engine", {}).get("recompute", "none") != "none"
        for shape in doc["shapes"]:
            c = shape["config"]
            quota, threads = _quota(shape.get("compute") or doc.get("compute"), path)
            # a quota the machine cannot give every rank is what the machine gives (older results
            # name the first shape's quota only; the default is the machine's cores over the ranks)
            quota = min(quota, cpus / (c["nodes"] * c["per_node"]))
            dims = shape_dims(c)
            # the rates `bench cluster` measured right after the shape's runs, else measured now: a
            # CPU's rate drifts by tens of percent from one day to the next
            recorded = shape.get("calibration")
            dev = Device(**recorded) if recorded else _calibrated(dims, threads, quota, args.out)
            nominal = link(doc["rate"])
            shaped = dataclasses.replace(nominal, latency=100e-6, efficiency=args.link_efficiency,
                                         burst=shaper_burst(nominal.rate))
            for row in shape["rows"]:
                base = row["method"].removesuffix("-compute")
                if row.get("status") != "ok" or base not in _BENCH_METHODS:
                    continue
                method = _BENCH_METHODS[base]
                inter = link(LOOPBACK) if row.get("unlimited") else shaped
                cluster = Cluster(c["nodes"], c["per_node"], dev, link(LOOPBACK), inter)
                work = Workload(dims, dev, recompute=recompute if method.startswith(("tawpipe", "weipipe")) else False)
                try:
                    sim = compare.run(method, cluster, work, c["micro_batches"], host=True)
                except (ValueError, KeyError) as e:
                    print(f"{path}: {row['label']}: not simulated ({e})", file=sys.stderr)
                    continue
                out.append({"results": str(path), "cluster": f"{c['nodes']}x{c['per_node']}", "seq": c["seq_len"],
                            "rate": doc["rate"], "method": row["method"], "label": row["label"],
                            "calibrated": ("by the ranks with the run" if recorded.get("transfer_rate") else
                                           "with the run") if recorded else "at validation",
                            "measured_s": row["time_median_s"], "predicted_s": sim.time_s,
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


def _calibrated(dims: ModelDims, threads: int, quota: float, out: Path | None) -> Device:
    """This machine's CPU at ``dims``' shapes under ``quota``: measured, or read from ``out``
    where an earlier validation measured it (so a table can be remade on a busy machine)."""
    from .sim.calibrate import calibrate

    path = out / f"cpu_H{dims.hidden}_S{dims.seq}_B{dims.micro_batch}_q{quota:.3f}.json" if out else None
    if path is not None and path.is_file():
        return Device(**json.loads(path.read_text()))
    dev = calibrate(dims, threads=threads, quota=quota)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(dev), indent=1))
    return dev


def _quota(text: str | None, path: Path) -> tuple[float, int]:
    """(cores, threads) per rank from a results file's description of its compute."""
    m = re.search(r"([0-9.]+) core\(s\) per rank \(([0-9]+) thread", text or "")
    if not m:
        raise SystemExit(f"{path}: not a fixed-compute run (its compute is {text!r}); the simulator models a "
                         f"device whose compute is its own")
    return float(m.group(1)), int(m.group(2))


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
    dev = load_device(args.device, model("paper", seq=16384, micro_batch=2))
    cluster = Cluster(3, 8, dev, link(args.intra), link(args.inter), args.rails)
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
        rows = {m: compare.run(m, cluster, work, 2) for m in methods}
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
