"""The PNG plots of `tawpipe bench cluster`: per shape, time and bytes per method; over S, time
and memory; and the closed-form bytes against S with the crossovers."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from ...atomic import write_atomic
from ..baselines import RunConfig
from .method import predicted_busiest
from .report import by_cluster, crossover_seq


def plots(result: dict[str, Any], out: str) -> list[str]:
    """Every plot of ``result`` into ``out``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = len({s["config"]["seq_len"] for s in result["shapes"]}) > 1
    paths = [path for shape in result["shapes"] if (path := shape_plot(result, shape, out, plt, sweep))]
    if sweep:
        paths += sweep_plots(result, out, plt)
    paths.append(bytes_vs_seq_plot(result, out, plt))
    return paths


def shape_plot(result: dict[str, Any], shape: dict[str, Any], out: str, plt: Any, sweep: bool) -> str | None:
    """One shape: each method's time against the network floor and its compute-only time, and its
    inter-node bytes measured against predicted (None where no method ran)."""
    c = shape["config"]
    rows = [r for r in shape["rows"] if r.get("status") == "ok" and not r.get("unlimited")]
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(rows))
    med = [r["time_median_s"] for r in rows]
    err = [[r["time_median_s"] - r["time_min_s"] for r in rows], [r["time_max_s"] - r["time_median_s"] for r in rows]]
    ax1.bar(x, med, yerr=err, capsize=4, color="tab:blue")
    floors = [r.get("floor_s") for r in rows]
    if any(f is not None for f in floors):
        ax1.scatter(x, [f or 0 for f in floors], marker="_", s=600, color="black", label="network floor", zorder=3)
    free = [r.get("compute_only_s") for r in rows]
    if any(f is not None for f in free):
        ax1.scatter([i for i, f in zip(x, free) if f], [f for f in free if f], marker="_", s=600,
                    color="tab:red", label="compute only (links unlimited)", zorder=3)
    if any(f is not None for f in floors + free):
        ax1.set_ylim(top=1.35 * max(r["time_max_s"] for r in rows))  # room for the legend above the bars
        ax1.legend(loc="upper right")
    ax1.set_ylabel("iteration time, s (median, min–max)")
    meas = [(r["measured_busiest_bytes"] or 0) / 1e6 for r in rows]
    pred = [(r["predicted_busiest_bytes"] or 0) / 1e6 for r in rows]
    ax2.bar([i - 0.2 for i in x], meas, width=0.4, label="measured (veth)")
    ax2.bar([i + 0.2 for i in x], pred, width=0.4, label="predicted")
    ax2.set_ylabel("inter-node MB / iteration, busiest node")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), [r["label"] for r in rows], rotation=30, ha="right")
    fig.suptitle(f"{c['nodes']} nodes × {c['per_node']} ranks, S = {c['seq_len']}, "
                 f"{result['rate'] or 'unlimited'} links, {result.get('compute', 'compute shared')}")
    fig.tight_layout()
    path = os.path.join(out, f"cluster_{c['nodes']}x{c['per_node']}" + (f"_s{c['seq_len']}" if sweep else "")
                        + ".png")
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return path


def bytes_vs_seq_plot(result: dict[str, Any], out: str, plt: Any) -> str:
    """Per cluster, every method's closed-form inter-node bytes against S, with TawPipe's (its
    plan's) and where 1F1B's reach them."""
    seqs = [2**p for p in range(7, 16)]  # 128 ... 32768
    one_per_cluster = list({(s["config"]["nodes"], s["config"]["per_node"]): s for s in result["shapes"]}.values())
    fig, axes = plt.subplots(1, len(one_per_cluster), figsize=(7 * len(one_per_cluster), 4.8), squeeze=False)
    for ax, shape in zip(axes[0], one_per_cluster):
        cfg = RunConfig(**{k: v for k, v in shape["config"].items() if k != "check_dir"})
        for name, label in (("ddp", "DDP"), ("fsdp", "FSDP2"), ("fsdp-node", "FSDP2 node reshard"),
                            ("hsdp", "HSDP"), ("weipipe", "WeiPipe"), ("1f1b", "1F1B")):
            ax.plot(seqs, [predicted_busiest(name, replace(cfg, seq_len=s)) / 1e6 for s in seqs], label=label)
        by_name = {r["method"]: r for r in shape["rows"]}
        lines = [("tawpipe (k=1)", by_name.get("tawpipe", {}).get("predicted_busiest_bytes")
                  or predicted_busiest("tawpipe", cfg), "-")]
        best = by_name.get("tawpipe-best", {})
        if best.get("predicted_busiest_bytes"):  # only once the engine executes k > 1
            lines.append((best["label"], best["predicted_busiest_bytes"], ":"))
        for label, taw, style in lines:
            ax.plot(seqs, [taw / 1e6] * len(seqs), style, label=label, color="black", linewidth=2)
            s_star = crossover_seq(cfg, taw)
            ax.axvline(s_star, color="grey", linestyle="--")
            ax.annotate(f"1F1B = {label}\nat S = {s_star:,.0f}", (s_star, taw / 1e6), textcoords="offset points",
                        xytext=(6, 12), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("inter-node MB / iteration, busiest node")
        ax.set_title(f"{cfg.nodes}×{cfg.per_node}: hidden {cfg.hidden}, {cfg.layers} layers, "
                     f"{cfg.micro_batches}×{cfg.batch_size} seq/rank", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("inter-node bytes per iteration (closed forms; tawpipe: its plan)")
    fig.tight_layout()
    path = os.path.join(out, "cluster_bytes_vs_seq.png")
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return path


def sweep_plots(result: dict[str, Any], out: str, plt: Any) -> list[str]:
    """Time per iteration against S, one line per method, with the measured and the predicted
    crossover of tawpipe's best with 1F1B; peak memory per rank against S beside it."""
    paths = []
    crossings = {(c["nodes"], c["per_node"]): c for c in result.get("crossovers", [])}
    for key, shapes in by_cluster(result).items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        labels = {r["method"]: r["label"] for s in shapes for r in s["rows"] if not r.get("unlimited")}
        for name, label in labels.items():
            pts = [(s["config"]["seq_len"], r) for s in shapes for r in s["rows"]
                   if r["method"] == name and r.get("status") == "ok"]
            ax1.plot([p for p, _ in pts], [r["time_median_s"] for _, r in pts], "o-", label=label)
            ax2.plot([p for p, _ in pts], [r["peak_rss_bytes_max"] / 2**20 for _, r in pts], "o-", label=label)
        c = crossings.get(key)
        if c and c["predicted_seq"]:
            ax1.axvline(c["predicted_seq"], color="grey", linestyle="--",
                        label=f"predicted crossover S = {c['predicted_seq']:,.0f} (bytes)")
        if c and c["measured_seq"]:
            ax1.axvline(c["measured_seq"], color="black", linestyle=":",
                        label=f"measured crossover S = {c['measured_seq']:,.0f}")
        for ax, what in ((ax1, "iteration time, s (median)"), (ax2, "peak RSS per rank, MiB")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length S")
            ax.set_ylabel(what)
            ax.legend(fontsize=8)
        ax1.set_yscale("log")
        cfg = shapes[0]["config"]
        fig.suptitle(f"{key[0]} nodes × {key[1]} ranks, hidden {cfg['hidden']}, {cfg['layers']} layers, "
                     f"{result['rate'] or 'unlimited'} links, {result.get('compute', 'compute shared')}")
        fig.tight_layout()
        path = os.path.join(out, f"cluster_sweep_{key[0]}x{key[1]}.png")
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
        plt.close(fig)
        paths.append(path)
    return paths
