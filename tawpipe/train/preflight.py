"""Everything ``tawpipe train`` checks before any worker starts, and the schedule it chooses.

``validate`` reads the data and the model's shapes (on the meta device: no memory), a Hugging
Face directory's weight files (headers only) and a checkpoint to resume (every shard), tries every
path the job writes, chooses the schedule options left "auto" (design §7.3) as the engine would,
and estimates the memory of this host's ranks against what it has. A problem is a ValueError,
OSError or ImportError of one line; ``tawpipe train`` prints it with exit status 2.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .. import models
from ..commands import as_flags
from ..cost.memory import (AUTO, MemoryEstimate, Savers, describe, logits_bytes, rank_memory, savers_to_weigh,
                           working_set_bytes)
from ..cost.units import gib
from ..engine.auto import engine_plan, host_available
from ..io import checkpoint
from ..engine.policy import MemoryPolicy, activation_batch
from ..models.parts import parts_signature, unique_params
from ..ops import DTYPES
from ..plan.plan import Plan
from ..plan.schedule import check_depth_gains, check_replicas
from ..plan.topology import Topology
from ..runtime import comm as comm_backends
from ..runtime.timeout import default_timeout
from .config import NOT_TRAINING, TrainConfig, check, flag, under_torchrun
from .data import load_tokens
from .metrics import check_tensorboard

GiB = 2**30


@dataclass(frozen=True)
class Preflight:
    """What the checks before the start found out, for the header ``main`` prints."""

    memory: str  # the memory estimate of the ranks on this host, one line
    resumed_from: int | None = None  # the checkpoint's step
    schedule: dict[str, Any] | None = None  # mb_per_fetch, prefetch_depth, reuse_weights: "auto" resolved
    auto: str | None = None  # what "auto" chose and why; None: every option was given


RUNTIME_BYTES = 384 * 2**20  # a rank's own footprint besides the model: torch, the data, the communicator
# (measured: the peak RSS of a rank of the built-in "micro" model, whose own memory is a few MiB)



def validate(cfg: TrainConfig, topology: Topology | None = None) -> Preflight:
    """Everything that can be checked before a worker starts; raises ValueError, OSError or
    ImportError (one line). ``topology``: torchrun's (default: the local emulated cluster's).
    Creates the directories the job writes to, last, once everything else passed."""
    check(cfg)
    default_timeout()  # a bad TAWPIPE_TIMEOUT: its ValueError says what to set
    _check_comm(cfg)
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
    _check_context(cfg, topology, kind)
    vocab = _vocab(cfg)
    overrides = builtin_overrides(cfg, vocab)
    blocks, embed, head, model_vocab = models.meta_model(cfg.model, **overrides)
    chunkable = True  # a built-in model's head
    if kind.startswith("hf"):
        from ..models.hf import has_chunked_loss

        chunkable = has_chunked_loss(head)
    if cfg.loss == "chunked" and not chunkable:
        raise ValueError(f"--loss chunked: this model's head ({type(head).__name__}) is not the final norm and a "
                         "bias-free projection, whose loss tawpipe computes without the whole logits; use --loss plain")
    if len(blocks) < world:
        each = f" of each of the {cfg.replicas} replicas" if cfg.replicas > 1 else ""
        raise ValueError(f"{len(blocks)} layers for {world} ranks{each}: every rank needs at least one layer "
                         f"(--layers >= {world}, or more --replicas)")
    manifest = _check_resume(cfg, parts_signature(blocks, embed, head)) if cfg.resume is not None else None
    ran = _as_it_ran(cfg, topology, manifest)
    weight_bytes, grad_bytes = _wire_bytes(cfg)
    shape = replace(models.dims(cfg.model, seq=cfg.seq_len // cfg.context_parallel, micro_batch=cfg.micro_batch_size,
                                dtype_bytes=weight_bytes, grad_bytes=grad_bytes),
                    layers=len(blocks), vocab=model_vocab)  # what a rank computes: its slice of each sequence
    if cfg.loss == AUTO:
        cfg = replace(cfg, loss=_loss(chunkable, shape))
    try:
        check_depth_gains(topology, cfg.prefetch_depth, cfg.replicas)
        plan, savers, auto = _plan(replace(cfg, **ran), topology, blocks, embed, head, shape)
        cfg = replace(cfg, recompute=savers.recompute, offload_state=savers.offload_state,
                      offload_activations=savers.offload_activations)
    except ValueError as e:
        raise ValueError(f"schedule: {e}") from None
    MemoryPolicy(cfg.recompute, cfg.offload_state, cfg.offload_activations)  # the engine's rules, before the start
    if ran:
        options = (plan.options["mb_per_fetch"], plan.options["prefetch_depth"], plan.options["reuse_weights"])
        auto = (f"{describe(options)} — as the checkpoint ran (a bit-exact resume; give --mb-per-fetch, "
                "--prefetch-depth, --reuse-weights to choose otherwise)")
    if vocab > model_vocab:
        raise ValueError(f"--data {cfg.data}: tokens go up to {vocab - 1}, past the model's vocabulary ({model_vocab}): "
                         "use data tokenised for this model")
    _check_export(cfg)
    memory = _check_memory(cfg, topology, plan, blocks, embed, head, shape)
    params = sum(p.numel() for _, p in unique_params([("blocks", m) for m in blocks] + [("embed", embed), ("head", head)]))
    _check_writable(cfg, params)
    schedule = {name: plan.options[name] for name in ("mb_per_fetch", "prefetch_depth", "reuse_weights")}
    schedule.update(loss=cfg.loss, recompute=cfg.recompute, offload_state=cfg.offload_state,
                    offload_activations=cfg.offload_activations)
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
          head: torch.nn.Module, shape: models.ModelDims) -> tuple[Plan, Savers, str | None]:
    """The run's plan, as the engine builds it, with the "auto" options chosen (design §7.3) on the
    busiest rank's estimate with this run's batch (the same on every rank) within --memory-budget,
    or within what a rank of this host has less the runtime's own; with --recompute auto, the
    memory savers too (``savers_ladder``: on the CPU, no offload, which would free nothing). Where
    nothing fits that measure, the least memory: ``_check_memory`` then says what the run needs."""
    weight_bytes, grad_bytes = _wire_bytes(cfg)
    sizes = _rank_sizes(cfg, blocks, embed, head, shape)
    gpu = under_torchrun() and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    batch = {k: sizes[k] for k in ("shape", "chunked_loss")}
    savers = savers_to_weigh(cfg.recompute, cfg.offload_state, cfg.offload_activations,
                             host_is_device=device.type == "cpu")
    plan, chosen, why = engine_plan(
        topology, len(blocks), cfg.micro_batches, device=device,
        budget=None if cfg.memory_budget is None else cfg.memory_budget * GiB, reserve=RUNTIME_BYTES, batch=batch,
        savers=savers, grad_route=cfg.grad_route, algo=cfg.algo, mb_per_fetch=cfg.mb_per_fetch,
        prefetch_depth=cfg.prefetch_depth, reuse_weights=cfg.reuse_weights, replicas=cfg.replicas,
        layer_numel=sum(p.numel() for p in blocks[0].parameters()), weight_bytes=weight_bytes, grad_bytes=grad_bytes,
        replicated_numel=sizes["replicated_numel"])
    return plan, chosen, why and as_flags(why)


def _loss(chunkable: bool, shape: models.ModelDims) -> str:
    """--loss auto: chunked where the model has a chunked loss (``chunkable``) and a micro-batch's
    float32 logits, with their softmax and gradient, would outweigh what one layer keeps for its
    backward without attention scores (12·V against about 24·H·dtype bytes per token at LLaMA's
    shapes: LLaMA-sized vocabularies); plain otherwise."""
    layer = working_set_bytes(replace(shape, scores=False), 1)
    return "chunked" if chunkable and logits_bytes(shape) > layer else "plain"


def _wire_bytes(cfg: TrainConfig) -> tuple[int, int]:
    """Bytes of a weight and of a gradient element on the wire and in the staging buffers."""
    weight_bytes = DTYPES[cfg.dtype].itemsize
    return weight_bytes, 4 if cfg.grad_wire_dtype == "float32" else weight_bytes


def _rank_sizes(cfg: TrainConfig, blocks: list[torch.nn.Module], embed: torch.nn.Module, head: torch.nn.Module,
                shape: models.ModelDims) -> dict[str, Any]:
    """``rank_memory``'s sizes but the chunks' (``_chunk_numel``, which depend on the plan)."""
    weight_bytes, grad_bytes = _wire_bytes(cfg)
    return dict(replicated_numel=sum(p.numel() for _, p in unique_params([("embed", embed), ("head", head)])),
                weight_bytes=weight_bytes, grad_bytes=grad_bytes,
                scratch_bytes=weight_bytes if grad_bytes != weight_bytes else 0,
                **activation_batch(shape, cfg.loss == "chunked"))


def _chunk_numel(plan: Plan, blocks: list[torch.nn.Module]) -> list[int]:
    return [sum(p.numel() for b in blocks[a:z] for p in b.parameters()) for a, z in plan.chunk_layers]


def _local(topology: Topology) -> list[int]:
    """The ranks on this host: under torchrun its node's, else all of them."""
    if under_torchrun():
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
    torchrun = under_torchrun()
    savers = Savers(cfg.recompute, cfg.offload_state, cfg.offload_activations)
    per_rank = [rank_memory(plan, r, chunk_numel=chunk_numel, savers=savers, **sizes) for r in _local(topology)]
    busiest = max(per_rank, key=lambda m: m.total)
    if torchrun and torch.cuda.is_available():  # each rank has a device of its own
        free, _ = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", 0)))
        need, available, where = busiest.total + RUNTIME_BYTES, free, "free on this rank's GPU"
        ranks = "this rank"
        check_host(per_rank, host_available())
    else:  # the ranks' devices are this host's memory, and so is what they offload
        need = sum(m.total + m.host for m in per_rank) + len(per_rank) * RUNTIME_BYTES
        available, where = host_available() or (None, "")
        ranks = f"{len(per_rank)} rank(s) on this host"
    detail = (f"{gib(need)} for {ranks}; per rank up to {gib(busiest.total + RUNTIME_BYTES)}: {_breakdown(busiest)}")
    if available is not None and need > available:
        more = ("more nodes (each rank then owns fewer layers)" if torchrun else
                f"more machines under torchrun (this host runs all {topology.world_size} ranks)")
        raise ValueError(f"not enough memory: the run needs about {detail}; {gib(available)} is available ({where}): "
                         f"use {more}, a smaller --prefetch-depth or --mb-per-fetch (fewer staging buffers), "
                         "--recompute layer, --offload-activations or --offload-state (on a GPU: device memory to "
                         "the host), --dtype bfloat16, a smaller --micro-batch-size or --seq-len, or a smaller model "
                         "(--model, --layers)")
    return f"memory estimate: {detail}" + (f"; {gib(available)} available ({where})" if available is not None else "")


