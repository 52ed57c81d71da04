"""The map: which method wins where, from 24 to 1,024 GPUs (issue #24, item 4; design §9).

Every cell of a grid (nodes × 8 H100s, NVLink inside a node, one inter-node link per node; a
LLaMA preset; a sequence length S) plays one iteration of every method with the simulator and
keeps, among the methods whose memory fits a device, the fastest: the *winner*, TawPipe's best
settings, and TawPipe's *margin* over the fastest other method that fits (its time over
TawPipe's: > 1 where TawPipe is faster, < 1 where it loses).

Fixed for every cell (``Grid``): micro-batch 1, ``acc`` = 8 micro-batches per device per
iteration, recompute on, bf16 weights, activations and gradients on the wire, AdamW in float32.

The methods and the rules that choose their settings:

- TawPipe: replicas R over the divisors of the nodes whose pipelines (8·nodes/R ranks) have no
  more ranks than layers and no more forwards and backwards than ``compare`` plays; k over the
  divisors of acc; prefetch depth 1 without reuse, or every chunk resident with reuse. A
  setting's memory and a lower bound on its time come from its plan without playing it (the
  larger of rank 0's compute and the busiest node link's bytes, ``plan_traffic``, over its
  rate); the settings that fit are played in the order of their bounds, skipping any whose bound
  times 1 + ``PRUNE`` is no less than the best time played so far (branch and bound: the best
  played is within ``PRUNE`` of the best of all). Plans are built once per (nodes, model,
  setting): they depend on neither S nor the link.
- WeiPipe: its single pipeline, where it has no more ranks than layers (N ≤ L); else n/a.
- DDP, FSDP2 (``fsdp``: gradients reduce-scattered on the last micro-batch; ``fsdp-mm``: after
  every micro-batch), FSDP2 with intra-node reshard (``fsdp-node``), HSDP: ``compare.run``.
- 1F1B: P stages per pipeline and N/P data-parallel copies; P over the divisors of N that are at
  most L and tile nodes (a multiple or a divisor of 8): the two largest, and the largest that
  divides L (equal stages); the fastest that fits.

Memory: as ``compare`` counts it, except that TawPipe's and WeiPipe's rows add the head's float32
logits, their log-softmax and gradient (3·B·S·V·4 bytes), which the peers' rows and the engine's
own estimate (``cost.memory.rank_memory``) count but ``cost.memory.memory_per_rank`` does not.

A cell the simulator refuses (a plan too large, more stages than layers) records why instead.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..cost.memory import MemoryEstimate, memory_per_rank
from ..cost.traffic import plan_traffic
from ..plan.actions import OPS, Channel, batches
from ..plan.plan import Plan
from ..plan.schedule import RESIDENT
from . import compare
from .compare import TIE, taw_settings, title
from .hardware import Cluster, device, link
from .peers import peer_memory, stage_counts
from .play import compute_seconds, engine_plan
from .workload import Workload, model

GiB = 2**30
PRUNE = 0.005  # a TawPipe setting is played only if its lower bound is below best / (1 + PRUNE)
DP_PEERS = ("ddp", "fsdp", "fsdp-mm", "fsdp-node", "hsdp")
METHODS = ("tawpipe", "weipipe", *DP_PEERS, "1f1b")
SHORT = {"tawpipe": "Taw", "weipipe": "Wei", "ddp": "DDP", "fsdp": "FSDP", "fsdp-mm": "FSDPmm",
         "fsdp-node": "FSDPn", "hsdp": "HSDP", "1f1b": "1F1B"}


@dataclass(frozen=True)
class Grid:
    """The cells: every (nodes, link, model, seq), on ``per_node`` devices per node."""

    nodes: tuple[int, ...] = (3, 16, 64, 128)
    links: tuple[str, ...] = ("10gbe", "100gb", "400gb")
    models: tuple[str, ...] = ("1b", "7b", "13b", "70b")
    seqs: tuple[int, ...] = (4096, 16384, 65536, 131072)
    per_node: int = 8
    device: str = "h100"
    intra: str = "nvlink"
    acc: int = 8
    micro_batch: int = 1
    recompute: bool = True
    dtype_bytes: int = 2
    grad_bytes: int = 2

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        dev, intra = device(self.device), link(self.intra)
        d["device_detail"] = {"memory_bytes": dev.memory, "matmul_flops": dev.matmul_flops,
                              "attention_flops": dev.attention_flops, "peak_flops": dev.peak_flops}
        d["link_detail"] = {li: {"rate_bytes_per_s": link(li).rate, "bandwidth_bytes_per_s": link(li).bandwidth,
                                 "latency_s": link(li).latency, "per": "node"} for li in self.links}
        d["intra_detail"] = {"bandwidth_bytes_per_s": intra.bandwidth, "latency_s": intra.latency}
        return d


FULL = Grid()
QUICK = Grid(nodes=(3,), links=("10gbe", "400gb"), models=("7b",), seqs=(4096,))


# ------------------------------------------------------------------------------------ one cell


def pipeline_stages(nodes: int, per_node: int, layers: int, tries: int = 2) -> list[int]:
    """1F1B's stage counts tried: among the P dividing N with 2 ≤ P ≤ L that tile nodes (P a
    multiple or a divisor of ``per_node``), the ``tries`` largest and the largest that divides L
    (stages of equal layers)."""
    ok = stage_counts(nodes, per_node, layers)[::-1]
    even = [p for p in ok if layers % p == 0][:1]
    return sorted(set(ok[:tries] + even), reverse=True)


def pipeline_row(cluster: Cluster, work: Workload, acc: int, stages: int) -> compare.Row:
    """``compare.run("1f1b")`` with ``stages`` stages per pipeline."""
    return compare.run("1f1b", cluster, work, acc, settings={"stages": stages})


def compute_floor(plan: Plan, work: Workload, rank: int = 0) -> float:
    """``rank``'s compute in ``plan``: what its played iteration cannot beat."""
    return sum(compute_seconds(plan, u[0], work) for u in batches(plan.actions[rank])
               if OPS[u[0].op].channel is Channel.COMPUTE)


