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
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ..commands import UsageError
from ..cluster import (Cluster, ClusterError, ClusterSpec, LinkBytes, add_link_arguments, describe_compute, host,
                       spec_from_args)
from ..cost.traffic import crossover_tokens, estimate, fsdp_numel, plan_traffic
from ..engine.engine import TawPipe
from ..models.llama import block_forward, llama_loss
from ..plan.schedule import RESIDENT, prefetch_depth_arg
from ..plan.topology import Topology
from ..sim.calibrate import median_device, on_rank
from ..simulate import shape_dims
from . import DEFAULT_OUT, baselines, provenance
from .baselines import RunConfig

LOSS_TOL = 1e-5  # relative, fp32: the first two losses
UPDATE_TOL = 1e-4  # relative norm of the first update; Adam's first step is ~lr·sign(g), so a
# gradient that rounds to the other side of zero flips a whole lr step: a few per million


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    engine_options: dict[str, Any] | None = None  # None: a peer from tawpipe.bench.baselines
    unlimited: bool = False  # run with the links' rate limit lifted: the method's compute-only time

    @property
    def replicas(self) -> int:
        """R of a TawPipe run as R replicas (engine option ``replicas``); 1 otherwise."""
        return (self.engine_options or {}).get("replicas", 1)


def compute_only(m: Method) -> Method:
    """``m`` again, on the same cluster with its links unlimited: the compute side of its bound."""
    return Method(f"{m.name}-compute", f"{m.label}, links unlimited", m.engine_options, unlimited=True)


def methods(micro_batches: int, prefetch_depth: int | str = 1, recompute: str = "none",
            replicas: tuple[int, ...] = ()) -> dict[str, Method]:
    """Every method the bench knows, in the default order. ``prefetch_depth`` is tawpipe's at k = 1;
    the best k keeps every chunk resident (one fetch per chunk and iteration; this model fits).
    ``recompute`` is the engine's (tawpipe and WeiPipe); "none" keeps activations, as every peer
    here does, so all do the same work. Each R in ``replicas`` adds tawpipe-rR and tawpipe-best-rR:
    the same two with the engine's ``replicas=R`` (see :func:`for_shape`)."""
    k = micro_batches  # the largest k dividing micro_batches; it fits this model's memory
    paper = {"mb_per_fetch": 1, "prefetch_depth": prefetch_depth, "reuse_weights": False}  # not the engine's "auto"
    taw = [Method("tawpipe", "tawpipe (k=1)", {**paper, "recompute": recompute})]
    if k > 1:
        best = {"mb_per_fetch": k, "reuse_weights": True, "prefetch_depth": RESIDENT, "recompute": recompute}
        taw.append(Method("tawpipe-best", f"tawpipe (k={k}, reuse, resident)", best))
    out = list(taw)
    for r in replicas:
        out += [Method(f"{m.name}-r{r}", f"{m.label}, {r} replicas", {**m.engine_options, "replicas": r})
                for m in taw]
    out += [
        Method("weipipe", "WeiPipe", {"algo": "weipipe", "recompute": recompute}),
        Method("fsdp", "FSDP2"), Method("fsdp-mm", "FSDP2 memory-matched"),
        Method("fsdp-node", "FSDP2 node reshard"), Method("hsdp", "HSDP"),
        Method("ddp", "DDP"), Method("1f1b", "1F1B"),
    ]
    return {m.name: m for m in out}


def for_shape(m: Method, nodes: int, per_node: int) -> Method | None:
    """``m`` on a cluster of ``nodes`` x ``per_node``: a run as R replicas names the replicas' shape
    in its label, and is left out (None) where R does not divide the nodes."""
    r = m.replicas
    if r == 1:
        return m
    if nodes % r:
        return None
    return replace(m, label=f"{m.label} of {nodes // r}×{per_node}")