def _check_context(cfg: TrainConfig, topology: Topology, kind: str) -> None:
    """--context-parallel's needs, before any rank starts (the engine checks them again)."""
    c = cfg.context_parallel
    if c == 1:
        return
    if kind.startswith("hf"):
        from ..models.hf import context_parallel_refusal

        why = context_parallel_refusal(models.hf_config(cfg.model))
        if why is not None:
            raise ValueError(f"--context-parallel {c}: this model cannot attend from a slice of the sequence: {why}; "
                             "train it with --context-parallel 1")
    if topology.per_node % c:
        raise ValueError(f"--context-parallel {c} does not divide the {topology.per_node} ranks of a node "
                         "(--per-node): a context group is ranks of one node")
    if cfg.seq_len % (2 * c):
        raise ValueError(f"--seq-len {cfg.seq_len} is not a multiple of 2 x --context-parallel = {2 * c}: each of "
                         f"a group's {c} ranks takes two equal mirrored slices of every sequence")
    if cfg.algo != "tawpipe":
        raise ValueError(f"--context-parallel {c} needs --algo tawpipe, whose node's ranks run each chunk in the "
                         f"same slot ({cfg.algo}'s do not)")


def check_host(per_rank: list[MemoryEstimate], available: tuple[int, str] | None) -> None:
    """ValueError where what this node's ranks keep in host memory (offloaded state and activations,
    stashed chunks: ``MemoryEstimate.host``) is more than the host has, before any rank allocates it."""
    need = sum(m.host for m in per_rank)
    if available is not None and need > available[0]:
        raise ValueError(f"not enough host memory: this node's {len(per_rank)} rank(s) keep about {gib(need)} in host "
                         f"memory (offloaded optimizer state and activations, fetched chunks kept there); "
                         f"{gib(available[0])} is available ({available[1]}): leave out --offload-state, "
                         "--offload-activations or --reuse-weights host, or use more nodes")


