"""The TawPipe engine: builds the plan, stores this rank's share, and executes the plan.

One ``step`` equals one step of single-device training on the concatenation of every rank's
micro-batches (mean loss, same optimizer). The parts, one concept each (design §6):

* ``tawpipe.plan.schedule``: the plan of one iteration (pure data, proven by ``tawpipe.plan.verify``);
* ``storage``: the own chunk, the replicated modules and the staging buffers;
* ``compute``: forward and backward of one chunk for one micro-batch;
* ``precision``: loss scaling, clipping and non-finite steps;
* ``tawpipe.runtime.executor``: runs action lists on the compute thread and the comm channels.

This module wires them together and turns each action into the call that performs it; it makes
no scheduling decision of its own. Everything the engine does with other ranks is a program of
the op table run on its own channels: the iteration, the setup CHECK, the gather, a validation
pass and the agreement rows of a checkpoint (``gather_rows``). Files are written by
``tawpipe.io`` through the public methods here.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from ..cost.memory import AUTO
from ..models.parts import (
    PART_NAMES,
    Materialize,
    block_param_name,
    model_signature,
    param_signature,
    unique_params,
)
from ..ops import SUPPORTED_DTYPES
from ..plan.actions import OPS, QUEUES, Action, BufKind, Channel, Op, buf_kind
from ..plan.plan import Plan
from ..plan.programs import eval_program, gather_program, setup_program
from ..plan.schedule import check_replicas, compute_actions
from ..plan.topology import Topology
from ..plan.verify import verify
from ..runtime.comm.base import P2P, Comm
from ..runtime.executor import Executor, Messages
from ..runtime.timeout import default_timeout
from . import fingerprint
from .auto import engine_plan
from .compute import ChunkCompute, EvalState, StepState
from .precision import Precision
from .storage import ChunkStorage, MemoryReport

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
BlockForward = Callable[..., torch.Tensor]


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


def _check_blocks(blocks: list[nn.Module]) -> None:
    if not blocks:
        raise ValueError("blocks is empty: pass the decoder layers as a sequence of nn.Modules")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"blocks[{i}] is a {type(b).__name__}, not an nn.Module")
    seen: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            j = seen.setdefault(id(p), i)
            if j != i:
                raise ValueError(
                    f"blocks {j} and {i} share parameters (the same module passed twice?): tawpipe "
                    "gives every block its own weights; pass distinct blocks"
                )
    sig = param_signature(blocks[0].named_parameters())
    for i, b in enumerate(blocks[1:], 1):
        if param_signature(b.named_parameters()) != sig:
            raise ValueError(
                f"block {i} differs in structure from block 0 (parameter names, shapes or dtypes); "
                "tawpipe chunks a stack of identical blocks"
            )
    if not sig:
        raise ValueError("the blocks have no parameters: nothing to shard")


def _check_callables(**kwargs: Any) -> None:
    for name, value in kwargs.items():
        if name in ("embed", "head"):
            if not isinstance(value, nn.Module) or not list(value.parameters()):
                raise TypeError(f"{name} must be an nn.Module with parameters, got {type(value).__name__}")
        elif value is not None and not callable(value):
            raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        elif value is None and name in ("loss_fn", "optimizer"):
            raise TypeError(f"{name} is required")


def _check_options(topology: Topology, comm: Comm | str | None, offload: str | None, timeout: float | None,
                   names: tuple[str, str, str], recompute: str, compute_dtype: torch.dtype,
                   grad_wire_dtype: torch.dtype) -> None:
    """The engine's plain options, checked before anything is built or sent."""
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a tawpipe.Topology, got {type(topology).__name__}")
    if not (comm is None or isinstance(comm, Comm) or comm in ("torch", "nccl-native")):
        raise TypeError(f"comm must be a tawpipe.runtime.comm.Comm, 'torch' (torch.distributed, the default) or "
                        f"'nccl-native', got {comm!r}")
    if offload not in (None, "host"):
        raise ValueError(f"offload must be None or 'host', got {offload!r}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not (isinstance(names, tuple) and len(names) == 3 and all(isinstance(n, str) and n for n in names)):
        raise ValueError(f"names must be three non-empty strings (embed, blocks, head), got {names!r}")
    if recompute not in ("chunk", "none"):
        raise ValueError(f"recompute must be 'chunk' or 'none', got {recompute!r}")
    if compute_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"compute_dtype {compute_dtype} unsupported; use one of {SUPPORTED_DTYPES}")
    if grad_wire_dtype not in (torch.float32, compute_dtype):
        raise ValueError(f"grad_wire_dtype must be torch.float32 or the compute dtype {compute_dtype}, "
                         f"got {grad_wire_dtype}")