def build_engine(model: Any, cfg: RunConfig, topology: Topology, device: torch.device, **options: Any) -> TawPipe:
    """The one place the bench builds a TawPipe/WeiPipe engine, as ``tawpipe train`` does, with the
    head and loss of ``cfg.loss``; ``options`` (algo, mb_per_fetch, prefetch_depth, ...) go to the
    engine as they are."""
    return TawPipe(
        model.blocks, model.embed, model.head, llama_loss, topology=topology,
        micro_batches=cfg.micro_batches, optimizer=functools.partial(baselines.make_optimizer, cfg),
        block_forward=block_forward, block_context=lambda t: model.block_context(t.shape[1], device),
        device=device, head_loss=baselines.head_loss(cfg), **options,
    )


def engine_rank(rank: int, cfg: RunConfig, options: dict[str, Any]) -> dict[str, Any]:
    """A TawPipe/WeiPipe engine in the harness of tawpipe.bench.baselines, plus its plan's bytes."""
    device = torch.device("cpu")
    model = baselines.build_model(cfg)
    engine = build_engine(model, cfg, Topology.from_env(), device, **options)
    del model.blocks  # the engine holds its own chunk
    data = baselines.rank_data(cfg, rank)
    traffic = plan_traffic(engine.plan)
    plan = {"sent": traffic.per_node(direction="sent"), "received": traffic.per_node(direction="received")}
    try:
        return baselines.measure(cfg, lambda i: engine.step(data(i)), lambda: dict(engine.named_parameters()),
                                 engine.optimizer, plan_bytes=plan if rank == 0 else None,
                                 staging_bytes=sum(engine.memory_report().staging.values()))
    finally:
        engine.close()


def predicted_busiest(method: str, cfg: RunConfig) -> float:
    """Closed-form inter-node bytes per iteration leaving the busiest node, for gloo.

    ddp, hsdp, 1f1b, weipipe and tawpipe are ``tawpipe.cost.traffic.estimate``. The FSDP2 variants
    are written here: ``estimate('fsdp')`` assumes a ring reduce-scatter per micro-batch, but
    gloo's reduce-scatter is an all-reduce plus a slice (twice the bytes), the default variant
    reduce-scatters once per step, and FSDP2 does not reshard the root (embedding and head)
    after forward, so backward re-gathers only the blocks.

    With Ψ block and E root parameters, N ranks and acc micro-batches, a ring collective over all
    N ranks sends (N−1)/N of its size over each node's link. Per micro-batch, forward gathers the
    blocks and the root (Ψ + E) and backward the blocks again (Ψ): acc·(N−1)/N·(2Ψ + E) for
    ``fsdp``/``fsdp-mm``. ``fsdp-node`` reshards the blocks to the node after forward, so its
    backward gather is the node's own: acc·(N−1)/N·(Ψ + E). Gradients (Ψ + E) are all-reduced,
    2·(N−1)/N each time: once per step, or every micro-batch for ``fsdp-mm``. Ψ and E are
    counted as FSDP2 pads them (``tawpipe.cost.traffic.fsdp_numel``).
    """
    dims = shape_dims(asdict(cfg))
    topo, acc = cfg.topology, cfg.micro_batches
    if method not in ("fsdp", "fsdp-mm", "fsdp-node"):
        return estimate(method, dims, topo, acc).inter_node_per_node
    n = topo.world_size
    if topo.nodes == 1:
        return 0.0
    ring = (n - 1) / n
    block, e = fsdp_numel(dims, n)  # FSDP2 pads every parameter's dim 0 to a multiple of n
    psi = dims.layers * block
    gathered = (1 if method == "fsdp-node" else 2) * psi + e
    gathers = acc * ring * gathered * dims.dtype_bytes
    reduces = (acc if method == "fsdp-mm" else 1) * 2 * ring * (psi + e) * dims.grad_bytes
    return gathers + reduces


# ------------------------------------------------------------------------------- running rounds


def _rank_fn(m: Method) -> tuple[Any, tuple]:
    if m.engine_options is None:
        return baselines.METHODS[m.name], ()
    return engine_rank, (m.engine_options,)


