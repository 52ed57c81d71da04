"""`tawpipe train`: the main job.

With no arguments it starts a local emulated cluster (2 nodes x 2 ranks, gloo, CPU) and trains a
tiny byte-level LLaMA on the Python standard library's own source files. Under torchrun the same
entry point trains across real nodes (NCCL on GPUs), with the topology read from the environment.
--model takes a built-in preset, a Hugging Face save_pretrained directory or a config .json; each
rank builds only its own chunk. --config reads a TOML or YAML file whose keys are the flags' names;
flags on the command line override it.

Everything is checked before any worker starts (``validate``): the arguments, the data, a Hugging
Face directory's weight files (headers only), ``TAWPIPE_TIMEOUT``, that every path the job writes is
writable, and that the estimated memory of the ranks on this host fits what it has; a problem is one
line on stderr and exit status 2. There too the schedule options left "auto" (the default of
--mb-per-fetch, --prefetch-depth, --reuse-weights) are chosen (design §7.3): the workers get them as
given, and the start summary says what was chosen and why. ``--save DIR`` writes checkpoints
(``tawpipe.io.checkpoint``) every ``--save-every`` steps and at the end; ``--resume DIR`` continues
from one, bit-exactly: the engine's shard (weights, optimizer, scheduler, loss scale, counters)
plus each rank's RNG state and the loss history; the data position is the step number, since
batches are drawn from (seed, step, index) alone.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import math
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import models
from ..cost.memory import AUTO, MemoryEstimate, describe, rank_memory
from ..cost.traffic import plan_traffic
from ..cost.units import decimal, gib
from ..engine.auto import engine_plan, host_available
from ..engine.engine import TawPipe, default_optimizer
from ..io import checkpoint, safetensors
from ..models.parts import parts_signature
from ..commands import UsageError, as_flags
from ..ops import DTYPES
from ..plan.plan import Plan
from ..plan.schedule import check_replicas, depth_text
from ..plan.topology import Topology
from ..runtime.launch import JobFailed, JobStopped, init_distributed, run_local, stop_requested
from ..runtime.progress import StepBar
from ..runtime.timeout import default_timeout
from .config import NOT_TRAINING, TrainConfig, check, flag
from .data import TokenSource
from .data import batch as draw_batch
from .data import load_tokens
from .metrics import MetricsWriter, check_tensorboard, gather_peaks


class TrainError(RuntimeError):
    """A run that cannot go on, for a reason its one line says: ``main`` prints that line, no
    traceback (a full disk, steps skipped one after another)."""


@dataclass(frozen=True)
class Preflight:
    """What the checks before the start found out, for the header ``main`` prints."""

    memory: str  # the memory estimate of the ranks on this host, one line
    resumed_from: int | None = None  # the checkpoint's step
    schedule: dict[str, Any] | None = None  # mb_per_fetch, prefetch_depth, reuse_weights: "auto" resolved
    auto: str | None = None  # what "auto" chose and why; None: every option was given


GiB = 2**30
RUNTIME_BYTES = 384 * 2**20  # a rank's own footprint besides the model: torch, the data, the communicator
# (measured: the peak RSS of a rank of the built-in "micro" model, whose own memory is a few MiB)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _config(args: argparse.Namespace) -> tuple[TrainConfig, Preflight]:
    """The run's configuration, checked (``validate``) and its "auto" options chosen; UsageError
    (one line, exit status 2) otherwise."""
    cfg = TrainConfig.from_args(args)
    try:
        pre = validate(cfg, Topology.from_env() if _under_torchrun() else None)
    except (ValueError, OSError, ImportError) as e:
        raise UsageError(as_flags(str(e))) from None
    return replace(cfg, **pre.schedule), pre


def _schedule(cfg: TrainConfig) -> dict[str, Any]:
    """The schedule options, as both ``build_plan`` and the engine take them."""
    return dict(algo=cfg.algo, prefetch_depth=cfg.prefetch_depth, mb_per_fetch=cfg.mb_per_fetch,
                reuse_weights=cfg.reuse_weights, replicas=cfg.replicas)


def validate(cfg: TrainConfig, topology: Topology | None = None) -> Preflight:
    """Everything that can be checked before a worker starts; raises ValueError, OSError or
    ImportError (one line). ``topology``: torchrun's (default: the local emulated cluster's).
    Creates the directories the job writes to, last, once everything else passed."""
    check(cfg)
    default_timeout()  # a bad TAWPIPE_TIMEOUT: its ValueError says what to set
    kind = models.check(cfg.model)
    if cfg.layers is not None and kind.startswith("hf"):
        raise ValueError("--layers applies to built-in models; a Hugging Face model's layers come from its config")
    try:
        models.check_weights(cfg.model)
    except (ValueError, OSError) as e:
        raise ValueError(f"--model {cfg.model}: {e}") from None
    if cfg.tensorboard:
        check_tensorboard()
    topology = topology or Topology(cfg.nodes, cfg.per_node)
    try:
        world = check_replicas(topology, cfg.replicas)  # ranks of one pipeline
    except ValueError as e:
        raise ValueError(f"--replicas: {e}") from None
    vocab = _vocab(cfg)
    overrides = _builtin_overrides(cfg, vocab)
    blocks, embed, head, model_vocab = models.meta_model(cfg.model, **overrides)
    if len(blocks) < world:
        each = f" of each of the {cfg.replicas} replicas" if cfg.replicas > 1 else ""
        raise ValueError(f"{len(blocks)} layers for {world} ranks{each}: every rank needs at least one layer "
                         f"(--layers >= {world}, or more --replicas)")
    manifest = _check_resume(cfg, parts_signature(blocks, embed, head)) if cfg.resume is not None else None
    ran = _as_it_ran(cfg, topology, manifest)
    shape = replace(models.dims(cfg.model), layers=len(blocks), vocab=model_vocab)
    try:
        plan, auto = _plan(replace(cfg, **ran), topology, blocks, embed, head, shape)
    except ValueError as e:
        raise ValueError(f"schedule: {e}") from None
    if ran:
        options = (plan.options["mb_per_fetch"], plan.options["prefetch_depth"], plan.options["reuse_weights"])
        auto = (f"{describe(options)} — as the checkpoint ran (a bit-exact resume; give --mb-per-fetch, "
                "--prefetch-depth, --reuse-weights to choose otherwise)")
    if vocab > model_vocab:
        raise ValueError(f"--data {cfg.data}: tokens go up to {vocab - 1}, past the model's vocabulary ({model_vocab}): "
                         "use data tokenised for this model")
    _check_export(cfg)
    memory = _check_memory(cfg, topology, plan, blocks, embed, head, shape)
    params = sum({id(p): p.numel() for m in (*blocks, embed, head) for p in m.parameters()}.values())
    _check_writable(cfg, params)
    schedule = {name: plan.options[name] for name in ("mb_per_fetch", "prefetch_depth", "reuse_weights")}
    if cfg.prefetch_depth == "resident":
        schedule["prefetch_depth"] = cfg.prefetch_depth  # as asked: the summary names it
    return Preflight(memory=memory, resumed_from=manifest["step"] if manifest else None, schedule=schedule, auto=auto)


def _as_it_ran(cfg: TrainConfig, topology: Topology, manifest: dict[str, Any] | None) -> dict[str, Any]:
    """The schedule options left "auto" as the checkpoint to resume ran them, where it ran the same
    shape of plan (topology, replicas, micro-batches, algorithm): "auto" then chooses what it chose
    although this host's free memory moved, and the resume stays bit-exact. Nothing where there is
    no such checkpoint (or it predates the manifest's "schedule"), or where --memory-budget is
    given: within a given budget "auto" chooses the same again by itself."""
    ran = (manifest or {}).get("schedule")
    if not ran or cfg.memory_budget is not None:
        return {}
    shape = ({"nodes": topology.nodes, "per_node": topology.per_node}, cfg.replicas, cfg.algo, cfg.micro_batches)
    if (manifest["topology"], manifest["replicas"], manifest["algo"], ran["micro_batches"]) != shape:
        return {}
    return {name: ran[name] for name in ("mb_per_fetch", "prefetch_depth", "reuse_weights")
            if getattr(cfg, name) == AUTO}


def _plan(cfg: TrainConfig, topology: Topology, blocks: list[torch.nn.Module], embed: torch.nn.Module,
          head: torch.nn.Module, shape: models.ModelDims) -> tuple[Plan, str | None]:
    """The run's plan, as the engine builds it, with the "auto" options chosen (design §7.3) on the
    busiest rank's estimate with this run's batch (the same on every rank) within --memory-budget,
    or within what a rank of this host has less the runtime's own. Where nothing fits that
    measure, the least memory: ``_check_memory`` then says what the run needs."""
    weight_bytes, grad_bytes = _wire_bytes(cfg)
    sizes = _rank_sizes(cfg, blocks, embed, head, shape)
    gpu = _under_torchrun() and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    batch = {k: sizes[k] for k in ("seq", "micro_batch", "hidden", "heads", "vocab")}
    plan, why = engine_plan(topology, len(blocks), cfg.micro_batches, device=device,
                            budget=None if cfg.memory_budget is None else cfg.memory_budget * GiB,
                            reserve=RUNTIME_BYTES, batch=batch, grad_route=cfg.grad_route, **_schedule(cfg),
                            layer_numel=sum(p.numel() for p in blocks[0].parameters()), weight_bytes=weight_bytes,
                            grad_bytes=grad_bytes, replicated_numel=sizes["replicated_numel"] + 1)  # + the loss sum
    return plan, why and as_flags(why)


def _wire_bytes(cfg: TrainConfig) -> tuple[int, int]:
    """Bytes of a weight and of a gradient element on the wire and in the staging buffers."""
    weight_bytes = DTYPES[cfg.dtype].itemsize
    return weight_bytes, 4 if cfg.grad_wire_dtype == "float32" else weight_bytes


def _rank_sizes(cfg: TrainConfig, blocks: list[torch.nn.Module], embed: torch.nn.Module, head: torch.nn.Module,
                shape: models.ModelDims) -> dict[str, int]:
    """``rank_memory``'s sizes but the chunks' (``_chunk_numel``, which depend on the plan)."""
    weight_bytes, grad_bytes = _wire_bytes(cfg)
    return dict(replicated_numel=sum({id(p): p.numel() for m in (embed, head) for p in m.parameters()}.values()),
                weight_bytes=weight_bytes, grad_bytes=grad_bytes,
                scratch_bytes=weight_bytes if grad_bytes != weight_bytes else 0, seq=cfg.seq_len,
                micro_batch=cfg.micro_batch_size, hidden=shape.hidden, heads=shape.heads, vocab=shape.vocab)


def _chunk_numel(plan: Plan, blocks: list[torch.nn.Module]) -> list[int]:
    return [sum(p.numel() for b in blocks[a:z] for p in b.parameters()) for a, z in plan.chunk_layers]


def _local(topology: Topology) -> list[int]:
    """The ranks on this host: under torchrun its node's, else all of them."""
    if _under_torchrun():
        return topology.group_ranks(topology.group_of(int(os.environ["RANK"])))
    return list(range(topology.world_size))


def _check_export(cfg: TrainConfig) -> None:
    """--export must not replace the model it starts from."""
    if cfg.export is None or cfg.model in models.PRESETS:
        return
    model = Path(cfg.model)
    source = model if model.is_dir() else model.parent if model.is_file() else None
    if source is not None and Path(cfg.export).resolve() == source.resolve():
        raise ValueError(f"--export {cfg.export} is the directory of --model {cfg.model}: the export would replace "
                         "the weights and config the run starts from; export to another directory")


def _check_writable(cfg: TrainConfig, params: int) -> None:
    """Every path the job writes, created (directories) and tried now rather than after the start;
    and room on the file system for one checkpoint (12 B per parameter: the float32 master and
    two AdamW moments) and for the export (4 B per parameter), where the disk says how much it has."""
    for name, size in (("save", 12 * params), ("export", 4 * params), ("tensorboard", 0)):
        if getattr(cfg, name) is not None:
            path = Path(getattr(cfg, name))
            _writable_dir(flag(name), path)
            try:
                st = os.statvfs(path)
            except (OSError, AttributeError):  # no statvfs (Windows): found out when writing
                continue
            if st.f_bavail * st.f_frsize < size:
                raise ValueError(f"{flag(name)} {path}: no space left on device for it: "
                                 f"{gib(st.f_bavail * st.f_frsize)} free, the {name} takes about {gib(size)}: "
                                 f"free space there, or point {flag(name)} at a file system with room")
    if cfg.metrics is not None:
        path = Path(cfg.metrics)
        if path.is_dir():
            raise ValueError(f"--metrics {path} is a directory: name a file (e.g. {path / 'metrics.jsonl'})")
        _writable_dir("--metrics", path.parent, of=path)
        if path.exists() and not os.access(path, os.W_OK):
            raise ValueError(f"--metrics {path} is not writable: choose another file, or make it writable")


def _writable_dir(flag: str, path: Path, of: Path | None = None) -> None:
    """Create ``path`` and write a file in it; ValueError naming ``flag``'s value where that fails."""
    what = f"{flag} {of or path}"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} exists and is not a directory" if of is None else
                         f"{what}: {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{what}: cannot create the directory {path} ({e.strerror or e}): "
                         "choose a writable location") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".tawpipe-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what}: cannot write in {path} ({e.strerror or e}): choose a writable location") from None