def _gib(x: float) -> float:
    return round(x / GiB, 3)


def _entry(row: compare.Row) -> dict[str, Any]:
    return {"time_s": row.time_s, "compute_s": row.compute_s, "exposed_comm_s": row.exposed_comm_s,
            "memory_gib": _gib(row.memory.total), "fits": row.fits, "settings": row.settings,
            "tokens_per_s_per_device": row.tokens_per_s_per_device, "mfu": row.mfu,
            "inter_gb": row.inter_bytes / 1e9, "intra_gb": row.intra_bytes / 1e9, "bottleneck": row.bottleneck}


def _unplayed(memory: MemoryEstimate, budget: float, settings: dict, why: str) -> dict[str, Any]:
    return {"time_s": None, "memory_gib": _gib(memory.total), "fits": memory.total <= budget, "settings": settings,
            "note": why}


@dataclass
class _Plans:
    """TawPipe's plans for one (nodes, model), with their S- and link-free facts."""

    plans: dict[int, Plan] = field(default_factory=dict)
    settings: list[dict] = field(default_factory=list)
    busiest_node_bytes: dict[int, float] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)


def _build_plans(cluster: Cluster, work: Workload, acc: int) -> _Plans:
    out = _Plans(settings=taw_settings(cluster.nodes, cluster.per_node, work.dims.layers, acc))
    for i, s in enumerate(out.settings):
        try:
            plan = engine_plan(cluster, work, acc, **s)
        except ValueError as e:
            out.errors[i] = str(e)
            continue
        out.plans[i] = plan
        out.busiest_node_bytes[i] = plan_traffic(plan).link_seconds(1.0)[0]
    return out


def _resolved(s: dict, plan: Plan) -> dict:
    return {**s, "prefetch_depth": plan.options["prefetch_depth"], "resident": s["prefetch_depth"] == RESIDENT}


