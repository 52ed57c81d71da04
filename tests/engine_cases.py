"""Rank functions for the engine tests (module level, so spawned processes can import them).

Each rank runs tawpipe and, independently, plain single-process training on the whole global
batch; the parent test compares them. The reference never touches tawpipe code.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

from tawpipe.runtime import comm as comms
from tawpipe.runtime.comm import RecordingComm
from tawpipe.runtime.comm.torch_dist import TorchDistComm
from tawpipe.engine.engine import TawPipe, default_optimizer
from tawpipe.engine.policy import CommPolicy, MemoryPolicy, PrecisionPolicy, SchedulePolicy
from tawpipe.models.parts import ModelParts
from tawpipe.plan.actions import OPS, Op
from tawpipe.plan.topology import Topology

VOCAB, HIDDEN, SEQ, MB_ROWS = 61, 24, 7, 2


class MLPBlock(nn.Module):
    """A residual block with matrices, vectors and biases: odd sizes on purpose."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, 3 * h - 1)
        self.down = nn.Linear(3 * h - 1, h)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = self.down(F.gelu(self.up(self.norm(x))))
        return x + (y * scale.to(y.dtype) if scale is not None else y)


class Head(nn.Module):
    def __init__(self, h: int, v: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.proj = nn.Linear(h, v, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class BufferBlock(MLPBlock):
    """An MLPBlock with constant buffers, as rotary tables are: a float gain (not in the state dict)
    and an integer permutation of the features (in it)."""

    def __init__(self, h: int) -> None:
        super().__init__(h)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, h), persistent=False)
        self.register_buffer("perm", torch.arange(h).roll(1))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x * self.gain.to(x.dtype), scale)[..., self.perm]


def freeze(model: "TinyLM", what: str) -> None:
    """Fine-tuning's frozen parameters: "some" freezes every block's norm weight, the first two
    layers whole and the head's norm; "replicated" freezes the first two layers, the embedding and
    the head whole (a rank owning only those layers then trains nothing)."""
    model.blocks[:2].requires_grad_(False)
    if what == "some":
        for b in model.blocks:
            b.norm.weight.requires_grad_(False)
        model.head.norm.weight.requires_grad_(False)
    elif what == "replicated":
        model.embed.requires_grad_(False)
        model.head.requires_grad_(False)
    else:
        raise ValueError(f"freeze: unknown recipe {what!r}")


class TinyLM(nn.Module):
    def __init__(self, layers: int, block: type[nn.Module] = MLPBlock) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(block(HIDDEN) for _ in range(layers))
        self.head = Head(HIDDEN, VOCAB)
        with torch.no_grad():  # non-trivial norms and biases
            for p in self.parameters():
                p.add_(0.05 * torch.randn_like(p))

    def context(self, tokens: torch.Tensor) -> dict:
        # a per-batch extra input, to exercise the block_forward hook
        return {"scale": torch.linspace(0.5, 1.5, tokens.shape[1]).unsqueeze(-1)}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        ctx = self.context(tokens)
        for b in self.blocks:
            h = b(h, **ctx)
        return self.head(h)


# plan op -> the backend call that executes it (its channel comes from the op table)
_CALLS = {
    Op.SEND_W: "send", Op.RECV_W: "recv", Op.BCAST_W: "broadcast", Op.SEND_G: "send",
    Op.RECV_G: "recv", Op.REDUCE_G: "reduce", Op.ALLREDUCE_REPLICATED: "all_reduce",
    Op.ALLREDUCE_STATS: "all_reduce", Op.ALLREDUCE_G: "all_reduce",
}


# case keys passed to the engine as they are
_ENGINE_OPTIONS = ("grad_route", "overlap", "recompute", "algo", "prefetch_depth", "mb_per_fetch",
                   "reuse_weights",
                   "grad_wire_dtype", "offload_state", "offload_activations", "replicas")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def finished_norms(patch=setattr) -> list[tuple[float, float]]:
    """From now on (``patch`` as ``record_norms``'s) each step's own-chunk squared norm as the
    step's statistics carry it, beside the one of the accumulator the step unscales and clips."""
    from tawpipe.engine.precision import Precision, squared_norm

    norms: list[tuple[float, float]] = []
    finish = Precision.finish

    def checked(self, step, stats, loss, rep_grad, own_grad):
        norms.append((stats[0].item(), squared_norm(own_grad).item()))
        return finish(self, step, stats, loss, rep_grad, own_grad)

    patch(Precision, "finish", checked)
    return norms


