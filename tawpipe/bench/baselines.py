"""The peers TawPipe is measured against, on one model, one global batch and one optimizer.

DDP, FSDP2 (``fully_shard``; the default keeps unsharded gradients until the last micro-batch,
"memory-matched" reduce-scatters after every micro-batch so that only shards persist, as in
TawPipe; "node reshard" reshards the blocks to the node after forward, so that backward gathers
them inside the node, ZeRO++'s hpZ), HSDP (``fully_shard`` over a replicate x shard = nodes x
per-node mesh) and 1F1B (``torch.distributed.pipelining.Schedule1F1B``, one stage per rank).
Each is a rank function ``fn(rank, cfg) -> dict`` for a job whose torch.distributed is already
initialised (``tawpipe.runtime.launch.run_local`` or ``tawpipe.cluster.Cluster.run``), and all of
them — and the TawPipe engine, through :func:`measure` — produce the same record: per-step losses, timed step
seconds, persistent and peak memory, the node's inter-node link bytes when run on an emulated
cluster, and optionally the parameters after the first step for a check against
:func:`reference`, plain single-process training on the whole global batch.

Rank r trains on micro-batches r·acc … r·acc+acc−1 of each step (``tawpipe.train.data.batch``), as
``tawpipe train`` does; 1F1B feeds all of them, in that order, through its first stage. The
model's embedding and head are untied, so 1F1B's first and last stages share no weight. Every
method computes the head and the loss with :func:`head_loss` (``RunConfig.loss``); the
reference keeps the plain ``llama_loss(model(x), y)``.
"""

from __future__ import annotations

import functools
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from ..cluster import link_bytes
from ..engine.engine import default_optimizer
from ..models.llama import Head, Llama, LlamaConfig, block_forward, chunked_head_loss, llama_loss
from ..plan.topology import Topology
from ..train.data import batch as draw_batch
from ..train.data import load_tokens
from ..train.metrics import peak_host_bytes


LOSSES = ("plain", "chunked")


@dataclass(frozen=True)
class RunConfig:
    """One training job every method runs identically (defaults: the issue's measurement)."""

    nodes: int = 2
    per_node: int = 2
    hidden: int = 256
    layers: int = 8
    heads: int = 8  # MHA with head_dim 32, like the paper's model family
    seq_len: int = 512
    vocab: int = 256  # the byte corpus uses ids < 256; a larger vocabulary sizes the embedding and head
    micro_batches: int = 2  # per rank and step
    batch_size: int = 1  # sequences per micro-batch
    warmup: int = 1  # untimed steps first; the parameters after step 0 are checked
    steps: int = 3  # timed steps
    lr: float = 1e-3
    optimizer: str = "adamw"  # tawpipe.engine.default_optimizer; "sgd": plain SGD, whose update
    # is proportional to the gradient (Adam's first step is not: it hides gradient scale errors)
    loss: str = "plain"  # "chunked": the head's cross-entropy without the float32 logits (chunked_head_loss)
    seed: int = 0
    check_dir: str | None = None  # write each rank's parameters after step 0 here

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node", "hidden", "layers", "heads", "seq_len", "micro_batches",
                     "batch_size", "warmup", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.layers < self.world_size:
            raise ValueError(f"{self.layers} layers cannot give each of {self.world_size} ranks a chunk "
                             "(or a 1F1B stage): use at least as many layers as ranks")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 256:
            raise ValueError(f"vocab must be an integer >= 256 (the byte corpus has token ids up to 255), "
                             f"got {self.vocab!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden={self.hidden} must split into {self.heads} heads of even size")

    @property
    def topology(self) -> Topology:
        return Topology(self.nodes, self.per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def tokens_per_step(self) -> int:
        return self.world_size * self.micro_batches * self.batch_size * self.seq_len

    def model_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab, hidden=self.hidden, n_layers=self.layers, n_heads=self.heads,
                           n_kv_heads=self.heads, max_seq_len=self.seq_len, tie_embeddings=False)