def _tawpipe(plans: _Plans, cluster: Cluster, work: Workload, acc: int, memories: dict[int, MemoryEstimate],
             stats: dict) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """TawPipe's best setting that fits (branch and bound over ``plans``), and every setting tried:
    its memory, lower bound, time where played, and ``status``: played, pruned (its bound cannot
    beat the best played by ``PRUNE``), does not fit (not played), or the planner's error."""
    budget = cluster.device.memory
    tried: dict[int, dict[str, Any]] = {}
    for i, s in enumerate(plans.settings):
        if i in plans.errors:
            tried[i] = {"settings": s, "status": f"error: {plans.errors[i]}", "fits": False, "time_s": None}
            continue
        plan, mem = plans.plans[i], memories[i]
        floor = max(compute_floor(plan, work), plans.busiest_node_bytes[i] / cluster.inter.bandwidth)
        tried[i] = {"settings": _resolved(s, plan), "memory_gib": _gib(mem.total), "fits": mem.total <= budget,
                    "lower_bound_s": floor, "time_s": None, "status": "does not fit"}
    best: tuple[float, dict] | None = None
    for i in sorted((i for i, t in tried.items() if t["fits"]), key=lambda i: tried[i]["lower_bound_s"]):
        t = tried[i]
        if best is not None and t["lower_bound_s"] * (1 + PRUNE) >= best[0]:
            t["status"] = "pruned"
            stats["pruned"] += 1
            continue
        row = compare.play("tawpipe", plans.plans[i], cluster, work, acc, t["settings"], memory=memories[i])
        stats["played"] += 1
        if row.time_s < t["lower_bound_s"] * (1 - 1e-6):
            stats["bound_violations"].append({"settings": t["settings"], "time_s": row.time_s,
                                              "bound_s": t["lower_bound_s"]})
        t.update(time_s=row.time_s, status="played")
        if best is None or row.time_s < best[0]:
            best = (row.time_s, {**_entry(row), "lower_bound_s": t["lower_bound_s"]})
    out = [tried[i] for i in sorted(tried)]
    if best is not None:
        return best[1], out
    if not plans.plans:
        return {"error": "; ".join(sorted(set(plans.errors.values()))) or "no replica count gives a pipeline of at "
                         "most as many ranks as layers", "fits": False, "time_s": None}, out
    least = min((t for t in out if "memory_gib" in t), key=lambda t: t["memory_gib"])
    return {"time_s": None, "fits": False, "memory_gib": least["memory_gib"], "settings": least["settings"],
            "note": f"no setting fits (least memory {least['memory_gib']:.1f} GiB)"}, out


def _weipipe(cluster: Cluster, work: Workload, acc: int) -> dict[str, Any]:
    n, layers = cluster.world_size, work.dims.layers
    if n > layers:
        return {"error": f"n/a: WeiPipe's single pipeline of {n} ranks needs at least {n} layers (L = {layers})",
                "fits": False, "time_s": None}
    try:
        plan = engine_plan(cluster, work, acc, algo="weipipe")
        return _entry(compare.play("weipipe", plan, cluster, work, acc, {}))
    except ValueError as e:
        return {"error": str(e), "fits": False, "time_s": None}


def _pipeline(cluster: Cluster, work: Workload, acc: int) -> dict[str, Any]:
    stages = pipeline_stages(cluster.nodes, cluster.per_node, work.dims.layers)
    if not stages:
        return {"error": "no stage count divides the ranks, tiles nodes and is at most the layers", "fits": False,
                "time_s": None}
    budget, best, unfit = cluster.device.memory, None, []
    for p in stages:
        mem = peer_memory("1f1b", work.dims, cluster, acc, work.recompute, stages=p)
        if mem.total > budget:
            unfit.append(_unplayed(mem, budget, {"stages": p}, "does not fit: not played"))
            continue
        try:
            e = _entry(pipeline_row(cluster, work, acc, p))
        except ValueError as err:
            unfit.append({"error": str(err), "fits": False, "time_s": None, "settings": {"stages": p}})
            continue
        if best is None or e["time_s"] < best["time_s"]:
            best = e
    if best is not None:
        return {**best, "stages_tried": stages}
    least = min((u for u in unfit if "memory_gib" in u), key=lambda u: u["memory_gib"], default=unfit[0])
    return {**least, "stages_tried": stages}


def _peer(method: str, cluster: Cluster, work: Workload, acc: int) -> dict[str, Any]:
    try:
        return _entry(compare.run(method, cluster, work, acc))
    except ValueError as e:
        return {"error": str(e), "fits": False, "time_s": None}


def decide(row: dict[str, Any]) -> dict[str, Any]:
    """The winner (the fastest method that fits), the fastest other method that fits, and
    TawPipe's margin over it (its time / TawPipe's), into ``row``."""
    ok = {m: e for m, e in row["methods"].items() if e.get("fits") and e.get("time_s") is not None}
    row["winner"] = min(ok, key=lambda m: ok[m]["time_s"]) if ok else None
    others = {m: e for m, e in ok.items() if m != "tawpipe"}
    row["best_other"] = min(others, key=lambda m: others[m]["time_s"]) if others else None
    taw = ok.get("tawpipe")
    row["tawpipe_margin"] = (others[row["best_other"]]["time_s"] / taw["time_s"]) if taw and others else None
    return row


