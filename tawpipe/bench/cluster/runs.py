"""Running the methods on an emulated cluster, in rounds, and what each method's runs add up to:
its row of times, bytes, memory and the exactness check against single-process training."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any

from ...cluster import Cluster, ClusterError, ClusterSpec, LinkBytes
from ...sim.calibrate import median_device, on_rank
from ...simulate.inputs import shape_dims
from .. import baselines
from ..baselines import RunConfig
from .method import Method, engine_rank, predicted_busiest

LOSS_TOL = 1e-5  # relative, fp32: the first two losses
UPDATE_TOL = 1e-4  # relative norm of the first update; Adam's first step is ~lr·sign(g), so a
# gradient that rounds to the other side of zero flips a whole lr step: a few per million


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
