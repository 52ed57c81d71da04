"""`tawpipe bench overlap`: step time with communication overlapped against the same job with every transfer
waited for at once. A delay is injected into every communication operation (DelayComm), sized so
that a rank's communication takes about as long as its compute; the ratio is measured in one run
on one machine, with the same processes, model and data. The JSON goes into ``--out`` (default
``tawpipe-results/`` in the current directory; the committed results are rewritten only with
``--out benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from .. import models
from ..atomic import write_atomic
from ..commands import UsageError, as_flags, env_timeout, int_at_least, nonnegative_float
from ..cost.units import gib
from ..engine.engine import TawPipe
from ..engine.policy import CommPolicy, SchedulePolicy
from ..models.parts import ModelParts
from ..models.llama import Llama, LlamaConfig, block_forward, llama_loss
from ..models.presets import PRESETS
from ..plan.actions import OPS
from ..plan.schedule import build_plan
from ..plan.topology import Topology
from ..runtime.comm import DelayComm
from ..runtime.comm.torch_dist import TorchDistComm
from ..runtime.launch import run_local
from ..runtime.timeout import default_timeout
from ..train.data import batch as draw_batch
from ..train.data import load_tokens
from ..train.preflight import RUNTIME_BYTES
from . import DEFAULT_OUT, check_memory, provenance, result_file
from .footprint import engine_rank_bytes


DESCRIPTION = (
    "Step time with communication overlapped against the same job with every transfer waited for at once, under "
    "a delay injected into every communication so that it takes about as long as the compute."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    count = int_at_least(1)
    p.add_argument("--nodes", type=count, default=2, help="emulated nodes (groups)")
    p.add_argument("--per-node", type=count, default=2, help="ranks per node")
    p.add_argument("--micro-batches", type=count, default=2, help="micro-batches per rank and step")
    p.add_argument("--model", default="micro", choices=PRESETS, metavar="MODEL",
                   help=f"a built-in model: {', '.join(PRESETS)}")
    p.add_argument("--layers", type=count, default=8, help="decoder layers (at least --nodes x --per-node)")
    p.add_argument("--micro-batch-size", type=count, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=count, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=count, default=8, help="timed steps per variant (after one warm-up)")
    p.add_argument("--comm-ratio", type=nonnegative_float, default=1.0,
                   help="injected comm time / compute time (0: nothing injected, the two variants as they are)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"directory for overlap_cpu.json (default: {DEFAULT_OUT}/ in the current directory; the "
                        "committed results: --out benchmarks/results); a path ending in .json names the file, "
                        "'' writes none")


def _engine(model: Llama, topo: Topology, acc: int, comm, overlap: bool) -> TawPipe:
    parts = ModelParts(model.blocks, model.embed, model.head, llama_loss, block_forward=block_forward,
                       block_context=lambda t: model.block_context(t.shape[1], "cpu"))
    return TawPipe(parts, topology=topo, micro_batches=acc, comm=CommPolicy(comm, overlap=overlap),
                   schedule=SchedulePolicy(mb_per_fetch=1, prefetch_depth=1, reuse_weights=False))  # the paper's


def _time_steps(engine: TawPipe, batches: list, steps: int) -> list[float]:
    engine.step(batches[0])  # warm-up
    out = []
    for i in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        engine.step(batches[(i + 1) % len(batches)])
        out.append(time.perf_counter() - t0)
    return out


def _overlap_rank(rank: int, a: dict) -> dict:
    topo = Topology(a["nodes"], a["per_node"])
    acc = a["micro_batches"]
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset(a["model"], n_layers=a["layers"], max_seq_len=a["seq_len"]))
    src = load_tokens(None)
    batches = []
    for step in range(3):
        parts = [draw_batch(src.train, a["seq_len"], a["micro_batch_size"], seed=0, step=step, index=rank * acc + i)
                 for i in range(acc)]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    timeout = default_timeout()  # run_local's, as every wait of the engines
    # Calibrate: compute-bound step time without any injected delay.
    base = _engine(model, topo, acc, TorchDistComm(topo, timeout), overlap=True)
    t_compute = statistics.median(_time_steps(base, batches, a["steps"]))
    n_ops = sum(1 for x in base.plan.actions[rank] if OPS[x.op].is_comm and not OPS[x.op].always_overlaps)
    base.close()
    del base  # each engine's memory freed before the next is built
    stats = torch.tensor([t_compute, float(n_ops)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    delay = a["comm_ratio"] * stats[0].item() / stats[1].item()
    too_long = _too_long(a["comm_ratio"], stats[0].item(), timeout)
    if too_long:
        return {"rank": rank, "refused": too_long}  # every rank alike: the same calibration
    result = {"rank": rank, "t_no_delay": t_compute, "delay_per_op_s": delay, "comm_ops": n_ops}
    for overlap in (False, True):
        eng = _engine(model, topo, acc, DelayComm(TorchDistComm(topo, timeout), delay), overlap=overlap)
        result["overlap" if overlap else "serial"] = statistics.median(_time_steps(eng, batches, a["steps"]))
        eng.close()
        del eng
    return result


def _too_long(ratio: float, t_compute: float, timeout: float) -> str:
    """Why a step's injected delay (``ratio`` x the compute) would not leave its waits inside the
    timeout, which a queue of delayed transfers could outlast (the serial variant's step is that
    long), naming both knobs; "" where it does. Known only once the compute is measured."""
    injected = ratio * t_compute
    if injected <= timeout / 2:
        return ""
    return (f"--comm-ratio {ratio:g} injects {injected:.1f} s of delay per step (the compute takes {t_compute:.3f} s), "
            f"more than half the {timeout:g} s a wait may take: lower --comm-ratio to at most "
            f"{timeout / 2 / t_compute:.0f}, or raise TAWPIPE_TIMEOUT")


def overlap(a: dict, timeout: float | None = None) -> dict:
    ranks = run_local(_overlap_rank, a["nodes"] * a["per_node"], a, timeout=timeout)
    if "refused" in ranks[0]:
        raise UsageError(ranks[0]["refused"])
    serial = max(r["serial"] for r in ranks)
    over = max(r["overlap"] for r in ranks)
    return {
        "benchmark": "overlap", "config": a, "device": "cpu", **provenance(),
        "step_s_no_delay": max(r["t_no_delay"] for r in ranks),
        "delay_per_op_s": ranks[0]["delay_per_op_s"],
        "step_s_serial": serial, "step_s_overlap": over, "ratio": over / serial, "ranks": ranks,
    }


def _check(a: dict) -> None:
    """A UsageError naming the flag where the ranks could not run, before any starts: more ranks
    than this host has memory for, a plan the engine refuses, sequences longer than the corpus, or
    ranks that need more memory together than the host has."""
    world = a["nodes"] * a["per_node"]
    ranks = f"{world} ranks (--nodes {a['nodes']} x --per-node {a['per_node']})"
    check_memory(world * RUNTIME_BYTES, f"{ranks}, each {gib(RUNTIME_BYTES)} before its model", "use fewer ranks")
    try:  # the engine's plan: too few layers for the ranks is refused here
        plan = build_plan(Topology(a["nodes"], a["per_node"]), a["layers"], a["micro_batches"])
    except ValueError as e:
        raise UsageError(as_flags(str(e))) from None
    tokens = len(load_tokens(None).train)
    if a["seq_len"] >= tokens:
        raise UsageError(f"--seq-len {a['seq_len']:,}: the corpus has {tokens:,} training tokens, too few for one "
                         f"sequence and its next token; use at most {tokens - 1:,}")
    dims = models.dims(a["model"], layers=a["layers"], seq=a["seq_len"], micro_batch=a["micro_batch_size"],
                       dtype_bytes=4, grad_bytes=4, scores=False)
    per_rank = engine_rank_bytes(dims, plan, a["micro_batches"])
    check_memory(world * per_rank, f"{ranks} of --model {a['model']} x {a['layers']} --layers at --seq-len "
                 f"{a['seq_len']:,}, --micro-batch-size {a['micro_batch_size']}, --micro-batches {a['micro_batches']}, "
                 f"each {gib(per_rank)}", "use fewer ranks, a smaller model or fewer --layers, or a smaller --seq-len "
                 "or --micro-batch-size")


def main(args: argparse.Namespace) -> int:
    a = {k: v for k, v in vars(args).items() if k not in ("what", "out", "bench_main")}
    timeout = env_timeout()  # every wait of the ranks
    _check(a)
    path = result_file(args.out, "overlap_cpu.json") if args.out else None
    res = overlap(a, timeout)
    print(f"overlap on {a['nodes']} nodes x {a['per_node']} ranks, {a['model']} x {a['layers']} layers, "
          f"acc {a['micro_batches']}, injected {res['delay_per_op_s'] * 1e3:.2f} ms per comm op")
    print(f"{'variant':<28}{'step time (s, median, slowest rank)':>36}")
    print(f"{'compute only (no delay)':<28}{res['step_s_no_delay']:>36.3f}")
    print(f"{'delay, serial (no overlap)':<28}{res['step_s_serial']:>36.3f}")
    print(f"{'delay, overlapped':<28}{res['step_s_overlap']:>36.3f}")
    print(f"ratio overlapped / serial = {res['ratio']:.3f}")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(res, indent=2))
        print(f"wrote {path}")
    return 0