def record_norms(patch=setattr) -> list[int]:
    """From now on (``patch``: ``setattr``, or a test's ``monkeypatch.setattr``) the storage of
    every tensor the engine's ``squared_norm`` reads, in the order read."""
    from tawpipe.engine import precision, storage

    storages: list[int] = []
    norm = precision.squared_norm

    def recorded(t: torch.Tensor) -> torch.Tensor:
        storages.append(t.untyped_storage().data_ptr())
        return norm(t)

    for module in (precision, storage):
        patch(module, "squared_norm", recorded)
    return storages


def host_accumulator(engine: TawPipe) -> int:
    """The storage of the own chunk's gradient accumulator (its parameters' ``.grad`` are views)."""
    (storage,) = {p.grad.untyped_storage().data_ptr() for n, p in engine.named_parameters() if n.startswith("blocks.")}
    return storage


def global_batch(step: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, VOCAB, (n_rows, SEQ + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def adamw(params):
    # one group given as a dict: AdamW(params) itself refuses an empty list, which a rank that
    # trains nothing (all its parameters frozen) is given
    return torch.optim.AdamW([{"params": list(params)}], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6)


def reference_run(model: TinyLM, n_rows: int, steps: int, max_grad_norm: float | None) -> tuple[TinyLM, list[float]]:
    """Single-process training on the whole global batch: the ground truth."""
    return train_alone(copy.deepcopy(model), lambda step: global_batch(step, n_rows), lm_loss, steps, max_grad_norm)


def train_alone(model: nn.Module, batch, loss_fn, steps: int,
                max_grad_norm: float | None) -> tuple[nn.Module, list[float]]:
    """``model`` trained in place by one process with ``adamw`` on ``batch(step)`` for ``steps``
    steps, clipped to ``max_grad_norm``; the model and its losses."""
    opt = adamw([p for p in model.parameters() if p.requires_grad])  # frozen ones are not trained
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return model, losses


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# Where each option the cases name belongs: the model's hooks, or one of the engine's policies.
_MODEL = ("block_forward", "block_context", "materialize", "names", "head_loss")
_POLICIES = {
    "schedule": (SchedulePolicy, {"algo": "algo", "mb_per_fetch": "mb_per_fetch", "prefetch_depth": "prefetch_depth",
                                  "reuse_weights": "reuse_weights", "replicas": "replicas", "grad_route": "grad_route",
                                  "context_parallel": "context_parallel"}),
    "precision": (PrecisionPolicy, {"compute_dtype": "compute_dtype", "grad_wire_dtype": "grad_wire_dtype",
                                    "loss_scale": "loss_scale", "max_grad_norm": "max_grad_norm",
                                    "nonfinite": "nonfinite"}),
    "memory": (MemoryPolicy, {"recompute": "recompute", "offload_state": "offload_state",
                              "offload_activations": "offload_activations", "memory_budget": "budget",
                              "chunked_loss": "chunked_loss", "shape": "shape"}),
    "comm": (CommPolicy, {"comm": "backend", "timeout": "timeout", "overlap": "overlap"}),
}


def make_engine(*model, topology: Topology, micro_batches: int, optimizer=default_optimizer, lr_scheduler=None,
                device=None, **options) -> TawPipe:
    """A TawPipe of ``model`` (ModelParts, or blocks, embed, head and loss_fn), every option the
    tests name put where the engine takes it: in the model's parts or in its policy (a head_loss
    given asks for the chunked loss)."""
    hooks = {k: options.pop(k) for k in _MODEL if k in options}
    parts = dataclasses.replace(model[0], **hooks) if isinstance(model[0], ModelParts) else ModelParts(*model, **hooks)
    if hooks.get("head_loss") is not None:
        options.setdefault("chunked_loss", True)
    policies = {}
    for name, (policy, fields) in _POLICIES.items():
        given = {field: options.pop(key) for key, field in fields.items() if key in options}
        policies[name] = policy(**given)
    if options:
        raise TypeError(f"make_engine: unknown options {sorted(options)}")
    return TawPipe(parts, topology=topology, micro_batches=micro_batches, optimizer=optimizer,
                   lr_scheduler=lr_scheduler, device=device, **policies)


def _engine(model: TinyLM, topo: Topology, acc: int, comm=None, **options) -> TawPipe:
    return make_engine(model.blocks, model.embed, model.head, lm_loss, topology=topo, micro_batches=acc,
                       optimizer=adamw, block_context=model.context, comm=comm or TorchDistComm(topo, timeout=120),
                       **options)


def _graphs(case: dict) -> int:
    """The graphs torch.compile traced in this process so far, where ``case`` compiles (0 where it
    does not: the compiler is not imported for nothing)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] if case.get("compile") else 0


def exactness(rank: int, cases: list[dict]) -> list[dict]:
    """For each case: tawpipe vs the reference after `steps` steps; returns per-case errors."""
    out = []
    world = torch.distributed.get_world_size()
    for case in cases:
        beside = contextlib.ExitStack()
        if case.get("beside"):  # the host's step beside the next iteration, a GPU's, forced on the CPU
            beside.enter_context(mock.patch("tawpipe.engine.update.steps_beside", lambda device: True))
        nodes, acc, layers = case["nodes"], case["acc"], case["layers"]
        steps, dtype = case.get("steps", 3), case.get("dtype", torch.float32)
        clip = case.get("max_grad_norm")
        topo = Topology(nodes=nodes, per_node=world // nodes)
        torch.manual_seed(case.get("seed", 0))
        model = TinyLM(layers, BufferBlock if case.get("block") == "buffers" else MLPBlock)
        if case.get("frozen"):
            freeze(model, case["frozen"])
        ref, ref_losses = reference_run(model, world * acc * MB_ROWS, steps, clip)
        log: list = []
        comm = RecordingComm(comms.create(case.get("comm", "torch"), topo, 120.0, torch.device("cpu")))
        comm.log = log
        eng_model = copy.deepcopy(model)
        options = {k: case[k] for k in _ENGINE_OPTIONS if k in case}
        block_forward = lambda blk, h, **ctx: blk(h, **ctx)  # noqa: E731
        graphs = _graphs(case)
        if case.get("compile"):  # a backend of torch.compile: what a user does for speed
            block_forward = torch.compile(block_forward, backend=case["compile"])
        engine = _engine(eng_model, topo, acc, comm, compute_dtype=dtype, max_grad_norm=clip,
                         block_forward=block_forward, **options)
        setup = [(r.channel, r.op, r.group, r.bytes) for r in log]  # construction: the CHECK only
        log.clear()
        losses = []
        rows = acc * MB_ROWS
        for step in range(steps):
            x, y = global_batch(step, world * rows)
            losses.append(engine.step((x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])))
            if step == 0:
                first_log = list(log)
        ref_params = dict(ref.named_parameters())
        errs = {n: rel_err(p.detach(), ref_params[n].detach()) for n, p in engine.named_parameters()}
        upd = {
            n: rel_err(p.detach() - dict(model.named_parameters())[n].detach(),
                       ref_params[n].detach() - dict(model.named_parameters())[n].detach())
            for n, p in engine.named_parameters()
        }
        plan_comm = [
            (OPS[a.op].channel, _CALLS[a.op], a.peer if a.peer is not None else a.root, a.group, a.bytes)
            for a in engine.plan.actions[rank] if OPS[a.op].is_comm
        ]
        recorded = [(r.channel, r.op, r.peer if r.peer is not None else r.root, r.group, r.bytes) for r in first_log]
        mem = engine.memory_report()
        initial = dict(model.named_parameters())
        frozen_moved = max([(p.detach() - initial[n].detach()).abs().max().item()
                            for n, p in engine.named_parameters() if not initial[n].requires_grad], default=0.0)
        flags = all(p.requires_grad == initial[n].requires_grad for n, p in engine.named_parameters())
        engine.close()
        beside.close()
        out.append({
            "case": case, "rank": rank, "param_err": max(errs.values()), "update_err": max(upd.values()),
            "worst": max(errs, key=errs.get), "losses": losses, "ref_losses": ref_losses,
            "plan_comm": plan_comm, "recorded": recorded, "setup": setup, "memory": mem,
            "own_chunk": engine.own_chunk,
            "finite": all(math.isfinite(v) for v in losses), "skipped": engine.skipped_steps,
            "frozen_moved": frozen_moved, "requires_grad_as_given": flags,
            "graphs": _graphs(case) - graphs,
        })
    return out


def resume(rank: int, directory: str) -> dict:
    """Train 2 steps, checkpoint, train a 3rd; a fresh engine restored from the checkpoint must
    reproduce the 3rd step; the gathered full state dict must equal single-process training."""
    from tawpipe.io.checkpoint import load, save_atomic

    world = torch.distributed.get_world_size()
    topo, acc, layers, rows = Topology(2, world // 2), 2, 5, 2 * MB_ROWS
    torch.manual_seed(0)
    model = TinyLM(layers)
    first = _engine(copy.deepcopy(model), topo, acc)

    def local(step):
        x, y = global_batch(step, world * rows)
        return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]

    for step in range(2):
        first.step(local(step))
    save_atomic(first.state_dict(), f"{directory}/shard{rank}.pt")
    full = first.full_state_dict()
    if rank == 0:
        save_atomic(full, f"{directory}/full.pt")
    loss3 = first.step(local(2))
    params3 = {n: p.detach().clone() for n, p in first.named_parameters()}
    first.close()

    torch.manual_seed(123)  # a differently initialised model: everything must come from the shard
    second = _engine(TinyLM(layers), topo, acc)
    second.load_state_dict(load(f"{directory}/shard{rank}.pt"))
    loss3_resumed = second.step(local(2))
    resumed_err = max(rel_err(p.detach(), params3[n]) for n, p in second.named_parameters())
    second.close()
    out = {"loss3": loss3, "loss3_resumed": loss3_resumed, "resumed_err": resumed_err}
    if rank == 0:
        unsharded = TinyLM(layers)
        unsharded.load_state_dict(load(f"{directory}/full.pt"), strict=True)
        ref, _ = reference_run(model, world * rows, 2, None)
        ref_params = dict(ref.named_parameters())
        out["full_err"] = max(rel_err(p.detach(), ref_params[n].detach()) for n, p in unsharded.named_parameters())
    return out


def disagreements(rank: int, cases: list[dict]) -> list[str]:
    """Build an engine where rank 2 differs from the others in one setting per case; every rank
    must get a ValueError from the construction-time check (no hang, no silent training)."""
    world = torch.distributed.get_world_size()
    out = []
    for case in cases:
        odd = rank == 2
        torch.manual_seed(1 if odd and case.get("seed") else 0)
        model = TinyLM(5 if odd and case.get("layers") else 4, BufferBlock if odd and case.get("buffers") else MLPBlock)
        if odd and case.get("frozen"):
            model.blocks[3].norm.weight.requires_grad_(False)
        options = dict(case.get("options", {})) if odd else {}
        try:
            topo = Topology(1, world) if odd and case.get("topology") else Topology(2, world // 2)
            _engine(model, topo, 4 if odd and case.get("acc") else 2, **options)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append("no error")
    return out


def evaluation(rank: int, case: dict) -> dict:
    """One step, then ``TawPipe.evaluate`` on fresh batches: the loss must equal the reference
    model's after the same step, every byte of it must go through the engine's Comm as the
    evaluation program says, and the next step must be what it would have been without it."""
    from tawpipe.plan.programs import eval_program

    world = torch.distributed.get_world_size()
    topo, acc, layers, rows = Topology(case["nodes"], world // case["nodes"]), case["acc"], case["layers"], MB_ROWS
    torch.manual_seed(case.get("seed", 0))
    model = TinyLM(layers)
    log: list = []
    comm = RecordingComm(TorchDistComm(topo, timeout=120))
    comm.log = log
    engine = _engine(copy.deepcopy(model), topo, acc, comm, **{k: case[k] for k in _ENGINE_OPTIONS if k in case})
    twin = _engine(copy.deepcopy(model), topo, acc, **{k: case[k] for k in _ENGINE_OPTIONS if k in case})
    n = acc * rows

    def local(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = global_batch(step, world * n)
        return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]

    engine.step(local(0))
    twin.step(local(0))
    val = [global_batch(100 + b, world * rows) for b in range(case["val_batches"])]
    # "uneven": rank r evaluates the first 1 + r % val_batches batches of its rows, not all of them
    counts = [1 + r % len(val) if case.get("uneven") else len(val) for r in range(world)]
    mine = [(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]) for x, y in val[:counts[rank]]]
    log.clear()
    loss = engine.evaluate(mine)
    recorded = [(r.channel, r.op, r.root, r.group, r.bytes) for r in log]
    planned = [(OPS[a.op].channel, "broadcast" if a.op is Op.BCAST_W else "all_reduce", a.root, a.group, a.bytes)
               for a in eval_program(engine.plan, "w0")[rank] if OPS[a.op].is_comm]
    after = (engine.step(local(1)), twin.step(local(1)))
    same_step = max(rel_err(p.detach(), q.detach()) for (_, p), (_, q)
                    in zip(engine.named_parameters(), twin.named_parameters()))
    engine.close()
    twin.close()
    ref, _ = reference_run(model, world * n, 1, None)
    with torch.no_grad():  # plain evaluation of the union of every rank's batches: one term per batch
        want = sum(lm_loss(ref(x[r * rows:(r + 1) * rows]), y[r * rows:(r + 1) * rows]).item()
                   for r in range(world) for x, y in val[:counts[r]]) / sum(counts)
    return {"loss": loss, "want": want, "recorded": recorded, "planned": planned, "after": after,
            "same_step": same_step}
