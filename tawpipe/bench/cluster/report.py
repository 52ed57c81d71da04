"""What `tawpipe bench cluster` writes: cluster.json and cluster.md (a table per shape, the sweep
over S and its crossovers, the notes)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from typing import Any

from ...atomic import write_atomic
from ...cost.traffic import crossover_tokens
from ...simulate.inputs import shape_dims
from ..baselines import RunConfig
from .runs import UPDATE_TOL


def _mb(v: float | None) -> str:
    return "–" if v is None else f"{v / 1e6:.1f}"


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for shape in result["shapes"]:
        c = shape["config"]
        by_name = {r["method"]: r for r in shape["rows"] if r.get("status") == "ok"}
        ref = by_name.get("tawpipe-best") or by_name.get("tawpipe")
        lines += [
            f"### {c['nodes']} nodes × {c['per_node']} ranks, S = {c['seq_len']}, {result['rate'] or 'unlimited'} "
            f"links, {result.get('compute', 'compute shared')}",
            "",
            f"hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads, vocabulary {c['vocab']}, "
            f"{c['loss']} loss, seq {c['seq_len']}, "
            f"{c['micro_batches']} micro-batches × {c['batch_size']} sequence per rank, AdamW, fp32, gloo; "
            f"{result['rounds']} rounds × {c['steps']} timed steps.",
            "",
            "| method | median s/it | min–max | tok/s | inter-node MB/it, all nodes | busiest node MB/it: "
            "measured / predicted | floor s | time / floor | persistent MiB/rank | peak RSS MiB/rank | "
            f"time, peak RSS / {ref['label'] if ref else 'tawpipe'}'s | same update |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in shape["rows"]:
            if row.get("status") != "ok":
                lines.append(f"| {row['label']} | {row.get('status', '')} | | | | – / "
                             f"{_mb(row['predicted_busiest_bytes'])} | | | | | | |")
                continue
            chk = row.get("check")
            same = "–" if chk is None else (
                f"{'yes' if chk['ok'] else 'NO'} (loss {chk['loss_rel_err']:.0e}, update {chk['update_rel_err']:.0e})")
            floor = row.get("floor_s")
            over = "–" if floor is None else f"{row['time_median_s'] / floor:.2f}"
            ratio = f" ({row['measured_over_predicted'] - 1:+.1%})" if row.get("measured_over_predicted") else ""
            staging = f" + {row['staging_bytes'] / 2**20:.1f} staging" if row.get("staging_bytes") else ""
            total = _mb(row["measured_total_bytes"])
            if row["predicted_total_bytes"]:
                total += f" (plan {_mb(row['predicted_total_bytes'])})"
            failed = f" ({row['failed_runs']} run(s) failed, see the JSON)" if row.get("failed_runs") else ""
            rel = "–" if ref is None else (f"{row['time_median_s'] / ref['time_median_s']:.2f}×, "
                                           f"{row['peak_rss_bytes_max'] / ref['peak_rss_bytes_max']:.2f}×")
            lines.append(
                f"| {row['label']}{failed} | {row['time_median_s']:.2f} | {row['time_min_s']:.2f}–{row['time_max_s']:.2f} "
                f"| {row['tokens_per_s']:,.0f} | {total} | {_mb(row['measured_busiest_bytes'])} / "
                f"{_mb(row['predicted_busiest_bytes'])}{ratio} | {'–' if floor is None else f'{floor:.2f}'} | "
                f"{over} | {row['persistent_bytes_max'] / 2**20:.1f}{staging} | "
                f"{row['peak_rss_bytes_max'] / 2**20:.0f} | {rel} | {same} |")
        lines.append("")
        bounds = [f"- {row['label']}: {row['time_median_s']:.2f} s = **{row['time_over_bound']:.2f}** × "
                  f"max(network floor {row['floor_s']:.2f} s, compute-only {row['compute_only_s']:.2f} s)"
                  for row in shape["rows"] if "time_over_bound" in row]
        if bounds:
            lines += bounds + [""]
    lines += _sweep_markdown(result)
    lines += [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def _sweep_markdown(result: dict[str, Any]) -> list[str]:
    """A sweep over S: each method's median time per S, and the crossovers."""
    if not result.get("crossovers"):
        return []
    lines = []
    for c in result["crossovers"]:
        shapes = by_cluster(result)[(c["nodes"], c["per_node"])]
        labels = {r["method"]: r["label"] for s in shapes for r in s["rows"] if not r.get("unlimited")}
        lines += [f"### Sweep over S, {c['nodes']} × {c['per_node']}: median s/it", "",
                  "| S | " + " | ".join(labels.values()) + f" | {c['fast']} / {c['slow']} |",
                  "|---|" + "---|" * (len(labels) + 1)]
        for shape in shapes:
            rows = {r["method"]: r for r in shape["rows"]}
            cells = [f"{rows[n]['time_median_s']:.2f}" if rows.get(n, {}).get("status") == "ok" else "–" for n in labels]
            ratio = c["time_ratio"].get(shape["config"]["seq_len"])
            lines.append(f"| {shape['config']['seq_len']} | " + " | ".join(cells)
                         + f" | {'–' if ratio is None else f'{ratio:.2f}'} |")
        measured = "not inside the sweep" if c["measured_seq"] is None else f"S = {c['measured_seq']:,.0f}"
        predicted = "–" if c["predicted_seq"] is None else f"S = {c['predicted_seq']:,.0f}"
        off = f" ({c['measured_over_predicted'] - 1:+.0%})" if c["measured_over_predicted"] else ""
        lines += ["", f"- {c['fast']} becomes faster than {c['slow']} at {measured} (measured: time ratio 1, "
                  f"interpolated in log S) against {predicted} predicted (its plan's bytes equal to 1F1B's, design "
                  f"§7.4){off}.", ""]
    return lines


