"""The TawPipe engine: executes a Plan on real modules, and nothing else.

Every rank keeps only its own chunk (float32 master, optimizer state, float32 gradient
accumulator) plus a few chunk-sized staging buffers. The plan says which chunk sits in which
buffer at every moment; this module only runs the actions in order, orders work on each buffer by
dataflow (`_Hazards`), and keeps communication on in-order channels so it overlaps compute.

Note on recompute: with ``recompute="chunk"`` (the paper's setting) the forward of a chunk keeps
only the chunk's input activation, and its backward re-runs the forward with gradients enabled on
the weights then resident in the plan's buffer. With ``recompute="none"`` the forward keeps its
graph; tensors it saves that alias its weight buffer are stored as (offset, size, stride) and
re-read at backward time from the buffer the plan names for that backward, which holds the same
chunk by then. No weight copy is kept and no saved tensor points into a buffer being refilled.
"""

from __future__ import annotations

import copy
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

from . import ops
from .comm.base import Channel, Comm, Handle
from .ops import ShardLayout
from .plan import COMM_OPS, Action, Op, Plan, build_plan

# Weight prefetches and gradient routing run on separate in-order channels (each with its own
# process groups), so a prefetch never queues behind gradient traffic. ACC_G runs on the gradient
# channel right after the receive it consumes: the compute side never waits for gradients.
_WEIGHT_OPS = frozenset({Op.SEND_W, Op.RECV_W, Op.BCAST_W})
_GRAD_OPS = frozenset({Op.REDUCE_G, Op.SEND_G, Op.RECV_G, Op.ACC_G})
from .topology import Topology

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
BlockForward = Callable[..., torch.Tensor]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def default_optimizer(params: list[nn.Parameter], lr: float = 1e-3) -> torch.optim.Optimizer:
    """AdamW as in the paper: lr 1e-3, betas (0.9, 0.95), weight decay 0.1 on matrices only."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )


def _default_block_forward(block: nn.Module, hidden: torch.Tensor, **ctx: Any) -> torch.Tensor:
    return block(hidden, **ctx)


class _ChunkRunner(nn.Module):
    """A stack of blocks run through the user's hook; instantiated once per chunk shape on the
    meta device, its parameters are always supplied from a staging buffer."""

    def __init__(self, blocks: nn.ModuleList, block_forward: BlockForward) -> None:
        super().__init__()
        self.blocks = blocks
        self._block_forward = block_forward

    def forward(self, hidden: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        for block in self.blocks:
            hidden = self._block_forward(block, hidden, **ctx)
        return hidden


def _unique_params(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for prefix, m in modules:
        for name, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{prefix}.{name}", p))
    return out


def _signature(block: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()]


class _Hazards:
    """Last writer and readers-since of every named buffer: the dataflow order of the plan."""

    def __init__(self) -> None:
        self.writer: dict[str, Handle] = {}
        self.readers: dict[str, list[Handle]] = {}

    def deps(self, reads: Sequence[str], writes: Sequence[str]) -> list[Handle]:
        out = [self.writer[b] for b in (*reads, *writes) if b in self.writer]
        for b in writes:
            out.extend(self.readers.get(b, ()))
        return out

    def record(self, handle: Handle, reads: Sequence[str], writes: Sequence[str]) -> None:
        for b in writes:
            self.writer[b] = handle
            self.readers[b] = []
        for b in reads:
            if b not in writes:
                self.readers.setdefault(b, []).append(handle)


def _reads_writes(a: Action) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Buffers an action reads and writes, per the contract in plan.py."""
    op, buf = a.op, a.buf
    if op is Op.F or op in (Op.SEND_W, Op.SEND_G, Op.ACC_G):
        return (buf,), ()
    if op is Op.B:
        return ((buf, a.grad_buf) if a.accumulate else (buf,)), (a.grad_buf,)
    if op in (Op.LOAD_W, Op.RECV_W, Op.RECV_G):
        return (), (buf,)
    if op is Op.BCAST_W:
        return ((buf,), ()) if a.root == a.rank else ((), (buf,))
    if op is Op.REDUCE_G:
        return (buf,), ((buf,) if a.root == a.rank else ())
    return (), ()