# A plan holds a forward and a backward of every chunk for every micro-batch on every rank of a
# replica (2 x (N/R)^2 x micro_batches actions) plus the transfers: past a million of the former
# it takes minutes and gigabytes to build (one replica's ranks' actions are built).
MAX_PLAN_COMPUTE_ACTIONS = 1_000_000
# Up to this many, the engine proves its plan before it connects (about 1.5 s of one core at the
# most); beyond, it trusts the schedules' tests and ``tawpipe plan``, which proves what it prints.
VERIFY_COMPUTE_ACTIONS = 50_000


def _check_micro_batches(topology: Topology, micro_batches: Any, replicas: Any) -> None:
    """micro_batches: a positive integer small enough that the plan can be built (checked before
    ``build_plan`` allocates anything: a huge value would end in a MemoryError deep inside it)."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer (micro-batches per rank and step), "
                         f"got {micro_batches!r}")
    n = check_replicas(topology, replicas)
    most = max(1, MAX_PLAN_COMPUTE_ACTIONS // compute_actions(topology, 1, replicas))
    if micro_batches > most:
        raise ValueError(
            f"micro_batches={micro_batches} is too large: on {n} rank(s) the plan would hold at least "
            f"{compute_actions(topology, micro_batches, replicas):,} actions (2 x ranks per replica^2 x micro_batches forwards and backwards = "
            f"2 x {n}^2 x {micro_batches}), more than the {MAX_PLAN_COMPUTE_ACTIONS:,} tawpipe builds in reasonable "
            f"time and memory; lower micro_batches to at most {most} (and put more rows into each micro-batch "
            "instead), or use more replicas"
        )


def _available_devices() -> list[str]:
    out = ["cpu"]
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is not None:
        out += [f"{acc.type}:{i}" for i in range(torch.accelerator.device_count())]
    return out


def _resolve_device(device: Any) -> torch.device:
    """``device`` as a torch.device this process can use (an accelerator with its index), or a
    ValueError naming it and the devices that are available."""
    available = ", ".join(_available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r} is not a device: pass a torch.device or a name such as 'cpu' or "
                         f"'cuda:0'; available here: {available}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ValueError(f"device={device!r}: the engine cannot train on the meta device (it holds no data); "
                         f"pass the device to train on; available here: {available}")
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != dev.type:
        raise ValueError(f"device={device!r} is not available: torch {torch.__version__} in this process sees no "
                         f"{dev.type} device; available here: {available}")
    count = torch.accelerator.device_count()
    if dev.index is None:
        return torch.device(dev.type, torch.accelerator.current_device_index())
    if dev.index >= count:
        raise ValueError(f"device={device!r} is not available: this process sees {count} {dev.type} device(s); "
                         f"available here: {available}")
    return dev


def _check_replicated(embed: nn.Module, head: nn.Module, names: tuple[str, str, str],
                      device: torch.device | None, asked: Any = None) -> None:
    """embed and head are real float32 tensors on the engine's device (``device``; None: not
    known yet, the meta check only; ``asked``: the device argument). Run before anything is built
    or sent."""
    shown = device if device is not None else asked
    where = f"the engine's device ({shown})" if shown is not None else "the engine's device"
    for part, module in ((names[0], embed), (names[2], head)):
        for n, p in module.named_parameters():
            if p.is_meta:
                raise ValueError(
                    f"{part} parameter {n!r} is on the meta device: the embedding and head are replicated on every "
                    f"rank and must be real (materialised) float32 tensors on {where}; build them outside "
                    f"torch.device('meta'), or materialise them first ({part}.to_empty(device=...), then initialise "
                    "or load their weights). Only blocks may stay on meta (with materialize=)"
                )
            if device is not None and (p.dtype != torch.float32 or p.device != device):
                raise ValueError(
                    f"{part} parameter {n!r} is {p.dtype} on {p.device}, but the embedding and head must be float32 "
                    f"on {where}: move them there first ({part}.to({str(device)!r}, torch.float32))"
                )


def _find_vocab(embed: nn.Module) -> int | None:
    """The number of token ids the first nn.Embedding inside ``embed`` takes (None: there is none)."""
    return next((m.num_embeddings for m in embed.modules() if isinstance(m, nn.Embedding)), None)


class TawPipe:
    """Topology-aware weight pipeline training of a stack of identical blocks.

    Each rank runs the whole model on its own micro-batches; chunk weights and gradients move
    between ranks as the plan says. ``algo="weipipe"`` runs the paper's baseline on the same
    machinery. ``prefetch_depth`` fetches weights that many slots ahead; ``"resident"`` (with
    ``reuse_weights``) goes far enough that every fetched chunk stays (``schedule.resident_depth``).
    ``mb_per_fetch`` runs each resident chunk for that many micro-batches (one fetch and one
    gradient route per group of micro-batches); ``reuse_weights`` skips the fetch of a chunk still
    in a staging buffer (fewer bytes than the paper's schedule, same memory). Each of the three
    left ``"auto"`` (the default) is chosen by the cost model: the fewest inter-node bytes whose
    memory fits ``memory_budget`` bytes per rank (default: the free memory, design §7.3). The
    properties ``mb_per_fetch``, ``prefetch_depth`` and ``reuse_weights`` hold the values, and
    ``auto_reason`` says why. The engine cannot see the activations before its first batch: where
    they are large, give ``memory_budget`` without them, or the options. ``grad_wire_dtype``
    (float32 or the compute dtype) is the dtype gradients travel in, always accumulated in float32
    by their owner. Blocks may live on the meta device: ``materialize(block, layer_index)`` then
    gives each rank its own chunk's real blocks.
    ``offload="host"`` keeps the own chunk's master, gradient accumulator and optimizer state in
    pinned host memory, streamed through two staging buffers (``tawpipe.engine.offload``).
    ``replicas`` R splits the nodes into R replicas of whole nodes, each a pipeline over its N/R
    ranks; a chunk's R owners add their gradients once per step (design §3.5). The step is still
    one step on every rank's micro-batches; R > 1 needs ``comm="torch"`` (the default).
    ``head_loss(head, hidden, targets)``, if given, replaces ``loss_fn(head(hidden), targets)``:
    a head and loss that never hold the whole logits (``tawpipe.models.llama.chunked_head_loss``).
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
        comm: Comm | str | None = None,
        device: torch.device | str | None = None,
        algo: str = "tawpipe",
        grad_route: str = "rail",
        prefetch_depth: int | str = AUTO,
        mb_per_fetch: int | str = AUTO,
        reuse_weights: bool | str = AUTO,
        memory_budget: float | None = None,
        grad_wire_dtype: torch.dtype = torch.float32,
        overlap: bool = True,
        loss_scale: float | str | None = "auto",
        nonfinite: str = "skip",
        recompute: str = "chunk",
        timeout: float | None = None,
        names: tuple[str, str, str] = PART_NAMES,
        materialize: Materialize | None = None,
        offload: str | None = None,
        replicas: int = 1,
        head_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        blocks = list(blocks)
        _check_blocks(blocks)
        _check_callables(embed=embed, head=head, loss_fn=loss_fn, optimizer=optimizer, lr_scheduler=lr_scheduler,
                         block_forward=block_forward, block_context=block_context, materialize=materialize,
                         head_loss=head_loss)
        _check_options(topology, comm, offload, timeout, names, recompute, compute_dtype, grad_wire_dtype)
        _check_micro_batches(topology, micro_batches, replicas)
        if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                          or not memory_budget > 0):
            raise ValueError(f"memory_budget must be None (measure the free memory) or bytes per rank > 0, "
                             f"got {memory_budget!r}")
        if replicas > 1 and not (comm is None or comm == "torch" or isinstance(comm, Comm)):
            raise ValueError(f"replicas={replicas} needs comm='torch' (NCCL through torch.distributed on GPUs): the "
                             f"{comm!r} backend has no communicators across replicas yet")
        if loss_scale == "auto":
            loss_scale = "dynamic" if compute_dtype == torch.float16 else None
        self.precision = Precision(loss_scale, max_grad_norm, nonfinite)
        self.timeout = float(timeout) if timeout is not None else default_timeout()
        _check_replicated(embed, head, names, None, device)  # meta first: it would make the default device meta
        self.device = _resolve_device(device if device is not None else next(embed.parameters()).device)
        _check_replicated(embed, head, names, self.device)
        self.topology, self.micro_batches, self.names = topology, micro_batches, names
        self.block_context = block_context
        replicated = unique_params([(names[0], embed), (names[2], head)])
        self.plan: Plan
        self.auto_reason: str | None  # why "auto" chose the options it did; None: all were given
        self.plan, self.auto_reason = engine_plan(
            topology, len(blocks), micro_batches, device=self.device, budget=memory_budget, algo=algo,
            grad_route=grad_route, prefetch_depth=prefetch_depth, mb_per_fetch=mb_per_fetch,
            reuse_weights=reuse_weights, layer_numel=sum(p.numel() for p in blocks[0].parameters()),
            weight_bytes=torch.empty((), dtype=compute_dtype).element_size(),
            grad_bytes=torch.empty((), dtype=grad_wire_dtype).element_size(),
            replicated_numel=sum(p.numel() for _, p in replicated) + 1,  # + the loss sum
            replicas=replicas,
        )
        if compute_actions(topology, micro_batches, replicas) <= VERIFY_COMPUTE_ACTIONS:
            verify(self.plan)  # a schedule bug is a PlanError here, not a silently wrong gradient
        self._connect(comm)  # communication starts only now, after every check above passed
        self.storage = ChunkStorage(self.plan, self.rank, blocks, replicated,
                                    block_forward or _default_block_forward, names[1],
                                    compute_dtype, grad_wire_dtype, self.device, materialize, offload,
                                    self.timeout)
        backward_of = {(a.chunk, a.mb): a for a in self.plan.actions[self.rank] if a.op is Op.B}
        self.compute = ChunkCompute(self.storage, embed, head, loss_fn, compute_dtype, recompute, backward_of,
                                    head_loss)
        self.optimizer = optimizer([p for _, p in self.storage.own_params] + [p for _, p in replicated])
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a factory that returns a torch.optim.Optimizer of the parameters it is given "
                f"(e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)), but it returned "
                f"{type(self.optimizer).__name__}: return the optimizer it builds"
            )
        self.scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        if lr_scheduler is not None and not all(callable(getattr(self.scheduler, m, None))
                                                for m in ("step", "state_dict", "load_state_dict")):
            raise TypeError(
                f"lr_scheduler must be a factory that returns a learning-rate scheduler of the optimizer it is given "
                f"(with step(), state_dict() and load_state_dict(), e.g. lambda opt: torch.optim.lr_scheduler."
                f"StepLR(opt, 100)), but it returned {type(self.scheduler).__name__}"
            )
        self.executor = Executor(self.plan, self.timeout, self.device, overlap, self.rank)
        self._embed, self._head = embed, head
        self._vocab = _find_vocab(embed)
        self.steps = 0
        self._failed: BaseException | None = None
        self._closed = False
        self._loaded_unchecked = False  # load_state_dict ran: the ranks must agree before the next step
        self._stats: torch.Tensor | None = None
        self._state: StepState | None = None
        self._last_loss = float("nan")
        self._check_ranks_agree(blocks[0], replicated, compute_dtype, grad_wire_dtype, recompute)

    def _check_ranks_agree(self, block: nn.Module, replicated: list[tuple[str, nn.Parameter]],
                           compute_dtype: torch.dtype, grad_dtype: torch.dtype, recompute: str) -> None:
        """Run the setup program: every rank's fingerprint, compared with rank 0's."""
        mine = fingerprint.fields(self.plan, compute_dtype=compute_dtype, grad_dtype=grad_dtype, block=block,
                                  replicated=replicated, optimizer=self.optimizer,
                                  precision=dataclasses.asdict(self.precision), recompute=recompute)
        fingerprint.compare(self.gather_rows([v for _, v, _ in mine]), mine, self.rank)

    def _connect(self, comm: Comm | str | None) -> None:
        if comm is None or comm == "torch":
            from ..runtime.comm.torch_dist import TorchDistComm

            comm = TorchDistComm(self.topology, self.timeout)
        elif comm == "nccl-native":
            from ..runtime.comm.nccl_native import NcclComm

            # no per-call size exchange: every size comes from the plan, which the setup program's
            # CHECK proves identical on every rank
            comm = NcclComm(self.topology, self.timeout, device=self.device, check="off")
        if comm.world_size != self.topology.world_size:
            raise ValueError(
                f"the comm backend has {comm.world_size} ranks but the topology {self.topology.world_size}"
            )
        self.rank = comm.rank
        comm.add_groups(self.plan.replica_groups())
        # The root backend carries the weights; every other channel has its own communicator.
        # (the replicas' channel only where there are replicas: no idle communicator otherwise)
        used = [ch for ch in QUEUES if ch is not Channel.REPLICAS or self.plan.replicas > 1]
        self._comms = {ch: comm if ch is Channel.WEIGHTS else comm.channel_comm(ch) for ch in used}

    # ------------------------------------------------------------------ public API

    @property
    def own_chunk(self) -> int:
        return self.storage.own_chunk

    @property
    def mb_per_fetch(self) -> int:
        """k, as given or as "auto" chose it."""
        return int(self.plan.options["mb_per_fetch"])

    @property
    def prefetch_depth(self) -> int:
        """The prefetch depth in slots, as given ("resident": its number) or as "auto" chose it."""
        return int(self.plan.options["prefetch_depth"])

    @property
    def reuse_weights(self) -> bool:
        return bool(self.plan.options["reuse_weights"])

    @property
    def skipped_steps(self) -> int:
        return self.precision.skipped_steps

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One iteration over this rank's micro-batches; returns the mean loss over all ranks.

        ``batch`` is (inputs, targets): inputs 2-D integer token ids (rows, seq_len), rows a multiple
        of micro_batches, ids inside the vocabulary of ``embed``'s first nn.Embedding (if it has
        one); targets starting with the same two dimensions. Anything else is refused before the
        step runs, and the engine stays usable."""
        self._refuse_if_closed()
        if self._failed is not None:
            raise RuntimeError(
                f"an earlier step failed ({self._failed!r}); this engine's buffers are in an unknown "
                "state: build a new engine (and restore a checkpoint) to continue"
            ) from self._failed
        state = self._step_state(batch)  # a bad batch is refused here, and the engine stays usable
        self._check_loaded_shards_agree()
        self._state = state
        try:
            self.executor.run(self.plan.actions[self.rank], self._work)
        except BaseException as e:
            self._failed = e
            self.executor.close()  # queued work refers to this step's buffers: stop the channels
            raise
        finally:
            self._state = None
        self.steps += 1
        return self._last_loss

    def _check_tokens(self, inputs: torch.Tensor, targets: torch.Tensor, what: str) -> None:
        """``inputs`` are 2-D integer token ids inside the embedding's vocabulary and ``targets``
        match them: a clear error here rather than a deep one inside the step."""
        for name, t in (("inputs", inputs), ("targets", targets)):
            if t.device.type != self.device.type and t.device.type != "cpu":
                raise ValueError(f"{what}: {name} is on {t.device}; pass CPU tensors or tensors on {self.device}")
        if inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
            raise TypeError(f"{what}: inputs are {inputs.dtype}, but they must be token ids of an integer dtype "
                            "(torch.int64): convert them with inputs.long()")
        if self._vocab is not None and inputs.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{what}: inputs are {inputs.dtype}, but the embedding (nn.Embedding) takes token ids "
                            "of torch.int64 or torch.int32: convert them with inputs.long()")
        if inputs.dim() != 2 or inputs.shape[1] == 0:
            hint = {1: ": one row? pass inputs[None]", 3: ": drop the last dimension"}.get(inputs.dim(), "")
            raise ValueError(f"{what}: inputs have shape {tuple(inputs.shape)}, but they must be 2-D token ids "
                             f"(rows, seq_len) with seq_len >= 1{hint}")
        if targets.shape[:2] != inputs.shape:
            raise ValueError(f"{what}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in shape: "
                             "targets must be (rows, seq_len) like the inputs, one target per input token")
        if self._vocab is not None and inputs.numel():
            lo, hi = (int(v) for v in torch.aminmax(inputs))
            if lo < 0 or hi >= self._vocab:
                raise ValueError(
                    f"{what}: inputs hold token id {lo if lo < 0 else hi}, outside the vocabulary of the embedding "
                    f"(nn.Embedding with {self._vocab} ids: 0 to {self._vocab - 1}); check the tokenizer against "
                    "the model's vocabulary size"
                )

    def _step_state(self, batch: tuple[torch.Tensor, torch.Tensor]) -> StepState:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2
                and all(torch.is_tensor(t) for t in batch)):
            raise TypeError("step(batch): batch must be a pair of tensors (inputs, targets)")
        inputs, targets = batch
        acc = self.micro_batches
        self._check_tokens(inputs, targets, "step(batch)")
        if inputs.shape[0] % acc or inputs.shape[0] == 0:
            raise ValueError(f"step(batch): batch has {inputs.shape[0]} rows, not a positive "
                             f"multiple of micro_batches={acc}")
        mb_in = [t.to(self.device) for t in inputs.chunk(acc)]
        return StepState(
            inputs=mb_in, targets=[t.to(self.device) for t in targets.chunk(acc)],
            ctx=[self.block_context(t) if self.block_context else {} for t in mb_in],
            grad_scale=self.precision.scale / (self.topology.world_size * acc),
        )

    def _check_loaded_shards_agree(self) -> None:
        """After ``load_state_dict``, before the weights are used with other ranks: every rank must
        have loaded the same step, scheduler, optimizer hyper-parameters and loss scale (one CHECK of
        the setup program; until it passes, every step asks again)."""
        if not self._loaded_unchecked:
            return
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        rows = self.gather_rows([self.steps, fingerprint.state_digest(scheduler), fingerprint.state_digest(groups),
                                 fingerprint.state_digest(self.precision.state_dict())])
        steps = [r[0] for r in rows]
        if len(set(steps)) > 1:
            raise ValueError(
                f"the ranks loaded shards of different steps ({', '.join(f'rank {r}: step {s}' for r, s in enumerate(steps))}): "
                f"rank(s) {[r for r, s in enumerate(steps) if s != steps[0]]} differ from rank 0, so they would "
                "train on other weights and another learning rate; load every rank's shard of the same checkpoint "
                "(tawpipe.io.checkpoint.restore does), then step"
            )
        for j, what in ((1, "learning-rate scheduler state"), (2, "optimizer hyper-parameters (learning rate...)"),
                        (3, "loss scaling state")):
            differ = [r for r, row in enumerate(rows) if row[j] != rows[0][j]]
            if differ:
                raise ValueError(
                    f"rank(s) {differ} loaded another {what} than rank 0, all at step {steps[0]}: every rank must "
                    "load its own shard of the same checkpoint (tawpipe.io.checkpoint.restore does), then step"
                )
        self._loaded_unchecked = False

    def memory_report(self) -> MemoryReport:
        return self.storage.memory_report(self.optimizer)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters (own chunk and replicated) under the original names."""
        return self.storage.own_params + self.storage.replicated

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: its chunk's float32 master, the replicated masters, the optimizer
        state, scheduler, loss scaling and step counter. Parameters and per-parameter optimizer
        state are keyed by the model's parameter names, so shards can be re-sharded by name
        (``tawpipe.io.checkpoint.restore``); everything loads with ``weights_only=True``."""
        self._refuse_if_failed()
        names, by_id = self._optimizer_names(), self._param_name
        opt = self.optimizer.state_dict()
        aliases = {f"{prefix}.{n}": by_id[id(p)]
                   for prefix, module in ((self.names[0], self._embed), (self.names[2], self._head))
                   for n, p in module.named_parameters(remove_duplicate=False) if by_id[id(p)] != f"{prefix}.{n}"}
        return {
            "rank": self.rank,
            "chunk": self.own_chunk,
            "layers": list(self.plan.chunk_layers[self.own_chunk]),
            "steps": self.steps,
            "params": {n: p.detach().to("cpu", copy=True) for n, p in self.named_parameters()},
            "aliases": aliases,  # tied weights: their other names
            "optimizer": {"state": {names[i]: s for i, s in opt["state"].items()},
                          "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in opt["param_groups"]]},
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "precision": dict(self.precision.state_dict(), loss_scale=self.precision.loss_scale),
            "compute_dtype": str(self.storage.compute_dtype),
        }

    def load_state_dict(self, state: dict[str, Any], reshard: bool = False) -> None:
        """Restore a shard from ``state_dict()`` of the rank that owned this rank's chunk.

        ``reshard=True`` takes this rank's parameters and their optimizer state by name from a
        ``state`` that may hold more (shards of another topology merged); the scheduler, loss
        scale, counters and optimizer hyper-parameters are then taken from ``state`` as they are.
        A shard saved with another loss-scaling mode (e.g. float32, unscaled, into a float16
        engine) keeps this engine's own scale, with a warning, instead of adopting a wrong one.
        Every rank loads its shard; before the next step (or evaluate, full_state_dict) the ranks
        compare the step, scheduler state, optimizer hyper-parameters and loss scale they loaded
        (one CHECK), and every rank raises a ValueError naming the ranks that differ.
        """
        if not reshard and state.get("chunk") != self.own_chunk:
            raise ValueError(
                f"shard holds chunk {state.get('chunk')} but rank {self.rank} owns chunk "
                f"{self.own_chunk}: load each rank's own shard on the same topology, or re-shard "
                "(tawpipe.io.checkpoint.restore does)"
            )
        own = dict(self.named_parameters())
        saved = state["params"]
        missing = sorted(own.keys() - saved.keys())
        unexpected = [] if reshard else sorted(saved.keys() - own.keys())
        if missing or unexpected:
            raise ValueError(f"the shard's parameters differ from this engine's (different model?): missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}")
        for n, p in own.items():
            if tuple(saved[n].shape) != tuple(p.shape):
                raise ValueError(f"parameter {n} is {tuple(saved[n].shape)} in the shard but {tuple(p.shape)} "
                                 "here: different model?")
        names = self._optimizer_names()
        groups = self.optimizer.state_dict()["param_groups"]
        saved_groups = state["optimizer"]["param_groups"]
        if len(saved_groups) != len(groups):
            raise ValueError(f"the shard's optimizer has {len(saved_groups)} parameter groups, this engine's "
                             f"{len(groups)}: different optimizer?")
        saved_state = state["optimizer"]["state"]
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(saved[n])
        self.optimizer.load_state_dict({
            "state": {i: saved_state[n] for i, n in enumerate(names) if n in saved_state},
            "param_groups": [dict(sg, params=g["params"]) for sg, g in zip(saved_groups, groups)],
        })
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._load_precision(state["precision"], state.get("compute_dtype"))
        self.steps = int(state["steps"])
        self._loaded_unchecked = True  # the ranks compare what they loaded before the next step

    def _load_precision(self, saved: dict[str, Any], saved_dtype: str | None) -> None:
        mode = saved.get("loss_scale", self.precision.loss_scale)
        if mode == self.precision.loss_scale:
            self.precision.load_state_dict(saved)
            return
        warnings.warn(
            f"the shard was saved with loss_scale={mode!r} (compute dtype {saved_dtype}), this engine uses "
            f"loss_scale={self.precision.loss_scale!r} ({self.storage.compute_dtype}): keeping this engine's "
            f"scale {self.precision.scale:g} rather than the shard's {saved['scale']:g}",
            stacklevel=2,
        )
        self.precision.skipped_steps = int(saved["skipped_steps"])

    @property
    def _param_name(self) -> dict[int, str]:
        return {id(p): n for n, p in self.named_parameters()}

    def _optimizer_names(self) -> list[str]:
        """The parameter name of each optimizer index (the order of its state_dict)."""
        by_id = self._param_name
        try:
            return [by_id[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        except KeyError:
            raise ValueError("the optimizer holds a parameter that is not this engine's") from None

    def model_signature(self) -> dict[str, Any]:
        """Layer count, one block's and the replicated parameters (``models.parts.model_signature``)."""
        layout = self.storage.layouts[min(self.storage.layouts)]
        block = [(n.split(".", 1)[1], tuple(shape), dtype)
                 for n, shape, dtype in zip(layout.names, layout.shapes, layout.dtypes) if n.startswith("0.")]
        return model_signature(self.plan.num_layers, self.names, block, param_signature(self.storage.replicated))

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.storage.compute_dtype

    @property
    def grad_wire_dtype(self) -> torch.dtype:
        return self.storage.grad_dtype

    def own_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's chunk: (name in the model, float32 master view), in layer order."""
        return list(self.storage.own_params)

    def replicated_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The embedding's and head's parameters (identical on every rank), each tied one once."""
        return list(self.storage.replicated)

    def block_parameters(self) -> list[tuple[str, int, int]]:
        """(name in the model, numel, owning chunk) of every block parameter of every chunk, in layer
        order: the whole model's layout, which no rank holds in memory."""
        out = []
        for k in self.plan.model_order:
            start = self.plan.chunk_layers[k][0]
            layout = self.storage.layouts[self.storage.layers(k)]
            out += [(block_param_name(self.names[1], start, n), numel, k)
                    for n, numel in zip(layout.names, layout.numels)]
        return out

    def barrier(self) -> None:
        """Return once every rank has called it (one CHECK on the step channel)."""
        self.gather_rows([1])

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was closed (TawPipe.close() was called) and communicates no more: "
                               "build a new TawPipe (and restore a checkpoint into it) to go on")

    def _refuse_if_unusable(self) -> None:
        """Before anything that communicates: the engine is neither closed nor failed."""
        self._refuse_if_closed()
        self._refuse_if_failed()

    def _refuse_if_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"an earlier step failed ({self._failed!r}): this engine's state is unknown and "
                               "its channels are closed; restore the last checkpoint into a new engine")

    def gather_rows(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (integers; the same count on every rank), in rank order: one
        all-reduce, run as the setup program's CHECK (checkpoints agree through it)."""
        self._refuse_if_unusable()
        n = self.topology.world_size
        table = torch.zeros(n, len(values), dtype=torch.int64)
        table[self.rank] = torch.tensor(list(values), dtype=torch.int64)
        table = table.to(self.device)
        comm = self._comms[Channel.STEP]
        self.executor.run(setup_program(self.plan, table.numel() * 8)[self.rank],
                          lambda unit: lambda: comm.all_reduce(table, unit[0].group))
        return table.cpu().tolist()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gather every chunk on rank 0 under the original parameter names (None elsewhere)."""
        self._refuse_if_unusable()
        self._check_loaded_shards_agree()
        received: dict[int, torch.Tensor] = {}
        actions = gather_program(self.plan, root=0)[self.rank]

        def work(unit: list[Action]) -> Callable[[], None]:
            for a in unit:
                if a.op is Op.RECV_MASTER:
                    received[a.chunk] = torch.empty(self.storage.numel(a.chunk), device=self.device)
            master = self.storage.master.to(self.device)  # a copy when offloaded to the host
            return self._p2p(unit, lambda a: master if a.op is Op.SEND_MASTER else received[a.chunk])

        self.executor.run(actions, work)
        if self.rank != 0:
            return None
        received[self.own_chunk] = self.storage.master.to(self.device)
        out: dict[str, torch.Tensor] = {}
        for k, flat in sorted(received.items(), key=lambda kv: self.plan.chunk_layers[kv[0]]):
            start = self.plan.chunk_layers[k][0]
            layout = self.storage.layouts[self.storage.layers(k)]
            for name, view in zip(layout.names, layout.views(flat)):
                out[block_param_name(self.names[1], start, name)] = view.detach().clone().cpu()
        for mod_name, module in ((self.names[0], self._embed), (self.names[2], self._head)):
            for n, p in module.named_parameters(remove_duplicate=False):
                out[f"{mod_name}.{n}"] = p.detach().clone().cpu()
        return out

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Validation loss with the current weights: the mean of ``loss_fn`` over this rank's
        ``batches`` and every other rank's (the same count on each), leaving training state as it
        was. Runs ``plan.programs.eval_program``: each chunk broadcast once from its owner into an
        idle weight buffer, every rank's batches through it, the loss sums all-reduced."""
        self._refuse_if_unusable()
        if not batches:
            raise ValueError("evaluate needs at least one (inputs, targets) batch")
        for i, b in enumerate(batches):
            if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(torch.is_tensor(t) for t in b)):
                raise TypeError(f"evaluate(batches): batches[{i}] must be a pair of tensors (inputs, targets)")
            self._check_tokens(b[0], b[1], f"evaluate(batches): batches[{i}]")
        self._check_loaded_shards_agree()
        buf = next(b for b in sorted(self.storage.bufs) if buf_kind(b) is BufKind.WEIGHTS)
        inputs = [x.to(self.device) for x, _ in batches]
        st = EvalState(inputs=inputs, targets=[y.to(self.device) for _, y in batches],
                       ctx=[self.block_context(x) if self.block_context else {} for x in inputs],
                       loss_sum=torch.zeros((), dtype=torch.float64, device=self.device))

        def work(unit: list[Action]) -> Callable[[], None]:
            a = unit[0]
            if a.op is Op.EVAL_F:
                return lambda: self.compute.evaluate(a, st)
            if a.op is Op.ALLREDUCE_EVAL:
                return lambda: self._comms[OPS[a.op].channel].all_reduce(st.loss_sum, a.group)
            return self._work(unit)

        self.executor.run(eval_program(self.plan, buf)[self.rank], work)
        return st.loss_sum.item() / (self.topology.world_size * len(batches))

    def close(self) -> None:
        """Stop the engine's channels; every method that communicates then refuses."""
        self._closed = True
        self.executor.close()

    # ------------------------------------------------------------------ actions -> calls

    def _work(self, unit: list[Action]) -> Callable[[], None]:
        """The call that performs one unit of the plan (design §4.2 says what each op means)."""
        a, s = unit[0], self.storage
        if OPS[a.op].is_p2p:
            return self._p2p(unit, lambda x: s.chunk(x.buf, x.chunk))
        comm = self._comms.get(OPS[a.op].channel)
        if a.op is Op.F:
            return lambda: self.compute.forward(a, self._state)
        if a.op is Op.B:
            return lambda: self.compute.backward(a, self._state)
        if a.op is Op.LOAD_W:
            return lambda: s.load_master(a.buf, a.chunk)
        if a.op is Op.STEP:
            return self._optimizer_step
        if a.op is Op.ACC_G:
            return lambda: s.accumulate(a.buf, a.chunk)
        if a.op is Op.BCAST_W:
            return lambda: comm.broadcast(s.chunk(a.buf, a.chunk), a.root, a.group)
        if a.op is Op.REDUCE_G:
            return lambda: comm.reduce(s.chunk(a.buf, a.chunk), a.root, a.group)
        if a.op is Op.ALLREDUCE_REPLICATED:
            return lambda: comm.all_reduce(s.rep, a.group)
        if a.op is Op.ALLREDUCE_STATS:
            return lambda: self._all_reduce_stats(comm, a.group)
        if a.op is Op.ALLREDUCE_G:
            return lambda: self._all_reduce_grad(comm, a.group)
        raise ValueError(f"the engine cannot execute {a.op}")

    def _p2p(self, unit: list[Action], tensor: Callable[[Action], torch.Tensor]) -> Messages:
        return Messages(self._comms[OPS[unit[0].op].channel],
                        tuple(P2P(OPS[a.op].transfer, tensor(a), a.peer) for a in unit),
                        tuple(a.tag for a in unit), self.timeout)

    def _all_reduce_grad(self, comm: Comm, group: tuple[int, ...]) -> None:
        """The own chunk's accumulator summed with its owners' in the other replicas."""
        acc = self.storage.grad_acc
        summed = acc.to(self.device)  # a copy when offloaded to the host
        comm.all_reduce(summed, group)
        if summed is not acc:
            acc.copy_(summed)

    def _all_reduce_stats(self, comm: Comm, group: tuple[int, ...]) -> None:
        stats = Precision.local_stats(self.storage.grad_acc).to(self.device)
        if self.plan.replica_of(self.rank) > 0:
            stats[0] = 0  # each chunk's norm counted once: its owners in every replica hold the same sum
        comm.all_reduce(stats, group)
        self._stats = stats

    def _optimizer_step(self) -> None:
        s = self.storage
        n_total = self.topology.world_size * self.micro_batches
        self._last_loss = s.rep[-1].item() / n_total
        if self.precision.finish(self.steps, self._stats, self._last_loss, s.rep[:-1], s.grad_acc):
            if s.offload is not None:
                s.offload.synchronize()  # streamed loads have finished reading the master
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        s.grad_acc.zero_()
        s.rep.zero_()
