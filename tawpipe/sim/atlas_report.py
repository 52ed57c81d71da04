"""The map's outputs (``tawpipe simulate --map``, design §9.6): its table in Markdown with the
counts and what fits where, its rows as JSON, its picture, and the command that plays it
(``atlas`` plays the cells)."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ..atomic import write_atomic
from ..plan.schedule import HOST
from .atlas import FIT_SEQS, FULL, METHODS, PRUNE, QUICK, SHORT, GiB, Grid, fingerprint, largest_fits, map_rows
from .compare import TIE, title
from .hardware import device


def fits_markdown(fits: dict[str, dict[str, int | None]], grid: Grid = FULL, nodes: int = 4) -> str:
    """``largest_fits`` as a table: a row per method, a column per model."""
    models = list(fits)
    lines = [f"## What fits where: the longest sequence per method on {nodes * grid.per_node} "
             f"{grid.device.upper()}s ({nodes} x {grid.per_node})", "",
             f"Micro-batch {grid.micro_batch}, {grid.acc} micro-batches per device, the chunked loss; each method with "
             "the settings and memory savers the map tries; host memory "
             f"{grid.host.memory / 1e12:.0f} TB per node. S from {FIT_SEQS[0] // 1024}k to {FIT_SEQS[-1] // 1024}k.", "",
             "| method | " + " | ".join(m.upper() for m in models) + " |", "|---|" + "---|" * len(models)]
    for method in METHODS:
        lines.append(f"| {title(method)} | " + " | ".join(
            "none" if fits[m][method] is None else f"{fits[m][method] // 1024}k" for m in models) + " |")
    return "\n".join(lines)


def progress_text(row: dict) -> str:
    """A cell's line as the map goes."""
    return f"{row['gpus']:>5} GPUs {row['link']:>6} {row['model']:>4} S={row['seq']:>6}: {_cell_text(row)}"


# ------------------------------------------------------------------------------------ writers


def summary(rows: list[dict], long_from: tuple[int, ...] = (16384, 32768)) -> dict[str, Any]:
    """The map in counts: cells where TawPipe is the fastest by more than ``TIE`` (``wins``), ties
    within it, loses, does not fit while another method does, and where nothing fits; and for each
    S of ``long_from``, among the cells at S >= it where something fits, those where TawPipe is the
    fastest or within ``TIE`` of it."""
    out: dict[str, Any] = dict.fromkeys(("wins", "ties", "loses", "tawpipe_does_not_fit", "nothing_fits"), 0)
    for s in long_from:
        out[f"s_ge_{s}_where_something_fits"] = out[f"s_ge_{s}_tawpipe_fastest_or_within_tie"] = 0
    keys = {"neither fits": "nothing_fits", "TawPipe does not fit": "tawpipe_does_not_fit", "only TawPipe fits": "wins"}
    for r in rows:
        standing = _standing(r)
        key = keys.get(standing, standing)
        out[key] += 1
        for s in long_from:
            if r["seq"] >= s and r["winner"] is not None:
                out[f"s_ge_{s}_where_something_fits"] += 1
                out[f"s_ge_{s}_tawpipe_fastest_or_within_tie"] += key in ("wins", "ties")
    return {**out, "cells": len(rows)}


FSDP2_FAMILY = ("fsdp", "fsdp-mm", "fsdp-node", "hsdp")  # FSDP2's ways to shard, CP tried in each
STANDINGS = ("wins", "ties", "loses", "only TawPipe fits", "TawPipe does not fit", "neither fits")


def _standing(row: dict, others: tuple[str, ...] | None = None) -> str:
    """TawPipe against the fastest other method that fits (or the fastest of ``others``): "wins"
    (by more than ``TIE``), "ties", "loses", "only TawPipe fits", "TawPipe does not fit", "neither fits"."""
    ok = {m: e for m, e in row["methods"].items() if e.get("fits") and e.get("time_s") is not None}
    rivals = [e["time_s"] for m, e in ok.items() if m != "tawpipe" and (others is None or m in others)]
    if "tawpipe" not in ok:
        return "TawPipe does not fit" if rivals else "neither fits"
    if not rivals:
        return "only TawPipe fits"
    m = min(rivals) / ok["tawpipe"]["time_s"]
    return "wins" if m >= 1 + TIE else "ties" if m > 1 - TIE else "loses"


