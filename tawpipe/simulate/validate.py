"""``tawpipe simulate --validate``: the simulator against ``tawpipe bench cluster`` results
(design §9.5). Every measured row is played on the emulated cluster's model: the ranks as the CPU
executor, with the rates they measured of themselves (else this machine's CPU measured now), the
shaped links at the payload's share of their rate, loopback inside a node.
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

from ..atomic import write_atomic
from ..cluster import shaper_burst
from ..commands import UsageError
from ..models.shape import ModelDims
from ..sim import compare
from ..sim.hardware import Cluster, Device, Link, link
from ..sim.workload import Workload
from .inputs import LOOPBACK, device_from, link_arg, read_json, shape_dims

# tawpipe bench cluster's methods, by the simulator's names: its "tawpipe" is the paper's schedule
# (k = 1, depth 1), "tawpipe-best" k = acc with every chunk resident
_BENCH_METHODS = {"tawpipe": "tawpipe-paper", "tawpipe-best": "tawpipe",
                  **{m: m for m in ("weipipe", "fsdp", "fsdp-mm", "fsdp-node", "hsdp", "ddp", "1f1b")}}
_CONFIG = ("nodes", "per_node", "hidden", "layers", "heads", "vocab", "seq_len", "batch_size", "micro_batches")


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


def validate(args: argparse.Namespace) -> int:
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
        write_atomic(args.out / "validation.json", json.dumps({"rows": out, "link_efficiency": args.link_efficiency,
                                                               "intra": LOOPBACK}, indent=1))
        write_atomic(args.out / "validation.md", md + "\n")
    return 0


def _read_results(path: Path, args: argparse.Namespace) -> list[_Shape]:
    """The shapes of one ``tawpipe bench cluster`` results file, or a UsageError naming the file
    and what it lacks."""
    where = f"--validate {path}"
    doc = read_json(path, "--validate")
    if not isinstance(doc, dict) or not isinstance(doc.get("shapes"), list) or not isinstance(doc.get("rate"), str):
        raise UsageError(f"{where}: not the cluster.json of tawpipe bench cluster (it needs 'rate' and 'shapes')")
    nominal = link_arg(f"{where}: its rate", doc["rate"])
    shaped = dataclasses.replace(nominal, latency=100e-6, efficiency=args.link_efficiency,
                                 burst=shaper_burst(nominal.rate))
    cpus = doc.get("machine", {}).get("cpus") or os.cpu_count()
    recompute = doc.get("engine", {}).get("recompute", "none") != "none"
    shapes = []
    for i, shape in enumerate(doc["shapes"], 1):
        at = f"{where}: shape {i}"
        c, rows = (shape.get("config"), shape.get("rows")) if isinstance(shape, dict) else (None, None)
        if not isinstance(c, dict) or not isinstance(rows, list) or \
                not all(isinstance(c.get(k), int) and not isinstance(c[k], bool) and c[k] >= 1 for k in _CONFIG):
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
            dev = device_from(recorded, f"{at}: its calibration")
            calibrated = "by the ranks with the run" if recorded.get("transfer_rate") else "with the run"
        else:
            cached = _calibration_file(dims, quota, args.out)
            dev = device_from(read_json(cached, "--out"), f"--out {cached}") if cached and cached.is_file() else None
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
    from ..sim.calibrate import calibrate

    dev = calibrate(dims, threads=threads, quota=quota)
    path = _calibration_file(dims, quota, out)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(dataclasses.asdict(dev), indent=1))
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
