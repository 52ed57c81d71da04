"""`tawpipe train`: the main job.

With no arguments it starts a local emulated cluster (2 nodes x 2 ranks, gloo, CPU) and trains a
tiny byte-level LLaMA on the Python standard library's own source files. Under torchrun the same
entry point trains across real nodes (NCCL on GPUs), with the topology read from the environment.

Arguments and data are checked before any worker starts. ``--save DIR`` writes checkpoints
(``tawpipe.checkpoint``) every ``--save-every`` steps and at the end; ``--resume DIR`` continues
from one, bit-exactly: the engine's shard (weights, optimizer, scheduler, loss scale, counters)
plus each rank's RNG state and the loss history; the data position is the step number, since
batches are drawn from (seed, step, index) alone.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint
from .data import batch as draw_batch
from .data import load_tokens
from .engine import TawPipe, default_optimizer
from .launch import JobFailed, init_distributed, run_local
from .models.llama import PRESETS, Llama, LlamaConfig, block_forward, llama_loss
from .storage import unique_params
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
    save_every: int | None = None
    resume: str | None = None
    log_every: int = 1


_NOT_TRAINING = ("save", "save_every", "resume", "log_every")  # may change on resume


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
    p.add_argument("--save", default=None, metavar="DIR",
                   help="checkpoint directory: a checkpoint at the end (and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=None, metavar="N", help="also checkpoint every N steps")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint: a step directory, or the latest one under DIR")


def _config(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        validate(cfg, int(os.environ["WORLD_SIZE"]) if under_torchrun else None)
    except (ValueError, OSError) as e:
        raise SystemExit(f"tawpipe train: {e}") from None
    return cfg


def _arg(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Everything that can be checked before a worker starts; raises ValueError (one line)."""
    for name in ("steps", "micro_batches", "batch_size", "seq_len", "nodes", "per_node", "layers", "save_every"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"{_arg(name)} must be >= 1, got {value}")
    if cfg.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {cfg.warmup}")
    for name in ("lr", "max_grad_norm"):
        value = getattr(cfg, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{_arg(name)} must be a finite number > 0, got {value}")
    if cfg.preset not in PRESETS:
        raise ValueError(f"unknown --preset {cfg.preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    world = world_size or cfg.nodes * cfg.per_node
    mcfg = _model_config(cfg, _vocab(cfg))
    if mcfg.n_layers < world:
        raise ValueError(f"{mcfg.n_layers} layers for {world} ranks: every rank needs at least one layer "
                         f"(--layers >= {world})")
    if cfg.save_every is not None and cfg.save is None:
        raise ValueError("--save-every needs --save DIR")
    if cfg.save is not None:
        save = Path(cfg.save)
        if save.exists() and not save.is_dir():
            raise ValueError(f"--save {save} exists and is not a directory")
        save.mkdir(parents=True, exist_ok=True)
        if not os.access(save, os.W_OK | os.X_OK):
            raise ValueError(f"--save {save} is not writable")
    if cfg.resume is not None:
        _check_resume(cfg, mcfg)


def _vocab(cfg: TrainConfig) -> int:
    """The model's vocabulary: bytes, or a .bin file's tokens (the file is checked on the way)."""
    if cfg.data is None or cfg.data == "stdlib":
        return 256
    src = load_tokens(cfg.data)
    if len(src.train) < cfg.seq_len + 1:
        raise ValueError(f"--data {cfg.data}: {len(src.train)} training tokens are too few for --seq-len {cfg.seq_len}")
    return src.vocab_size


def _model_config(cfg: TrainConfig, vocab: int) -> LlamaConfig:
    overrides: dict[str, Any] = {"vocab_size": max(vocab, 256)}
    if cfg.layers is not None:
        overrides["n_layers"] = cfg.layers
    return LlamaConfig.preset(cfg.preset, max_seq_len=max(cfg.seq_len, 16), **overrides)


def _signature(mcfg: LlamaConfig) -> dict[str, Any]:
    """The checkpoint signature the engine will have, from a model on the meta device."""
    with torch.device("meta"):
        model = Llama(mcfg)
    shapes = lambda named: [(n, tuple(p.shape), p.dtype) for n, p in named]  # noqa: E731
    return checkpoint.model_signature(mcfg.n_layers, ("embed", "blocks", "head"),
                                      shapes(model.blocks[0].named_parameters()),
                                      shapes(unique_params([("embed", model.embed), ("head", model.head)])))


def _check_resume(cfg: TrainConfig, mcfg: LlamaConfig) -> None:
    manifest = checkpoint.read_manifest(cfg.resume)
    checkpoint.check_model(manifest, _signature(mcfg), cfg.resume)
    if manifest["step"] >= cfg.steps:
        raise ValueError(f"--resume {cfg.resume} is at step {manifest['step']}: --steps {cfg.steps} leaves nothing to train")
    saved = manifest["meta"].get("train", {})
    changed = [f"{_arg(k)} {saved[k]} -> {v}" for k, v in asdict(cfg).items()
               if k in saved and k not in _NOT_TRAINING and saved[k] != v]
    if changed:
        print(f"tawpipe train: note: resuming with other settings than the checkpoint's ({', '.join(changed)}); "
              "the run will differ from an uninterrupted one", file=sys.stderr)


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
    mcfg = _model_config(cfg, src.vocab_size)
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
    losses: list[float] = []
    if cfg.resume:
        restored = checkpoint.restore(engine, cfg.resume)
        losses = list(restored.extra["losses"])
        if not restored.resharded:  # each rank's own stream; on another topology there is none
            _set_rng(restored.extra["rng"], device)
    start = engine.steps
    traffic = plan_traffic(engine.plan)
    intra, inter = traffic.node_bytes(rank)
    tokens_per_step = topology.world_size * cfg.micro_batches * cfg.batch_size * cfg.seq_len
    bar = _progress(cfg.steps, start) if rank == 0 else None
    t0 = time.perf_counter()
    for step in range(start, cfg.steps):
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
                f"loss {loss:.3f} | {tokens_per_step * (step + 1 - start) / elapsed:,.0f} tok/s | "
                f"moved/iter: intra-node {intra / 1e6:.2f} MB, inter-node {inter / 1e6:.2f} MB (rank 0)"
            )
        if cfg.save and (engine.steps == cfg.steps or (cfg.save_every and engine.steps % cfg.save_every == 0)):
            _save(engine, cfg, mcfg, losses, device)
    if bar is not None:
        bar.close()
    memory = str(engine.memory_report())
    engine.close()
    return {"losses": losses, "steps_run": cfg.steps - start, "seconds": time.perf_counter() - t0,
            "memory": memory, "intra_bytes": intra, "inter_bytes": inter, "tokens_per_step": tokens_per_step}


def _save(engine: TawPipe, cfg: TrainConfig, mcfg: LlamaConfig, losses: list[float], device: torch.device) -> None:
    extra = {"rng": _get_rng(device), "losses": list(losses), "data_step": engine.steps}
    checkpoint.save(engine, cfg.save, extra=extra, meta={"model": asdict(mcfg), "train": asdict(cfg)})


def _get_rng(device: torch.device) -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _set_rng(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


def _progress(total: int, initial: int):
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # not its default multiprocessing lock: a killed rank would leak it
    return tqdm(total=total, initial=initial, desc="tawpipe train", unit="step", dynamic_ncols=True)


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
        try:
            result = run_local(_local_rank, world, cfg)[0]
        except JobFailed as e:
            print(f"tawpipe train: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    losses = result["losses"]
    k = min(5, len(losses))
    start, end = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss at start {losses[0]:.4f} (mean of first {k}: {start:.4f}) -> at end {losses[-1]:.4f} "
          f"(mean of last {k}: {end:.4f}); {result['steps_run']} steps in {result['seconds']:.1f}s, "
          f"{result['tokens_per_step'] * result['steps_run'] / result['seconds']:,.0f} tok/s")
    print(f"memory per rank (rank 0): {result['memory']}")
    if cfg.save:
        print(f"checkpoint: {checkpoint.resolve(cfg.save)}")
    return 0