def standings(rows: list[dict], others: tuple[str, ...] | None = None, seq_from: int = 0) -> dict[str, int]:
    """How often TawPipe wins, ties or loses against the fastest of ``others`` (every other method:
    None) at S >= ``seq_from`` (``_standing``)."""
    out: dict[str, int] = {}
    for r in rows:
        if r["seq"] >= seq_from:
            key = _standing(r, others)
            out[key] = out.get(key, 0) + 1
    return out


def why_not(row: dict) -> str:
    """Why TawPipe is not the fastest in ``row`` or within ``TIE`` of it, from the played times: it
    does not fit (its least memory per device), or the larger of its extra compute (its memory
    savers) and its extra exposed time against the winner's: communication where it moves more
    bytes between nodes, else its schedule's waits."""
    taw, w = row["methods"]["tawpipe"], row["methods"][row["winner"]]
    if not taw.get("fits"):
        least = min((t["least_memory_gib"] for t in row.get("tawpipe_tried", []) if "least_memory_gib" in t),
                    default=None)
        return "does not fit" + (f": {least:.0f} GiB per device at the least" if least is not None else "")
    extra_compute = taw["compute_s"] - w["compute_s"]
    extra_comm = taw["exposed_comm_s"] - w["exposed_comm_s"]
    if extra_comm >= extra_compute and taw["inter_gb"] < w["inter_gb"]:  # not the bytes: the schedule's waits
        host = " and its savers' host transfers" if taw.get("pcie_gb") else ""
        return (f"waits: {taw['exposed_comm_s']:.3g} s beyond its compute against {w['exposed_comm_s']:.3g}, with "
                f"fewer bytes through the busiest node's port ({taw['inter_gb']:.3g} GB against {w['inter_gb']:.3g}): "
                f"its pipeline's fill and drain{host} (TawPipe's bottleneck: {taw['bottleneck']})")
    if extra_comm >= extra_compute:
        return (f"communication: {taw['exposed_comm_s']:.3g} s exposed against {w['exposed_comm_s']:.3g}, "
                f"{taw['inter_gb']:.3g} GB through the busiest node's port against {w['inter_gb']:.3g} "
                f"(TawPipe's bottleneck: {taw['bottleneck']})")
    return (f"compute: {taw['compute_s']:.3g} s against {w['compute_s']:.3g} (TawPipe "
            f"{_method_text('tawpipe', taw)}; {title(row['winner'])} {_method_text(row['winner'], w)})")


def _method_text(method: str, entry: dict) -> str:
    """A played method's setting and memory savers in a few words."""
    s = entry.get("settings") or {}
    if method in ("tawpipe", "weipipe"):
        return _settings_text(s, entry.get("savers_short") or "no savers")
    words = [f"P={s['stages']}"] if "stages" in s else []
    words.append("checkpointing" if s.get("recompute") else "no checkpointing")
    if entry.get("pcie_gb"):
        words.append("save_on_cpu")
    if s.get("context_parallel", 1) > 1:
        words.append(f"CP{s['context_parallel']}")
    return ", ".join(words)


def shortfalls(rows: list[dict], seq_from: int = 0, seq_below: int | None = None) -> list[dict]:
    """The cells at ``seq_from`` <= S < ``seq_below`` where something fits and TawPipe is neither
    the fastest nor within ``TIE`` of it, each with the winner, TawPipe's margin and ``why_not``."""
    out = []
    for r in sorted(rows, key=lambda r: (r["model"], r["seq"], _row_key(r))):
        if r["seq"] < seq_from or (seq_below is not None and r["seq"] >= seq_below) or r["winner"] is None:
            continue
        if _standing(r) in ("loses", "TawPipe does not fit"):
            out.append({"cell": f"{r['model'].upper()}, {r['gpus']} GPUs, {r['link']}, {r['seq'] // 1024}k",
                        "winner": title(r["winner"]), "margin": r["tawpipe_margin"], "why": why_not(r)})
    return out


