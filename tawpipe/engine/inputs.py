"""What the user hands the engine, checked before anything is built or sent: the model's parts,
the device, the micro-batches and every batch. Each problem is an exception naming it and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..models.parts import ModelParts, param_signature
from ..ops import SUPPORTED_DTYPES
from ..plan.plan import Plan
from ..plan.schedule import check_replicas, compute_actions
from ..plan.topology import Topology
from .policy import CommPolicy, MemoryPolicy, SchedulePolicy

def check_blocks(blocks: list[nn.Module]) -> None:
    """A stack of distinct, identically structured blocks with floating-point parameters and
    constant buffers (what ``ChunkStorage`` can shard and run)."""
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
    for name, _, dtype in sig:  # every block's, as block 0's
        if not dtype.is_floating_point:
            raise ValueError(
                f"block parameter {name!r} is {dtype}: tawpipe shards and trains floating-point parameters "
                f"(float32, bfloat16 or float16) only; keep an integer or boolean constant as a buffer "
                f"(block.register_buffer({name.rsplit('.', 1)[-1]!r}, tensor)) instead"
            )
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"block parameter {name!r} is {dtype}: tawpipe keeps the blocks' weights as float32 masters and "
                f"computes in PrecisionPolicy.compute_dtype, from parameters of float32, bfloat16 or float16; "
                "convert the blocks first (block.float())"
            )
    check_block_buffers(blocks)


def check_block_buffers(blocks: list[nn.Module]) -> None:
    """The blocks' buffers are constants that every block has alike (rotary tables, masks): the
    engine runs every layer with one copy of them (design §6.2). Buffers that forward changes
    (BatchNorm's running statistics) cannot be kept per layer, so they are refused here; blocks on
    the meta device are compared once materialised (``ChunkStorage``)."""
    for name, m in blocks[0].named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            raise ValueError(
                f"block module {name!r} is a {type(m).__name__} that tracks running statistics: its forward changes "
                "its buffers, but tawpipe runs every layer with one copy of the blocks' buffers (constants) and runs "
                f"forwards again to recompute; build it with track_running_stats=False, or use LayerNorm or RMSNorm"
            )
    first = [(n, tuple(t.shape), t.dtype) for n, t in blocks[0].named_buffers()]
    for i, b in enumerate(blocks[1:], 1):
        if [(n, tuple(t.shape), t.dtype) for n, t in b.named_buffers()] != first:
            raise ValueError(f"block {i} differs in structure from block 0 (buffer names, shapes or dtypes); "
                             "tawpipe chunks a stack of identical blocks")
    check_same_buffers(blocks, range(len(blocks)))


def check_same_buffers(blocks: Sequence[nn.Module], layers: Iterable[int]) -> None:
    """Every real block's buffers equal the first real one's (meta ones are skipped); ``layers``
    are the blocks' layer numbers, for the message."""
    ref: tuple[int, dict[str, torch.Tensor]] | None = None
    for i, b in zip(layers, blocks):
        mine = dict(b.named_buffers())
        if any(t.is_meta for t in mine.values()):
            continue
        if ref is None:
            ref = (i, mine)
            continue
        for n, t in mine.items():
            if not torch.equal(t, ref[1][n].to(t.device)):
                raise ValueError(
                    f"block {i}'s buffer {n!r} differs from block {ref[0]}'s: tawpipe runs every layer with one copy "
                    "of the blocks' buffers, so they must be constants every block has alike (rotary tables, masks); "
                    f"make a per-layer value a frozen parameter (nn.Parameter(tensor, requires_grad=False)), or pass "
                    "it through block_context"
                )


def check_shared_with_replicated(blocks: list[nn.Module], embed: nn.Module, head: nn.Module,
                                 names: tuple[str, str, str]) -> None:
    """No block parameter is also the embedding's or the head's: blocks are sharded over the ranks
    and embed and head replicated on every rank, so a weight in both would be two copies that
    train apart (silently untied)."""
    replicated = {id(p): (part, n) for part, module in ((names[0], embed), (names[2], head))
                  for n, p in module.named_parameters(remove_duplicate=False)}
    for i, b in enumerate(blocks):
        for n, p in b.named_parameters():
            if id(p) in replicated:
                part, m = replicated[id(p)]
                raise ValueError(
                    f"{names[1]}[{i}] parameter {n!r} is also {part} parameter {m!r}: tawpipe shards the blocks over "
                    f"the ranks and replicates {names[0]} and {names[2]} on every rank, so a weight shared between a "
                    f"block and {part} cannot stay tied (its two copies would train apart); keep the shared weight in "
                    f"{part} only, or give the block its own copy (nn.Parameter(p.detach().clone())) if it may train "
                    "apart"
                )


def check_callables(**kwargs: Any) -> None:
    for name, value in kwargs.items():
        if name in ("embed", "head"):
            if not isinstance(value, nn.Module) or not list(value.parameters()):
                raise TypeError(f"{name} must be an nn.Module with parameters, got {type(value).__name__}")
        elif value is not None and not callable(value):
            raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        elif value is None and name in ("loss_fn", "optimizer"):
            raise TypeError(f"{name} is required")


def check_model(model: ModelParts, topology: Topology, optimizer: Any, lr_scheduler: Any) -> list[nn.Module]:
    """The model's parts and the factories the engine will call; the blocks, as a list."""
    if not isinstance(model, ModelParts):
        raise TypeError(f"model must be a tawpipe.models.ModelParts (blocks, embed, head, loss_fn and the hooks), "
                        f"got {type(model).__name__}: wrap your modules in ModelParts(blocks, embed, head, loss_fn)")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a tawpipe.Topology, got {type(topology).__name__}")
    names = model.names
    if not (isinstance(names, tuple) and len(names) == 3 and all(isinstance(n, str) and n for n in names)):
        raise ValueError(f"names must be three non-empty strings (embed, blocks, head), got {names!r}")
    blocks = list(model.blocks)
    check_blocks(blocks)
    check_callables(embed=model.embed, head=model.head, loss_fn=model.loss_fn, optimizer=optimizer,
                    lr_scheduler=lr_scheduler, block_forward=model.block_forward, block_context=model.block_context,
                    materialize=model.materialize, head_loss=model.head_loss, sliced_context=model.sliced_context)
    check_shared_with_replicated(blocks, model.embed, model.head, names)
    return blocks


def check_policies(model: ModelParts, topology: Topology, schedule: SchedulePolicy, memory: MemoryPolicy,
                   comm: CommPolicy) -> None:
    """What the policies ask of each other, of the model and of the topology; before any backend
    is built."""
    if schedule.replicas > 1 and not comm.supports_replicas():
        raise ValueError(f"replicas={schedule.replicas} needs comm='torch' (NCCL through torch.distributed on GPUs): "
                         f"the {comm.backend!r} backend has no communicators across replicas yet")
    if 1 < schedule.context_parallel < topology.per_node and not comm.supports_replicas():
        raise ValueError(f"context_parallel={schedule.context_parallel} on nodes of {topology.per_node} ranks needs "
                         f"comm='torch': the {comm.backend!r} backend has no communicators over groups smaller than "
                         f"a node yet (context_parallel={topology.per_node} uses the node's own)")
    if schedule.context_parallel > 1 and model.sliced_context is None:
        raise ValueError(f"context_parallel={schedule.context_parallel}: {model.description or 'this model'} has no "
                         "sliced_context (the block context of a slice of the sequence, whose attention gathers the "
                         "whole sequence's keys and values through the SequenceSlice it is given); give ModelParts "
                         "one, or leave context_parallel at 1")
    if memory.chunked_loss and model.head_loss is None:
        raise ValueError(f"chunked_loss: {model.description or 'this model'} has no head_loss (a head and loss that "
                         "never hold the whole logits); give ModelParts one, or leave chunked_loss off")


def check_trainable(plan: Plan, blocks: list[nn.Module], replicated: list[tuple[str, nn.Parameter]],
                    optimizer: Any) -> None:
    """Something trains; and where a rank's share trains nothing (its chunk's blocks and the
    replicated modules all frozen), its optimizer is built over no parameters, so the factory must
    take an empty list (``torch.optim.AdamW([])`` raises): asked here, once, before anything is sent."""
    trains = lambda params: any(p.requires_grad for p in params)  # noqa: E731
    if not trains(p for b in blocks for p in b.parameters()) and not trains(p for _, p in replicated):
        raise ValueError("every parameter of the model has requires_grad=False: there is nothing to train; "
                         "unfreeze the parameters to train (p.requires_grad_(True))")
    if trains(p for _, p in replicated):
        return
    idle = []
    for rank in range(plan.topology.world_size):
        start, stop = plan.chunk_layers[plan.own_chunk(rank)]
        if not trains(p for b in blocks[start:stop] for p in b.parameters()):
            idle.append(rank)
    if idle:
        try:
            optimizer([])
        except Exception as e:
            raise ValueError(
                f"rank(s) {idle} train nothing: every parameter of their chunk's layers and of the embedding and "
                f"head has requires_grad=False, so their optimizer is given no parameters, but optimizer([]) "
                f"raised {e!r}: make the factory take an empty list (as default_optimizer does, or "
                "lambda params: torch.optim.AdamW([{'params': params}], ...)), or unfreeze a parameter of the "
                "embedding or head"
            ) from e


def check_optimizer(optimizer: Any) -> None:
    """What the optimizer factory returned is an optimizer."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a factory that returns a torch.optim.Optimizer of the parameters it is given "
            f"(e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)), but it returned "
            f"{type(optimizer).__name__}: return the optimizer it builds"
        )


def check_scheduler(scheduler: Any, factory: Any) -> None:
    """What the scheduler factory returned (if one was given) is a learning-rate scheduler."""
    if factory is not None and not all(callable(getattr(scheduler, m, None))
                                       for m in ("step", "state_dict", "load_state_dict")):
        raise TypeError(
            f"lr_scheduler must be a factory that returns a learning-rate scheduler of the optimizer it is given "
            f"(with step(), state_dict() and load_state_dict(), e.g. lambda opt: torch.optim.lr_scheduler."
            f"StepLR(opt, 100)), but it returned {type(scheduler).__name__}"
        )


# A plan holds a forward and a backward of every chunk for every micro-batch on every rank of a
# replica (2 x (N/R)^2 x micro_batches actions) plus the transfers: past a million of the former
# it takes minutes and gigabytes to build (one replica's ranks' actions are built).
MAX_PLAN_COMPUTE_ACTIONS = 1_000_000


def check_micro_batches(topology: Topology, micro_batches: Any, replicas: Any) -> None:
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


def resolve_device(device: Any) -> torch.device:
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
    check_current(dev, torch.accelerator.current_device_index())
    return dev


def check_current(dev: torch.device, current: int) -> None:
    """The engine's device is the process's current one: the engine orders its work after what
    the caller queued on the current stream, which is the current device's (a ValueError naming
    the call that makes it so)."""
    if dev.index != current:
        raise ValueError(f"device={str(dev)!r} is not this process's current {dev.type} device ({dev.type}:{current}): "
                         f"the engine orders its streams after the current device's; call "
                         f"torch.accelerator.set_device_index({dev.index}) (torch.cuda.set_device) before building it, "
                         "as a torchrun worker does with its LOCAL_RANK")


def check_replicated(embed: nn.Module, head: nn.Module, names: tuple[str, str, str],
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


def find_vocab(embed: nn.Module) -> int | None:
    """The number of token ids the first nn.Embedding inside ``embed`` takes (None: there is none)."""
    return next((m.num_embeddings for m in embed.modules() if isinstance(m, nn.Embedding)), None)


def find_classes(head: nn.Module) -> int | None:
    """The number of classes the last nn.Linear inside ``head`` scores (None: there is none)."""
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else None


def check_tokens(inputs: torch.Tensor, targets: torch.Tensor, what: str, device: torch.device, vocab: int | None,
                 classes: int | None) -> None:
    """``inputs`` are 2-D integer token ids inside the embedding's vocabulary and ``targets``
    match them: a clear error here rather than a deep one inside the step, which would leave the
    engine failed. The rule is what torch's own modules take: inputs int64 or int32 (nn.Embedding
    takes both), targets of the inputs' shape int64 class indices (cross_entropy takes no other
    integer dtype), below the head's classes where they are known (its last nn.Linear's outputs,
    which are the vocabulary in a language model, but may be more or fewer); negative targets (an
    ignore_index) and targets with more dimensions (class probabilities) are ``loss_fn``'s business."""
    for name, t in (("inputs", inputs), ("targets", targets)):
        if t.device.type != device.type and t.device.type != "cpu":
            raise ValueError(f"{what}: {name} is on {t.device}; pass CPU tensors or tensors on {device}")
    if inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
        raise TypeError(f"{what}: inputs are {inputs.dtype}, but they must be token ids of an integer dtype "
                        "(torch.int64): convert them with inputs.long()")
    if vocab is not None and inputs.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what}: inputs are {inputs.dtype}, but the embedding (nn.Embedding) takes token ids "
                        "of torch.int64 or torch.int32: convert them with inputs.long()")
    if inputs.dim() != 2 or inputs.shape[1] == 0:
        hint = {1: ": one row? pass inputs[None]", 3: ": drop the last dimension"}.get(inputs.dim(), "")
        raise ValueError(f"{what}: inputs have shape {tuple(inputs.shape)}, but they must be 2-D token ids "
                         f"(rows, seq_len) with seq_len >= 1{hint}")
    if targets.shape[:2] != inputs.shape:
        raise ValueError(f"{what}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in shape: "
                         "targets must be (rows, seq_len) like the inputs, one target per input token")
    if targets.dim() == 2 and targets.dtype != torch.int64:
        raise TypeError(
            f"{what}: targets are {targets.dtype}, but targets shaped like the inputs (rows, seq_len) are class "
            "indices (the next tokens), which cross_entropy takes as torch.int64 only: convert them with "
            "targets.long() (targets of class probabilities have a class dimension: (rows, seq_len, classes))"
        )
    if vocab is not None and inputs.numel():
        lo, hi = (int(v) for v in torch.aminmax(inputs))
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"{what}: inputs hold token id {lo if lo < 0 else hi}, outside the vocabulary of the embedding "
                f"(nn.Embedding with {vocab} ids: 0 to {vocab - 1}); check the tokenizer against "
                "the model's vocabulary size"
            )
    if classes is not None and targets.dim() == 2 and targets.numel():
        hi = int(targets.max())
        if hi >= classes:
            raise ValueError(
                f"{what}: targets hold class {hi}, outside the classes the head scores (its last nn.Linear has "
                f"{classes} outputs: 0 to {classes - 1}); in a language model they are the next tokens, so check the "
                "tokenizer against the model's vocabulary size (negative targets, such as cross_entropy's "
                "ignore_index -100, are left to loss_fn)"
            )