def _check_memory(cfg: TrainConfig, topology: Topology, plan: Plan, blocks: list[torch.nn.Module],
                  embed: torch.nn.Module, head: torch.nn.Module, shape: models.ModelDims) -> str:
    """The estimated memory of this host's ranks against what it has: ValueError with the
    estimate and the fixes where it does not fit; else the estimate, one line."""
    sizes, chunk_numel = _rank_sizes(cfg, blocks, embed, head, shape), _chunk_numel(plan, blocks)
    torchrun = _under_torchrun()
    per_rank = [rank_memory(plan, r, chunk_numel=chunk_numel, **sizes) for r in _local(topology)]
    busiest = max(per_rank, key=lambda m: m.total)
    if torchrun and torch.cuda.is_available():  # each rank has a device of its own
        free, _ = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", 0)))
        need, available, where = busiest.total + RUNTIME_BYTES, free, "free on this rank's GPU"
        ranks = "this rank"
    else:
        need = sum(m.total for m in per_rank) + len(per_rank) * RUNTIME_BYTES
        available, where = host_available() or (None, "")
        ranks = f"{len(per_rank)} rank(s) on this host"
    detail = (f"{gib(need)} for {ranks}; per rank up to {gib(busiest.total + RUNTIME_BYTES)}: {_breakdown(busiest)}")
    if available is not None and need > available:
        more = ("more nodes (each rank then owns fewer layers)" if torchrun else
                f"more machines under torchrun (this host runs all {topology.world_size} ranks)")
        raise ValueError(f"not enough memory: the run needs about {detail}; {gib(available)} is available ({where}): "
                         f"use {more}, a smaller --prefetch-depth or --mb-per-fetch (fewer staging buffers), "
                         "--dtype bfloat16, a smaller --micro-batch-size or --seq-len, or a smaller model "
                         "(--model, --layers)")
    return f"memory estimate: {detail}" + (f"; {gib(available)} available ({where})" if available is not None else "")


