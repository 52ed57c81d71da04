"""One rank's training: the engine built from the run's configuration, and the loop over steps.

``build_engine`` is the one place where ``tawpipe train``'s configuration becomes the engine's
model and policies. ``Loop`` runs the steps on this rank's micro-batches (drawn from (seed, step,
index) alone, so a resumed run continues bit-exactly), validates, logs metrics, checkpoints, and
stops every rank at the same step boundary on request.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import re
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from .. import models
from ..cost.traffic import context_bytes, plan_traffic
from ..cost.units import decimal
from ..engine.engine import TawPipe, default_optimizer
from ..engine.policy import CommPolicy, MemoryPolicy, PrecisionPolicy, SchedulePolicy
from ..io import checkpoint, safetensors
from ..ops import DTYPES
from ..plan.schedule import HOST, depth_text
from ..plan.topology import Topology
from ..runtime.launch import stop_requested
from ..runtime.progress import StepBar
from .config import TrainConfig
from .data import TokenSource
from .data import batch as draw_batch
from .data import load_tokens
from .metrics import MetricsWriter, gather_peaks
from .preflight import builtin_overrides


class TrainError(RuntimeError):
    """A run that cannot go on, for a reason its one line says: ``main`` prints that line, no
    traceback (a full disk, steps skipped one after another)."""



def _lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return f


def _reschedule(engine: TawPipe, cfg: TrainConfig) -> None:
    """This run's --lr, --warmup and --steps from the restored step on. The checkpoint's optimizer
    and scheduler hold the rates its own run computed (the peak rate, and the next step's): kept, a
    resume with a new --lr went on at the old one, and one with a new --warmup or --steps took its
    first step at the old schedule's rate. With the same flags the rates are the ones restored."""
    scheduler, f = engine.scheduler, _lr_lambda(cfg)
    scheduler.base_lrs = [cfg.lr] * len(engine.optimizer.param_groups)
    for group in engine.optimizer.param_groups:
        group["initial_lr"], group["lr"] = cfg.lr, cfg.lr * f(scheduler.last_epoch)


def build_engine(cfg: TrainConfig, parts: models.ModelParts, topology: Topology, device: torch.device) -> TawPipe:
    """The engine this run trains: the model and the four policies its flags ask for."""
    dtype = DTYPES[cfg.dtype]
    return TawPipe(
        parts, topology=topology, micro_batches=cfg.micro_batches,
        optimizer=functools.partial(default_optimizer, lr=cfg.lr),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg)), device=device,
        schedule=SchedulePolicy(cfg.algo, cfg.mb_per_fetch, cfg.prefetch_depth, cfg.reuse_weights, cfg.replicas,
                                cfg.grad_route, cfg.context_parallel),
        precision=PrecisionPolicy(dtype, torch.float32 if cfg.grad_wire_dtype == "float32" else dtype,
                                  max_grad_norm=cfg.max_grad_norm),
        memory=MemoryPolicy(cfg.recompute, cfg.offload_state, cfg.offload_activations, chunked_loss=cfg.loss == "chunked"),
        comm=CommPolicy(cfg.comm),
    )


def train_rank(rank: int, cfg: TrainConfig, topology: Topology, device: torch.device,
               auto: str | None = None) -> dict:
    """One rank's training; returns the loss curves and traffic figures. ``cfg``'s schedule
    options are given (``validate`` chose the "auto" ones; ``auto`` says what and why). A SIGTERM (a
    scheduler's preemption) or a first Ctrl-C ends it at the next step boundary, every rank at the
    same one, after saving a checkpoint when --save is set (``stopped_at`` in the result)."""
    stop_requested()  # arms the handlers: from now on a stop signal waits for a step boundary
    return Loop(rank, cfg, topology, device, auto).run()


def local_rank(rank: int, cfg: TrainConfig, auto: str | None) -> dict:
    """A rank of the local emulated cluster (``run_local``'s worker): gloo, the CPU."""
    return train_rank(rank, cfg, Topology(nodes=cfg.nodes, per_node=cfg.per_node), torch.device("cpu"), auto)