def crossover_seq(cfg: RunConfig, tawpipe_bytes: float) -> float:
    """Sequence length at which 1F1B's activation traffic equals ``tawpipe_bytes`` (design §7.4)."""
    return crossover_tokens(tawpipe_bytes, shape_dims(asdict(cfg)), cfg.topology, cfg.micro_batches) / cfg.batch_size


def by_cluster(result: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The shapes of each cluster (nodes, per node), in the order first run, each by S."""
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for shape in result["shapes"]:
        out.setdefault((shape["config"]["nodes"], shape["config"]["per_node"]), []).append(shape)
    return {key: sorted(shapes, key=lambda s: s["config"]["seq_len"]) for key, shapes in out.items()}


def sweep_crossovers(result: dict[str, Any], fast: str = "tawpipe-best", slow: str = "1f1b") -> list[dict[str, Any]]:
    """Per cluster of a sweep over S: where ``fast``'s median time meets ``slow``'s, measured
    (interpolated in log S between the two runs around it) and predicted (the bytes of ``fast``'s
    plan against 1F1B's closed form, design §7.4)."""
    out = []
    for key, shapes in by_cluster(result).items():
        points = []
        for shape in shapes:
            rows = {r["method"]: r for r in shape["rows"] if r.get("status") == "ok"}
            if fast in rows and slow in rows:
                points.append((shape["config"]["seq_len"], rows[fast]["time_median_s"] / rows[slow]["time_median_s"],
                               rows[fast]["predicted_busiest_bytes"], shape["config"]))
        if not points:
            continue
        measured = None
        for (s0, r0, *_), (s1, r1, *_) in zip(points, points[1:]):
            if (r0 - 1) * (r1 - 1) <= 0 and r0 != r1:  # the time ratio crosses 1 between s0 and s1
                f = math.log(r0) / (math.log(r0) - math.log(r1))
                measured = s0 * (s1 / s0) ** f
                break
        cfg = RunConfig(**{k: v for k, v in points[0][3].items() if k != "check_dir"})
        predicted = crossover_seq(cfg, points[0][2]) if points[0][2] else None
        out.append({"nodes": key[0], "per_node": key[1], "fast": fast, "slow": slow,
                    "time_ratio": {p[0]: p[1] for p in points}, "measured_seq": measured, "predicted_seq": predicted,
                    "measured_over_predicted": measured / predicted if measured and predicted else None})
    return out

def write_results(result: dict[str, Any], out: str) -> str:
    """cluster.json and cluster.md of the shapes measured so far, each replaced atomically; the
    markdown returned."""
    if len({s["config"]["seq_len"] for s in result["shapes"]}) > 1:
        result["crossovers"] = sweep_crossovers(result)
    result["notes"] = _notes(result)
    md = markdown(result)
    for name, text in (("cluster.json", json.dumps(result, indent=1)), ("cluster.md", md)):
        write_atomic(os.path.join(out, name), text)
    return md


def _notes(result: dict[str, Any]) -> list[str]:
    notes = [
        "Bytes are the veth counters of each node's link (payload plus TCP/IP headers, read around the timed "
        "steps); 'busiest node' is the larger direction of the busiest link, which sets the network floor.",
        "Predictions: the engine's own plan for tawpipe/WeiPipe; tawpipe.cost.traffic.estimate for DDP, HSDP, 1F1B; "
        "FSDP2 with gloo's reduce-scatter counted as the all-reduce it is, and the root (embedding, head) "
        "gathered once per micro-batch; FSDP2 node reshard: the blocks' backward all-gather stays inside the node.",
        "Same update: losses of the first two steps (rel. tol. 1e-5) and the first update of every parameter "
        f"(rel. norm tol. {UPDATE_TOL:g}) against single-process training on the whole global batch.",
        "Memory: persistent = parameters + one gradient per parameter + optimizer state held by the rank; peak "
        "RSS includes the Python/torch runtime.",
    ]
    e = result["engine"]
    notes.append(f"tawpipe (k=1): prefetch depth {e['prefetch_depth']}; the best k: every chunk resident once "
                 "fetched (depth N - 1, reuse); WeiPipe: lock-step (depth 1). Both: recompute "
                 f"'{e['recompute']}'" + (" (activations kept, as every peer keeps them)." if e["recompute"] == "none"
                                          else "."))
    if any(r.get("replicas") for shape in result["shapes"] for r in shape["rows"]):
        notes.append("'R replicas of g×p': the same engine as R pipelines of g nodes each, every one on its own "
                     "ranks' micro-batches, and a chunk's R owners all-reduce its gradient once per step (plan "
                     "op ALLREDUCE_G, on the rail); its prediction is its plan, the all-reduce included. Same "
                     "update: every replica's parameters are checked against the reference, the worst reported.")
    if any(r.get("unlimited") for shape in result["shapes"] for r in shape["rows"]):
        notes.append("'links unlimited': the same method with the links' rate limit lifted for that run only, "
                     "in the same round as the others; its time is the compute-only side of the bound.")
    if result.get("compute", "").startswith("compute fixed"):
        notes.append(f"Compute: {result['compute']}: each rank runs in a cgroup of its own with that CPU quota, so "
                     "time a rank spends waiting (a bubble, a transfer it cannot hide) is lost as on a GPU. Compute-"
                     "only runs use the same quota.")
    elif result.get("compute"):
        notes.append(f"Compute: {result['compute']}: a waiting rank's core goes to the others, so waiting is "
                     "under-priced (tawpipe cluster --compute fixed is the default).")
    if result.get("pin_cpus"):
        notes.append(f"Every rank is pinned to one of the machine's {result['machine']['cpus']} cores, "
                     "round-robin, for every method alike.")
    return notes
