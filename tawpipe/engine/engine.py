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

import copy
import dataclasses
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from ..models.parts import ModelParts, block_param_name, model_signature, param_signature, unique_params
from ..plan.actions import OPS, QUEUES, Action, BufKind, Channel, Op, buf_kind
from ..plan.context import check_plan as check_context_plan
from ..plan.context import context_groups
from ..plan.plan import Plan
from ..plan.programs import eval_program, gather_program, setup_program
from ..plan.schedule import compute_actions
from ..plan.topology import Topology
from ..plan.verify import verify
from ..runtime import comm as comm_backends
from ..runtime import progress
from ..runtime.comm.base import P2P, Comm
from ..runtime.executor import Executor, Messages
from ..runtime.timeout import timeout_seconds
from . import fingerprint, shard
from .auto import engine_plan
from .activations import ActivationOffload
from .context import CONTEXT_CHANNEL, ContextGroup
from .compute import ChunkCompute, EvalState, StepState
from .precision import Precision
from .inputs import (check_micro_batches, check_model, check_optimizer, check_policies, check_replicated,
                     check_scheduler, check_tokens, check_trainable, find_classes, find_vocab,
                     resolve_device)
from .policy import CommPolicy, MemoryPolicy, PrecisionPolicy, SchedulePolicy
from .storage import ChunkStorage, MemoryReport
from .update import Update

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

# Up to this many, the engine proves its plan before it connects (about 1.5 s of one core at the
# most); beyond, it trusts the schedules' tests and ``tawpipe plan``, which proves what it prints.
VERIFY_COMPUTE_ACTIONS = 50_000
# A refused input's error, as a rank's progress label gives it (the label's slot holds 230 bytes)
REFUSAL_CHARS = 120