def make_optimizer(cfg: RunConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer every method (and the TawPipe engine) uses over its own parameters."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    return default_optimizer(params, lr=cfg.lr)


def build_model(cfg: RunConfig) -> Llama:
    """The same initial model on every rank and in the reference."""
    torch.manual_seed(cfg.seed)
    return Llama(cfg.model_config())


def rank_batch(cfg: RunConfig, tokens: np.ndarray, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batches of ``step``, concatenated (acc·B rows)."""
    parts = [draw_batch(tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed, step=step,
                        index=rank * cfg.micro_batches + i) for i in range(cfg.micro_batches)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def global_batch(cfg: RunConfig, tokens: np.ndarray, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's micro-batches of ``step``, in rank order."""
    parts = [rank_batch(cfg, tokens, step, r) for r in range(cfg.world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def persistent_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank keeps between steps: its parameters, one gradient each, optimizer state."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            t = _local(p)
            total += 2 * t.numel() * t.element_size()
            for s in optimizer.state.get(p, {}).values():
                if torch.is_tensor(s) and s.dim() > 0:
                    s = _local(s)
                    total += s.numel() * s.element_size()
    return total


def measure(cfg: RunConfig, step: Callable[[int], float | None], params: Callable[[], dict[str, torch.Tensor]],
            optimizer: torch.optim.Optimizer, **extra: Any) -> dict[str, Any]:
    """Run warm-up and timed steps of one method and return its record (see the module doc).

    ``step(i)`` runs step i and returns this rank's loss (None if it has none); ``params()``
    returns the full parameters this rank can vouch for, under the model's names.
    """
    rank = dist.get_rank()
    losses = [step(i) for i in range(cfg.warmup)]
    if cfg.check_dir is not None:
        state = {n: t.detach().clone() for n, t in params().items()}
        torch.save(state, os.path.join(cfg.check_dir, f"rank{rank}.pt"))
    dist.barrier()
    before = link_bytes()
    dist.barrier()  # nobody sends before every node has read its counters
    times = []
    for i in range(cfg.warmup, cfg.warmup + cfg.steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
    dist.barrier()
    after = link_bytes()
    local_rank = rank % cfg.per_node
    link = asdict(after - before) if after is not None and local_rank == 0 else None
    return {"rank": rank, "losses": losses, "step_seconds": times, "link_bytes": link,
            "persistent_bytes": persistent_bytes(optimizer),
            "peak_rss_bytes": peak_host_bytes(), **extra}


def rank_data(cfg: RunConfig, rank: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """``step -> (inputs, targets)`` of this rank, on the stdlib byte corpus."""
    tokens = load_tokens(None).train
    return functools.partial(rank_batch, cfg, tokens, rank=rank)


def _plain_head_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return llama_loss(head(hidden), targets)


def head_loss(cfg: RunConfig) -> Callable[[Head, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(head, hidden, targets) -> loss`` of ``cfg.loss`` (the engine's ``head_loss`` contract):
    the plain loss of the head's logits, or ``chunked_head_loss``, which never holds them in float32."""
    return chunked_head_loss if cfg.loss == "chunked" else _plain_head_loss


def stage_layers(layers: int, stages: int, stage: int) -> tuple[int, int]:
    """Contiguous, balanced layer range of ``stage`` (the first ``layers % stages`` get one more)."""
    base, extra = divmod(layers, stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


class _Stage(nn.Module):
    """Embedding (first stage), a contiguous run of layers, head (last stage), under the model's
    parameter names (:meth:`global_names`). The only stage of one is the whole model, whose forward
    with targets ends in the loss: DDP's and FSDP2's hooks on it then run around the head's loss
    too (FSDP2 has the root's parameters, embedding and head, unsharded only inside its forward)."""

    def __init__(self, model: Llama, cfg: RunConfig, stage: int = 0, stages: int = 1) -> None:
        super().__init__()
        self.start, stop = stage_layers(cfg.layers, stages, stage)
        self.embed = model.embed if stage == 0 else None
        self.blocks = nn.ModuleList(model.blocks[self.start:stop])
        self.head = model.head if stage == stages - 1 else None
        self._ctx = model.block_context(cfg.seq_len, "cpu")
        self._head_loss = head_loss(cfg)

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden state after this stage's layers; the loss if ``targets`` are given."""
        if self.embed is not None:
            h = self.embed(h)
        for block in self.blocks:
            h = block_forward(block, h, **self._ctx)
        return h if targets is None else self.loss(h, targets)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's head and loss (1F1B's ``loss_fn``)."""
        return self._head_loss(self.head, hidden, targets)

    def global_names(self) -> dict[str, nn.Parameter]:
        out = {}
        for name, p in self.named_parameters():
            if name.startswith("blocks."):
                _, idx, rest = name.split(".", 2)
                name = f"blocks.{self.start + int(idx)}.{rest}"
            out[name] = p
        return out


def _accumulate(net: nn.Module, cfg: RunConfig, x: torch.Tensor, y: torch.Tensor,
                sync: Callable[[int], Any]) -> float:
    """Forward/backward of each micro-batch with loss / acc; ``sync(m)`` wraps micro-batch m."""
    total = 0.0
    for m, (xm, ym) in enumerate(zip(x.chunk(cfg.micro_batches), y.chunk(cfg.micro_batches))):
        with sync(m):
            loss = net(xm, ym) / cfg.micro_batches
            loss.backward()
        total += loss.item()
    return total


def ddp(rank: int, cfg: RunConfig) -> dict[str, Any]:
    """DistributedDataParallel; gradients are all-reduced once, after the last micro-batch."""
    model = _Stage(build_model(cfg), cfg)
    net = nn.parallel.DistributedDataParallel(model)
    opt = make_optimizer(cfg, list(model.parameters()))
    data = rank_data(cfg, rank)
    last = cfg.micro_batches - 1

    def step(i: int) -> float:
        loss = _accumulate(net, cfg, *data(i), lambda m: nullcontext() if m == last else net.no_sync())
        opt.step()
        opt.zero_grad()
        return loss

    return measure(cfg, step, lambda: dict(model.named_parameters()) if rank == 0 else {}, opt)


def _fsdp(rank: int, cfg: RunConfig, mesh_shape: tuple[int, ...], sync_every_micro_batch: bool,
          reshard_blocks: bool | int = True) -> dict[str, Any]:
    """FSDP2 with one group per block and the root (embedding, head) left to FSDP2's default:
    not resharded after forward, since backward needs it first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _Stage(build_model(cfg), cfg)
    names = ("replicate", "shard")[-len(mesh_shape):]  # HSDP: dim 0 replicates, dim 1 shards
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_blocks)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(cfg, list(model.parameters()))
    data = rank_data(cfg, rank)
    last = cfg.micro_batches - 1

    def sync(m: int):
        model.set_requires_gradient_sync(sync_every_micro_batch or m == last)
        return nullcontext()

    def step(i: int) -> float:
        loss = _accumulate(model, cfg, *data(i), sync)
        opt.step()
        opt.zero_grad()
        return loss

    def params() -> dict[str, torch.Tensor]:
        full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective: every rank
        return full if rank == 0 else {}

    return measure(cfg, step, params, opt)


def fsdp(rank: int, cfg: RunConfig) -> dict[str, Any]:
    """FSDP2 over all ranks; unsharded gradients accumulate, one reduce-scatter per step."""
    return _fsdp(rank, cfg, (cfg.world_size,), sync_every_micro_batch=False)


def fsdp_memory_matched(rank: int, cfg: RunConfig) -> dict[str, Any]:
    """FSDP2 over all ranks with a reduce-scatter per micro-batch: only shards persist."""
    return _fsdp(rank, cfg, (cfg.world_size,), sync_every_micro_batch=True)


def fsdp_node_reshard(rank: int, cfg: RunConfig) -> dict[str, Any]:
    """FSDP2 over all ranks whose blocks reshard to their node after forward
    (``reshard_after_forward=per_node``, ZeRO++'s hpZ): the forward all-gather crosses nodes, the
    backward one stays inside the node. Gradients are synced once per step, as in ``fsdp``.

    FSDP2 takes the int only as a non-trivial divisor of the world size; the two trivial node
    sizes mean what FSDP2 itself maps them to: one rank per node keeps the whole blocks after
    forward (False), one node is plain ``fsdp`` (True)."""
    reshard = True if cfg.nodes == 1 else False if cfg.per_node == 1 else cfg.per_node
    return _fsdp(rank, cfg, (cfg.world_size,), sync_every_micro_batch=False, reshard_blocks=reshard)


def hsdp(rank: int, cfg: RunConfig) -> dict[str, Any]:
    """FSDP2 sharded inside a node, replicated across nodes; gradients synced once per step."""
    return _fsdp(rank, cfg, (cfg.nodes, cfg.per_node), sync_every_micro_batch=False)


def one_f_one_b(rank: int, cfg: RunConfig) -> dict[str, Any]:
    """Schedule1F1B with one stage per rank over the whole global batch (world·acc micro-batches);
    the last stage sends out its hidden state and the schedule's loss is its head's."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    n = cfg.world_size
    if n < 2:
        raise ValueError("1F1B needs at least 2 ranks (one pipeline stage each)")
    stage_mod = _Stage(build_model(cfg), cfg, rank, n)
    opt = make_optimizer(cfg, list(stage_mod.parameters()))
    stage = PipelineStage(stage_mod, rank, n, torch.device("cpu"))
    # every rank passes a loss_fn (the schedule runs no backward without one); only the last calls it
    schedule = Schedule1F1B(stage, n_microbatches=n * cfg.micro_batches, loss_fn=stage_mod.loss, scale_grads=True)
    tokens = load_tokens(None).train

    def step(i: int) -> float | None:
        # Micro-batches are cut along rows: batch_size rows each, in rank order as for the others.
        x, y = global_batch(cfg, tokens, i) if rank in (0, n - 1) else (None, None)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == n - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).mean().item() if losses else None

    return measure(cfg, step, stage_mod.global_names, opt)


METHODS: dict[str, Callable[[int, RunConfig], dict[str, Any]]] = {
    "ddp": ddp, "fsdp": fsdp, "fsdp-mm": fsdp_memory_matched, "fsdp-node": fsdp_node_reshard, "hsdp": hsdp,
    "1f1b": one_f_one_b,
}


def reference(cfg: RunConfig, steps: int = 2) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process training on the whole global batch: (losses, initial and after-step-0 params)."""
    model = build_model(cfg)
    opt = make_optimizer(cfg, list(model.parameters()))
    tokens = load_tokens(None).train
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, after = [], {}
    for i in range(steps):
        x, y = global_batch(cfg, tokens, i)
        loss = llama_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i == 0:
            after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, init, after


def update_error(init: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """‖Δ − Δ_ref‖ / ‖Δ_ref‖ over all parameters, Δ = after − before the first step."""
    missing = sorted(set(ref) - set(got))
    if missing:
        raise ValueError(f"no rank returned {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    num = sum(((got[n].float() - init[n]) - (ref[n] - init[n])).square().sum().item() for n in ref)
    den = sum((ref[n] - init[n]).square().sum().item() for n in ref)
    return (num / den) ** 0.5


def merge_params(check_dir: str, world_size: int, ranks: range | None = None) -> dict[str, torch.Tensor]:
    """Union of the parameters every rank (or every rank of ``ranks``: one replica's) wrote to
    ``check_dir``."""
    out: dict[str, torch.Tensor] = {}
    for r in range(world_size) if ranks is None else ranks:
        path = os.path.join(check_dir, f"rank{r}.pt")
        if os.path.exists(path):
            out.update(torch.load(path, weights_only=True))  # tensors only: nothing in the file runs
    return out
