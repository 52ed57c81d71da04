"""`tawpipe train`: the main job.

With no arguments it starts a local emulated cluster (2 nodes x 2 ranks, gloo, CPU) and trains a
tiny byte-level LLaMA on the Python standard library's own source files. Under torchrun the same
entry point trains across real nodes (NCCL on GPUs), with the topology read from the environment.
--model takes a built-in preset, a Hugging Face save_pretrained directory or a config .json; each
rank builds only its own chunk. --config reads a TOML or YAML file whose keys are the flags' names;
flags on the command line override it.

Arguments and data are checked before any worker starts. ``--save DIR`` writes checkpoints
(``tawpipe.io.checkpoint``) every ``--save-every`` steps and at the end; ``--resume DIR`` continues
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

from .. import models
from ..cost.traffic import plan_traffic
from ..engine.engine import TawPipe, default_optimizer
from ..io import checkpoint, safetensors
from ..models.parts import parts_signature
from ..ops import DTYPES
from ..plan.plan import ALGOS
from ..plan.schedule import build_plan, depth_text, prefetch_depth_arg
from ..plan.topology import Topology
from ..runtime.launch import JobFailed, init_distributed, run_local
from .data import TokenSource
from .data import batch as draw_batch
from .data import load_tokens
from .metrics import MetricsWriter, check_tensorboard, gather_peaks, peak_host_bytes


@dataclass(frozen=True)
class TrainConfig:
    nodes: int = 2
    per_node: int = 2
    model: str = "tiny"
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
    algo: str = "tawpipe"
    prefetch_depth: int | str = 1
    mb_per_fetch: int = 1
    reuse_weights: bool = False
    grad_wire_dtype: str = "float32"
    seed: int = 0
    save: str | None = None
    save_every: int | None = None
    resume: str | None = None
    export: str | None = None
    val_every: int = 25
    val_batches: int = 2
    metrics: str | None = None
    tensorboard: str | None = None
    log_every: int = 1


# may change on resume: they do not change what is trained
_NOT_TRAINING = ("save", "save_every", "resume", "export", "val_every", "val_batches", "metrics", "tensorboard",
                 "log_every", "prefetch_depth", "mb_per_fetch", "reuse_weights")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.epilog = (f"Built-in presets for --model: {', '.join(sorted(models.PRESETS))}. Hugging Face model types: "
                "llama, mistral, qwen2, qwen3 (tawpipe.models.hf.register adds others).")
    p.add_argument("--config", default=None, help="TOML or YAML file of flag values, keys named as the flags "
                   "(micro-batches = 4); flags on the command line override it")
    p.add_argument("--nodes", type=int, default=d.nodes, help="emulated nodes (local cluster only)")
    p.add_argument("--per-node", type=int, default=d.per_node, help="ranks per emulated node")
    p.add_argument("--model", "--preset", dest="model", default=d.model,
                   help="a built-in preset, a Hugging Face save_pretrained directory, or a config .json "
                        "(a Hugging Face config.json, or LlamaConfig fields)")
    p.add_argument("--layers", type=int, default=None, help="override a built-in model's layer count")
    p.add_argument("--data", default=None, help="text file or uint16 .bin; default: Python stdlib sources")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches, help="micro-batches per rank per step")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps, then cosine decay to 10%%")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype, help="compute dtype")
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="clip the global gradient norm")
    p.add_argument("--grad-route", choices=("rail", "leader"), default=d.grad_route,
                   help="router of inter-node gradients")
    p.add_argument("--algo", choices=ALGOS, default=d.algo, help="the schedule (weipipe: the paper's baseline)")
    p.add_argument("--prefetch-depth", type=prefetch_depth_arg, default=d.prefetch_depth,
                   help="fetch weights this many slots ahead; 'resident' (with --reuse-weights): every fetched "
                        "chunk stays in a staging buffer, the fewest bytes for the most staging memory")
    p.add_argument("--mb-per-fetch", type=int, default=d.mb_per_fetch,
                   help="k: micro-batches a resident chunk runs per fetch (divides --micro-batches); "
                        "inter-node bytes fall by k (see `tawpipe plan --memory-budget`)")
    p.add_argument("--reuse-weights", action=argparse.BooleanOptionalAction, default=d.reuse_weights,
                   help="do not fetch again a chunk still in a staging buffer")
    p.add_argument("--grad-wire-dtype", choices=("float32", "compute"), default=d.grad_wire_dtype,
                   help="dtype gradients travel in; the owner accumulates in float32 either way")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the initial model and of the batches")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="checkpoint directory: a checkpoint at the end (and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=None, metavar="N", help="also checkpoint every N steps")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint: a step directory, or the latest one under DIR")
    p.add_argument("--export", default=None, help="write the trained model here as a Hugging Face "
                   "save_pretrained directory (safetensors; each rank writes its own chunk)")
    p.add_argument("--val-every", type=int, default=d.val_every,
                   help="validation loss on the held-out split every this many steps and at the end (0: never)")
    p.add_argument("--val-batches", type=int, default=d.val_batches, help="validation micro-batches per rank")
    p.add_argument("--metrics", default=None, help="append a JSON record per logged step to this file")
    p.add_argument("--tensorboard", default=None, help="also write the metrics as TensorBoard events here")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between metrics records")
    _read_config_file_first(p)


def _read_config_file_first(p: argparse.ArgumentParser) -> None:
    """Make ``p`` read --config's file before the command line: the file's values become flags in
    front of the given ones, so they are checked like flags and the flags given override them."""
    parse_known_args = p.parse_known_args
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")

    def with_config(args: list[str] | None = None, namespace: argparse.Namespace | None = None):
        args = sys.argv[1:] if args is None else list(args)
        path = pre.parse_known_args(args)[0].config
        return parse_known_args((_config_argv(p, path) if path else []) + args, namespace)

    p.parse_known_args = with_config  # type: ignore[method-assign]


def _config_argv(p: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags a config file stands for."""
    file = Path(path)
    if not file.is_file():
        p.error(f"--config {path}: no such file")
    if file.suffix not in (".toml", ".yaml", ".yml"):
        p.error(f"--config {path}: use a .toml, .yaml or .yml file")
    try:
        if file.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib

            values = tomllib.loads(file.read_text())
        else:
            import yaml

            values = yaml.safe_load(file.read_text()) or {}
    except ImportError as e:
        p.error(f"--config {path}: reading it needs pip install {'pyyaml' if e.name == 'yaml' else e.name}")
    except Exception as e:  # a syntax error: tomllib.TOMLDecodeError or yaml.YAMLError
        p.error(f"--config {path}: {e}")
    if not isinstance(values, dict):
        p.error(f"--config {path}: expected a table of flag values")
    flags = {o for a in p._actions for o in a.option_strings if o.startswith("--") and o not in ("--config", "--help")}
    argv: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in flags:
            p.error(f"--config {path}: unknown key {key!r}; keys are the flags' names: "
                    f"{', '.join(sorted(f[2:] for f in flags))}")
        if value is not None:
            argv += [flag, str(value)]
    return argv


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