def shortfalls_markdown(rows: list[dict]) -> str:
    """The cells TawPipe does not win or tie, named with why: at S >= 16k, and below it."""
    lines = []
    for head, low, below in (("at S ≥ 16k", 16384, None), ("below S = 16k", 0, 16384)):
        found = shortfalls(rows, low, below)
        lines += [f"## Where TawPipe is not the fastest or within {TIE:.0%}, {head}", ""]
        if not found:
            lines += ["None.", ""]
            continue
        lines += ["| cell | fastest | TawPipe's margin | why |", "|---|---|---|---|"]
        lines += [f"| {s['cell']} | {s['winner']} | " + ("–" if s["margin"] is None else f"×{s['margin']:.2f}")
                  + f" | {s['why']} |" for s in found]
        lines.append("")
    return "\n".join(lines)


def _settings_text(s: dict | None, savers: str | None = None) -> str:
    if not s:
        return ""
    if "stages" in s:
        return f"P={s['stages']}"
    depth = "res" if s.get("resident") else f"d{s.get('prefetch_depth', 1)}"
    reuse = {True: "+reuse", HOST: "+host"}.get(s.get("reuse_weights"), "")
    return (f"R={s.get('replicas', 1)} k={s.get('mb_per_fetch', 1)} {depth}{reuse}"
            + (f" CP{s['context_parallel']}" if s.get("context_parallel", 1) > 1 else "")
            + (f" {savers}" if savers else ""))


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
        f"{grid.intra}, {grid.host.memory / 1e12:.0f} TB of host memory per node; one inter-node link per node "
        f"(10gbe: 10 Gbit/s TCP; 100gb, 400gb: RDMA). Micro-batch {grid.micro_batch}, {grid.acc} micro-batches per "
        f"device per iteration, bf16 weights and gradients, {'the chunked' if grid.chunked_loss else 'the plain'} "
        "loss for every method. A cell: the fastest method whose memory fits, and TawPipe's margin = (fastest other "
        "method that fits) / TawPipe, both per iteration of the same tokens per device. Bold: TawPipe wins; tie: the "
        f"margin is within {TIE:.0%} of 1.",
        "",
        f"Fits: memory per device ≤ {device(grid.device).memory / GiB:.1f} GiB and what a node's ranks keep on the "
        "host within its memory. Every method runs the fastest of its memory savers that fits: TawPipe its settings "
        "(R, k, depth: res = every chunk resident on the device, d1+host = two buffers and the fetched chunks kept "
        "in host memory) and savers (recompute none, chunk, block or layer; activations and the optimizer state on "
        "the host); DDP, FSDP2 (reduce-scatter on the last micro-batch; FSDP2-mm: on every one), FSDP2-node "
        "(intra-node reshard) and HSDP with or without per-block checkpointing and torch's save_on_cpu; 1F1B "
        "(P stages, N/P copies; P searched) with or without checkpointing; WeiPipe (where N ≤ L) recomputing each "
        "chunk. TawPipe's savers are named after its settings: the recompute, +act (activations on the host), "
        "+state (the optimizer on the host).",
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
    c = summary(rows)
    lines += [f"TawPipe is the fastest by more than {TIE:.0%} in {c['wins']} of {c['cells']} cells, within {TIE:.0%} "
              f"in {c['ties']}, slower in {c['loses']}; it does not fit where another method does in "
              f"{c['tawpipe_does_not_fit']}, and nothing fits in {c['nothing_fits']}. At S ≥ 16k, where something fits, "
              f"it is the fastest or within {TIE:.0%} in {c['s_ge_16384_tawpipe_fastest_or_within_tie']} of "
              f"{c['s_ge_16384_where_something_fits']}; at S ≥ 32k in {c['s_ge_32768_tawpipe_fastest_or_within_tie']} "
              f"of {c['s_ge_32768_where_something_fits']}."]
    against = standings(rows, FSDP2_FAMILY, 32768)
    lines += ["", "Against FSDP2 (its fastest way to shard that fits, context parallelism tried in each) at S ≥ 32k, in "
              f"{sum(against.values())} cells: " + ", ".join(f"{k} {against[k]}" for k in STANDINGS if k in against) + "."]
    lines += ["", shortfalls_markdown(rows)]
    if stats:
        lines += [f"{len(rows)} cells, {sum(stats['seconds'].values()):,.0f} s of play summed over them (the run that "
                  f"wrote this took {stats['elapsed_s']:,.0f} s: cells played before are read from their folder); "
                  f"TawPipe settings and savers played {stats['played']}, skipped by their lower bound "
                  f"{stats['pruned']}."]
    return "\n".join(lines)