def run_shape(cfg: RunConfig, chosen: list[Method], spec: ClusterSpec, rounds: int, timeout: float,
              log=print) -> dict[str, Any]:
    """All rounds of all executable methods on one cluster shape; raw records per method."""
    runs: dict[str, list[list[dict]]] = {m.name: [] for m in chosen}
    checks: dict[str, dict] = {}
    failures: dict[str, list[str]] = {m.name: [] for m in chosen}  # reported; the method runs again next round
    ref_losses, ref_init, ref_after = baselines.reference(cfg)
    with Cluster(spec) as c, tempfile.TemporaryDirectory(prefix="tawpipe-bench-") as tmp:
        for r in range(rounds):
            order = chosen[r % len(chosen):] + chosen[:r % len(chosen)]
            for m in order:
                check_dir = os.path.join(tmp, f"{m.name}-{r}") if m.name not in checks else None
                if check_dir:
                    os.makedirs(check_dir)
                fn, extra = _rank_fn(m)
                t0 = time.perf_counter()
                try:
                    with c.unlimited() if m.unlimited else contextlib.nullcontext():
                        records = c.run(fn, replace(cfg, check_dir=check_dir), *extra, timeout=timeout)
                except ClusterError as e:
                    failures[m.name].append(str(e))
                    log(f"  round {r + 1}/{rounds} {m.label:<22} FAILED: {str(e)[-2000:]}")
                    continue
                runs[m.name].append(records)
                log(f"  round {r + 1}/{rounds} {m.label:<22} {time.perf_counter() - t0:6.1f} s wall, "
                    f"median step {statistics.median(_step_times(records)):.2f} s")
                if check_dir:
                    checks[m.name] = _check(cfg, records, check_dir, ref_losses, ref_init, ref_after, m.replicas)
        calibration = None
        if spec.compute == "fixed":  # the ranks' rates now, beside the times they explain (design §9.2)
            with c.unlimited():
                devices = c.run(on_rank, asdict(shape_dims(asdict(cfg))),
                                f"cpu rank x {spec.rank_cpus:g}, in the cluster", 10, spec.rank_cpus,
                                spec.threads, os.cpu_count(), timeout=timeout)
            calibration = asdict(median_device(devices))
    return {"runs": runs, "checks": checks, "failures": failures, "reference_losses": ref_losses,
            "calibration": calibration}


def _step_times(records: list[dict]) -> list[float]:
    """Per timed step, the slowest rank's time."""
    return [max(t) for t in zip(*(r["step_seconds"] for r in records))]


def _losses(records: list[dict]) -> list[float]:
    """Global mean loss per step: mean over the ranks that report one (1F1B: the last stage)."""
    out = []
    for step in zip(*(r["losses"] for r in records)):
        vals = [v for v in step if v is not None]
        out.append(sum(vals) / len(vals))
    return out


def _check(cfg: RunConfig, records: list[dict], check_dir: str, ref_losses: list[float],
           ref_init: dict, ref_after: dict, replicas: int = 1) -> dict[str, Any]:
    """Losses and the first update against the reference. With R replicas each replica's ranks
    hold a whole model: every replica's update is checked and the worst one reported."""
    losses = _losses(records)[: len(ref_losses)]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    if replicas == 1:
        update_err = baselines.update_error(ref_init, ref_after, baselines.merge_params(check_dir, cfg.world_size))
        errs = None
    else:
        size = cfg.world_size // replicas
        errs = [baselines.update_error(ref_init, ref_after,
                                       baselines.merge_params(check_dir, cfg.world_size,
                                                              range(i * size, (i + 1) * size)))
                for i in range(replicas)]
        update_err = max(errs)
    out = {"losses": losses, "loss_rel_err": loss_err, "update_rel_err": update_err,
           "ok": loss_err <= LOSS_TOL and update_err <= UPDATE_TOL}
    if errs is not None:
        out["update_rel_err_per_replica"] = errs
    return out