def _schedule(cfg: TrainConfig) -> dict[str, Any]:
    """The schedule options, as both ``build_plan`` and the engine take them."""
    return dict(algo=cfg.algo, prefetch_depth=cfg.prefetch_depth, mb_per_fetch=cfg.mb_per_fetch,
                reuse_weights=cfg.reuse_weights)


def validate(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Everything that can be checked before a worker starts; raises ValueError (one line)."""
    for name in ("steps", "micro_batches", "batch_size", "seq_len", "nodes", "per_node", "layers", "save_every",
                 "val_batches", "log_every"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"{_arg(name)} must be >= 1, got {value}")
    for name in ("warmup", "val_every"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{_arg(name)} must be >= 0, got {getattr(cfg, name)}")
    for name in ("lr", "max_grad_norm"):
        value = getattr(cfg, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{_arg(name)} must be a finite number > 0, got {value}")
    kind = models.check(cfg.model)
    if cfg.layers is not None and kind.startswith("hf"):
        raise ValueError("--layers applies to built-in models; a Hugging Face model's layers come from its config")
    if cfg.tensorboard:
        check_tensorboard()
    world = world_size or cfg.nodes * cfg.per_node
    vocab = _vocab(cfg)
    blocks, embed, head, model_vocab = models.meta_model(cfg.model, **_builtin_overrides(cfg, vocab))
    if len(blocks) < world:
        raise ValueError(f"{len(blocks)} layers for {world} ranks: every rank needs at least one layer "
                         f"(--layers >= {world})")
    try:
        build_plan(Topology(1, world), len(blocks), cfg.micro_batches, **_schedule(cfg))
    except ValueError as e:
        raise ValueError(f"schedule: {e}") from None
    if vocab > model_vocab:
        raise ValueError(f"--data {cfg.data}: tokens go up to {vocab - 1}, past the model's vocabulary ({model_vocab}): "
                         "use data tokenised for this model")
    if cfg.save_every is not None and cfg.save is None:
        raise ValueError("--save-every needs --save DIR")
    for name in ("save", "export"):
        if getattr(cfg, name) is not None:
            path = Path(getattr(cfg, name))
            if path.exists() and not path.is_dir():
                raise ValueError(f"{_arg(name)} {path} exists and is not a directory")
            path.mkdir(parents=True, exist_ok=True)
            if not os.access(path, os.W_OK | os.X_OK):
                raise ValueError(f"{_arg(name)} {path} is not writable")
    if cfg.resume is not None:
        _check_resume(cfg, parts_signature(blocks, embed, head))


def _vocab(cfg: TrainConfig) -> int:
    """The data's vocabulary: bytes, or a .bin file's tokens (the file is checked on the way)."""
    if cfg.data is None or cfg.data == "stdlib":
        return 256
    src = load_tokens(cfg.data)
    if len(src.train) < cfg.seq_len + 1:
        raise ValueError(f"--data {cfg.data}: {len(src.train)} training tokens are too few for --seq-len {cfg.seq_len}")
    return src.vocab_size


def _builtin_overrides(cfg: TrainConfig, vocab: int) -> dict[str, int | None]:
    """A built-in model is sized to the data and the sequence; a Hugging Face one is as configured."""
    if models.check(cfg.model) not in ("preset", "llama-json"):
        return {}
    return {"layers": cfg.layers, "vocab_size": max(vocab, 256), "max_seq_len": max(cfg.seq_len, 16)}


def _check_resume(cfg: TrainConfig, signature: dict[str, Any]) -> None:
    manifest = checkpoint.read_manifest(cfg.resume)
    checkpoint.check_model(manifest, signature, cfg.resume)
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


def _load_model(cfg: TrainConfig, src: TokenSource, device: torch.device) -> models.ModelParts:
    """The model, with only the replicated parts real (each rank builds its own chunk later)."""
    return models.load(cfg.model, seed=cfg.seed, device=device, compute_dtype=DTYPES[cfg.dtype],
                       **_builtin_overrides(cfg, src.vocab_size))


def train_rank(rank: int, cfg: TrainConfig, topology: Topology, device: torch.device) -> dict:
    """One rank's training loop; returns the loss curves and traffic figures."""
    src = load_tokens(cfg.data)
    parts = _load_model(cfg, src, device)
    if cfg.export and parts.checkpoint_name is None:
        raise ValueError(f"--export: {parts.description} has no Hugging Face format")
    val = _validation_batches(rank, cfg, src) if cfg.val_every else []
    engine = TawPipe(
        **parts.engine_args(), topology=topology, micro_batches=cfg.micro_batches,
        compute_dtype=DTYPES[cfg.dtype], max_grad_norm=cfg.max_grad_norm,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg)),
        optimizer=functools.partial(default_optimizer, lr=cfg.lr), device=device, grad_route=cfg.grad_route,
        **_schedule(cfg),
        grad_wire_dtype=torch.float32 if cfg.grad_wire_dtype == "float32" else DTYPES[cfg.dtype],
    )
    losses: list[float] = []
    if cfg.resume:
        restored = checkpoint.restore(engine, cfg.resume)
        losses = list(restored.extra["losses"])
        if not restored.resharded:  # each rank's own stream; on another topology there is none
            _set_rng(restored.extra["rng"], device)
    start = engine.steps
    traffic = plan_traffic(engine.plan)
    intra, inter = traffic.node_bytes(rank)
    per_rank_bytes = {"intra_node": [traffic.node_bytes(r)[0] for r in range(topology.world_size)],
                      "inter_node": [traffic.node_bytes(r)[1] for r in range(topology.world_size)]}
    if rank == 0:
        print(_summary(cfg, src, parts, engine), flush=True)
    tokens_per_step = topology.world_size * cfg.micro_batches * cfg.batch_size * cfg.seq_len
    writer = MetricsWriter(cfg.metrics, cfg.tensorboard) if rank == 0 and (cfg.metrics or cfg.tensorboard) else None
    bar = _progress(cfg.steps, start) if rank == 0 else None
    val_losses: dict[int, float] = {}
    t0 = time.perf_counter()
    for step in range(start, cfg.steps):
        idx = [rank * cfg.micro_batches + i for i in range(cfg.micro_batches)]
        mbs = [draw_batch(src.train, cfg.seq_len, cfg.batch_size, seed=cfg.seed, step=step, index=i) for i in idx]
        t_step = time.perf_counter()
        loss = engine.step((torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])))
        step_seconds = time.perf_counter() - t_step
        losses.append(loss)
        done = engine.steps
        if val and (done % cfg.val_every == 0 or done == cfg.steps):
            val_losses[done] = engine.evaluate(val)
        if done % cfg.log_every == 0 or done == cfg.steps:
            peaks = gather_peaks(device)  # a collective: every rank takes part
            if writer is not None:
                writer.write({
                    "step": done, "loss": loss, "lr": engine.optimizer.param_groups[0]["lr"],
                    **({"val_loss": val_losses[done]} if done in val_losses else {}),
                    "tokens": tokens_per_step * done, "tokens_per_s": tokens_per_step / step_seconds,
                    "step_seconds": step_seconds, "bytes_per_iter": per_rank_bytes, "peak_memory": peaks,
                })
        if bar is not None:
            elapsed = time.perf_counter() - t0
            bar.update(1)
            shown = f" | val {val_losses[max(val_losses)]:.3f}" if val_losses else ""
            bar.set_postfix_str(
                f"loss {loss:.3f}{shown} | {tokens_per_step * (step + 1 - start) / elapsed:,.0f} tok/s | "
                f"moved/iter: intra-node {intra / 1e6:.2f} MB, inter-node {inter / 1e6:.2f} MB (rank 0)"
            )
        if cfg.save and (done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
            _save(engine, cfg, parts, losses, device)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if writer is not None:
        writer.close()
    if cfg.export:
        safetensors.export(engine, parts, cfg.export, torch.float32)
    memory = str(engine.memory_report())
    engine.close()
    return {"losses": losses, "val_losses": val_losses, "steps_run": cfg.steps - start, "seconds": seconds,
            "memory": memory, "intra_bytes": intra, "inter_bytes": inter, "tokens_per_step": tokens_per_step}


def _validation_batches(rank: int, cfg: TrainConfig, src: TokenSource) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of a fixed held-out set: the same batches at every evaluation."""
    if len(src.val) < cfg.seq_len + 1:
        raise ValueError(f"the held-out split has {len(src.val)} tokens, too few for --seq-len {cfg.seq_len}: "
                         "use more data, or --val-every 0")
    return [draw_batch(src.val, cfg.seq_len, cfg.batch_size, seed=cfg.seed, step=0, index=rank * cfg.val_batches + i)
            for i in range(cfg.val_batches)]


def _summary(cfg: TrainConfig, src: TokenSource, parts: models.ModelParts, engine: TawPipe) -> str:
    """What this run trains, on what and where, and the memory each rank needs."""
    topo, plan, mib = engine.topology, engine.plan, 2**20
    report = engine.memory_report()
    psi, rep = parts.decoder_params, parts.replicated_params
    layers = [stop - start for start, stop in (plan.chunk_layers[k] for k in plan.model_order)]
    return "\n".join([
        f"data: {src.description}: {len(src.train):,} training and {len(src.val):,} held-out tokens, "
        f"vocabulary {src.vocab_size}",
        f"model: {parts.description}: {psi:,} decoder parameters + {rep:,} replicated; compute {cfg.dtype}, "
        "masters and optimizer state float32",
        f"topology: {topo.nodes} node(s) x {topo.per_node} rank(s) = {topo.world_size} ranks, chunks of {layers} "
        f"layers in model order; per rank {cfg.micro_batches} micro-batches of {cfg.batch_size} x {cfg.seq_len} tokens",
        f"schedule: {plan.algo}, gradient route {cfg.grad_route}, prefetch depth {depth_text(plan, cfg.prefetch_depth)}, "
        f"{cfg.mb_per_fetch} micro-batch(es) per fetch, resident chunks {'reused' if cfg.reuse_weights else 'refetched'}, "
        f"gradients travel in {cfg.grad_wire_dtype if cfg.grad_wire_dtype == 'float32' else cfg.dtype}",
        f"memory per rank (rank 0): own chunk {report.persistent / mib:,.1f} MiB (master, gradient accumulator), "
        f"{report.sharded_target / mib:,.1f} MiB with AdamW state from the first step (16 B x Psi/N); staging "
        f"{sum(report.staging.values()) / mib:,.1f} MiB; replicated {16 * rep / mib:,.1f} MiB (weights, gradients, "
        f"AdamW); peak RSS so far {peak_host_bytes() / mib:,.1f} MiB",
    ])


def _save(engine: TawPipe, cfg: TrainConfig, parts: models.ModelParts, losses: list[float],
          device: torch.device) -> None:
    extra = {"rng": _get_rng(device), "losses": list(losses), "data_step": engine.steps}
    checkpoint.save(engine, cfg.save, extra=extra, meta={"model": parts.config, "train": asdict(cfg)})


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
              f"model {cfg.model}, {cfg.steps} steps")
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
    if result["val_losses"]:
        print("validation loss: " + ", ".join(f"step {s} {v:.4f}" for s, v in result["val_losses"].items()))
    print(f"memory per rank (rank 0): {result['memory']}")
    if cfg.save:
        print(f"checkpoint: {checkpoint.resolve(cfg.save)}")
    return 0
