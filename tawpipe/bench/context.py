"""`tawpipe bench context`: TawPipe with context parallelism against the same run without it, on
an emulated cluster (design §3.6).

Both runs are the same plan (the paper's schedule, recompute by chunk, the chunked loss) on the
same cluster, with the same micro-batches per rank: without context parallelism a rank computes
whole sequences; with C it computes its two mirrored slices of its context group's sequences (so
the job trains 1/C as many sequences per step). Per rank the bench measures:

* the step time (median of the timed steps, slowest rank);
* the activation memory: the peak of the process's resident memory during the timed steps less
  the resident memory before them (the kernel's high-water mark, reset first through
  ``/proc/self/clear_refs``; large tensors are mapped and unmapped on their own, so freed
  activations leave it), which is everything a step holds beyond what persists between steps;
* the inter-node bytes of each node's link (the veth counters, payload and TCP/IP headers) beside
  the plan's;
* the K/V exchange's bytes beside the cost model's, and the time the compute spent in it.

Results go to ``--out`` (``context_cluster.json`` and ``context_cluster.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..atomic import write_atomic
from ..cluster import Cluster, ClusterSpec, describe_compute, host, rate_arg
from ..cluster.counters import link_bytes
from ..commands import UsageError, env_timeout, int_at_least, positive_float, writable
from ..cost.traffic import context_bytes, plan_traffic
from ..cost.units import gib
from ..engine.engine import TawPipe
from ..engine.policy import MemoryPolicy, SchedulePolicy
from ..models.llama import LlamaConfig, llama_parts
from ..plan.schedule import build_plan
from ..plan.topology import Topology, divisors
from ..train.data import batch as draw_batch
from ..train.data import load_tokens
from . import DEFAULT_OUT, check_memory, provenance
from .footprint import engine_rank_bytes

DESCRIPTION = ("TawPipe with context parallelism (each C ranks of a node split every sequence) against the same "
               "plan without it, on an emulated cluster: activation memory, inter-node bytes, the K/V exchange, time.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    count = int_at_least(1)
    p.add_argument("--nodes", type=count, default=2, help="emulated nodes")
    p.add_argument("--per-node", type=count, default=2, help="ranks per node")
    p.add_argument("--context-parallel", type=int_at_least(2), default=2, metavar="C",
                   help="ranks of a node that split a sequence (divides --per-node; the run without, C = 1, is "
                        "the bench's other run)")
    p.add_argument("--seq-len", type=count, default=8192, help="tokens per sequence (a multiple of 2 x C)")
    p.add_argument("--hidden", type=count, default=128, help="model width")
    p.add_argument("--heads", type=count, default=4, help="attention heads")
    p.add_argument("--layers-per-rank", type=count, default=1, help="decoder layers per rank")
    p.add_argument("--micro-batches", type=count, default=2, help="micro-batches per rank and step")
    p.add_argument("--rate", default="14mbit", type=rate_arg,
                   help="each node link's rate per direction (tc), 'none': no limit")
    p.add_argument("--cpus-per-rank", type=float, default=0.3, help="each rank's CPU quota (fixed compute)")
    p.add_argument("--steps", type=count, default=3, help="timed steps per run, after one warm-up step")
    p.add_argument("--timeout", type=positive_float, default=1800, help="seconds a run may take")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"directory for context_cluster.json and .md (default: {DEFAULT_OUT}/; '' writes none)")


def _model(cfg: dict[str, Any], world_size: int) -> LlamaConfig:
    """The model of every run: the one the ranks build, built first by the check."""
    return LlamaConfig(vocab_size=256, hidden=cfg["hidden"], n_layers=world_size * cfg["layers_per_rank"],
                       n_heads=cfg["heads"], n_kv_heads=cfg["heads"], max_seq_len=cfg["seq_len"])


def _check(cfg: dict[str, Any]) -> ClusterSpec:
    """The cluster ``cfg`` asks for; a UsageError naming the flag where it or the runs on it cannot
    work, before any namespace or rank exists."""
    c, per_node, seq = cfg["context_parallel"], cfg["per_node"], cfg["seq_len"]
    if per_node % c:
        fits = divisors(per_node)[1:]  # a group of 1 is no context parallelism
        raise UsageError(f"--context-parallel {c} does not divide --per-node {per_node}: a context group is ranks of "
                         f"one node; use {'one of ' + ', '.join(map(str, fits)) if fits else 'more ranks per node'}")
    if seq % (2 * c):
        raise UsageError(f"--seq-len {seq} is not a multiple of 2 x --context-parallel = {2 * c}: each of a group's "
                         f"{c} ranks takes two equal mirrored slices of every sequence")
    world = cfg["nodes"] * per_node
    try:
        model = _model(cfg, world)
    except ValueError as e:
        raise UsageError(f"--hidden {cfg['hidden']} and --heads {cfg['heads']} make no model: {e}") from None
    # the run without context parallelism holds the more: every rank computes whole sequences
    dims = model.dims(seq=seq, micro_batch=1, dtype_bytes=4, grad_bytes=4, scores=False)
    per_rank = engine_rank_bytes(dims, build_plan(Topology(cfg["nodes"], per_node), dims.layers, cfg["micro_batches"]),
                                 cfg["micro_batches"], chunked_loss=True)
    check_memory(world * per_rank, f"{world} ranks (--nodes {cfg['nodes']} x --per-node {per_node}) of {dims.layers} "
                 f"layers of width {cfg['hidden']} at --seq-len {seq:,}, --micro-batches {cfg['micro_batches']}, each "
                 f"{gib(per_rank)}", "use fewer ranks, --layers-per-rank, a smaller --hidden or --seq-len, or fewer "
                 "--micro-batches")
    if cfg["out"]:
        writable(Path(cfg["out"]), "--out", directory=True)
    env_timeout()  # what the ranks' engines wait, read in every rank
    try:
        spec = ClusterSpec(cfg["nodes"], per_node, rate=cfg["rate"], cpus_per_rank=cfg["cpus_per_rank"])
    except ValueError as e:
        raise UsageError(str(e)) from None
    reason = host.unavailable_reason(spec)
    if reason:
        raise UsageError(reason)
    return spec


def _memory_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def context_rank(rank: int, cfg: dict[str, Any], degree: int) -> dict[str, Any]:
    """One rank of one run: ``cfg``'s model and plan, context parallel over ``degree`` ranks."""
    topology = Topology.from_env()
    model = _model(cfg, topology.world_size)
    acc = cfg["micro_batches"]
    engine = TawPipe(llama_parts(model, seed=0), topology=topology, micro_batches=acc,
                     schedule=SchedulePolicy(mb_per_fetch=1, prefetch_depth=1, reuse_weights=False,
                                             context_parallel=degree),
                     memory=MemoryPolicy(recompute="chunk", chunked_loss=True))
    tokens = load_tokens(None).train

    def step(i: int) -> float:
        parts = [draw_batch(tokens, cfg["seq_len"], 1, seed=0, step=i, index=rank // degree * acc + j) for j in range(acc)]
        return engine.step((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))

    step(0)  # warm-up: buffers and pools allocated, the first step's one-time work done
    dist.barrier()
    links, (kv_bytes, kv_seconds) = link_bytes(), engine.context_traffic()
    dist.barrier()  # nobody sends before every node has read its counters
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark from here on
    resident = _memory_kib("VmRSS")
    times = []
    for i in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    peak = _memory_kib("VmHWM")
    dist.barrier()
    after, (kv_bytes_after, kv_seconds_after) = link_bytes(), engine.context_traffic()
    traffic = plan_traffic(engine.plan)
    dims = model.dims(seq=cfg["seq_len"], micro_batch=1, dtype_bytes=4)
    engine.close()
    return {
        "rank": rank, "step_seconds": times, "activation_bytes": (peak - resident) * 1024,
        "link_bytes": {k: v // cfg["steps"] for k, v in asdict(after - links).items()}
        if after is not None and rank % topology.per_node == 0 else None,
        "plan_inter_node": {"sent": traffic.per_node(direction="sent"), "received": traffic.per_node(direction="received")},
        "kv_bytes": (kv_bytes_after - kv_bytes) // cfg["steps"], "kv_seconds": (kv_seconds_after - kv_seconds) / cfg["steps"],
        "kv_planned": context_bytes(engine.plan, rank, dims, degree, engine.policies[2].recompute) if degree > 1 else 0,
    }


def _summary(records: list[dict[str, Any]], degree: int, seq_len: int, world: int, acc: int) -> dict[str, Any]:
    step = statistics.median(max(t) for t in zip(*(r["step_seconds"] for r in records)))
    nodes = [r["link_bytes"] for r in records if r["link_bytes"] is not None]
    plan = records[0]["plan_inter_node"]
    return {
        "context_parallel": degree, "step_s": step, "tokens_per_s": world // degree * acc * seq_len / step,
        "activation_bytes": [r["activation_bytes"] for r in records],
        "inter_node_busiest_bytes": max(max(n["tx"], n["rx"]) for n in nodes),
        "plan_busiest_bytes": max(max(plan["sent"]), max(plan["received"])),
        "kv_bytes": [r["kv_bytes"] for r in records], "kv_planned": [r["kv_planned"] for r in records],
        "kv_share": max(r["kv_seconds"] for r in records) / step,
    }


def run(a: dict[str, Any], spec: ClusterSpec, log=print) -> dict[str, Any]:
    # large tensors mapped and unmapped on their own: a freed activation leaves the resident set
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    rows = []
    with Cluster(spec) as cluster:
        for degree in (1, a["context_parallel"]):
            t0 = time.perf_counter()
            records = cluster.run(context_rank, a, degree, timeout=a["timeout"])
            rows.append(_summary(records, degree, a["seq_len"], spec.world_size, a["micro_batches"]))
            log(f"  context parallel {degree}: {time.perf_counter() - t0:.0f} s wall")
    base, cp = rows
    return {"config": a, "cluster": describe_compute(spec), "rows": rows,
            "activation_ratio": max(c / b for c, b in zip(cp["activation_bytes"], base["activation_bytes"])),
            "inter_node_vs_plan": cp["inter_node_busiest_bytes"] / cp["plan_busiest_bytes"],
            "inter_node_vs_base": cp["inter_node_busiest_bytes"] / base["inter_node_busiest_bytes"],
            "provenance": provenance()}


def table(res: dict[str, Any]) -> str:
    a = res["config"]
    lines = [
        f"TawPipe with and without context parallelism on {a['nodes']} x {a['per_node']} ({res['cluster']}, links "
        f"{a['rate'] or 'unlimited'}): {a['nodes'] * a['per_node'] * a['layers_per_rank']} layers of width "
        f"{a['hidden']}, S = {a['seq_len']}, {a['micro_batches']} micro-batches of one sequence (or its slices) "
        "per rank, paper schedule, recompute by chunk, chunked loss",
        "",
        "| context parallel | s/step | tok/s | activation MiB per rank | busiest node link MB/step (plan) "
        "| K/V exchange MB per rank (cost model) | K/V share of the step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        act = ", ".join(f"{b / 2**20:.1f}" for b in r["activation_bytes"])
        kv = ", ".join(f"{b / 1e6:.2f}" for b in r["kv_bytes"])
        planned = ", ".join(f"{b / 1e6:.2f}" for b in r["kv_planned"])
        lines.append(f"| {r['context_parallel']} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {act} | "
                     f"{r['inter_node_busiest_bytes'] / 1e6:.2f} ({r['plan_busiest_bytes'] / 1e6:.2f}) | {kv} ({planned}) | "
                     f"{r['kv_share']:.1%} |")
    lines += ["", f"activation memory with / without, the worst rank: {res['activation_ratio']:.2f}; inter-node bytes "
              f"with context parallelism / its plan {res['inter_node_vs_plan']:.3f}, / without it "
              f"{res['inter_node_vs_base']:.3f}"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    spec = _check(vars(args))
    a = {k: v for k, v in vars(args).items() if k not in ("what", "out", "bench_main")}
    res = run(a, spec)
    text = table(res)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "context_cluster.json", json.dumps(res, indent=2) + "\n")
        write_atomic(out / "context_cluster.md", text + "\n")
        print(f"wrote {out / 'context_cluster.json'} and {out / 'context_cluster.md'}")
    return 0