def weights_saved_by_reference(
    buf: torch.Tensor, backward_buf: Callable[[], torch.Tensor]
) -> torch.autograd.graph.saved_tensors_hooks:
    """Autograd hooks under which tensors saved for backward that alias `buf` are stored as
    (offset, size, stride) and read back from `backward_buf()` when the backward runs."""
    base, ptr = buf.storage_offset(), buf.untyped_storage().data_ptr()

    def pack(t: torch.Tensor):
        if t.device == buf.device and t.untyped_storage().data_ptr() == ptr:
            return ("weights", t.storage_offset() - base, t.size(), t.stride())
        return t

    def unpack(saved):
        if isinstance(saved, tuple) and saved and saved[0] == "weights":
            _, offset, size, stride = saved
            b = backward_buf()
            return b.as_strided(size, stride, b.storage_offset() + offset)
        return saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@dataclass(frozen=True)
class MemoryReport:
    """Persistent per-rank bytes, by kind. `model_bytes_16` is 16 bytes x decoder parameters / N."""

    master: int
    optimizer: int
    grad_accumulator: int
    staging: dict[str, int]
    replicated: int
    decoder_params: int
    world_size: int

    @property
    def persistent(self) -> int:
        return self.master + self.optimizer + self.grad_accumulator

    @property
    def sharded_target(self) -> float:
        return 16.0 * self.decoder_params / self.world_size

    def __str__(self) -> str:
        mb = 1 / 2**20
        st = ", ".join(f"{k} {v * mb:.2f}" for k, v in sorted(self.staging.items()))
        return (
            f"master {self.master * mb:.2f} MiB + optimizer {self.optimizer * mb:.2f} + grad acc "
            f"{self.grad_accumulator * mb:.2f} = {self.persistent * mb:.2f} MiB "
            f"(16*Psi/N = {self.sharded_target * mb:.2f}); staging: {st} MiB; "
            f"replicated {self.replicated * mb:.2f} MiB"
        )


