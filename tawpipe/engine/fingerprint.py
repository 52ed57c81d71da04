"""What every rank must agree on before the first step, and the check that they do.

Ranks that disagree fail in ways that are hard to read, or not at all: a bf16 rank and an fp16
rank silently reinterpret each other's weights; ranks built from different seeds train diverging
replicated embeddings; a rank with other micro-batches or another route waits for a transfer
that never comes. So the engine exchanges one row of numbers per rank (the plan's CHECK action)
and every rank compares every row with rank 0's, naming the first rank and field that differ.
The schedule options are compared as the plan holds them, after ``"auto"`` chose them on each
rank from its own free memory: ranks that chose differently are told so.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch
import torch.nn as nn

from ..models.parts import param_signature
from ..plan.plan import Plan

_MASK = (1 << 63) - 1
_CHOSEN = ("prefetch_depth", "mb_per_fetch", "reuse_weights")  # "auto" chooses them on each rank


def _digest(*parts: object) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p if isinstance(p, bytes) else repr(p).encode())
    return int.from_bytes(h.digest(), "little") & _MASK


def _checksum(params: Sequence[tuple[str, nn.Parameter]]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for _, p in params:
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") & _MASK


def state_digest(state: object) -> int:
    """A digest of a state (a scheduler's, an optimizer's groups...) that is equal on every rank for
    equal states: objects other than plain data (functions, say) count by their type only, never by
    a repr that holds a memory address."""
    def plain(x: object) -> object:
        if isinstance(x, dict):
            return [(plain(k), plain(v)) for k, v in x.items()]
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if torch.is_tensor(x):
            return ("tensor", x.detach().cpu().tolist())
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, (torch.dtype, torch.device)):
            return str(x)
        return type(x).__qualname__

    return _digest(plain(state))


def _optimizer(opt: torch.optim.Optimizer) -> str:
    # hyper-parameters only: the own chunk's parameter count differs between ranks (uneven chunks)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return type(opt).__name__ + json.dumps(groups, sort_keys=True, default=repr)


def fields(plan: Plan, *, compute_dtype: torch.dtype, grad_dtype: torch.dtype, block: nn.Module,
           replicated: Sequence[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer,
           precision: dict, recompute: str, context_parallel: int = 1, trainable: object = (),
           buffers: dict[str, torch.Tensor] | None = None) -> list[tuple[str, int, str]]:
    """(field, value, readable value) in the order mismatches are reported: integers as they are,
    everything else as a 63-bit digest. ``trainable``: which parameters train (each chunk's
    requires_grad, the replicated ones'); ``buffers``: the blocks' buffers as the runners hold them."""
    o = plan.options
    rows = [
        ("algo", _digest(plan.algo), plan.algo),
        ("topology", _digest(plan.topology), f"{plan.topology.nodes}x{plan.topology.per_node}"),
        ("num_layers", plan.num_layers, str(plan.num_layers)),
        ("micro_batches", plan.micro_batches, str(plan.micro_batches)),
        ("replicas", plan.replicas, str(plan.replicas)),
        ("grad_route", _digest(o.get("grad_route")), str(o.get("grad_route"))),
        ("prefetch_depth", int(o["prefetch_depth"]), str(o["prefetch_depth"])),
        ("mb_per_fetch", int(o["mb_per_fetch"]), str(o["mb_per_fetch"])),
        ("reuse_weights", _digest(o["reuse_weights"]), str(o["reuse_weights"])),
        ("compute_dtype", _digest(str(compute_dtype)), str(compute_dtype)),
        ("grad_wire_dtype", _digest(str(grad_dtype)), str(grad_dtype)),
        ("block parameters", _digest(param_signature(block.named_parameters())), "names, shapes, dtypes"),
        ("replicated parameters", _digest(param_signature(replicated)), "names, shapes, dtypes"),
        ("replicated weights", _checksum(replicated), "values (same seed?)"),
        ("trainable parameters", _digest(trainable), "which parameters have requires_grad"),
        ("block buffers", _checksum(sorted((buffers or {}).items())), "values"),
        ("optimizer", _digest(_optimizer(optimizer)), "type and hyper-parameters"),
        ("precision", _digest(sorted(precision.items())), "loss scaling, clipping, nonfinite"),
        ("recompute", _digest(recompute), recompute),
        ("context_parallel", context_parallel, str(context_parallel)),
        ("plan", _digest(plan.algo, plan.topology, plan.num_layers, plan.micro_batches, plan.chunk_layers,
                         plan.owner, plan.num_slots, sorted(o.items())), "the plan's parameters"),
    ]
    return rows


def compare(table: list[list[int]], mine: Sequence[tuple[str, int, str]], rank: int) -> None:
    """Raise ValueError naming the first rank and field that differ from rank 0's (every rank
    sees the same table, one row per rank, so every rank raises the same error)."""
    for r in range(1, len(table)):
        for j, (name, _, readable) in enumerate(mine):
            if table[r][j] != table[0][j]:
                shown = auto = ""
                if name in ("num_layers", "micro_batches", "replicas", "context_parallel", *_CHOSEN):
                    shown = f" (rank 0: {table[0][j]}, rank {r}: {table[r][j]})"
                if name in _CHOSEN or name == "recompute":
                    left = "left \"auto\" (the default)" if name in _CHOSEN else "\"auto\""
                    auto = (f"; where it is {left}, each rank chooses within its own free memory: give every "
                            f"rank the same MemoryPolicy.budget (tawpipe train --memory-budget), or {name}")
                raise ValueError(
                    f"rank {r} disagrees with rank 0 on {name}{shown}: every rank must build the "
                    f"engine with the same arguments and the same initial model (same seed); this is "
                    f"rank {rank}, whose {name} is {readable}{auto}"
                )