def _breakdown(m: MemoryEstimate) -> str:
    return (f"own chunk {gib(m.persistent)} (16 B per parameter: float32 master, gradient accumulator, AdamW), "
            f"staging {gib(m.staging)}, replicated {gib(m.replicated)}, activations ~{gib(m.activations)}, "
            f"runtime ~{gib(RUNTIME_BYTES)}"
            + (f"; in host memory {gib(m.host)} (offloaded)" if m.host else ""))


def _vocab(cfg: TrainConfig) -> int:
    """The data's vocabulary: bytes, or a .bin file's tokens (the file is checked on the way)."""
    if cfg.data is None or cfg.data == "stdlib":
        return 256
    src = load_tokens(cfg.data)
    if len(src.train) < cfg.seq_len + 1:
        raise ValueError(f"--data {cfg.data}: {len(src.train)} training tokens are too few for --seq-len {cfg.seq_len}")
    if cfg.val_every and len(src.val) < cfg.seq_len + 1:
        raise ValueError(f"--data {cfg.data}: the held-out split has {len(src.val)} tokens, too few for --seq-len "
                         f"{cfg.seq_len}: use more data, or --val-every 0")
    return src.vocab_size


def builtin_overrides(cfg: TrainConfig, vocab: int) -> dict[str, int | None]:
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
    checkpoint.verify(cfg.resume, checksums=leader())  # every shard whole, before a worker reads one
    saved = manifest["meta"].get("train", {})
    changed = [f"{flag(k)} {saved[k]} -> {v}" for k, v in asdict(cfg).items()
               if k in saved and k not in (*NOT_TRAINING, "nodes", "per_node") and saved[k] != v]
    ranks = manifest["topology"]["nodes"], manifest["topology"]["per_node"]  # the job's, under torchrun too
    if ranks[0] * ranks[1] != cfg.nodes * cfg.per_node:  # other ranks draw the batches
        changed.insert(0, f"--nodes x --per-node {ranks[0]} x {ranks[1]} -> {cfg.nodes} x {cfg.per_node}")
    if changed:
        print(f"tawpipe train: note: resuming with other settings than the checkpoint's ({', '.join(changed)}); "
              "the run will differ from an uninterrupted one", file=sys.stderr)
    return manifest


def leader() -> bool:
    """Whether this process acts for the whole job: the local launcher, or rank 0 under torchrun."""
    return not under_torchrun() or os.environ["RANK"] == "0"


def _check_comm(cfg: TrainConfig) -> None:
    """--comm names a registered backend this job can use: the local cluster runs on the CPU."""
    comm_backends.backend(cfg.comm)  # a ValueError naming the registered ones
    if cfg.comm != "torch" and not (under_torchrun() and torch.cuda.is_available()):
        raise ValueError(f"--comm {cfg.comm} needs CUDA GPUs under torchrun; the local emulated cluster (gloo, CPU) "
                         "runs --comm torch")