def map_rows(grid: Grid = FULL, *, progress: Callable[[str], None] | None = None) -> tuple[list[dict], dict]:
    """One row per cell of ``grid`` (see the module's docstring), and the run's statistics."""
    dev, intra = device(grid.device), link(grid.intra)
    stats: dict[str, Any] = {"played": 0, "pruned": 0, "bound_violations": [], "seconds": {}}
    rows = []
    start = time.perf_counter()
    for nodes in grid.nodes:
        for name in grid.models:
            t0 = time.perf_counter()
            base = model(name, seq=grid.seqs[0], micro_batch=grid.micro_batch, dtype_bytes=grid.dtype_bytes,
                         grad_bytes=grid.grad_bytes)
            shape = Cluster(nodes, grid.per_node, dev, intra, link(grid.links[0]))
            plans = _build_plans(shape, Workload(base, dev, grid.recompute), grid.acc)
            for seq in grid.seqs:
                dims = model(name, seq=seq, micro_batch=grid.micro_batch, dtype_bytes=grid.dtype_bytes,
                             grad_bytes=grid.grad_bytes)
                work = Workload(dims, dev, grid.recompute)
                memories = {i: compare.with_logits(memory_per_rank(p, dims), dims) for i, p in plans.plans.items()}
                for li in grid.links:
                    cluster = Cluster(nodes, grid.per_node, dev, intra, link(li))
                    methods: dict[str, dict] = {}
                    methods["tawpipe"], tried = _tawpipe(plans, cluster, work, grid.acc, memories, stats)
                    methods["weipipe"] = _weipipe(cluster, work, grid.acc)
                    for m in DP_PEERS:
                        methods[m] = _peer(m, cluster, work, grid.acc)
                    methods["1f1b"] = _pipeline(cluster, work, grid.acc)
                    row = decide({"nodes": nodes, "per_node": grid.per_node, "gpus": cluster.world_size,
                                  "link": li, "model": name, "layers": dims.layers, "seq": seq,
                                  "micro_batch": grid.micro_batch, "acc": grid.acc,
                                  "tokens_per_device": grid.acc * seq * grid.micro_batch,
                                  "methods": methods, "tawpipe_tried": tried})
                    rows.append(row)
                    if progress:
                        progress(f"{cluster.world_size:>5} GPUs {li:>6} {name:>4} S={seq:>6}: {_cell_text(row)}")
            stats["seconds"][f"{nodes}x{grid.per_node} {name}"] = round(time.perf_counter() - t0, 2)
    stats["elapsed_s"] = round(time.perf_counter() - start, 2)
    return rows, stats


# ------------------------------------------------------------------------------------ writers


def _settings_text(s: dict | None) -> str:
    if not s:
        return ""
    if "stages" in s:
        return f"P={s['stages']}"
    depth = "res" if s.get("resident") else f"d{s.get('prefetch_depth', 1)}"
    return f"R={s.get('replicas', 1)} k={s.get('mb_per_fetch', 1)} {depth}{'+reuse' if s.get('reuse_weights') else ''}"


def _cell_text(row: dict) -> str:
    w, other, margin = row["winner"], row["best_other"], row["tawpipe_margin"]
    if w is None:
        return "nothing fits"
    if margin is None:
        return f"{title(w)} (only TawPipe fits)" if w == "tawpipe" else f"{title(w)} (TawPipe does not fit)"
    if abs(margin - 1) < TIE:
        return f"tie: TawPipe ×{margin:.2f} vs {title(other)}" if w == "tawpipe" else \
            f"tie: {title(w)} (TawPipe ×{margin:.2f})"
    if w == "tawpipe":
        return f"**TawPipe ×{margin:.2f}** vs {title(other)}"
    return f"{title(w)} (TawPipe ×{margin:.2f})"


def _row_key(row: dict) -> tuple:
    return row["gpus"], {"10gbe": 0, "100gb": 1, "400gb": 2}.get(row["link"], 9), row["link"]