def summarize(cfg: RunConfig, m: Method, runs: list[list[dict]], check: dict | None, rate_bits: int | None,
              failures: list[str] | None = None) -> dict[str, Any]:
    """One row: times pooled over rounds, bytes per iteration, memory, prediction, check."""
    row: dict[str, Any] = {"method": m.name, "label": m.label, "predicted_busiest_bytes": None,
                           "predicted_total_bytes": None, "unlimited": m.unlimited}
    if m.replicas > 1:
        row["replicas"] = m.replicas
    if failures:
        row.update(failed_runs=len(failures), errors=failures)
    if not runs:  # every round's run failed
        row["status"] = "failed (see the JSON)"
    if m.engine_options is None:
        row["predicted_busiest_bytes"] = predicted_busiest(m.name, cfg)
        row["prediction"] = "closed form (tawpipe.cost.traffic.estimate" + (
            ", FSDP2-on-gloo variant in tawpipe.bench.cluster)" if m.name.startswith("fsdp") else ")")
    if not runs:
        return row
    times = [t for records in runs for t in _step_times(records)]
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    # Per run, each node's bytes per iteration (reported by the node's local rank 0).
    per_run = [[LinkBytes(**{k: v // cfg.steps for k, v in r["link_bytes"].items()})
                for r in recs if r["link_bytes"] is not None] for recs in runs]
    per_run = [nodes for nodes in per_run if nodes]
    busiest = [max(b.busiest_direction for b in nodes) for nodes in per_run]
    total = [sum(b.tx for b in nodes) for nodes in per_run]
    plan = next((r["plan_bytes"] for r in runs[0] if r.get("plan_bytes")), None)
    if plan is not None:
        row["predicted_busiest_bytes"] = max(max(plan["sent"]), max(plan["received"]))
        row["predicted_total_bytes"] = sum(plan["sent"])
        row["prediction"] = "the engine's plan (tawpipe.cost.traffic.plan_traffic)"
    row.update(
        status="ok", samples=len(times), time_median_s=statistics.median(times), time_min_s=min(times),
        time_max_s=max(times), time_q1_s=q[0], time_q3_s=q[2],
        tokens_per_s=cfg.tokens_per_step / statistics.median(times),
        measured_busiest_bytes=statistics.median(busiest) if busiest else None,
        measured_total_bytes=statistics.median(total) if total else None,
        measured_per_node_last_run=[asdict(b) for b in per_run[-1]] if per_run else None,
        persistent_bytes_max=max(r["persistent_bytes"] for r in runs[0]),
        peak_rss_bytes_max=max(r["peak_rss_bytes"] for recs in runs for r in recs),
        staging_bytes=max((r.get("staging_bytes") or 0) for r in runs[0]) or None,
        check=check,
    )
    if rate_bits and not m.unlimited and row["measured_busiest_bytes"] is not None:
        row["floor_s"] = row["measured_busiest_bytes"] * 8 / rate_bits
    if row["predicted_busiest_bytes"] and row["measured_busiest_bytes"] is not None:
        row["measured_over_predicted"] = row["measured_busiest_bytes"] / row["predicted_busiest_bytes"]
    return row


def add_bounds(rows: list[dict[str, Any]]) -> None:
    """Where a method ran with its links unlimited too: its compute-only time, and its time over
    max(network floor, compute-only time), the bound no schedule can beat."""
    by_name = {r["method"]: r for r in rows}
    for r in rows:
        free = by_name.get(f"{r['method']}-compute")
        if r.get("status") != "ok" or not free or free.get("status") != "ok" or r.get("floor_s") is None:
            continue
        r["compute_only_s"] = free["time_median_s"]
        r["time_over_bound"] = r["time_median_s"] / max(r["floor_s"], r["compute_only_s"])


# ------------------------------------------------------------------------------------- output


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


def plots(result: dict[str, Any], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    sweep = len({s["config"]["seq_len"] for s in result["shapes"]}) > 1
    for shape in result["shapes"]:
        c = shape["config"]
        rows = [r for r in shape["rows"] if r.get("status") == "ok" and not r.get("unlimited")]
        if not rows:
            continue
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
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    if sweep:
        paths += sweep_plots(result, out, plt)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


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
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


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
    d = RunConfig()
    p.add_argument("--preset", choices=sorted(PRESETS), action=_Preset, default=None,
                   help="long: the long-context comparison at the paper's proportions (2x2 and 3x2, 31 "
                        "minutes); sweep: the same over S on 2x2 (README, 'Long context'); other options win")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 3], help="node counts to run, one cluster each")
    p.add_argument("--per-node", type=int, default=2, help="ranks per node")
    add_link_arguments(p)
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every method once")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per run (after one warm-up step)")
    p.add_argument("--methods", nargs="+", default=None,
                   help="subset of: tawpipe tawpipe-best weipipe fsdp fsdp-mm fsdp-node hsdp ddp 1f1b, and with "
                        "--replicas tawpipe-rR tawpipe-best-rR (default: all)")
    p.add_argument("--replicas", type=int, nargs="+", default=[], metavar="R",
                   help="also run tawpipe and the best k as R replicas of nodes/R nodes each (tawpipe-rR, "
                        "tawpipe-best-rR; engine option replicas=R), on the node counts R divides")
    p.add_argument("--seq-len", type=int, nargs="+", default=[d.seq_len],
                   help="tokens per sequence; several: one run of every shape at each (a sweep)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size of the LLaMA model")
    p.add_argument("--layers", type=int, default=d.layers, help="decoder layers")
    p.add_argument("--layers-per-rank", type=int, default=None, metavar="K",
                   help="K layers per rank on every shape (replaces --layers)")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    p.add_argument("--vocab", type=int, default=d.vocab,
                   help="vocabulary of the model (>= 256; the byte corpus uses the first 256 ids)")
    p.add_argument("--loss", choices=baselines.LOSSES, default=d.loss,
                   help="head and cross-entropy of every method: plain (the whole float32 logits) or chunked "
                        "(tawpipe.models.llama.chunked_head_loss, never holding them)")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches, help="per rank and step")
    p.add_argument("--micro-batch-size", dest="batch_size", type=int, default=d.batch_size,
                   help="sequences per micro-batch")
    p.add_argument("--prefetch-depth", type=prefetch_depth_arg, default=1,
                   help="prefetch depth (slots ahead) of tawpipe at k=1; the best k keeps every chunk resident")
    p.add_argument("--compute-only", nargs="*", default=None, metavar="METHOD",
                   help="also run these tawpipe/WeiPipe methods (none named: all of them) with the links "
                        "unlimited, in the same rounds, and report each one's time over max(network floor, "
                        "compute-only time)")
    p.add_argument("--recompute", choices=("none", "chunk"), default="none",
                   help="tawpipe and WeiPipe: keep activations like the peers (none), or recompute each "
                        "chunk in its backward as the paper does (chunk)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one method run may take")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"directory for cluster.json, cluster.md and the PNG plots (default: {DEFAULT_OUT}/ in the "
                        "current directory; the committed results: --out benchmarks/results/cluster)")


def main(args: argparse.Namespace) -> int:
    rate = args.rate
    try:
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
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
    except ValueError as e:
        raise UsageError(str(e)) from None
    reason = host.unavailable_reason(specs[0])
    if reason:
        raise UsageError(reason)
    chosen = [v for m in (known[n] for n in names)
              for v in ((m, compute_only(m)) if m.name in free and m.engine_options is not None else (m,))]
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


def write_results(result: dict[str, Any], out: str) -> str:
    """cluster.json and cluster.md of the shapes measured so far, each replaced atomically; the
    markdown returned."""
    if len({s["config"]["seq_len"] for s in result["shapes"]}) > 1:
        result["crossovers"] = sweep_crossovers(result)
    result["notes"] = _notes(result)
    md = markdown(result)
    os.makedirs(out, exist_ok=True)
    for name, text in (("cluster.json", json.dumps(result, indent=1)), ("cluster.md", md)):
        part = os.path.join(out, f"{name}.part")
        with open(part, "w") as f:
            f.write(text)
        os.replace(part, os.path.join(out, name))
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
