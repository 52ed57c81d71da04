"""`tawpipe train`: the main job.

With no arguments it starts a local emulated cluster (2 nodes x 2 ranks, gloo, CPU) and trains a
tiny byte-level LLaMA on the Python standard library's own source files. Under torchrun the same
entry point trains across real nodes (NCCL on GPUs), with the topology read from the environment.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .checkpoint import save_atomic
from .data import batch as draw_batch
from .data import load_tokens
from .engine import TawPipe, default_optimizer
from .launch import init_distributed, run_local
from .models.llama import Llama, LlamaConfig, block_forward, llama_loss
from .topology import Topology
from .traffic import plan_traffic

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TrainConfig:
    nodes: int = 2
    per_node: int = 2
    preset: str = "tiny"
    layers: int | None = None
    data: str | None = None
    steps: int = 100
    micro_batches: int = 2
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 5
    dtype: str = "float32"
    max_grad_norm: float | None = 1.0
    grad_route: str = "rail"
    seed: int = 0
    save: str | None = None
    log_every: int = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--nodes", type=int, default=d.nodes, help="emulated nodes (local cluster only)")
    p.add_argument("--per-node", type=int, default=d.per_node, help="ranks per emulated node")
    p.add_argument("--preset", default=d.preset, help="model preset (tiny, micro, paper-1024, ...)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--data", default=None, help="text file or uint16 .bin; default: Python stdlib sources")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--micro-batches", type=int, default=d.micro_batches, help="micro-batches per rank per step")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=d.dtype, help="compute dtype")
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm)
    p.add_argument("--grad-route", choices=("rail", "leader"), default=d.grad_route)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--save", default=None, help="write the full model state_dict here at the end")


def _config(args: argparse.Namespace) -> TrainConfig:
    fields = TrainConfig.__dataclass_fields__
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    for name in ("steps", "micro_batches", "batch_size", "seq_len", "nodes", "per_node"):
        if getattr(cfg, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    return cfg


def _lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return f


def train_rank(rank: int, cfg: TrainConfig, topology: Topology, device: torch.device) -> dict:
    """One rank's training loop; returns the loss curve and traffic figures."""
    src = load_tokens(cfg.data)
    overrides = {"vocab_size": max(src.vocab_size, 256)}
    if cfg.layers:
        overrides["n_layers"] = cfg.layers
    mcfg = LlamaConfig.preset(cfg.preset, max_seq_len=max(cfg.seq_len, 16), **overrides)
    torch.manual_seed(cfg.seed)
    model = Llama(mcfg)  # every rank builds the same model; the engine keeps its own chunk
    model.embed.to(device)
    model.head.to(device)
    dtype = _DTYPES[cfg.dtype]
    engine = TawPipe(
        model.blocks, model.embed, model.head, llama_loss, topology=topology,
        micro_batches=cfg.micro_batches, compute_dtype=dtype, max_grad_norm=cfg.max_grad_norm,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg)),
        optimizer=functools.partial(default_optimizer, lr=cfg.lr), block_forward=block_forward,
        block_context=lambda t: model.block_context(t.shape[1], device, dtype),
        device=device, grad_route=cfg.grad_route,
    )
    del model.blocks  # the engine holds its own chunk; the other blocks can go
    traffic = plan_traffic(engine.plan)
    intra, inter = traffic.node_bytes(rank)
    tokens_per_step = topology.world_size * cfg.micro_batches * cfg.batch_size * cfg.seq_len
    bar = _progress(cfg.steps) if rank == 0 else None
    losses, t0 = [], time.perf_counter()
    for step in range(cfg.steps):
        idx = [rank * cfg.micro_batches + i for i in range(cfg.micro_batches)]
        parts = [draw_batch(src.train, cfg.seq_len, cfg.batch_size, seed=cfg.seed, step=step, index=i) for i in idx]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        loss = engine.step((x, y))
        losses.append(loss)
        if bar is not None:
            elapsed = time.perf_counter() - t0
            bar.update(1)
            bar.set_postfix_str(
                f"loss {loss:.3f} | {tokens_per_step * (step + 1) / elapsed:,.0f} tok/s | "
                f"moved/iter: intra-node {intra / 1e6:.2f} MB, inter-node {inter / 1e6:.2f} MB (rank 0)"
            )
    if bar is not None:
        bar.close()
    full = engine.full_state_dict()
    if rank == 0 and cfg.save:
        save_atomic({"model": full, "config": asdict(mcfg), "train": asdict(cfg)}, cfg.save)
    memory = str(engine.memory_report())
    engine.close()
    return {"losses": losses, "seconds": time.perf_counter() - t0, "memory": memory,
            "intra_bytes": intra, "inter_bytes": inter, "tokens_per_step": tokens_per_step}


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="tawpipe train", unit="step", dynamic_ncols=True)


def _local_rank(rank: int, cfg: TrainConfig) -> dict:
    return train_rank(rank, cfg, Topology(nodes=cfg.nodes, per_node=cfg.per_node), torch.device("cpu"))


def main(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        device = init_distributed()
        rank = dist.get_rank()
        result = train_rank(rank, cfg, Topology.from_env(), device)
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        world = cfg.nodes * cfg.per_node
        print(f"tawpipe train: local emulated cluster, {cfg.nodes} nodes x {cfg.per_node} ranks (gloo, CPU), "
              f"preset {cfg.preset}, {cfg.steps} steps")
        result = run_local(_local_rank, world, cfg)[0]
    losses = result["losses"]
    k = min(5, len(losses))
    start, end = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss at start {losses[0]:.4f} (mean of first {k}: {start:.4f}) -> at end {losses[-1]:.4f} "
          f"(mean of last {k}: {end:.4f}) in {result['seconds']:.1f}s, "
          f"{result['tokens_per_step'] * len(losses) / result['seconds']:,.0f} tok/s")
    print(f"memory per rank (rank 0): {result['memory']}")
    return 0