class TawPipe:
    """Topology-aware weight pipeline training of a stack of identical blocks.

    Each rank runs the whole model on its own micro-batches; chunk weights and gradients move
    between ranks as the plan says. `step(batch)` equals one step of single-device training on the
    concatenation of every rank's micro-batches (mean loss, same optimizer).
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        embed: nn.Module,
        head: nn.Module,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        topology: Topology,
        micro_batches: int,
        optimizer: OptimizerFactory = default_optimizer,
        lr_scheduler: SchedulerFactory | None = None,
        compute_dtype: torch.dtype = torch.float32,
        max_grad_norm: float | None = None,
        block_forward: BlockForward | None = None,
        block_context: Callable[[torch.Tensor], dict[str, Any]] | None = None,
        comm: Comm | None = None,
        device: torch.device | str | None = None,
        grad_route: str = "rail",
        overlap: bool = True,
        loss_scale: float | str | None = "auto",
        recompute: str = "chunk",
        timeout: float | None = None,
        names: tuple[str, str, str] = ("embed", "blocks", "head"),
    ) -> None:
        blocks = list(blocks)
        if not blocks:
            raise ValueError("blocks is empty: pass the decoder layers as a sequence of nn.Modules")
        sig = _signature(blocks[0])
        for i, b in enumerate(blocks[1:], 1):
            if _signature(b) != sig:
                raise ValueError(
                    f"block {i} differs in structure from block 0 (parameter names, shapes or "
                    "dtypes); tawpipe chunks a stack of identical blocks"
                )
        if not sig:
            raise ValueError("the blocks have no parameters: nothing to shard")
        if recompute not in ("chunk", "none"):
            raise ValueError(f"recompute must be 'chunk' or 'none', got {recompute!r}")
        if compute_dtype not in _DTYPES:
            raise ValueError(f"compute_dtype {compute_dtype} unsupported; use one of {_DTYPES}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 (or None), got {max_grad_norm}")
        if loss_scale == "auto":
            loss_scale = "dynamic" if compute_dtype == torch.float16 else None
        if not (loss_scale is None or loss_scale == "dynamic" or (isinstance(loss_scale, (int, float)) and loss_scale > 0)):
            raise ValueError(f"loss_scale must be None, 'dynamic', 'auto' or a positive number, got {loss_scale!r}")
        self.timeout = float(timeout if timeout is not None else os.environ.get("TAWPIPE_TIMEOUT", 300))
        self.device = torch.device(device) if device is not None else next(embed.parameters()).device
        self.topology = topology
        self.compute_dtype = compute_dtype
        self.max_grad_norm = max_grad_norm
        self.overlap = overlap
        self.recompute = recompute
        self.loss_fn = loss_fn
        self.block_context = block_context
        self.names = names
        self._block_forward = block_forward or _default_block_forward
        self._embed, self._head = embed, head

        # Replicated modules: float32 masters on every rank; gradients all-reduced once per step
        # together with the loss sum (one flat buffer, one collective).
        self._rep = _unique_params([(names[0], embed), (names[2], head)])
        self._rep_layout = ShardLayout.from_tensors([p for _, p in self._rep], align=1)
        self._rep_flat = torch.zeros(self._rep_layout.numel + 1, dtype=torch.float32, device=self.device)

        block_numel = sum(p.numel() for p in blocks[0].parameters())
        self.plan: Plan = build_plan(
            topology, len(blocks), micro_batches, algo="tawpipe", grad_route=grad_route,
            layer_numel=block_numel, weight_bytes=torch.empty((), dtype=compute_dtype).element_size(),
            grad_bytes=4, replicated_numel=self._rep_flat.numel(),
        )
        self.micro_batches = micro_batches
        # Communication starts only now, after every check above and the (pure) plan passed.
        if comm is None:
            from .comm.torch_dist import TorchDistComm

            comm = TorchDistComm(topology, self.timeout)
        if comm.world_size != topology.world_size:
            raise ValueError(
                f"the comm backend has {comm.world_size} ranks but the topology {topology.world_size}"
            )
        self.rank = comm.rank
        self.num_chunks = len(self.plan.chunk_layers)
        self.own_chunk = self.plan.owner.index(self.rank)
        self.decoder_params = block_numel * len(blocks)

        # Chunk layouts and meta templates, one per chunk shape (number of layers).
        self._layouts: dict[int, ShardLayout] = {}
        self._runners: dict[int, _ChunkRunner] = {}
        for start, stop in self.plan.chunk_layers:
            n = stop - start
            if n not in self._layouts:
                stack = nn.ModuleList(blocks[start:stop])
                self._layouts[n] = ShardLayout.from_module(stack, align=1)
                self._runners[n] = _ChunkRunner(copy.deepcopy(stack).to("meta"), self._block_forward)

        # Device-bound storage: the own chunk's float32 master and gradient accumulator, as flat
        # buffers whose views are the optimizer's parameters and their .grad.
        start, stop = self.plan.chunk_layers[self.own_chunk]
        own_layout = self._layouts[stop - start]
        own_modules = nn.ModuleList(blocks[start:stop])
        self._master = own_layout.new_flat(torch.float32, self.device)
        own_layout.pack([p.detach() for p in own_modules.parameters()], self._master)
        self._grad_acc = torch.zeros_like(self._master)
        self._own_params: list[tuple[str, nn.Parameter]] = []
        for (name, _), view, gview in zip(
            own_modules.named_parameters(), own_layout.views(self._master), own_layout.views(self._grad_acc)
        ):
            idx, rest = name.split(".", 1)
            p = nn.Parameter(view, requires_grad=True)
            p.grad = gview
            self._own_params.append((f"{names[1]}.{start + int(idx)}.{rest}", p))

        self.optimizer = optimizer([p for _, p in self._own_params] + [p for _, p in self._rep])
        self.scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self._scale = 2.0**16 if loss_scale == "dynamic" else float(loss_scale or 1.0)
        self._dynamic = loss_scale == "dynamic"
        self._good_steps = 0
        self.skipped_steps = 0

        # Staging buffers named by the plan: weights in compute dtype, gradients in float32.
        max_numel = max(l.numel for l in self._layouts.values())
        names_used = {a.buf for a in self.plan.actions[self.rank] if a.buf} | {
            a.grad_buf for a in self.plan.actions[self.rank] if a.grad_buf
        }
        self._bufs = {
            b: torch.empty(max_numel, dtype=compute_dtype if b.startswith("w") else torch.float32, device=self.device)
            for b in sorted(names_used)
        }
        self._comm = comm
        self._grad_comm = comm.channel_comm("grads")
        self._rep_comm = comm.channel_comm("replicated")
        self._step_comm = comm.channel_comm("step")
        self._channels = {
            name: Channel(name, self.timeout, self.device) for name in ("weights", "grads", "replicated")
        }

    # ------------------------------------------------------------------ public API

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One iteration over this rank's micro-batches; returns the mean loss over all ranks."""
        inputs, targets = batch
        acc = self.micro_batches
        if inputs.shape[0] % acc or inputs.shape[0] == 0:
            raise ValueError(
                f"batch has {inputs.shape[0]} rows, not a positive multiple of micro_batches={acc}"
            )
        if inputs.shape != targets.shape[: inputs.dim()]:
            raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in shape")
        self._mb_in = [t.to(self.device) for t in inputs.chunk(acc)]
        self._mb_tgt = [t.to(self.device) for t in targets.chunk(acc)]
        self._ctx = [self.block_context(t) if self.block_context else {} for t in self._mb_in]
        self._x: dict[tuple[int, int], torch.Tensor] = {}
        self._dy: dict[tuple[int, int], torch.Tensor] = {}
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self._rep_handle: Handle | None = None
        hazards = _Hazards()
        n_total = self.topology.world_size * acc
        self._grad_scale = self._scale / n_total
        try:
            for a in self.plan.actions[self.rank]:
                reads, writes = _reads_writes(a)
                deps = hazards.deps(reads, writes)
                if a.op in COMM_OPS or a.op is Op.ACC_G:
                    h = self._submit(a, deps)
                    if not self.overlap:
                        h.wait(self.timeout)
                else:
                    for d in deps:
                        d.wait(self.timeout)
                    self._compute(a)
                    h = self._compute_done(a)
                hazards.record(h, reads, writes)
        except BaseException:
            self.close()  # queued work refers to this step's buffers: stop the channels
            raise
        return self._last_loss

    def memory_report(self) -> MemoryReport:
        opt = sum(
            t.numel() * t.element_size()
            for _, p in self._own_params
            for t in self.optimizer.state.get(p, {}).values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        return MemoryReport(
            master=self._master.numel() * 4,
            optimizer=opt,
            grad_accumulator=self._grad_acc.numel() * 4,
            staging={k: v.numel() * v.element_size() for k, v in self._bufs.items()},
            replicated=sum(p.numel() * p.element_size() for _, p in self._rep),
            decoder_params=self.decoder_params,
            world_size=self.topology.world_size,
        )

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters (own chunk and replicated) under the original names."""
        return self._own_params + self._rep

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: own chunk master, replicated masters, optimizer and scaler state."""
        return {
            "rank": self.rank,
            "chunk": self.own_chunk,
            "params": {n: p.detach().clone() for n, p in self.named_parameters()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "loss_scale": self._scale,
            "good_steps": self._good_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("chunk") != self.own_chunk:
            raise ValueError(
                f"shard holds chunk {state.get('chunk')} but rank {self.rank} owns chunk "
                f"{self.own_chunk}: load each rank's own shard, on the same topology"
            )
        own = dict(self.named_parameters())
        if set(state["params"]) != set(own):
            raise ValueError("shard parameter names differ from this engine's: different model?")
        with torch.no_grad():
            for n, t in state["params"].items():
                own[n].copy_(t)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._scale = float(state["loss_scale"])
        self._good_steps = int(state["good_steps"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gather every chunk on rank 0 under the original parameter names (None elsewhere)."""
        comm = self._comm.channel_comm("step")
        out: dict[str, torch.Tensor] | None = {} if self.rank == 0 else None
        for k, owner in enumerate(self.plan.owner):
            start, stop = self.plan.chunk_layers[k]
            layout = self._layouts[stop - start]
            if self.rank == 0:
                flat = self._master if owner == 0 else torch.empty(layout.numel, device=self.device)
                if owner != 0:
                    comm.recv(flat, owner)
                for name, view in zip(layout.names, layout.views(flat)):
                    idx, rest = name.split(".", 1)
                    out[f"{self.names[1]}.{start + int(idx)}.{rest}"] = view.detach().clone().cpu()
            elif owner == self.rank:
                comm.send(self._master, 0)
        if out is not None:
            for mod_name, module in ((self.names[0], self._embed), (self.names[2], self._head)):
                for n, p in module.named_parameters(remove_duplicate=False):
                    out[f"{mod_name}.{n}"] = p.detach().clone().cpu()
        return out

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()

    # ------------------------------------------------------------------ execution

    def _tensor(self, a: Action, buf: str | None = None) -> torch.Tensor:
        start, stop = self.plan.chunk_layers[a.chunk]
        return self._bufs[buf or a.buf][: self._layouts[stop - start].numel]

    def _submit(self, a: Action, deps: list[Handle]) -> Handle:
        comm, label = self._comm, f"{a.op.value} chunk {a.chunk} slot {a.slot}"
        if a.op is Op.ALLREDUCE_REPLICATED:
            self._pack_replicated()
            deps = [*deps, self._compute_done(a)]  # on CUDA: the pack's event on the compute stream
            flat, group, rep = self._rep_flat, a.group, self._rep_comm
            self._rep_handle = self._channels["replicated"].submit(lambda: rep.all_reduce(flat, group), deps, label)
            return self._rep_handle
        t = self._tensor(a)
        if a.op in _GRAD_OPS:
            comm, channel = self._grad_comm, self._channels["grads"]
        elif a.op in _WEIGHT_OPS:
            channel = self._channels["weights"]
        else:
            raise ValueError(f"engine cannot execute communication op {a.op}")
        if a.op is Op.ACC_G:
            acc = self._grad_acc
            fn = lambda: acc.add_(t)  # noqa: E731
        elif a.op in (Op.SEND_W, Op.SEND_G):
            fn = lambda: comm.send(t, a.peer)  # noqa: E731
        elif a.op in (Op.RECV_W, Op.RECV_G):
            fn = lambda: comm.recv(t, a.peer)  # noqa: E731
        elif a.op is Op.BCAST_W:
            fn = lambda: comm.broadcast(t, a.root, a.group)  # noqa: E731
        else:
            fn = lambda: comm.reduce(t, a.root, a.group)  # noqa: E731
        return channel.submit(fn, deps, label)

    def _compute_done(self, a: Action) -> Handle:
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            return Handle.completed(ev, a.op.value)
        return Handle.completed(label=a.op.value)

    @torch.no_grad()
    def _compute(self, a: Action) -> None:
        if a.op is Op.F:
            self._forward(a)
        elif a.op is Op.B:
            self._backward(a)
        elif a.op is Op.LOAD_W:
            self._tensor(a).copy_(self._master)
        elif a.op is Op.STEP:
            self._step()
        else:
            raise ValueError(f"engine cannot execute compute op {a.op}")

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _run_chunk(self, a: Action, x: torch.Tensor, leaves: list[torch.Tensor]) -> torch.Tensor:
        start, stop = self.plan.chunk_layers[a.chunk]
        n = stop - start
        params = {f"blocks.{name}": t for name, t in zip(self._layouts[n].names, leaves)}
        return functional_call(self._runners[n], params, (x, self._ctx[a.mb]))

    def _forward(self, a: Action) -> None:
        k, m = a.chunk, a.mb
        if k == 0:
            self._x[(0, m)] = self._embed(self._mb_in[m]).to(self.compute_dtype)
        x = self._x[(k, m)]
        start, stop = self.plan.chunk_layers[k]
        views = self._layouts[stop - start].views(self._tensor(a))
        if self.recompute == "none":
            y = self._forward_keep_graph(a, x, views)
        else:
            y = self._run_chunk(a, x, views)
        if k + 1 < self.num_chunks:
            self._x[(k + 1, m)] = y.detach()
            return
        # Last chunk: head and loss now, so the backward of this micro-batch can start next slot.
        with torch.enable_grad():
            y = y.detach().requires_grad_()
            with self._autocast():
                loss = self.loss_fn(self._head(y), self._mb_tgt[m])
            (loss.float() * self._grad_scale).backward()
        self._loss_sum += loss.detach().float()
        self._dy[(k, m)] = y.grad

    def _forward_keep_graph(self, a: Action, x: torch.Tensor, views: list[torch.Tensor]) -> torch.Tensor:
        x = x.detach().requires_grad_()
        leaves = [v.detach().requires_grad_() for v in views]
        with torch.enable_grad(), weights_saved_by_reference(self._bufs[a.buf], lambda: self._backward_buf):
            y = self._run_chunk(a, x, leaves)
        self._graphs[(a.chunk, a.mb)] = (x, y, leaves)
        return y

    def _backward(self, a: Action) -> None:
        k, m = a.chunk, a.mb
        start, stop = self.plan.chunk_layers[k]
        layout = self._layouts[stop - start]
        if self.recompute == "none":
            x, y, leaves = self._graphs.pop((k, m))
            self._x.pop((k, m))
            self._backward_buf = self._bufs[a.buf]
        else:
            x = self._x.pop((k, m)).detach().requires_grad_()
            leaves = [v.detach().requires_grad_() for v in layout.views(self._tensor(a))]
            with torch.enable_grad():
                y = self._run_chunk(a, x, leaves)
        with torch.enable_grad():
            torch.autograd.backward(y, self._dy.pop((k, m)))
        grads = [l.grad if l.grad is not None else torch.zeros_like(l) for l in leaves]
        gbuf = self._tensor(a, a.grad_buf)
        if a.accumulate:
            ops.pack_accumulate(grads, gbuf, list(layout.offsets), 1.0)
        else:
            ops.pack(grads, gbuf, list(layout.offsets))
        if k > 0:
            self._dy[(k - 1, m)] = x.grad
            return
        with torch.enable_grad():
            e = self._embed(self._mb_in[m]).to(self.compute_dtype)
            if e.requires_grad:
                e.backward(x.grad)

    def _pack_replicated(self) -> None:
        """Replicated gradients and this rank's loss sum into one flat float32 buffer."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self._rep]
        ops.pack(grads, self._rep_flat, list(self._rep_layout.offsets))
        self._rep_flat[-1] = self._loss_sum

    def _step(self) -> None:
        self._channels["weights"].drain()
        self._channels["grads"].drain()
        self._rep_handle.wait(self.timeout)
        flat = self._rep_flat
        n_total = self.topology.world_size * self.micro_batches
        self._last_loss = flat[-1].item() / n_total
        rep_params = [p for _, p in self._rep]
        for p in rep_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ops.unpack(flat[:-1], [p.grad for p in rep_params], list(self._rep_layout.offsets))
        inv = 1.0 / self._scale
        if inv != 1.0:
            self._grad_acc.mul_(inv)
            torch._foreach_mul_([p.grad for p in rep_params], inv)
        clip = self.max_grad_norm is not None
        if clip or self._dynamic:
            # Each chunk has one owner, so the owners' squared norms add up to the global one;
            # replicated gradients are identical everywhere and count once.
            own_sq = self._grad_acc.double().square().sum()
            rep_sq = sum(p.grad.double().square().sum() for p in rep_params)
            stats = torch.stack([own_sq, (~torch.isfinite(own_sq)).double()])
            self._step_comm.all_reduce(stats, tuple(range(self.topology.world_size)))
            total_sq = stats[0] + rep_sq
            found_inf = bool(stats[1].item() > 0) or not math.isfinite(total_sq.item())
        else:
            found_inf = False
        if found_inf and self._dynamic:
            self._scale /= 2.0
            self._good_steps = 0
            self.skipped_steps += 1
        else:
            if clip:
                coef = self.max_grad_norm / (math.sqrt(total_sq.item()) + 1e-6)
                if coef < 1.0:
                    self._grad_acc.mul_(coef)
                    torch._foreach_mul_([p.grad for p in rep_params], coef)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            if self._dynamic:
                self._good_steps += 1
                if self._good_steps % 1000 == 0:
                    self._scale *= 2.0
        self._grad_acc.zero_()
        for p in rep_params:
            p.grad.zero_()