def _breakdown(m: MemoryEstimate) -> str:
    return (f"own chunk {gib(m.persistent)} (16 B per parameter: float32 master, gradient accumulator, AdamW), "
            f"staging {gib(m.staging)}, replicated {gib(m.replicated)}, activations ~{gib(m.activations)}, "
            f"gradient norm {gib(m.transient)}, runtime ~{gib(RUNTIME_BYTES)}")


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


def _check_resume(cfg: TrainConfig, signature: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's manifest, once it is found fit to resume this run."""
    manifest = checkpoint.read_manifest(cfg.resume)
    checkpoint.check_model(manifest, signature, cfg.resume)
    if manifest["step"] >= cfg.steps:
        raise ValueError(f"--resume {cfg.resume} is at step {manifest['step']}: --steps {cfg.steps} leaves nothing to train")
    checkpoint.verify(cfg.resume, checksums=_leader())  # every shard whole, before a worker reads one
    saved = manifest["meta"].get("train", {})
    changed = [f"{flag(k)} {saved[k]} -> {v}" for k, v in asdict(cfg).items()
               if k in saved and k not in NOT_TRAINING and saved[k] != v]
    if changed:
        print(f"tawpipe train: note: resuming with other settings than the checkpoint's ({', '.join(changed)}); "
              "the run will differ from an uninterrupted one", file=sys.stderr)
    return manifest


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


def train_rank(rank: int, cfg: TrainConfig, topology: Topology, device: torch.device,
               auto: str | None = None) -> dict:
    """One rank's training loop; returns the loss curves and traffic figures. ``cfg``'s schedule
    options are given (``validate`` chose the "auto" ones; ``auto`` says what and why). A SIGTERM (a
    scheduler's preemption) or a first Ctrl-C ends it at the next step boundary, every rank at the
    same one, after saving a checkpoint when --save is set (``stopped_at`` in the result)."""
    stop_requested()  # arms the handlers: from now on a stop signal waits for a step boundary
    src = load_tokens(cfg.data)
    parts = _load_model(cfg, src, device)
    if cfg.export and parts.checkpoint_name is None:
        raise ValueError(f"--export: {parts.description} has no Hugging Face format")
    if cfg.loss == "chunked" and parts.head_loss is None:
        raise ValueError(f"--loss chunked: {parts.description} has no chunked head loss; use --loss plain")
    val = _validation_batches(rank, cfg, src) if cfg.val_every else []
    engine = TawPipe(
        **parts.engine_args(), topology=topology, micro_batches=cfg.micro_batches,
        compute_dtype=DTYPES[cfg.dtype], max_grad_norm=cfg.max_grad_norm,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg)),
        optimizer=functools.partial(default_optimizer, lr=cfg.lr), device=device, grad_route=cfg.grad_route,
        **_schedule(cfg),
        grad_wire_dtype=torch.float32 if cfg.grad_wire_dtype == "float32" else DTYPES[cfg.dtype],
        head_loss=parts.head_loss if cfg.loss == "chunked" else None,
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
        print(_summary(cfg, src, parts, engine, auto), flush=True)
    tokens_per_step = topology.world_size * cfg.micro_batches * cfg.micro_batch_size * cfg.seq_len
    writer = None
    metrics_flag = ("--metrics", cfg.metrics) if cfg.metrics else ("--tensorboard", cfg.tensorboard)
    if rank == 0 and (cfg.metrics or cfg.tensorboard):
        with _writing(*metrics_flag):
            writer = MetricsWriter(cfg.metrics, cfg.tensorboard, resume_step=start if cfg.resume else None)
        if writer.dropped:
            print(f"metrics: dropped {writer.dropped} record(s) after step {start} from {cfg.metrics}: "
                  "the resumed run writes them again", flush=True)
    bar = StepBar(cfg.steps, start, "tawpipe train") if rank == 0 else None
    val_losses: dict[int, float] = {}
    skipped_before, in_a_row = engine.skipped_steps, 0
    t0 = time.perf_counter()
    stopped_at = None
    try:
        for step in range(start, cfg.steps):
            idx = [rank * cfg.micro_batches + i for i in range(cfg.micro_batches)]
            mbs = [draw_batch(src.train, cfg.seq_len, cfg.micro_batch_size, seed=cfg.seed, step=step, index=i) for i in idx]
            t_step = time.perf_counter()
            skipped = engine.skipped_steps
            loss = engine.step((torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])))
            step_seconds = time.perf_counter() - t_step
            in_a_row = in_a_row + 1 if engine.skipped_steps > skipped else 0
            losses.append(loss)
            done = engine.steps
            if val and (done % cfg.val_every == 0 or done == cfg.steps):
                val_losses[done] = engine.evaluate(val)
            if done % cfg.log_every == 0 or done == cfg.steps:
                peaks = gather_peaks(device)  # a collective: every rank takes part
                if writer is not None:
                    with _writing(*metrics_flag):
                        writer.write({
                            "step": done, "loss": loss, "lr": engine.optimizer.param_groups[0]["lr"],
                            **({"val_loss": val_losses[done]} if done in val_losses else {}),
                            "skipped_steps": engine.skipped_steps,
                            "tokens": tokens_per_step * done, "tokens_per_s": tokens_per_step / step_seconds,
                            "step_seconds": step_seconds, "bytes_per_iter": per_rank_bytes, "peak_memory": peaks,
                        })
            if bar is not None:
                elapsed = time.perf_counter() - t0
                shown = f" | val {val_losses[max(val_losses)]:.3f}" if val_losses else ""
                shown += f" | skipped {engine.skipped_steps}" if engine.skipped_steps else ""
                bar.step(
                    f"loss {loss:.3f}{shown} | {tokens_per_step * (step + 1 - start) / elapsed:,.0f} tok/s | "
                    f"rank 0 sends {decimal(intra)}/iter inside its node, {decimal(inter)}/iter to other nodes"
                )
            _check_skipped(cfg, in_a_row, done - start, done, loss, rank)
            stopping = done < cfg.steps and stop_requested(agree=True)  # a collective: every rank asks
            if cfg.save and (stopping or done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
                _save(engine, cfg, parts, losses, device)
            if stopping:
                stopped_at = done
                break
    except BaseException:
        if bar is not None:  # its last line ends, so that the error's starts a line of its own
            bar.close()
        raise
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if writer is not None:
        writer.close()
    if cfg.export and stopped_at is None:
        with _writing("--export", cfg.export):
            safetensors.export(engine, parts, cfg.export, torch.float32)
    memory = str(engine.memory_report())
    engine.close()
    return {"losses": losses, "val_losses": val_losses, "steps_run": len(losses) - start, "seconds": seconds,
            "stopped_at": stopped_at,
            "memory": memory, "intra_bytes": intra, "inter_bytes": inter, "tokens_per_step": tokens_per_step,
            "skipped": engine.skipped_steps - skipped_before, "skipped_total": engine.skipped_steps}


def _check_skipped(cfg: TrainConfig, in_a_row: int, run: int, done: int, loss: float, rank: int = 0) -> None:
    """TrainError once --max-skipped-in-a-row steps in a row were skipped, or every step of a
    finished run was: nothing is being trained (every rank sees the same steps skipped)."""
    limit = cfg.max_skipped_in_a_row
    if not limit or not (in_a_row >= limit or (done == cfg.steps and in_a_row == run)):
        return
    what = f"the last {in_a_row} steps" if in_a_row < run else f"all {run} steps of this run"
    error = TrainError(
        f"step {done}: {what} were skipped, their loss (last: {loss}) or gradients not finite, so nothing is "
        "being trained: lower --lr, use --dtype float32 or bfloat16 rather than float16, or check the model's "
        f"weights for NaN/Inf (--max-skipped-in-a-row 0 lets the run go on; now {limit})")
    # Every rank stops at the same step with the same error: the launcher names rank 0's.
    error.about_a_peer = rank != 0  # type: ignore[attr-defined]
    raise error


def _validation_batches(rank: int, cfg: TrainConfig, src: TokenSource) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of a fixed held-out set: the same batches at every evaluation."""
    if len(src.val) < cfg.seq_len + 1:
        raise ValueError(f"the held-out split has {len(src.val)} tokens, too few for --seq-len {cfg.seq_len}: "
                         "use more data, or --val-every 0")
    return [draw_batch(src.val, cfg.seq_len, cfg.micro_batch_size, seed=cfg.seed, step=0, index=rank * cfg.val_batches + i)
            for i in range(cfg.val_batches)]


def _summary(cfg: TrainConfig, src: TokenSource, parts: models.ModelParts, engine: TawPipe,
             auto: str | None = None) -> str:
    """What this run trains, on what and where; what "auto" chose and why."""
    topo, plan = engine.topology, engine.plan
    psi, rep = parts.decoder_params, parts.replicated_params
    layers = [stop - start for start, stop in (plan.chunk_layers[k] for k in plan.model_order)]
    return "\n".join([
        *([f"resumed from step {engine.steps} ({checkpoint.resolve(cfg.resume)})"] if cfg.resume else []),
        f"data: {src.description}: {len(src.train):,} training and {len(src.val):,} held-out tokens, "
        f"vocabulary {src.vocab_size}",
        f"model: {parts.description}: {psi:,} decoder parameters + {rep:,} replicated; compute {cfg.dtype}, "
        "masters and optimizer state float32",
        f"topology: {topo.nodes} node(s) x {topo.per_node} rank(s) = {topo.world_size} ranks"
        f"{f' in {plan.replicas} replicas of {plan.replica_size}' if plan.replicas > 1 else ''}, chunks of {layers} "
        f"layers in model order; per rank {cfg.micro_batches} micro-batches of {cfg.micro_batch_size} x {cfg.seq_len} tokens",
        f"schedule: {plan.algo}, gradient route {cfg.grad_route}, prefetch depth {depth_text(plan, cfg.prefetch_depth)}, "
        f"{engine.mb_per_fetch} micro-batch(es) per fetch, resident chunks "
        f"{'reused' if engine.reuse_weights else 'refetched'}, "
        f"gradients travel in {cfg.grad_wire_dtype if cfg.grad_wire_dtype == 'float32' else cfg.dtype}",
        *([f"auto: {auto}"] if auto else []),
    ])  # memory: the estimate before the workers start, what was allocated at the end


def _save(engine: TawPipe, cfg: TrainConfig, parts: models.ModelParts, losses: list[float],
          device: torch.device) -> None:
    extra = {"rng": _get_rng(device), "losses": list(losses), "data_step": engine.steps}
    with _writing("--save", checkpoint.step_dir(cfg.save, engine.steps)):
        checkpoint.save(engine, cfg.save, extra=extra, meta={"model": parts.config, "train": asdict(cfg)})


@contextlib.contextmanager
def _writing(flag: str, path: Any) -> Iterator[None]:
    """A full disk while writing ``path`` becomes a TrainError that says so in one line (the
    writers' own errors hide it: torch's is "enforce fail ... unexpected pos")."""
    try:
        yield
    except Exception as e:
        if not _no_space(e):
            raise
        raise TrainError(f"no space left on device: could not write {path} ({flag}): free space there, or point "
                         f"{flag} at a file system with room") from e


def _no_space(e: BaseException | None) -> bool:
    """Whether ``e`` or an error it came from is a full disk (or quota)."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if re.search(r"no space left on device|disk quota exceeded|os error (28|122)\b", str(e), re.I):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _get_rng(device: torch.device) -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _set_rng(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


def _local_rank(rank: int, cfg: TrainConfig, auto: str | None) -> dict:
    return train_rank(rank, cfg, Topology(nodes=cfg.nodes, per_node=cfg.per_node), torch.device("cpu"), auto)


def _leader() -> bool:
    """Whether this process acts for the whole job: the local launcher, or rank 0 under torchrun."""
    return not _under_torchrun() or os.environ["RANK"] == "0"


def _holding_save(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    """--save's lock (``checkpoint.hold``), taken by the leader before any worker starts and held
    to the end; UsageError where another run holds it."""
    if cfg.save is None or not _leader():
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
    if _under_torchrun():
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
        if rank != 0:
            return 0
    else:
        world = cfg.nodes * cfg.per_node
        print(f"tawpipe train: local emulated cluster, {cfg.nodes} nodes x {cfg.per_node} ranks (gloo, CPU), "
              f"model {cfg.model}, {cfg.steps} steps{resumed}")
        print(f"tawpipe train: {pre.memory}", flush=True)
        try:
            result = run_local(_local_rank, world, cfg, pre.auto)[0]
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
