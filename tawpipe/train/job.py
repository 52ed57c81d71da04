"""`tawpipe train`: the job. It checks everything first (``preflight``), then starts the ranks: a
local emulated cluster on this machine (gloo, CPU), or the rank torchrun started, which trains
across real nodes (NCCL on GPUs) with the topology read from the environment (``loop``). It holds
--save's lock for the whole run and ends with a summary of the losses and the memory.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
from dataclasses import replace

import torch.distributed as dist

from ..commands import UsageError, as_flags
from ..io import checkpoint
from ..plan.topology import Topology
from ..runtime.launch import JobFailed, JobStopped, init_distributed, missing_torchrun_env, run_local
from .config import TrainConfig, under_torchrun
from .loop import TrainError, local_rank, train_rank
from .preflight import Preflight, leader, validate


def _config(args: argparse.Namespace) -> tuple[TrainConfig, Preflight]:
    """The run's configuration, checked (``validate``) and its "auto" options chosen; UsageError
    (one line, exit status 2) otherwise."""
    cfg = TrainConfig.from_args(args)
    topology = None  # the local emulated cluster's, from the flags
    if under_torchrun():
        if missing := missing_torchrun_env():  # set by hand, not by torchrun
            raise UsageError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: start the ranks with "
                             "torchrun, which sets them all, or unset RANK and WORLD_SIZE for a local emulated cluster")
        try:
            topology = Topology.from_env()
        except ValueError as e:
            raise UsageError(str(e)) from None
        _check_torchrun_shape(args, topology)
        cfg = replace(cfg, nodes=topology.nodes, per_node=topology.per_node)  # what the checkpoints record
    try:
        pre = validate(cfg, topology)
    except (ValueError, OSError, ImportError) as e:
        raise UsageError(as_flags(str(e))) from None
    return replace(cfg, **pre.schedule), pre



def _check_torchrun_shape(args: argparse.Namespace, topology: Topology) -> None:
    """Under torchrun the job's shape is torchrun's: a --nodes or --per-node given (on the command
    line or in --config) that says otherwise is refused, not ignored."""
    wrong = [f"{flag} {given}" for flag, given, job in (("--nodes", args.nodes, topology.nodes),
                                                         ("--per-node", args.per_node, topology.per_node))
             if given is not None and given != job]
    if wrong:
        raise UsageError(
            f"{' '.join(wrong)} differ(s) from this torchrun job of {topology.nodes} "
            f"node(s) x {topology.per_node} rank(s) (its --nnodes and --nproc-per-node, which set the shape): leave "
            "--nodes and --per-node out under torchrun, or start torchrun with the shape you meant")


def _holding_save(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    """--save's lock (``checkpoint.hold``), taken by the leader before any worker starts and held
    to the end; UsageError where another run holds it."""
    if cfg.save is None or not leader():
        return contextlib.nullcontext()
    try:
        return checkpoint.hold(cfg.save)
    except checkpoint.RootBusy as e:
        raise UsageError(f"--save {cfg.save}: {e}") from None


def main(args: argparse.Namespace) -> int:
    cfg, pre = _config(args)
    with _holding_save(cfg):
        return _run(cfg, pre)


def _run(cfg: TrainConfig, pre: Preflight) -> int:
    resumed = f", resumed from step {pre.resumed_from}" if pre.resumed_from is not None else ""
    stopped_by = signal.SIGTERM  # what a stopped run's exit code says (128 + the signal)
    if under_torchrun():
        device = init_distributed()
        rank = dist.get_rank()
        if rank == 0:
            print(f"tawpipe train: {pre.memory}", flush=True)
        try:
            result = train_rank(rank, cfg, Topology.from_env(), device, pre.auto)
        except TrainError as e:
            print(f"tawpipe train: rank {rank}: {e}", file=sys.stderr)
            return 1
        dist.destroy_process_group()
        if rank != 0:  # rank 0 reports the job; another node's launcher still learns that it stopped early
            if result["stopped_at"] is None:
                return 0
            print(f"tawpipe train: rank {rank}: stopped on request after step {result['stopped_at']} of "
                  f"{cfg.steps}, with every rank (rank 0 reports the checkpoint)", file=sys.stderr)
            return 128 + stopped_by
    else:
        world = cfg.nodes * cfg.per_node
        print(f"tawpipe train: local emulated cluster, {cfg.nodes} nodes x {cfg.per_node} ranks (gloo, CPU), "
              f"model {cfg.model}, {cfg.steps} steps{resumed}")
        print(f"tawpipe train: {pre.memory}", flush=True)
        try:
            result = run_local(local_rank, world, cfg, pre.auto)[0]
        except JobStopped as e:
            if not e.complete or e.results[0] is None:
                print(f"tawpipe train: {e}; nothing was saved after the last checkpoint", file=sys.stderr)
                return 128 + e.signal
            result, stopped_by = e.results[0], e.signal
        except JobFailed as e:
            ours = re.match(rf"rank (\d+) failed: {TrainError.__name__}: (.*)", e.summary)
            print(f"tawpipe train: rank {ours[1]}: {ours[2]}" if ours else f"tawpipe train: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    if result["stopped_at"] is not None:
        saved = f"; checkpoint: {checkpoint.resolve(cfg.save)} (resume with --resume {cfg.save})" if cfg.save else \
            "; nothing saved (no --save)"
        print(f"tawpipe train: stopped on request after step {result['stopped_at']} of {cfg.steps}{saved}",
              file=sys.stderr)
    losses = result["losses"]
    k = min(5, len(losses))
    start, end = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss at start {losses[0]:.4f} (mean of first {k}: {start:.4f}) -> at end {losses[-1]:.4f} "
          f"(mean of last {k}: {end:.4f}); {result['steps_run']} steps in {result['seconds']:.1f}s, "
          f"{result['tokens_per_step'] * result['steps_run'] / result['seconds']:,.0f} tok/s; "
          f"{result['skipped']} of them skipped (loss or gradients not finite)"
          + (f", {result['skipped_total']} since the first step" if result["skipped_total"] != result["skipped"]
             else ""))
    if result["val_losses"]:
        print("validation loss: " + ", ".join(f"step {s} {v:.4f}" for s, v in result["val_losses"].items()))
    print(f"memory per rank (rank 0), allocated: {result['memory']}")
    if cfg.save:
        print(f"checkpoint: {checkpoint.resolve(cfg.save)}")
    return 0 if result["stopped_at"] is None else 128 + stopped_by