class Loop:
    """This rank's run: its data, model, engine, metrics writer and progress bar."""

    def __init__(self, rank: int, cfg: TrainConfig, topology: Topology, device: torch.device,
                 auto: str | None) -> None:
        self.rank, self.cfg, self.device = rank, cfg, device
        self.src = load_tokens(cfg.data)
        self.parts = models.load(cfg.model, seed=cfg.seed, device=device, compute_dtype=DTYPES[cfg.dtype],
                                 **builtin_overrides(cfg, self.src.vocab_size))
        if cfg.export and self.parts.checkpoint_name is None:
            raise ValueError(f"--export: {self.parts.description} has no Hugging Face format")
        self.val = _validation_batches(rank, cfg, self.src) if cfg.val_every else []
        self.engine = build_engine(cfg, self.parts, topology, device)
        self.losses: list[float] = []
        restored = checkpoint.restore(self.engine, cfg.resume) if cfg.resume else None
        if restored is not None:
            _reschedule(self.engine, cfg)
            self.losses = list(restored.extra["losses"])
        if restored is not None and not restored.resharded:  # each rank's own stream, where it was
            _set_rng(restored.extra["rng"], device)
        else:
            _seed_rng(cfg.seed, rank, self.engine.steps)
        self.start = self.engine.steps
        traffic, ranks = plan_traffic(self.engine.plan), range(topology.world_size)
        kv = [self._context_bytes(r) for r in ranks]  # the K/V exchange: inside the node too
        self.per_rank_bytes = {"intra_node": [traffic.node_bytes(r)[0] + kv[r] for r in ranks],
                               "inter_node": [traffic.node_bytes(r)[1] for r in ranks]}
        self.intra, self.inter = self.per_rank_bytes["intra_node"][rank], self.per_rank_bytes["inter_node"][rank]
        if rank == 0:
            print(_summary(cfg, self.src, self.parts, self.engine, auto), flush=True)
        self.tokens_per_step = (topology.world_size // cfg.context_parallel * cfg.micro_batches * cfg.micro_batch_size
                                * cfg.seq_len)
        self.writer = self._writer() if rank == 0 and (cfg.metrics or cfg.tensorboard) else None
        self.bar = StepBar(cfg.steps, self.start, "tawpipe train") if rank == 0 else None
        self.val_losses: dict[int, float] = {}
        # the steps skipped in a row up to the checkpoint count on (older checkpoints: from 0)
        self.skipped_before = self.engine.skipped_steps
        self.in_a_row = int(restored.extra.get("skipped_in_a_row", 0)) if restored is not None else 0

    def _writer(self) -> MetricsWriter:
        cfg = self.cfg
        with _writing(*self._metrics_flag()):
            writer = MetricsWriter(cfg.metrics, cfg.tensorboard, resume_step=self.start if cfg.resume else None)
        if writer.dropped:
            print(f"metrics: dropped {writer.dropped} record(s) after step {self.start} from {cfg.metrics}: "
                  "the resumed run writes them again", flush=True)
        return writer

    def _metrics_flag(self) -> tuple[str, str | None]:
        cfg = self.cfg
        return ("--metrics", cfg.metrics) if cfg.metrics else ("--tensorboard", cfg.tensorboard)

    def run(self) -> dict:
        cfg, engine = self.cfg, self.engine
        t0 = time.perf_counter()
        stopped_at = None
        try:
            for step in range(self.start, cfg.steps):
                if self._step(step, t0):
                    stopped_at = engine.steps
                    break
        finally:  # the bar's last line ends, so that an error's starts a line of its own
            if self.bar is not None:
                self.bar.close()
        seconds = time.perf_counter() - t0
        if self.writer is not None:
            self.writer.close()
        if cfg.export and stopped_at is None:
            with _writing("--export", cfg.export):
                safetensors.export(engine, self.parts, cfg.export, torch.float32)
        memory = str(engine.memory_report())
        engine.close()
        return {"losses": self.losses, "val_losses": self.val_losses, "steps_run": len(self.losses) - self.start,
                "seconds": seconds, "stopped_at": stopped_at, "memory": memory, "intra_bytes": self.intra,
                "inter_bytes": self.inter, "tokens_per_step": self.tokens_per_step,
                "skipped": engine.skipped_steps - self.skipped_before, "skipped_total": engine.skipped_steps}

    def _context_bytes(self, rank: int) -> int:
        """What ``rank`` sends per iteration in context parallelism's K/V exchanges (0 without)."""
        cfg = self.cfg
        if cfg.context_parallel == 1:
            return 0
        dims = models.dims(cfg.model, seq=cfg.seq_len, micro_batch=cfg.micro_batch_size,
                           dtype_bytes=DTYPES[cfg.dtype].itemsize)
        return context_bytes(self.engine.plan, rank, dims, cfg.context_parallel, self.engine.policies[2].recompute)

    def _step(self, step: int, t0: float) -> bool:
        """One step with its validation, metrics, bar and checkpoint; whether the run stops here."""
        cfg, engine = self.cfg, self.engine
        idx = [data_rank(self.rank, cfg) * cfg.micro_batches + i for i in range(cfg.micro_batches)]
        mbs = [draw_batch(self.src.train, cfg.seq_len, cfg.micro_batch_size, seed=cfg.seed, step=step, index=i)
               for i in idx]
        t_step = time.perf_counter()
        skipped, lr = engine.skipped_steps, engine.optimizer.param_groups[0]["lr"]  # the step's (it advances it)
        loss = engine.step((torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])))
        step_seconds = time.perf_counter() - t_step
        self.in_a_row = self.in_a_row + 1 if engine.skipped_steps > skipped else 0
        self.losses.append(loss)
        done = engine.steps
        if self.val and (done % cfg.val_every == 0 or done == cfg.steps):
            self.val_losses[done] = engine.evaluate(self.val)
        if done % cfg.log_every == 0 or done == cfg.steps:
            self._record(done, loss, lr, step_seconds)
        if self.bar is not None:
            self._show(step, loss, time.perf_counter() - t0)
        _check_skipped(cfg, self.in_a_row, done - self.start, done, loss, self.rank)
        stopping = done < cfg.steps and stop_requested(agree=True)  # a collective: every rank asks
        if cfg.save and (stopping or done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
            _save(engine, cfg, self.parts, self.losses, self.in_a_row, self.device)
        return stopping

    def _record(self, done: int, loss: float, lr: float, step_seconds: float) -> None:
        """The metrics of step ``done`` (``lr``: the rate it stepped with): every rank's peak memory
        (a collective), rank 0's record."""
        peaks = gather_peaks(self.device)  # a collective: every rank takes part
        if self.writer is None:
            return
        with _writing(*self._metrics_flag()):
            self.writer.write({
                "step": done, "loss": loss, "lr": lr,
                **({"val_loss": self.val_losses[done]} if done in self.val_losses else {}),
                "skipped_steps": self.engine.skipped_steps,
                "tokens": self.tokens_per_step * done, "tokens_per_s": self.tokens_per_step / step_seconds,
                "step_seconds": step_seconds, "bytes_per_iter": self.per_rank_bytes, "peak_memory": peaks,
            })

    def _show(self, step: int, loss: float, elapsed: float) -> None:
        """The bar's line: the loss, the last validation loss, tokens/s and what rank 0 sends."""
        shown = f" | val {self.val_losses[max(self.val_losses)]:.3f}" if self.val_losses else ""
        shown += f" | skipped {self.engine.skipped_steps}" if self.engine.skipped_steps else ""
        self.bar.step(
            f"loss {loss:.3f}{shown} | {self.tokens_per_step * (step + 1 - self.start) / elapsed:,.0f} tok/s | "
            f"rank 0 sends {decimal(self.intra)}/iter inside its node, {decimal(self.inter)}/iter to other nodes"
        )


def _check_skipped(cfg: TrainConfig, in_a_row: int, run: int, done: int, loss: float, rank: int = 0) -> None:
    """TrainError once --max-skipped-in-a-row steps in a row were skipped, or every step of a
    finished run was: nothing is being trained (every rank sees the same steps skipped)."""
    limit = cfg.max_skipped_in_a_row
    if not limit or not (in_a_row >= limit or (done == cfg.steps and in_a_row >= run)):
        return
    what = f"the last {in_a_row} steps" if in_a_row != run else f"all {run} steps of this run"
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
    return [draw_batch(src.val, cfg.seq_len, cfg.micro_batch_size, seed=cfg.seed, step=0,
                       index=data_rank(rank, cfg) * cfg.val_batches + i) for i in range(cfg.val_batches)]


def data_rank(rank: int, cfg: TrainConfig) -> int:
    """Whose share of the data ``rank`` draws: a context group's ranks draw the same sequences
    (each computes its slice of them)."""
    return rank // cfg.context_parallel


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
        "masters and optimizer state float32; "
        + ("chunked loss (the head a slice of tokens at a time)" if cfg.loss == "chunked" else "plain loss"),
        f"topology: {topo.nodes} node(s) x {topo.per_node} rank(s) = {topo.world_size} ranks"
        f"{f' in {plan.replicas} replicas of {plan.replica_size}' if plan.replicas > 1 else ''}, chunks of {layers} "
        f"layers in model order; per rank {cfg.micro_batches} micro-batches of {cfg.micro_batch_size} x {cfg.seq_len} tokens"
        + (f", context parallel: each {cfg.context_parallel} ranks of a node share them, {cfg.seq_len // cfg.context_parallel} "
           "tokens of each sequence per rank" if cfg.context_parallel > 1 else ""),
        f"schedule: {plan.algo}, gradient route {cfg.grad_route}, prefetch depth {depth_text(plan, cfg.prefetch_depth)}, "
        f"{engine.mb_per_fetch} micro-batch(es) per fetch, resident chunks "
        f"{'reused' if engine.reuse_weights else 'refetched'}"
        f"{', the rest kept in host memory' if engine.reuse_weights == HOST else ''}, "
        f"gradients travel in {cfg.grad_wire_dtype if cfg.grad_wire_dtype == 'float32' else cfg.dtype}",
        *([f"auto: {auto}"] if auto else []),
    ])  # memory: the estimate before the workers start, what was allocated at the end


def _save(engine: TawPipe, cfg: TrainConfig, parts: models.ModelParts, losses: list[float], in_a_row: int,
          device: torch.device) -> None:
    extra = {"rng": _get_rng(device), "losses": list(losses), "data_step": engine.steps, "skipped_in_a_row": in_a_row}
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


def _seed_rng(seed: int, rank: int, step: int) -> None:
    """Seed this rank's torch generators (dropout draws from them) from --seed, the rank and the
    step it starts at: the workers started with the launcher's state, one that differed from run
    to run and was the same on every rank, so two runs of one command trained other curves and
    every rank drew the same dropout masks for its micro-batches."""
    torch.manual_seed(int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0]))


def _get_rng(device: torch.device) -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _set_rng(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