def markdown(rows: list[dict], grid: Grid = FULL, stats: dict | None = None) -> str:
    """One table per model: a row per (GPUs, link), a column per S; a cell names the winner and
    TawPipe's margin over the fastest other method that fits (×1.30: TawPipe 1.30 times as fast;
    ×0.80: it takes 1.25 times as long as the winner); then TawPipe's best settings per cell."""
    lines = [
        "# Which method wins: the simulator's map",
        "",
        f"{grid.device.upper()} ({device(grid.device).memory / 1e9:.0f} GB), {grid.per_node} per node on "
        f"{grid.intra}; one inter-node link per node (10gbe: 10 Gbit/s TCP; 100gb, 400gb: RDMA). Micro-batch "
        f"{grid.micro_batch}, {grid.acc} micro-batches per device per iteration, recompute "
        f"{'on' if grid.recompute else 'off'}, bf16 weights and gradients. A cell: the fastest method whose memory "
        "fits, and TawPipe's margin = (fastest other method that fits) / TawPipe, both per iteration of the same "
        f"tokens per device. Bold: TawPipe wins; tie: the margin is within {TIE:.0%} of 1.",
        "",
        f"Fits: memory per device ≤ {device(grid.device).memory / GiB:.1f} GiB, counting for every method the head's "
        "float32 logits, log-softmax and gradient (3·S·V·4 bytes per micro-batch, no chunked loss) and, with "
        "recompute, the working set of what one backward recomputes at once (one layer for the peers, one chunk "
        "for TawPipe and WeiPipe). Methods: TawPipe (R, k, depth searched), WeiPipe (where N ≤ L), DDP, FSDP2 "
        "(reduce-scatter on the last micro-batch; FSDP2-mm: on every one), FSDP2-node (intra-node reshard), HSDP, "
        "1F1B (P stages, N/P copies; P searched).",
        "",
    ]
    seqs = sorted({r["seq"] for r in rows})
    for m in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == m]
        lines += [f"## {m.upper()} (L = {sub[0]['layers']})", "",
                  "| GPUs | link | " + " | ".join(f"S = {s // 1024}k" for s in seqs) + " |",
                  "|---|---|" + "---|" * len(seqs)]
        keys = sorted({_row_key(r) for r in sub})
        for key in keys:
            cells = {r["seq"]: r for r in sub if _row_key(r) == key}
            lines.append(f"| {key[0]} | {key[2]} | "
                         + " | ".join(_cell_text(cells[s]) if s in cells else "" for s in seqs) + " |")
        lines += ["", "TawPipe's best settings and seconds per iteration (TawPipe / fastest other that fits):", "",
                  "| GPUs | link | " + " | ".join(f"S = {s // 1024}k" for s in seqs) + " |",
                  "|---|---|" + "---|" * len(seqs)]
        for key in keys:
            cells = {r["seq"]: r for r in sub if _row_key(r) == key}
            lines.append(f"| {key[0]} | {key[2]} | " + " | ".join(_settings_cell(cells[s]) if s in cells else ""
                                                                for s in seqs) + " |")
        lines.append("")
    if stats:
        lines += [f"{len(rows)} cells in {stats['elapsed_s']:.0f} s; TawPipe settings played {stats['played']}, "
                  f"skipped by their lower bound {stats['pruned']}."]
    return "\n".join(lines)


def _settings_cell(row: dict) -> str:
    taw = row["methods"]["tawpipe"]
    other = row["methods"].get(row["best_other"]) if row["best_other"] else None
    t = f"{taw['time_s']:.3g}" if taw.get("fits") and taw.get("time_s") else "–"
    o = f"{other['time_s']:.3g}" if other else "–"
    s = _settings_text(taw.get("settings")) if taw.get("fits") else "does not fit"
    return f"{s}; {t} / {o} s"


def write_json(rows: list[dict], path: Path, grid: Grid = FULL, stats: dict | None = None) -> None:
    """``{"grid", "prune", "tie", "stats", "rows"}``, a row per line."""
    head = json.dumps({"grid": grid.describe(), "prune": PRUNE, "tie": TIE, "stats": stats or {}}, default=str)
    body = ",\n".join(json.dumps(r, default=str, separators=(",", ":")) for r in rows)
    path.write_text(f'{head[:-1]}, "rows": [\n{body}\n]}}\n')