def default_optimizer(params: list[nn.Parameter], lr: float = 1e-3) -> torch.optim.Optimizer:
    """AdamW as in the paper: lr 1e-3, betas (0.9, 0.95), weight decay 0.1 on matrices only.
    Fused (one kernel per device and dtype) where torch has one for every parameter's device: on
    a host, where offloaded state steps, it runs 10-16x faster than the per-tensor loops (design §6.2)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), fused=all(p.device.type in ("cpu", "cuda") for p in params) or None,
    )


class TawPipe:
    """Topology-aware weight pipeline training of a stack of identical blocks.

    Each rank runs the whole model on its own micro-batches; chunk weights and gradients move
    between ranks as the plan says. One ``step`` equals one step of single-device training on the
    concatenation of every rank's micro-batches, with the same optimizer. ``model`` is a
    ``tawpipe.models.ModelParts``: the blocks (which may live on the meta device, with
    ``materialize`` giving each rank its own chunk's real blocks), the replicated ``embed`` and
    ``head``, the loss and the hooks. ``optimizer(params)`` and ``lr_scheduler(optimizer)`` are
    factories: the engine owns the optimizer of its own chunk and the replicated parameters.
    ``device`` (default: the embedding's) is the process's current device on an accelerator
    (``torch.cuda.set_device``), whose current stream the engine orders its work after. The
    four policies (``tawpipe.engine.policy``) say which schedule runs, in what precision, with
    what memory savers and over which backend; ``mb_per_fetch``, ``prefetch_depth``,
    ``reuse_weights`` and ``auto_reason`` say what "auto" chose and why. On a GPU with the state on
    the host, ``step`` returns while the host still steps the own chunk (``finish_step``).
    """

    def __init__(self, model: ModelParts, *, topology: Topology, micro_batches: int,
                 optimizer: OptimizerFactory = default_optimizer, lr_scheduler: SchedulerFactory | None = None,
                 device: torch.device | str | None = None, schedule: SchedulePolicy = SchedulePolicy(),
                 precision: PrecisionPolicy = PrecisionPolicy(), memory: MemoryPolicy = MemoryPolicy(),
                 comm: CommPolicy = CommPolicy()) -> None:
        blocks = check_model(model, topology, optimizer, lr_scheduler)
        check_policies(model, topology, schedule, memory, comm)
        check_micro_batches(topology, micro_batches, schedule.replicas)
        self.precision = precision.numerics()
        self.timeout = timeout_seconds(comm.timeout)
        check_replicated(model.embed, model.head, model.names, None, device)  # meta first: the default device
        self.device = resolve_device(device if device is not None else next(model.embed.parameters()).device)
        check_replicated(model.embed, model.head, model.names, self.device)
        self.topology, self.micro_batches, self.names = topology, micro_batches, model.names
        self.block_context = model.block_context
        replicated = unique_params([(model.names[0], model.embed), (model.names[2], model.head)])
        self.plan: Plan
        self.auto_reason: str | None  # why "auto" chose the options it did; None: all were given
        self.plan, savers, self.auto_reason = engine_plan(
            topology, len(blocks), micro_batches, device=self.device, budget=memory.budget,
            savers=memory.savers(host_is_device=self.device.type == "cpu"),
            batch=memory.batch(schedule.context_parallel), layer_numel=sum(p.numel() for p in blocks[0].parameters()),
            weight_bytes=precision.compute_dtype.itemsize, grad_bytes=precision.grad_wire_dtype.itemsize,
            replicated_numel=sum(p.numel() for _, p in replicated if p.requires_grad),  # frozen: no gradient
            **schedule.plan_options())
        memory = dataclasses.replace(memory, recompute=savers.recompute, offload_state=savers.offload_state,
                                     offload_activations=savers.offload_activations)  # recompute "auto": chosen
        self.policies = (schedule, precision, memory, comm)
        if compute_actions(topology, micro_batches, schedule.replicas) <= VERIFY_COMPUTE_ACTIONS:
            verify(self.plan)  # a schedule bug is a PlanError here, not a silently wrong gradient
        if schedule.context_parallel > 1:
            check_context_plan(self.plan, schedule.context_parallel)
        check_trainable(self.plan, blocks, replicated, optimizer)
        self.sliced_context = model.sliced_context
        self._connect(comm.backend)  # communication starts only now, after every check above passed
        self._build(model, blocks, replicated, optimizer, lr_scheduler)
        self._embed, self._head = model.embed, model.head
        self._vocab, self._classes = find_vocab(model.embed), find_classes(model.head)
        self.steps, self._loaded_unchecked = 0, False  # load_state_dict ran: the ranks must agree before a step
        # A step that raised leaves its error here (the buffers are in an unknown state); ``close``
        # sets _closed. Neither comes back, and closing a failed engine leaves it failed.
        self._failure: BaseException | None = None
        self._closed = False
        self._stats: torch.Tensor | None = None
        self._state: StepState | None = None
        self._last_loss = float("nan")
        self._check_ranks_agree(blocks[0], replicated)
        self._context = self._connect_context(schedule.context_parallel)  # after the ranks agree on it

    def _build(self, model: ModelParts, blocks: list[nn.Module], replicated: list[tuple[str, nn.Parameter]],
               optimizer: OptimizerFactory, lr_scheduler: SchedulerFactory | None) -> None:
        """This rank's storage, compute, optimizer, scheduler and executor, for its plan."""
        _, precision, memory, comm = self.policies
        self.storage = ChunkStorage(self.plan, self.rank, blocks, replicated, model.block_forward, model.names[1],
                                    precision.compute_dtype, precision.grad_wire_dtype, self.device,
                                    model.materialize, memory.offload_state, self.timeout,
                                    layerwise=memory.savers().layerwise)
        backwards = [a for a in self.plan.actions[self.rank] if a.op is Op.B]
        per_layer = memory.recompute == "block"  # each layer's input kept, and fetched back, on its own
        activations = ActivationOffload(self.device, [
            (self.storage.position[a.chunk], a.mb, j) for a in backwards
            for j in reversed(range(self.plan.chunk_layers[a.chunk][1] - self.plan.chunk_layers[a.chunk][0]
                                    if per_layer else 1))]) if memory.offload_activations else None
        self.compute = ChunkCompute(self.storage, model.embed, model.head, model.loss_fn, precision.compute_dtype,
                                    memory.recompute, {(a.chunk, a.mb): a for a in backwards},
                                    model.head_loss if memory.chunked_loss else None, activations)
        # the parameters that train, as plain torch would be given them (a frozen one is never stepped)
        self.optimizer = optimizer([p for _, p in self.storage.own_params + replicated if p.requires_grad])
        check_optimizer(self.optimizer)
        self.scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        check_scheduler(self.scheduler, lr_scheduler)
        self.executor = Executor(self.plan, self.timeout, self.device, comm.overlap, self.rank)
        self._update = Update(self.plan, self.storage, self.optimizer, self.scheduler, self.precision, self.executor,
                              self.timeout)

    def _check_ranks_agree(self, block: nn.Module, replicated: list[tuple[str, nn.Parameter]]) -> None:
        """Run the setup program: every rank's fingerprint, compared with rank 0's."""
        _, precision, memory, _ = self.policies
        mine = fingerprint.fields(self.plan, compute_dtype=precision.compute_dtype,
                                  grad_dtype=precision.grad_wire_dtype, block=block, replicated=replicated,
                                  optimizer=self.optimizer, precision=dataclasses.asdict(self.precision),
                                  recompute=memory.recompute, context_parallel=self.policies[0].context_parallel,
                                  trainable=(self.storage.trainable, [p.requires_grad for _, p in replicated]),
                                  buffers=self.storage.buffers)
        fingerprint.compare(self.gather_rows([v for _, v, _ in mine]), mine, self.rank)

    def _connect_context(self, degree: int) -> ContextGroup | None:
        """The context group's communicator (its own channel, design §3.6); None without one."""
        if degree == 1:
            return None
        nodes = {tuple(self.topology.group_ranks(g)) for g in range(self.topology.nodes)}
        groups = [g for g in context_groups(self.topology, degree) if g not in nodes]  # a whole node's exists
        if groups:
            self._comm.add_groups(groups)
        return ContextGroup(self._comm.channel_comm(CONTEXT_CHANNEL), self.topology, degree, self.rank)

    def _connect(self, backend: Comm | str) -> None:
        comm = backend if isinstance(backend, Comm) else comm_backends.create(backend, self.topology, self.timeout,
                                                                             self.device)
        if comm.world_size != self.topology.world_size:
            raise ValueError(
                f"the comm backend has {comm.world_size} ranks but the topology {self.topology.world_size}"
            )
        self.rank, self._comm = comm.rank, comm
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
    def reuse_weights(self) -> bool | str:
        return self.plan.options["reuse_weights"]

    @property
    def skipped_steps(self) -> int:
        return self.precision.skipped_steps

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One iteration over this rank's micro-batches; returns the mean loss over all ranks.

        ``batch`` is (inputs, targets): inputs 2-D integer token ids (rows, seq_len), rows a multiple
        of micro_batches, ids inside the vocabulary of ``embed``'s first nn.Embedding (if it has
        one); targets starting with the same two dimensions: of exactly that shape, int64 class
        indices (the next tokens) below the outputs of ``head``'s last nn.Linear (if it has one) or
        negative (an ignore_index), else with
        more dimensions (class probabilities), which only ``loss_fn`` reads. Anything else is
        refused before the step runs, and the engine stays usable: peers already in the step wait
        for this rank, a call with a good batch joins them, and if none comes in time their timeout
        names this rank and the refusal. An exception inside the step
        (``loss_fn``'s own included: it runs after the step's first transfers) leaves the engine
        failed."""
        self._refuse_if_unusable()
        try:
            state = self._step_state(batch)  # a bad batch is refused here, and the engine stays usable
        except (TypeError, ValueError) as e:
            _published_refusal("step", self.steps, e)
            raise
        self._check_loaded_shards_agree()
        self._state = state
        try:
            self.executor.run(self.plan.actions[self.rank], self._work, traced=True)
        except BaseException as e:
            self._failure = e
            self.executor.close()  # queued work refers to this step's buffers: stop the channels
            raise
        finally:
            self._state = None
        self.steps += 1
        return self._last_loss

    def _step_state(self, batch: tuple[torch.Tensor, torch.Tensor]) -> StepState:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2
                and all(torch.is_tensor(t) for t in batch)):
            raise TypeError("step(batch): batch must be a pair of tensors (inputs, targets)")
        inputs, targets = batch
        acc = self.micro_batches
        check_tokens(inputs, targets, "step(batch)", self.device, self._vocab, self._classes)
        if inputs.shape[0] % acc or inputs.shape[0] == 0:
            raise ValueError(f"step(batch): batch has {inputs.shape[0]} rows, not a positive "
                             f"multiple of micro_batches={acc}")
        planned = self.policies[2].shape
        if planned is not None and (inputs.shape[0] // acc > planned.micro_batch or inputs.shape[1] > planned.seq):
            raise ValueError(f"step(batch): micro-batches of {inputs.shape[0] // acc} x {inputs.shape[1]} tokens, "
                             f"larger than MemoryPolicy.shape's {planned.micro_batch} x {planned.seq}, for which this "
                             "engine chose its memory use: give the shape of the largest micro-batches step() takes")
        mb_in, ctx, mb_targets, weights = self._sliced([t.to(self.device) for t in inputs.chunk(acc)],
                                                       [t.to(self.device) for t in targets.chunk(acc)])
        return StepState(inputs=mb_in, targets=mb_targets, ctx=ctx, loss_weights=weights,
                         grad_scale=self.precision.scale / (self.topology.world_size * acc))

    def _sliced(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]
                ) -> tuple[list[torch.Tensor], list[dict[str, Any]], list[torch.Tensor], list[float]]:
        """Each batch's inputs, block context, targets and loss weight as this rank computes them:
        whole (weight 1), or with context parallelism its slice of each sequence (after checking
        that its group was given the same batches), weighted so that the mean of the slices'
        losses is the whole batch's even where ignored targets fall unevenly among the slices
        (``ContextGroup.loss_weights``)."""
        if self._context is None:
            return (inputs, [self.block_context(t) if self.block_context else {} for t in inputs], targets,
                    [1.0] * len(inputs))
        slices = [self._context.slice(t.shape[1], self.device) for t in inputs]  # a bad length: before any exchange
        self._context.check_same_batches(tuple(range(self.topology.world_size)), inputs + targets)
        weights = self._context.loss_weights(targets, slices)
        inputs = [t[:, s.positions] for t, s in zip(inputs, slices)]
        return (inputs, [self.sliced_context(t, s) for t, s in zip(inputs, slices)],
                [t[:, s.positions] for t, s in zip(targets, slices)], weights)

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
        self.finish_step()  # the optimizer's state: created by the first step
        return self.storage.memory_report(self.optimizer)

    def host_traffic(self) -> tuple[int, int]:
        """Bytes this rank moved to and from host memory since it was built: the own chunk's
        gradients and master with ``offload_state``, the chunk inputs with
        ``offload_activations``, the stashed chunks with ``reuse_weights="host"``
        (``cost.memory.host_bytes`` counts the same from the plan)."""
        self.finish_step()
        a = self.compute.activations
        to_host = self.storage.to_host + (a.stored_bytes if a is not None else 0)
        return to_host, self.storage.from_host + (a.fetched_bytes if a is not None else 0)

    def context_traffic(self) -> tuple[int, float]:
        """Bytes this rank sent in the K/V exchanges of context parallelism since it was built
        (``cost.traffic.context_bytes`` counts the same from the plan), and the seconds its compute
        spent in them; (0, 0.0) without it."""
        return (self._context.sent, self._context.seconds) if self._context is not None else (0, 0.0)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters (own chunk and replicated) under the original names."""
        self.finish_step()
        return self.storage.own_params + self.storage.replicated

    def state_dict(self, *, snapshot: bool = True) -> dict[str, Any]:
        """This rank's shard: its chunk's float32 master, the replicated masters, the optimizer
        state (and its class), scheduler, loss scaling and step counter. Parameters and
        per-parameter optimizer state are keyed by the model's parameter names, so shards can be
        re-sharded by name (``tawpipe.io.checkpoint.restore``); everything loads with
        ``weights_only=True``.

        The shard is a snapshot, on the host: later steps do not change it (torch's own
        ``state_dict`` hands out the live optimizer tensors). ``snapshot=False`` leaves the
        optimizer and scheduler state live, to be written at once without a second copy of the
        moments (``checkpoint.save`` does)."""
        self._refuse_if_failed()
        self.finish_step()
        names, by_id = self._optimizer_names(), self._param_name
        opt = self.optimizer.state_dict()
        aliases = {f"{prefix}.{n}": by_id[id(p)]
                   for prefix, module in ((self.names[0], self._embed), (self.names[2], self._head))
                   for n, p in module.named_parameters(remove_duplicate=False) if by_id[id(p)] != f"{prefix}.{n}"}
        live = ({names[i]: s for i, s in opt["state"].items()},
                [dict(g, params=[names[i] for i in g["params"]]) for g in opt["param_groups"]],
                self.scheduler.state_dict() if self.scheduler is not None else None)
        state, groups, scheduler = shard.snapshot(live) if snapshot else live
        return {
            "rank": self.rank,
            "chunk": self.own_chunk,
            "layers": list(self.plan.chunk_layers[self.own_chunk]),
            "steps": self.steps,
            "params": {n: p.detach().to("cpu", copy=True) for n, p in self.named_parameters()},
            "aliases": aliases,  # tied weights: their other names
            "optimizer": {"class": shard.optimizer_class(self.optimizer), "state": state, "param_groups": groups},
            "scheduler": scheduler,
            "precision": dict(self.precision.state_dict(), loss_scale=self.precision.loss_scale),
            "compute_dtype": str(self.storage.compute_dtype),
        }

    def load_state_dict(self, state: dict[str, Any], reshard: bool = False, *, assign: bool = False) -> None:
        """Restore a shard from ``state_dict()`` of the rank that owned this rank's chunk.

        ``reshard=True`` takes this rank's parameters and their optimizer state by name from a
        ``state`` that may hold more (shards of another topology merged); the scheduler, loss
        scale, counters and optimizer hyper-parameters are then taken from ``state`` as they are.
        A shard saved with another loss-scaling mode (e.g. float32, unscaled, into a float16
        engine) keeps this engine's own scale, with a warning, instead of adopting a wrong one.
        Every rank loads its shard; before the next step (or evaluate, full_state_dict) the ranks
        compare the step, scheduler state, optimizer hyper-parameters and loss scale they loaded
        (one CHECK), and every rank raises a ValueError naming the ranks that differ.

        The whole shard is checked before anything changes (``engine.shard.check``: its keys, the
        shapes of the parameters and of their optimizer state, the optimizer's class, a scheduler
        state iff this engine has a scheduler): a ValueError leaves the engine as it was. The
        engine keeps copies, never ``state``'s tensors, so one dict loads into several engines;
        ``assign=True`` lets the optimizer keep them instead, for a dict nobody else holds
        (``checkpoint.restore``'s, read from a file)."""
        self.finish_step()
        own, names, by_id = dict(self.named_parameters()), self._optimizer_names(), self._param_name
        groups = [[by_id[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
        shard.check(state, params=own, optimizer=self.optimizer, groups=groups, scheduler=self.scheduler,
                    reshard=reshard, rank=self.rank, own_chunk=self.own_chunk)
        saved_state = state["optimizer"]["state"]
        self.optimizer.load_state_dict({
            "state": {i: saved_state[n] for i, n in enumerate(names) if n in saved_state},
            "param_groups": [dict(sg, params=g["params"]) for sg, g in
                             zip(state["optimizer"]["param_groups"], self.optimizer.state_dict()["param_groups"])],
        })
        if not assign:
            shard.unshare(self.optimizer, saved_state)
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(state["params"][n])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"] if assign else copy.deepcopy(state["scheduler"]))
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
        self.finish_step()
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
        if self._failure is not None:
            raise RuntimeError(f"an earlier step failed ({self._failure!r}): this engine's state is unknown and "
                               "its channels are closed; restore the last checkpoint into a new engine"
                               ) from self._failure

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
        self.finish_step()
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
        """Validation loss with the current weights: the mean of ``loss_fn`` over every rank's
        ``batches`` together, one term per batch, as a plain ``model.eval()`` loop under
        ``torch.no_grad()`` over the union of the batches gives it; ranks may pass different
        numbers of batches, and every rank returns the same value. The blocks, ``embed`` and
        ``head`` run in eval mode (dropout off), each module's mode restored after; the training
        state is left as it was. Runs ``plan.programs.eval_program``: each chunk broadcast once
        from its owner into an idle weight buffer, every rank's batches through it, the loss sums
        and the batch counts all-reduced."""
        self._refuse_if_unusable()
        self.finish_step()
        try:
            self._check_eval_batches(batches)
        except (TypeError, ValueError) as e:
            _published_refusal("evaluate", self.steps, e)
            raise
        self._check_loaded_shards_agree()
        buf = next(b for b in sorted(self.storage.bufs) if buf_kind(b) is BufKind.WEIGHTS)
        inputs, ctx, targets, weights = self._sliced([x.to(self.device) for x, _ in batches],
                                                     [y.to(self.device) for _, y in batches])
        # the count rides with the loss sum: the divisor is every rank's count, not this rank's
        st = EvalState(inputs=inputs, targets=targets, ctx=ctx, loss_weights=weights,
                       totals=torch.tensor([0.0, len(batches)], dtype=torch.float64, device=self.device))

        def work(unit: list[Action]) -> Callable[[], None]:
            a = unit[0]
            if a.op is Op.EVAL_F:
                return lambda: self.compute.evaluate(a, st)
            if a.op is Op.ALLREDUCE_EVAL:
                return lambda: self._comms[OPS[a.op].channel].all_reduce(st.totals, a.group)
            return self._work(unit)

        actions = eval_program(self.plan, buf)[self.rank]
        self.storage.before_program(actions)
        with self.compute.eval_mode():
            self.executor.run(actions, work)
        loss_sum, count = st.totals.tolist()
        return loss_sum / count

    def _check_eval_batches(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not batches:
            raise ValueError("evaluate needs at least one (inputs, targets) batch")
        for i, b in enumerate(batches):
            if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(torch.is_tensor(t) for t in b)):
                raise TypeError(f"evaluate(batches): batches[{i}] must be a pair of tensors (inputs, targets)")
            check_tokens(b[0], b[1], f"evaluate(batches): batches[{i}]", self.device, self._vocab,
                         self._classes)

    def close(self) -> None:
        """Stop the engine's channels, once the last step is done (its failure raised after);
        every method that communicates then refuses."""
        self._closed = True
        try:
            self.finish_step()
        finally:
            self.executor.close()

    # ------------------------------------------------------------------ actions -> calls

    def _work(self, unit: list[Action]) -> Callable[[], None]:
        """The call that performs one unit of the plan (design §4.2 says what each op means)."""
        a, s = unit[0], self.storage
        if self._update.beside and any(self._update.waits_for(x) for x in unit):
            if a.op is Op.F and a.buf == s.carried_load.buf and self.compute.recompute != "none":
                return lambda: self.compute.forward(a, self._state, gate=self._update.gate)  # a layer once loaded
            self.finish_step()
        if OPS[a.op].is_p2p:
            return self._p2p(unit, lambda x: s.chunk(x.buf, x.chunk))
        comm = self._comms.get(OPS[a.op].channel)
        if a.op is Op.F:
            return lambda: self.compute.forward(a, self._state)
        if a.op is Op.B:
            addition = s.streamed.get(a)
            done = None if addition is None else (lambda layer: self._update.stream_slice(addition, layer))
            return lambda: self.compute.backward(a, self._state, done)
        if a.op is Op.LOAD_W:
            return lambda: s.load_master(a.buf, a.chunk)
        if a.op is Op.STASH_W:
            return lambda: s.stash(a.buf, a.chunk)
        if a.op is Op.RESTORE_W:
            return lambda: s.restore(a.buf, a.chunk)
        if a.op is Op.STEP:
            return self._optimizer_step
        if a.op is Op.ACC_G:
            return lambda: self._update.accumulate(a)
        if a.op is Op.BCAST_W:
            return lambda: comm.broadcast(s.chunk(a.buf, a.chunk), a.root, a.group)
        if a.op is Op.REDUCE_G:
            return lambda: comm.reduce(s.chunk(a.buf, a.chunk), a.root, a.group)
        if a.op is Op.ALLREDUCE_REPLICATED:  # nothing to sum where embed and head are frozen (alike on every rank)
            return (lambda: self._all_reduce_in_wire(comm, s.rep, a.group)) if s.rep.numel() else (lambda: None)
        if a.op is Op.ALLREDUCE_STATS:
            return lambda: self._all_reduce_stats(comm, a.group)
        if a.op is Op.ALLREDUCE_G:
            return lambda: s.summed_over_replicas(self._all_reduce_in_wire(comm, s.grad_acc, a.group))
        raise ValueError(f"the engine cannot execute {a.op}")

    def _p2p(self, unit: list[Action], tensor: Callable[[Action], torch.Tensor]) -> Messages:
        return Messages(self._comms[OPS[unit[0].op].channel],
                        tuple(P2P(OPS[a.op].transfer, tensor(a), a.peer) for a in unit),
                        tuple(a.tag for a in unit), self.timeout)

    def _all_reduce_in_wire(self, comm: Comm, grads: torch.Tensor, group: tuple[int, ...]) -> torch.Tensor:
        """A float32 gradient buffer (the own chunk's accumulator, summed over the replicas; the
        replicated modules', over the job) summed in the dtype gradients travel in
        (``PrecisionPolicy.grad_wire_dtype``); returns the sum as it crossed, on the device."""
        summed = grads.to(self.device, self.storage.grad_dtype)  # a copy when offloaded, or cast
        comm.all_reduce(summed, group)
        if summed is not grads:
            grads.copy_(summed)
        return summed

    def _all_reduce_stats(self, comm: Comm, group: tuple[int, ...]) -> None:
        s = self.storage
        stats = Precision.local_stats(s.grad_acc, s.loss_sum, s.own_squared_norm()).to(self.device)
        if self.plan.replica_of(self.rank) > 0:
            stats[0] = 0  # each chunk's norm counted once: its owners in every replica hold the same sum
        comm.all_reduce(stats, group)
        self._stats = stats

    def _optimizer_step(self) -> None:
        self._last_loss = self._stats[2].item() / (self.topology.world_size * self.micro_batches)
        self._update.step(self.steps, self._stats, self._last_loss)

    def finish_step(self) -> None:
        """Wait until the last step is done. On a GPU with ``offload_state`` the host steps the own
        chunk beside the next iteration (design §6.1), and ``step()`` returns before it is done;
        every method of the engine that reads what it changes waits for it first (the next
        ``step()`` only where it needs to), so call this only before reading the own parameters
        or the optimizer's state directly. The optimizer's ``param_groups`` may be changed at any
        time: the step runs with the values they had when it began."""
        try:
            self._update.finish()
        except BaseException as e:
            self._failure = e
            raise


def _published_refusal(call: str, steps: int, error: Exception) -> None:
    """A rank that refused its input stays out of the step its peers are in: they wait for it, and
    when a wait times out its message names this rank and why (``runtime.progress``; the error's
    first line, shortened to fit the board's slot)."""
    why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    why = why if len(why) <= REFUSAL_CHARS else why[:REFUSAL_CHARS - 1] + "…"
    progress.publish(f"{progress.OUTSIDE}, having refused what {call}() was given at step {steps} ({why})")
