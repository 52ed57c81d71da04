"""Validation loss with the engine's current weights, leaving its state untouched.

Every chunk is broadcast from its owner to all ranks, in model order, into one of the engine's
own weight staging buffers (idle between steps); every rank runs its own batch through it and the
mean loss is all-reduced. This is one forward pass of the weight pipeline with a single world
broadcast per chunk; it runs between steps, outside the plan, on torch.distributed's default group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.func import functional_call

if TYPE_CHECKING:
    from .engine import TawPipe


@torch.no_grad()
def validation_loss(engine: TawPipe, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean of ``loss_fn`` over this rank's ``batches`` and every other rank's (same count each)."""
    if not batches:
        raise ValueError("validation_loss needs at least one (inputs, targets) batch")
    s, plan, world = engine.storage, engine.plan, engine.topology.world_size
    if world > 1 and not dist.is_initialized():
        raise RuntimeError("validation_loss needs torch.distributed initialised (torchrun or run_local)")
    compute = engine.compute
    buf = next(b for b in sorted(s.bufs) if b.startswith("w"))
    inputs = [x.to(engine.device) for x, _ in batches]
    ctx = [engine.block_context(x) if engine.block_context else {} for x in inputs]
    hidden = [compute.embed(x).to(s.compute_dtype) for x in inputs]
    for k in plan.model_order:
        if engine.rank == plan.owner[k]:
            s.load_master(buf, k)
        weights = s.chunk(buf, k)
        if world > 1:
            dist.broadcast(weights, plan.owner[k])
        n = s.layers(k)
        params = {f"blocks.{name}": v for name, v in zip(s.layouts[n].names, s.layouts[n].views(weights))}
        hidden = [functional_call(s.runners[n], params, (h, c)) for h, c in zip(hidden, ctx)]
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    with compute._autocast():
        for h, (_, y) in zip(hidden, batches):
            total += compute.loss_fn(compute.head(h), y.to(engine.device)).double()
    if world > 1:
        dist.all_reduce(total)
    return total.item() / (world * len(batches))