def _settings_cell(row: dict) -> str:
    taw = row["methods"]["tawpipe"]
    other = row["methods"].get(row["best_other"]) if row["best_other"] else None
    t = f"{taw['time_s']:.3g}" if taw.get("fits") and taw.get("time_s") else "–"
    o = f"{other['time_s']:.3g}" if other else "–"
    s = _settings_text(taw.get("settings"), taw.get("savers_short")) if taw.get("fits") else "does not fit"
    return f"{s}; {t} / {o} s"


def write_json(rows: list[dict], path: Path, grid: Grid = FULL, stats: dict | None = None) -> None:
    """``{"grid", "prune", "tie", "stats", "rows"}``, a row per line."""
    head = json.dumps({"grid": grid.describe(), "prune": PRUNE, "tie": TIE, "stats": stats or {}}, default=str)
    body = ",\n".join(json.dumps(r, default=str, separators=(",", ":")) for r in rows)
    write_atomic(path, f'{head[:-1]}, "rows": [\n{body}\n]}}\n')


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
                 f"{grid.micro_batch}, acc {grid.acc}, bf16, {'chunked' if grid.chunked_loss else 'plain'} loss, "
                 "every method's memory savers searched\n"
                 "cell: winner and TawPipe's margin; 'Taw ✗': TawPipe does not fit; grey: no margin", fontsize=8)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def _png_text(row: dict) -> str:
    w, margin = row["winner"], row["tawpipe_margin"]
    if w is None:
        return "none fits"
    if margin is None:
        return f"{SHORT[w]}\n(only fit)" if w == "tawpipe" else f"{SHORT[w]}\nTaw ✗"
    return f"{SHORT[w]}\n×{margin:.2f}" if w == "tawpipe" else f"{SHORT[w]}\nTaw ×{margin:.2f}"


def processes(jobs: int) -> ProcessPoolExecutor | nullcontext[None]:
    """A pool of ``jobs`` processes for ``map_rows`` (spawned: the simulator holds no state a fork
    should copy), or none for 1."""
    if jobs > 1:
        return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    return nullcontext()


def saved_fits(path: Path, grid: Grid, key: str) -> dict | None:
    """``largest_fits`` as the map at ``path`` saved it, where it was made of ``grid`` under the
    source fingerprint ``key``; else None. It takes minutes and, like a cell, changes only with
    the source: a map read again from its cells need not count it again."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict):
        return None
    made = saved.get("stats", {})
    same = saved.get("grid") == json.loads(json.dumps(grid.describe(), default=str)) and made.get("fingerprint") == key
    return made.get("largest_fits") if same else None


def main_map(out: Path, quick: bool = False, jobs: int = 1) -> int:
    """Compute the map (``QUICK`` or the full grid) in ``jobs`` processes, print its table, and
    write ``map.json``, ``map.md`` and ``map.png`` into ``out``. Each cell is kept in ``out/cells``
    as it is played: run again after a stop, the map plays only the cells it lacks (and
    ``saved_fits`` spares the largest S that fits)."""
    grid = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    key = fingerprint(grid)
    fits = saved_fits(out / "map.json", grid, key)
    with processes(jobs) as pool:
        fitting = pool.submit(largest_fits, grid) if pool and fits is None else None
        rows, stats = map_rows(grid, progress=lambda row: print(progress_text(row), file=sys.stderr, flush=True),
                               pool=pool, cells=out / "cells")
        if fits is None:
            fits = fitting.result() if fitting else largest_fits(grid)
    md = markdown(rows, grid, stats) + "\n\n" + fits_markdown(fits, grid)
    print(md)
    write_json(rows, out / "map.json", grid, {**stats, "largest_fits": fits, "fingerprint": key})
    write_atomic(out / "map.md", md + "\n")
    write_png(rows, out / "map.png", grid)
    if stats["bound_violations"]:
        print(f"warning: {len(stats['bound_violations'])} TawPipe settings played faster than their lower bound "
              f"(see map.json's stats)", file=sys.stderr)
    return 0


if __name__ == "__main__":  # python -m tawpipe.sim.atlas_report OUT [--quick]: tawpipe simulate --map OUT
    sys.exit(main_map(Path(sys.argv[1]), quick="--quick" in sys.argv[2:], jobs=os.cpu_count() or 1))