def write_png(rows: list[dict], path: Path, grid: Grid = FULL) -> None:
    """Panels per model; x = S, y = GPUs × link; colour = TawPipe's margin on a log scale clipped
    to [1/``span``, ``span``] (red where TawPipe is faster, blue where it is slower, grey where
    TawPipe or every other method does not fit); each cell names the winner and the margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    models = list(dict.fromkeys(r["model"] for r in rows))
    seqs = sorted({r["seq"] for r in rows})
    keys = sorted({_row_key(r) for r in rows})
    span = 2.0
    norm = LogNorm(vmin=1 / span, vmax=span, clip=True)
    cols = min(len(models), 2)
    nrows = -(-len(models) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 + 1.3 * len(seqs) * cols, 0.36 * len(keys) * nrows + 1.6),
                             squeeze=False, sharey=True, constrained_layout=True)
    image = None
    for ax, m in zip(axes.flat, models):
        cells = [[math.nan] * len(seqs) for _ in keys]
        for r in rows:
            if r["model"] != m:
                continue
            y, x = keys.index(_row_key(r)), seqs.index(r["seq"])
            cells[y][x] = r["tawpipe_margin"] if r["tawpipe_margin"] else math.nan
            ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color="0.88", zorder=0))
            ax.text(x, y, _png_text(r), ha="center", va="center", fontsize=6.5, zorder=3,
                    fontweight="bold" if r["winner"] == "tawpipe" and r["tawpipe_margin"] else "normal")
        image = ax.imshow(cells, cmap="coolwarm", norm=norm, aspect="auto", zorder=1)
        ax.set_xticks(range(len(seqs)), [f"{s // 1024}k" for s in seqs])
        ax.set_yticks(range(len(keys)), [f"{k[0]} GPUs, {k[2]}" for k in keys], fontsize=7)
        ax.set_xlabel("sequence length S", fontsize=8)
        layers = next(r["layers"] for r in rows if r["model"] == m)
        ax.set_title(f"LLaMA {m.upper()} (L = {layers})", fontsize=9)
        for y in range(1, len(keys)):
            if keys[y][0] != keys[y - 1][0]:
                ax.axhline(y - 0.5, color="k", lw=0.8)
    for ax in axes.flat[len(models):]:
        ax.axis("off")
    if image is not None:
        bar = fig.colorbar(image, ax=axes, shrink=0.5, extend="both")
        ticks = [t for t in (0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0) if 1 / span <= t <= span]
        bar.set_ticks(ticks, labels=[f"×{t:g}" for t in ticks])
        bar.ax.minorticks_off()
        bar.set_label("TawPipe's speed-up over the fastest other method that fits (clipped)", fontsize=8)
    fig.suptitle(f"Winner among the methods that fit: {grid.device.upper()} {device(grid.device).memory / 1e9:.0f} GB, "
                 f"{grid.per_node} per node ({grid.intra}), one inter-node link per node; micro-batch "
                 f"{grid.micro_batch}, acc {grid.acc}, recompute, bf16\n"
                 "cell: winner and TawPipe's margin; 'Taw ✗': TawPipe does not fit; grey: no margin", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _png_text(row: dict) -> str:
    w, margin = row["winner"], row["tawpipe_margin"]
    if w is None:
        return "none fits"
    if margin is None:
        return f"{SHORT[w]}\n(only fit)" if w == "tawpipe" else f"{SHORT[w]}\nTaw ✗"
    return f"{SHORT[w]}\n×{margin:.2f}" if w == "tawpipe" else f"{SHORT[w]}\nTaw ×{margin:.2f}"


def main_map(out: Path, quick: bool = False) -> int:
    """Compute the map (``QUICK`` or the full grid), print its table, and write ``map.json``,
    ``map.md`` and ``map.png`` into ``out``."""
    grid = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    rows, stats = map_rows(grid, progress=lambda s: print(s, file=sys.stderr, flush=True))
    md = markdown(rows, grid, stats)
    print(md)
    write_json(rows, out / "map.json", grid, stats)
    (out / "map.md").write_text(md + "\n")
    write_png(rows, out / "map.png", grid)
    if stats["bound_violations"]:
        print(f"warning: {len(stats['bound_violations'])} TawPipe settings played faster than their lower bound "
              f"(see map.json's stats)", file=sys.stderr)
    return 0


if __name__ == "__main__":  # python -m tawpipe.sim.atlas OUT [--quick]
    sys.exit(main_map(Path(sys.argv[1]), quick="--quick" in sys.argv[2:]))
